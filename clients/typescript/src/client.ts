import { BatonError } from "./errors.js";
import { duration, requestJson, sleep, type Endpoint } from "./http.js";
import { isTerminal, jsonText, type CommandState } from "./types.js";

/** Options of {@link BatonClient}. */
export interface BatonClientOptions {
  /** Base URL of `baton serve`, e.g. `http://127.0.0.1:7700`. */
  url: string;
  /** Bearer token (operations `read` for get/wait, `write` for submit/cancel). */
  token?: string;
  /**
   * Longest single `?wait=` of {@link BatonClient.wait}, in milliseconds (default 240000 = 4 min;
   * at most 300000, the server's limit). Node's fetch gives up on an answer whose head takes
   * longer than 300 s, so the default stays under that.
   */
  maxWaitChunkMs?: number;
}

/** What {@link BatonClient.submitDetailed} answers. */
export interface SubmitResult {
  /** `true`: a new command (`202`); `false`: the same id was already submitted with the same type and params (`200`). */
  created: boolean;
  /** The command's state (for `created: false`, the stored one, whatever its status). */
  state: CommandState;
}

/** Options of {@link BatonClient.submit}. */
export interface SubmitOptions {
  /**
   * The command's id (1 to 128 bytes, see the server's rules). Resubmitting an id with the same
   * type and params is idempotent; with other ones it is `409 conflict`. Default: the server
   * generates one.
   */
  id?: string;
  /**
   * Gives the command an output stream (`state.output`): created at submit, written by its
   * handler, ended with the command. `true` for the defaults, or any of `path`, `content_type`,
   * `silence_timeout` (e.g. `"60s"`). Part of the request: a resubmit of the id with another
   * `output` is `409 conflict`.
   */
  output?: boolean | { path?: string; content_type?: string; silence_timeout?: string };
  /**
   * Schedules the command: stored now (`SUBMITTED`, `state.run_at` set), its handler not called
   * before this time (a `Date` or an RFC 3339 string); a time not in the future runs at once.
   * Part of the request: a resubmit of the id with another `runAt` is `409 conflict`.
   */
  runAt?: Date | string;
  /** Schedules it this many milliseconds from now (or a string like `"10m"`); not with `runAt`. */
  delay?: number | string;
  /**
   * Its concurrency key, sent as `concurrency_key`: a string of 1 to 256 bytes without control
   * characters, stored in the state (`state.concurrency_key`). On a queue configured with
   * `concurrency_per_key = N`, at most N commands of one key run at once (across every worker),
   * the others waiting and starting in submit order as those end; elsewhere it is only stored.
   * Not part of the idempotent body (a resubmit of the id returns the stored command whatever
   * key it asks). Empty, over 256 bytes or with a control character: `400 invalid_body`.
   */
  concurrencyKey?: string;
  /**
   * Its priority, an integer from -10 to 10 (default 0): the queue's workers take the waiting
   * command of the highest priority first, in submit order among equal ones (strict: a flood of
   * higher priorities holds lower ones back until it drains).
   */
  priority?: number;
  signal?: AbortSignal;
}

/**
 * One command of {@link BatonClient.submitMany}: its `type`, `params` (any JSON value, or
 * {@link RawJson}; omitted: none) and the options of {@link BatonClient.submit} but `signal`
 * (`id`, `output`, `runAt`, `delay`, `concurrencyKey`, `priority`: same meaning, same defaults).
 */
export interface SubmitItem extends Omit<SubmitOptions, "signal"> {
  type: string;
  params?: unknown;
}

/**
 * One outcome of {@link BatonClient.submitMany}: `{created, state}` for a stored command (`202`
 * new, `200` already there), or the item's {@link BatonError} (`status`, `code`, `message`).
 */
export type SubmitManyOutcome = SubmitResult | BatonError;

/**
 * The most commands the server takes in one batch request; {@link BatonClient.submitMany} sends
 * a longer list as several requests of at most this many.
 */
export const MAX_BATCH = 1000;

/** Options of {@link BatonClient.wait}. */
export interface WaitOptions {
  /** How long to wait in total, in milliseconds (default: no limit). */
  timeoutMs?: number;
  /** Aborts the wait: it rejects with the signal's reason. */
  signal?: AbortSignal;
}

const SERVER_MAX_WAIT_MS = 300_000;

function enc(part: string): string {
  return encodeURIComponent(part);
}

/** The `run_at` / `delay` fields of a body (`,"run_at":…`), or "" for neither. */
function dueFields(runAt: Date | string | undefined, delay: number | string | undefined, required: boolean): string {
  if (runAt !== undefined && delay !== undefined) throw new TypeError("give runAt or delay, not both");
  if (runAt !== undefined) {
    const t = runAt instanceof Date ? runAt.toISOString() : runAt;
    return `,"run_at":${JSON.stringify(t)}`;
  }
  if (delay !== undefined) {
    if (typeof delay === "number" && !(Number.isInteger(delay) && delay >= 0)) {
      throw new RangeError("delay must be a whole number of milliseconds >= 0, or a string like \"30s\"");
    }
    return `,"delay":${JSON.stringify(delay)}`;
  }
  if (required) throw new TypeError("give runAt or delay");
  return "";
}

/** The JSON body of one submit (also one item of a batch). */
function commandBody(type: string, params: unknown, options: Omit<SubmitOptions, "signal">): string {
  let body = `{"type":${JSON.stringify(type)}`;
  if (options.id !== undefined) body += `,"id":${JSON.stringify(options.id)}`;
  if (params !== undefined) body += `,"params":${jsonText(params)}`;
  if (options.output !== undefined) body += `,"output":${JSON.stringify(options.output)}`;
  body += dueFields(options.runAt, options.delay, false);
  if (options.concurrencyKey !== undefined) body += `,"concurrency_key":${JSON.stringify(options.concurrencyKey)}`;
  if (options.priority !== undefined) body += `,"priority":${JSON.stringify(options.priority)}`;
  return body + "}";
}

const ITEM_KEYS = ["type", "params", "id", "output", "runAt", "delay", "concurrencyKey", "priority"];

/** The JSON text of `items[index]` of a batch, or a TypeError naming the index. */
function itemBody(item: SubmitItem, index: number): string {
  if (item === null || typeof item !== "object" || Array.isArray(item)) {
    throw new TypeError(`submitMany: items[${index}] must be an object like {type: "resize", params: {...}}`);
  }
  const unknown = Object.keys(item).filter((k) => !ITEM_KEYS.includes(k));
  if (unknown.length > 0) {
    throw new TypeError(
      `submitMany: items[${index}] has unknown key(s) ${unknown.join(", ")}; an item has only ${ITEM_KEYS.join(", ")}`,
    );
  }
  if (typeof item.type !== "string") {
    throw new TypeError(`submitMany: items[${index}] needs a string type, got ${describeBody(item.type)}`);
  }
  try {
    return commandBody(item.type, item.params, item);
  } catch (err) {
    const message = err instanceof Error ? err.message : String(err);
    throw new TypeError(`submitMany: items[${index}]: ${message}`, { cause: err });
  }
}

/** One element of a batch answer's `results`: `{created, state}` or the item's error. */
function batchOutcome(httpStatus: number, index: number, result: unknown): SubmitManyOutcome {
  const r = (result !== null && typeof result === "object" ? result : {}) as {
    status?: unknown;
    state?: unknown;
    error?: unknown;
    message?: unknown;
  };
  const state = r.state !== null && typeof r.state === "object" ? (r.state as CommandState) : undefined;
  if ((r.status === 200 || r.status === 202) && state !== undefined) return { created: r.status === 202, state };
  if (typeof r.status === "number" && r.status >= 400 && typeof r.error === "string") {
    const message = typeof r.message === "string" ? r.message : r.error;
    return new BatonError(r.status, r.error, message, { body: result, state });
  }
  throw new BatonError(
    httpStatus,
    "invalid_response",
    `results[${index}] of the batch answer is neither {status: 200|202, state} nor {status: >=400, error, message}: ${describeBody(result)}`,
    { body: result },
  );
}

/** A value in a message: its JSON, cut to 200 characters. */
function describeBody(value: unknown): string {
  let text: string;
  try {
    text = JSON.stringify(value) ?? String(value);
  } catch {
    text = String(value);
  }
  return text.length > 200 ? `${text.slice(0, 200)}…` : text;
}

/**
 * The commands API of `baton serve`: submit (one or many), get, wait, cancel.
 *
 * Every method rejects with a {@link BatonError} on an error answer (`status`, `code`,
 * `message`) or when no answer came (`status` 0, `code` `"network_error"`).
 *
 * ```ts
 * const baton = new BatonClient({ url: "http://127.0.0.1:7700" });
 * const { id } = await baton.submit("jobs", "resize", { image: "a.png" });
 * const state = await baton.wait(id, { timeoutMs: 60_000 });
 * ```
 */
export class BatonClient {
  readonly #endpoint: Endpoint;
  readonly #maxWaitChunkMs: number;

  constructor(options: BatonClientOptions) {
    if (!options || typeof options.url !== "string" || options.url === "") {
      throw new TypeError("BatonClient: `url` is required, e.g. http://127.0.0.1:7700");
    }
    this.#endpoint = { url: options.url, token: options.token };
    const chunk = options.maxWaitChunkMs ?? 240_000;
    if (!(chunk > 0 && chunk <= SERVER_MAX_WAIT_MS)) {
      throw new RangeError(`BatonClient: maxWaitChunkMs must be in (0, ${SERVER_MAX_WAIT_MS}]`);
    }
    this.#maxWaitChunkMs = chunk;
  }

  /**
   * Submits a command to `queue` (`POST /v1/queues/{queue}/commands`) and resolves with its
   * state (`SUBMITTED` for a new one).
   *
   * @param params any JSON value (or {@link RawJson} for exact text); omitted: no params.
   * @throws {BatonError} `404 unknown_queue`; `400 unknown_type` (a queue with handlers and none
   *   for `type`), `invalid_params`, `invalid_id`, `invalid_body` (e.g. a bad `priority` or
   *   `concurrencyKey`); `409 conflict` (the id exists with another
   *   type, params or queue); `413 body_too_large`; `503` (backend unavailable).
   */
  async submit(queue: string, type: string, params?: unknown, options: SubmitOptions = {}): Promise<CommandState> {
    return (await this.submitDetailed(queue, type, params, options)).state;
  }

  /** {@link BatonClient.submit}, also telling whether the command is new (`202`) or was already there (`200`). */
  async submitDetailed(queue: string, type: string, params?: unknown, options: SubmitOptions = {}): Promise<SubmitResult> {
    const body = commandBody(type, params, options);
    const res = await requestJson(this.#endpoint, "POST", `/v1/queues/${enc(queue)}/commands`, {
      body,
      signal: options.signal,
    });
    return { created: res.status === 202, state: res.body as CommandState };
  }

  /**
   * Submits several commands to `queue` at once (`POST /v1/queues/{queue}/commands/batch`).
   * Each item is decided on its own, as {@link BatonClient.submitDetailed} of it would be (same
   * rules, idempotence and errors): one item's error does not stop the others.
   *
   * More than {@link MAX_BATCH} (1000) items are sent as several requests of at most 1000, one
   * after the other, and their outcomes joined in order. An empty list sends nothing.
   *
   * @returns one outcome per item, in the order of `items`: `{created, state}` as
   *   {@link BatonClient.submitDetailed} answers, or the {@link BatonError} that it would have
   *   thrown for that item (e.g. `409 conflict`, `400 unknown_type`), returned and not thrown
   *   (its `body` is the item's error object). Tell them apart with `instanceof BatonError`.
   * @throws {TypeError} an item that is not an object with a string `type`, has an unknown key,
   *   both `runAt` and `delay`, or params not representable as JSON (naming its index; nothing is
   *   sent).
   * @throws {BatonError} for the request itself: `404 unknown_queue`, `400 invalid_json` /
   *   `invalid_body`, `413` (the items' JSON is over the server's limit), `401`/`403`, `503`, no
   *   answer (status 0). With more than 1000 items, the requests before the failed one were
   *   stored (their outcomes are lost; resubmitting items with an `id` is idempotent).
   */
  async submitMany(
    queue: string,
    items: readonly SubmitItem[],
    options: { signal?: AbortSignal } = {},
  ): Promise<SubmitManyOutcome[]> {
    if (!Array.isArray(items)) throw new TypeError("submitMany: items must be an array of {type, params?, id?, ...}");
    const bodies = items.map((item, i) => itemBody(item, i));
    const outcomes: SubmitManyOutcome[] = [];
    for (let at = 0; at < bodies.length; at += MAX_BATCH) {
      const chunk = bodies.slice(at, at + MAX_BATCH);
      const res = await requestJson(this.#endpoint, "POST", `/v1/queues/${enc(queue)}/commands/batch`, {
        body: `{"commands":[${chunk.join(",")}]}`,
        signal: options.signal,
      });
      const results = (res.body as { results?: unknown } | null)?.results;
      if (!Array.isArray(results) || results.length !== chunk.length) {
        const got = Array.isArray(results) ? `${results.length} results` : `no results list: ${describeBody(res.body)}`;
        throw new BatonError(res.status, "invalid_response", `the batch answer has ${got} for ${chunk.length} commands`, {
          body: res.body,
        });
      }
      results.forEach((r, i) => outcomes.push(batchOutcome(res.status, at + i, r)));
    }
    return outcomes;
  }

  /**
   * Moves the due time of a scheduled command still waiting for it
   * (`POST /v1/commands/{id}/schedule`): exactly one of `runAt` and `delay` (ms, or `"30s"`).
   *
   * @throws {BatonError} `404 not_found`; `409 not_scheduled` (it no longer waits: enqueued,
   *   started or ended); `400 invalid_body`.
   */
  async reschedule(
    id: string,
    due: { runAt?: Date | string; delay?: number | string; signal?: AbortSignal },
  ): Promise<CommandState> {
    const body = `{${dueFields(due.runAt, due.delay, true).slice(1)}}`;
    const res = await requestJson(this.#endpoint, "POST", `/v1/commands/${enc(id)}/schedule`, {
      body,
      signal: due.signal,
    });
    return res.body as CommandState;
  }

  /**
   * The command's current state (`GET /v1/commands/{id}`).
   *
   * @throws {BatonError} `404 not_found` (unknown or expired), `400` (a malformed id).
   */
  async get(id: string, options: { signal?: AbortSignal } = {}): Promise<CommandState> {
    const res = await requestJson(this.#endpoint, "GET", `/v1/commands/${enc(id)}`, { signal: options.signal });
    return res.body as CommandState;
  }

  /**
   * Waits until the command is final (`SUCCEEDED`, `FAILED` or `CANCELLED`) or `timeoutMs`
   * passes, and resolves with its latest state: check `status` (or {@link isTerminal}) to tell a
   * timeout. Long-polls `GET /v1/commands/{id}?wait=` in chunks of at most `maxWaitChunkMs`;
   * `503` answers (no live-reader slot) are retried after their `Retry-After`.
   *
   * @throws {BatonError} `404 not_found`; the signal's reason when `signal` aborts.
   */
  async wait(id: string, options: WaitOptions = {}): Promise<CommandState> {
    const timeoutMs = options.timeoutMs ?? Number.POSITIVE_INFINITY;
    if (!(timeoutMs >= 0)) throw new RangeError("wait: timeoutMs must be >= 0");
    const deadline = Date.now() + timeoutMs;
    for (;;) {
      const remaining = deadline - Date.now();
      const chunk = Math.min(remaining, this.#maxWaitChunkMs);
      const path =
        chunk >= 1 ? `/v1/commands/${enc(id)}?wait=${duration(Math.floor(chunk))}` : `/v1/commands/${enc(id)}`;
      let state: CommandState;
      try {
        state = (await requestJson(this.#endpoint, "GET", path, { signal: options.signal })).body as CommandState;
      } catch (err) {
        if (err instanceof BatonError && err.status === 503 && deadline - Date.now() > 0) {
          await sleep(Math.min(err.retryAfterMs ?? 1000, Math.max(0, deadline - Date.now())), options.signal);
          continue;
        }
        throw err;
      }
      if (isTerminal(state) || Date.now() >= deadline || chunk < 1) return state;
    }
  }

  /**
   * Cancels the command (`POST /v1/commands/{id}/cancel`) and resolves with its `CANCELLED`
   * state; a handler running it is signalled.
   *
   * A command that is already final is not changed: this rejects with a {@link BatonError}
   * `409` code `"already_terminal"` whose `state` is the command's unchanged state
   * (`SUCCEEDED`, `FAILED`, or `CANCELLED` by an earlier cancel).
   *
   * @throws {BatonError} `409 already_terminal` (see above), `404 not_found`.
   */
  async cancel(id: string, options: { signal?: AbortSignal } = {}): Promise<CommandState> {
    const res = await requestJson(this.#endpoint, "POST", `/v1/commands/${enc(id)}/cancel`, {
      signal: options.signal,
    });
    return res.body as CommandState;
  }
}
