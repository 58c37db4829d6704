//! `--otlp-endpoint`: `baton serve` exports its spans over OTLP/HTTP (protobuf) to a receiver
//! started here, continuing the trace of a submit's `traceparent` (submit → dispatch → execute),
//! passes the trace on to the `http` handler's webhook, writes `trace_id` in JSON log lines, and
//! flushes at shutdown; without the flag nothing is sent, and the submit's `traceparent` still
//! reaches the webhook unchanged.

use std::collections::HashMap;
use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::body::Bytes;
use axum::extract::State;
use axum::http::HeaderMap;
use axum::routing::post;
use axum::{Json, Router};
use opentelemetry_proto::tonic::collector::trace::v1::ExportTraceServiceRequest;
use opentelemetry_proto::tonic::common::v1::any_value::Value as AnyValue;
use prost::Message;

const TRACE_ID: &str = "4bf92f3577b34da6a3ce929d0e0e4736";
const CALLER_SPAN: &str = "00f067aa0ba902b7";

/// A span as received: ids in hex, attributes as strings.
#[derive(Clone, Debug)]
struct Got {
    name: String,
    trace_id: String,
    span_id: String,
    parent: String,
    attrs: HashMap<String, String>,
    service: String,
}

/// `(command id, traceparent header)` of each webhook request.
type Hooks = Arc<Mutex<Vec<(String, Option<String>)>>>;

#[derive(Clone, Default)]
struct Receiver {
    spans: Arc<Mutex<Vec<Got>>>,
    posts: Arc<Mutex<usize>>,
    /// The `traceparent` headers the webhook got, by command id.
    hooks: Hooks,
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

fn text(v: &Option<opentelemetry_proto::tonic::common::v1::AnyValue>) -> String {
    match v.as_ref().and_then(|v| v.value.as_ref()) {
        Some(AnyValue::StringValue(s)) => s.clone(),
        Some(AnyValue::IntValue(i)) => i.to_string(),
        Some(AnyValue::BoolValue(b)) => b.to_string(),
        Some(other) => format!("{other:?}"),
        None => String::new(),
    }
}

async fn traces(State(r): State<Receiver>, body: Bytes) -> &'static str {
    let req = ExportTraceServiceRequest::decode(body).expect("an OTLP protobuf body");
    *r.posts.lock().unwrap() += 1;
    let mut spans = r.spans.lock().unwrap();
    for rs in req.resource_spans {
        let service = rs
            .resource
            .iter()
            .flat_map(|res| res.attributes.iter())
            .find(|kv| kv.key == "service.name")
            .map(|kv| text(&kv.value))
            .unwrap_or_default();
        for ss in rs.scope_spans {
            for s in ss.spans {
                spans.push(Got {
                    name: s.name,
                    trace_id: hex(&s.trace_id),
                    span_id: hex(&s.span_id),
                    parent: hex(&s.parent_span_id),
                    attrs: s.attributes.iter().map(|kv| (kv.key.clone(), text(&kv.value))).collect(),
                    service: service.clone(),
                });
            }
        }
    }
    ""
}

async fn hook(
    State(r): State<Receiver>,
    headers: HeaderMap,
    Json(body): Json<serde_json::Value>,
) -> Json<serde_json::Value> {
    let id = body["id"].as_str().unwrap_or_default().to_string();
    let tp = headers.get("traceparent").map(|v| v.to_str().unwrap().to_string());
    r.hooks.lock().unwrap().push((id, tp));
    Json(serde_json::json!({"status": "succeeded", "result": {"hooked": true}}))
}

/// The receiver (`POST /v1/traces`) and the webhook (`POST /hook`) on one free port.
async fn start_receiver() -> (Receiver, u16) {
    let r = Receiver::default();
    let app = Router::new().route("/v1/traces", post(traces)).route("/hook", post(hook)).with_state(r.clone());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    (r, port)
}

struct Proc {
    child: Child,
    base: String,
    stderr: std::path::PathBuf,
}

/// Writes the queue config (`jobs`: `echo`, and `hook` = the `http` handler to the receiver).
fn config(dir: &std::path::Path, receiver_port: u16) -> String {
    let cfg = dir.join("baton.toml");
    std::fs::write(
        &cfg,
        format!(
            "[queues.jobs.handlers]\necho = \"echo\"\nhook = {{ kind = \"http\", url = \"http://127.0.0.1:{receiver_port}/hook\", timeout = \"5s\" }}\n"
        ),
    )
    .unwrap();
    cfg.to_str().unwrap().to_string()
}

/// Starts `baton <args>` with JSON logs into `<dir>/<label>.log`, exporting to the receiver as
/// `service` when given; waits for its first stdout line, which must contain `ready`.
fn spawn(dir: &std::path::Path, label: &str, args: &[&str], otlp: Option<(u16, &str)>, ready: &str) -> Proc {
    let port = baton_testkit::free_port();
    let stderr = dir.join(format!("{label}.log"));
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_baton"));
    cmd.args(args)
        .args(["--log-format", "json"])
        .env("BATON_LOG", "info,baton_commands=debug")
        .env_remove("BATON_REDIS")
        .env_remove("BATON_REDIS_CLUSTER")
        .env_remove("BATON_OTLP_ENDPOINT")
        .env_remove("OTEL_EXPORTER_OTLP_ENDPOINT")
        .env_remove("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
        .stdout(Stdio::piped())
        .stderr(std::fs::File::create(&stderr).unwrap());
    if args[0] == "serve" {
        cmd.args(["--listen", &format!("127.0.0.1:{port}")]);
    }
    if let Some((receiver_port, service)) = otlp {
        cmd.args(["--otlp-endpoint", &format!("http://127.0.0.1:{receiver_port}"), "--otlp-service-name", service]);
    }
    let mut child = cmd.spawn().unwrap();
    let mut out = BufReader::new(child.stdout.take().unwrap());
    let mut first = String::new();
    out.read_line(&mut first).unwrap();
    assert!(first.contains(ready), "{first}");
    // Keep reading stdout so the process never blocks on a full pipe.
    std::thread::spawn(move || for _ in out.lines() {});
    Proc { child, base: format!("http://127.0.0.1:{port}"), stderr }
}

fn serve(dir: &std::path::Path, receiver_port: u16, otlp: bool) -> Proc {
    let cfg = config(dir, receiver_port);
    let label = if otlp { "serve-otlp" } else { "serve-off" };
    spawn(dir, label, &["serve", "--config", &cfg], otlp.then_some((receiver_port, "baton-test")), "listening on")
}

/// Submits `type` with the caller's `traceparent` and waits for the command to end.
async fn submit(base: &str, id: &str, command_type: &str) {
    let res = reqwest::Client::new()
        .post(format!("{base}/v1/queues/jobs/commands?wait=10s"))
        .header("content-type", "application/json")
        .header("traceparent", format!("00-{TRACE_ID}-{CALLER_SPAN}-01"))
        .header("tracestate", "caller=1")
        .body(serde_json::json!({"id": id, "type": command_type, "params": {"n": 1}}).to_string())
        .send()
        .await
        .unwrap();
    assert!(res.status().is_success(), "{}", res.status());
    let st: serde_json::Value = serde_json::from_slice(&res.bytes().await.unwrap()).unwrap();
    assert_eq!(st["status"], "SUCCEEDED", "{st}");
}

async fn stop(mut s: Proc) {
    let killed = Command::new("kill").args(["-TERM", &s.child.id().to_string()]).status().unwrap();
    assert!(killed.success());
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        if let Some(status) = s.child.try_wait().unwrap() {
            assert!(status.success(), "exit status {status}");
            return;
        }
        assert!(Instant::now() < deadline, "baton did not exit after SIGTERM");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn spans_are_exported_and_continue_the_submits_trace() {
    let dir = std::env::temp_dir().join(format!("baton-otlp-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let (r, rport) = start_receiver().await;

    // Export off (the default): nothing is sent; the caller's traceparent passes through as is.
    let s = serve(&dir, rport, false);
    submit(&s.base, "off-hook", "hook").await;
    stop(s).await;
    assert_eq!(*r.posts.lock().unwrap(), 0, "spans were sent without --otlp-endpoint");
    let hooks = r.hooks.lock().unwrap().clone();
    assert_eq!(hooks, [("off-hook".to_string(), Some(format!("00-{TRACE_ID}-{CALLER_SPAN}-01")))]);
    r.hooks.lock().unwrap().clear();

    // Export on.
    let s = serve(&dir, rport, true);
    submit(&s.base, "on-echo", "echo").await;
    submit(&s.base, "on-hook", "hook").await;
    let http = reqwest::Client::new();
    let url = format!("{}/v1/stream/traced/s1", s.base);
    let created = http.put(&url).header("content-type", "text/plain").send().await.unwrap();
    assert!(created.status().is_success(), "{}", created.status());
    let appended = http
        .post(&url)
        .header("content-type", "text/plain")
        .header("traceparent", format!("00-{TRACE_ID}-{CALLER_SPAN}-01"))
        .body("hello")
        .send()
        .await
        .unwrap();
    assert!(appended.status().is_success(), "{}", appended.status());
    let stderr = s.stderr.clone();
    stop(s).await;
    assert!(*r.posts.lock().unwrap() > 0, "no span was exported (flushed at shutdown)");
    let spans = r.spans.lock().unwrap().clone();
    assert!(spans.iter().all(|s| s.service == "baton-test"), "service.name");
    let ours: Vec<&Got> = spans.iter().filter(|s| s.trace_id == TRACE_ID).collect();
    let names: Vec<&str> = ours.iter().map(|s| s.name.as_str()).collect();
    let find = |name: &str, id: &str| -> &Got {
        ours.iter()
            .find(|s| s.name == name && s.attrs.get("baton.command.id").map(String::as_str) == Some(id))
            .unwrap_or_else(|| panic!("no {name} span of {id}: {names:?}"))
    };
    for id in ["on-echo", "on-hook"] {
        let submit = find("baton.submit", id);
        let http = ours
            .iter()
            .find(|s| s.span_id == submit.parent)
            .unwrap_or_else(|| panic!("the submit's parent is not exported: {submit:?}"));
        assert_eq!(http.name, "POST /v1/queues/{queue}/commands");
        assert_eq!(http.attrs["http.route"], "/v1/queues/{queue}/commands");
        assert_eq!(http.attrs["http.response.status_code"], "202");
        assert_eq!(http.parent, CALLER_SPAN, "the request's span is a child of the caller's");
        let dispatch = find("baton.dispatch", id);
        assert_eq!(dispatch.parent, submit.span_id, "dispatch is a child of submit");
        assert_eq!(dispatch.attrs["baton.queue"], "jobs");
        let execute = find("baton.execute", id);
        assert_eq!(execute.parent, dispatch.span_id, "execute is a child of dispatch");
        let done = ours
            .iter()
            .find(|s| {
                s.name == "baton.transition"
                    && s.attrs.get("baton.command.id").map(String::as_str) == Some(id)
                    && s.attrs["baton.status.to"] == "SUCCEEDED"
            })
            .unwrap_or_else(|| panic!("no transition to SUCCEEDED of {id}: {names:?}"));
        assert_eq!(done.parent, dispatch.span_id, "the outcome's write is inside dispatch");
    }
    let append = ours
        .iter()
        .find(|s| s.name == "baton.stream.append")
        .unwrap_or_else(|| panic!("no baton.stream.append span: {names:?}"));
    assert_eq!(append.attrs["baton.stream"], "traced/s1");
    let request = ours.iter().find(|s| s.span_id == append.parent).expect("the append's request span");
    assert!(request.name.starts_with("POST /v1/stream/"), "{request:?}");
    // The webhook continues the trace under the `http` handler's execute span.
    let hooks = r.hooks.lock().unwrap().clone();
    let execute = find("baton.execute", "on-hook");
    assert_eq!(hooks, [("on-hook".to_string(), Some(format!("00-{TRACE_ID}-{}-01", execute.span_id)))]);
    // JSON log lines inside a traced span carry its ids.
    let logs = std::fs::read_to_string(&stderr).unwrap();
    let traced: Vec<serde_json::Value> = logs
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .filter(|v| v["trace_id"] == TRACE_ID)
        .collect();
    assert!(!traced.is_empty(), "no JSON log line with the trace id:\n{logs}");
    assert!(traced.iter().all(|v| v["span_id"].as_str().is_some_and(|s| s.len() == 16)), "{traced:?}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// `baton serve --no-workers` and a `baton worker` on one Redis: the worker's `baton.dispatch`
/// (another process) is a child of the API's `baton.submit`, through the stored trace context.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_trace_crosses_the_queue_to_a_worker_process() {
    baton_testkit::require_redis();
    let redis = baton_testkit::RedisServer::start();
    let dir = std::env::temp_dir().join(format!("baton-otlp-redis-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let (r, rport) = start_receiver().await;
    let cfg = config(&dir, rport);
    let url = redis.url();
    let api = spawn(
        &dir,
        "api",
        &["serve", "--config", &cfg, "--redis", &url, "--no-workers"],
        Some((rport, "baton-api")),
        "listening on",
    );
    let worker = spawn(
        &dir,
        "worker",
        &["worker", "--config", &cfg, "--redis", &url],
        Some((rport, "baton-worker")),
        "working queues",
    );
    submit(&api.base, "cross-echo", "echo").await;
    stop(worker).await;
    stop(api).await;
    let spans = r.spans.lock().unwrap().clone();
    let of = |name: &str| -> Got {
        spans
            .iter()
            .find(|s| {
                s.name == name
                    && s.trace_id == TRACE_ID
                    && s.attrs.get("baton.command.id").map(String::as_str) == Some("cross-echo")
            })
            .cloned()
            .unwrap_or_else(|| panic!("no {name} span: {spans:?}"))
    };
    let (submit, dispatch, execute) = (of("baton.submit"), of("baton.dispatch"), of("baton.execute"));
    assert_eq!((submit.service.as_str(), dispatch.service.as_str()), ("baton-api", "baton-worker"));
    assert_eq!(dispatch.parent, submit.span_id, "dispatch (worker process) is a child of submit (API process)");
    assert_eq!(execute.parent, dispatch.span_id);
    let _ = std::fs::remove_dir_all(&dir);
}

/// `POST /v1/queues/{queue}/commands/batch`: the request's `traceparent` goes with every item, as
/// with a submit alone (export off: it reaches each webhook call unchanged).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_carries_the_traceparent_to_every_item() {
    let dir = std::env::temp_dir().join(format!("baton-otlp-batch-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let (r, rport) = start_receiver().await;
    let s = serve(&dir, rport, false);
    let http = reqwest::Client::new();
    let res = http
        .post(format!("{}/v1/queues/jobs/commands/batch", s.base))
        .header("content-type", "application/json")
        .header("traceparent", format!("00-{TRACE_ID}-{CALLER_SPAN}-01"))
        .body(
            serde_json::json!({"commands": [
                {"id": "batch-1", "type": "hook", "params": {"n": 1}},
                {"id": "batch-2", "type": "hook", "params": {"n": 2}},
            ]})
            .to_string(),
        )
        .send()
        .await
        .unwrap();
    assert_eq!(res.status(), 200);
    for id in ["batch-1", "batch-2"] {
        let res = http.get(format!("{}/v1/commands/{id}?wait=10s", s.base)).send().await.unwrap();
        let st: serde_json::Value = serde_json::from_slice(&res.bytes().await.unwrap()).unwrap();
        assert_eq!(st["status"], "SUCCEEDED", "{st}");
    }
    stop(s).await;
    let mut hooks = r.hooks.lock().unwrap().clone();
    hooks.sort();
    let tp = Some(format!("00-{TRACE_ID}-{CALLER_SPAN}-01"));
    assert_eq!(hooks, [("batch-1".to_string(), tp.clone()), ("batch-2".to_string(), tp)]);
    let _ = std::fs::remove_dir_all(&dir);
}
