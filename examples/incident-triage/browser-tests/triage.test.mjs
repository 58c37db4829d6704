// Drives the incident-triage page in headless Chromium (Debian's `chromium`, through
// playwright-core), against the example binary on the in-memory backend and on a Redis
// standalone server started here:
//   1. start a run; reload mid-stream → the page resumes (Last-Event-ID / stored offset) and
//      ends with every event exactly once, in order; the command ends SUCCEEDED;
//   2. a second page (another browser context = another device) on the same engineer finds the
//      current run and shows the same events; Stop → both pages show cancelled at once, and the
//      command ends CANCELLED;
//   3. an uploaded (pasted) log is analysed too;
//   4. a phone (Pixel 7 emulation: 412×915 viewport, touch, deviceScaleFactor 2.625) starts a run:
//      the page is no wider than the screen and Stop lies fully inside the viewport; a TAP on Stop
//      cancels the run on the phone and on a desktop page following it; a finished run with long
//      unbreakable log lines (findings, open event log, start form) fits 412 and 360 px too.
// Screenshots go to target/incident-triage-screenshots/.
//
//   TRIAGE_BIN=target/debug/incident-triage node triage.test.mjs [memory] [redis]
//
// Environment: TRIAGE_BIN (required), CHROMIUM (default /usr/bin/chromium), SCREENSHOTS.
import { spawn, execFileSync } from "node:child_process"
import { mkdtempSync, mkdirSync, rmSync, writeFileSync, openSync, readFileSync } from "node:fs"
import { createServer } from "node:net"
import { tmpdir } from "node:os"
import { dirname, join, resolve } from "node:path"
import { fileURLToPath } from "node:url"
import { chromium, devices } from "playwright-core"
import { launchChromium } from "../../../scripts/chromium.mjs"

const HERE = dirname(fileURLToPath(import.meta.url))
const ROOT = resolve(HERE, "..", "..", "..")
const BIN = process.env.TRIAGE_BIN
if (!BIN) throw new Error("set TRIAGE_BIN to a built incident-triage binary")
const SHOTS = process.env.SCREENSHOTS ?? join(ROOT, "target", "incident-triage-screenshots")
mkdirSync(SHOTS, { recursive: true })
const MODES = process.argv.slice(2).length ? process.argv.slice(2) : ["memory", "redis"]

const children = []
const work = mkdtempSync(join(tmpdir(), "triage-browser-"))
process.on("exit", () => {
  for (const c of children) try { c.kill("SIGKILL") } catch {}
  try { rmSync(work, { recursive: true, force: true }) } catch {}
})
const sleep = (ms) => new Promise((r) => setTimeout(r, ms))
async function freePort() {
  return new Promise((res, rej) => {
    const s = createServer()
    s.listen(0, "127.0.0.1", () => { const p = s.address().port; s.close(() => res(p)) })
    s.on("error", rej)
  })
}
async function until(what, fn, ms = 15000) {
  const end = Date.now() + ms
  let last
  while (Date.now() < end) {
    try { last = await fn(); if (last) return last } catch (e) { last = e }
    await sleep(50)
  }
  throw new Error(`timed out waiting for ${what} (last: ${last instanceof Error ? last.message : JSON.stringify(last)})`)
}
function check(cond, msg) { if (!cond) throw new Error("check failed: " + msg) }

// A deterministic application log: steady errors and warnings, plus a burst of timeouts.
function writeLog(path, lines) {
  let seed = 42
  const rnd = (n) => { seed = (seed * 1103515245 + 12345) % 2147483648; return Math.floor(seed / 65536) % n }
  const hex = (n) => Array.from({ length: n }, () => "0123456789abcdef"[rnd(16)]).join("")
  let t = Date.UTC(2025, 0, 31, 12, 0, 0)
  const out = []
  for (let i = 0; i < lines; i++) {
    t += rnd(3) * 1000
    const ts = new Date(t + rnd(1000)).toISOString()
    const r = rnd(1000)
    if (i > lines / 2 && i < lines / 2 + 300 && r < 600) out.push(`${ts} ERROR payments: upstream timed out after ${1000 + rnd(8000)}ms (request ${hex(8)}-${hex(4)}-${hex(4)}-${hex(4)}-${hex(12)})`)
    else if (r < 50) out.push(`${ts} ERROR db: connection to 10.0.${rnd(10)}.${1 + rnd(250)}:5432 refused (attempt ${1 + rnd(5)})`)
    else if (r < 70) out.push(`${ts} WARN cache: slow response from node-${1 + rnd(12)} (${200 + rnd(700)} ms)`)
    else if (r < 80) out.push(`${ts} ERROR worker-${1 + rnd(8)}: panic: index out of range [${rnd(99)}] with length ${rnd(99)}`)
    else out.push(`${ts} INFO http: GET /api/orders/${rnd(99999)} 200 ${1 + rnd(80)}ms`)
  }
  writeFileSync(path, out.join("\n") + "\n")
}

async function startRedis() {
  const port = await freePort()
  const dir = join(work, `redis-${port}`)
  mkdirSync(dir)
  const p = spawn("redis-server", ["--port", String(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no", "--dir", dir], { stdio: "ignore" })
  children.push(p)
  await until("redis-server", () => { try { execFileSync("redis-cli", ["-p", String(port), "ping"], { stdio: "pipe" }); return true } catch { return false } })
  return `redis://127.0.0.1:${port}`
}

async function startApp(extra, logDir) {
  const port = await freePort()
  const log = join(work, `triage-${port}.log`)
  const fd = openSync(log, "w")
  const args = ["--listen", `127.0.0.1:${port}`, "--log-dir", logDir, "--pace", "200ms", "--sse-cycle", "2s", "--silence-timeout", "5s", ...extra]
  const p = spawn(BIN, args, { stdio: ["ignore", fd, fd], env: { ...process.env, TRIAGE_LOG: "info" } })
  children.push(p)
  const base = `http://127.0.0.1:${port}`
  await until("incident-triage", async () => (await fetch(base + "/healthz")).ok)
  return { base, log }
}

const page_state = (page) => page.evaluate(() => ({ ...window.triage, events: window.triage.events }))

// A phone: Pixel 7 emulation (mobile user agent, touch, deviceScaleFactor 2.625) with its whole
// 412×915 screen as the viewport.
const { defaultBrowserType: _, viewport: __, ...PHONE } = devices["Pixel 7"]
const PHONE_VIEWPORT = { width: 412, height: 915 }

// How wide the page lays out against the viewport: the document's scroll width, and the elements
// (tag#id.class, right edge; widest first) reaching past the viewport's right edge that no
// scrolling or clipping ancestor contains, for the failure message.
const layoutWidth = (page) => page.evaluate(() => {
  const vw = document.documentElement.clientWidth
  const clipped = (e) => {
    for (let p = e.parentElement; p && p !== document.body; p = p.parentElement)
      if (getComputedStyle(p).overflowX !== "visible") return true
    return false
  }
  const name = (e) => e.tagName.toLowerCase() + (e.id ? "#" + e.id : "") + (e.classList.length ? "." + [...e.classList].join(".") : "")
  const over = [...document.querySelectorAll("body *")]
    .map((e) => [e, Math.round(e.getBoundingClientRect().right)])
    .filter(([e, right]) => right > vw && !clipped(e))
    .sort((x, y) => y[1] - x[1])
    .map(([e, right]) => `${name(e)} (right ${right})`)
  return { scrollWidth: document.documentElement.scrollWidth, viewport: vw, over: over.slice(0, 12) }
})
async function checkFits(page, width, what) {
  const w = await layoutWidth(page)
  check(w.scrollWidth <= width, `${what}: the page is ${w.scrollWidth} px wide on a ${width}-px screen; past the edge: ${w.over.join(", ")}`)
}

// One "device": a Chromium with its own fresh profile (--user-data-dir), so its own storage.
let profiles = 0
async function device(viewport, options = {}) {
  const ctx = await launchChromium(chromium, join(work, `profile-${++profiles}`), { viewport, ...options })
  const page = ctx.pages()[0] ?? (await ctx.newPage())
  return [ctx, page]
}

async function runMode(mode) {
  const logDir = join(work, `logs-${mode}`)
  mkdirSync(logDir)
  const logPath = join(logDir, "app.log")
  writeLog(logPath, 6000)
  const extra = mode === "redis" ? ["--redis", await startRedis()] : []
  const app = await startApp(extra, logDir)
  console.log(`[${mode}] app at ${app.base}`)
  try {
    // 1. Start a run, reload mid-stream, check every event arrives exactly once.
    const [ctxA, a] = await device({ width: 1280, height: 900 })
    await a.goto(`${app.base}/?engineer=ann-${mode}`)
    await a.fill("#path", logPath)
    await a.click("#start")
    await until("a few events", async () => (await page_state(a)).seqs.length >= 5)
    await a.screenshot({ path: join(SHOTS, `${mode}-1-running.png`) })
    const before = (await page_state(a)).seqs.length
    await a.reload()
    await until("the run to finish after the reload", async () => (await page_state(a)).end === "finished", 30000)
    const s1 = await page_state(a)
    check(s1.resumedFrom, "the reloaded page resumed from a stored offset")
    check(s1.duplicates === 0, `no duplicate events (got ${s1.duplicates})`)
    check(s1.seqs.every((s, i) => s === i), `events 0..n in order, none missing: ${s1.seqs.join(",")}`)
    const info = await (await fetch(`${app.base}/api/runs/ann-${mode}/${s1.run}`)).json()
    check(info.events === s1.seqs.length, `page has all ${info.events} events (has ${s1.seqs.length}; ${before} before the reload)`)
    check(s1.connections >= 2, `SSE connections were recycled and resumed (${s1.connections})`)
    await until("command SUCCEEDED", async () => (await page_state(a)).status === "SUCCEEDED")
    check((await a.locator("#findings .finding").count()) >= 3, "findings are shown")
    check((await a.textContent("#summary")).includes("errors"), "summary is shown")
    check((await a.textContent("#findings")).includes("burst"), "the burst of timeouts is found")
    await a.screenshot({ path: join(SHOTS, `${mode}-2-finished.png`), fullPage: true })
    console.log(`[${mode}] ok: reload mid-stream resumed; ${s1.seqs.length} events exactly once; SUCCEEDED`)

    // 2. A second device follows the same engineer's run; Stop cancels it on both.
    const eng = `bob-${mode}`
    await a.goto(`${app.base}/?engineer=${eng}`)
    await a.fill("#path", logPath)
    await a.click("#start")
    await until("run started on page A", async () => (await page_state(a)).seqs.length >= 3)
    const [ctxB, b] = await device({ width: 1100, height: 850 })
    await b.goto(`${app.base}/?engineer=${eng}`)
    await until("page B follows the current run", async () => {
      const [sa, sb] = [await page_state(a), await page_state(b)]
      return sb.run === sa.run && sb.seqs.length >= sa.seqs.length && sb.seqs[0] === 0
    })
    await sleep(600)
    await b.click("#stop")
    const t0 = Date.now()
    await until("both pages show cancelled", async () => (await page_state(a)).end === "cancelled" && (await page_state(b)).end === "cancelled", 3000)
    const seen = Date.now() - t0
    const [sa, sb] = [await page_state(a), await page_state(b)]
    check(JSON.stringify(sa.events) === JSON.stringify(sb.events), "both pages show the same events")
    check(sa.duplicates === 0 && sb.duplicates === 0, "no duplicates")
    check((await a.textContent("#run-status")).includes("cancelled"), "page A's status says cancelled")
    check((await b.textContent("#run-status")).includes("cancelled"), "page B's status says cancelled")
    await until("command CANCELLED", async () => (await page_state(a)).status === "CANCELLED" && (await page_state(b)).status === "CANCELLED")
    const after = (await (await fetch(`${app.base}/api/runs/${eng}/${sa.run}`)).json()).events
    await sleep(700)
    const later = (await (await fetch(`${app.base}/api/runs/${eng}/${sa.run}`)).json()).events
    check(after === later && later === sa.seqs.length, `the producer stopped: ${sa.seqs.length} events shown, ${after} then ${later} stored`)
    await a.screenshot({ path: join(SHOTS, `${mode}-3-cancelled-a.png`) })
    await b.screenshot({ path: join(SHOTS, `${mode}-4-cancelled-b.png`) })
    console.log(`[${mode}] ok: second page showed the same ${sa.seqs.length} events; Stop seen on both in ${seen} ms; CANCELLED`)

    // 3. Uploaded text.
    await b.goto(`${app.base}/?engineer=${eng}`)
    await b.click("#tab-text")
    await b.fill("#text", readFileSync(logPath, "utf8").split("\n").slice(0, 400).join("\n"))
    await b.click("#start")
    await until("the upload run to finish", async () => (await page_state(b)).status === "SUCCEEDED", 30000)
    check((await b.textContent("#run-source")).startsWith("upload:"), "the upload is named")
    await b.screenshot({ path: join(SHOTS, `${mode}-5-upload.png`), fullPage: true })
    console.log(`[${mode}] ok: uploaded log analysed`)

    // 4. A phone: the running page fits the screen, Stop is inside the viewport, a tap stops it.
    const pe = `pia-${mode}`
    const [ctxP, p] = await device(PHONE_VIEWPORT, PHONE)
    await p.goto(`${app.base}/?engineer=${pe}`)
    await p.fill("#path", logPath)
    await p.tap("#start")
    await until("the phone's run streams", async () => (await page_state(p)).seqs.length >= 3)
    await a.goto(`${app.base}/?engineer=${pe}`)
    await until("the desktop page follows the phone's run", async () => {
      const [sp, sa] = [await page_state(p), await page_state(a)]
      return sa.run === sp.run && sa.seqs.length >= 1
    })
    for (const width of [PHONE_VIEWPORT.width, 360]) {
      await p.setViewportSize({ width, height: PHONE_VIEWPORT.height })
      await checkFits(p, width, `${width} px, run in progress`)
      await p.locator("#stop").evaluate((e) => e.scrollIntoView({ block: "center", inline: "nearest" }))
      const box = await p.locator("#stop").boundingBox()
      const scrollX = await p.evaluate(() => window.scrollX)
      check(box && scrollX === 0 && box.x >= 0 && box.y >= 0 && box.x + box.width <= width && box.y + box.height <= PHONE_VIEWPORT.height,
        `Stop lies inside the ${width}×${PHONE_VIEWPORT.height} viewport (box ${JSON.stringify(box)}, scrollX ${scrollX})`)
    }
    await p.setViewportSize(PHONE_VIEWPORT)
    await p.screenshot({ path: join(SHOTS, `${mode}-6-phone-running.png`) })
    await p.tap("#stop")
    await until("phone and desktop show cancelled", async () => (await page_state(p)).end === "cancelled" && (await page_state(a)).end === "cancelled", 3000)
    check((await p.textContent("#run-status")).includes("cancelled"), "the phone's status says cancelled")
    check((await a.textContent("#run-status")).includes("cancelled"), "the desktop page's status says cancelled")
    await until("command CANCELLED on both", async () => (await page_state(p)).status === "CANCELLED" && (await page_state(a)).status === "CANCELLED")
    await checkFits(p, PHONE_VIEWPORT.width, "412 px, cancelled")
    await p.screenshot({ path: join(SHOTS, `${mode}-7-phone-cancelled.png`) })
    console.log(`[${mode}] ok: phone at 412 px: page ${(await layoutWidth(p)).scrollWidth} px wide, Stop inside the viewport, tapped: cancelled on phone and desktop`)

    // 4b. A finished run with long unbreakable lines: findings, the open event log and the start
    // form (text tab) fit 412 and 360 px.
    const long = "x".repeat(180)
    const lines = readFileSync(logPath, "utf8").split("\n").slice(0, 300)
    for (let i = 0; i < 12; i++) lines.push(`2025-01-31T13:00:0${i % 10}Z ERROR storage: object key ${long} not found in /srv/buckets/${"y".repeat(120)}`)
    await p.tap("#tab-text")
    await p.fill("#text", lines.join("\n"))
    await p.tap("#start")
    await until("the phone's upload run to finish", async () => (await page_state(p)).status === "SUCCEEDED", 30000)
    check((await p.locator("#findings .finding").count()) >= 2, "findings are shown on the phone")
    await p.tap(".events summary")
    for (const width of [412, 360]) {
      await p.setViewportSize({ width, height: PHONE_VIEWPORT.height })
      await checkFits(p, width, `${width} px, finished run with findings and the event log open`)
      await p.screenshot({ path: join(SHOTS, `${mode}-8-phone-${width}-finished.png`), fullPage: true })
    }
    console.log(`[${mode}] ok: a finished run (findings, event log, start form) fits 412 and 360 px`)
    await ctxP.close()
    await ctxA.close()
    await ctxB.close()
  } catch (e) {
    console.error(`[${mode}] app log:\n` + readFileSync(app.log, "utf8").split("\n").slice(-40).join("\n"))
    throw e
  }
}

let failed = false
try {
  for (const mode of MODES) await runMode(mode)
} catch (e) {
  failed = true
  console.error("FAILED:", e.message)
}
console.log(failed ? "incident-triage browser tests: FAILED" : `incident-triage browser tests: ok (${MODES.join(", ")}); screenshots in ${SHOTS}`)
process.exit(failed ? 1 : 0)
