//! Group commit of writes ([`baton_redis::group_commit`]): per stream, at most one `write.lua`
//! call is in flight from this process; writes submitted meanwhile are queued and go together in
//! the next call, where the script applies them one after the other exactly as separate calls
//! would (each request keeps its own producer checks, offsets and reply). Submission order is
//! queue order: a request is queued synchronously when its future is first polled, so requests
//! issued in order by one task are applied in that order (no client-side reordering, whatever
//! the number in flight).
//!
//! The first writer of an idle stream sends its call from its own task (no hop); if its caller
//! goes away mid-call, the call is finished in a spawned task so the other queued writers still
//! get their replies. Follow-up batches are sent from a spawned task, never by a caller that
//! already has its reply.
//!
//! On Cluster each call is guarded against the client's re-sends (`scripts/write_guard.lua`):
//! one more key, the writer's overflow key `baton:s:{path}:resend:<writer>` (written only for a
//! reply too long for the hash), and two more arguments, the writer's field `r:<writer>` in the
//! stream's metadata hash and a token
//! ([`baton_redis::resend::ResendGuard`]); the one call in flight per stream is what the guard
//! needs.

use std::sync::Arc;

use baton_redis::group_commit::{self, Committer, GroupCommitOptions};
use baton_redis::redis::{self, Value};

use super::reply::*;
use super::{keys, RedisStreamBackend, WRITE, WRITE_GUARDED};
use crate::backend::{found_end, WriteSpec};
use crate::end::{EndReason, EndState};
use crate::error::{Result, StreamError};
use crate::offset::Offset;
use crate::types::*;

/// Requests per `write.lua` call at most.
const MAX_REQUESTS: usize = 1024;
/// Body bytes per `write.lua` call at most (a bigger single request still goes alone).
const MAX_BYTES: usize = 4 << 20;

/// The streams' group commit: stream → its queued writes.
pub(crate) struct Writer(group_commit::GroupCommit<StreamPath, WriteSpec, Result<Appended>>);

impl Default for Writer {
    fn default() -> Self {
        let options = GroupCommitOptions { max_items: MAX_REQUESTS, max_weight: MAX_BYTES, lead_sends: true };
        Self(group_commit::GroupCommit::new(options))
    }
}

/// Sends a stream's batches: one `write.lua` call each.
struct WriteCall(Arc<RedisStreamBackend>);

impl Committer<StreamPath, WriteSpec, Result<Appended>> for WriteCall {
    async fn commit(&mut self, path: &StreamPath, batch: Vec<WriteSpec>) -> Vec<Result<Appended>> {
        self.0.send_batch(path, batch).await
    }

    fn weight(&self, spec: &WriteSpec) -> usize {
        body_len(spec)
    }
}

fn body_len(spec: &WriteSpec) -> usize {
    spec.records.iter().map(|r| r.0.len()).sum()
}

impl RedisStreamBackend {
    pub(crate) async fn submit_write(self: Arc<Self>, path: &StreamPath, spec: WriteSpec) -> Result<Appended> {
        self.writer
            .0
            .submit(path, spec, || WriteCall(self.clone()))
            .await
            .unwrap_or_else(|_| Err(StreamError::Backend("write abandoned".into())))
    }

    /// One `write.lua` call for `batch`; one reply per request, in order.
    async fn send_batch(&self, path: &StreamPath, batch: Vec<WriteSpec>) -> Vec<Result<Appended>> {
        let (ks, km) = keys(path);
        // Sized up front: no regrowth while the arguments are written.
        let args = 8 + batch.len() * 10;
        let bytes = 128 + 3 * ks.len() + batch.iter().map(|spec| body_len(spec) + 64).sum::<usize>();
        let script = if self.resend.is_some() { &WRITE_GUARDED } else { &WRITE };
        let mut cmd = script.evalsha_cmd_with_capacity(2 + usize::from(self.resend.is_some()), args, bytes);
        // Every key a script touches is in KEYS (Cluster): the guard's overflow key too.
        let overflow = self.resend.as_ref().map(|g| g.key(&ks));
        cmd.arg(ks).arg(km);
        if let Some(k) = &overflow {
            cmd.arg(k.as_str());
        }
        match batch.as_slice() {
            [spec] if is_fast(spec) => fast_args(&mut cmd, spec),
            _ => general_args(&mut cmd, &batch),
        }
        if let Some(g) = &self.resend {
            cmd.arg(g.field()).arg(g.next_token());
        }
        let started = self.hub.before_write(path);
        match self.eval_durable(script, path, &cmd).await {
            // The fast path's reply: "<incarnation> <previous tail> <new entry id>" of a lone
            // accepted request.
            Ok(Value::BulkString(b)) if batch.len() == 1 => {
                let spec = batch.into_iter().next().expect("one request");
                let out = parse_fast(&b);
                let pushed = match &out {
                    Ok((inc, Some(prev), tail)) => {
                        let (data, messages) = &spec.records[0];
                        Some((
                            inc.as_str(),
                            *prev,
                            vec![Record { offset: *tail, data: data.clone(), messages: *messages }],
                        ))
                    }
                    _ => None,
                };
                self.hub.after_write(path, started, pushed);
                vec![out.map(|(inc, _, tail)| accepted(&spec, tail, inc))]
            }
            Ok(Value::Array(mut replies)) if replies.len() == batch.len() || replies.len() == batch.len() + 1 => {
                // {incarnation, tail before the call}, when the stream exists.
                let before = if replies.len() > batch.len() { replies.pop() } else { None };
                let incarnation = match &before {
                    Some(Value::Array(ip)) => ip.first().map(text).unwrap_or_default(),
                    _ => String::new(),
                };
                let mut outs = Vec::with_capacity(batch.len());
                for (spec, r) in batch.iter().zip(replies) {
                    outs.push(match r {
                        Value::Array(items) if !items.is_empty() => {
                            parse_write(path, spec, &items).map(|a| Appended { incarnation: incarnation.clone(), ..a })
                        }
                        other => Err(StreamError::Backend(format!("streams.write: unexpected reply {other:?}"))),
                    });
                }
                let mut pushed = None;
                let inc_text;
                if let Some(Value::Array(ip)) = &before {
                    if let (Some(inc), Some(prev)) = (ip.first(), ip.get(1).and_then(|v| parse_id(v).ok())) {
                        // The records of the leading requests that each added exactly one entry
                        // (accepted, one record, stream not ended): contiguous after `prev`.
                        let mut records = Vec::new();
                        for (spec, out) in batch.iter().zip(&outs) {
                            match out {
                                Ok(a) if !a.duplicate && a.end.is_none() && spec.records.len() == 1 => {
                                    let (data, messages) = &spec.records[0];
                                    records.push(Record { offset: a.tail, data: data.clone(), messages: *messages });
                                }
                                _ => break,
                            }
                        }
                        if !records.is_empty() {
                            inc_text = text(inc);
                            pushed = Some((inc_text.as_str(), prev, records));
                        }
                    }
                }
                self.hub.after_write(path, started, pushed);
                outs
            }
            Ok(other) => {
                self.hub.after_write(path, started, None);
                let e = StreamError::Backend(format!("streams.write: unexpected reply {other:?}"));
                vec![Err(e); batch.len()]
            }
            Err(e) => {
                self.hub.after_write(path, started, None);
                vec![Err(e); batch.len()]
            }
        }
    }
}

/// A lone request the script's fast path may take: one record, no close, no Stream-Seq (and a
/// producer stamp within the checked range, whose decimals are those the scripts write).
fn is_fast(spec: &WriteSpec) -> bool {
    const MAX_SAFE_INT: u64 = (1 << 53) - 1;
    spec.close.is_none()
        && spec.fence.is_none()
        && spec.stream_seq.is_none()
        && spec.records.len() == 1
        && spec.producer.as_ref().is_none_or(|p| p.epoch <= MAX_SAFE_INT && p.seq <= MAX_SAFE_INT)
}

/// The compact layout of `write_fast.lua` (3 to 7 arguments, which is how the script tells it
/// from the general one): incarnation, content type, data, JSON message count (left out for a
/// binary record without a producer), then `p:` + producer id (the field of its state), the state prefix this request continues
/// (`"<epoch>:<seq - 1>:"`, so `"<epoch>:-1:"` for seq 0) and the new state without count and
/// offset (`"<epoch>:<seq>::"`), in the canonical decimals every script writes (`is_fast`
/// keeps epoch and seq ≤ 2^53-1).
fn fast_args(cmd: &mut redis::Cmd, s: &WriteSpec) {
    let (data, n) = &s.records[0];
    cmd.arg(s.incarnation.as_deref().unwrap_or("")).arg(s.ctn.as_deref().unwrap_or("")).arg(data.as_ref());
    match &s.producer {
        Some(p) => {
            if *n == 0 {
                cmd.arg("");
            } else {
                cmd.arg(*n);
            }
            let expected = match p.seq.checked_sub(1) {
                Some(last) => format!("{}:{}:", p.epoch, last),
                None => format!("{}:-1:", p.epoch),
            };
            cmd.arg(format!("p:{}", p.id)).arg(expected).arg(format!("{}:{}::", p.epoch, p.seq));
        }
        None if *n != 0 => {
            cmd.arg(*n);
        }
        None => {}
    }
}

/// The general layout of `write.lua`: R, then per request inc, ctn, stream seq, producer id,
/// epoch, seq, close reason, n, then n x (data, messages). A fence ([`WriteSpec::fence`]) is
/// sent as its producer id, its epoch (`""`: none claimed) and the seq `f`.
fn general_args(cmd: &mut redis::Cmd, batch: &[WriteSpec]) {
    cmd.arg(batch.len());
    for s in batch {
        let pr = s.producer.as_ref();
        cmd.arg(s.incarnation.as_deref().unwrap_or(""))
            .arg(s.ctn.as_deref().unwrap_or(""))
            .arg(s.stream_seq.as_deref().unwrap_or(""));
        match (pr, &s.fence) {
            (Some(p), _) => cmd.arg(p.id.as_str()).arg(p.epoch).arg(p.seq),
            (None, Some((id, Some(epoch)))) => cmd.arg(id.as_str()).arg(*epoch).arg("f"),
            (None, Some((id, None))) => cmd.arg(id.as_str()).arg("").arg("f"),
            (None, None) => cmd.arg("").arg("").arg(""),
        };
        cmd.arg(s.close.map_or("", |r| r.as_str())).arg(s.records.len());
        for (data, n) in &s.records {
            cmd.arg(data.as_ref()).arg(*n);
        }
    }
}

/// The fast path's reply `"<incarnation> <previous tail id> <new entry id>"`.
fn parse_fast(b: &[u8]) -> Result<(String, Option<Offset>, Offset)> {
    let bad = || StreamError::Backend(format!("streams.write: unexpected reply {:?}", String::from_utf8_lossy(b)));
    let t = std::str::from_utf8(b).map_err(|_| bad())?;
    let mut it = t.split(' ');
    let (Some(inc), Some(prev), Some(id), None) = (it.next(), it.next(), it.next(), it.next()) else {
        return Err(bad());
    };
    let tail = Offset::from_redis_id(id).ok_or_else(bad)?;
    Ok((inc.to_string(), Offset::from_redis_id(prev), tail))
}

/// An accepted request that did not end the stream, whose last entry is `tail`.
fn accepted(spec: &WriteSpec, tail: Offset, incarnation: String) -> Appended {
    let p = spec.producer.as_ref();
    Appended {
        tail,
        duplicate: false,
        producer: p.map(|p| (p.epoch, p.seq)),
        producer_offset: p.map(|_| tail),
        end: None,
        ended_now: false,
        incarnation,
    }
}

/// One request's reply: status, then (ok) tail, or (ok, ended by it) epoch, seq, tail, 1, end
/// reason, final id, or (dup) epoch, last seq, producer offset, tail, end reason, final id; else an
/// error status.
fn parse_write(path: &StreamPath, spec: &WriteSpec, r: &[Value]) -> Result<Appended> {
    let p = spec.producer.as_ref();
    let dup = is(&r[0], "dup");
    if !dup && !is(&r[0], "ok") {
        match check(path, r, Offset::ZERO, p.map_or(0, |p| p.epoch)) {
            // The incarnation the script found ended is filled in by the caller (the call's last
            // array; a carried re-send answer's names the stream its first copy ran on).
            Err(StreamError::Closed { end, .. }) if spec.answers_found_end() => {
                return Ok(found_end(end, String::new()))
            }
            Err(StreamError::StreamSeqRegression { last, .. }) => {
                return Err(StreamError::StreamSeqRegression {
                    last,
                    received: spec.stream_seq.clone().unwrap_or_default(),
                })
            }
            // `check`'s message knows only the stream's type (`["ct", <stream's type>]`).
            Err(_) if is(&r[0], "ct") => {
                return Err(StreamError::content_type_differs(&text(&r[1]), spec.ctn.as_deref()))
            }
            Err(e) => return Err(e),
            Ok(()) => {}
        }
    }
    if !dup && r.len() == 2 {
        // Short form: accepted, did not end the stream (the incarnation is filled in by the caller).
        return Ok(accepted(spec, parse_id(&r[1])?, String::new()));
    }
    let tail = parse_id(&r[if dup { 4 } else { 3 }])?;
    let end = EndReason::parse(&text(&r[5]))
        .map(|reason| EndState { reason, final_offset: Offset::from_redis_id(&text(&r[6])).unwrap_or(tail) });
    if dup {
        Ok(Appended {
            tail,
            duplicate: true,
            producer: Some((num(&r[1])?, num(&r[2])?)),
            producer_offset: parse_id(&r[3]).ok(),
            end,
            ended_now: false,
            incarnation: String::new(),
        })
    } else {
        Ok(Appended {
            tail,
            duplicate: false,
            producer: p.map(|p| (p.epoch, p.seq)),
            producer_offset: p.map(|_| tail),
            end,
            ended_now: num(&r[4])? == 1,
            incarnation: String::new(),
        })
    }
}
