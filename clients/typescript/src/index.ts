/**
 * `@baton/client`: the commands API of Baton's `baton serve` ({@link BatonClient}) (a remote worker follows).
 *
 * @packageDocumentation
 */
export { BatonClient, type BatonClientOptions, type SubmitOptions, type SubmitResult, type WaitOptions } from "./client.js";
export { BatonError } from "./errors.js";
export {
  RawJson,
  TERMINAL_STATUSES,
  isTerminal,
  type CommandState,
  type CommandStatus,
  type JsonValue,
} from "./types.js";
