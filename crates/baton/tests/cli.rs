//! The client subcommands (`baton streams|commands|queues|subscriptions`) and `baton bench`, run as the real
//! binary against a `baton serve` started by each test (in memory, on a free port): exact text
//! and JSON output, and exit codes (docs/cli.md), errors included.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use serde_json::{json, Value};

const BIN: &str = env!("CARGO_BIN_EXE_baton");

/// A `baton serve` child process, killed on drop.
struct Serve {
    child: Child,
    base: String,
}

impl Serve {
    fn start() -> Serve {
        Serve::start_env(&[])
    }

    /// [`Serve::start`] with more environment (e.g. `BATON_ADMIN_TOKEN`).
    fn start_env(env: &[(&str, &str)]) -> Serve {
        let port = baton_testkit::free_port();
        let child = Command::new(BIN)
            .args(["serve", "--listen", &format!("127.0.0.1:{port}")])
            .env_remove("BATON_CONFIG")
            .env_remove("BATON_ADMIN_TOKEN")
            .envs(env.iter().copied())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("baton serve starts");
        let deadline = Instant::now() + Duration::from_secs(20);
        while TcpStream::connect(("127.0.0.1", port)).is_err() {
            assert!(Instant::now() < deadline, "baton serve did not listen on {port}");
            std::thread::sleep(Duration::from_millis(30));
        }
        Serve { child, base: format!("http://127.0.0.1:{port}") }
    }

    /// Runs `baton <args>` against this server.
    fn run(&self, args: &[&str]) -> Out {
        self.run_stdin(args, None)
    }

    fn run_stdin(&self, args: &[&str], stdin: Option<&str>) -> Out {
        let mut cmd = Command::new(BIN);
        cmd.args(args).env("BATON_SERVER", &self.base).env_remove("BATON_TOKEN").env("BATON_LOG", "warn");
        cmd.stdin(if stdin.is_some() { Stdio::piped() } else { Stdio::null() });
        cmd.stdout(Stdio::piped()).stderr(Stdio::piped());
        let mut child = cmd.spawn().expect("baton runs");
        if let Some(s) = stdin {
            child.stdin.take().unwrap().write_all(s.as_bytes()).unwrap();
        }
        Out::from(child.wait_with_output().unwrap())
    }
}

impl Drop for Serve {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

#[derive(Debug)]
struct Out {
    code: i32,
    stdout: String,
    stderr: String,
}

impl From<Output> for Out {
    fn from(o: Output) -> Self {
        Out {
            code: o.status.code().unwrap_or(-1),
            stdout: String::from_utf8_lossy(&o.stdout).into_owned(),
            stderr: String::from_utf8_lossy(&o.stderr).into_owned(),
        }
    }
}

impl Out {
    fn ok(self) -> Self {
        assert_eq!(self.code, 0, "{self:?}");
        self
    }
    fn code(self, code: i32) -> Self {
        assert_eq!(self.code, code, "{self:?}");
        self
    }
    fn json(&self) -> Value {
        serde_json::from_str(&self.stdout).unwrap_or_else(|e| panic!("not JSON ({e}): {self:?}"))
    }
}

fn without(mut v: Value, keys: &[&str]) -> Value {
    if let Value::Object(m) = &mut v {
        for k in keys {
            m.remove(*k);
        }
    }
    v
}

#[test]
fn commands_submit_status_wait_cancel_list() {
    let s = Serve::start();
    let out = s.run(&["commands", "submit", "default", "echo", r#"{"n":1}"#, "--id", "c1"]).ok();
    assert_eq!(out.stdout, "submitted c1 to default (SUBMITTED)\n");
    // Same id and body: the existing command; another body: a conflict (exit 4).
    let out = s.run(&["commands", "submit", "default", "echo", r#"{"n":1}"#, "--id", "c1"]).ok();
    assert!(out.stdout.starts_with("c1 was already submitted to default ("), "{out:?}");
    let out = s.run(&["commands", "submit", "default", "echo", r#"{"n":2}"#, "--id", "c1"]).code(4);
    assert!(out.stderr.contains("409 Conflict (conflict)"), "{out:?}");

    let out = s.run(&["commands", "wait", "c1", "--timeout", "10s"]).ok();
    assert_eq!(out.stdout, "c1 SUCCEEDED: {\"n\":1}\n");
    let out = s.run(&["commands", "status", "c1", "--json"]).ok();
    let st = out.json();
    assert_eq!(
        without(st.clone(), &["created_at", "started_at", "modified_at", "completed_at", "version"]),
        json!({"id": "c1", "queue": "default", "type": "echo", "params": {"n": 1}, "status": "SUCCEEDED",
               "result": {"n": 1}, "error": null, "attempts": 1, "errors_count": 0, "handed_off_to": null})
    );
    let out = s.run(&["commands", "status", "c1"]).ok();
    let lines: Vec<&str> = out.stdout.lines().collect();
    assert_eq!(
        &lines[..5],
        [
            "id:            c1",
            "queue:         default",
            "type:          echo",
            "status:        SUCCEEDED",
            "params:        {\"n\":1}"
        ]
    );

    // Unknown id: not found (3). Bad duration: usage error (2), from the argument parser.
    let out = s.run(&["commands", "status", "nope"]).code(3);
    assert_eq!(out.stderr, "baton: no command nope (never submitted, or expired) [404 Not Found (not_found)]\n");
    s.run(&["commands", "wait", "nope"]).code(3);
    let out = s.run(&["commands", "wait", "c1", "--timeout", "soon"]).code(2);
    assert!(out.stderr.contains("invalid value 'soon' for '--timeout <TIMEOUT>'"), "{out:?}");
    assert!(out.stderr.contains("is not a duration like `30s`"), "{out:?}");
    let out = s.run(&["commands", "submit", "default", "echo", "{oops"]).code(2);
    assert!(out.stderr.starts_with("baton: params \"{oops\" are not JSON"), "{out:?}");
    let out = s.run(&["commands", "submit", "nosuchqueue", "echo"]).code(3);
    assert!(out.stderr.contains("no queue \"nosuchqueue\""), "{out:?}");
    let out = s.run(&["commands", "submit", "default", "teleport"]).code(2);
    assert!(out.stderr.contains("has no handler for type \"teleport\""), "{out:?}");
    s.run(&["commands", "list", "default", "--status", "sleepy"]).code(2);

    // A failing command: `submit --wait` exits 1.
    let out = s
        .run(&["commands", "submit", "default", "fail", r#"{"error":"disk full"}"#, "--id", "f1", "--wait", "10s"])
        .code(1);
    assert_eq!(out.stdout, "f1 FAILED: disk full\n");
    // A long command: the wait times out (6), then cancel (0), cancel again is refused (4).
    s.run(&["commands", "submit", "default", "sleep", r#"{"ms":600000}"#, "--id", "s1"]).ok();
    let t = Instant::now();
    let out = s.run(&["commands", "wait", "s1", "--timeout", "300ms"]).code(6);
    assert!(t.elapsed() < Duration::from_secs(5));
    assert!(out.stdout.starts_with("s1 is still "), "{out:?}");
    // While it sleeps: which call runs where, and its progress (written about once a second).
    let mut shown = String::new();
    for _ in 0..100 {
        shown = s.run(&["commands", "status", "s1"]).ok().stdout;
        if shown.contains("progress:") {
            break;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    let line = |k: &str| shown.lines().find(|l| l.starts_with(k)).unwrap_or_default().to_string();
    assert!(line("execution:").contains("execute on "), "{shown}");
    assert!(line("execution:").contains(", delivery 1, deadline "), "{shown}");
    assert!(line("progress:").contains("% slept "), "{shown}");
    assert!(line("progress:").ends_with(" of 600000 ms"), "{shown}");
    assert!(line("status:").contains("SUBMITTED"), "{shown}");
    let out = s.run(&["commands", "cancel", "s1"]).ok();
    assert_eq!(out.stdout, "cancelled s1\n");
    let out = s.run(&["commands", "cancel", "s1"]).code(4);
    assert_eq!(out.stderr, "baton: s1 has already ended (CANCELLED); it cannot be cancelled\n");
    let out = s.run(&["commands", "wait", "s1", "--json"]).code(1);
    assert_eq!(out.json()["status"], "CANCELLED");
    s.run(&["commands", "cancel", "nope"]).code(3);

    // Listing: newest first, filters, JSON pages.
    let out = s.run(&["commands", "list", "default"]).ok();
    let lines: Vec<&str> = out.stdout.lines().collect();
    assert_eq!(lines.len(), 4, "{out:?}");
    assert!(lines[0].starts_with("ID  TYPE   STATUS     ATTEMPTS  CREATED"), "{out:?}");
    assert!(lines[1].starts_with("s1  sleep  CANCELLED "), "{out:?}");
    assert!(lines[2].starts_with("f1  fail   FAILED     "), "{out:?}");
    assert!(lines[2].ends_with("disk full"), "{out:?}");
    assert!(lines[3].starts_with("c1  echo   SUCCEEDED  "), "{out:?}");
    assert!(lines[3].ends_with("{\"n\":1}"), "{out:?}");
    let out = s.run(&["commands", "list", "default", "--status", "succeeded", "--json"]).ok();
    let page = out.json();
    assert_eq!(page["items"].as_array().unwrap().len(), 1);
    assert_eq!(page["items"][0]["id"], "c1");
    assert_eq!(page["next_cursor"], Value::Null);
    let out = s.run(&["commands", "list", "default", "--limit", "1"]).ok();
    assert!(out.stdout.lines().last().unwrap().starts_with("more: --cursor "), "{out:?}");
    let out = s.run(&["commands", "list", "default", "--status", "running"]).ok();
    assert_eq!(out.stdout, "no RUNNING commands in default\n");
}

/// Params go to the server and come back byte for byte: `submit --wait` prints the echo's result
/// as the server sent it, `status --json` prints pretty JSON with every number, string escape and
/// key order as submitted, `status` the params text.
#[test]
fn commands_submit_batch() {
    let s = Serve::start();
    // Scheduled an hour ahead, so their states stay SUBMITTED.
    let lines = [
        r#"{"id": "b1", "type": "echo", "params": {"n": 1}, "delay": "1h"}"#,
        "",
        r#"{"id": "b1", "type": "echo", "params": {"n": 1}, "delay": "1h"}"#,
        r#"{"type": "nope"}"#,
        r#"{"id": "b1", "type": "echo", "params": {"n": 2}, "delay": "1h"}"#,
    ];
    let out = s.run_stdin(&["commands", "submit-batch", "default", "--file", "-"], Some(&lines.join("\n"))).code(2);
    assert_eq!(
        out.stdout,
        "line 1: submitted b1 (SUBMITTED)\n\
         line 3: b1 was already submitted (SUBMITTED)\n\
         line 4: refused 400 unknown_type: queue \"default\" has no handler for type \"nope\"; use one of echo, fail, sleep\n\
         line 5: refused 409 conflict: command b1 already exists with a different type or params; resubmit the same body, or use a new id\n"
    );
    assert_eq!(out.stderr, "1 submitted, 1 already submitted, 2 refused (queue default)\n");
    // The first refusal gives the exit code: a conflict first is 4.
    let out = s.run_stdin(&["commands", "submit-batch", "default", "--file", "-"], Some(lines[4])).code(4);
    assert!(out.stdout.starts_with("line 1: refused 409 conflict: "), "{out:?}");

    // 1,500 lines from a file: two requests (1,000 and 500), every one created, in order; --json
    // prints each result as the server wrote it.
    let dir = std::env::temp_dir().join(format!("baton-batch-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("commands.jsonl");
    let body: Vec<String> = (0..1500)
        .map(|i| format!(r#"{{"id": "f{i}", "type": "echo", "params": {{"n": {i}}}, "delay": "1h"}}"#))
        .collect();
    std::fs::write(&file, body.join("\n") + "\n").unwrap();
    let out = s.run(&["commands", "submit-batch", "default", "--file", file.to_str().unwrap(), "--json"]).ok();
    let results: Vec<Value> = out.stdout.lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    assert_eq!(results.len(), 1500);
    for (i, r) in results.iter().enumerate() {
        assert_eq!((r["status"].as_u64(), r["state"]["id"].as_str()), (Some(202), Some(format!("f{i}").as_str())));
        assert_eq!(r["state"]["params"], json!({"n": i}));
    }
    let out = s.run(&["commands", "status", "f1499", "--json"]).ok();
    assert_eq!(out.json()["params"], json!({"n": 1499}));

    // A line that is not JSON: nothing sent (exit 2).
    std::fs::write(&file, "{\"id\": \"g1\", \"type\": \"echo\"}\nnot json\n").unwrap();
    let out = s.run(&["commands", "submit-batch", "default", "--file", file.to_str().unwrap()]).code(2);
    assert!(out.stderr.contains("line 2 of "), "{out:?}");
    s.run(&["commands", "status", "g1"]).code(3);
    // An unknown queue: the request's own error (exit 3).
    let out = s.run_stdin(&["commands", "submit-batch", "nope", "--file", "-"], Some(lines[0])).code(3);
    assert!(out.stderr.contains("unknown_queue"), "{out:?}");
    std::fs::remove_dir_all(&dir).unwrap();
}

/// `submit-batch` reads each result without decoding the state's params: params the server
/// stores exactly but a `serde_json::Value` cannot hold (a number beyond f64, arrays nested
/// the full 127 deep) are created, not reported as refused with status 0 (and exit 1).
#[test]
fn commands_submit_batch_with_params_beyond_a_value() {
    let s = Serve::start();
    let deep = format!("{}{}", "[".repeat(127), "]".repeat(127));
    let lines = [
        r#"{"id": "v1", "type": "echo", "params": {"x": 1e400}, "delay": "1h"}"#.to_string(),
        format!(r#"{{"id": "v2", "type": "echo", "params": {deep}, "delay": "1h"}}"#),
    ];
    let out = s.run_stdin(&["commands", "submit-batch", "default", "--file", "-"], Some(&lines.join("\n"))).ok();
    assert_eq!(out.stdout, "line 1: submitted v1 (SUBMITTED)\nline 2: submitted v2 (SUBMITTED)\n", "{out:?}");
    assert_eq!(out.stderr, "2 submitted, 0 already submitted, 0 refused (queue default)\n");
}

#[test]
fn commands_params_and_results_come_back_exactly() {
    let s = Serve::start();
    let sample = baton_testkit::exact_json::sample(2_000, 9);
    let out = s.run(&["commands", "submit", "default", "echo", &sample.text, "--id", "x1", "--wait", "10s"]).ok();
    assert!(out.stdout == format!("x1 SUCCEEDED: {}\n", sample.text), "the result changed: {:.300}", out.stdout);
    let out = s.run(&["commands", "status", "x1", "--json"]).ok();
    assert!(!out.stdout.contains("\x1b["), "{out:?}");
    let floats = |doc: &str, field: &str| -> Vec<String> {
        let v: std::collections::BTreeMap<String, Box<serde_json::value::RawValue>> =
            serde_json::from_str(doc).unwrap();
        let p: std::collections::BTreeMap<String, Box<serde_json::value::RawValue>> =
            serde_json::from_str(v[field].get()).unwrap();
        let f: Vec<Box<serde_json::value::RawValue>> = serde_json::from_str(p["floats"].get()).unwrap();
        f.iter().map(|x| x.get().to_string()).collect()
    };
    let sent = baton_testkit::exact_json::floats(2_000, 9);
    assert!(floats(&out.stdout, "params") == sent, "--json: params' numbers changed");
    assert!(floats(&out.stdout, "result") == sent, "--json: result's numbers changed");
    for kept in [r#""text": "\u00e9 \ud83d\ude00 \"q\"""#, "18446744073709551615", "123456789012345678901234567890"] {
        assert!(out.stdout.contains(kept), "--json: {kept} missing");
    }
    // Key order as submitted: z before floats.
    assert!(out.stdout.find("\"z\": {").unwrap() < out.stdout.find("\"floats\": [").unwrap());
    let out = s.run(&["commands", "status", "x1"]).ok();
    assert!(out.stdout.contains(&format!("params:        {}\n", sample.text)), "status: params changed");
}

/// Log lines written to a pipe (not a terminal) carry no colour codes, with or without NO_COLOR.
#[test]
fn logs_on_a_pipe_have_no_colour_codes() {
    for no_color in [None, Some("1")] {
        let port = baton_testkit::free_port();
        let mut cmd = Command::new(BIN);
        cmd.args(["serve", "--listen", &format!("127.0.0.1:{port}")])
            .env_remove("BATON_CONFIG")
            .env_remove("NO_COLOR")
            .env("BATON_LOG", "info")
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        if let Some(v) = no_color {
            cmd.env("NO_COLOR", v);
        }
        let child = cmd.spawn().expect("baton serve starts");
        let deadline = Instant::now() + Duration::from_secs(20);
        while TcpStream::connect(("127.0.0.1", port)).is_err() {
            assert!(Instant::now() < deadline, "baton serve did not listen on {port}");
            std::thread::sleep(Duration::from_millis(30));
        }
        baton_testkit::sigterm(child.id());
        let out = Out::from(child.wait_with_output().unwrap()).ok();
        assert!(out.stderr.contains(" INFO "), "log lines expected: {out:?}");
        assert!(!out.stderr.contains('\x1b') && !out.stdout.contains('\x1b'), "colour codes on a pipe: {out:?}");
    }
}

#[test]
fn streams_create_append_read_tail_close_delete() {
    let s = Serve::start();
    let out = s.run(&["streams", "create", "acme/run-1"]).ok();
    assert_eq!(out.stdout, "created acme/run-1 (text/plain)\n");
    let out = s.run(&["streams", "create", "acme/run-1"]).ok();
    assert_eq!(out.stdout, "acme/run-1 already exists (text/plain)\n");
    let out = s.run(&["streams", "append", "acme/run-1", "hello\n"]).ok();
    assert!(out.stdout.starts_with("appended 6 bytes to acme/run-1; next offset "), "{out:?}");
    let out = s.run_stdin(&["streams", "append", "acme/run-1", "--json"], Some("from stdin\n")).ok();
    let v = out.json();
    assert_eq!((v["bytes"].clone(), v["closed"].clone()), (json!(11), json!(false)));
    let after_two = v["next_offset"].as_str().unwrap().to_string();

    let out = s.run(&["streams", "read", "acme/run-1"]).ok();
    assert_eq!(out.stdout, "hello\nfrom stdin\n");
    let out = s.run(&["streams", "read", "acme/run-1", "--json"]).ok();
    assert_eq!(
        out.json(),
        json!({"path": "acme/run-1", "content_type": "text/plain", "offset": "-1", "next_offset": after_two,
               "closed": false, "end_reason": null, "data": "hello\nfrom stdin\n"})
    );
    let out = s.run(&["streams", "read", "acme/run-1", "--offset", &after_two]).ok();
    assert_eq!(out.stdout, "");

    // tail follows live until the stream ends.
    let mut tail = Command::new(BIN)
        .args(["streams", "tail", "acme/run-1", "--json"])
        .env("BATON_SERVER", &s.base)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(tail.stdout.take().unwrap()).lines();
    let first: Value = serde_json::from_str(&lines.next().unwrap().unwrap()).unwrap();
    assert_eq!(first, json!({"next_offset": after_two, "data": "hello\nfrom stdin\n"}));
    s.run(&["streams", "append", "acme/run-1", "live line\n"]).ok();
    let live: Value = serde_json::from_str(&lines.next().unwrap().unwrap()).unwrap();
    assert_eq!(live["data"], "live line\n");
    let out = s.run(&["streams", "close", "acme/run-1", "--reason", "cancelled"]).ok();
    assert!(out.stdout.starts_with("closed acme/run-1 (cancelled); final offset "), "{out:?}");
    let end: Value = serde_json::from_str(&lines.next().unwrap().unwrap()).unwrap();
    assert_eq!((end["closed"].clone(), end["end_reason"].clone()), (json!(true), json!("cancelled")));
    let deadline = Instant::now() + Duration::from_secs(10);
    let status = loop {
        if let Some(st) = tail.try_wait().unwrap() {
            break st;
        }
        assert!(Instant::now() < deadline, "tail did not exit at the end of the stream");
        std::thread::sleep(Duration::from_millis(20));
    };
    assert!(status.success());

    // Text tail of an ended stream prints everything and says how it ended.
    let out = s.run(&["streams", "tail", "acme/run-1"]).ok();
    assert_eq!(out.stdout, "hello\nfrom stdin\nlive line\n");
    assert!(out.stderr.starts_with("baton: acme/run-1 has ended (cancelled) at offset "), "{out:?}");
    // Appending to an ended stream is refused (4).
    let out = s.run(&["streams", "append", "acme/run-1", "late\n"]).code(4);
    assert!(out.stderr.contains("409 Conflict"), "{out:?}");

    // JSON streams: one message per line.
    s.run(&["streams", "create", "acme/j", "--content-type", "application/json"]).ok();
    s.run(&["streams", "append", "acme/j", r#"{"a":1}"#]).ok();
    s.run(&["streams", "append", "acme/j", r#"[{"b":2},3]"#]).ok();
    let out = s.run(&["streams", "read", "acme/j"]).ok();
    assert_eq!(out.stdout, "{\"a\":1}\n{\"b\":2}\n3\n");
    let out = s.run(&["streams", "append", "acme/j", "{not json"]).code(2);
    assert!(out.stderr.contains("400 Bad Request"), "{out:?}");

    let out = s.run(&["streams", "delete", "acme/j"]).ok();
    assert_eq!(out.stdout, "deleted acme/j\n");
    let out = s.run(&["streams", "read", "acme/j"]).code(3);
    assert!(out.stderr.contains("404 Not Found (not_found)"), "{out:?}");
    // The server's HTTP advice, said the CLI's way.
    assert!(out.stderr.contains("create it with `baton streams create`"), "{out:?}");
    s.run(&["streams", "tail", "acme/missing"]).code(3);
    s.run(&["streams", "delete", "acme/missing"]).code(3);
    s.run(&["streams", "read", "acme/run-1", "--offset", "garbage"]).code(2);
    let out = s.run(&["streams", "read", "a//b"]).code(2);
    assert!(out.stderr.contains("is not a stream path"), "{out:?}");
    s.run(&["streams", "create", "acme/x", "--silence-timeout", "forever"]).code(2);
}

/// A re-create with other settings is refused (4), naming the stream, the setting and both
/// values; the same settings are fine.
#[test]
fn streams_create_with_other_settings() {
    let s = Serve::start();
    s.run(&["streams", "create", "acme/lim", "--silence-timeout", "60s", "--max-len", "5"]).ok();
    let out = s.run(&["streams", "create", "acme/lim", "--silence-timeout", "60s", "--max-len", "5"]).ok();
    assert_eq!(out.stdout, "acme/lim already exists with the same settings\n");
    let out = s.run(&["streams", "create", "acme/lim", "--silence-timeout", "30s", "--max-len", "5"]).code(4);
    assert!(out.stdout.is_empty(), "{out:?}");
    assert!(
        out.stderr.contains("acme/lim")
            && out.stderr.contains("Baton-Silence-Timeout")
            && out.stderr.contains("it has 60s, the request asks for 30s")
            && out.stderr.contains("409 Conflict"),
        "{out:?}"
    );
}

/// A close of an ended stream reports the end that was kept: exit 0 when it is the one asked
/// for, 4 when another end was kept.
#[test]
fn streams_close_of_an_ended_stream() {
    let s = Serve::start();
    s.run(&["streams", "create", "acme/lim"]).ok();
    s.run(&["streams", "close", "acme/lim"]).ok();
    let out = s.run(&["streams", "close", "acme/lim", "--reason", "cancelled"]).code(4);
    assert!(out.stdout.is_empty(), "{out:?}");
    assert!(out.stderr.contains("acme/lim had already ended (finished), not cancelled; nothing changed"), "{out:?}");
    let out = s.run(&["streams", "close", "acme/lim", "--reason", "cancelled", "--json"]).code(4);
    let v = out.json();
    assert_eq!((v["end_reason"].clone(), v["already_ended"].clone()), (json!("finished"), json!(true)));
    let out = s.run(&["streams", "close", "acme/lim"]).ok();
    assert!(out.stdout.starts_with("acme/lim had already ended (finished); final offset "), "{out:?}");
}

/// A missing stream is named, also where the server's answer has no body (HEAD).
#[test]
fn streams_missing_stream_is_named() {
    let s = Serve::start();
    let out = s.run(&["streams", "append", "acme/nope", "x"]).code(3);
    assert!(out.stderr.contains("stream acme/nope not found"), "{out:?}");
}

/// JSON messages are printed exactly as stored: key order and spelling kept.
#[test]
fn streams_json_messages_printed_as_stored() {
    let s = Serve::start();
    s.run(&["streams", "create", "acme/order", "--content-type", "application/json"]).ok();
    s.run(&["streams", "append", "acme/order", r#"{"z":1,"a":{"y":2,"b":3}}"#]).ok();
    s.run(&["streams", "append", "acme/order", r#"[{"m":1.50,"c":2}]"#]).ok();
    let out = s.run(&["streams", "read", "acme/order"]).ok();
    assert_eq!(out.stdout, "{\"z\":1,\"a\":{\"y\":2,\"b\":3}}\n{\"m\":1.50,\"c\":2}\n");
    let out = s.run(&["streams", "read", "acme/order", "--json"]).ok();
    assert!(out.stdout.contains(r#"{"z":1,"a":{"y":2,"b":3}}"#), "{out:?}");
    assert_eq!(out.json()["messages"], json!([{"z": 1, "a": {"y": 2, "b": 3}}, {"m": 1.5, "c": 2}]));
    s.run(&["streams", "close", "acme/order"]).ok();
    let out = s.run(&["streams", "tail", "acme/order"]).ok();
    assert_eq!(out.stdout, "{\"z\":1,\"a\":{\"y\":2,\"b\":3}}\n{\"m\":1.50,\"c\":2}\n");
    let out = s.run(&["streams", "tail", "acme/order", "--json"]).ok();
    let first = out.stdout.lines().next().unwrap();
    assert!(first.starts_with(r#"{"message":{"z":1,"a":{"y":2,"b":3}},"next_offset":""#), "{out:?}");
}

#[test]
fn queues_list_pending_dead_replay_and_errors() {
    let s = Serve::start();
    s.run(&["commands", "submit", "default", "echo", "--id", "e1", "--wait", "10s"]).ok();
    s.run(&["commands", "submit", "default", "sleep", r#"{"ms":600000}"#, "--id", "long"]).ok();
    let out = s.run(&["queues", "list"]).ok();
    let lines: Vec<&str> = out.stdout.lines().collect();
    assert_eq!(
        lines[0],
        "QUEUE    LENGTH  PENDING  CONSUMERS  LAG  SUBMITTED  SCHEDULED  RUNNING  SUCCEEDED  FAILED  CANCELLED  DEAD"
    );
    assert!(lines[1].starts_with("default "), "{out:?}");
    let cols: Vec<&str> = lines[1].split_whitespace().collect();
    assert_eq!(cols[5..], ["1", "0", "0", "1", "0", "0", "0"], "{out:?}");
    let out = s.run(&["queues", "list", "--json"]).ok();
    let q = &out.json()["queues"][0];
    assert_eq!(q["name"], "default");
    assert_eq!(
        q["commands"],
        json!({"submitted": 1, "running": 0, "succeeded": 1, "failed": 0, "cancelled": 0, "total": 2, "scheduled": 0, "next_due": null})
    );

    let out = s.run(&["queues", "pending", "default"]).ok();
    let lines: Vec<&str> = out.stdout.lines().collect();
    assert!(lines[0].starts_with("default: "), "{out:?}");
    assert!(lines[0].ends_with("1 submitted, 0 running"), "{out:?}");
    // One consumer (this server's one worker on the queue): singular.
    assert!(lines[0].contains(" pending (delivered, not acknowledged), 1 consumer, lag "), "{out:?}");
    assert!(lines[1].starts_with("ID    TYPE   STATUS     ATTEMPTS  CREATED"), "{out:?}");
    assert!(lines[2].starts_with("long  sleep  SUBMITTED "), "{out:?}");
    let out = s.run(&["queues", "pending", "default", "--json"]).ok();
    assert_eq!(out.json()["commands"][0]["id"], "long");

    let out = s.run(&["queues", "dead", "default"]).ok();
    assert_eq!(out.stdout, "no dead letters in default\n");
    let out = s.run(&["queues", "dead", "default", "--json"]).ok();
    assert_eq!(out.json(), json!({"items": []}));
    let out = s.run(&["queues", "replay", "default", "1700000000000-0"]).code(3);
    assert!(out.stderr.contains("no dead letter 1700000000000-0"), "{out:?}");
    s.run(&["queues", "replay", "default", "not-an-id"]).code(2);
    let out = s.run(&["queues", "replay", "default", "--all"]).ok();
    assert_eq!(out.stdout, "replayed 0 dead letters onto default\n");
    s.run(&["queues", "replay", "default"]).code(2);

    // Pause: submits wait (the lag is exact while paused), the list marks the queue; resume.
    let out = s.run(&["queues", "pause", "default"]).ok();
    assert_eq!(out.stdout, "paused default (0 commands wait)\n");
    s.run(&["commands", "submit", "default", "echo", "--id", "e2"]).ok();
    let out = s.run(&["queues", "pause", "default"]).ok();
    assert_eq!(out.stdout, "default was already paused (1 command waits)\n");
    let out = s.run(&["queues", "list"]).ok();
    assert!(out.stdout.lines().nth(1).unwrap().starts_with("default (paused) "), "{out:?}");
    let out = s.run(&["queues", "pause", "default", "--json"]).ok();
    assert_eq!((out.json()["paused"].as_bool(), out.json()["changed"].as_bool()), (Some(true), Some(false)));
    let out = s.run(&["commands", "status", "e2"]).ok();
    assert!(out.stdout.contains("SUBMITTED"), "{out:?}");
    let out = s.run(&["queues", "resume", "default"]).ok();
    assert_eq!(out.stdout, "resumed default\n");
    s.run(&["commands", "wait", "e2", "--timeout", "10s"]).ok();
    let out = s.run(&["queues", "resume", "default"]).ok();
    assert_eq!(out.stdout, "default was not paused\n");
    s.run(&["queues", "pause", "nosuchqueue"]).code(3);
    s.run(&["queues", "pause"]).code(2);

    s.run(&["queues", "pending", "nosuchqueue"]).code(3);
    s.run(&["queues", "dead", "nosuchqueue"]).code(3);

    // No server there: a network error (5). A bad --server: usage (2).
    let port = baton_testkit::free_port();
    let out = Out::from(
        Command::new(BIN).args(["queues", "list", "--server", &format!("http://127.0.0.1:{port}")]).output().unwrap(),
    )
    .code(5);
    assert!(out.stderr.contains("cannot connect to http://127.0.0.1:"), "{out:?}");
    Out::from(Command::new(BIN).args(["queues", "list", "--server", "ftp://x"]).output().unwrap()).code(2);
    Out::from(Command::new(BIN).args(["queues", "frobnicate"]).output().unwrap()).code(2);
}

/// `commands watch` follows a 2 s sleep from submitted to succeeded and exits 0 (a failed one
/// exits 1; `--json` prints each event as one line); `queues events` prints the queue's events
/// from an offset and where to read next.
fn watch_and_events(s: Serve) {
    s.run(&["commands", "submit", "default", "sleep", r#"{"ms":2000}"#, "--id", "nap"]).ok();
    let t = Instant::now();
    let out = s.run(&["commands", "watch", "nap"]).ok();
    assert!(t.elapsed() >= Duration::from_millis(1500), "{:?}", t.elapsed());
    let lines: Vec<&str> = out.stdout.lines().collect();
    // `<at> <event> <status>[ <progress>]`: submitted, started (about a second in), maybe
    // progress reports, succeeded.
    let words: Vec<Vec<&str>> = lines.iter().map(|l| l.split(' ').collect()).collect();
    assert!(words.iter().all(|w| w[0].len() == 24 && w[0].ends_with('Z')), "{out:?}");
    assert_eq!(lines[0][24..], *" submitted SUBMITTED", "{out:?}");
    assert_eq!(words[1][1..3], ["started", "SUBMITTED"], "{out:?}");
    for w in &words[2..lines.len() - 1] {
        assert_eq!(w[1..3], ["progress", "SUBMITTED"], "{out:?}");
    }
    assert_eq!(words[lines.len() - 1][1..3], ["succeeded", "SUCCEEDED"], "{out:?}");

    s.run(&["commands", "submit", "default", "fail", r#"{"error":"disk full"}"#, "--id", "bad"]).ok();
    let out = s.run(&["commands", "watch", "bad"]).code(1);
    let lines: Vec<&str> = out.stdout.lines().collect();
    assert_eq!(lines.len(), 2, "{out:?}");
    assert_eq!(lines[0][24..], *" submitted SUBMITTED", "{out:?}");
    assert_eq!(lines[1][24..], *" failed FAILED error: disk full", "{out:?}");
    let out = s.run(&["commands", "watch", "bad", "--json"]).code(1);
    let events: Vec<Value> = out.stdout.lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    let short: Vec<(&str, &str, u64)> = events
        .iter()
        .map(|e| (e["event"].as_str().unwrap(), e["status"].as_str().unwrap(), e["version"].as_u64().unwrap()))
        .collect();
    assert_eq!(short, [("submitted", "SUBMITTED", 1), ("failed", "FAILED", 2)]);
    assert_eq!(events[1]["error"], "disk full");
    // A re-run: refused while not FAILED or CANCELLED (exit 4); watch goes on past the first
    // outcome to the last.
    let out = s.run(&["commands", "retry", "nap"]).code(4);
    assert!(out.stderr.contains("nap is SUCCEEDED; only FAILED or CANCELLED commands can be re-run"), "{out:?}");
    let out = s.run(&["commands", "retry", "bad"]).ok();
    assert_eq!(out.stdout, "re-running bad (SUBMITTED)\n");
    s.run(&["commands", "wait", "bad"]).code(1);
    let out = s.run(&["commands", "watch", "bad"]).code(1);
    let kinds: Vec<&str> = out.stdout.lines().map(|l| l.split(' ').nth(1).unwrap()).collect();
    assert_eq!(kinds, ["submitted", "failed", "rerun", "failed"], "{out:?}");
    let out = s.run(&["commands", "bulk", "retry", "default", "--type", "fail", "--dry-run"]).ok();
    assert_eq!(out.stdout, "would re-run 1 of 1 commands looked at (dry run)\n");
    let out = s.run(&["commands", "bulk", "cancel", "default", "--status", "succeeded", "--max", "1"]).ok();
    assert_eq!(out.stdout, "cancelled 0 of 1 commands looked at (0 eligible, 0 refused: changed meanwhile)\n");
    s.run(&["commands", "bulk", "delete", "default"]).code(2);
    let out = s.run(&["commands", "list", "default", "--type", "fail", "--json"]).ok();
    let page: Value = serde_json::from_str(&out.stdout).unwrap();
    assert_eq!(
        page["items"].as_array().unwrap().iter().map(|i| i["id"].as_str().unwrap()).collect::<Vec<_>>(),
        ["bad"]
    );
    let out = s.run(&["queues", "workers", "default"]).ok();
    assert!(out.stdout.starts_with("WORKER"), "{out:?}");
    assert!(out.stdout.contains(" alive "), "{out:?}");
    assert!(out.stdout.ends_with("1 alive, 0 dead\n"), "{out:?}");
    // Per minute: `nap` succeeded, `bad` failed twice (its re-run counts again).
    let out = s.run(&["queues", "minutes", "default", "--json"]).ok();
    let v: Value = serde_json::from_str(&out.stdout).unwrap();
    let minutes = v["minutes"].as_array().unwrap();
    assert_eq!(minutes.len(), 15);
    let total = |k: &str| minutes.iter().map(|m| m[k].as_u64().unwrap()).sum::<u64>();
    assert_eq!((total("succeeded"), total("failed"), total("cancelled")), (1, 2, 0), "{v}");
    let out = s.run(&["queues", "minutes", "default", "--last", "3"]).ok();
    let lines: Vec<&str> = out.stdout.lines().collect();
    assert_eq!(lines.len(), 4, "{out:?}");
    assert!(lines[0].starts_with("MINUTE") && lines[0].ends_with("OLDEST"), "{out:?}");
    s.run(&["queues", "minutes", "default", "--last", "0"]).code(2);
    let out = s.run(&["commands", "watch", "nope"]).code(3);
    assert_eq!(out.stderr, "baton: no command nope (never submitted, or expired) [404 Not Found (not_found)]\n");

    // The queue's events: both commands, with their ids; then from the last offset, none.
    let out = s.run(&["queues", "events", "default"]).ok();
    let lines: Vec<&str> = out.stdout.lines().collect();
    let kinds: Vec<(&str, &str)> =
        lines[..lines.len() - 1].iter().map(|l| l.split(' ').collect::<Vec<_>>()).map(|w| (w[1], w[2])).collect();
    let n = kinds.len();
    assert_eq!(kinds[..2], [("nap", "submitted"), ("nap", "started")], "{out:?}");
    assert_eq!(
        kinds[n - 5..],
        [("nap", "succeeded"), ("bad", "submitted"), ("bad", "failed"), ("bad", "rerun"), ("bad", "failed")],
        "{out:?}"
    );
    let next = lines[n].strip_prefix("next: --offset ").expect("the next offset");
    let out = s.run(&["queues", "events", "default", "--offset", next]).ok();
    assert_eq!(out.stdout, format!("next: --offset {next}\n"));
    let out = s.run(&["queues", "events", "default", "--offset", "now", "--json"]).ok();
    assert_eq!(out.stdout, "");
    let out = s.run(&["queues", "events", "default", "--offset", "x"]).code(2);
    assert_eq!(
        out.stderr,
        "baton: invalid offset \"x\": use -1 (the start), now (the tail) or an offset returned by a read [400 Bad \
         Request (invalid_offset)]\n"
    );
    s.run(&["queues", "events", "nosuchqueue"]).code(3);

    // --follow: a command submitted while it waits is printed.
    let mut child = Command::new(BIN)
        .args(["queues", "events", "default", "--offset", next, "--follow"])
        .env("BATON_SERVER", &s.base)
        .env_remove("BATON_TOKEN")
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    std::thread::sleep(Duration::from_millis(300));
    s.run(&["commands", "submit", "default", "echo", "--id", "late"]).ok();
    let mut line = String::new();
    BufReader::new(child.stdout.take().unwrap()).read_line(&mut line).unwrap();
    let _ = child.kill();
    let _ = child.wait();
    assert_eq!(line[24..], *" late submitted SUBMITTED\n", "{line:?}");
}

#[test]
fn commands_watch_and_queues_events() {
    watch_and_events(Serve::start());
}

#[test]
fn commands_watch_and_queues_events_on_redis() {
    baton_testkit::require_redis();
    let redis = baton_testkit::RedisServer::start();
    watch_and_events(Serve::start_env(&[("BATON_REDIS", &redis.url())]));
}

/// `baton streams list`: a table in path order with each stream's state, pages with `more:
/// --cursor`, the JSON with `--json`, an empty prefix said so.
fn streams_list(s: Serve) {
    s.run(&["streams", "create", "acme/run-2"]).ok();
    s.run(&["streams", "create", "acme/run-1", "--content-type", "application/json"]).ok();
    s.run(&["streams", "append", "acme/run-1", "[1,2,3]"]).ok();
    s.run(&["streams", "create", "acme/run-3"]).ok();
    s.run(&["streams", "close", "acme/run-3", "--reason", "cancelled"]).ok();
    s.run(&["streams", "create", "other/x"]).ok();
    let out = s.run(&["streams", "list", "acme/", "--limit", "2"]).ok();
    let lines: Vec<&str> = out.stdout.lines().collect();
    assert_eq!(lines.len(), 4, "{out:?}");
    let cols = |l: &str| l.split_whitespace().take(4).map(str::to_string).collect::<Vec<_>>().join(" ");
    assert_eq!(cols(lines[0]), "PATH CONTENT TYPE LENGTH");
    assert_eq!(cols(lines[1]), "acme/run-1 application/json 3 open");
    assert_eq!(cols(lines[2]), "acme/run-2 text/plain 0 open");
    assert_eq!(lines[3], "more: --cursor acme/run-2");
    let out = s.run(&["streams", "list", "acme/", "--limit", "2", "--cursor", "acme/run-2"]).ok();
    let lines: Vec<&str> = out.stdout.lines().collect();
    assert_eq!(lines.len(), 2, "{out:?}");
    assert_eq!(
        lines[1].split_whitespace().take(5).collect::<Vec<_>>(),
        ["acme/run-3", "text/plain", "0", "ended", "(cancelled)"]
    );
    let out = s.run(&["streams", "list", "--json"]).ok();
    let v = out.json();
    let paths: Vec<&str> = v["streams"].as_array().unwrap().iter().map(|x| x["path"].as_str().unwrap()).collect();
    assert_eq!(paths, ["acme/run-1", "acme/run-2", "acme/run-3", "other/x"]);
    assert_eq!(v["next_cursor"], Value::Null);
    let out = s.run(&["streams", "list", "nobody/"]).ok();
    assert_eq!(out.stdout, "no streams under nobody/\n");
    let out = s.run(&["streams", "list", "--cursor", "a//b"]).code(2);
    assert!(out.stderr.contains("(invalid_cursor)"), "{out:?}");
}

#[test]
fn streams_list_by_prefix() {
    streams_list(Serve::start());
}

#[test]
fn streams_list_by_prefix_on_redis() {
    baton_testkit::require_redis();
    let redis = baton_testkit::RedisServer::start();
    streams_list(Serve::start_env(&[("BATON_REDIS", &redis.url())]));
}

#[test]
fn streams_list_by_prefix_on_cluster() {
    baton_testkit::require_redis();
    let cluster = baton_testkit::RedisCluster::start();
    streams_list(Serve::start_env(&[("BATON_REDIS_CLUSTER", &cluster.urls().join(","))]));
}

/// `baton streams list`'s `more: --cursor …` line, pasted into a shell, gives back the exact
/// path even when it holds spaces, quotes or glob characters (it is shell-quoted then).
#[test]
fn streams_list_cursor_survives_a_shell() {
    let s = Serve::start();
    for p in ["sp/a b*'q", "sp/z", "plain/run-1", "plain/run-2"] {
        s.run(&["streams", "create", p]).ok();
    }
    let more = |prefix: &str| {
        let out = s.run(&["streams", "list", prefix, "--limit", "1"]).ok();
        out.stdout.lines().last().unwrap().strip_prefix("more: --cursor ").expect("a more: line").to_string()
    };
    let word = more("sp/");
    let echoed = std::process::Command::new("sh").arg("-c").arg(format!("printf %s {word}")).output().unwrap();
    assert_eq!(String::from_utf8(echoed.stdout).unwrap(), "sp/a b*'q", "printed: {word}");
    // A plain path is printed as it is.
    assert_eq!(more("plain/"), "plain/run-1");
}

/// A bare HTTP/1.1 request to `base` (`Connection: close`): the status and the body.
fn http(base: &str, method: &str, path: &str, token: Option<&str>, body: &str) -> (u16, String) {
    let addr = base.trim_start_matches("http://");
    let mut c = TcpStream::connect(addr).unwrap();
    let auth = token.map(|t| format!("Authorization: Bearer {t}\r\n")).unwrap_or_default();
    write!(
        c,
        "{method} {path} HTTP/1.1\r\nHost: {addr}\r\n{auth}Content-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    let mut res = String::new();
    c.read_to_string(&mut res).unwrap();
    let status = res[9..12].parse().unwrap();
    let body = res.split_once("\r\n\r\n").map(|(_, b)| b.to_string()).unwrap_or_default();
    (status, body)
}

#[test]
fn subscriptions_rotate_key_and_get() {
    const ADMIN: &str = "admin-secret-for-the-cli-0123456789";
    let s = Serve::start_env(&[("BATON_ADMIN_TOKEN", ADMIN)]);
    let jwks_kids = || -> Vec<Value> {
        let (st, body) = http(&s.base, "GET", "/v1/stream/__ds/jwks.json", None, "");
        assert_eq!(st, 200, "{body}");
        let v: Value = serde_json::from_str(&body).unwrap();
        v["keys"].as_array().unwrap().iter().map(|k| k["kid"].clone()).collect()
    };
    let old = jwks_kids();

    // No token, or a wrong one: refused (4), the CLI's hint about --token.
    let out = s.run(&["subscriptions", "rotate-key"]).code(4);
    assert!(out.stderr.contains("401 Unauthorized (unauthorized)"), "{out:?}");
    assert!(out.stderr.contains("--token TOKEN or BATON_TOKEN"), "{out:?}");
    s.run(&["subscriptions", "rotate-key", "--token", "wrong-token-0123456789abcdef"]).code(4);
    assert_eq!(jwks_kids(), old);

    // The new kid, alone on its line; the JWKS lists it first.
    let out = s.run(&["subscriptions", "rotate-key", "--token", ADMIN]).ok();
    let kid = out.stdout.strip_suffix('\n').unwrap().to_string();
    assert!(kid.starts_with("ds_") && !kid.contains(char::is_whitespace), "{out:?}");
    assert_eq!(jwks_kids(), vec![json!(kid), old[0].clone()]);
    let out = s.run(&["subscriptions", "rotate-key", "--token", ADMIN, "--json"]).ok();
    let v = out.json();
    assert_eq!(v["jwks_url"], format!("{}/v1/stream/__ds/jwks.json", s.base));
    assert_eq!(jwks_kids()[0], v["kid"]);

    // get: the subscription's JSON as the server sends it; an unknown id is not found (3).
    s.run(&["streams", "create", "acme/wake", "--content-type", "application/json", "--token", ADMIN]).ok();
    let spec = r#"{"type":"pull-wake","pattern":"acme/sub/*","wake_stream":"acme/wake"}"#;
    let (st, created) = http(&s.base, "PUT", "/v1/stream/__ds/subscriptions/cli-sub", Some(ADMIN), spec);
    assert_eq!(st, 201, "{created}");
    let out = s.run(&["subscriptions", "get", "cli-sub", "--token", ADMIN]).ok();
    let got = out.json();
    assert_eq!(got, serde_json::from_str::<Value>(&created).unwrap());
    assert_eq!(got["subscription_id"], "cli-sub", "{got}");
    let out = s.run(&["subscriptions", "get", "no-such-sub", "--token", ADMIN]).code(3);
    assert!(out.stderr.contains("subscription \"no-such-sub\" not found"), "{out:?}");
    assert_eq!(out.stdout, "");
    // Admin only, like the HTTP route.
    s.run(&["subscriptions", "get", "cli-sub"]).code(4);
}

#[test]
fn bench_runs_each_workload_in_memory() {
    /// A result row: name, concurrency, ops, what the latency is of.
    type Row<'a> = (&'a str, u64, u64, &'a str);
    // (workload, arguments, the rows expected)
    let runs: [(&str, &[&str], &[Row]); 3] = [
        (
            "queue",
            &["--count", "300", "--concurrency", "1,16"],
            &[("queue", 1, 300, "offer → handler"), ("queue", 16, 300, "offer → handler")],
        ),
        ("commands", &["--count", "100", "--concurrency", "8"], &[("commands", 8, 100, "submit → SUCCEEDED")]),
        (
            "streams",
            &["--count", "200", "--concurrency", "4"],
            &[("stream append", 4, 200, "append call"), ("append → live read", 1, 200, "append → subscriber")],
        ),
    ];
    for (workload, extra, expected) in runs {
        let mut args = vec!["bench", workload, "--quiet", "--json"];
        args.extend(extra);
        let out = Out::from(Command::new(BIN).args(&args).env("BATON_LOG", "warn").output().unwrap()).ok();
        let v = out.json();
        assert_eq!(v["workload"], workload);
        assert_eq!(v["backend"], "in-memory");
        let rows: Vec<Row> = v["results"]
            .as_array()
            .unwrap()
            .iter()
            .map(|r| {
                (
                    r["name"].as_str().unwrap(),
                    r["concurrency"].as_u64().unwrap(),
                    r["ops"].as_u64().unwrap(),
                    r["latency"].as_str().unwrap(),
                )
            })
            .collect();
        assert_eq!(rows, expected, "{v}");
        for r in v["results"].as_array().unwrap() {
            // The printed throughput is the printed ops over the printed seconds.
            let (ops, secs, rate) =
                (r["ops"].as_f64().unwrap(), r["seconds"].as_f64().unwrap(), r["ops_per_sec"].as_f64().unwrap());
            assert!(secs > 0.0 && (rate - ops / secs).abs() <= 1e-6 * rate, "{r}");
            let (p50, p99, max) =
                (r["p50_ms"].as_f64().unwrap(), r["p99_ms"].as_f64().unwrap(), r["max_ms"].as_f64().unwrap());
            assert!(p50 > 0.0 && p50 <= p99 && p99 <= max && max <= secs * 1e3, "{r}");
        }
    }
    // The text table.
    let out = Out::from(
        Command::new(BIN)
            .args(["bench", "queue", "--count", "100", "--concurrency", "4", "--quiet"])
            .env("BATON_LOG", "warn")
            .output()
            .unwrap(),
    )
    .ok();
    let lines: Vec<&str> = out.stdout.lines().collect();
    assert!(lines[0].starts_with("backend: in-memory; "), "{out:?}");
    assert!(lines[1].starts_with("WORKLOAD  CONCURRENCY  OPS  SECONDS  OPS/S  "), "{out:?}");
    assert!(lines[2].starts_with("queue "), "{out:?}");
    Out::from(Command::new(BIN).args(["bench", "queue", "--concurrency", "0"]).output().unwrap()).code(2);
}

/// `bench commands --open-loop`: an `add` row (latency per `submit_many` call) and a `drain` row
/// (no latency) per concurrency; on Redis each `commands` row counts Redis calls per command,
/// in memory none.
#[test]
fn bench_commands_open_loop() {
    baton_testkit::require_redis();
    let redis = baton_testkit::RedisServer::start();
    let url = redis.url();
    for backend in [None, Some(url.as_str())] {
        let mut args = vec!["bench", "commands", "--open-loop", "--count", "250", "--batch", "100"];
        args.extend(["--concurrency", "8,16", "--quiet", "--json"]);
        if let Some(u) = backend {
            args.extend(["--redis", u]);
        }
        let out = Out::from(Command::new(BIN).args(&args).env("BATON_LOG", "warn").output().unwrap()).ok();
        let v = out.json();
        let rows: Vec<(&str, u64, u64, &str)> = v["results"]
            .as_array()
            .unwrap()
            .iter()
            .map(|r| {
                let name = r["name"].as_str().unwrap();
                (name, r["concurrency"].as_u64().unwrap(), r["ops"].as_u64().unwrap(), r["latency"].as_str().unwrap())
            })
            .collect();
        assert_eq!(
            rows,
            [
                ("commands add", 8, 250, "submit_many call"),
                ("commands drain", 8, 250, "–"),
                ("commands add", 16, 250, "submit_many call"),
                ("commands drain", 16, 250, "–"),
            ],
            "{v}"
        );
        for r in v["results"].as_array().unwrap() {
            let (ops, secs, rate) =
                (r["ops"].as_f64().unwrap(), r["seconds"].as_f64().unwrap(), r["ops_per_sec"].as_f64().unwrap());
            assert!(secs > 0.0 && (rate - ops / secs).abs() <= 1e-6 * rate, "{r}");
            let (p50, max) = (r["p50_ms"].as_f64().unwrap(), r["max_ms"].as_f64().unwrap());
            if r["name"] == "commands add" {
                // 3 calls: 100, 100 and 50 commands.
                assert!(p50 > 0.0 && p50 <= max && max <= secs * 1e3, "{r}");
            } else {
                assert_eq!((p50, max), (0.0, 0.0), "{r}");
            }
            let calls = &r["redis_calls_per_op"];
            match backend {
                None => assert!(calls.is_null(), "{r}"),
                // Every command is stored with a script call; INFO itself is left out.
                Some(_) => {
                    assert!(calls["evalsha"].as_f64().unwrap() > 0.0, "{r}");
                    assert!(calls.get("info").is_none(), "{r}");
                }
            }
        }
    }
    // The text table, and the calls under it.
    let out = Out::from(
        Command::new(BIN)
            .args(["bench", "commands", "--open-loop", "--count", "50", "--concurrency", "4", "--quiet"])
            .args(["--redis", &url])
            .env("BATON_LOG", "warn")
            .output()
            .unwrap(),
    )
    .ok();
    let lines: Vec<&str> = out.stdout.lines().collect();
    assert_eq!(lines.len(), 7, "{out:?}");
    assert!(lines[2].starts_with("commands add "), "{out:?}");
    let drain: Vec<&str> = lines[3].split_whitespace().collect();
    assert_eq!((drain[..4].join(" ").as_str(), &drain[6..]), ("commands drain 4 50", &["–"; 4][..]), "{out:?}");
    assert_eq!(lines[4], "Redis calls per operation (INFO commandstats, all clients of that Redis):");
    assert!(lines[5].starts_with("  commands add c=4: ") && lines[5].contains("; total "), "{out:?}");
    assert!(lines[6].starts_with("  commands drain c=4: ") && lines[6].contains("; total "), "{out:?}");
    Out::from(Command::new(BIN).args(["bench", "commands", "--open-loop", "--batch", "0"]).output().unwrap()).code(2);
}

/// `commands submit --output…`, `status` showing the link, `output` reading it and `output
/// --follow` following it until the command's cancel ends it.
fn command_output(s: Serve) {
    let out = s.run(&["commands", "submit", "default", "sleep", r#"{"ms":600000}"#, "--id", "o1", "--output"]).ok();
    assert_eq!(
        out.stdout,
        "submitted o1 to default (SUBMITTED)\noutput: commands/o1 (run 1, application/json) at /v1/stream/commands/o1\n"
    );
    let out = s.run(&["commands", "status", "o1"]).ok();
    let line = out.stdout.lines().find(|l| l.starts_with("output:")).unwrap_or_default().to_string();
    assert_eq!(line, "output:        commands/o1 (run 1, application/json) at /v1/stream/commands/o1");
    // Another output for the same id is a conflict (4).
    let out = s
        .run(&["commands", "submit", "default", "sleep", r#"{"ms":600000}"#, "--id", "o1", "--output-path", "x/o1"])
        .code(4);
    assert!(out.stderr.contains("already exists with a different output"), "{out:?}");

    // The handler (here: a writer of our own) appends; `output` prints what is there.
    s.run(&["streams", "append", "commands/o1", r#"{"line":1}"#]).ok();
    let out = s.run(&["commands", "output", "o1"]).ok();
    assert_eq!(out.stdout, "{\"line\":1}\n");
    let mut follow = Command::new(BIN)
        .args(["commands", "output", "o1", "--follow"])
        .env("BATON_SERVER", &s.base)
        .env_remove("BATON_TOKEN")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(follow.stdout.take().unwrap()).lines();
    assert_eq!(lines.next().unwrap().unwrap(), r#"{"line":1}"#);
    s.run(&["streams", "append", "commands/o1", r#"{"line":2}"#]).ok();
    assert_eq!(lines.next().unwrap().unwrap(), r#"{"line":2}"#);
    // Cancelling the command ends its output: the follow ends.
    s.run(&["commands", "cancel", "o1"]).ok();
    let deadline = Instant::now() + Duration::from_secs(10);
    let status = loop {
        if let Some(st) = follow.try_wait().unwrap() {
            break st;
        }
        assert!(Instant::now() < deadline, "output --follow did not exit when the command was cancelled");
        std::thread::sleep(Duration::from_millis(20));
    };
    assert!(status.success());
    let mut err = String::new();
    follow.stderr.take().unwrap().read_to_string(&mut err).unwrap();
    assert!(err.starts_with("baton: commands/o1 has ended (cancelled) at offset "), "{err:?}");
    let out = s.run(&["commands", "output", "o1", "--json"]).ok();
    let v = out.json();
    assert_eq!(
        (&v["messages"], &v["closed"], &v["end_reason"]),
        (&json!([{"line": 1}, {"line": 2}]), &json!(true), &json!("cancelled"))
    );

    // Options: a path, a content type and a silence timeout; a failure's error ends the output.
    let out = s
        .run(&[
            "commands",
            "submit",
            "default",
            "fail",
            r#"{"error":"no disk"}"#,
            "--id",
            "o2",
            "--output-path",
            "team/o2",
            "--output-content-type",
            "text/plain",
            "--output-silence-timeout",
            "2m",
            "--json",
        ])
        .ok();
    let o = &out.json()["output"];
    assert_eq!(
        (&o["stream"], &o["content_type"], &o["silence_timeout_ms"]),
        (&json!("team/o2"), &json!("text/plain"), &json!(120_000))
    );
    s.run(&["commands", "wait", "o2", "--timeout", "10s"]).code(1);
    let out = s.run(&["commands", "output", "o2", "--follow"]).ok();
    assert_eq!(out.stdout, "error: no disk");
    // Bad options are refused by the server with what to fix (2); no output: exit 3.
    let out = s.run(&["commands", "submit", "default", "echo", "--output-path", "a//b"]).code(2);
    assert_eq!(
        out.stderr,
        "baton: \"output\" must be true, or {\"path\"?: \"a/stream/path\", \"content_type\"?: \"application/json\", \"silence_timeout\"?: \"60s\"}; \"path\" \"a//b\": invalid request: a stream path has empty, `.` or `..` segments [400 Bad Request (invalid_body)]\n"
    );
    s.run(&["commands", "submit", "default", "echo", "--id", "plain"]).ok();
    let out = s.run(&["commands", "output", "plain"]).code(3);
    assert_eq!(
        out.stderr,
        "baton: command plain has no output stream (it was submitted without one: `baton commands submit … --output`)\n"
    );
    s.run(&["commands", "output", "nope"]).code(3);
}

#[test]
fn commands_output() {
    command_output(Serve::start());
}

#[test]
fn commands_output_on_redis() {
    baton_testkit::require_redis();
    let redis = baton_testkit::RedisServer::start();
    command_output(Serve::start_env(&[("BATON_REDIS", &redis.url())]));
}

#[test]
fn commands_output_on_redis_cluster() {
    baton_testkit::require_redis();
    let cluster = baton_testkit::RedisCluster::start();
    command_output(Serve::start_env(&[("BATON_REDIS_CLUSTER", &cluster.urls().join(","))]));
}

/// `baton queues schedules Q`: the table (header, one row per schedule with its last fire) and
/// `--json`; a queue without schedules says so.
#[test]
fn queues_schedules() {
    let dir = std::env::temp_dir().join(format!("baton-cli-sched-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let config = dir.join("baton.toml");
    std::fs::write(
        &config,
        "[queues.cron.handlers]\nsay = \"echo\"\n[queues.plain.handlers]\nsay = \"echo\"\n\
         [[queues.cron.schedules]]\nname = \"tick\"\ncron = \"* * * * * *\"\ntype = \"say\"\noverlap = \"allow\"\n\
         [[queues.cron.schedules]]\nname = \"nightly\"\ncron = \"30 2 * * *\"\ntimezone = \"Europe/Berlin\"\ntype = \"say\"\n",
    )
    .unwrap();
    let s = Serve::start_env(&[("BATON_CONFIG", config.to_str().unwrap())]);
    std::thread::sleep(Duration::from_millis(2_200));
    let out = s.run(&["queues", "schedules", "cron"]).ok();
    let lines: Vec<&str> = out.stdout.lines().collect();
    assert_eq!(lines.len(), 3, "{out:?}");
    let head: Vec<&str> = lines[0].split_whitespace().collect();
    assert_eq!(
        head,
        [
            "SCHEDULE", "CRON", "TIMEZONE", "TYPE", "OVERLAP", "MISSED", "NEXT", "DUE", "LAST", "FIRE", "RESULT",
            "COMMAND"
        ]
    );
    assert!(lines[1].starts_with("tick "), "{out:?}");
    assert!(lines[1].contains(" fired ") && lines[1].contains(" sched-cron.tick-"), "{out:?}");
    assert!(lines[2].starts_with("nightly ") && lines[2].contains(" Europe/Berlin "), "{out:?}");
    assert!(lines[2].ends_with(" -  -  -") || lines[2].split_whitespace().rev().take(3).all(|w| w == "-"), "{out:?}");
    let out = s.run(&["queues", "schedules", "cron", "--json"]).ok();
    let v: Value = serde_json::from_str(&out.stdout).unwrap();
    assert_eq!(v["schedules"][1]["name"], "nightly");
    assert_eq!(v["schedules"][0]["last_fire"]["result"], "fired");
    let out = s.run(&["queues", "schedules", "plain"]).ok();
    assert_eq!(out.stdout, "no schedules on plain\n");
    s.run(&["queues", "schedules", "nope"]).code(3);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn commands_submit_with_priority() {
    let s = Serve::start();
    let out = s.run(&["commands", "submit", "default", "echo", "7", "--id", "p1", "--priority", "-3", "--json"]).ok();
    assert_eq!(out.json()["priority"], -3, "{out:?}");
    let shown = s.run(&["commands", "status", "p1"]).ok();
    assert!(shown.stdout.lines().any(|l| l.starts_with("priority") && l.trim_end().ends_with("-3")), "{shown:?}");
    let out = s.run(&["commands", "submit", "default", "echo", "--priority", "11"]).code(2);
    assert!(out.stderr.contains("11 is not in -10..=10"), "{out:?}");
}

#[test]
fn commands_scheduled_submit_reschedule_list() {
    let s = Serve::start();
    let out = s.run(&["commands", "submit", "default", "echo", "7", "--id", "s1", "--delay", "1h", "--json"]).ok();
    let run_at = out.json()["run_at"].as_str().expect("run_at").to_string();
    let shown = s.run(&["commands", "status", "s1"]).ok();
    assert!(shown.stdout.lines().any(|l| l.starts_with("run_at") && l.contains(&run_at)), "{shown:?}");
    let out = s.run(&["commands", "list", "default", "--scheduled", "--json"]).ok();
    let listed = out.json();
    let ids: Vec<&str> = listed["items"].as_array().unwrap().iter().map(|i| i["id"].as_str().unwrap()).collect();
    assert_eq!(ids, ["s1"], "{out:?}");
    let out = s.run(&["queues", "list", "--json"]).ok();
    assert_eq!(out.json()["queues"][0]["commands"]["scheduled"], 1, "{out:?}");
    let out = s.run(&["commands", "reschedule", "s1", "--delay", "200ms"]).ok();
    assert!(out.stdout.starts_with("s1 is due at "), "{out:?}");
    s.run(&["commands", "wait", "s1", "--timeout", "10s"]).ok();
    let out = s.run(&["commands", "reschedule", "s1", "--delay", "1s"]).code(4);
    assert!(out.stderr.contains("no longer waits for a due time"), "{out:?}");
    s.run(&["commands", "submit", "default", "echo", "--run-at", "2026-01-01T00:00:00Z", "--delay", "1s"]).code(2);
    s.run(&["commands", "reschedule", "s1"]).code(2);
}
