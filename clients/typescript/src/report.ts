// Progress and checkpoints of a job (docs/workers.md, "Progress and checkpoints"), checked and
// turned into JSON text when the handler reports them: the renewal that carries them is one
// request for every lease of the worker, and the server refuses all of it (`400`, nothing
// renewed) for one malformed report, so a bad one must never get that far. Internal.
import { RawJson } from "./types.js";

/** Longest progress message the server keeps, bytes of UTF-8. */
export const MAX_MESSAGE_BYTES = 1024;
/** Longest `details` the server keeps, bytes of JSON text. */
export const MAX_DETAILS_BYTES = 64 * 1024;

/** A report on its way to the lease thread: each part as the JSON text of its renewal item. */
export interface EncodedReport {
  /** `{"fraction"?, "message"?}`. */
  progress?: string;
  /** Any JSON but `null`. */
  details?: string;
}

/** A lone UTF-16 surrogate (a `u` regex sees a valid pair as one code point). */
const LONE_SURROGATE = /\p{Surrogate}/u;

function kindOf(value: unknown): string {
  if (value === null) return "null";
  if (Array.isArray(value)) return "an array";
  return typeof value === "object" ? "an object" : `${typeof value} ${String(value).slice(0, 40)}`;
}

function isRecord(value: unknown): value is Record<string, unknown> {
  return value !== null && typeof value === "object" && !Array.isArray(value) && !(value instanceof RawJson);
}

/** Checks a progress report; its JSON text. Throws TypeError naming what to fix. */
export function encodeProgress(progress: unknown, what: string): string {
  if (!isRecord(progress)) {
    throw new TypeError(`${what}: progress must be an object like {fraction: 0.5, message: "…"}; got ${kindOf(progress)}`);
  }
  for (const [key, value] of Object.entries(progress)) {
    if (value !== undefined && key !== "fraction" && key !== "message") {
      throw new TypeError(`${what}: unknown progress field ${JSON.stringify(key)} (progress has only fraction and message)`);
    }
  }
  const { fraction, message } = progress;
  if (fraction === undefined && message === undefined) {
    throw new TypeError(`${what}: progress needs fraction (0 to 1) and/or message (a string)`);
  }
  if (fraction !== undefined) {
    if (typeof fraction !== "number" || !Number.isFinite(fraction) || fraction < 0 || fraction > 1) {
      throw new TypeError(`${what}: progress fraction must be a number from 0 to 1; got ${kindOf(fraction)}`);
    }
  }
  if (message !== undefined) {
    if (typeof message !== "string") throw new TypeError(`${what}: progress message must be a string; got ${kindOf(message)}`);
    if (LONE_SURROGATE.test(message)) {
      throw new TypeError(`${what}: progress message is not well-formed UTF-16 (a lone surrogate): it has no UTF-8 form`);
    }
    const bytes = Buffer.byteLength(message, "utf8");
    if (bytes > MAX_MESSAGE_BYTES) {
      throw new TypeError(`${what}: progress message is ${bytes} bytes of UTF-8; at most ${MAX_MESSAGE_BYTES} are kept`);
    }
  }
  return JSON.stringify({ fraction, message });
}

/** Checks a checkpoint; its JSON text. Throws TypeError naming what to fix. */
export function encodeDetails(details: unknown, what: string): string {
  let text: string | undefined;
  if (details instanceof RawJson) {
    text = details.text;
    try {
      JSON.parse(text);
    } catch (err) {
      throw new TypeError(`${what}: details: the RawJson text is not valid JSON (${(err as Error).message})`);
    }
  } else {
    try {
      text = JSON.stringify(details);
    } catch (err) {
      throw new TypeError(`${what}: details are not representable as JSON (${(err as Error).message})`, { cause: err });
    }
    if (text === undefined) throw new TypeError(`${what}: details are not representable as JSON: ${kindOf(details)}`);
  }
  if (text.trim() === "null") {
    throw new TypeError(`${what}: details must be a JSON value other than null (the server takes null for no details)`);
  }
  const bytes = Buffer.byteLength(text, "utf8");
  if (bytes > MAX_DETAILS_BYTES) {
    throw new TypeError(
      `${what}: details are ${bytes} bytes of JSON; at most ${MAX_DETAILS_BYTES} are kept (keep a checkpoint small, or store it elsewhere and keep its address)`,
    );
  }
  return text;
}

/** Checks `{progress?, details?}` (at least one). Throws TypeError naming what to fix. */
export function encodeReport(report: unknown, what: string): EncodedReport {
  if (!isRecord(report)) throw new TypeError(`${what}: a report must be an object like {progress?, details?}; got ${kindOf(report)}`);
  for (const [key, value] of Object.entries(report)) {
    if (value !== undefined && key !== "progress" && key !== "details") {
      throw new TypeError(`${what}: unknown report field ${JSON.stringify(key)} (a report has only progress and details)`);
    }
  }
  const out: EncodedReport = {};
  if (report.progress !== undefined) out.progress = encodeProgress(report.progress, what);
  if (report.details !== undefined) out.details = encodeDetails(report.details, what);
  if (out.progress === undefined && out.details === undefined) throw new TypeError(`${what}: a report needs progress and/or details`);
  return out;
}
