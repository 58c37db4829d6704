// Runs the public Durable Streams server conformance suite (@durable-streams/server-conformance-tests,
// pinned in package.json) against a running `baton serve`.
// (Not BASE_URL: vitest sets that to Vite's base path "/".)
//
//   CONFORMANCE_BASE_URL=http://127.0.0.1:7700 npx vitest run
//
// The server must be started with a long-poll timeout shorter than vitest's 5 s test timeout
// (run.sh uses `--long-poll-timeout 2s`); LONG_POLL_TIMEOUT_MS tells the suite what it is.
import { runConformanceTests } from "@durable-streams/server-conformance-tests"

const baseUrl = process.env.CONFORMANCE_BASE_URL
if (!baseUrl) {
  throw new Error("set CONFORMANCE_BASE_URL to the base URL of a running `baton serve`, e.g. http://127.0.0.1:7700")
}

runConformanceTests({
  baseUrl,
  longPollTimeoutMs: Number(process.env.LONG_POLL_TIMEOUT_MS ?? 2000),
  subscriptions: process.env.SUBSCRIPTIONS === "1",
})
