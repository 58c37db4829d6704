// Baton dashboard: one EventSource on /v1/dashboard/events (a JSON snapshot every second) drives
// the queues, commands and dead-letter views; actions use the JSON API; the streams view lists
// streams by prefix (/v1/streams) and follows one with /v1/stream/{path}?offset=-1&live=sse; the
// workers view polls /v1/queues/{queue}/workers. A bearer token, when the server needs one, is kept in
// sessionStorage, sent as `Authorization` with fetch and as `access_token` with EventSource.
"use strict";
(() => {
  const $ = (id) => document.getElementById(id);
  const TERMINAL = new Set(["SUCCEEDED", "FAILED", "CANCELLED"]);
  const STATUSES = ["SUBMITTED", "RUNNING", "SUCCEEDED", "FAILED", "CANCELLED"];

  const state = {
    token: sessionStorage.getItem("baton.token") || "",
    snapshot: null,
    es: null,
    selected: null, // command id
    detail: null, // its state
    timeline: null, // {id, offset, events, busy, again}: its events read so far
    streamEs: null,
    stream: null, // {path, url, contentType, offset}
  };

  // ---- helpers ------------------------------------------------------------------------------
  function h(tag, attrs, ...children) {
    const el = document.createElement(tag);
    for (const [k, v] of Object.entries(attrs || {})) {
      if (v === null || v === undefined || v === false) continue;
      if (k === "class") el.className = v;
      else if (k.startsWith("on")) el.addEventListener(k.slice(2), v);
      else el.setAttribute(k, v === true ? "" : String(v));
    }
    for (const c of children.flat()) {
      if (c === null || c === undefined) continue;
      el.append(c instanceof Node ? c : document.createTextNode(String(c)));
    }
    return el;
  }
  const num = (n) => (n === undefined || n === null ? "–" : Number(n).toLocaleString());
  const badge = (s) => h("span", { class: `badge ${s}` }, s);
  /** How far ahead an RFC 3339 time is: "in 5s", "in 3m", "in 2h", "in 4d" ("now" once due). */
  function dueIn(iso) {
    if (!iso) return "–";
    const s = (Date.parse(iso) - Date.now()) / 1000;
    if (s < 1) return "now";
    if (s < 60) return `in ${Math.floor(s)}s`;
    if (s < 3600) return `in ${Math.floor(s / 60)}m`;
    if (s < 86400) return `in ${Math.floor(s / 3600)}h`;
    return `in ${Math.floor(s / 86400)}d`;
  }
  function ago(iso) {
    if (!iso) return "–";
    const s = Math.max(0, (Date.now() - Date.parse(iso)) / 1000);
    if (s < 1) return "just now";
    if (s < 60) return `${Math.floor(s)}s ago`;
    if (s < 3600) return `${Math.floor(s / 60)}m ago`;
    if (s < 86400) return `${Math.floor(s / 3600)}h ago`;
    return new Date(iso).toLocaleString();
  }
  const timeCell = (iso) => h("td", { title: iso || "" }, h("time", { datetime: iso || "" }, ago(iso)));
  const enc = (s) => encodeURIComponent(s);
  const streamUrl = (path) => "/v1/stream/" + path.split("/").filter(Boolean).map(enc).join("/");
  // The page URL of a followed stream (`#streams:acme/run-1`): each segment percent-encoded, so
  // that a `%` or an encoded-looking `%7B` in a path comes back as that exact path.
  const streamHash = (path) => "#streams:" + path.split("/").map(enc).join("/");
  function hashPath(hash) {
    const raw = hash.slice("#streams:".length);
    // A hand-typed link may hold a bare `%`: such a segment is taken as it is.
    return raw.split("/").map((s) => { try { return decodeURIComponent(s); } catch { return s; } }).join("/");
  }
  function withToken(url) {
    if (!state.token) return url;
    return url + (url.includes("?") ? "&" : "?") + "access_token=" + enc(state.token);
  }
  async function api(method, url, body, headers) {
    const hdrs = Object.assign({}, headers || {});
    if (state.token) hdrs["Authorization"] = "Bearer " + state.token;
    let res;
    try {
      res = await fetch(url, { method, headers: hdrs, body });
    } catch (e) {
      return { ok: false, status: 0, body: null, message: "the server cannot be reached" };
    }
    let data = null;
    const text = await res.text();
    try { data = text ? JSON.parse(text) : null; } catch { data = text; }
    let message = "";
    if (!res.ok) {
      if (data && typeof data.error === "string") message = data.message || data.error;
      else message = `HTTP ${res.status}`;
    }
    return { ok: res.ok, status: res.status, body: data, message, res };
  }
  let toastTimer = null;
  function toast(msg, isError) {
    const t = $("toast");
    t.textContent = msg;
    t.className = "toast" + (isError ? " error" : "");
    t.hidden = false;
    clearTimeout(toastTimer);
    toastTimer = setTimeout(() => (t.hidden = true), isError ? 7000 : 3500);
  }
  function setConn(kind, text) {
    $("conn").className = "conn " + kind;
    $("conn-text").textContent = text;
  }
  function authBanner(msg) {
    const b = $("auth-banner");
    b.textContent = msg || "";
    b.hidden = !msg;
  }

  // ---- tabs ---------------------------------------------------------------------------------
  const tabs = [...document.querySelectorAll('[role="tab"]')];
  function selectTab(tab, focus) {
    for (const t of tabs) {
      const on = t === tab;
      t.setAttribute("aria-selected", on ? "true" : "false");
      t.tabIndex = on ? 0 : -1;
      $(t.getAttribute("aria-controls")).hidden = !on;
    }
    if (focus) tab.focus();
    history.replaceState(null, "", "#" + tab.id.slice(4));
  }
  tabs.forEach((t, i) => {
    t.addEventListener("click", () => selectTab(t));
    t.addEventListener("keydown", (e) => {
      let j = null;
      if (e.key === "ArrowRight") j = (i + 1) % tabs.length;
      if (e.key === "ArrowLeft") j = (i - 1 + tabs.length) % tabs.length;
      if (e.key === "Home") j = 0;
      if (e.key === "End") j = tabs.length - 1;
      if (j !== null) { e.preventDefault(); selectTab(tabs[j], true); }
    });
  });
  const initial = tabs.find((t) => "#" + t.id.slice(4) === location.hash);
  if (initial) selectTab(initial);

  // ---- live snapshot ------------------------------------------------------------------------
  async function connect() {
    if (state.es) { state.es.close(); state.es = null; }
    // A plain request first: EventSource cannot tell a 401 from a network error.
    const probe = await api("GET", "/v1/queues");
    if (probe.status === 401 || probe.status === 403) {
      setConn("down", "token needed");
      authBanner(state.token
        ? `This token was refused: ${probe.message}`
        : "This server requires a bearer token: enter it above (it is kept in this tab only).");
      $("token").focus();
      return;
    }
    authBanner("");
    const q = new URLSearchParams();
    const fq = $("filter-queue").value, fs = $("filter-status").value;
    if (fq) q.set("queue", fq);
    if (fs) q.set("status", fs);
    q.set("limit", "100");
    const es = new EventSource(withToken("/v1/dashboard/events?" + q.toString()));
    state.es = es;
    setConn("", "connecting…");
    es.addEventListener("open", () => setConn("live", "live"));
    es.addEventListener("snapshot", (e) => {
      setConn("live", "live");
      try { render(JSON.parse(e.data)); } catch (err) { console.error(err); }
    });
    es.addEventListener("error", () => {
      if (state.es !== es) return;
      setConn("down", es.readyState === EventSource.CLOSED ? "disconnected" : "reconnecting…");
      if (es.readyState === EventSource.CLOSED) setTimeout(() => state.es === es && connect(), 2000);
    });
  }

  function render(s) {
    state.snapshot = s;
    const srv = s.server || {};
    $("server-info").textContent = `v${srv.version || "?"} · ${srv.backend || ""}${srv.auth === "bearer" ? " · tokens required" : ""}`;
    renderQueues(s);
    renderCommands(s);
    renderDead(s);
    renderOps(s);
    chartsQueues(s);
    if (state.selected) refreshDetail(s);
    if (s.errors && s.errors.length) console.warn("dashboard:", s.errors);
  }

  function renderQueues(s) {
    const totals = { SUBMITTED: 0, RUNNING: 0, SUCCEEDED: 0, FAILED: 0, CANCELLED: 0, DEAD: 0 };
    const body = h("tbody");
    for (const q of s.queues) {
      const c = q.commands || {};
      for (const st of STATUSES) totals[st] += c[st.toLowerCase()] || 0;
      totals.DEAD += q.dead_letters || 0;
      const n = (v) => h("td", { class: "num" }, v ? num(v) : h("span", { class: "zero" }, "0"));
      if (q.error) {
        body.append(h("tr", {}, h("th", { scope: "row" }, q.name), h("td", { colspan: 12, class: "wrap" }, "error: " + q.error)));
        continue;
      }
      body.append(h("tr", { "data-queue": q.name, "data-paused": q.paused ? "1" : null, class: q.paused ? "paused" : null },
        h("th", { scope: "row" }, q.name,
          q.paused ? h("span", { class: "badge PAUSED", title: "Paused " + ago(q.paused_since) + ": submits wait, nothing new starts" }, "PAUSED") : null,
          q.backoff_ms ? h("span", { class: "badge BACKOFF", title: `Backing off after a rate limited answer: nothing new starts for ${num(q.backoff_ms)} ms more` }, "BACKING OFF") : null,
          q.rate_limit ? h("span", { class: "muted", title: `Rate limit: at most ${num(q.rate_limit.limit)} started per ${num(q.rate_limit.per_ms)} ms by all workers, bursts of ${num(q.rate_limit.burst)}` },
            ` ≤${num(q.rate_limit.limit)}/${q.rate_limit.per_ms === 1000 ? "s" : num(q.rate_limit.per_ms) + "ms"}`) : null,
          q.rate_limit_per_key ? h("span", { class: "muted", title: `Rate limit per concurrency key: at most ${num(q.rate_limit_per_key.limit)} of one key started per ${num(q.rate_limit_per_key.per_ms)} ms, bursts of ${num(q.rate_limit_per_key.burst)}` },
            ` ≤${num(q.rate_limit_per_key.limit)}/${q.rate_limit_per_key.per_ms === 1000 ? "s" : num(q.rate_limit_per_key.per_ms) + "ms"} per key`) : null,
          // Throttled per key: waiting for a slot of their key, or for their key's rate.
          q.key_waiting ? h("span", { class: "badge THROTTLED", "data-key-waiting": q.key_waiting, title: `${num(q.key_waiting)} waiting for a slot of their concurrency key` }, `${num(q.key_waiting)} KEY-WAITING`) : null,
          q.key_rate_delayed ? h("span", { class: "badge THROTTLED", "data-key-rate-delayed": q.key_rate_delayed, title: `${num(q.key_rate_delayed)} waiting for their concurrency key's rate` }, `${num(q.key_rate_delayed)} RATE-LIMITED`) : null,
          pauseButton(q)),
        n(q.length), n(q.pending),
        // Live consumers; dead ones (silent past their claim timeout, not reaped yet) apart.
        h("td", { class: "num", "data-dead": q.dead_consumers || 0 }, num(q.consumers || 0),
          q.dead_consumers ? h("span", { class: "muted" }, ` +${num(q.dead_consumers)} dead`) : null),
        n(q.lag), n(q.delayed),
        // Submitted, of which scheduled (waiting for their due time) apart, with the next due time.
        h("td", { class: "num", "data-scheduled": c.scheduled || 0 }, c.submitted ? num(c.submitted) : h("span", { class: "zero" }, "0"),
          c.scheduled ? h("span", { class: "muted", title: "scheduled, next due " + (c.next_due || "–") },
            ` (${num(c.scheduled)} scheduled, next ${dueIn(c.next_due)})`) : null),
        n(c.running), n(c.succeeded), n(c.failed), n(c.cancelled), n(q.dead_letters),
        h("td", { class: "muted" }, (q.handlers || []).join(", ") + (q.workers ? "" : " (no workers here)")),
      ));
    }
    $("queues-table").querySelector("tbody").replaceWith(body);
    $("queues-empty").hidden = s.queues.length > 0;
    // Per-key counts of every queue that has any.
    const keys = h("tbody");
    for (const q of s.queues) {
      for (const k of q.keys || []) {
        const n = (v) => h("td", { class: "num" }, v ? num(v) : h("span", { class: "zero" }, "0"));
        keys.append(h("tr", { "data-queue": q.name, "data-key": k.key },
          h("td", {}, q.name), h("th", { scope: "row", class: "mono" }, k.key), n(k.active), n(k.waiting), n(k.rate_delayed)));
      }
    }
    $("keys-table").querySelector("tbody").replaceWith(keys);
    $("keys-panel").hidden = keys.children.length === 0;
    const labels = { SUBMITTED: "Submitted", RUNNING: "Running", SUCCEEDED: "Succeeded", FAILED: "Failed", CANCELLED: "Cancelled", DEAD: "Dead letters" };
    $("totals").replaceChildren(...Object.entries(totals).map(([k, v]) =>
      h("div", { class: `card ${k}` }, h("div", { class: "label" }, labels[k]), h("div", { class: "value" }, num(v)))));
    $("count-queues").textContent = s.queues.length || "";
    // Keep the queue filter's options in step with the queues.
    const sel = $("filter-queue");
    const have = [...sel.options].map((o) => o.value).filter(Boolean).join("\n");
    const want = s.queues.map((q) => q.name).join("\n");
    if (have !== want) {
      const cur = sel.value;
      sel.replaceChildren(h("option", { value: "" }, "all"), ...s.queues.map((q) => h("option", { value: q.name }, q.name)));
      sel.value = cur;
    }
  }

  function renderCommands(s) {
    const body = h("tbody");
    for (const c of s.commands) {
      const tr = h("tr", {
        "data-id": c.id, "data-status": c.status, tabindex: 0,
        "aria-selected": c.id === state.selected ? "true" : "false",
        onclick: () => select(c.id),
        onkeydown: (e) => { if (e.key === "Enter" || e.key === " ") { e.preventDefault(); select(c.id); } },
      },
      h("td", { class: "mono" }, c.id), h("td", {}, c.queue), h("td", {}, c.type),
      h("td", {}, badge(c.status), c.execution ? h("span", { class: "muted running", title: executionText(c.execution) }, " running" + (progressPct(c.progress) ? " " + progressPct(c.progress) : "")) : null),
      h("td", { class: "num" }, num(c.attempts)), timeCell(c.created_at), timeCell(c.modified_at));
      body.append(tr);
    }
    const old = $("commands-table").querySelector("tbody");
    const focusedId = document.activeElement && document.activeElement.closest && document.activeElement.closest("#commands-table tr")?.dataset.id;
    old.replaceWith(body);
    if (focusedId) body.querySelector(`tr[data-id="${CSS.escape(focusedId)}"]`)?.focus();
    $("commands-empty").hidden = s.commands.length > 0;
    const active = s.queues.reduce((a, q) => a + ((q.commands || {}).running || 0) + ((q.commands || {}).submitted || 0), 0);
    $("count-commands").textContent = active ? String(active) : "";
  }

  function renderDead(s) {
    const body = h("tbody");
    for (const d of s.dead_letters) {
      body.append(h("tr", { "data-id": d.id, "data-queue": d.queue },
        h("td", {}, d.queue), h("td", { class: "mono" }, d.id), h("td", { class: "mono" }, d.command_id || "–"),
        h("td", { class: "num" }, num(d.deliveries)), h("td", { class: "wrap" }, d.reason),
        timeCell(d.dead_lettered_at), h("td", { class: "mono wrap" }, d.payload.length > 120 ? d.payload.slice(0, 119) + "…" : d.payload),
        h("td", {}, h("button", { type: "button", class: "small", "aria-label": `Replay dead letter ${d.id} of ${d.queue}`, onclick: (e) => replay(d, e.target) }, "Replay"))));
    }
    $("dead-table").querySelector("tbody").replaceWith(body);
    $("dead-empty").hidden = s.dead_letters.length > 0;
    const c = $("count-dead");
    c.textContent = s.dead_letters.length ? String(s.dead_letters.length) : "";
    c.classList.toggle("alert", s.dead_letters.length > 0);
  }

  // ---- command detail -----------------------------------------------------------------------
  async function select(id) {
    state.selected = id;
    for (const tr of document.querySelectorAll("#commands-table tbody tr")) tr.setAttribute("aria-selected", tr.dataset.id === id ? "true" : "false");
    $("detail").hidden = false;
    const r = await api("GET", "/v1/commands/" + enc(id));
    if (state.selected !== id) return;
    if (!r.ok) { toast(`Cannot load ${id}: ${r.message}`, true); return; }
    showDetail(r.body);
  }
  // "42%" from a state's progress, or "" without a fraction.
  function progressPct(p) {
    return p && typeof p.fraction === "number" ? Math.round(p.fraction * 100) + "%" : "";
  }
  function progressText(p) {
    return [progressPct(p), p && p.message].filter(Boolean).join(" ");
  }
  function executionText(e) {
    return `${e.call} on ${e.worker} since ${e.since}, delivery ${e.deliveries}, deadline ${e.deadline}`;
  }
  // The command's events (GET /v1/commands/{id}/events, the queue's durable feed), read on from
  // the last offset each time the detail is shown again.
  async function loadTimeline(id) {
    let tl = state.timeline;
    if (!tl || tl.id !== id) tl = state.timeline = { id, offset: "-1", events: [], busy: false, again: false };
    if (tl.busy) { tl.again = true; return; }
    tl.busy = true;
    try {
      for (let page = 0; page < 20; page++) {
        const r = await api("GET", `/v1/commands/${enc(id)}/events?offset=${enc(tl.offset)}`);
        if (state.timeline !== tl) return;
        if (!r.ok) {
          $("detail-timeline").replaceChildren(h("li", { class: "muted" }, `Events unavailable: ${r.message}`));
          return;
        }
        tl.events.push(...(Array.isArray(r.body) ? r.body : []));
        tl.offset = r.res.headers.get("Stream-Next-Offset") || tl.offset;
        if (r.res.headers.get("Stream-Up-To-Date") === "true") break;
      }
      renderTimeline(tl);
    } finally {
      tl.busy = false;
      if (tl.again && state.timeline === tl) { tl.again = false; loadTimeline(id); }
    }
  }
  function eventText(e) {
    const parts = [e.event.replace(/_/g, " ")];
    if (e.progress) parts.push(progressText(e.progress));
    if (e.error) parts.push(e.error);
    if (typeof e.retry_in_ms === "number") parts.push(`retry in ${e.retry_in_ms} ms`);
    if (e.handed_off_to) parts.push(`to ${e.handed_off_to}`);
    if (e.worker) parts.push(`on ${e.worker}`);
    return parts.join(" · ");
  }
  function renderTimeline(tl) {
    // `title` keeps the exact time when the page's clock shows it as "… ago".
    const items = tl.events.map((e) => h("li", { "data-event": e.event }, h("time", { datetime: e.at, title: e.at }, e.at), " ", eventText(e)));
    $("detail-timeline").replaceChildren(...(items.length ? items : [h("li", { class: "muted" }, "No events (this queue's feed may be off)")]));
  }
  function showDetail(c) {
    if (!state.detail || state.detail.id !== c.id) $("detail-timeline").replaceChildren();
    state.detail = c;
    loadTimeline(c.id);
    $("detail-title").textContent = "Command " + c.id;
    const facts = [["Status", badge(c.status)], ["Queue", c.queue], ["Type", c.type], ["Attempts", String(c.attempts)],
      ["Created", c.created_at], ["Completed", c.completed_at || "–"]];
    if (c.run_at) facts.push(["Due", c.run_at + (c.status === "SUBMITTED" && !c.started_at ? ` (${dueIn(c.run_at)})` : "")]);
    if (c.execution) facts.push(["Running", executionText(c.execution)]);
    if (c.progress) facts.push(["Progress", progressText(c.progress)]);
    if (c.error) facts.push(["Error", c.error]);
    const output = outputFact(c);
    if (output) facts.push(output);
    $("detail-facts").replaceChildren(...facts.flatMap(([k, v]) => [h("dt", {}, k), h("dd", {}, v)]));
    $("detail-json").textContent = JSON.stringify(c, null, 2);
    const btn = $("cancel-btn");
    btn.disabled = TERMINAL.has(c.status);
    btn.title = btn.disabled ? `Already ${c.status.toLowerCase()}` : "";
    const retry = $("retry-btn");
    retry.disabled = !(c.status === "FAILED" || c.status === "CANCELLED");
    retry.title = retry.disabled ? "Only a FAILED or CANCELLED command can be re-run" : "Run it again from the start";
  }
  // The command's output stream (its state's `output`): a link that follows it live in the
  // Streams tab (openStream); `#streams:<path>` opens it there in a new tab too.
  function outputFact(c) {
    if (!c.output || typeof c.output.stream !== "string") return null;
    const path = c.output.stream;
    const run = c.output.run > 1 ? ` (run ${c.output.run})` : "";
    const a = h("a", { href: "#streams:" + path, id: "detail-output", title: `Follow ${c.output.url} live` }, path);
    a.addEventListener("click", (e) => {
      e.preventDefault();
      selectTab($("tab-streams"));
      $("stream-path").value = path;
      openStream(path);
    });
    return ["Output", h("span", {}, a, run)];
  }
  function refreshDetail(s) {
    const inList = s.commands.find((c) => c.id === state.selected);
    if (inList) { if (!state.detail || inList.version !== state.detail.version) showDetail(inList); return; }
    if (state.detail && !TERMINAL.has(state.detail.status)) {
      const id = state.selected;
      api("GET", "/v1/commands/" + enc(id)).then((r) => { if (r.ok && state.selected === id) showDetail(r.body); });
    }
  }
  $("detail-close").addEventListener("click", () => {
    const id = state.selected;
    state.selected = null; state.detail = null; state.timeline = null; $("detail").hidden = true;
    document.querySelector(`#commands-table tr[data-id="${CSS.escape(id || "")}"]`)?.focus();
  });
  // Two clicks act: the first arms the button ("Confirm …?") for 4 seconds, the second acts.
  function confirmed(btn, label, ask, act) {
    let timer = null;
    const disarm = () => { clearTimeout(timer); btn.dataset.armed = ""; btn.textContent = label; };
    btn.addEventListener("click", async () => {
      if (btn.dataset.armed !== "1") {
        btn.dataset.armed = "1";
        btn.textContent = ask;
        timer = setTimeout(disarm, 4000);
        return;
      }
      disarm();
      await act();
    });
  }
  confirmed($("cancel-btn"), "Cancel command", "Confirm cancel?", async () => {
    const id = state.selected;
    if (!id) return;
    $("cancel-btn").disabled = true;
    const r = await api("POST", `/v1/commands/${enc(id)}/cancel`);
    if (r.ok) { showDetail(r.body); toast(`Cancelled ${id}`); }
    else {
      if (r.body && r.body.state) showDetail(r.body.state);
      else $("cancel-btn").disabled = false;
      toast(`Cannot cancel ${id}: ${r.message}`, true);
    }
  });
  confirmed($("retry-btn"), "Retry command", "Confirm retry?", async () => {
    const id = state.selected;
    if (!id) return;
    $("retry-btn").disabled = true;
    const r = await api("POST", `/v1/commands/${enc(id)}/retry`);
    if (r.ok) { showDetail(r.body); toast(`Re-running ${id}`); }
    else {
      if (r.body && r.body.state) showDetail(r.body.state);
      else $("retry-btn").disabled = false;
      toast(`Cannot retry ${id}: ${r.message}`, true);
    }
  });

  // ---- pause / resume (POST /v1/queues/{queue}/pause|resume) ---------------------------------
  // The rows are redrawn every second, so a button's armed state ("Confirm pause?", 4 s) is kept
  // here, not on the element.
  const pauseArm = { key: "", until: 0 };
  function pauseButton(q) {
    const verb = q.paused ? "resume" : "pause";
    const key = verb + "\n" + q.name;
    const armed = pauseArm.key === key && Date.now() < pauseArm.until;
    const label = q.paused ? "Resume" : "Pause";
    return h("button", {
      class: "small secondary pause-btn", type: "button", "data-action": verb, "data-armed": armed ? "1" : null,
      title: q.paused ? "Start the waiting commands again" : "Accept submits but start nothing new; running commands go on",
      onclick: async (e) => {
        e.stopPropagation();
        const btn = e.currentTarget;
        if (!(pauseArm.key === key && Date.now() < pauseArm.until)) {
          pauseArm.key = key; pauseArm.until = Date.now() + 4000;
          btn.dataset.armed = "1";
          btn.textContent = `Confirm ${verb}?`;
          return;
        }
        pauseArm.key = "";
        btn.disabled = true;
        const r = await api("POST", `/v1/queues/${enc(q.name)}/${verb}`);
        if (r.ok) toast(r.body.changed ? `${q.paused ? "Resumed" : "Paused"} ${q.name}` : `${q.name} already ${q.paused ? "running" : "paused"}`);
        else { btn.disabled = false; toast(`Cannot ${verb} ${q.name}: ${r.message}`, true); }
      },
    }, armed ? `Confirm ${verb}?` : label);
  }

  // ---- dead letters -------------------------------------------------------------------------
  async function replay(d, btn) {
    btn.disabled = true;
    const r = await api("POST", `/v1/queues/${enc(d.queue)}/dead-letters/${enc(d.id)}/replay`);
    if (r.ok) toast(`Replayed ${d.id} onto ${d.queue} as ${r.body.id}`);
    else { btn.disabled = false; toast(`Cannot replay ${d.id}: ${r.message}`, true); }
  }

  // ---- per-minute charts (queues view, "Last hour") -----------------------------------------
  // GET /v1/queues/{queue}/minutes?last=60 for the chosen queue, every CHARTS_EVERY ms while the
  // queues view shows, drawn as inline SVG polylines (one point per minute, oldest first; a
  // minute without a value, e.g. depth nobody sampled, breaks the line).
  const CHARTS_MINUTES = 60, CHARTS_EVERY = 5000;
  const charts = { queue: "", busy: false, timer: null };
  // The SVG namespace, as the HTML parser gives it (the page holds no URL literal).
  const SVGNS = (() => { const t = document.createElement("template"); t.innerHTML = "<svg></svg>"; return t.content.firstChild.namespaceURI; })();
  function svg(tag, attrs) {
    const el = document.createElementNS(SVGNS, tag);
    for (const [k, v] of Object.entries(attrs || {})) el.setAttribute(k, String(v));
    return el;
  }
  function fmtMs(ms) {
    if (ms === null || ms === undefined) return "–";
    if (ms < 10) return `${Number(ms.toFixed(1))} ms`;
    if (ms < 1000) return `${Math.round(ms)} ms`;
    if (ms < 60000) return `${(ms / 1000).toFixed(ms < 10000 ? 1 : 0)} s`;
    if (ms < 3600000) return `${(ms / 60000).toFixed(1)} min`;
    return `${(ms / 3600000).toFixed(1)} h`;
  }
  // A chart: `series` = [{key, label, values: [number|null] (one per minute)}], `fmt` for values.
  function lineChart(id, title, series, fmt) {
    const W = 320, H = 120, L = 44, R = 6, T = 8, B = 18;
    const n = series[0].values.length;
    const all = series.flatMap((s) => s.values.filter((v) => v !== null && v !== undefined));
    const max = Math.max(1, ...all);
    const x = (i) => L + (n <= 1 ? 0 : (i * (W - L - R)) / (n - 1));
    const y = (v) => T + (H - T - B) * (1 - v / max);
    const el = svg("svg", { viewBox: `0 0 ${W} ${H}`, role: "img", "aria-label": `${title}: ` +
      series.map((s) => `${s.label} ${fmt(s.values[n - 1])} this minute`).join(", ") });
    for (const v of [0, max / 2, max]) {
      el.append(svg("line", { class: "grid", x1: L, x2: W - R, y1: y(v), y2: y(v) }));
      const t = svg("text", { class: "axis", x: L - 4, y: y(v) + 3, "text-anchor": "end" });
      t.textContent = fmt(v);
      el.append(t);
    }
    const t0 = svg("text", { class: "axis", x: L, y: H - 4 }); t0.textContent = `−${n - 1} min`;
    const t1 = svg("text", { class: "axis", x: W - R, y: H - 4, "text-anchor": "end" }); t1.textContent = "now";
    el.append(t0, t1);
    for (const s of series) {
      // One polyline per unbroken run of values; the series' element carries them all.
      const g = svg("g", { class: `series c-${s.key}`, "data-series": s.key, "data-points": s.values.length,
        "data-total": s.values.reduce((a, v) => a + (v || 0), 0),
        "data-last": s.values[n - 1] === null || s.values[n - 1] === undefined ? "" : s.values[n - 1] });
      let run = [];
      const flush = () => {
        if (run.length === 1) {
          // A lone value (its neighbours have none): a dot.
          const [cx, cy] = run[0].split(",");
          g.append(svg("circle", { class: `c-${s.key}`, cx, cy, r: 2.5 }));
        } else if (run.length) g.append(svg("polyline", { class: `c-${s.key}`, points: run.join(" ") }));
        run = [];
      };
      s.values.forEach((v, i) => {
        if (v === null || v === undefined) flush();
        else run.push(`${x(i).toFixed(1)},${y(v).toFixed(1)}`);
      });
      flush();
      el.append(g);
    }
    const legend = series.map((s) => h("span", { class: "legend" }, h("i", { class: `l-${s.key}` }), s.label));
    return h("figure", { class: "chart", id }, h("figcaption", {}, title, ...legend), el);
  }
  // Counts; an axis label between integers keeps one decimal.
  const count = (v) => (v === null || v === undefined ? "–" : Number.isInteger(v) ? num(v) : v.toFixed(1));
  function renderCharts(minutes) {
    const col = (f) => minutes.map(f);
    $("charts").replaceChildren(
      lineChart("chart-outcomes", "Processed per minute", [
        { key: "succeeded", label: "succeeded", values: col((m) => m.succeeded) },
        { key: "failed", label: "failed", values: col((m) => m.failed) },
        { key: "cancelled", label: "cancelled", values: col((m) => m.cancelled) },
      ], count),
      lineChart("chart-depth", "Waiting commands", [
        { key: "depth", label: "waiting (SUBMITTED)", values: col((m) => m.depth) },
      ], count),
      lineChart("chart-age", "Oldest waiting", [
        { key: "age", label: "age of the oldest", values: col((m) => m.oldest_age_ms) },
      ], fmtMs),
      lineChart("chart-durations", "Handler duration", [
        { key: "p50", label: "p50", values: col((m) => m.duration_p50_ms) },
        { key: "p90", label: "p90", values: col((m) => m.duration_p90_ms) },
        { key: "p99", label: "p99", values: col((m) => m.duration_p99_ms) },
      ], fmtMs),
    );
  }
  async function loadCharts() {
    if (!charts.queue || charts.busy || $("view-queues").hidden) return;
    charts.busy = true;
    try {
      const q = charts.queue;
      const r = await api("GET", `/v1/queues/${enc(q)}/minutes?last=${CHARTS_MINUTES}`);
      if (q !== charts.queue) return;
      if (!r.ok) { $("charts-status").textContent = `Charts unavailable: ${r.message}`; return; }
      $("charts-status").textContent = "";
      renderCharts(r.body.minutes);
      $("charts").setAttribute("data-queue", q);
      // The queue's cron schedules (GET /v1/queues/{queue}/schedules): next due, last fire
      // linked to its command.
      const sr = await api("GET", `/v1/queues/${enc(q)}/schedules`);
      if (q !== charts.queue) return;
      const list = sr.ok ? sr.body.schedules : [];
      $("schedules-box").hidden = list.length === 0;
      $("schedules-table").querySelector("tbody").replaceChildren(...list.map((sc) => {
        const last = sc.last_fire || {};
        const id = last.command_id;
        const link = id
          ? h("a", { href: "#commands", "data-command": id, onclick: (e) => { e.preventDefault(); selectTab($("tab-commands")); select(id); } }, id)
          : "–";
        return h("tr", { "data-schedule": sc.name },
          h("td", {}, sc.name), h("td", {}, h("code", {}, sc.cron)), h("td", {}, sc.timezone), h("td", {}, sc.type),
          h("td", {}, sc.overlap), h("td", {}, sc.missed), h("td", {}, sc.next_due || "–"),
          h("td", {}, last.due || "–"), h("td", {}, last.result || "–"), h("td", {}, link));
      }));
    } finally {
      charts.busy = false;
    }
  }
  // Called with every snapshot: keeps the queue choice in step with the queues shown.
  function chartsQueues(s) {
    const names = (s.queues || []).filter((q) => !q.error).map((q) => q.name);
    $("charts-panel").hidden = names.length === 0;
    const sel = $("charts-queue");
    if ([...sel.options].map((o) => o.value).join("\n") !== names.join("\n")) {
      sel.replaceChildren(...names.map((n) => h("option", { value: n }, n)));
    }
    if (!names.includes(charts.queue)) {
      charts.queue = names[0] || "";
      sel.value = charts.queue;
      $("charts").replaceChildren();
      loadCharts();
    }
    if (!charts.timer) charts.timer = setInterval(loadCharts, CHARTS_EVERY);
  }
  $("charts-queue").addEventListener("change", (e) => { charts.queue = e.target.value; loadCharts(); });
  $("charts-form").addEventListener("submit", (e) => e.preventDefault());
  $("tab-queues").addEventListener("click", () => loadCharts());

  // ---- filters and token --------------------------------------------------------------------
  $("filter-form").addEventListener("change", () => connect());
  $("filter-form").addEventListener("submit", (e) => e.preventDefault());
  $("token").value = state.token ? "••••••••" : "";
  $("token").addEventListener("focus", (e) => { if (e.target.value === "••••••••") e.target.value = ""; });
  $("token-form").addEventListener("submit", (e) => {
    e.preventDefault();
    const v = $("token").value.trim();
    if (v && v !== "••••••••") { state.token = v; sessionStorage.setItem("baton.token", v); }
    $("token").value = state.token ? "••••••••" : "";
    connect();
    if (state.stream) openStream(state.stream.path, true);
  });
  $("token-clear").addEventListener("click", () => {
    state.token = ""; sessionStorage.removeItem("baton.token"); $("token").value = ""; connect();
  });

  // ---- streams ------------------------------------------------------------------------------
  function streamStatus(text, kind) {
    const el = $("stream-status");
    el.textContent = text;
    el.className = "stream-status" + (kind ? " " + kind : "");
  }
  function stopStream(msg) {
    if (state.streamEs) { state.streamEs.close(); state.streamEs = null; }
    $("stream-stop").disabled = true;
    if (msg) streamStatus(msg, "closed");
  }
  // Follows `path`: as typed (trimmed, a leading `/` or `v1/stream/` dropped), or `exact` (a path
  // the server listed, or the page URL's), as it is.
  async function openStream(path, exact) {
    stopStream();
    path = exact ? path.replace(/^\/+/, "") : path.trim().replace(/^\/+/, "").replace(/^v1\/stream\//, "");
    if (!path) return;
    const url = streamUrl(path);
    $("stream-log").textContent = "";
    $("append-form").hidden = true;
    streamStatus(`Opening ${path}…`);
    const head = await api("HEAD", url);
    if (!head.ok) {
      streamStatus(head.status === 404 ? `No stream at ${path}.` : `Cannot open ${path}: HTTP ${head.status || "network error"}`, "error");
      state.stream = null;
      return;
    }
    const contentType = head.res.headers.get("content-type") || "application/octet-stream";
    const isJson = /^application\/([\w.+-]*\+)?json/i.test(contentType);
    state.stream = { path, url, contentType, offset: "-1", lines: 0 };
    history.replaceState(null, "", streamHash(path));
    const es = new EventSource(withToken(url + "?offset=-1&live=sse"));
    state.streamEs = es;
    $("stream-stop").disabled = false;
    $("append-form").hidden = false;
    const log = $("stream-log");
    const base64 = !isJson && !/^text\//i.test(contentType);
    es.addEventListener("open", () => streamStatus(`Following ${path} (${contentType}) live`, "live"));
    es.addEventListener("data", (e) => {
      const atBottom = log.scrollTop + log.clientHeight >= log.scrollHeight - 4;
      let text = e.data;
      if (isJson) {
        try { text = JSON.parse(e.data).map((m) => JSON.stringify(m)).join("\n") + "\n"; } catch { /* show as is */ }
      } else if (base64) {
        text = `[${atob(e.data.trim()).length} bytes]\n`;
      }
      log.append(document.createTextNode(text));
      if (atBottom) log.scrollTop = log.scrollHeight;
    });
    es.addEventListener("control", (e) => {
      const c = JSON.parse(e.data);
      state.stream.offset = c.streamNextOffset;
      if (c.streamClosed) {
        es.close();
        if (state.streamEs === es) state.streamEs = null;
        $("stream-stop").disabled = true;
        $("append-form").hidden = true;
        streamStatus(`${path} has ended (${c.batonEndReason || "closed"}) at offset ${c.streamNextOffset}`, "closed");
      } else if (c.upToDate) {
        streamStatus(`Following ${path} (${contentType}) live · up to date at ${c.streamNextOffset}`, "live");
      }
    });
    es.addEventListener("error", () => {
      if (state.streamEs !== es) return;
      if (es.readyState === EventSource.CLOSED) { streamStatus(`${path}: the connection was refused`, "error"); stopStream(); }
      else streamStatus(`Reconnecting to ${path}…`);
    });
  }
  $("stream-form").addEventListener("submit", (e) => { e.preventDefault(); openStream($("stream-path").value); });
  $("stream-stop").addEventListener("click", () => stopStream(`Stopped following ${state.stream ? state.stream.path : ""}.`));
  $("append-form").addEventListener("submit", async (e) => {
    e.preventDefault();
    if (!state.stream) return;
    const input = $("append-text");
    const isJson = /json/i.test(state.stream.contentType);
    let body = input.value;
    if (isJson) { try { JSON.parse(body); } catch { toast("This stream is JSON: enter a JSON value", true); return; } }
    else body += "\n";
    const r = await api("POST", state.stream.url, body, { "Content-Type": state.stream.contentType });
    if (r.ok) input.value = "";
    else toast(`Append refused: ${r.message}`, true);
  });
  if (location.hash.startsWith("#streams:")) {
    const p = hashPath(location.hash);
    selectTab($("tab-streams"));
    $("stream-path").value = p;
    openStream(p, true);
  }

  // ---- operations: workers, bulk actions, stream browser -------------------------------------
  // The queue pickers of the workers panel and the bulk form follow the snapshot's queues; the
  // Workers tab counts the dead workers of every queue.
  function renderOps(s) {
    const names = s.queues.map((q) => q.name);
    for (const id of ["workers-queue", "bulk-queue"]) {
      const sel = $(id);
      const have = [...sel.options].map((o) => o.value).join("\n");
      if (have === names.join("\n")) continue;
      const cur = sel.value;
      sel.replaceChildren(...names.map((n) => h("option", { value: n }, n)));
      if (names.includes(cur)) sel.value = cur;
      if (id === "workers-queue") loadWorkers();
    }
    const dead = s.queues.reduce((a, q) => a + (q.dead_consumers || 0), 0);
    const c = $("count-dead-workers");
    c.textContent = dead ? `${dead} dead` : "";
    c.classList.toggle("alert", dead > 0);
  }

  // Workers of one queue (GET /v1/queues/{queue}/workers), polled every 2 s while shown.
  let workersBusy = false;
  async function loadWorkers() {
    const q = $("workers-queue").value;
    if (!q || workersBusy || $("view-workers").hidden) return;
    workersBusy = true;
    try {
      const r = await api("GET", `/v1/queues/${enc(q)}/workers`);
      if ($("workers-queue").value !== q) return;
      if (!r.ok) { $("workers-summary").textContent = `Workers unavailable: ${r.message}`; return; }
      const { workers, alive, dead } = r.body;
      const summary = $("workers-summary");
      summary.dataset.alive = alive;
      summary.dataset.dead = dead;
      summary.textContent = `${q}: ${alive} live worker${alive === 1 ? "" : "s"}, ${dead} dead`;
      const row = (w) => h("tr", { "data-worker": w.name, "data-alive": String(w.alive), class: w.alive ? "" : "dead" },
        h("th", { scope: "row", class: "mono" }, w.name),
        h("td", {}, h("span", { class: "badge " + (w.alive ? "SUCCEEDED" : "FAILED") }, w.alive ? "alive" : "dead")),
        timeCell(w.last_heartbeat),
        h("td", { class: "num" }, num(w.leases)),
        h("td", { class: "mono wrap" }, ...(w.commands || []).flatMap((id, i) => [i ? " " : null,
          h("a", { href: "#commands", "data-command": id, onclick: (e) => { e.preventDefault(); selectTab($("tab-commands")); select(id); } }, id)])));
      $("workers-table").querySelector("tbody").replaceChildren(...workers.filter((w) => w.alive).map(row));
      const gone = workers.filter((w) => !w.alive);
      $("dead-workers-table").querySelector("tbody").replaceChildren(...gone.map(row));
      $("dead-workers-empty").hidden = gone.length > 0;
    } finally {
      workersBusy = false;
    }
  }
  $("workers-form").addEventListener("change", () => loadWorkers());
  $("workers-form").addEventListener("submit", (e) => e.preventDefault());
  $("tab-workers").addEventListener("click", () => loadWorkers());
  setInterval(loadWorkers, 2000);

  // Bulk cancel / retry (POST /v1/queues/{queue}/commands/bulk): the first click counts with a
  // dry run and arms the button with that count for 8 seconds; the second acts. Changing the
  // filter disarms it. The dry run and the action walk the same range (calls of up to BULK_MAX
  // commands through next_cursor, at most BULK_CALLS), so the count confirmed is what is done
  // when nothing changes in between.
  const bulk = { armed: false, timer: null };
  const BULK_MAX = 10000, BULK_CALLS = 20;
  function bulkFilter() {
    const f = { action: $("bulk-action").value };
    const st = $("bulk-status").value, ty = $("bulk-type").value.trim(), ip = $("bulk-prefix").value.trim();
    if (st) f.status = st;
    if (ty) f.type = ty;
    if (ip) f.id_prefix = ip;
    return f;
  }
  function bulkDisarm() {
    clearTimeout(bulk.timer);
    bulk.armed = false;
    const btn = $("bulk-btn");
    btn.dataset.armed = "";
    btn.textContent = "Count";
  }
  function bulkSay(text, data) {
    const p = $("bulk-result");
    p.textContent = text;
    for (const k of ["eligible", "applied", "refused"]) delete p.dataset[k];
    Object.assign(p.dataset, data || {});
  }
  async function bulkCall(queue, body) {
    return api("POST", `/v1/queues/${enc(queue)}/commands/bulk`, JSON.stringify(body), { "Content-Type": "application/json" });
  }
  // Calls the bulk endpoint through next_cursor (at most BULK_CALLS times) and sums the reports;
  // `more` when a cursor is left; `error` (with the sums so far) when a call fails.
  async function bulkWalk(queue, body) {
    const sum = { eligible: 0, applied: 0, refused: 0, looked: 0, more: false, error: null };
    let cursor = null;
    for (let call = 0; call < BULK_CALLS; call++) {
      const r = await bulkCall(queue, { ...body, max: BULK_MAX, ...(cursor ? { cursor } : {}) });
      if (!r.ok) { sum.error = r.message; return sum; }
      sum.eligible += r.body.eligible;
      sum.applied += r.body.applied;
      sum.refused += r.body.refused;
      sum.looked += r.body.looked_at;
      cursor = r.body.next_cursor;
      if (!cursor) return sum;
    }
    sum.more = true;
    return sum;
  }
  $("bulk-form").addEventListener("submit", async (e) => {
    e.preventDefault();
    const queue = $("bulk-queue").value, btn = $("bulk-btn");
    const f = bulkFilter();
    if (!queue) return;
    btn.disabled = true;
    try {
      if (!bulk.armed) {
        const c = await bulkWalk(queue, { ...f, dry_run: true });
        if (c.error) { bulkSay(`Cannot count: ${c.error}`); return; }
        const n = c.eligible, more = c.more ? ` among the first ${num(c.looked)} looked at` : "";
        const verb = f.action === "cancel" ? "cancelled" : "re-run";
        if (!n) { bulkSay(`No command of ${queue} matches: nothing would be ${verb} (${num(c.looked)} looked at).`, { eligible: 0 }); return; }
        bulkSay(`${num(n)} command${n === 1 ? "" : "s"} of ${queue} would be ${verb}${more} (dry run). Click again to confirm.`, { eligible: n });
        bulk.armed = true;
        btn.dataset.armed = "1";
        btn.textContent = `Confirm ${f.action} of ${num(n)}?`;
        bulk.timer = setTimeout(bulkDisarm, 8000);
        return;
      }
      bulkDisarm();
      const { applied, refused, error } = await bulkWalk(queue, f);
      if (error) { bulkSay(`Stopped after ${num(applied)}: ${error}`, { applied }); toast(`Bulk ${f.action} failed: ${error}`, true); return; }
      const verb = f.action === "cancel" ? "Cancelled" : "Re-running";
      bulkSay(`${verb} ${num(applied)} command${applied === 1 ? "" : "s"} of ${queue}` +
        (refused ? ` (${num(refused)} changed meanwhile, left as they were)` : "") + ".", { applied, refused });
      toast(`${verb} ${num(applied)} command${applied === 1 ? "" : "s"}`);
    } finally {
      btn.disabled = false;
    }
  });
  $("bulk-form").addEventListener("input", bulkDisarm);
  $("bulk-form").addEventListener("change", bulkDisarm);

  // Stream browser (GET /v1/streams?prefix=): pages in path order; a path opens the stream in the
  // follow panel below (live, with EventSource).
  // Each List starts a new listing (its generation); an answer for an older one, still under
  // way when List was pressed again, is dropped. More is ignored while one is under way.
  const browse = { prefix: "", next: null, gen: 0, moreBusy: false, loaded: false };
  async function listStreams(more) {
    if (more && (browse.moreBusy || !browse.next)) return;
    if (!more) { browse.gen++; browse.prefix = $("browse-prefix").value.trim().replace(/^\/+/, ""); browse.next = null; }
    const gen = browse.gen;
    if (more) browse.moreBusy = true;
    try {
      const q = new URLSearchParams({ limit: "50" });
      if (browse.prefix) q.set("prefix", browse.prefix);
      if (more) q.set("cursor", browse.next);
      const r = await api("GET", "/v1/streams?" + q.toString());
      if (gen !== browse.gen) return;
      if (!r.ok) { toast(`Cannot list streams: ${r.message}`, true); return; }
      browse.loaded = true;
      const body = $("streams-table").querySelector("tbody");
      const rows = r.body.streams.map((s) => h("tr", { "data-path": s.path, "data-closed": String(s.closed) },
        h("th", { scope: "row", class: "mono" }, h("a", { href: streamHash(s.path), onclick: (e) => { e.preventDefault(); follow(s.path); } }, s.path)),
        h("td", {}, s.content_type), h("td", { class: "num" }, num(s.length)),
        h("td", {}, s.closed ? h("span", { class: "badge CANCELLED" }, `ended (${s.end_reason})`) : h("span", { class: "badge RUNNING" }, "open")),
        timeCell(s.created_at), timeCell(s.last_write_at)));
      if (more) body.append(...rows); else body.replaceChildren(...rows);
      browse.next = r.body.next_cursor;
      $("browse-more").hidden = !browse.next;
      $("streams-empty").hidden = body.children.length > 0;
    } finally {
      if (more) browse.moreBusy = false;
    }
  }
  function follow(path) {
    $("stream-path").value = path;
    openStream(path, true);
    $("follow").scrollIntoView({ block: "nearest" });
  }
  $("browse-form").addEventListener("submit", (e) => { e.preventDefault(); listStreams(false); });
  $("browse-more").addEventListener("click", () => listStreams(true));
  $("tab-streams").addEventListener("click", () => { if (!browse.loaded) listStreams(false); });
  if (!$("view-streams").hidden) listStreams(false);

  // Relative times tick even between snapshots.
  setInterval(() => {
    for (const t of document.querySelectorAll("time[datetime]")) {
      const iso = t.getAttribute("datetime");
      if (iso) t.textContent = ago(iso);
    }
  }, 1000);

  connect();
})();
