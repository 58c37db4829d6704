import type { CommandState } from "./types.js";

/**
 * An error answer of the server, or a request that did not get one.
 *
 * - `status`: the HTTP status; `0` when no answer came (connection refused or reset, DNS, a
 *   timeout), with the underlying error as `cause`.
 * - `code`: the server's `error` code (`"unknown_queue"`, `"conflict"`, `"not_found"`,
 *   `"already_terminal"`, `"lease_lost"`, …); `"network_error"` when `status` is `0`;
 *   `"http_<status>"` when the body was not the server's JSON error.
 * - `message`: the server's `message` (what to fix).
 */
export class BatonError extends Error {
  /** The HTTP status, or `0` when no answer came. */
  readonly status: number;
  /** The server's error code, e.g. `"unknown_queue"`. */
  readonly code: string;
  /** The `Retry-After` of a `503`, in milliseconds, when the server sent one. */
  readonly retryAfterMs: number | undefined;
  /**
   * The command's state where the answer carries one: the unchanged state of a `409
   * already_terminal` cancel.
   */
  readonly state: CommandState | undefined;
  /** The parsed error body (or its text when it was not JSON). */
  readonly body: unknown;

  constructor(
    status: number,
    code: string,
    message: string,
    extra: { retryAfterMs?: number; state?: CommandState; body?: unknown; cause?: unknown } = {},
  ) {
    super(message, extra.cause === undefined ? undefined : { cause: extra.cause });
    this.name = "BatonError";
    this.status = status;
    this.code = code;
    this.retryAfterMs = extra.retryAfterMs;
    this.state = extra.state;
    this.body = extra.body;
  }

  /**
   * Whether repeating the same request later may succeed: no answer at all, `503` (backend
   * unavailable, no live-reader slot), `502`, `504`, `408` or `429`.
   */
  get transient(): boolean {
    return this.status === 0 || [408, 429, 502, 503, 504].includes(this.status);
  }
}
