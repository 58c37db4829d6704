// A plain browser `EventSource` (headless Chromium) follows a Baton stream through forced
// disconnects: every event arrives once, in order, and the page stops at the end of the stream.
//
//   BATON_URL=http://127.0.0.1:7700 node conformance/browser/eventsource.mjs
//
// Start `baton serve` with a short `--sse-cycle` (run.sh uses 1s): the server then closes every
// SSE connection after a second, mid-stream, and the browser reconnects on its own, sending
// `Last-Event-ID` (the offset of the last event it saw). The page reports what it received by
// POSTing it to this script's small HTTP server. Needs `chromium` on PATH (CHROMIUM to override).
import { spawn } from "node:child_process"
import { createServer } from "node:http"
import { mkdtempSync, rmSync } from "node:fs"
import { tmpdir } from "node:os"
import { join } from "node:path"

const baton = process.env.BATON_URL
if (!baton) throw new Error("set BATON_URL to the base URL of a running `baton serve` (with --sse-cycle 1s)")
const chromiumBin = process.env.CHROMIUM ?? "chromium"
const MESSAGES = 40
const streamUrl = `${baton}/v1/stream/browser/es-${Date.now()}`

const fail = (msg) => {
  console.error(`eventsource: FAILED: ${msg}`)
  process.exitCode = 1
}

// 1. The stream.
const put = await fetch(streamUrl, { method: "PUT", headers: { "content-type": "text/plain" } })
if (put.status !== 201) throw new Error(`create failed: ${put.status}`)

// 2. The page, served from another origin (CORS), and the result endpoint.
const page = `<!doctype html><meta charset="utf-8"><script>
  const lines = [], opens = [];
  const es = new EventSource(${JSON.stringify(streamUrl + "?offset=-1&live=sse")});
  es.onopen = () => { if (opens.push(Date.now()) === 1) fetch("/opened", { method: "POST" }) };
  es.addEventListener("data", (e) => { for (const l of e.data.split("\\n")) if (l) lines.push(l) });
  es.addEventListener("control", (e) => {
    const c = JSON.parse(e.data);
    if (c.streamClosed) {
      es.close();
      fetch("/result", { method: "POST", body: JSON.stringify({ lines, opens: opens.length, end: c }) });
    }
  });
</script>`
let resolveResult
const result = new Promise((r) => (resolveResult = r))
let resolveOpened
const opened = new Promise((r) => (resolveOpened = r))
const server = createServer((req, res) => {
  if (req.method === "POST" && req.url === "/opened") {
    res.end("ok")
    resolveOpened()
    return
  }
  if (req.method === "POST" && req.url === "/result") {
    let body = ""
    req.on("data", (c) => (body += c))
    req.on("end", () => {
      res.end("ok")
      resolveResult(JSON.parse(body))
    })
    return
  }
  res.writeHead(200, { "content-type": "text/html" })
  res.end(page)
})
await new Promise((r) => server.listen(0, "127.0.0.1", r))
const pageUrl = `http://127.0.0.1:${server.address().port}/`

// 3. Headless Chromium on the page.
const profile = mkdtempSync(join(tmpdir(), "baton-chromium-"))
const chromium = spawn(
  chromiumBin,
  ["--headless=new", "--no-sandbox", "--disable-gpu", "--no-first-run", `--user-data-dir=${profile}`,
    "--remote-debugging-port=0", pageUrl],
  { stdio: ["ignore", "ignore", "pipe"] },
)
let chromiumLog = ""
chromium.stderr.on("data", (d) => (chromiumLog += d))

// 4. The producer, once the page's EventSource is open (Chromium may take seconds to start on a
//    loaded machine): MESSAGES lines over ~4 s (several forced disconnects), then close.
await Promise.race([opened, new Promise((r) => setTimeout(r, 20000))])
for (let i = 0; i < MESSAGES; i++) {
  const r = await fetch(streamUrl, { method: "POST", headers: { "content-type": "text/plain" }, body: `m${i}\n` })
  if (r.status !== 204) fail(`append ${i}: ${r.status}`)
  await new Promise((r) => setTimeout(r, 100))
}
await fetch(streamUrl, { method: "POST", headers: { "stream-closed": "true" } })

// 5. Check.
const timeout = new Promise((_, reject) => setTimeout(() => reject(new Error("no result from the page within 30 s")), 30000))
try {
  const got = await Promise.race([result, timeout])
  const expected = Array.from({ length: MESSAGES }, (_, i) => `m${i}`)
  if (JSON.stringify(got.lines) !== JSON.stringify(expected)) {
    fail(`events differ:\n got ${JSON.stringify(got.lines)}\nwant ${JSON.stringify(expected)}`)
  } else if (got.opens < 2) {
    fail(`the connection was never cycled (opened ${got.opens} time); start baton with --sse-cycle 1s`)
  } else {
    console.log(`eventsource: ${MESSAGES} events, once each, in order, across ${got.opens} connections; end ${JSON.stringify(got.end)}`)
  }
} catch (e) {
  fail(`${e.message}\n--- chromium stderr (last 2000 chars) ---\n${chromiumLog.slice(-2000)}`)
} finally {
  chromium.kill("SIGTERM")
  server.close()
  await new Promise((r) => setTimeout(r, 300))
  rmSync(profile, { recursive: true, force: true })
}
