// Incident triage page: starts runs, follows the engineer's current run over SSE (EventSource),
// resumes after a reload from the last event id kept in sessionStorage, and stops runs.
// State for tests and debugging: window.triage = { run, seqs, duplicates, end, status, resumedFrom }.
"use strict"

const $ = (id) => document.getElementById(id)
const state = (window.triage = { engineer: "", run: null, seqs: [], duplicates: 0, end: null, status: null, resumedFrom: null, connections: 0 })
let es = null
let lastId = null
let pollTimer = null
let kind = "path"

function cacheKey(run) { return `triage:run:${run}` }
function saveCache() {
  if (!state.run) return
  try { sessionStorage.setItem(cacheKey(state.run), JSON.stringify({ lastId, events: state.events })) } catch {}
}
function loadCache(run) {
  try { return JSON.parse(sessionStorage.getItem(cacheKey(run)) || "null") } catch { return null }
}

async function api(method, url, body) {
  const res = await fetch(url, { method, headers: body ? { "content-type": "application/json" } : {}, body: body ? JSON.stringify(body) : undefined })
  let data = null
  try { data = await res.json() } catch {}
  return { status: res.status, ok: res.ok, data }
}

function fmt(n) { return Number(n || 0).toLocaleString("en-US") }
function el(tag, cls, text) {
  const e = document.createElement(tag)
  if (cls) e.className = cls
  if (text !== undefined) e.textContent = text
  return e
}

function setMessage(text, isError) {
  const m = $("start-message")
  m.textContent = text || ""
  m.classList.toggle("error", !!isError)
}

function setStatus(label, s) {
  const st = $("run-status")
  st.textContent = label
  st.dataset.state = s
}

function resetRun(info) {
  state.run = info.run
  state.seqs = []
  state.events = []
  state.duplicates = 0
  state.end = null
  state.status = info.status || null
  state.resumedFrom = null
  lastId = null
  $("empty").classList.add("hidden")
  $("run").classList.remove("hidden")
  $("run-source").textContent = info.source || info.stream
  $("run-id").textContent = `${info.stream}`
  $("findings").replaceChildren()
  $("event-log").replaceChildren()
  $("summary").classList.add("hidden")
  $("outcome").classList.add("hidden")
  $("findings-count").textContent = ""
  placeholder("Findings appear once the whole log has been read.")
  $("bar").style.width = "0%"
  for (const k of ["percent", "lines", "errors", "warnings", "signatures"]) $("st-" + k).textContent = k === "percent" ? "0%" : "0"
  setStatus("running", "running")
  $("stop").disabled = false
  $("explain-stream").textContent = info.stream
}

function render(ev) {
  const log = el("li", null, `#${ev.seq ?? "–"} ${ev.type ?? "error"}${ev.type === "progress" ? " " + ev.percent + "%" : ""}`)
  $("event-log").append(log)
  $("event-count").textContent = `${state.seqs.length} events`
  if (ev.error) {
    showOutcome("failed", `Analysis failed: ${ev.error}`)
    return
  }
  switch (ev.type) {
    case "started":
      $("run-source").textContent = ev.source
      $("run-id").textContent = `${ev.engineer} · run ${ev.run} · ${fmt(ev.bytes_total)} bytes · on ${ev.worker}`
      break
    case "progress":
      $("bar").style.width = ev.percent + "%"
      $("st-percent").textContent = ev.percent + "%"
      for (const k of ["lines", "errors", "warnings", "signatures"]) $("st-" + k).textContent = fmt(ev[k])
      break
    case "finding": renderFinding(ev); break
    case "summary": {
      const s = $("summary")
      s.textContent = ev.headline
      s.classList.remove("hidden")
      if (!ev.findings) placeholder("No error or warning lines: nothing to report.")
      for (const k of ["lines", "errors", "warnings", "signatures"]) $("st-" + k).textContent = fmt(ev[k])
      $("bar").style.width = "100%"
      $("st-percent").textContent = "100%"
      break
    }
  }
}

function renderFinding(f) {
  const li = el("li", "finding " + f.severity)
  li.dataset.rank = f.rank
  const row = el("div", "row")
  const sig = el("div", "sig")
  sig.append(el("span", "rank", `#${f.rank}`), document.createTextNode(" " + f.signature))
  row.append(sig, el("div", "count", `×${fmt(f.count)}`))
  const share = el("div", "share")
  const bar = el("i")
  bar.style.width = Math.min(100, f.share) + "%"
  share.append(bar)
  const facts = el("div", "facts")
  facts.append(el("span", null, `${f.severity} · ${f.share}% of flagged lines`))
  facts.append(el("span", null, `first: line ${fmt(f.first.line)}${f.first.at ? " · " + f.first.at : ""}`))
  facts.append(el("span", null, `last: line ${fmt(f.last.line)}${f.last.at ? " · " + f.last.at : ""}`))
  if (f.burst) facts.append(el("span", "burst", `burst: ×${fmt(f.burst.count)} within ${f.burst.window} from ${f.burst.start} (${f.burst.times_mean}× the mean)`))
  li.append(row, share, facts, el("div", "sample", f.sample))
  $("findings").append(li)
  placeholder("")
  $("findings-count").textContent = `${$("findings").children.length}`
}

function placeholder(text) {
  const p = $("findings-empty")
  p.textContent = text || ""
  p.classList.toggle("hidden", !text)
}

function showOutcome(cls, text) {
  const o = $("outcome")
  o.className = "outcome " + cls
  o.textContent = text
}

function accept(ev, id) {
  if (typeof ev.seq === "number" && state.seqs.includes(ev.seq)) { state.duplicates++; return }
  if (typeof ev.seq === "number") state.seqs.push(ev.seq)
  state.events.push(ev)
  if (id) lastId = id
  render(ev)
  saveCache()
}

const END_TEXT = {
  finished: ["finished", "finished"],
  cancelled: ["cancelled", "cancelled"],
  producer_lost: ["producer lost", "producer_lost"],
}

function ended(reason) {
  state.end = reason
  const [label, s] = END_TEXT[reason] || [reason, "failed"]
  setStatus(label, s)
  $("stop").disabled = true
  if (reason !== "finished" && !$("findings").children.length) placeholder("The run ended before the whole log was read.")
  if (reason === "cancelled") showOutcome("cancelled", "Cancelled: the run was stopped.")
  if (reason === "producer_lost") showOutcome("failed", "Producer lost: the process running the analysis stopped sending events.")
  if (es) { es.close(); es = null }
  $("conn").textContent = "run ended"
  watchCommand(state.run)
}

// After the stream ends, the monitor completes the command within about a second: show it.
async function watchCommand(run) {
  for (let i = 0; i < 40 && state.run === run; i++) {
    const r = await api("GET", `/api/runs/${state.engineer}/${run}`)
    if (r.ok && r.data.status && !["SUBMITTED", "RUNNING"].includes(r.data.status)) {
      state.status = r.data.status
      if (r.data.status === "FAILED") showOutcome("failed", r.data.error || "Failed.")
      else if (r.data.status === "SUCCEEDED" && !state.events.some((e) => e.error)) showOutcome("finished", "Succeeded: the command completed with the summary below.")
      else if (r.data.status === "CANCELLED") showOutcome("cancelled", "Cancelled: the run was stopped; the command is CANCELLED.")
      return
    }
    await new Promise((r) => setTimeout(r, 500))
  }
}

function connect() {
  if (es) es.close()
  const run = state.run
  const url = `/api/runs/${encodeURIComponent(state.engineer)}/${run}/events?offset=${encodeURIComponent(lastId || "-1")}`
  if (lastId && state.resumedFrom === null) state.resumedFrom = lastId
  es = new EventSource(url)
  es.onopen = () => { state.connections++; $("conn").textContent = "live" }
  es.addEventListener("triage", (e) => accept(JSON.parse(e.data), e.lastEventId))
  es.addEventListener("end", (e) => ended(JSON.parse(e.data).reason))
  es.addEventListener("failure", (e) => { setMessage(JSON.parse(e.data).error, true) })
  es.onerror = () => {
    if (state.run !== run || state.end) return
    $("conn").textContent = "reconnecting…"
    if (es && es.readyState === EventSource.CLOSED) setTimeout(() => { if (state.run === run && !state.end) connect() }, 1000)
  }
}

function follow(info) {
  const cached = loadCache(info.run)
  resetRun(info)
  if (cached && cached.events) {
    for (const ev of cached.events) { state.seqs.push(ev.seq); state.events.push(ev); render(ev) }
    lastId = cached.lastId
  }
  if (info.stream_end && !cached) {
    // Already over: replay it all from the start (the SSE sends the end too).
  }
  connect()
}

async function checkCurrent() {
  if (!state.engineer) return
  const r = await api("GET", `/api/engineers/${encodeURIComponent(state.engineer)}/current`)
  if (r.ok && r.data.run && r.data.run !== state.run && !(state.run && !state.end)) follow(r.data)
}

function setEngineer(e) {
  state.engineer = e
  localStorage.setItem("triage:engineer", e)
  const u = new URL(location.href)
  u.searchParams.set("engineer", e)
  history.replaceState(null, "", u)
}

$("start-form").addEventListener("submit", async (e) => {
  e.preventDefault()
  const engineer = $("engineer").value.trim()
  if (!engineer) return
  setEngineer(engineer)
  const source = kind === "path" ? { kind, path: $("path").value.trim() } : { kind, name: $("file").files[0]?.name || "pasted.log", text: $("text").value }
  $("start").disabled = true
  setMessage("Starting…")
  const r = await api("POST", "/api/runs", { engineer, source })
  $("start").disabled = false
  if (r.status === 201) { setMessage(""); follow(r.data) }
  else if (r.status === 409 && r.data.current) { setMessage("You already have a run in progress — following it."); if (r.data.current.run !== state.run) follow(r.data.current) }
  else setMessage(r.data?.error || `Could not start (HTTP ${r.status})`, true)
})

$("stop").addEventListener("click", async () => {
  if (!state.run) return
  $("stop").disabled = true
  const r = await api("POST", `/api/runs/${encodeURIComponent(state.engineer)}/${state.run}/stop`)
  if (!r.ok) { setMessage(r.data?.error || "Stop failed", true); $("stop").disabled = false }
})

$("engineer").addEventListener("change", () => {
  const e = $("engineer").value.trim()
  if (e && e !== state.engineer) { setEngineer(e); if (!state.run || state.end) checkCurrent() }
})

for (const t of document.querySelectorAll(".tab")) {
  t.addEventListener("click", () => {
    kind = t.dataset.kind
    for (const o of document.querySelectorAll(".tab")) o.classList.toggle("active", o === t)
    $("source-path").classList.toggle("hidden", kind !== "path")
    $("source-text").classList.toggle("hidden", kind !== "text")
  })
}

$("file").addEventListener("change", async () => {
  const f = $("file").files[0]
  if (f) $("text").value = await f.text()
})

async function init() {
  const cfg = await api("GET", "/api/config")
  if (cfg.ok) {
    $("backend").textContent = cfg.data.backend === "redis" ? "Redis" : "in memory"
    $("worker").textContent = cfg.data.worker
    $("dirs-hint").textContent = `Files under ${cfg.data.log_dirs.join(", ")}`
  }
  api("GET", "/api/logs").then((r) => {
    if (!r.ok) return
    for (const f of r.data) {
      const o = document.createElement("option")
      o.value = f.path
      o.label = `${(f.size / 1024).toFixed(f.size < 10240 ? 1 : 0)} KiB`
      $("log-files").append(o)
    }
    if (!$("path").value && r.data[0]) $("path").placeholder = r.data[0].path
  })
  const e = new URLSearchParams(location.search).get("engineer") || localStorage.getItem("triage:engineer") || ""
  if (e) { $("engineer").value = e; setEngineer(e); await checkCurrent() }
  // Another device may start a run for this engineer: look for it while idle.
  pollTimer = setInterval(() => { if (!state.run || state.end) checkCurrent() }, 2000)
}
init()
