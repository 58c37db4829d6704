//! The built-in handlers (`baton_commands::builtin`) end to end through a real `CommandService`:
//! sleep / echo on memory and Redis standalone, fail and http on memory. The http handler talks
//! to local axum servers on 127.0.0.1 only (link-local addresses are refused before any
//! connection, and the DNS test's resolver answers 127.0.0.1 *first*, so even a broken check
//! could not send traffic off this machine).

use crate::common;

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use async_trait::async_trait;
use axum::body::Bytes;
use axum::extract::State;
use axum::http::{HeaderMap, Method, StatusCode, Uri};
use axum::response::{IntoResponse, Response};
use baton_commands::builtin::{
    self, EchoHandler, FailHandler, HttpHandler, HttpHandlerConfig, Name, Resolve, Resolving, SleepHandler,
};
use baton_commands::{
    Command, CommandError, CommandHandler, CommandResult, CommandService, CommandState, CommandStatus, CommandStore,
    HandlerError, QueueSettings, RawJson,
};
use baton_testkit::TestBackend;
use common::*;
use serde_json::{json, Value};
use tokio::sync::mpsc;

baton_testkit::on_memory_and_standalone!(
    sleep_succeeds_with_slept_ms,
    sleep_cancelled_midway_ends_cancelled_early,
    sleep_bad_params_are_refused_at_submit,
    echo_returns_its_params,
);

/// What one `execute` / `check_status` call of a wrapped handler returned, and how long it took.
#[derive(Debug)]
struct Call {
    execute: bool,
    outcome: Result<CommandResult, String>,
    took: Duration,
}

/// Wraps a handler and reports every call's outcome.
struct Recorded {
    inner: Arc<dyn CommandHandler>,
    tx: mpsc::UnboundedSender<Call>,
}

fn recorded(inner: Arc<dyn CommandHandler>) -> (Recorded, mpsc::UnboundedReceiver<Call>) {
    let (tx, rx) = mpsc::unbounded_channel();
    (Recorded { inner, tx }, rx)
}

#[async_trait]
impl CommandHandler for Recorded {
    async fn execute(&self, command: Command) -> Result<CommandResult, HandlerError> {
        let t = Instant::now();
        let r = self.inner.execute(command).await;
        let outcome = r.as_ref().map(Clone::clone).map_err(|e| e.to_string());
        let _ = self.tx.send(Call { execute: true, outcome, took: t.elapsed() });
        r
    }
    async fn check_status(&self, command: Command, state: CommandState) -> Result<CommandResult, HandlerError> {
        let t = Instant::now();
        let r = self.inner.check_status(command, state).await;
        let outcome = r.as_ref().map(Clone::clone).map_err(|e| e.to_string());
        let _ = self.tx.send(Call { execute: false, outcome, took: t.elapsed() });
        r
    }
    fn validate(&self, params: &baton_commands::RawJson) -> Result<(), String> {
        self.inner.validate(params)
    }
}

async fn service(
    store: &CommandStore,
    q: &str,
    settings: QueueSettings,
    t: &str,
    h: impl CommandHandler,
) -> CommandService {
    CommandService::builder(store.clone(), q).settings(settings).handler(t, h).start().await.unwrap()
}

async fn sleep_succeeds_with_slept_ms(b: TestBackend) {
    let store = store_for(&b).await;
    let q = queue_name("sleep");
    let (h, mut calls) = recorded(Arc::new(SleepHandler));
    let svc = service(&store, &q, fast(), "sleep", h).await;
    let t = Instant::now();
    let id = svc.submit(Command::new("sleep", json!({"ms": 300}))).await.unwrap().id;
    let st = store.wait(&id, Duration::from_secs(10)).await.unwrap();
    assert_eq!(st.status, CommandStatus::Succeeded);
    assert_eq!(st.result, Some(json!({"slept_ms": 300}).into()));
    assert_eq!((st.attempts, st.errors_count, st.error.clone()), (1, 0, None));
    assert!(t.elapsed() >= Duration::from_millis(300), "finished after {:?}", t.elapsed());
    let call = calls.recv().await.unwrap();
    assert!(call.execute);
    assert_eq!(call.outcome, Ok(CommandResult::succeeded(json!({"slept_ms": 300}))));
    assert!(call.took >= Duration::from_millis(300) && call.took < Duration::from_secs(3), "{:?}", call.took);

    // Zero is a valid sleep.
    let id = svc.submit(Command::new("sleep", json!({"ms": 0}))).await.unwrap().id;
    let st = store.wait(&id, Duration::from_secs(10)).await.unwrap();
    assert_eq!((st.status, st.result), (CommandStatus::Succeeded, Some(json!({"slept_ms": 0}).into())));
    svc.close().await;
}

async fn sleep_cancelled_midway_ends_cancelled_early(b: TestBackend) {
    let store = store_for(&b).await;
    let q = queue_name("sleepc");
    let (h, mut calls) = recorded(Arc::new(SleepHandler));
    let svc = service(&store, &q, fast(), "sleep", h).await;
    let id = svc.submit(Command::new("sleep", json!({"ms": 20_000}))).await.unwrap().id;
    tokio::time::sleep(Duration::from_millis(500)).await; // the handler is sleeping by now
    let t = Instant::now();
    let cancelled = store.cancel(&id).await.unwrap();
    assert_eq!(cancelled.status, CommandStatus::Cancelled);
    // The handler itself stopped early and said so.
    let call = tokio::time::timeout(Duration::from_secs(5), calls.recv()).await.expect("handler returned").unwrap();
    assert!(call.execute);
    assert_eq!(call.outcome, Ok(CommandResult::Cancelled));
    assert!(call.took < Duration::from_secs(5), "sleep ran {:?} of 20 s", call.took);
    assert!(t.elapsed() < Duration::from_secs(5));
    let st = store.wait(&id, Duration::from_secs(5)).await.unwrap();
    assert_eq!(st.status, CommandStatus::Cancelled);
    assert_eq!((st.result, st.error), (None, None));
    svc.close().await;
}

async fn sleep_bad_params_are_refused_at_submit(b: TestBackend) {
    let store = store_for(&b).await;
    let q = queue_name("sleepv");
    let svc = service(&store, &q, fast(), "sleep", SleepHandler).await;
    let cases = [
        (json!({"ms": -1}), "\"ms\" must be an integer from 0 to 86400000 (milliseconds); got -1"),
        (json!({"ms": 86_400_001}), "\"ms\" is 86400001, above the 86400000 (24 h) maximum"),
        (json!({"ms": 1.5}), "\"ms\" must be an integer from 0 to 86400000 (milliseconds); got 1.5"),
        (json!({"ms": "10"}), "\"ms\" must be an integer from 0 to 86400000 (milliseconds); got \"10\""),
        (
            json!({}),
            "missing field \"ms\": sleep params must be {\"ms\": n} with n an integer number of milliseconds from 0 to 86400000 (24 h)",
        ),
        (
            json!(null),
            "sleep params must be {\"ms\": n} with n an integer number of milliseconds from 0 to 86400000 (24 h); got null",
        ),
    ];
    for (i, (params, msg)) in cases.into_iter().enumerate() {
        let id = format!("bad-sleep-{i}");
        match svc.submit(Command::with_id(&id, "sleep", params.clone())).await {
            Err(CommandError::InvalidParams(m)) => assert_eq!(m, msg, "params {params}"),
            other => panic!("params {params} must be refused, got {other:?}"),
        }
        assert_eq!(store.get(&id).await.unwrap(), None, "nothing stored for {params}");
    }
    svc.close().await;
}

async fn echo_returns_its_params(b: TestBackend) {
    let store = store_for(&b).await;
    let q = queue_name("echo");
    let svc = service(&store, &q, fast(), "echo", EchoHandler).await;
    for params in [json!({"a": [1, 2.5, "x"], "b": null, "c": {"d": true}}), json!(null), json!("text")] {
        let id = svc.submit(Command::new("echo", params.clone())).await.unwrap().id;
        let st = store.wait(&id, Duration::from_secs(10)).await.unwrap();
        assert_eq!(st.status, CommandStatus::Succeeded);
        // Compared as the state's JSON: a `null` result reads back as `None` from Redis but as
        // `Some(Null)` from memory; both serialize to `"result": null`.
        assert_eq!(serde_json::to_value(&st).unwrap()["result"], params);
        if !params.is_null() {
            assert_eq!(st.result, Some(params.into()));
        }
        assert_eq!((st.attempts, st.errors_count), (1, 0));
    }
    svc.close().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fail_ends_failed_with_its_text_and_bad_params_are_refused() {
    let store = store_for(&TestBackend::Memory).await;
    let q = queue_name("fail");
    let svc = service(&store, &q, fast(), "fail", FailHandler).await;
    let id = svc.submit(Command::new("fail", json!({"error": "disk full"}))).await.unwrap().id;
    let st = store.wait(&id, Duration::from_secs(10)).await.unwrap();
    assert_eq!(st.status, CommandStatus::Failed);
    assert_eq!(st.error.as_deref(), Some("disk full"));
    assert_eq!((st.result, st.attempts, st.errors_count), (None, 1, 0), "a real failure: one attempt, no retry");
    for (params, msg) in [
        (
            json!({"error": ""}),
            "\"error\" is empty: fail params must be {\"error\": text} with text a non-empty string",
        ),
        (json!({"error": 7}), "\"error\" must be a non-empty string; got a number"),
        (
            json!({"message": "x"}),
            "unknown field \"message\": fail params must be {\"error\": text} with text a non-empty string",
        ),
    ] {
        match svc.submit(Command::with_id("bad-fail", "fail", params.clone())).await {
            Err(CommandError::InvalidParams(m)) => assert_eq!(m, msg),
            other => panic!("params {params} must be refused, got {other:?}"),
        }
    }
    assert_eq!(store.get("bad-fail").await.unwrap(), None);
    svc.close().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn builtins_register_from_config() {
    let store = store_for(&TestBackend::Memory).await;
    let q = queue_name("cfg");
    let b = CommandService::builder(store.clone(), &q).settings(fast());
    let b = builtin::register(b, "nap", "sleep", &Value::Null).unwrap();
    let b = builtin::register(b, "say", "echo", &json!({})).unwrap();
    let b = builtin::register(b, "boom", "fail", &json!({"kind": "fail"})).unwrap();
    let svc = b.start().await.unwrap();
    let a = svc.submit(Command::new("nap", json!({"ms": 10}))).await.unwrap().id;
    let e = svc.submit(Command::new("say", json!([1]))).await.unwrap().id;
    let f = svc.submit(Command::new("boom", json!({"error": "no"}))).await.unwrap().id;
    let w = |id: String| {
        let store = store.clone();
        async move { store.wait(&id, Duration::from_secs(10)).await.unwrap() }
    };
    let (a, e, f) = (w(a).await, w(e).await, w(f).await);
    assert_eq!((a.status, a.result), (CommandStatus::Succeeded, Some(json!({"slept_ms": 10}).into())));
    assert_eq!((e.status, e.result), (CommandStatus::Succeeded, Some(json!([1]).into())));
    assert_eq!((f.status, f.error.as_deref()), (CommandStatus::Failed, Some("no")));
    assert!(matches!(svc.submit(Command::new("nap", json!({"ms": -5}))).await, Err(CommandError::InvalidParams(_))));
    svc.close().await;
    assert_eq!(
        builtin::from_config("http", &json!({"url": "http://169.254.169.254/latest/meta-data"})).err().unwrap(),
        "http handler: url: address 169.254.169.254 is link-local or cloud-metadata and is refused (set allow_link_local = true to allow it)"
    );
    assert_eq!(
        builtin::register(CommandService::builder(store.clone(), &q), "x", "shell", &Value::Null).err().unwrap(),
        "unknown built-in handler \"shell\": use one of sleep, echo, fail, http"
    );
}

// ---------------------------------------------------------------------------------------------
// http

/// One request a test server received.
#[derive(Clone, Debug)]
struct Hit {
    method: Method,
    path: String,
    body: Value,
    /// The body as sent.
    raw: String,
    auth: Option<String>,
}

#[derive(Clone)]
struct Srv {
    hits: Arc<Mutex<Vec<Hit>>>,
    /// The other server's base URL (for the cross-origin redirect).
    other: Arc<Mutex<String>>,
    /// `/status/…` answers succeeded once set.
    done: Arc<AtomicBool>,
}

impl Srv {
    fn hits(&self) -> Vec<Hit> {
        self.hits.lock().unwrap().clone()
    }
    fn count(&self, method: &str, path: &str) -> usize {
        self.hits().iter().filter(|h| h.method.as_str() == method && h.path == path).count()
    }
}

fn reply(v: Value) -> Response {
    ([("content-type", "application/json")], v.to_string()).into_response()
}

async fn hook(State(s): State<Srv>, method: Method, uri: Uri, headers: HeaderMap, body: Bytes) -> Response {
    let raw = String::from_utf8_lossy(&body).into_owned();
    let body: Value = serde_json::from_slice(&body).unwrap_or(Value::Null);
    let path = uri.path().to_string();
    let auth = headers.get("authorization").map(|v| v.to_str().unwrap().to_string());
    s.hits.lock().unwrap().push(Hit {
        method: method.clone(),
        path: path.clone(),
        body: body.clone(),
        raw: raw.clone(),
        auth,
    });
    let id = body["id"].as_str().unwrap_or("").to_string();
    match path.as_str() {
        "/ok" => reply(json!({"status": "succeeded", "result": {"got": body}})),
        "/fail" => reply(json!({"status": "FAILED", "error": "remote says no"})),
        "/async" => reply(json!({"status": "running", "status_url": format!("status/{id}?t=1"), "retry_after_ms": 30})),
        p if p.starts_with("/status/") => {
            if s.done.load(Ordering::SeqCst) {
                reply(json!({"status": "succeeded", "result": {"done": &p["/status/".len()..]}}))
            } else {
                reply(json!({"status": "running", "retry_after_ms": 30}))
            }
        }
        "/poll" if body["check"] == json!(true) => reply(json!({"status": "succeeded", "result": {"checked": id}})),
        "/poll" => reply(json!({"status": "running", "retry_after_ms": 20})),
        "/busy" => (StatusCode::SERVICE_UNAVAILABLE, "busy, try later").into_response(),
        // A 429 with Retry-After on the first call, then succeeded.
        "/limited" if s.count("POST", "/limited") == 1 => {
            (StatusCode::TOO_MANY_REQUESTS, [("retry-after", "1")], "slow down").into_response()
        }
        "/limited" => reply(json!({"status": "succeeded", "result": 1})),
        "/slow" => {
            tokio::time::sleep(Duration::from_secs(3)).await;
            reply(json!({"status": "succeeded"}))
        }
        "/redirect-same" => (StatusCode::TEMPORARY_REDIRECT, [("location", "/ok")]).into_response(),
        "/redirect-loop" => (StatusCode::TEMPORARY_REDIRECT, [("location", "/redirect-loop")]).into_response(),
        "/redirect-other" => {
            let to = format!("{}/ok", s.other.lock().unwrap());
            (StatusCode::TEMPORARY_REDIRECT, [("location", to)]).into_response()
        }
        "/not-json" => "hello".into_response(),
        // The request's params text as the result, untouched.
        "/raw-echo" => {
            let params = raw_params(&raw);
            ([("content-type", "application/json")], format!(r#"{{"status": "succeeded", "result": {params}}}"#))
                .into_response()
        }
        "/unknown-status" => reply(json!({"status": "paused"})),
        "/evil-status-url" => {
            reply(json!({"status": "running", "status_url": format!("{}/ok", s.other.lock().unwrap())}))
        }
        _ => (StatusCode::NOT_FOUND, "no such hook").into_response(),
    }
}

/// The `params` of a request body, as their text.
fn raw_params(body: &str) -> String {
    #[derive(serde::Deserialize)]
    struct In<'a> {
        #[serde(borrow)]
        params: &'a serde_json::value::RawValue,
    }
    serde_json::from_str::<In>(body).map(|i| i.params.get().to_string()).unwrap_or_else(|_| "null".into())
}

async fn server() -> (SocketAddr, Srv) {
    let srv = Srv { hits: Default::default(), other: Default::default(), done: Default::default() };
    let app = axum::Router::new().fallback(hook).with_state(srv.clone());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    (addr, srv)
}

fn http(url: String) -> HttpHandler {
    HttpHandler::new(HttpHandlerConfig::new(url)).unwrap()
}

/// Runs one command of type `hook` with `handler` on a fresh memory queue; returns its final state.
async fn run_http(handler: impl CommandHandler, settings: QueueSettings, params: impl Into<RawJson>) -> CommandState {
    let store = store_for(&TestBackend::Memory).await;
    let q = queue_name("http");
    let svc = service(&store, &q, settings, "hook", handler).await;
    let id = svc.submit(Command::with_id("cmd-1", "hook", params)).await.unwrap().id;
    let st = store.wait(&id, Duration::from_secs(15)).await.unwrap();
    svc.close().await;
    st
}

fn one_attempt() -> QueueSettings {
    let mut s = fast();
    s.retry.max_attempts = 1;
    s
}

/// The webhook gets the params byte for byte (10,000 floats of 17 digits, big integers, escapes,
/// key order), and the reply's `result` is kept as the webhook wrote it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn http_forwards_params_and_keeps_the_reply_result_byte_for_byte() {
    let (addr, srv) = server().await;
    let text = baton_testkit::exact_json::sample(10_000, 5).text;
    let st =
        run_http(http(format!("http://{addr}/raw-echo")), fast(), RawJson::from_string(text.clone()).unwrap()).await;
    assert_eq!(st.status, CommandStatus::Succeeded, "{:?}", st.error);
    assert!(raw_params(&srv.hits()[0].raw) == text, "the webhook got other params");
    assert!(st.result.as_ref().map(RawJson::get) == Some(text.as_str()), "the reply's result changed");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn http_succeeded_reply_posts_the_command_with_configured_headers() {
    let (addr, srv) = server().await;
    let mut cfg = HttpHandlerConfig::new(format!("http://{addr}/ok"));
    cfg.headers = vec![("Authorization".into(), "Bearer t0k".into())];
    let st = run_http(HttpHandler::new(cfg).unwrap(), fast(), json!({"n": 1})).await;
    let sent = json!({"id": "cmd-1", "type": "hook", "params": {"n": 1}});
    assert_eq!(st.status, CommandStatus::Succeeded);
    assert_eq!(st.result, Some(json!({"got": sent}).into()));
    assert_eq!((st.attempts, st.errors_count), (1, 0));
    let hits = srv.hits();
    assert_eq!(hits.len(), 1);
    assert_eq!((hits[0].method.as_str(), hits[0].path.as_str()), ("POST", "/ok"));
    assert_eq!(hits[0].body, sent);
    assert_eq!(hits[0].auth.as_deref(), Some("Bearer t0k"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn http_system_resolver_accepts_localhost() {
    let (addr, srv) = server().await;
    let st = run_http(http(format!("http://localhost:{}/ok", addr.port())), fast(), json!(null)).await;
    assert_eq!(st.status, CommandStatus::Succeeded, "{:?}", st.error);
    assert_eq!(srv.count("POST", "/ok"), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn http_failed_reply_fails_the_command() {
    let (addr, srv) = server().await;
    let st = run_http(http(format!("http://{addr}/fail")), fast(), json!({})).await;
    assert_eq!(st.status, CommandStatus::Failed);
    assert_eq!(st.error.as_deref(), Some("remote says no"));
    assert_eq!((st.attempts, st.errors_count), (1, 0), "a real failure is not retried");
    assert_eq!(srv.count("POST", "/fail"), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn http_running_then_status_url_then_succeeded() {
    let (addr, srv) = server().await;
    let store = store_for(&TestBackend::Memory).await;
    let q = queue_name("http-async");
    let svc = service(&store, &q, fast(), "hook", http(format!("http://{addr}/async"))).await;
    let id = svc.submit(Command::with_id("job-7", "hook", json!({}))).await.unwrap().id;
    let running = eventually(Duration::from_secs(10), || {
        let store = store.clone();
        let id = id.clone();
        async move { store.get(&id).await.unwrap().filter(|s| s.status == CommandStatus::Running) }
    })
    .await
    .expect("RUNNING");
    assert!(running.started_at.is_some());
    // Polled through the status URL (relative, resolved against the webhook URL).
    eventually(Duration::from_secs(10), || async { (srv.count("GET", "/status/job-7") >= 2).then_some(()) })
        .await
        .expect("status URL polled");
    assert_eq!(store.get(&id).await.unwrap().unwrap().status, CommandStatus::Running);
    srv.done.store(true, Ordering::SeqCst);
    let st = store.wait(&id, Duration::from_secs(10)).await.unwrap();
    assert_eq!(st.status, CommandStatus::Succeeded);
    assert_eq!(st.result, Some(json!({"done": "job-7"}).into()));
    assert_eq!((st.attempts, st.errors_count), (1, 0));
    assert_eq!(srv.count("POST", "/async"), 1, "execute ran once");
    assert!(srv.hits().iter().all(|h| h.method == Method::POST && h.path == "/async" || h.method == Method::GET));
    svc.close().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn http_running_without_status_url_is_checked_by_post() {
    let (addr, srv) = server().await;
    let st = run_http(http(format!("http://{addr}/poll")), fast(), json!({"x": 2})).await;
    assert_eq!(st.status, CommandStatus::Succeeded);
    assert_eq!(st.result, Some(json!({"checked": "cmd-1"}).into()));
    let hits = srv.hits();
    assert_eq!(hits.len(), 2);
    assert_eq!(hits[0].body, json!({"id": "cmd-1", "type": "hook", "params": {"x": 2}}));
    assert_eq!(hits[1].body, json!({"id": "cmd-1", "type": "hook", "params": {"x": 2}, "check": true}));
    assert_eq!(hits[1].method, Method::POST);
}

/// A `429` is not an error: the queue backs off for its `Retry-After` and the call is made again
/// (one attempt allowed, yet it succeeds; no error recorded).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn http_429_backs_off_for_retry_after_then_calls_again() {
    let (addr, srv) = server().await;
    let t = std::time::Instant::now();
    let st = run_http(http(format!("http://{addr}/limited")), one_attempt(), json!({})).await;
    assert_eq!(st.status, CommandStatus::Succeeded, "{:?}", st.error);
    assert_eq!((st.attempts, st.errors_count, st.error.as_deref()), (1, 0, None));
    assert_eq!(srv.count("POST", "/limited"), 2);
    assert!(t.elapsed() >= Duration::from_secs(1), "called again after the Retry-After: {:?}", t.elapsed());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn http_non_2xx_is_retried_then_failed() {
    let (addr, srv) = server().await;
    let mut s = fast();
    s.retry.max_attempts = 2;
    let st = run_http(http(format!("http://{addr}/busy?key=secret")), s, json!({})).await;
    assert_eq!(st.status, CommandStatus::Failed);
    assert_eq!(
        st.error.as_deref().unwrap(),
        format!("POST http://{addr}/busy: HTTP 503 Service Unavailable: busy, try later")
    );
    assert_eq!((st.attempts, st.errors_count), (2, 2));
    assert_eq!(srv.count("POST", "/busy"), 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn http_timeout_is_a_handler_error() {
    let (addr, _srv) = server().await;
    let mut cfg = HttpHandlerConfig::new(format!("http://{addr}/slow"));
    cfg.timeout = Duration::from_millis(200);
    let t = Instant::now();
    let st = run_http(HttpHandler::new(cfg).unwrap(), one_attempt(), json!({})).await;
    assert_eq!(st.status, CommandStatus::Failed);
    assert_eq!(st.error.as_deref().unwrap(), format!("POST http://{addr}/slow: timed out after 200ms"));
    assert_eq!((st.attempts, st.errors_count), (1, 1));
    assert!(t.elapsed() < Duration::from_secs(3), "{:?}", t.elapsed());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn http_cancel_during_a_request_ends_cancelled() {
    let (addr, _srv) = server().await;
    let store = store_for(&TestBackend::Memory).await;
    let q = queue_name("http-cancel");
    let (h, mut calls) = recorded(Arc::new(http(format!("http://{addr}/slow"))));
    let svc = service(&store, &q, fast(), "hook", h).await;
    let id = svc.submit(Command::new("hook", json!({}))).await.unwrap().id;
    tokio::time::sleep(Duration::from_millis(300)).await;
    store.cancel(&id).await.unwrap();
    let call = tokio::time::timeout(Duration::from_secs(2), calls.recv()).await.expect("returned").unwrap();
    assert_eq!(call.outcome, Ok(CommandResult::Cancelled));
    assert!(call.took < Duration::from_millis(2500), "{:?}", call.took);
    assert_eq!(store.wait(&id, Duration::from_secs(5)).await.unwrap().status, CommandStatus::Cancelled);
    svc.close().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn http_redirects_follow_same_origin_only() {
    let (addr, srv) = server().await;
    let (other, other_srv) = server().await;
    *srv.other.lock().unwrap() = format!("http://{other}");

    // Same origin: followed (307 keeps the POST and its body).
    let st = run_http(http(format!("http://{addr}/redirect-same")), one_attempt(), json!({"r": 1})).await;
    assert_eq!(st.status, CommandStatus::Succeeded, "{:?}", st.error);
    assert_eq!(st.result_as::<serde_json::Value>().unwrap()["got"]["params"], json!({"r": 1}));

    // Same host, other port: another origin, refused before any request reaches it.
    let st = run_http(http(format!("http://{addr}/redirect-other")), one_attempt(), json!({})).await;
    assert_eq!(st.status, CommandStatus::Failed);
    let err = st.error.unwrap();
    assert!(err.starts_with(&format!("POST http://{addr}/redirect-other: ")), "{err}");
    assert!(
        err.contains(&format!(
            "redirect to http://{other}/ok refused: only redirects to the webhook's origin (http://{addr}) are followed"
        )),
        "{err}"
    );
    assert!(other_srv.hits().is_empty(), "the other origin was contacted");

    // At most 5 redirects.
    let st = run_http(http(format!("http://{addr}/redirect-loop")), one_attempt(), json!({})).await;
    assert_eq!(st.status, CommandStatus::Failed);
    assert!(st.error.as_deref().unwrap().contains("more than 5 redirects"), "{:?}", st.error);
    assert_eq!(srv.count("POST", "/redirect-loop"), 6, "the first request and 5 redirects");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn http_bad_replies_are_handler_errors() {
    let (addr, srv) = server().await;
    let (other, _other_srv) = server().await;
    *srv.other.lock().unwrap() = format!("http://{other}");
    let cases = [
        ("/not-json", "reply is not valid JSON (expected value at line 1 column 1); expected {\"status\": \"succeeded\"|\"failed\"|\"running\", …}".to_string()),
        ("/unknown-status", "unknown status \"paused\" in reply; expected succeeded, failed or running".to_string()),
        ("/nowhere", "HTTP 404 Not Found: no such hook".to_string()),
        (
            "/evil-status-url",
            format!("\"status_url\" http://{other}/ok refused: it must have the webhook's origin (http://{addr})"),
        ),
    ];
    for (path, msg) in cases {
        let st = run_http(http(format!("http://{addr}{path}")), one_attempt(), json!({})).await;
        assert_eq!(st.status, CommandStatus::Failed, "{path}");
        assert_eq!(st.error.unwrap(), format!("POST http://{addr}{path}: {msg}"));
        assert_eq!((st.attempts, st.errors_count), (1, 1), "{path}: a handler error");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn http_refuses_link_local_literals_without_allow_link_local() {
    for url in ["http://169.254.169.254/latest/meta-data/", "http://[fd00:ec2::254]/", "http://100.100.100.200/"] {
        let err = HttpHandler::new(HttpHandlerConfig::new(url)).unwrap_err();
        assert!(err.starts_with("http handler: url: address "), "{err}");
        assert!(
            err.ends_with(" is link-local or cloud-metadata and is refused (set allow_link_local = true to allow it)"),
            "{err}"
        );
    }
    let mut cfg = HttpHandlerConfig::new("http://169.254.169.254/latest/meta-data/");
    cfg.allow_link_local = true;
    assert!(HttpHandler::new(cfg).is_ok(), "allowed in configuration");
}

/// A fixed DNS table: `name` → addresses (port 0: the URL's port is used).
struct FixedDns(Vec<(&'static str, Vec<SocketAddr>)>);

impl Resolve for FixedDns {
    fn resolve(&self, name: Name) -> Resolving {
        let found = self.0.iter().find(|(n, _)| *n == name.as_str()).map(|(_, a)| a.clone());
        let host = name.as_str().to_string();
        Box::pin(async move {
            match found {
                Some(a) => Ok(Box::new(a.into_iter()) as builtin::Addrs),
                None => Err(format!("no such host {host}").into()),
            }
        })
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn http_refuses_a_host_name_resolving_to_link_local() {
    let (addr, srv) = server().await;
    let local: SocketAddr = "127.0.0.1:0".parse().unwrap();
    let metadata: SocketAddr = "169.254.169.254:0".parse().unwrap();
    // 127.0.0.1 comes first: were the check missing, the request would reach the local server
    // (and fail this test), never the metadata address.
    let dns = Arc::new(FixedDns(vec![("good.test", vec![local]), ("rebind.test", vec![local, metadata])]));

    let h =
        HttpHandler::with_resolver(HttpHandlerConfig::new(format!("http://good.test:{}/ok", addr.port())), dns.clone())
            .unwrap();
    let st = run_http(h, one_attempt(), json!({})).await;
    assert_eq!(st.status, CommandStatus::Succeeded, "the resolver is used: {:?}", st.error);
    assert_eq!(srv.count("POST", "/ok"), 1);

    let h = HttpHandler::with_resolver(HttpHandlerConfig::new(format!("http://rebind.test:{}/ok", addr.port())), dns)
        .unwrap();
    let st = run_http(h, one_attempt(), json!({})).await;
    assert_eq!(st.status, CommandStatus::Failed);
    let err = st.error.unwrap();
    assert!(err.starts_with(&format!("POST http://rebind.test:{}/ok: ", addr.port())), "{err}");
    assert!(
        err.contains("host rebind.test resolves to 169.254.169.254, a link-local or cloud-metadata address; refused (set allow_link_local = true to allow it)"),
        "{err}"
    );
    assert_eq!(srv.count("POST", "/ok"), 1, "no request was sent");
}
