//! Decoding of script replies (the arrays built by `info()` and `flat()` in the scripts).

use std::time::Duration;

use baton_redis::redis::Value;
use bytes::Bytes;

use crate::end::{EndReason, EndState};
use crate::error::{Result, StreamError};
use crate::limits::{LimitScope, RunLimits};
use crate::offset::Offset;
use crate::types::*;

pub(super) fn text(v: &Value) -> String {
    match v {
        Value::BulkString(b) => String::from_utf8_lossy(b).into_owned(),
        Value::SimpleString(s) => s.clone(),
        Value::Int(i) => i.to_string(),
        Value::Okay => "OK".into(),
        _ => String::new(),
    }
}

/// True when `v` is the status `s` (no allocation).
pub(super) fn is(v: &Value, s: &str) -> bool {
    match v {
        Value::BulkString(b) => b == s.as_bytes(),
        Value::SimpleString(x) => x == s,
        _ => false,
    }
}

fn bytes(v: &Value) -> Bytes {
    match v {
        Value::BulkString(b) => Bytes::copy_from_slice(b),
        other => Bytes::from(text(other)),
    }
}

pub(super) fn num(v: &Value) -> Result<u64> {
    text(v).parse().map_err(|_| StreamError::Backend(format!("expected a number, got {v:?}")))
}

fn opt_num(v: &Value) -> Option<u64> {
    text(v).parse().ok()
}

pub(super) fn parse_id(v: &Value) -> Result<Offset> {
    if let Value::BulkString(b) = v {
        if let Some(o) = std::str::from_utf8(b).ok().and_then(Offset::from_redis_id) {
            return Ok(o);
        }
    }
    let t = text(v);
    Offset::from_redis_id(&t).ok_or_else(|| StreamError::Backend(format!("bad entry id {t:?}")))
}

pub(super) fn source_path(v: &Value) -> Option<StreamPath> {
    let t = text(v);
    if t.is_empty() {
        None
    } else {
        StreamPath::new(t).ok()
    }
}

fn items(v: &Value) -> Result<&[Value]> {
    match v {
        Value::Array(a) => Ok(a),
        other => Err(StreamError::Backend(format!("expected an array, got {other:?}"))),
    }
}

/// The 20-field `info(m)` array of `common.lua`.
pub(super) fn parse_info(path: &StreamPath, v: &Value) -> Result<StreamInfo> {
    let f = items(v)?;
    if f.len() < 20 {
        return Err(StreamError::Backend("short stream info".into()));
    }
    let tail = parse_id(&f[2])?;
    let end = EndReason::parse(&text(&f[3]))
        .map(|reason| EndState { reason, final_offset: Offset::from_redis_id(&text(&f[4])).unwrap_or(tail) });
    let expiry = match (opt_num(&f[5]), opt_num(&f[6])) {
        (Some(t), _) => Expiry::TtlSecs(t / 1000),
        (None, Some(e)) => Expiry::At(e),
        _ => Expiry::None,
    };
    let dur = |v: &Value| opt_num(v).map(Duration::from_millis);
    let fork = source_path(&f[17]).map(|source| ForkFrom {
        source,
        offset: Offset::from_redis_id(&text(&f[18])),
        sub_offset: opt_num(&f[19]).unwrap_or(0),
    });
    Ok(StreamInfo {
        path: path.clone(),
        incarnation: text(&f[0]),
        content_type: text(&f[1]),
        tail,
        expiry,
        deadline: opt_num(&f[16]),
        end,
        ended_at: f.get(20).and_then(opt_num),
        earliest: parse_id(&f[7])?,
        len: opt_num(&f[8]).unwrap_or(0),
        created_at: opt_num(&f[9]).unwrap_or(0),
        last_write_at: opt_num(&f[10]).unwrap_or(0),
        limits: RunLimits {
            silence_timeout: dur(&f[11]),
            max_run: dur(&f[12]),
            done_ttl: dur(&f[13]),
            max_len: opt_num(&f[14]),
            max_len_per_writer: opt_num(&f[15]),
        },
        fork,
    })
}

/// The `flat()` array: id, data, message count, ...
pub(super) fn parse_records(v: &Value) -> Result<Vec<Record>> {
    let f = items(v)?;
    let mut out = Vec::with_capacity(f.len() / 3);
    for c in f.chunks_exact(3) {
        out.push(Record { offset: parse_id(&c[0])?, data: bytes(&c[1]), messages: opt_num(&c[2]).unwrap_or(0) as u32 });
    }
    Ok(out)
}

/// Maps an error status of a script reply to its [`StreamError`]. `requested` is the offset the
/// caller asked for; `epoch` the producer epoch sent.
pub(super) fn check(path: &StreamPath, r: &[Value], requested: Offset, epoch: u64) -> Result<()> {
    let p = || path.to_string();
    let status = text(&r[0]);
    let at = |i: usize| r.get(i).map(text).unwrap_or_default();
    Err(match status.as_str() {
        "ok" | "created" | "exists" | "dup" | "soft" | "deleted" | "kept" | "collected" | "none" => return Ok(()),
        "nf" => StreamError::NotFound { path: p() },
        "gone" => StreamError::Gone { path: p() },
        "softdel" => StreamError::conflict("the path belongs to a deleted stream that forks still reference"),
        "conflict" => StreamError::conflict(at(1)),
        "fenced" => StreamError::Fenced { epoch, current_epoch: at(1).parse().unwrap_or(0) },
        "closed" => {
            let info = parse_info(path, &r[1])?;
            match info.end {
                Some(end) => StreamError::Closed { end, incarnation: info.incarnation },
                None => StreamError::Backend("closed reply without an end".into()),
            }
        }
        "ct" => StreamError::conflict(format!("content type differs from the stream's ({})", at(1))),
        "epoch0" => StreamError::EpochMustStartAtZero { seq: at(1).parse().unwrap_or(0) },
        "gap" => {
            StreamError::SequenceGap { expected: at(1).parse().unwrap_or(0), received: at(2).parse().unwrap_or(0) }
        }
        "sseq" => StreamError::StreamSeqRegression { last: at(1), received: String::new() },
        "toolong" => StreamError::TooLong {
            limit: at(2).parse().unwrap_or(0),
            scope: if at(1) == "writer" { LimitScope::Writer } else { LimitScope::Stream },
        },
        "ahead" => {
            StreamError::OffsetAhead { offset: requested, tail: Offset::from_redis_id(&at(1)).unwrap_or_default() }
        }
        "trimmed" => {
            StreamError::OffsetGone { offset: requested, earliest: Offset::from_redis_id(&at(1)).unwrap_or_default() }
        }
        other => StreamError::Backend(format!("unknown script status {other:?}")),
    })
}
