// Starts the Durable Streams project's Node reference server (@durable-streams/server, pinned in
// package.json; in-memory storage) for the benchmark in crates/baton/benches/http.rs.
//
//   node conformance/bench/reference-server.mjs PORT
import { DurableStreamTestServer } from "@durable-streams/server"

const port = Number(process.argv[2] ?? 4437)
const server = new DurableStreamTestServer({ port, host: "127.0.0.1", longPollTimeout: 30000 })
await server.start()
console.log(`reference server listening on http://127.0.0.1:${port}`)
const stop = async () => {
  await server.stop()
  process.exit(0)
}
process.on("SIGTERM", stop)
process.on("SIGINT", stop)
