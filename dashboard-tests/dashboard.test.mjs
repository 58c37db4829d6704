// Drives the Baton dashboard in headless Chromium (Debian's `chromium`, through playwright-core):
// starts `baton serve` on a free port (in memory, and on a Redis standalone server started here),
// submits commands and checks the page shows them live, filters by status, cancels a running
// command from its detail panel, replays a dead letter (Redis: a malformed queue entry is
// injected with redis-cli), follows a stream live, and uses the page with a bearer token; then
// (`ops`, `ops-redis`) at desktop and phone widths: the stream browser, the workers panel (on
// Redis a killed `baton worker` shown dead), bulk cancel and retry with their dry-run counts, and
// no horizontal page scroll; then (`links`) streams with `%`, braces or a trailing space in their
// paths followed exactly from the browser and after a reload, and (`bulk-large`) a bulk cancel of
// more than one call's 10,000 commands whose dry-run count is what is done. Writes screenshots to
// target/dashboard-screenshots/.
//
//   BATON_BIN=target/debug/baton node dashboard-tests/dashboard.test.mjs [memory] [redis] [auth] [ops] [ops-redis] [links] [bulk-large]
//
// Environment: BATON_BIN (required), CHROMIUM (default /usr/bin/chromium), SCREENSHOTS (default
// <repo>/target/dashboard-screenshots).
import { spawn, execFileSync } from "node:child_process"
import { mkdtempSync, mkdirSync, rmSync, readFileSync, writeFileSync } from "node:fs"
import { createServer } from "node:net"
import { tmpdir } from "node:os"
import { dirname, join, resolve } from "node:path"
import { fileURLToPath } from "node:url"
import { chromium } from "playwright-core"
import { launchChromium } from "../scripts/chromium.mjs"

const ROOT = resolve(dirname(fileURLToPath(import.meta.url)), "..")
const BATON = process.env.BATON_BIN
if (!BATON) throw new Error("set BATON_BIN to a built `baton` binary")
const SHOTS = process.env.SCREENSHOTS ?? join(ROOT, "target", "dashboard-screenshots")
mkdirSync(SHOTS, { recursive: true })
const MODES = process.argv.slice(2).length ? process.argv.slice(2) : ["memory", "redis", "auth", "ops", "ops-redis", "links", "bulk-large", "schedules"]
const TOKEN = "dashboard-test-token-0123456789abcdef"

const children = []
const work = mkdtempSync(join(tmpdir(), "baton-dashboard-"))
function cleanup() {
  for (const c of children) try { c.kill("SIGTERM") } catch {}
}
process.on("exit", () => { cleanup(); try { rmSync(work, { recursive: true, force: true }) } catch {} })

const sleep = (ms) => new Promise((r) => setTimeout(r, ms))
async function freePort() {
  return new Promise((res, rej) => {
    const s = createServer()
    s.listen(0, "127.0.0.1", () => { const p = s.address().port; s.close(() => res(p)) })
    s.on("error", rej)
  })
}
async function until(what, fn, ms = 10000) {
  const end = Date.now() + ms
  let last
  while (Date.now() < end) {
    try { last = await fn(); if (last) return last } catch (e) { last = e }
    await sleep(100)
  }
  throw new Error(`timed out waiting for ${what} (last: ${last instanceof Error ? last.message : JSON.stringify(last)})`)
}
function check(cond, msg) { if (!cond) throw new Error("check failed: " + msg) }

async function startRedis() {
  const port = await freePort()
  const dir = join(work, `redis-${port}`)
  mkdirSync(dir)
  const p = spawn("redis-server", ["--port", String(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no", "--dir", dir],
    { stdio: "ignore" })
  children.push(p)
  await until("redis-server", () => { try { execFileSync("redis-cli", ["-p", String(port), "ping"], { stdio: "pipe" }); return true } catch { return false } })
  return port
}

async function startBaton(args, env = {}) {
  const port = await freePort()
  const log = join(work, `baton-${port}.log`)
  const { openSync } = await import("node:fs")
  const fd = openSync(log, "w")
  const p = spawn(BATON, ["serve", "--listen", `127.0.0.1:${port}`, "--sse-cycle", "5s", ...args],
    { stdio: ["ignore", fd, fd], env: { ...process.env, BATON_LOG: "info,baton=debug", ...env } })
  children.push(p)
  const base = `http://127.0.0.1:${port}`
  await until("baton serve", async () => (await fetch(base + "/healthz")).ok)
  return { base, log, proc: p }
}

function client(base, token) {
  const auth = token ? { authorization: `Bearer ${token}` } : {}
  return {
    async submit(body) {
      const r = await fetch(`${base}/v1/queues/default/commands`, { method: "POST", headers: { "content-type": "application/json", ...auth }, body: JSON.stringify(body) })
      const text = await r.text()
      check(r.status === 202, `submit ${JSON.stringify(body)}: ${r.status} ${text}`)
      return JSON.parse(text)
    },
    async get(id) {
      const r = await fetch(`${base}/v1/commands/${encodeURIComponent(id)}`, { headers: auth })
      return r.json()
    },
    async stream(method, path, body, headers = {}) {
      const r = await fetch(`${base}/v1/stream/${path}`, { method, body, headers: { ...auth, ...headers } })
      if (!r.ok) throw new Error(`${method} ${path}: ${r.status} ${await r.text()}`)
      return r
    },
  }
}

async function browser() {
  const profile = mkdtempSync(join(work, "chromium-"))
  return launchChromium(chromium, profile, { viewport: { width: 1400, height: 900 }, colorScheme: "light" })
}

const tab = (page, name) => page.getByRole("tab", { name: new RegExp("^" + name) }).click()
const rowsOf = (page, table) => page.locator(`#${table} tbody tr`)

async function mainFlow(mode) {
  const redisPort = mode === "redis" ? await startRedis() : null
  const { base } = await startBaton(redisPort ? ["--redis", `redis://127.0.0.1:${redisPort}`] : [])
  const api = client(base)
  const prefix = `${mode}-`
  for (let i = 0; i < 3; i++) await api.submit({ id: `${prefix}echo-${i}`, type: "echo", params: { n: i } })
  await api.submit({ id: `${prefix}fail`, type: "fail", params: { error: "disk full" } })
  await api.submit({ id: `${prefix}sleepy`, type: "sleep", params: { ms: 600000 } })
  // `sleep` runs inside `execute`, so it stays SUBMITTED (not RUNNING) while it sleeps.
  await until("commands to settle", async () => (await api.get(`${prefix}fail`)).status === "FAILED" && (await api.get(`${prefix}echo-2`)).status === "SUCCEEDED")

  const ctx = await browser()
  const page = ctx.pages()[0] ?? await ctx.newPage()
  const consoleErrors = []
  page.on("console", (m) => { if (m.type() === "error") consoleErrors.push(m.text()) })
  page.on("pageerror", (e) => consoleErrors.push(String(e)))
  try {
    // The JSON index is still there for programs; browsers get the page.
    const idx = await fetch(base + "/")
    check(idx.headers.get("content-type").startsWith("application/json"), "GET / without Accept: text/html is JSON")
    await page.goto(base + "/")
    await page.locator("#conn.live").waitFor({ timeout: 10000 })
    // Queues view: counts per status, live.
    const row = page.locator('#queues-table tr[data-queue="default"]')
    await row.waitFor()
    const cells = async () => (await row.locator("td").allTextContents()).map((s) => s.trim())
    await until("queue counts", async () => { const c = await cells(); return c[5] === "1" && c[7] === "3" && c[8] === "1" })
    await page.locator(".card.SUCCEEDED .value", { hasText: "3" }).waitFor()
    await page.screenshot({ path: join(SHOTS, `${mode}-1-queues.png`), fullPage: true })
    await chartsFlow(page, base, mode)

    // Commands view: a command submitted now appears without a reload.
    await tab(page, "Commands")
    await until("5 commands listed", async () => (await rowsOf(page, "commands-table").count()) === 5)
    await api.submit({ id: `${prefix}late`, type: "echo", params: { late: true } })
    await page.locator(`#commands-table tr[data-id="${prefix}late"][data-status="SUCCEEDED"]`).waitFor({ timeout: 5000 })
    // Filter by status.
    await page.selectOption("#filter-status", "SUCCEEDED")
    await until("only SUCCEEDED rows", async () => {
      const st = await page.locator("#commands-table tbody tr").evaluateAll((rs) => rs.map((r) => r.dataset.status))
      return st.length === 4 && st.every((s) => s === "SUCCEEDED")
    })
    await page.selectOption("#filter-status", "SUBMITTED")
    await until("only the SUBMITTED row", async () => {
      const ids = await page.locator("#commands-table tbody tr").evaluateAll((rs) => rs.map((r) => r.dataset.id))
      return ids.length === 1 && ids[0] === `${prefix}sleepy`
    })
    // Detail and cancel.
    await page.locator(`#commands-table tr[data-id="${prefix}sleepy"]`).click()
    await page.locator("#detail-json", { hasText: '"status": "SUBMITTED"' }).waitFor()
    check(await page.locator("#cancel-btn").isEnabled(), "cancel is enabled for a command not yet ended")
    // What runs now and how far it is (sleep reports its progress; written about once a second).
    await page.locator("#detail-facts", { hasText: "execute on " }).waitFor({ timeout: 10000 })
    await page.locator("#detail-facts", { hasText: "% slept " }).waitFor({ timeout: 10000 })
    await page.locator(`#commands-table tr[data-id="${prefix}sleepy"] .running`).waitFor({ timeout: 10000 })
    await page.screenshot({ path: join(SHOTS, `${mode}-2-commands-running.png`), fullPage: true })
    check(await page.locator("#retry-btn").isDisabled(), "retry is disabled while the command runs")
    // Cancel asks to confirm: the first click arms it, the second cancels.
    await page.locator("#cancel-btn").click()
    await page.locator("#cancel-btn", { hasText: "Confirm cancel?" }).waitFor()
    check((await api.get(`${prefix}sleepy`)).status !== "CANCELLED", "one click does not cancel")
    await page.locator("#cancel-btn").click()
    await page.locator("#detail-json", { hasText: '"status": "CANCELLED"' }).waitFor()
    check((await api.get(`${prefix}sleepy`)).status === "CANCELLED", "the server says CANCELLED")
    // Its timeline, from the queue's event feed: submitted, started (a call past a second), then
    // progress reports, and cancelled last.
    await page.locator('#detail-timeline li[data-event="cancelled"]').waitFor({ timeout: 10000 })
    const timeline = await page.locator("#detail-timeline li").evaluateAll((ls) => ls.map((l) => l.dataset.event))
    check(timeline[0] === "submitted" && timeline[1] === "started" && timeline[timeline.length - 1] === "cancelled",
      `the timeline runs submitted, started … cancelled: ${timeline}`)
    check(timeline.slice(2, -1).every((e) => e === "progress"), `only progress between: ${timeline}`)
    check(await page.locator("#cancel-btn").isDisabled(), "cancel is disabled once terminal")
    await page.selectOption("#filter-status", "")
    await page.locator(`#commands-table tr[data-id="${prefix}sleepy"][data-status="CANCELLED"]`).waitFor()
    await page.locator(`#commands-table tr[data-id="${prefix}fail"]`).click()
    await page.locator("#detail-facts", { hasText: "disk full" }).waitFor()
    await page.locator('#detail-timeline li[data-event="failed"]', { hasText: "disk full" }).waitFor()
    // Retry (confirmed) re-runs it: it fails again, and the timeline shows both runs.
    check(await page.locator("#retry-btn").isEnabled(), "retry is enabled for a FAILED command")
    await page.locator("#retry-btn").click()
    await page.locator("#retry-btn", { hasText: "Confirm retry?" }).waitFor()
    await page.locator("#retry-btn").click()
    await page.locator('#detail-timeline li[data-event="rerun"]').waitFor({ timeout: 10000 })
    await until("the re-run fails again", async () => (await api.get(`${prefix}fail`)).version === 4)
    await page.locator("#detail-timeline li:nth-child(4)[data-event=\"failed\"]").waitFor({ timeout: 10000 })
    const runs = await page.locator("#detail-timeline li").evaluateAll((ls) => ls.map((l) => l.dataset.event))
    check(JSON.stringify(runs) === JSON.stringify(["submitted", "failed", "rerun", "failed"]), `two runs: ${runs}`)
    await page.screenshot({ path: join(SHOTS, `${mode}-3-commands-detail.png`), fullPage: true })

    // Dead letters (a command queue dead-letters only malformed entries: inject one on Redis).
    if (redisPort) {
      execFileSync("redis-cli", ["-p", String(redisPort), "XADD", "baton:q:{default}", "*", "p", "this is not a command"])
      await tab(page, "Dead letters")
      const dl = page.locator("#dead-table tbody tr")
      await until("a dead letter", async () => (await dl.count()) === 1, 15000)
      const firstId = await dl.first().getAttribute("data-id")
      await page.locator("#count-dead.alert", { hasText: "1" }).waitFor()
      await page.screenshot({ path: join(SHOTS, `${mode}-4-dead-letters.png`), fullPage: true })
      await dl.first().getByRole("button", { name: /Replay/ }).click()
      await page.locator("#toast", { hasText: `Replayed ${firstId}` }).waitFor()
      // Replayed, it is delivered again and (still malformed) dead-lettered again under a new id.
      await until("the replayed letter to come back with a new id", async () => {
        const ids = await dl.evaluateAll((rs) => rs.map((r) => r.dataset.id))
        return ids.length === 1 && ids[0] !== firstId
      }, 15000)
    } else {
      await tab(page, "Dead letters")
      await page.locator("#dead-empty").waitFor()
    }

    // Streams: open one and watch it live.
    const path = `${mode}/run-1`
    await api.stream("PUT", path, undefined, { "content-type": "text/plain" })
    await api.stream("POST", path, "line one\n", { "content-type": "text/plain" })
    await tab(page, "Streams")
    await page.fill("#stream-path", path)
    await page.getByRole("button", { name: "Open" }).click()
    await page.locator("#stream-log", { hasText: "line one" }).waitFor()
    await api.stream("POST", path, "line two\n", { "content-type": "text/plain" })
    await page.locator("#stream-log", { hasText: "line two" }).waitFor({ timeout: 5000 })
    await page.fill("#append-text", "typed in the page")
    await page.getByRole("button", { name: "Append", exact: true }).click()
    await page.locator("#stream-log", { hasText: "typed in the page" }).waitFor({ timeout: 5000 })
    const body = await (await api.stream("GET", `${path}?offset=-1`)).text()
    check(body === "line one\nline two\ntyped in the page\n", `stream content: ${JSON.stringify(body)}`)
    await page.screenshot({ path: join(SHOTS, `${mode}-5-stream-live.png`), fullPage: true })
    await api.stream("POST", path, undefined, { "stream-closed": "true" })
    await page.locator("#stream-status", { hasText: "has ended (finished)" }).waitFor({ timeout: 5000 })
    await page.screenshot({ path: join(SHOTS, `${mode}-6-stream-ended.png`), fullPage: true })
    // A path that does not exist says so.
    await page.fill("#stream-path", `${mode}/nope`)
    await page.getByRole("button", { name: "Open" }).click()
    await page.locator("#stream-status", { hasText: "No stream at" }).waitFor()
    // A command's output stream: linked from its detail, followed live in the Streams tab, ended by its cancel.
    const out = `commands/${prefix}out`
    await api.submit({ id: `${prefix}out`, type: "sleep", params: { ms: 600000 }, output: true })
    await tab(page, "Commands")
    await page.locator(`#commands-table tr[data-id="${prefix}out"]`).click()
    await page.locator("#detail-output", { hasText: out }).click()
    await page.locator("#stream-status", { hasText: `Following ${out}` }).waitFor({ timeout: 5000 })
    await api.stream("POST", out, JSON.stringify({ line: "from the handler" }), { "content-type": "application/json" })
    await page.locator("#stream-log", { hasText: '{"line":"from the handler"}' }).waitFor({ timeout: 5000 })
    const cancelled = await fetch(`${base}/v1/commands/${prefix}out/cancel`, { method: "POST" })
    check(cancelled.status === 200, `cancel: ${cancelled.status}`)
    await page.locator("#stream-status", { hasText: `${out} has ended (cancelled)` }).waitFor({ timeout: 5000 })
    await page.screenshot({ path: join(SHOTS, `${mode}-7-command-output.png`), fullPage: true })

    const unexpected = consoleErrors.filter((e) => !/404|Failed to load resource/.test(e))
    check(unexpected.length === 0, `console errors: ${unexpected.join(" | ")}`)
  } catch (e) {
    await page.screenshot({ path: join(SHOTS, `${mode}-FAILED.png`), fullPage: true }).catch(() => {})
    throw e
  } finally {
    await ctx.close()
  }
}

// The queues view's "Last hour" charts for `default` after mainFlow's known work (3 echo
// SUCCEEDED, 1 fail FAILED): one point per minute for 60 minutes, the totals the API gives, the
// depth line where the server sampled; desktop and phone widths.
async function chartsFlow(page, base, mode) {
  await page.locator('#charts[data-queue="default"] #chart-outcomes').waitFor({ timeout: 10000 })
  const series = (chart, key) => page.locator(`#${chart} g[data-series="${key}"]`)
  // Points per drawn run: a polyline's, or 1 for a dot (a lone value).
  const pointsOf = async (chart, key) => (await series(chart, key).locator("polyline, circle").evaluateAll(
    (ps) => ps.map((p) => p.tagName === "circle" ? 1 : p.getAttribute("points").trim().split(/\s+/).length)))
  await until("the charts count the work", async () =>
    (await series("chart-outcomes", "succeeded").getAttribute("data-total")) === "3" &&
    (await series("chart-outcomes", "failed").getAttribute("data-total")) === "1", 15000)
  for (const key of ["succeeded", "failed", "cancelled"]) {
    check(await series("chart-outcomes", key).getAttribute("data-points") === "60", `${key}: 60 minutes`)
    const pts = await pointsOf("chart-outcomes", key)
    check(pts.length === 1 && pts[0] === 60, `${key}: one line of 60 points (got ${JSON.stringify(pts)})`)
  }
  // Depth: a point for each minute the server sampled (it samples at start, then once a minute).
  const r = await fetch(`${base}/v1/queues/default/minutes?last=60`)
  const minutes = (await r.json()).minutes
  check(minutes.length === 60, "the API gives 60 minutes")
  const sampled = minutes.filter((m) => m.depth !== null).length
  check(sampled >= 1, "the server sampled the depth")
  const depthPts = (await pointsOf("chart-depth", "depth")).reduce((a, n) => a + n, 0)
  check(depthPts === sampled, `depth: ${sampled} sampled minutes drawn (got ${depthPts})`)
  check((await pointsOf("chart-age", "age")).length >= 1, "oldest age drawn")
  for (const key of ["p50", "p90", "p99"]) {
    check((await pointsOf("chart-durations", key)).length >= 1, `duration ${key} drawn`)
  }
  check(await page.locator("#chart-outcomes svg").getAttribute("aria-label") !== null, "the chart has a text alternative")
  await page.locator("#charts-panel").screenshot({ path: join(SHOTS, `${mode}-1b-charts.png`) })
  const size = page.viewportSize()
  await page.setViewportSize({ width: 390, height: 844 })
  await page.locator("#charts-panel").screenshot({ path: join(SHOTS, `${mode}-1c-charts-phone.png`) })
  const wide = await page.locator("#charts-panel").evaluate((el) => el.scrollWidth > el.clientWidth + 1)
  check(!wide, "the charts fit a phone's width")
  await page.setViewportSize(size)
}

async function authFlow() {
  const { base, log } = await startBaton([], { BATON_ADMIN_TOKEN: TOKEN })
  const api = client(base, TOKEN)
  const r = await fetch(`${base}/v1/queues`)
  check(r.status === 401, `without a token /v1/queues is 401 (got ${r.status})`)
  await api.submit({ id: "auth-echo", type: "echo", params: { hello: "token" } })
  await api.stream("PUT", "auth/s1", undefined, { "content-type": "text/plain" })
  await api.stream("POST", "auth/s1", "secret line\n", { "content-type": "text/plain" })
  const ctx = await browser()
  const page = ctx.pages()[0] ?? await ctx.newPage()
  try {
    await page.goto(base + "/")
    await page.locator("#auth-banner", { hasText: "requires a bearer token" }).waitFor()
    await page.screenshot({ path: join(SHOTS, "auth-1-token-needed.png"), fullPage: true })
    await page.fill("#token", TOKEN)
    await page.getByRole("button", { name: "Use" }).click()
    await page.locator("#conn.live").waitFor()
    await tab(page, "Commands")
    await page.locator('#commands-table tr[data-id="auth-echo"]').waitFor()
    await tab(page, "Streams")
    await page.fill("#stream-path", "auth/s1")
    await page.getByRole("button", { name: "Open" }).click()
    await page.locator("#stream-log", { hasText: "secret line" }).waitFor()
    await page.screenshot({ path: join(SHOTS, "auth-2-with-token.png"), fullPage: true })
    await sleep(300)
    const text = readFileSync(log, "utf8")
    check(!text.includes(TOKEN), "the token never appears in the server's log")
  } finally {
    await ctx.close()
  }
}

// ---- operations: stream browser, workers, bulk actions; desktop and phone widths -------------
const WIDTHS = { desktop: { width: 1400, height: 900 }, phone: { width: 390, height: 844 } }

async function json(method, url, body) {
  const r = await fetch(url, { method, headers: body ? { "content-type": "application/json" } : {}, body: body ? JSON.stringify(body) : undefined })
  const text = await r.text()
  check(r.ok, `${method} ${url}: ${r.status} ${text}`)
  return JSON.parse(text)
}

// No horizontal page scroll: the page is no wider than the window (tables scroll in their box).
async function noOverflow(page, what) {
  const [sw, iw, wide] = await page.evaluate(() => {
    const iw = window.innerWidth
    // The outermost elements that stick out (for the failure message).
    const clipped = (e) => { for (let a = e.parentElement; a; a = a.parentElement) if (getComputedStyle(a).overflowX !== "visible") return true; return false }
    const out = [...document.querySelectorAll("body *")].filter((e) => !clipped(e) && (e.getBoundingClientRect().right > iw + 0.5 ||
      (getComputedStyle(e).overflowX === "visible" && e.getBoundingClientRect().left + e.scrollWidth > iw + 0.5)))
      .map((e) => `${e.tagName.toLowerCase()}${e.id ? "#" + e.id : ""}${e.className ? "." + String(e.className).split(" ").join(".") : ""}`)
    return [document.documentElement.scrollWidth, iw, out.slice(0, 8)]
  })
  check(sw <= iw, `${what}: the page is ${sw}px wide in a ${iw}px window (sticking out: ${wide.join(", ")})`)
}

// A `baton worker` on the same Redis that took a lease, then SIGKILL: a dead consumer that the
// serving process outlives. Returns its consumer name.
async function deadWorker(base, redisPort, config) {
  const before = new Set((await json("GET", `${base}/v1/queues/default/workers`)).workers.map((w) => w.name))
  const p = spawn(BATON, ["worker", "--redis", `redis://127.0.0.1:${redisPort}`, "--config", config], { stdio: "ignore", env: { ...process.env, BATON_LOG: "warn" } })
  children.push(p)
  const name = await until("the worker to join the group", async () => {
    const ws = (await json("GET", `${base}/v1/queues/default/workers`)).workers
    return ws.map((w) => w.name).find((n) => !before.has(n))
  }, 20000)
  // Commands until the new worker holds one (the serving process takes some too).
  let n = 0
  await until("the worker to hold a lease", async () => {
    await json("POST", `${base}/v1/queues/default/commands`, { id: `doomed-${n++}`, type: "sleep", params: { ms: 600000 } })
    const w = (await json("GET", `${base}/v1/queues/default/workers`)).workers.find((w) => w.name === name)
    return w && w.leases > 0
  }, 20000)
  p.kill("SIGKILL")
  return name
}

async function opsFlow(backend) {
  const redisPort = backend === "redis" ? await startRedis() : null
  const config = join(work, `ops-${backend}.toml`)
  writeFileSync(config, '[queues.default]\nconcurrency = 64\nclaim_timeout = "2s"\npoll_interval = "200ms"\n' +
    '[queues.default.handlers]\nsleep = "sleep"\necho = "echo"\nfail = "fail"\n')
  const { base } = await startBaton(["--config", config, ...(redisPort ? ["--redis", `redis://127.0.0.1:${redisPort}`] : [])])
  const api = client(base)
  const ours = (await until("the server's own worker", async () => (await json("GET", `${base}/v1/queues/default/workers`)).workers[0])).name
  const dead = redisPort ? await deadWorker(base, redisPort, config) : null

  for (const [width, viewport] of Object.entries(WIDTHS)) {
    const tag = `ops-${backend}-${width}`
    const profile = mkdtempSync(join(work, "chromium-"))
    const ctx = await launchChromium(chromium, profile, { viewport, colorScheme: "light" })
    const page = ctx.pages()[0] ?? await ctx.newPage()
    const consoleErrors = []
    page.on("console", (m) => { if (m.type() === "error") consoleErrors.push(m.text()) })
    page.on("pageerror", (e) => consoleErrors.push(String(e)))
    try {
      // Streams of this width, and one elsewhere that the prefix leaves out.
      const pre = `br-${width}/`
      await api.stream("PUT", `${pre}b-json`, "[1, 2, 3]", { "content-type": "application/json" })
      await api.stream("PUT", `${pre}a-text`, "hello\n", { "content-type": "text/plain" })
      await api.stream("PUT", `${pre}c-ended`, "bye\n", { "content-type": "text/plain", "stream-closed": "true" })
      await api.stream("PUT", `br-${width}x/decoy`, undefined, { "content-type": "text/plain" })
      // A sleeping command held by the serving process, and the bulk action's targets.
      const held = `held-${width}`
      await api.submit({ id: held, type: "sleep", params: { ms: 600000 } })
      for (let i = 0; i < 3; i++) await api.submit({ id: `bulk-${width}-${i}`, type: "sleep", params: { ms: 600000 } })
      await api.submit({ id: `bulk-${width}-echo`, type: "echo", params: {} })

      await page.goto(base + "/")
      await page.locator("#conn.live").waitFor({ timeout: 10000 })
      await page.locator('#queues-table tr[data-queue="default"]').waitFor()
      await noOverflow(page, `${tag} queues`)
      await page.screenshot({ path: join(SHOTS, `${tag}-1-queues.png`), fullPage: true })

      // Stream browser: the prefix's streams in path order with their state; one opened live.
      await tab(page, "Streams")
      await page.fill("#browse-prefix", pre)
      await page.locator("#browse-form").getByRole("button", { name: "List" }).click()
      await until("the three streams", async () => {
        const paths = await page.locator("#streams-table tbody tr").evaluateAll((rs) => rs.map((r) => r.dataset.path))
        return JSON.stringify(paths) === JSON.stringify([`${pre}a-text`, `${pre}b-json`, `${pre}c-ended`])
      })
      const cells = (await page.locator(`#streams-table tr[data-path="${pre}b-json"] td`).allTextContents()).map((t) => t.trim())
      check(cells[0] === "application/json" && cells[1] === "3" && cells[2] === "open", `the JSON stream's row: ${cells}`)
      const ended = (await page.locator(`#streams-table tr[data-path="${pre}c-ended"] td`).allTextContents()).map((t) => t.trim())
      check(ended[2] === "ended (finished)", `the ended stream's row: ${ended}`)
      await page.locator(`#streams-table tr[data-path="${pre}a-text"] a`).click()
      await page.locator("#stream-log", { hasText: "hello" }).waitFor()
      await page.locator("#stream-status.live").waitFor()
      await api.stream("POST", `${pre}a-text`, "appended later\n", { "content-type": "text/plain" })
      await page.locator("#stream-log", { hasText: "appended later" }).waitFor({ timeout: 5000 })
      check((await page.locator("#stream-log").textContent()) === "hello\nappended later\n", "the followed stream's text")
      await noOverflow(page, `${tag} streams`)
      await page.screenshot({ path: join(SHOTS, `${tag}-2-streams.png`), fullPage: true })

      // Workers: the serving process's consumer, live, holding the sleeping command; on Redis
      // the killed worker apart, dead.
      await tab(page, "Workers")
      const live = page.locator(`#workers-table tr[data-worker="${ours}"][data-alive="true"]`)
      await live.waitFor({ timeout: 10000 })
      await live.locator(`a[data-command="${held}"]`).waitFor({ timeout: 10000 })
      if (dead) {
        await page.locator(`#dead-workers-table tr[data-worker="${dead}"][data-alive="false"]`).waitFor({ timeout: 15000 })
        check(await page.locator(`#workers-table tr[data-worker="${dead}"]`).count() === 0, "the dead worker is not among the live ones")
        await page.locator('#workers-summary[data-alive="1"][data-dead="1"]').waitFor()
        await page.locator("#count-dead-workers.alert", { hasText: "1 dead" }).waitFor()
      } else {
        await page.locator('#workers-summary[data-alive="1"][data-dead="0"]').waitFor()
        await page.locator("#dead-workers-empty").waitFor()
      }
      await noOverflow(page, `${tag} workers`)
      await page.screenshot({ path: join(SHOTS, `${tag}-3-workers.png`), fullPage: true })
      // A command id opens its detail.
      await live.locator(`a[data-command="${held}"]`).click()
      await page.locator("#detail-title", { hasText: `Command ${held}` }).waitFor()
      await page.locator("#detail-close").click()

      // Bulk: cancel the three sleeps by type and id prefix; the dry run counts them first.
      await page.locator("#bulk summary").click()
      await page.selectOption("#bulk-action", "cancel")
      await page.selectOption("#bulk-queue", "default")
      await page.fill("#bulk-type", "sleep")
      await page.fill("#bulk-prefix", `bulk-${width}-`)
      await page.locator("#bulk-btn").click()
      await page.locator('#bulk-result[data-eligible="3"]').waitFor()
      check((await page.locator("#bulk-result").textContent()).startsWith("3 commands of default would be cancelled (dry run)"), "the dry run's words")
      await page.locator("#bulk-btn", { hasText: "Confirm cancel of 3?" }).waitFor()
      await noOverflow(page, `${tag} bulk`)
      await page.screenshot({ path: join(SHOTS, `${tag}-4-bulk-dry-run.png`), fullPage: true })
      for (let i = 0; i < 3; i++) check((await api.get(`bulk-${width}-${i}`)).status === "SUBMITTED", "the dry run changes nothing")
      await page.locator("#bulk-btn").click()
      await page.locator('#bulk-result[data-applied="3"]').waitFor()
      for (let i = 0; i < 3; i++) check((await api.get(`bulk-${width}-${i}`)).status === "CANCELLED", `bulk-${width}-${i} cancelled`)
      check((await api.get(`bulk-${width}-echo`)).status === "SUCCEEDED", "the echo is left alone")
      check((await api.get(held)).status === "SUBMITTED", "the held command is left alone")
      await page.screenshot({ path: join(SHOTS, `${tag}-5-bulk-done.png`), fullPage: true })
      // Retry them the same way; changing the filter disarms a counted button.
      await page.selectOption("#bulk-action", "retry")
      await page.locator("#bulk-btn").click()
      await page.locator('#bulk-result[data-eligible="3"]').waitFor()
      await page.fill("#bulk-prefix", `bulk-${width}-1`)
      await page.locator("#bulk-btn", { hasText: "Count" }).waitFor()
      await page.locator("#bulk-btn").click()
      await page.locator('#bulk-result[data-eligible="1"]').waitFor()
      await page.locator("#bulk-btn").click()
      await page.locator('#bulk-result[data-applied="1"]').waitFor()
      check((await api.get(`bulk-${width}-1`)).status === "SUBMITTED", "bulk-1 re-run")
      check((await api.get(`bulk-${width}-0`)).status === "CANCELLED", "bulk-0 left cancelled")
      await tab(page, "Commands")
      await noOverflow(page, `${tag} commands`)

      const unexpected = consoleErrors.filter((e) => !/404|Failed to load resource/.test(e))
      check(unexpected.length === 0, `console errors: ${unexpected.join(" | ")}`)
    } catch (e) {
      await page.screenshot({ path: join(SHOTS, `${tag}-FAILED.png`), fullPage: true }).catch(() => {})
      throw e
    } finally {
      await ctx.close()
    }
  }
}

// Stream paths the URL treats specially (`%`, an encoded-looking `%7B`, a brace, a trailing
// space): a listed stream opens exactly that stream, and so does the page's URL after a reload
// (the `#streams:` link the browser shares), and a `%` in it does not stop the page working.
async function linksFlow() {
  const { base } = await startBaton([])
  const api = client(base)
  const odd = { "odd/%7B": "encoded", "odd/{": "brace", "odd/sp ": "space", "odd/sp": "nospace", "odd/100%": "percent" }
  for (const [path, text] of Object.entries(odd)) {
    const url = path.split("/").map(encodeURIComponent).join("/")
    await api.stream("PUT", url, text + "\n", { "content-type": "text/plain" })
  }
  const ctx = await browser()
  const page = ctx.pages()[0] ?? await ctx.newPage()
  const errors = []
  page.on("pageerror", (e) => errors.push(String(e)))
  try {
    await page.goto(base + "/")
    await page.locator("#conn.live").waitFor({ timeout: 10000 })
    for (const [path, text] of Object.entries(odd)) {
      await tab(page, "Streams")
      await page.fill("#browse-prefix", "odd/")
      await page.locator("#browse-form").getByRole("button", { name: "List" }).click()
      await until(`the row of ${JSON.stringify(path)}`, async () => {
        const paths = await page.locator("#streams-table tbody tr").evaluateAll((rs) => rs.map((r) => r.dataset.path))
        return paths.includes(path)
      })
      await page.locator("#streams-table tbody tr").evaluateAll((rs, p) => rs.find((r) => r.dataset.path === p).querySelector("a").click(), path)
      await until(`${JSON.stringify(path)} followed`, async () => (await page.locator("#stream-log").textContent()) === text + "\n")
      // The page's URL names the same stream: a reload follows it again, and the page works.
      await page.reload()
      await until(`${JSON.stringify(path)} followed after a reload`, async () => {
        if (errors.length) throw new Error(`page errors: ${errors.join(" | ")}`)
        const log = await page.locator("#stream-log").textContent()
        if (log !== text + "\n") throw new Error(`the log shows ${JSON.stringify(log)}`)
        return true
      })
      check(errors.length === 0, `page errors after reloading ${JSON.stringify(path)}: ${errors.join(" | ")}`)
    }
    // A listing asked for while a slow one is still under way: the table ends up showing the
    // prefix asked last (the slow answer for the old prefix does not replace it, and the
    // new request is not dropped).
    await api.stream("PUT", "late/one", "x\n", { "content-type": "text/plain" })
    await tab(page, "Streams")
    let delayed = false
    await page.route("**/v1/streams?**", async (route) => {
      if (!delayed && route.request().url().includes("prefix=odd")) { delayed = true; await sleep(1500) }
      await route.continue()
    })
    await page.fill("#browse-prefix", "odd/")
    await page.locator("#browse-form").getByRole("button", { name: "List" }).click()
    await until("the slow listing to start", async () => delayed)
    await page.fill("#browse-prefix", "late/")
    await page.locator("#browse-form").getByRole("button", { name: "List" }).click()
    await sleep(2500)
    const shown = await page.locator("#streams-table tbody tr").evaluateAll((rs) => rs.map((r) => r.dataset.path))
    check(JSON.stringify(shown) === JSON.stringify(["late/one"]), `the table after asking for late/: ${JSON.stringify(shown)}`)
    await page.unroute("**/v1/streams?**")
  } finally {
    await ctx.close()
  }
}

// Cron schedules under the queue's charts: an every-second schedule and a nightly one in
// Europe/Berlin; the last fire links to its command, which opens in the Commands view.
async function schedulesFlow() {
  const config = join(work, "schedules.toml")
  writeFileSync(config, '[queues.default.handlers]\necho = "echo"\n' +
    '[[queues.default.schedules]]\nname = "tick"\ncron = "* * * * * *"\ntype = "echo"\nparams = { hi = 1 }\noverlap = "allow"\n' +
    '[[queues.default.schedules]]\nname = "nightly"\ncron = "30 2 * * *"\ntimezone = "Europe/Berlin"\ntype = "echo"\nmissed = "run_once"\n')
  const { base } = await startBaton(["--config", config])
  const ctx = await browser()
  const page = ctx.pages()[0] ?? await ctx.newPage()
  try {
    await page.goto(base + "/")
    await page.locator("#conn.live").waitFor({ timeout: 10000 })
    await page.locator("#schedules-box:not([hidden])").waitFor({ timeout: 15000 })
    const rows = page.locator("#schedules-table tbody tr")
    await until("two schedule rows", async () => (await rows.count()) === 2)
    const nightly = page.locator('#schedules-table tr[data-schedule="nightly"]')
    check((await nightly.innerText()).includes("Europe/Berlin"), "the nightly row names its time zone")
    check((await nightly.innerText()).includes("run_once"), "the nightly row names its missed policy")
    const link = page.locator('#schedules-table tr[data-schedule="tick"] a[data-command^="sched-default.tick-"]')
    await link.waitFor({ timeout: 15000 })
    await page.screenshot({ path: join(SHOTS, "schedules-1-queue.png"), fullPage: true })
    const id = await link.getAttribute("data-command")
    await link.click()
    await page.locator("#detail-json", { hasText: `"id": "${id}"` }).waitFor({ timeout: 10000 })
    await page.screenshot({ path: join(SHOTS, "schedules-2-command.png"), fullPage: true })
  } finally {
    await ctx.close()
  }
}

// Bulk over more commands than one call looks at (10,000): the dry run's count, shown on the
// confirm button, is what the action then does.
async function bulkLargeFlow() {
  const config = join(work, "bulk-large.toml")
  writeFileSync(config, '[queues.default]\nconcurrency = 1\n[queues.default.handlers]\nsleep = "sleep"\n')
  const { base } = await startBaton(["--config", config])
  const n = 10005
  for (let i = 0; i < n; i += 200) {
    await Promise.all(Array.from({ length: Math.min(200, n - i) }, (_, k) =>
      json("POST", `${base}/v1/queues/default/commands`, { id: `big-${i + k}`, type: "sleep", params: { ms: 600000 } })))
  }
  const ctx = await browser()
  const page = ctx.pages()[0] ?? await ctx.newPage()
  try {
    await page.goto(base + "/")
    await page.locator("#conn.live").waitFor({ timeout: 10000 })
    await tab(page, "Commands")
    await page.locator("#bulk summary").click()
    await page.selectOption("#bulk-action", "cancel")
    await page.selectOption("#bulk-queue", "default")
    await page.fill("#bulk-prefix", "big-")
    await page.locator("#bulk-btn").click()
    await page.locator("#bulk-result[data-eligible]").waitFor({ timeout: 60000 })
    const counted = Number(await page.locator("#bulk-result").getAttribute("data-eligible"))
    await page.locator("#bulk-btn").click()
    await page.locator("#bulk-result[data-applied]").waitFor({ timeout: 120000 })
    const applied = Number(await page.locator("#bulk-result").getAttribute("data-applied"))
    check(counted === n && applied === n, `the dry run counted ${counted}, the action cancelled ${applied} (of ${n})`)
  } finally {
    await ctx.close()
  }
}

let failed = 0
for (const mode of MODES) {
  const t0 = Date.now()
  try {
    if (mode === "auth") await authFlow()
    else if (mode === "ops") await opsFlow("memory")
    else if (mode === "ops-redis") await opsFlow("redis")
    else if (mode === "links") await linksFlow()
    else if (mode === "bulk-large") await bulkLargeFlow()
    else if (mode === "schedules") await schedulesFlow()
    else await mainFlow(mode)
    console.log(`dashboard (${mode}): ok in ${((Date.now() - t0) / 1000).toFixed(1)}s`)
  } catch (e) {
    failed++
    console.error(`dashboard (${mode}): FAILED: ${e.stack || e}`)
  }
}
console.log(`screenshots in ${SHOTS}`)
cleanup()
process.exit(failed ? 1 : 0)
