//! `baton queues list|pending|workers|minutes|schedules|dead|replay|events|pause|resume`: queue
//! inspection and control from the command line.

use clap::Subcommand;
use reqwest::Method;
use serde_json::{json, Value};

use super::client::{encode_segment, CliError, Client};
use super::commands::{read_events, Follow};
use super::exit;
use super::output::{cell, clip, count, print_json, Table};

#[derive(Subcommand, Debug)]
pub enum QueuesOp {
    /// Every queue with its length, pending entries, consumers, lag, commands per status and dead letters.
    List,
    /// A queue's work in progress: its counters and the commands not yet ended (SUBMITTED, RUNNING).
    Pending {
        queue: String,
        /// At most this many commands per status (1 to 1000).
        #[arg(long, default_value_t = 20, value_parser = clap::value_parser!(u32).range(1..=1000))]
        limit: u32,
    },
    /// A queue's workers (the consumers of its group), live and dead, with the commands they hold.
    Workers { queue: String },
    /// A queue's work per minute (the current minute last): succeeded, failed, cancelled,
    /// retried, handler duration p50/p90/p99, waiting commands and the oldest one's age.
    Minutes {
        queue: String,
        /// This many minutes (1 to 120).
        #[arg(long, default_value_t = 15, value_parser = clap::value_parser!(u32).range(1..=120))]
        last: u32,
    },
    /// A queue's cron schedules: pattern, time zone, policies, next due time and last fire.
    Schedules { queue: String },
    /// A queue's dead letters, oldest first.
    Dead {
        queue: String,
        /// At most this many (1 to 1000).
        #[arg(long, default_value_t = 100, value_parser = clap::value_parser!(u32).range(1..=1000))]
        limit: u32,
        /// The queue's completion webhook deliveries that became dead letters, instead of its
        /// commands'.
        #[arg(long)]
        webhook: bool,
    },
    /// Put dead letters back on their queue: one by id, or all of them with --all.
    Replay {
        queue: String,
        /// Dead-letter id (as printed by `baton queues dead`).
        #[arg(required_unless_present = "all", conflicts_with = "all")]
        id: Option<String>,
        /// Replay every dead letter (oldest first).
        #[arg(long)]
        all: bool,
        /// Replay completion webhook deliveries (delivered again) instead of commands.
        #[arg(long)]
        webhook: bool,
    },
    /// Pause a queue: submits are still accepted, but no worker (of any process) starts a new
    /// command of it until `baton queues resume`; running commands go on.
    Pause { queue: String },
    /// Resume a paused queue: its waiting commands start at once, oldest first.
    Resume { queue: String },
    /// A queue's command events (its event feed), oldest first, one line each; with --follow,
    /// then the new ones as they happen (until ctrl-c).
    Events {
        queue: String,
        /// `-1` (the oldest kept), `now` (only new events), or an offset printed before.
        #[arg(long, default_value = "-1", allow_hyphen_values = true)]
        offset: String,
        /// Keep waiting for new events.
        #[arg(long)]
        follow: bool,
    },
}

pub async fn run(cl: &Client, op: QueuesOp) -> Result<u8, CliError> {
    match op {
        QueuesOp::List => {
            let v = cl.json_ok(cl.request(Method::GET, "/v1/queues")).await?;
            if cl.json {
                print_json(&v);
                return Ok(exit::OK);
            }
            let queues = v.get("queues").and_then(Value::as_array).cloned().unwrap_or_default();
            if queues.is_empty() {
                println!("no queues on {}", cl.base());
                return Ok(exit::OK);
            }
            let mut t = Table::new(&[
                "QUEUE",
                "LENGTH",
                "PENDING",
                "CONSUMERS",
                "LAG",
                "SUBMITTED",
                "SCHEDULED",
                "RUNNING",
                "SUCCEEDED",
                "FAILED",
                "CANCELLED",
                "DEAD",
            ])
            .right(&[1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11]);
            for q in &queues {
                let c = q.get("commands");
                let n = |k: &str| cell(c.and_then(|c| c.get(k)));
                let paused = q.get("paused").and_then(Value::as_bool).unwrap_or(false);
                t.row(vec![
                    if paused { format!("{} (paused)", cell(q.get("name"))) } else { cell(q.get("name")) },
                    cell(q.get("length")),
                    cell(q.get("pending")),
                    // Live consumers; dead ones (silent past their claim timeout) apart.
                    match q.get("dead_consumers").and_then(Value::as_u64).unwrap_or(0) {
                        0 => cell(q.get("consumers")),
                        dead => format!("{} +{dead} dead", cell(q.get("consumers"))),
                    },
                    cell(q.get("lag")),
                    n("submitted"),
                    // Of the submitted: scheduled ones waiting for their due time.
                    n("scheduled"),
                    n("running"),
                    n("succeeded"),
                    n("failed"),
                    n("cancelled"),
                    cell(q.get("dead_letters")),
                ]);
            }
            t.print();
            Ok(exit::OK)
        }
        QueuesOp::Workers { queue } => {
            let url = format!("/v1/queues/{}/workers", encode_segment(&queue));
            let v = cl.json_ok(cl.request(Method::GET, &url)).await?;
            if cl.json {
                print_json(&v);
                return Ok(exit::OK);
            }
            let workers = v.get("workers").and_then(Value::as_array).cloned().unwrap_or_default();
            if workers.is_empty() {
                println!("no workers on {queue}");
                return Ok(exit::OK);
            }
            let mut t = Table::new(&["WORKER", "STATE", "LAST HEARTBEAT", "LEASES", "COMMANDS"]).right(&[3]);
            for w in &workers {
                let alive = w.get("alive").and_then(Value::as_bool).unwrap_or(false);
                let ids: Vec<String> = w
                    .get("commands")
                    .and_then(Value::as_array)
                    .map(|a| a.iter().map(|i| cell(Some(i))).collect())
                    .unwrap_or_default();
                t.row(vec![
                    cell(w.get("name")),
                    if alive { "alive".into() } else { "dead".into() },
                    cell(w.get("last_heartbeat")),
                    cell(w.get("leases")),
                    clip(&ids.join(" "), 60),
                ]);
            }
            t.print();
            println!("{} alive, {} dead", cell(v.get("alive")), cell(v.get("dead")));
            Ok(exit::OK)
        }
        QueuesOp::Schedules { queue } => {
            let url = format!("/v1/queues/{}/schedules", encode_segment(&queue));
            let v = cl.json_ok(cl.request(Method::GET, &url)).await?;
            if cl.json {
                print_json(&v);
                return Ok(exit::OK);
            }
            let schedules = v.get("schedules").and_then(Value::as_array).cloned().unwrap_or_default();
            if schedules.is_empty() {
                println!("no schedules on {queue}");
                return Ok(exit::OK);
            }
            let mut t = Table::new(&[
                "SCHEDULE",
                "CRON",
                "TIMEZONE",
                "TYPE",
                "OVERLAP",
                "MISSED",
                "NEXT DUE",
                "LAST FIRE",
                "RESULT",
                "COMMAND",
            ]);
            for s in &schedules {
                let last = s.get("last_fire").filter(|l| !l.is_null());
                let field = |k: &str| {
                    last.and_then(|l| l.get(k)).filter(|x| !x.is_null()).map_or("-".into(), |x| cell(Some(x)))
                };
                t.row(vec![
                    cell(s.get("name")),
                    cell(s.get("cron")),
                    cell(s.get("timezone")),
                    cell(s.get("type")),
                    cell(s.get("overlap")),
                    cell(s.get("missed")),
                    s.get("next_due").filter(|x| !x.is_null()).map_or("-".into(), |x| cell(Some(x))),
                    field("due"),
                    field("result"),
                    field("command_id"),
                ]);
            }
            t.print();
            Ok(exit::OK)
        }
        QueuesOp::Minutes { queue, last } => {
            let url = format!("/v1/queues/{}/minutes?last={last}", encode_segment(&queue));
            let v = cl.json_ok(cl.request(Method::GET, &url)).await?;
            if cl.json {
                print_json(&v);
                return Ok(exit::OK);
            }
            let minutes = v.get("minutes").and_then(Value::as_array).cloned().unwrap_or_default();
            let mut t = Table::new(&[
                "MINUTE",
                "SUCCEEDED",
                "FAILED",
                "CANCELLED",
                "RETRIED",
                "P50",
                "P90",
                "P99",
                "WAITING",
                "OLDEST",
            ])
            .right(&[1, 2, 3, 4, 5, 6, 7, 8, 9]);
            // A duration in ms, shortened; `-` for none.
            let ms = |v: Option<&Value>| match v.and_then(Value::as_f64) {
                None => "-".to_string(),
                Some(x) if x < 1000.0 => format!("{x:.0}ms"),
                Some(x) if x < 60_000.0 => format!("{:.1}s", x / 1000.0),
                Some(x) => format!("{:.1}m", x / 60_000.0),
            };
            for m in &minutes {
                // `2026-12-06T05:36:00.000Z` → `05:36` (UTC).
                let minute = m.get("minute").and_then(Value::as_str).unwrap_or("");
                t.row(vec![
                    minute.get(11..16).unwrap_or(minute).to_string(),
                    cell(m.get("succeeded")),
                    cell(m.get("failed")),
                    cell(m.get("cancelled")),
                    cell(m.get("retried")),
                    ms(m.get("duration_p50_ms")),
                    ms(m.get("duration_p90_ms")),
                    ms(m.get("duration_p99_ms")),
                    m.get("depth").filter(|d| !d.is_null()).map_or("-".into(), |d| cell(Some(d))),
                    ms(m.get("oldest_age_ms")),
                ]);
            }
            t.print();
            Ok(exit::OK)
        }
        QueuesOp::Pending { queue, limit } => {
            let q = encode_segment(&queue);
            let stats = cl.json_ok(cl.request(Method::GET, &format!("/v1/queues/{q}"))).await?;
            let mut commands = Vec::new();
            for status in ["RUNNING", "SUBMITTED"] {
                let page = cl
                    .json_ok(cl.request(Method::GET, &format!("/v1/queues/{q}/commands?status={status}&limit={limit}")))
                    .await?;
                commands.extend(page.get("items").and_then(Value::as_array).cloned().unwrap_or_default());
            }
            if cl.json {
                print_json(&json!({ "queue": stats, "commands": commands }));
                return Ok(exit::OK);
            }
            let counts = stats.get("commands");
            let n = |k: &str| cell(counts.and_then(|c| c.get(k)));
            println!(
                "{queue}: {} in the queue, {} pending (delivered, not acknowledged), {}, lag {}; {} submitted, {} running",
                cell(stats.get("length")),
                cell(stats.get("pending")),
                count(&cell(stats.get("consumers")), "consumer", "consumers"),
                cell(stats.get("lag")),
                n("submitted"),
                n("running"),
            );
            if commands.is_empty() {
                println!("no commands waiting or running");
            } else {
                let mut t = Table::new(&["ID", "TYPE", "STATUS", "ATTEMPTS", "CREATED", "STARTED"]).right(&[3]);
                for s in &commands {
                    t.row(vec![
                        cell(s.get("id")),
                        cell(s.get("type")),
                        cell(s.get("status")),
                        cell(s.get("attempts")),
                        cell(s.get("created_at")),
                        cell(s.get("started_at")),
                    ]);
                }
                t.print();
            }
            Ok(exit::OK)
        }
        QueuesOp::Dead { queue, limit, webhook } => {
            let of = if webhook { "&of=webhook" } else { "" };
            let url = format!("/v1/queues/{}/dead-letters?limit={limit}{of}", encode_segment(&queue));
            let v = cl.json_ok(cl.request(Method::GET, &url)).await?;
            if cl.json {
                print_json(&v);
                return Ok(exit::OK);
            }
            let items = v.get("items").and_then(Value::as_array).cloned().unwrap_or_default();
            if items.is_empty() {
                println!("no dead letters in {queue}");
                return Ok(exit::OK);
            }
            let mut t =
                Table::new(&["ID", "COMMAND", "DELIVERIES", "DEAD-LETTERED AT", "REASON", "PAYLOAD"]).right(&[2]);
            for d in &items {
                t.row(vec![
                    cell(d.get("id")),
                    cell(d.get("command_id")),
                    cell(d.get("deliveries")),
                    cell(d.get("dead_lettered_at")),
                    clip(&cell(d.get("reason")), 40),
                    clip(&cell(d.get("payload")), 40),
                ]);
            }
            t.print();
            Ok(exit::OK)
        }
        QueuesOp::Replay { queue, id, all, webhook } => {
            let q = encode_segment(&queue);
            let of = if webhook { "?of=webhook" } else { "" };
            let v = if all {
                cl.json_ok(cl.request(Method::POST, &format!("/v1/queues/{q}/dead-letters/replay{of}"))).await?
            } else {
                let id = id.expect("clap requires id without --all");
                let url = format!("/v1/queues/{q}/dead-letters/{}/replay{of}", encode_segment(&id));
                cl.json_ok(cl.request(Method::POST, &url)).await?
            };
            if cl.json {
                print_json(&v);
            } else if all {
                println!("replayed {} onto {queue}", count(&cell(v.get("replayed")), "dead letter", "dead letters"));
            } else {
                println!("replayed {} onto {queue} as {}", cell(v.get("replayed")), cell(v.get("id")));
            }
            Ok(exit::OK)
        }
        QueuesOp::Pause { queue } => set_paused(cl, &queue, true).await,
        QueuesOp::Resume { queue } => set_paused(cl, &queue, false).await,
        QueuesOp::Events { queue, offset, follow } => {
            let path = format!("/v1/queues/{}/events", encode_segment(&queue));
            if follow {
                tokio::select! {
                    r = read_events(cl, &path, &offset, Follow::Forever, true) => r?,
                    _ = tokio::signal::ctrl_c() => return Ok(exit::OK),
                };
                return Ok(exit::OK);
            }
            let end = read_events(cl, &path, &offset, Follow::No, true).await?;
            if !cl.json {
                println!("next: --offset {}", end.next_offset);
            }
            Ok(exit::OK)
        }
    }
}

/// `baton queues pause|resume Q`: `POST /v1/queues/{queue}/pause|resume`. A pause prints how many
/// commands wait (exact then: nothing new starts); a resume does not (they start at once).
async fn set_paused(cl: &Client, queue: &str, pause: bool) -> Result<u8, CliError> {
    let url = format!("/v1/queues/{}/{}", encode_segment(queue), if pause { "pause" } else { "resume" });
    let v = cl.json_ok(cl.request(Method::POST, &url)).await?;
    let changed = v.get("changed").and_then(Value::as_bool).unwrap_or(false);
    if cl.json {
        print_json(&v);
    } else if pause {
        let waiting = count(&cell(v.get("lag")), "command waits", "commands wait");
        if changed {
            println!("paused {queue} ({waiting})");
        } else {
            println!("{queue} was already paused ({waiting})");
        }
    } else if changed {
        println!("resumed {queue}");
    } else {
        println!("{queue} was not paused");
    }
    Ok(exit::OK)
}
