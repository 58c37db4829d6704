//! `baton streams create|append|read|tail|close|delete`: the Durable Streams protocol from the
//! command line; `baton streams list`: the streams by prefix (`GET /v1/streams`).

use std::io::{Read, Write};
use std::time::Duration;

use base64::Engine as _;
use clap::Subcommand;
use futures::StreamExt;
use reqwest::{Method, Response, StatusCode};
use serde_json::value::RawValue;
use serde_json::{json, Value};

use super::args::duration_arg;
use super::client::{encode_query, error_from, stream_url_path, CliError, Client};
use super::exit;
use super::output::{cell, print_json, Table};

#[derive(Subcommand, Debug)]
pub enum StreamsOp {
    /// Create a stream (idempotent: an identical existing stream is fine).
    Create {
        /// Stream path, e.g. acme/run-1 (the first segment is its scope).
        path: String,
        /// Content type of the stream's data.
        #[arg(long, default_value = "text/plain")]
        content_type: String,
        /// End the stream as producer_lost after this long without an append or keepalive.
        #[arg(long, value_parser = duration_arg)]
        silence_timeout: Option<Duration>,
        /// Hard lifetime: the stream disappears this long after creation.
        #[arg(long, value_parser = duration_arg)]
        max_run: Option<Duration>,
        /// Replay window: the stream disappears this long after it ends.
        #[arg(long, value_parser = duration_arg)]
        done_ttl: Option<Duration>,
        /// At most this many messages (one per append; each JSON value on application/json streams).
        #[arg(long)]
        max_len: Option<u64>,
    },
    /// Append data (the argument, or stdin when it is absent or `-`).
    Append {
        path: String,
        /// The data; reads stdin when absent or `-`.
        data: Option<String>,
        /// Content type of the data [default: the stream's].
        #[arg(long)]
        content_type: Option<String>,
        /// Close the stream with this append.
        #[arg(long)]
        close: bool,
    },
    /// Read what the stream holds from an offset, up to its current end, and exit.
    Read {
        path: String,
        /// `-1` (the beginning), `now`, or an offset printed by an earlier read.
        #[arg(long, default_value = "-1", allow_hyphen_values = true)]
        offset: String,
    },
    /// Follow the stream live (server-sent events) until it ends or ctrl-c.
    Tail {
        path: String,
        /// `-1` (the beginning), `now` (only new data), or an offset.
        #[arg(long, default_value = "-1", allow_hyphen_values = true)]
        offset: String,
    },
    /// End the stream (exactly one end is kept; later writers are told it). On a stream that had
    /// already ended it prints the end kept and exits 0 when that is the reason asked, 4 otherwise.
    Close {
        path: String,
        /// Why it ends.
        #[arg(long, default_value = "finished", value_parser = ["finished", "cancelled"])]
        reason: String,
    },
    /// Delete the stream.
    Delete { path: String },
    /// The streams whose path starts with PREFIX (all when absent) that the token may read, in
    /// path order: path, content type, length, state, last write.
    List {
        /// A plain text prefix: `acme/run` lists acme/run-1 and acme/run/2.
        prefix: Option<String>,
        /// At most this many (1 to 1000).
        #[arg(long, default_value_t = 100, value_parser = clap::value_parser!(u32).range(1..=1000))]
        limit: u32,
        /// The cursor printed after the previous page (`more: --cursor …`).
        #[arg(long)]
        cursor: Option<String>,
    },
}

pub async fn run(cl: &Client, op: StreamsOp) -> Result<u8, CliError> {
    match op {
        StreamsOp::List { prefix, limit, cursor } => list(cl, prefix, limit, cursor).await,
        StreamsOp::Create { path, content_type, silence_timeout, max_run, done_ttl, max_len } => {
            let url = stream_url_path(&path)?;
            let mut rb = cl.request(Method::PUT, &url).header("content-type", &content_type);
            let fmt = |d: Duration| humantime::format_duration(d).to_string().replace(' ', "");
            if let Some(d) = silence_timeout {
                rb = rb.header("baton-silence-timeout", fmt(d));
            }
            if let Some(d) = max_run {
                rb = rb.header("baton-max-run", fmt(d));
            }
            if let Some(d) = done_ttl {
                rb = rb.header("baton-done-ttl", fmt(d));
            }
            if let Some(n) = max_len {
                rb = rb.header("baton-max-len", n.to_string());
            }
            let limited = silence_timeout.is_some() || max_run.is_some() || done_ttl.is_some() || max_len.is_some();
            // A 409 says which setting differs, with the stream's value and the one asked for.
            let res = cl.send_ok(rb).await.map_err(|e| with_path(e, &path))?;
            let created = res.status() == StatusCode::CREATED;
            let next = header(&res, "stream-next-offset");
            if cl.json {
                print_json(
                    &json!({ "path": path, "created": created, "content_type": content_type, "next_offset": next }),
                );
            } else if created {
                println!("created {path} ({content_type})");
            } else if limited {
                println!("{path} already exists with the same settings");
            } else {
                // Without limit flags the server compares only the content type (and expiry).
                println!("{path} already exists ({content_type})");
            }
            Ok(exit::OK)
        }
        StreamsOp::Append { path, data, content_type, close } => {
            let url = stream_url_path(&path)?;
            let body: Vec<u8> = match data.as_deref() {
                None | Some("-") => {
                    let mut buf = Vec::new();
                    std::io::stdin()
                        .read_to_end(&mut buf)
                        .map_err(|e| CliError::usage(format!("cannot read stdin: {e}")))?;
                    buf
                }
                Some(s) => s.as_bytes().to_vec(),
            };
            if body.is_empty() && !close {
                return Err(CliError::usage("nothing to append: give the data as an argument or on stdin"));
            }
            let ct = match content_type {
                Some(ct) => ct,
                None => {
                    let head = cl.send_ok(cl.request(Method::HEAD, &url)).await.map_err(|e| with_path(e, &path))?;
                    header(&head, "content-type").unwrap_or_else(|| "application/octet-stream".into())
                }
            };
            let len = body.len();
            let mut rb = cl.request(Method::POST, &url);
            if len > 0 {
                rb = rb.header("content-type", &ct).body(body);
            }
            if close {
                rb = rb.header("stream-closed", "true");
            }
            let res = cl.send_ok(rb).await.map_err(|e| with_path(e, &path))?;
            let next = header(&res, "stream-next-offset");
            if cl.json {
                print_json(&json!({ "path": path, "bytes": len, "next_offset": next, "closed": close }));
            } else {
                let closed = if close { " and closed it" } else { "" };
                println!("appended {len} bytes to {path}{closed}; next offset {}", next.as_deref().unwrap_or("?"));
            }
            Ok(exit::OK)
        }
        StreamsOp::Read { path, offset } => read(cl, &path, &offset).await,
        StreamsOp::Tail { path, offset } => {
            tokio::select! {
                r = tail(cl, &path, &offset) => r,
                _ = tokio::signal::ctrl_c() => Ok(exit::OK),
            }
        }
        StreamsOp::Close { path, reason } => {
            let url = stream_url_path(&path)?;
            let rb = cl.request(Method::POST, &url).header("stream-closed", "true").header("baton-end-reason", &reason);
            let res = cl.send(rb).await?;
            // A close-only request on an ended stream is a 204 with the end kept; a 409 with the end
            // is still understood (an older server).
            if res.status() == StatusCode::CONFLICT && header(&res, "stream-closed").as_deref() == Some("true") {
                let had = header(&res, "baton-end-reason").unwrap_or_else(|| "finished".into());
                return Err(CliError {
                    code: exit::REFUSED,
                    message: format!("{path} had already ended ({had}); nothing changed"),
                });
            }
            if !res.status().is_success() {
                return Err(with_path(error_from(res).await, &path));
            }
            let next = header(&res, "stream-next-offset");
            // The end that was kept: this close's, or the one the stream already had.
            let kept = header(&res, "baton-end-reason").unwrap_or_else(|| reason.clone());
            let already =
                header(&res, "baton-already-ended").is_some_and(|v| v.eq_ignore_ascii_case("true")) || kept != reason;
            let final_offset = next.as_deref().unwrap_or("?");
            if cl.json {
                print_json(&json!({ "path": path, "closed": true, "end_reason": kept, "already_ended": already,
                                    "next_offset": next }));
            } else if !already {
                println!("closed {path} ({kept}); final offset {final_offset}");
            } else if kept == reason {
                println!("{path} had already ended ({kept}); final offset {final_offset}");
            }
            if already && kept != reason {
                // Another end was kept: what was asked for did not happen.
                return Err(CliError {
                    code: exit::REFUSED,
                    message: format!("{path} had already ended ({kept}), not {reason}; nothing changed"),
                });
            }
            Ok(exit::OK)
        }
        StreamsOp::Delete { path } => {
            let url = stream_url_path(&path)?;
            cl.send_ok(cl.request(Method::DELETE, &url)).await.map_err(|e| with_path(e, &path))?;
            if cl.json {
                print_json(&json!({ "path": path, "deleted": true }));
            } else {
                println!("deleted {path}");
            }
            Ok(exit::OK)
        }
    }
}

/// Names the stream in an error that does not: a bare `404`/`410` (a `HEAD` has no body) says
/// what is missing, a refusal (`409`) which stream refused.
fn with_path(mut e: CliError, path: &str) -> CliError {
    if e.message.contains(path) {
        return e;
    }
    e.message = match e.message.as_str() {
        "404 Not Found" => format!("stream {path} not found; create it with `baton streams create` [404 Not Found]"),
        "410 Gone" => format!("stream {path} is deleted (forks still reference it) [410 Gone]"),
        m if e.code == exit::NOT_FOUND || e.code == exit::REFUSED => format!("{path}: {m}"),
        _ => return e,
    };
    e
}

fn header(res: &Response, name: &str) -> Option<String> {
    res.headers().get(name).and_then(|v| v.to_str().ok()).map(str::to_string)
}

fn is_json_type(ct: &str) -> bool {
    let base = ct.split(';').next().unwrap_or("").trim().to_ascii_lowercase();
    base == "application/json" || base.ends_with("+json")
}

fn is_text_type(ct: &str) -> bool {
    let base = ct.split(';').next().unwrap_or("").trim().to_ascii_lowercase();
    base.starts_with("text/") || is_json_type(&base)
}

/// Catch-up read to the current end.
pub(super) async fn read(cl: &Client, path: &str, offset: &str) -> Result<u8, CliError> {
    let url = stream_url_path(path)?;
    let start = offset.to_string();
    let mut offset = offset.to_string();
    let mut data: Vec<u8> = Vec::new();
    let mut messages: Vec<Box<RawValue>> = Vec::new();
    let mut content_type: String;
    let mut stdout = std::io::stdout().lock();
    let (closed, end_reason) = loop {
        let res = cl
            .send_ok(cl.request(Method::GET, &format!("{url}?offset={}", encode_query(&offset))))
            .await
            .map_err(|e| with_path(e, path))?;
        content_type = header(&res, "content-type").unwrap_or_default();
        let next = header(&res, "stream-next-offset");
        let up_to_date = header(&res, "stream-up-to-date").is_some_and(|v| v.eq_ignore_ascii_case("true"));
        let closed = header(&res, "stream-closed").is_some_and(|v| v.eq_ignore_ascii_case("true"));
        let reason = header(&res, "baton-end-reason");
        let body = res.bytes().await.map_err(|e| CliError::server(format!("reading {path} failed: {e}")))?;
        if is_json_type(&content_type) && !body.is_empty() {
            let items = json_messages(&body).map_err(|e| {
                CliError::server(format!("the server sent a JSON stream chunk that does not parse: {e}"))
            })?;
            if !cl.json {
                for m in &items {
                    let _ = writeln!(stdout, "{}", m.get());
                }
            }
            messages.extend(items);
        } else if cl.json {
            data.extend_from_slice(&body);
        } else {
            let _ = stdout.write_all(&body);
        }
        let progressed = next.as_deref().is_some_and(|n| n != offset);
        if let Some(n) = next {
            offset = n;
        }
        if up_to_date || closed || !progressed {
            break (closed, reason);
        }
    };
    let _ = stdout.flush();
    if cl.json {
        let json_stream = is_json_type(&content_type);
        let text = !json_stream && is_text_type(&content_type);
        let out = ReadOut {
            path,
            content_type: &content_type,
            offset: &start,
            next_offset: &offset,
            closed,
            end_reason: end_reason.as_deref().filter(|_| closed),
            messages: json_stream.then_some(messages.as_slice()),
            data: text.then(|| String::from_utf8_lossy(&data).into_owned()),
            data_base64: (!json_stream && !text).then(|| base64::engine::general_purpose::STANDARD.encode(&data)),
        };
        println!("{}", serde_json::to_string_pretty(&out).unwrap_or_default());
    } else if closed {
        eprintln!("baton: {path} has ended ({}) at offset {offset}", end_reason.as_deref().unwrap_or("finished"));
    }
    Ok(exit::OK)
}

/// What `streams read --json` prints; JSON messages exactly as stored (their key order and
/// spelling kept: `RawValue`, never re-serialized).
#[derive(serde::Serialize)]
struct ReadOut<'a> {
    path: &'a str,
    content_type: &'a str,
    offset: &'a str,
    next_offset: &'a str,
    closed: bool,
    end_reason: Option<&'a str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    messages: Option<&'a [Box<RawValue>]>,
    #[serde(skip_serializing_if = "Option::is_none")]
    data: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    data_base64: Option<String>,
}

/// The messages of a JSON read or SSE data event (an array; any other value is one message),
/// each as the exact text the server sent.
fn json_messages(body: &[u8]) -> serde_json::Result<Vec<Box<RawValue>>> {
    match serde_json::from_slice::<Vec<Box<RawValue>>>(body) {
        Ok(items) => Ok(items),
        Err(_) => serde_json::from_slice::<Box<RawValue>>(body).map(|one| vec![one]),
    }
}

/// One server-sent event.
#[derive(Default, Debug)]
struct Event {
    event: String,
    data: String,
}

/// Splits complete events off the front of `buf` (events end with a blank line).
fn take_events(buf: &mut String) -> Vec<Event> {
    let mut out = Vec::new();
    loop {
        let normalized_end = buf.find("\n\n");
        let Some(end) = normalized_end else { break };
        let block: String = buf.drain(..end + 2).collect();
        let mut ev = Event::default();
        let mut data_lines: Vec<&str> = Vec::new();
        for line in block.split('\n') {
            if line.is_empty() || line.starts_with(':') {
                continue;
            }
            let (field, value) = match line.split_once(':') {
                Some((f, v)) => (f, v.strip_prefix(' ').unwrap_or(v)),
                None => (line, ""),
            };
            match field {
                "event" => ev.event = value.to_string(),
                "data" => data_lines.push(value),
                _ => {}
            }
        }
        if data_lines.is_empty() && ev.event.is_empty() {
            continue;
        }
        ev.data = data_lines.join("\n");
        if ev.event.is_empty() {
            ev.event = "message".into();
        }
        out.push(ev);
    }
    out
}

/// Follows the stream over SSE, reconnecting from the last offset when the server cycles the
/// connection, until the stream ends.
pub(super) async fn tail(cl: &Client, path: &str, offset: &str) -> Result<u8, CliError> {
    let url = stream_url_path(path)?;
    let mut offset = offset.to_string();
    let mut failures = 0u32;
    loop {
        let rb = cl
            .request(Method::GET, &format!("{url}?offset={}&live=sse", encode_query(&offset)))
            .header("accept", "text/event-stream");
        let res = match cl.send(rb).await {
            Ok(r) => r,
            Err(e) if failures < 5 && offset != "-1" && offset != "now" => {
                // The server went away mid-follow: retry a few times from the last offset.
                failures += 1;
                tracing::debug!(error = %e.message, "reconnecting");
                tokio::time::sleep(Duration::from_millis(200 * u64::from(failures))).await;
                continue;
            }
            Err(e) => return Err(e),
        };
        if res.status() == StatusCode::NO_CONTENT {
            return Ok(exit::OK);
        }
        if !res.status().is_success() {
            return Err(with_path(error_from(res).await, path));
        }
        failures = 0;
        let base64_data = header(&res, "stream-sse-data-encoding").is_some_and(|v| v.eq_ignore_ascii_case("base64"));
        let content_type = match cl.send(cl.request(Method::HEAD, &url)).await {
            Ok(h) => header(&h, "content-type").unwrap_or_default(),
            Err(_) => String::new(),
        };
        let json_stream = is_json_type(&content_type);
        let mut body = res.bytes_stream();
        let mut buf = String::new();
        let mut raw: Vec<u8> = Vec::new();
        let mut pending: Option<String> = None;
        while let Some(chunk) = body.next().await {
            let Ok(chunk) = chunk else { break };
            raw.extend_from_slice(&chunk);
            // Keep incomplete UTF-8 sequences for the next chunk.
            let valid = match std::str::from_utf8(&raw) {
                Ok(s) => s.len(),
                Err(e) => e.valid_up_to(),
            };
            buf.push_str(&std::str::from_utf8(&raw[..valid]).expect("checked").replace("\r\n", "\n"));
            raw.drain(..valid);
            for ev in take_events(&mut buf) {
                match ev.event.as_str() {
                    // A data event is followed by its control event, which says the offset after it.
                    "data" => pending = Some(ev.data),
                    "control" => {
                        let c: Value = serde_json::from_str(&ev.data).unwrap_or(Value::Null);
                        if let Some(n) = c.get("streamNextOffset").and_then(Value::as_str) {
                            offset = n.to_string();
                        }
                        if let Some(data) = pending.take() {
                            emit_data(cl.json, &data, base64_data, json_stream, &offset)?;
                        }
                        if c.get("streamClosed").and_then(Value::as_bool) == Some(true) {
                            let reason = c.get("batonEndReason").and_then(Value::as_str).unwrap_or("finished");
                            if cl.json {
                                println!("{}", json!({ "closed": true, "end_reason": reason, "next_offset": offset }));
                            } else {
                                eprintln!("baton: {path} has ended ({reason}) at offset {offset}");
                            }
                            return Ok(exit::OK);
                        }
                    }
                    "error" => {
                        let c: Value = serde_json::from_str(&ev.data).unwrap_or(Value::Null);
                        let m = c.get("error").and_then(Value::as_str).unwrap_or(&ev.data).to_string();
                        return Err(CliError::not_found(format!("{path}: {m}")));
                    }
                    _ => {}
                }
            }
        }
        // The server closed the connection (its SSE cycle, or shutdown): resume from `offset`.
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

fn emit_data(json_out: bool, data: &str, base64_data: bool, json_stream: bool, offset: &str) -> Result<(), CliError> {
    let mut stdout = std::io::stdout().lock();
    if base64_data {
        let bytes = base64::engine::general_purpose::STANDARD
            .decode(data.trim())
            .map_err(|e| CliError::server(format!("the server sent bad base64 in an SSE data event: {e}")))?;
        if json_out {
            let _ = writeln!(stdout, "{}", json!({ "next_offset": offset, "data_base64": data.trim() }));
        } else {
            let _ = stdout.write_all(&bytes);
        }
    } else if json_stream {
        let items = json_messages(data.as_bytes())
            .map_err(|e| CliError::server(format!("the server sent a JSON stream event that does not parse: {e}")))?;
        for m in items {
            if json_out {
                // The message as stored, inside the line's object (same key order as before).
                let offset = Value::from(offset);
                let _ = writeln!(stdout, "{{\"message\":{},\"next_offset\":{offset}}}", m.get());
            } else {
                let _ = writeln!(stdout, "{}", m.get());
            }
        }
    } else if json_out {
        let _ = writeln!(stdout, "{}", json!({ "next_offset": offset, "data": data }));
    } else {
        let _ = stdout.write_all(data.as_bytes());
    }
    let _ = stdout.flush();
    Ok(())
}

/// `baton streams list`: one page of `GET /v1/streams`, a table (or the JSON with `--json`), then
/// `more: --cursor …` when there is a next page.
async fn list(cl: &Client, prefix: Option<String>, limit: u32, cursor: Option<String>) -> Result<u8, CliError> {
    let mut url = format!("/v1/streams?limit={limit}");
    if let Some(p) = prefix.as_deref().filter(|p| !p.is_empty()) {
        url.push_str(&format!("&prefix={}", encode_query(p)));
    }
    if let Some(c) = &cursor {
        url.push_str(&format!("&cursor={}", encode_query(c)));
    }
    let v = cl.json_ok(cl.request(Method::GET, &url)).await?;
    if cl.json {
        print_json(&v);
        return Ok(exit::OK);
    }
    let streams = v.get("streams").and_then(Value::as_array).cloned().unwrap_or_default();
    if streams.is_empty() {
        match prefix.as_deref().filter(|p| !p.is_empty()) {
            Some(p) => println!("no streams under {p}"),
            None => println!("no streams"),
        }
    } else {
        let mut t = Table::new(&["PATH", "CONTENT TYPE", "LENGTH", "STATE", "LAST WRITE"]).right(&[2]);
        for s in &streams {
            let state = match s.get("end_reason").and_then(Value::as_str) {
                Some(reason) => format!("ended ({reason})"),
                None => "open".to_string(),
            };
            t.row(vec![
                cell(s.get("path")),
                cell(s.get("content_type")),
                cell(s.get("length")),
                state,
                cell(s.get("last_write_at")),
            ]);
        }
        t.print();
    }
    if let Some(next) = v.get("next_cursor").and_then(Value::as_str) {
        println!("more: --cursor {}", shell_word(next));
    }
    Ok(exit::OK)
}

/// `s` as one POSIX shell word: as it is when it holds only characters no shell treats
/// specially, else in single quotes (a `'` written `'\''`), so a printed `--cursor` can be pasted.
fn shell_word(s: &str) -> String {
    let plain = |b: u8| b.is_ascii_alphanumeric() || b"-_./:@%+=,".contains(&b);
    if !s.is_empty() && s.bytes().all(plain) {
        s.to_string()
    } else {
        format!("'{}'", s.replace('\'', "'\\''"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sse_events_parse() {
        let mut buf =
            String::from("event: data\ndata:a\ndata:\n\n:\n\nevent: control\ndata:{\"x\":1}\nid:5\n\nevent: da");
        let evs = take_events(&mut buf);
        assert_eq!(evs.len(), 2);
        assert_eq!((evs[0].event.as_str(), evs[0].data.as_str()), ("data", "a\n"));
        assert_eq!((evs[1].event.as_str(), evs[1].data.as_str()), ("control", "{\"x\":1}"));
        assert_eq!(buf, "event: da");
    }
}
