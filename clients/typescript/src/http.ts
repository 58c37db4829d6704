// One JSON request to `baton serve`, used by the client, the worker and the renewer thread
// (each thread has its own module instance, hence its own global fetch and connection pool).
import { BatonError } from "./errors.js";
import type { CommandState } from "./types.js";

/** How to reach a server. */
export interface Endpoint {
  /** Base URL, e.g. `http://127.0.0.1:7700` (a trailing `/` is ignored). */
  url: string;
  /** Bearer token, sent as `Authorization: Bearer <token>`. */
  token?: string | undefined;
}

/** An answer with a 2xx status. */
export interface JsonResponse {
  status: number;
  body: unknown;
}

/** `Retry-After` (delay-seconds or an HTTP date) in milliseconds, or undefined. */
export function parseRetryAfter(value: string | null): number | undefined {
  if (value === null || value.trim() === "") return undefined;
  const seconds = Number(value.trim());
  if (Number.isFinite(seconds)) return Math.max(0, seconds * 1000);
  const date = Date.parse(value);
  if (Number.isNaN(date)) return undefined;
  return Math.max(0, date - Date.now());
}

/** Joins the base URL and a path whose variable parts the caller has encoded. */
export function joinUrl(base: string, path: string): string {
  return base.replace(/\/+$/, "") + path;
}

/**
 * Sends one request; resolves with a 2xx answer's parsed JSON body, rejects with a
 * {@link BatonError} for any other answer or none (`status` 0). An abort through `signal`
 * rejects with the signal's reason, unwrapped.
 */
export async function requestJson(
  endpoint: Endpoint,
  method: "GET" | "POST",
  path: string,
  options: { body?: string; signal?: AbortSignal | undefined; timeoutMs?: number | undefined } = {},
): Promise<JsonResponse> {
  const headers: Record<string, string> = { accept: "application/json" };
  if (options.body !== undefined) headers["content-type"] = "application/json";
  if (endpoint.token) headers.authorization = `Bearer ${endpoint.token}`;
  let signal = options.signal;
  let timer: NodeJS.Timeout | undefined;
  let unlink = () => {};
  if (options.timeoutMs !== undefined) {
    // (AbortSignal.any is Node >= 20.3: combined by hand.)
    const combined = new AbortController();
    const outer = options.signal;
    const forward = () => combined.abort(outer!.reason);
    if (outer?.aborted) forward();
    else if (outer) {
      outer.addEventListener("abort", forward, { once: true });
      unlink = () => outer.removeEventListener("abort", forward);
    }
    const ms = Math.max(1, Math.ceil(options.timeoutMs));
    timer = setTimeout(() => combined.abort(new Error(`no answer within ${ms} ms`)), ms);
    signal = combined.signal;
  }
  let response: Response;
  let text: string;
  try {
    response = await fetch(joinUrl(endpoint.url, path), { method, headers, body: options.body, signal });
    text = await response.text();
  } catch (err) {
    if (options.signal?.aborted) throw options.signal.reason;
    const why = signal?.aborted ? describe(signal.reason) : describe(err);
    throw new BatonError(0, "network_error", `${method} ${path}: no answer (${why})`, { cause: err });
  } finally {
    clearTimeout(timer);
    unlink();
  }
  let body: unknown = text;
  if (text !== "") {
    try {
      body = JSON.parse(text);
    } catch {
      // not JSON: kept as text
    }
  }
  if (response.status >= 200 && response.status < 300) return { status: response.status, body };
  const retryAfterMs = parseRetryAfter(response.headers.get("retry-after"));
  if (body !== null && typeof body === "object" && typeof (body as { error?: unknown }).error === "string") {
    const b = body as { error: string; message?: unknown; state?: unknown };
    return Promise.reject(
      new BatonError(response.status, b.error, typeof b.message === "string" ? b.message : b.error, {
        retryAfterMs,
        body,
        state: b.state !== null && typeof b.state === "object" ? (b.state as CommandState) : undefined,
      }),
    );
  }
  throw new BatonError(
    response.status,
    `http_${response.status}`,
    `${method} ${path}: HTTP ${response.status}${text ? `: ${text.slice(0, 200)}` : ""}`,
    { retryAfterMs, body },
  );
}

/** A short description of a thrown value, for messages. */
export function describe(err: unknown): string {
  if (err instanceof Error) {
    const cause = (err as { cause?: unknown }).cause;
    const causeText = cause instanceof Error ? `: ${cause.message}` : "";
    return `${err.name === "Error" ? "" : `${err.name}: `}${err.message}${causeText}`;
  }
  return String(err);
}

/** Resolves after `ms` milliseconds, or rejects with the signal's reason when it aborts first. */
export function sleep(ms: number, signal?: AbortSignal): Promise<void> {
  return new Promise((resolve, reject) => {
    if (signal?.aborted) return reject(signal.reason);
    const onAbort = () => {
      clearTimeout(timer);
      reject(signal!.reason);
    };
    const timer = setTimeout(() => {
      signal?.removeEventListener("abort", onAbort);
      resolve();
    }, Math.max(0, ms));
    signal?.addEventListener("abort", onAbort, { once: true });
  });
}

/** Formats milliseconds as a server duration (`"1500ms"`). */
export function duration(ms: number): string {
  return `${Math.max(0, Math.round(ms))}ms`;
}
