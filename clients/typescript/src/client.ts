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
   * Its priority, an integer from -10 to 10 (default 0): the queue's workers take the waiting
   * command of the highest priority first, in submit order among equal ones (strict: a flood of
   * higher priorities holds lower ones back until it drains).
   */
  priority?: number;
  signal?: AbortSignal;
}

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

/**
 * The commands API of `baton serve`: submit, get, wait, cancel.
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
   *   for `type`), `invalid_params`, `invalid_id`; `409 conflict` (the id exists with another
   *   type, params or queue); `413 body_too_large`; `503` (backend unavailable).
   */
  async submit(queue: string, type: string, params?: unknown, options: SubmitOptions = {}): Promise<CommandState> {
    return (await this.submitDetailed(queue, type, params, options)).state;
  }

  /** {@link BatonClient.submit}, also telling whether the command is new (`202`) or was already there (`200`). */
  async submitDetailed(queue: string, type: string, params?: unknown, options: SubmitOptions = {}): Promise<SubmitResult> {
    let body = `{"type":${JSON.stringify(type)}`;
    if (options.id !== undefined) body += `,"id":${JSON.stringify(options.id)}`;
    if (params !== undefined) body += `,"params":${jsonText(params)}`;
    if (options.output !== undefined) body += `,"output":${JSON.stringify(options.output)}`;
    body += dueFields(options.runAt, options.delay, false);
    if (options.priority !== undefined) body += `,"priority":${JSON.stringify(options.priority)}`;
    body += "}";
    const res = await requestJson(this.#endpoint, "POST", `/v1/queues/${enc(queue)}/commands`, {
      body,
      signal: options.signal,
    });
    return { created: res.status === 202, state: res.body as CommandState };
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
