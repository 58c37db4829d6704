/**
 * `@baton/client`: the commands API of Baton's `baton serve` ({@link BatonClient}) and a remote
 * worker speaking its HTTP worker protocol ({@link Worker}).
 *
 * @packageDocumentation
 */
export {
  BatonClient,
  MAX_BATCH,
  type BatonClientOptions,
  type SubmitItem,
  type SubmitManyOutcome,
  type SubmitOptions,
  type SubmitResult,
  type WaitOptions,
} from "./client.js";
export { BatonError } from "./errors.js";
export { Failed, HandOff, JobAborted, Release, Running, type AbortKind } from "./outcomes.js";
export {
  RawJson,
  TERMINAL_STATUSES,
  isTerminal,
  type CommandProgress,
  type CommandState,
  type CommandStatus,
  type JsonValue,
  type OutputLink,
} from "./types.js";
export type { JobOutput } from "./protocol.js";
export { Worker, type Handler, type Job, type JobReport, type WorkerOptions } from "./worker.js";
