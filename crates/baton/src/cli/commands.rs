//! `baton commands submit|submit-batch|status|wait|watch|output|cancel|retry|bulk|list`: the command API from the
//! command line, and the event feed reader `baton queues events` shares with `watch`
//! ([`read_events`]). `output` reads a command's output stream with the `streams` reader and tail.

use std::time::{Duration, Instant};

use clap::Subcommand;
use reqwest::Method;
use serde_json::value::RawValue;
use serde_json::Value;

use super::args::duration_arg;
use super::client::{encode_query, encode_segment, read_json_text, CliError, Client};
use super::exit;
use super::output::{cell, clip, print_json_exact, raw_field, Table};

/// The server's longest `?wait=` (5 minutes); longer waits are made of several requests.
const WAIT_STEP: Duration = Duration::from_secs(300);

#[derive(Subcommand, Debug)]
pub enum CommandsOp {
    /// Submit a command to a queue (idempotent on --id).
    Submit {
        /// Queue name, e.g. default.
        queue: String,
        /// Command type (a handler of the queue), e.g. echo.
        #[arg(name = "type")]
        command_type: String,
        /// Params as JSON, e.g. '{"ms": 500}' [default: null].
        params: Option<String>,
        /// Command id [default: a new UUIDv7 chosen by the server].
        #[arg(long)]
        id: Option<String>,
        /// Then wait up to this long for the command to end (exit code as `commands wait`).
        #[arg(long, value_parser = duration_arg)]
        wait: Option<Duration>,
        /// Give the command an output stream (created now, written by its handler, ended with
        /// the command); follow it with `baton commands output ID --follow`.
        #[arg(long)]
        output: bool,
        /// The output stream's path [default: commands/<id>] (implies --output).
        #[arg(long)]
        output_path: Option<String>,
        /// The output stream's content type [default: application/json] (implies --output).
        #[arg(long)]
        output_content_type: Option<String>,
        /// End the output stream producer_lost, and the command FAILED, after this long with no
        /// append nor keepalive [default: never] (implies --output).
        #[arg(long, value_parser = duration_arg)]
        output_silence_timeout: Option<Duration>,
        /// Schedule it: its handler is not called before this RFC 3339 time, e.g.
        /// 2026-12-24T18:00:00Z (the command is stored now, SUBMITTED, and waits).
        #[arg(long, conflicts_with = "delay")]
        run_at: Option<String>,
        /// Schedule it this long from now, e.g. 30s, 10m, 2h.
        #[arg(long, value_parser = duration_arg)]
        delay: Option<Duration>,
        /// Its concurrency key (1 – 256 bytes): on a queue with concurrency_per_key, commands of
        /// one key run at most that many at once, in submit order.
        #[arg(long)]
        concurrency_key: Option<String>,
        /// Its priority, -10 to 10 (default 0): taken before every waiting command of a lower
        /// priority on its queue, in submit order among equal ones (strict: a flood of higher
        /// priorities holds lower ones back until it drains).
        #[arg(long, allow_negative_numbers = true, value_parser = clap::value_parser!(i8).range(-10..=10))]
        priority: Option<i8>,
    },
    /// Submit many commands to a queue from a JSON Lines file (one submit body per line).
    ///
    /// FILE holds one submit body per line (as `POST /v1/queues/{queue}/commands` takes it, e.g.
    /// {"type": "echo", "params": {"n": 1}}; `-` reads stdin), sent in requests of at most 1000.
    /// Prints one line per item; exits with the code of the first item refused (as `commands
    /// submit` of it alone would), else 0.
    SubmitBatch {
        /// Queue name, e.g. default.
        queue: String,
        /// The JSON Lines file (`-`: stdin); blank lines are skipped.
        #[arg(long)]
        file: String,
    },
    /// Move the due time of a scheduled command still waiting for it (refused with exit code 4
    /// once it has been enqueued, started or ended).
    Reschedule {
        id: String,
        /// The new due time, an RFC 3339 time.
        #[arg(long, conflicts_with = "delay", required_unless_present = "delay")]
        run_at: Option<String>,
        /// The new due time, this long from now, e.g. 30s.
        #[arg(long, value_parser = duration_arg)]
        delay: Option<Duration>,
    },
    /// Show a command's state.
    Status { id: String },
    /// Wait until a command ends; exit 0 when SUCCEEDED, 1 when FAILED or CANCELLED, 6 on timeout.
    Wait {
        id: String,
        /// Give up after this long [default: wait until it ends].
        #[arg(long, value_parser = duration_arg)]
        timeout: Option<Duration>,
    },
    /// Follow a command's events (long-polls of its event feed), one line each, until it ends;
    /// exit 0 when it SUCCEEDED, 1 when it FAILED or was CANCELLED.
    Watch { id: String },
    /// Print a command's output stream (one line per JSON message, or its text) up to its current
    /// end; with --follow, follow it live until it ends (exit 0 when it ended; `commands wait`
    /// gives the command's outcome). Exit 3 when the command has no output stream.
    Output {
        id: String,
        /// Follow it live (server-sent events) until it ends or ctrl-c.
        #[arg(long, short = 'f')]
        follow: bool,
        /// `-1` (the beginning), `now` (with --follow: only new data), or an offset.
        #[arg(long, default_value = "-1", allow_hyphen_values = true)]
        offset: String,
    },
    /// Cancel a command (refused with exit code 4 when it has already ended).
    Cancel { id: String },
    /// Re-run a FAILED or CANCELLED command from the start (refused with exit code 4 otherwise).
    Retry { id: String },
    /// Cancel or re-run a queue's commands that the filters select, each by itself (cancel: those
    /// not ended; retry: the FAILED and CANCELLED ones); --dry-run only counts them.
    Bulk {
        /// cancel or retry.
        #[arg(value_parser = ["cancel", "retry"])]
        action: String,
        queue: String,
        /// Only this status: submitted, running, succeeded, failed or cancelled.
        #[arg(long, value_parser = parse_status)]
        status: Option<String>,
        /// Only commands of this type.
        #[arg(long = "type")]
        command_type: Option<String>,
        /// Only ids starting with this.
        #[arg(long)]
        id_prefix: Option<String>,
        /// Only commands created at this RFC 3339 time or later.
        #[arg(long)]
        created_after: Option<String>,
        /// Only commands created before this RFC 3339 time.
        #[arg(long)]
        created_before: Option<String>,
        /// Count, change nothing.
        #[arg(long)]
        dry_run: bool,
        /// Look at most at this many commands (1 to 10000); prints `more: --cursor …` to go on.
        #[arg(long, default_value_t = 1000, value_parser = clap::value_parser!(u32).range(1..=10000))]
        max: u32,
        /// The cursor printed by the previous call (with the same filters).
        #[arg(long)]
        cursor: Option<String>,
    },
    /// List a queue's commands, newest first.
    List {
        queue: String,
        /// Only this status: submitted, running, succeeded, failed or cancelled.
        #[arg(long, value_parser = parse_status)]
        status: Option<String>,
        /// At most this many (1 to 1000).
        #[arg(long, default_value_t = 20, value_parser = clap::value_parser!(u32).range(1..=1000))]
        limit: u32,
        /// The next_cursor printed by the previous page.
        #[arg(long)]
        cursor: Option<String>,
        /// Only commands of this type.
        #[arg(long = "type")]
        command_type: Option<String>,
        /// Only ids starting with this.
        #[arg(long)]
        id_prefix: Option<String>,
        /// Only commands created at this RFC 3339 time or later, e.g. 2026-12-04T10:00:00Z.
        #[arg(long)]
        created_after: Option<String>,
        /// Only commands created before this RFC 3339 time.
        #[arg(long)]
        created_before: Option<String>,
        /// Only scheduled commands still waiting for their due time.
        #[arg(long)]
        scheduled: bool,
    },
}

fn parse_status(s: &str) -> Result<String, String> {
    let up = s.trim().to_ascii_uppercase();
    match up.as_str() {
        "SUBMITTED" | "RUNNING" | "SUCCEEDED" | "FAILED" | "CANCELLED" => Ok(up),
        "PENDING" => Ok("SUBMITTED".into()),
        "PROCESSING" => Ok("RUNNING".into()),
        _ => Err(format!("{s:?} is not a status; use submitted, running, succeeded, failed or cancelled")),
    }
}

pub async fn run(cl: &Client, op: CommandsOp) -> Result<u8, CliError> {
    match op {
        CommandsOp::Submit {
            queue,
            command_type,
            params,
            id,
            wait,
            output,
            output_path,
            output_content_type,
            output_silence_timeout,
            run_at,
            delay,
            concurrency_key,
            priority,
        } => {
            // The params are sent as their text, byte for byte (the server keeps them so).
            let params: &RawValue = match params.as_deref() {
                None => serde_json::from_str("null").expect("null is JSON"),
                Some(p) => serde_json::from_str(p).map_err(|e| {
                    CliError::usage(format!("params {p:?} are not JSON ({e}); quote them, e.g. '{{\"ms\": 500}}'"))
                })?,
            };
            let detailed = output_path.is_some() || output_content_type.is_some() || output_silence_timeout.is_some();
            let output = if detailed {
                let mut o = serde_json::Map::new();
                if let Some(p) = output_path {
                    o.insert("path".into(), Value::String(p));
                }
                if let Some(ct) = output_content_type {
                    o.insert("content_type".into(), Value::String(ct));
                }
                if let Some(d) = output_silence_timeout {
                    o.insert("silence_timeout".into(), Value::String(format!("{}ms", d.as_millis())));
                }
                Some(Value::Object(o))
            } else {
                output.then_some(Value::Bool(true))
            };
            let delay = delay.map(|d| format!("{}ms", d.as_millis()));
            let body = SubmitBody {
                id: id.as_deref(),
                command_type: &command_type,
                params,
                output,
                run_at,
                delay,
                concurrency_key,
                priority,
            };
            let body = serde_json::to_string(&body).expect("serializable");
            let url = format!("/v1/queues/{}/commands", encode_segment(&queue));
            let res = cl
                .send_ok(cl.request(Method::POST, &url).header("content-type", "application/json").body(body))
                .await?;
            let created = res.status() == reqwest::StatusCode::ACCEPTED;
            let (text, state) = read_json_text(res).await?;
            match wait {
                None => {
                    if cl.json {
                        print_json_exact(&text);
                    } else {
                        let id = cell(state.get("id"));
                        let status = cell(state.get("status"));
                        if created {
                            println!("submitted {id} to {queue} ({status})");
                        } else {
                            println!("{id} was already submitted to {queue} ({status})");
                        }
                        if let Some(o) = state.get("output").filter(|o| o.is_object()) {
                            println!("output: {}", output_text(o));
                        }
                    }
                    Ok(exit::OK)
                }
                Some(d) => {
                    let id = cell(state.get("id"));
                    if !cl.json {
                        eprintln!("submitted {id} to {queue}; waiting up to {}", humantime::format_duration(d));
                    }
                    wait_for(cl, &id, Some(d)).await
                }
            }
        }
        CommandsOp::SubmitBatch { queue, file } => submit_batch(cl, &queue, &file).await,
        CommandsOp::Status { id } => {
            let (text, state) = json_text_ok(cl, cl.request(Method::GET, &command_path(&id))).await?;
            if cl.json {
                print_json_exact(&text);
            } else {
                print_state(&state, &text);
            }
            Ok(exit::OK)
        }
        CommandsOp::Wait { id, timeout } => wait_for(cl, &id, timeout).await,
        CommandsOp::Watch { id } => {
            let path = format!("{}/events", command_path(&id));
            let read = read_events(cl, &path, "-1", Follow::UntilTerminal, false);
            let end = tokio::select! {
                r = read => r?,
                _ = tokio::signal::ctrl_c() => return Err(CliError { code: exit::TIMEOUT, message: format!("interrupted while watching {id}") }),
            };
            Ok(match end.terminal.as_deref() {
                Some("succeeded") => exit::OK,
                _ => exit::UNSUCCESSFUL,
            })
        }
        CommandsOp::Output { id, follow, offset } => {
            let (_, state) = json_text_ok(cl, cl.request(Method::GET, &command_path(&id))).await?;
            let Some(stream) = state.get("output").and_then(|o| o.get("stream")).and_then(Value::as_str) else {
                return Err(CliError {
                    code: exit::NOT_FOUND,
                    message: format!(
                        "command {id} has no output stream (it was submitted without one: `baton commands submit … --output`)"
                    ),
                });
            };
            if follow {
                tokio::select! {
                    r = super::streams::tail(cl, stream, &offset) => r,
                    _ = tokio::signal::ctrl_c() => Ok(exit::OK),
                }
            } else {
                super::streams::read(cl, stream, &offset).await
            }
        }
        CommandsOp::Cancel { id } => {
            let refused = |status: &str| format!("{id} has already ended ({status}); it cannot be cancelled");
            act(cl, &id, "cancel", refused, &format!("cancelled {id}")).await
        }
        CommandsOp::Reschedule { id, run_at, delay } => {
            let body = match (run_at, delay) {
                (Some(t), _) => serde_json::json!({ "run_at": t }),
                (None, Some(d)) => serde_json::json!({ "delay": format!("{}ms", d.as_millis()) }),
                (None, None) => return Err(CliError::usage("give --run-at or --delay".to_string())),
            };
            let rb = cl
                .request(Method::POST, &format!("{}/schedule", command_path(&id)))
                .header("content-type", "application/json")
                .body(body.to_string());
            let res = cl.send(rb).await?;
            if res.status() == reqwest::StatusCode::CONFLICT {
                let v = super::client::read_json(res).await.unwrap_or(Value::Null);
                let status = v.get("state").map(|s| cell(s.get("status"))).unwrap_or_else(|| "?".into());
                return Err(CliError {
                    code: exit::REFUSED,
                    message: format!("{id} ({status}) no longer waits for a due time; it cannot be rescheduled"),
                });
            }
            if !res.status().is_success() {
                return Err(super::client::error_from(res).await);
            }
            let (text, state) = read_json_text(res).await?;
            if cl.json {
                print_json_exact(&text);
            } else {
                println!("{id} is due at {}", cell(state.get("run_at")));
            }
            Ok(exit::OK)
        }
        CommandsOp::Retry { id } => {
            let refused = |status: &str| format!("{id} is {status}; only FAILED or CANCELLED commands can be re-run");
            act(cl, &id, "retry", refused, &format!("re-running {id} (SUBMITTED)")).await
        }
        CommandsOp::Bulk {
            action,
            queue,
            status,
            command_type,
            id_prefix,
            created_after,
            created_before,
            dry_run,
            max,
            cursor,
        } => {
            let body = serde_json::json!({
                "action": action, "dry_run": dry_run, "max": max, "status": status, "type": command_type,
                "id_prefix": id_prefix, "created_after": created_after, "created_before": created_before, "cursor": cursor,
            });
            let url = format!("/v1/queues/{}/commands/bulk", encode_segment(&queue));
            let rb = cl.request(Method::POST, &url).header("content-type", "application/json").body(body.to_string());
            let (text, r) = json_text_ok(cl, rb).await?;
            if cl.json {
                print_json_exact(&text);
                return Ok(exit::OK);
            }
            let n = |k: &str| r.get(k).and_then(Value::as_u64).unwrap_or(0);
            let verb = if action == "cancel" { "cancel" } else { "re-run" };
            if dry_run {
                println!("would {verb} {} of {} commands looked at (dry run)", n("eligible"), n("looked_at"));
            } else {
                let done = if action == "cancel" { "cancelled" } else { "re-ran" };
                println!(
                    "{done} {} of {} commands looked at ({} eligible, {} refused: changed meanwhile)",
                    n("applied"),
                    n("looked_at"),
                    n("eligible"),
                    n("refused")
                );
            }
            if let Some(c) = r.get("next_cursor").and_then(Value::as_str) {
                println!("more: --cursor {c}");
            }
            Ok(exit::OK)
        }
        CommandsOp::List {
            queue,
            status,
            limit,
            cursor,
            command_type,
            id_prefix,
            created_after,
            created_before,
            scheduled,
        } => {
            let mut url = format!("/v1/queues/{}/commands?limit={limit}", encode_segment(&queue));
            if scheduled {
                url.push_str("&scheduled=true");
            }
            if let Some(s) = &status {
                url.push_str(&format!("&status={s}"));
            }
            for (name, v) in [
                ("cursor", &cursor),
                ("type", &command_type),
                ("id_prefix", &id_prefix),
                ("created_after", &created_after),
                ("created_before", &created_before),
            ] {
                if let Some(v) = v {
                    url.push_str(&format!("&{name}={}", encode_query(v)));
                }
            }
            let (text, page) = json_text_ok(cl, cl.request(Method::GET, &url)).await?;
            if cl.json {
                print_json_exact(&text);
                return Ok(exit::OK);
            }
            let items = page.get("items").and_then(Value::as_array).cloned().unwrap_or_default();
            // The items' results as the server wrote them.
            let raw_items = raw_field(&text, "items")
                .and_then(|t| serde_json::from_str::<Vec<&RawValue>>(t).ok())
                .unwrap_or_default();
            if items.is_empty() {
                let which = status.map(|s| format!(" {s}")).unwrap_or_default();
                println!("no{which} commands in {queue}");
            } else {
                let mut t = Table::new(&["ID", "TYPE", "STATUS", "ATTEMPTS", "CREATED", "RESULT/ERROR"]).right(&[3]);
                for (i, s) in items.iter().enumerate() {
                    let raw_result = raw_items.get(i).and_then(|r| raw_field(r.get(), "result"));
                    let outcome = match (s.get("error"), s.get("result")) {
                        (Some(Value::String(e)), _) => e.clone(),
                        (_, Some(r)) if !r.is_null() => raw_result.map(str::to_string).unwrap_or_else(|| r.to_string()),
                        _ => String::new(),
                    };
                    t.row(vec![
                        cell(s.get("id")),
                        cell(s.get("type")),
                        cell(s.get("status")),
                        cell(s.get("attempts")),
                        cell(s.get("created_at")),
                        clip(&outcome, 48),
                    ]);
                }
                t.print();
            }
            if let Some(next) = page.get("next_cursor").and_then(Value::as_str) {
                println!("more: --cursor {next}");
            }
            Ok(exit::OK)
        }
    }
}

/// `POST /v1/commands/{id}/<action>` (cancel, retry): prints `done` (or the state with
/// `--json`); a `409` is exit 4 with `refused(<the state's status>)`.
async fn act(
    cl: &Client,
    id: &str,
    action: &str,
    refused: impl Fn(&str) -> String,
    done: &str,
) -> Result<u8, CliError> {
    let res = cl.send(cl.request(Method::POST, &format!("{}/{action}", command_path(id)))).await?;
    if res.status() == reqwest::StatusCode::CONFLICT {
        let v = super::client::read_json(res).await.unwrap_or(Value::Null);
        let status = v.get("state").map(|s| cell(s.get("status"))).unwrap_or_else(|| "?".into());
        return Err(CliError { code: exit::REFUSED, message: refused(&status) });
    }
    if !res.status().is_success() {
        return Err(super::client::error_from(res).await);
    }
    let (text, _) = read_json_text(res).await?;
    if cl.json {
        print_json_exact(&text);
    } else {
        println!("{done}");
    }
    Ok(exit::OK)
}

fn command_path(id: &str) -> String {
    format!("/v1/commands/{}", encode_segment(id))
}

/// The body of a submit: the params as their text.
#[derive(serde::Serialize)]
struct SubmitBody<'a> {
    #[serde(skip_serializing_if = "Option::is_none")]
    id: Option<&'a str>,
    #[serde(rename = "type")]
    command_type: &'a str,
    params: &'a RawValue,
    #[serde(skip_serializing_if = "Option::is_none")]
    output: Option<Value>,
    #[serde(skip_serializing_if = "Option::is_none")]
    run_at: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    delay: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    concurrency_key: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    priority: Option<i8>,
}

/// Sends, requires a 2xx, and returns the JSON body as text and as a value.
/// The most commands of one batch request (the server's limit).
const BATCH_MAX: usize = 1000;

/// `commands submit-batch`: the lines of `file` (each a submit body, kept byte for byte) sent
/// to `POST /v1/queues/{queue}/commands/batch` in requests of at most [`BATCH_MAX`]; one line
/// printed per item (with --json: its result as the server wrote it).
async fn submit_batch(cl: &Client, queue: &str, file: &str) -> Result<u8, CliError> {
    let text = if file == "-" {
        let mut t = String::new();
        std::io::Read::read_to_string(&mut std::io::stdin(), &mut t)
            .map_err(|e| CliError::usage(format!("cannot read stdin: {e}")))?;
        t
    } else {
        std::fs::read_to_string(file).map_err(|e| CliError::usage(format!("cannot read {file:?}: {e}")))?
    };
    // (line number, body); every line is checked to be JSON before anything is sent.
    let mut items: Vec<(usize, &str)> = Vec::new();
    for (i, line) in text.lines().enumerate() {
        let line = line.trim();
        if line.is_empty() {
            continue;
        }
        if let Err(e) = serde_json::from_str::<&RawValue>(line) {
            return Err(CliError::usage(format!(
                "line {} of {file} is not JSON ({e}); write one submit body per line, e.g. {{\"type\": \"echo\", \"params\": {{\"n\": 1}}}}",
                i + 1
            )));
        }
        items.push((i + 1, line));
    }
    if items.is_empty() {
        return Err(CliError::usage(format!("{file} holds no command (one submit body per line)")));
    }
    let url = format!("/v1/queues/{}/commands/batch", encode_segment(queue));
    let (mut created, mut stored, mut failed) = (0usize, 0usize, 0usize);
    let mut code = exit::OK;
    for chunk in items.chunks(BATCH_MAX) {
        let bodies: Vec<&str> = chunk.iter().map(|(_, b)| *b).collect();
        let body = format!("{{\"commands\":[{}]}}", bodies.join(","));
        let rb = cl.request(Method::POST, &url).header("content-type", "application/json").body(body);
        // Read as text, each result through `Item`: a state's params are kept exactly by the
        // server and may be beyond a `Value` (a number past f64, nesting 127 deep inside the
        // reply's own 3 levels); they are skipped here, never decoded.
        let res = cl.send_ok(rb).await?;
        let text = res.text().await.map_err(|e| CliError::server(format!("reading the reply failed: {e}")))?;
        #[derive(serde::Deserialize)]
        struct Report<'a> {
            #[serde(borrow)]
            results: Vec<&'a RawValue>,
        }
        #[derive(serde::Deserialize, Default)]
        #[serde(default)]
        struct Item {
            status: u64,
            state: Option<Head>,
            error: Option<Value>,
            message: Option<Value>,
        }
        #[derive(serde::Deserialize, Default)]
        #[serde(default)]
        struct Head {
            id: Option<Value>,
            status: Option<Value>,
        }
        let report: Report = serde_json::from_str(&text)
            .map_err(|e| CliError::server(format!("the server's batch reply has no results ({e})")))?;
        if report.results.len() != chunk.len() {
            return Err(CliError::server(format!(
                "the server answered {} results for {} commands",
                report.results.len(),
                chunk.len()
            )));
        }
        for ((line, _), raw) in chunk.iter().zip(report.results) {
            let r: Item = serde_json::from_str(raw.get()).unwrap_or_default();
            let status = r.status;
            match status {
                202 => created += 1,
                200 => stored += 1,
                _ => {
                    failed += 1;
                    if code == exit::OK {
                        let s = reqwest::StatusCode::from_u16(status as u16)
                            .unwrap_or(reqwest::StatusCode::INTERNAL_SERVER_ERROR);
                        code = super::client::code_for(s);
                    }
                }
            }
            if cl.json {
                println!("{}", raw.get());
                continue;
            }
            let id = cell(r.state.as_ref().and_then(|s| s.id.as_ref()));
            let st = cell(r.state.as_ref().and_then(|s| s.status.as_ref()));
            match status {
                202 => println!("line {line}: submitted {id} ({st})"),
                200 => println!("line {line}: {id} was already submitted ({st})"),
                _ => println!("line {line}: refused {status} {}: {}", cell(r.error.as_ref()), cell(r.message.as_ref())),
            }
        }
    }
    if !cl.json {
        eprintln!("{created} submitted, {stored} already submitted, {failed} refused (queue {queue})");
    }
    Ok(code)
}

async fn json_text_ok(cl: &Client, rb: reqwest::RequestBuilder) -> Result<(String, Value), CliError> {
    read_json_text(cl.send_ok(rb).await?).await
}

/// The fields of a state (`s`, its JSON text `text`), one per line; `params` and `result` as the
/// server wrote them.
fn print_state(s: &Value, text: &str) {
    let mut t = Table::new(&["", ""]);
    for k in [
        "id",
        "queue",
        "type",
        "status",
        "params",
        "result",
        "error",
        "attempts",
        "errors_count",
        "created_at",
        "run_at",
        "concurrency_key",
        "priority",
        "started_at",
        "modified_at",
        "completed_at",
        "handed_off_to",
        "execution",
        "progress",
        "details",
        "output",
    ] {
        if let Some(v) = s.get(k) {
            if k == "handed_off_to" && v.is_null() {
                continue;
            }
            let shown = match (k, raw_field(text, k)) {
                ("params" | "result" | "details", Some(raw)) if !v.is_null() => raw.to_string(),
                ("execution", _) => execution_text(v),
                ("progress", _) => progress_text(v),
                ("output", _) => output_text(v),
                _ => cell(Some(v)),
            };
            t.row(vec![format!("{k}:"), shown]);
        }
    }
    // The header row is blank: print only the rows.
    let text = t.render();
    for line in text.lines().skip(1) {
        println!("{line}");
    }
}

/// `<stream> (run <n>, <content type>) at <url>`.
fn output_text(v: &Value) -> String {
    let f = |k: &str| cell(v.get(k));
    format!("{} (run {}, {}) at {}", f("stream"), f("run"), f("content_type"), f("url"))
}

/// `execute on <worker> since <time>, delivery <n>, deadline <time>`.
fn execution_text(v: &Value) -> String {
    let f = |k: &str| cell(v.get(k));
    format!(
        "{} on {} since {}, delivery {}, deadline {}",
        f("call"),
        f("worker"),
        f("since"),
        f("deliveries"),
        f("deadline")
    )
}

/// `42% <message>` (either part alone when the other is absent).
fn progress_text(v: &Value) -> String {
    let pct = v.get("fraction").and_then(Value::as_f64).map(|f| format!("{}%", (f * 100.0).round()));
    let msg = v.get("message").and_then(Value::as_str).map(str::to_string);
    [pct, msg].into_iter().flatten().collect::<Vec<_>>().join(" ")
}

/// How far [`read_events`] reads.
#[derive(Clone, Copy, PartialEq, Eq)]
pub enum Follow {
    /// Catch-up reads until the feed's tail.
    No,
    /// Long-polls without end.
    Forever,
    /// Long-polls until a terminal event (`succeeded`, `failed`, `cancelled`).
    UntilTerminal,
}

/// Where [`read_events`] stopped.
pub struct EventsEnd {
    /// The offset to read on from.
    pub next_offset: String,
    /// The terminal event seen (`succeeded`, `failed` or `cancelled`), with
    /// [`Follow::UntilTerminal`].
    pub terminal: Option<String>,
}

/// Reads the event feed at `path` (`/v1/commands/{id}/events`, `/v1/queues/{queue}/events`)
/// from `offset`, printing each event as it comes: one line of text ([`event_line`], with the
/// command id when `with_id`), or with `--json` the event's JSON as the server sent it, one per
/// line.
pub async fn read_events(
    cl: &Client,
    path: &str,
    offset: &str,
    follow: Follow,
    with_id: bool,
) -> Result<EventsEnd, CliError> {
    let mut offset = offset.to_string();
    // The last outcome seen with nothing after it (a re-run continues the watch).
    let mut terminal = None;
    // A watch begins with a catch-up read (an ended command whose feed holds nothing is then
    // known at once), and ends with one once its state has ended (`ending`).
    // Catch-up reads until the feed's tail, then long-polls.
    let (mut first, mut ending, mut at_tail) = (true, false, false);
    loop {
        let live = follow != Follow::No && !first && !ending && at_tail;
        first = false;
        let mode = if live { "&live=long-poll" } else { "" };
        let url = format!("{path}?offset={}{mode}", encode_query(&offset));
        let res = cl.send_ok(cl.request(Method::GET, &url)).await?;
        let header = |name: &str| res.headers().get(name).and_then(|v| v.to_str().ok()).map(str::to_string);
        let next = header("stream-next-offset")
            .ok_or_else(|| CliError::server(format!("the server's reply to GET {url} has no Stream-Next-Offset")))?;
        let up_to_date = header("stream-up-to-date").is_some_and(|v| v.eq_ignore_ascii_case("true"));
        at_tail = up_to_date;
        let mut printed = 0;
        if res.status() != reqwest::StatusCode::NO_CONTENT {
            let (text, _) = read_json_text(res).await?;
            let events: Vec<&RawValue> = serde_json::from_str(&text)
                .map_err(|e| CliError::server(format!("the server's events are not a JSON array ({e})")))?;
            for raw in events {
                let e: Value = serde_json::from_str(raw.get()).unwrap_or(Value::Null);
                if cl.json {
                    println!("{}", raw.get());
                } else {
                    println!("{}", event_line(&e, with_id));
                }
                printed += 1;
                let kind = cell(e.get("event"));
                terminal = matches!(kind.as_str(), "succeeded" | "failed" | "cancelled").then_some(kind);
            }
        }
        offset = next;
        if follow == Follow::UntilTerminal && up_to_date {
            if terminal.is_some() || ending {
                return Ok(EventsEnd { next_offset: offset, terminal });
            }
            if printed == 0 {
                // Nothing new for the command: if its state has ended, the feed does not hold its
                // outcome (the queue's feed is off, or the events were trimmed): end with the
                // state's, after one more catch-up read of what came meanwhile.
                let state_path = path.strip_suffix("/events").unwrap_or(path);
                let st = cl.json_ok(cl.request(Method::GET, state_path)).await?;
                let status = cell(st.get("status"));
                if matches!(status.as_str(), "SUCCEEDED" | "FAILED" | "CANCELLED") {
                    eprintln!(
                        "{} ended {status}; its queue's event feed holds no outcome for it (the feed is off, or its events were trimmed)",
                        cell(st.get("id"))
                    );
                    terminal = Some(status.to_ascii_lowercase());
                    ending = true;
                }
            }
        }
        if follow == Follow::No && up_to_date {
            return Ok(EventsEnd { next_offset: offset, terminal });
        }
    }
}

/// One event as a line: `<at> [<id>] <event> <status>`, then what it carries: the progress
/// (`67% slept 1000 of 2000 ms`), `error: <error>`, `retry in <n>ms`, `to <queue>` (a hand-off).
pub fn event_line(e: &Value, with_id: bool) -> String {
    let mut line = cell(e.get("at"));
    if with_id {
        line.push(' ');
        line.push_str(&cell(e.get("id")));
    }
    line.push_str(&format!(" {} {}", cell(e.get("event")), cell(e.get("status"))));
    if let Some(p) = e.get("progress").filter(|p| !p.is_null()) {
        line.push(' ');
        line.push_str(&progress_text(p));
    }
    if let Some(err) = e.get("error").and_then(Value::as_str) {
        line.push_str(&format!(" error: {err}"));
    }
    if let Some(ms) = e.get("retry_in_ms").and_then(Value::as_u64) {
        line.push_str(&format!(" retry in {ms}ms"));
    }
    if let Some(q) = e.get("handed_off_to").and_then(Value::as_str) {
        line.push_str(&format!(" to {q}"));
    }
    line
}

/// Waits (in steps of at most [`WAIT_STEP`]) until the command ends or `timeout` passes.
async fn wait_for(cl: &Client, id: &str, timeout: Option<Duration>) -> Result<u8, CliError> {
    let start = Instant::now();
    let wait = async {
        loop {
            let step = match timeout {
                Some(t) => t.saturating_sub(start.elapsed()).min(WAIT_STEP),
                None => WAIT_STEP,
            };
            let ms = step.as_millis().max(1);
            let (text, state) =
                json_text_ok(cl, cl.request(Method::GET, &format!("{}?wait={ms}ms", command_path(id)))).await?;
            let status = cell(state.get("status"));
            let terminal = matches!(status.as_str(), "SUCCEEDED" | "FAILED" | "CANCELLED");
            let timed_out = timeout.is_some_and(|t| start.elapsed() >= t);
            if terminal || timed_out {
                return Ok::<_, CliError>((text, state, status, terminal));
            }
        }
    };
    let (text, state, status, terminal) = tokio::select! {
        r = wait => r?,
        _ = tokio::signal::ctrl_c() => return Err(CliError { code: exit::TIMEOUT, message: format!("interrupted while waiting for {id}") }),
    };
    if cl.json {
        print_json_exact(&text);
    } else if terminal {
        let detail = match status.as_str() {
            "SUCCEEDED" => {
                raw_field(&text, "result").filter(|r| *r != "null").map(|r| format!(": {r}")).unwrap_or_default()
            }
            "FAILED" => state.get("error").and_then(Value::as_str).map(|e| format!(": {e}")).unwrap_or_default(),
            _ => String::new(),
        };
        println!("{id} {status}{detail}");
    } else {
        println!("{id} is still {status}");
    }
    Ok(match status.as_str() {
        "SUCCEEDED" => exit::OK,
        "FAILED" | "CANCELLED" => exit::UNSUCCESSFUL,
        _ => {
            if !cl.json {
                eprintln!(
                    "baton: gave up waiting for {id} after {}",
                    humantime::format_duration(timeout.unwrap_or_default())
                );
            }
            exit::TIMEOUT
        }
    })
}
