//! The subscription state machine: every change of a [`Record`] as a function of the record, the
//! request and the time (`now`, ms since the Unix epoch, from the backend's clock). The backends
//! only store records atomically (compare-and-set on a version); every decision is made here,
//! once, for memory and Redis alike.
//!
//! One rule makes wakes exactly-once per holder: a subscription has at most one *driver*, the
//! delivery-queue message whose token is in `Record::driver`. A change that gives the driver new
//! work it must act on now (a new wake, a claim whose lease must be watched) replaces the token
//! and asks for a new message ([`Change::drive`]); an older message finds another token and ends.

use rand::RngCore;
use serde_json::{json, Value};
use sha2::{Digest, Sha256};

use crate::model::*;

/// What a change asks of the caller besides storing the record.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Change {
    /// Enqueue a delivery message with this driver token.
    pub drive: Option<String>,
}

fn random_hex(n: usize) -> String {
    let mut b = vec![0u8; n];
    rand::rng().fill_bytes(&mut b);
    hex(&b)
}

fn sha256_hex(s: &str) -> String {
    hex(&Sha256::digest(s.as_bytes()))
}

/// A new record for `spec`, its explicit streams linked at their current tails (`tails`: path →
/// tail token, `ZERO_OFFSET` for a stream that does not exist) and the existing streams its glob
/// matches linked at theirs (so only what is appended after the creation is pending).
pub fn create(
    id: &str,
    spec: Spec,
    created_at: String,
    explicit: &[(String, String)],
    globbed: &[(String, String)],
) -> Record {
    let mut rec = Record {
        id: id.to_string(),
        config_hash: spec.config_hash(),
        spec,
        created_at,
        status: Status::Active,
        links: Default::default(),
        generation: 0,
        wake: None,
        token_generation: 0,
        token_sha256: String::new(),
        retry_count: 0,
        next_attempt_ms: 0,
        driver: None,
    };
    for (p, tail) in explicit {
        link(&mut rec, p, true, tail, tail);
    }
    for (p, tail) in globbed {
        link(&mut rec, p, false, tail, tail);
    }
    rec
}

/// Links a stream (explicitly or by glob); an existing link only gains the link type.
pub fn link(rec: &mut Record, path: &str, explicit: bool, acked: &str, tail: &str) {
    let l = rec.links.entry(path.to_string()).or_insert_with(|| Link {
        explicit: false,
        glob: false,
        acked: acked.to_string(),
        tail: tail.to_string(),
    });
    if explicit {
        l.explicit = true;
    } else {
        l.glob = true;
    }
}

/// Removes the explicit link of `path` (the link stays while the glob still matches it).
/// Returns whether the record changed.
pub fn unlink_explicit(rec: &mut Record, path: &str) -> bool {
    let Some(l) = rec.links.get_mut(path) else { return false };
    if !l.explicit {
        return false;
    }
    l.explicit = false;
    if !l.glob {
        rec.links.remove(path);
    }
    true
}

/// Forgets a deleted stream. Returns whether the record changed.
pub fn stream_deleted(rec: &mut Record, path: &str) -> bool {
    rec.links.remove(path).is_some()
}

/// An append to `path` whose tail is now `tail`: links it when the glob matches and it is new
/// (everything in it pending), records the tail, and wakes the subscription when nothing is
/// awake and entries are pending. Returns `None` when the record did not change.
pub fn appended(rec: &mut Record, path: &str, tail: &str, now: u64) -> Option<Change> {
    let mut changed = false;
    if !rec.links.contains_key(path) {
        if !rec.spec.pattern.as_deref().is_some_and(|p| glob_match(p, path)) {
            return None;
        }
        link(rec, path, false, BEFORE_FIRST, tail);
        changed = true;
    }
    let l = rec.links.get_mut(path).expect("linked above");
    if position(tail).unwrap_or((0, 0)) > position(&l.tail).unwrap_or((0, 0)) {
        l.tail = tail.to_string();
        changed = true;
    }
    let change = wake_if_pending(rec, now, false);
    if changed || change.drive.is_some() {
        Some(change)
    } else {
        None
    }
}

/// Creates a wake when none is current and entries are pending. `by_driver`: the driver itself
/// asks (it goes on with the new wake; no new message).
pub fn wake_if_pending(rec: &mut Record, now: u64, by_driver: bool) -> Change {
    if rec.wake.is_some() || !rec.has_pending() {
        return Change::default();
    }
    let trigger = rec.first_pending().unwrap_or_default().to_string();
    new_wake(rec, &trigger, now, false);
    if by_driver {
        Change::default()
    } else {
        new_driver(rec)
    }
}

fn new_driver(rec: &mut Record) -> Change {
    let t = random_hex(12);
    rec.driver = Some(t.clone());
    Change { drive: Some(t) }
}

/// Starts wake `generation + 1`. Webhook: issues its callback token (kept with the wake, so
/// every delivery attempt of the wake carries the same one) and starts its lease now.
fn new_wake(rec: &mut Record, trigger: &str, now: u64, announced: bool) {
    rec.generation += 1;
    let snapshot = rec.links.iter().map(|(p, l)| (p.clone(), l.tail.clone())).collect();
    let webhook = rec.spec.kind == Kind::Webhook;
    rec.wake = Some(Wake {
        id: format!("w_{}", random_hex(12)),
        generation: rec.generation,
        snapshot,
        triggered_by: trigger.to_string(),
        holder: None,
        deadline_ms: webhook.then(|| now + rec.spec.lease_ttl_ms),
        delivered: false,
        announced,
        token: None,
    });
    if webhook {
        let token = issue_token(rec);
        rec.wake.as_mut().expect("just set").token = Some(token);
    }
}

/// Issues a callback token for the current generation: `<generation>.<48 hex digits>`; only its
/// SHA-256 is stored.
fn issue_token(rec: &mut Record) -> String {
    let token = format!("{}.{}", rec.generation, random_hex(24));
    rec.token_generation = rec.generation;
    rec.token_sha256 = sha256_hex(&token);
    token
}

/// Ends the current wake (its token keeps fencing).
fn end_wake(rec: &mut Record) {
    rec.wake = None;
}

/// Checks a callback / ack / release against the current wake. Errors: `TokenInvalid`
/// (malformed or not this subscription's token; the message calls it the callback token of a
/// webhook subscription, the claim token of a pull-wake one), `Fenced` (an older generation's
/// token, a wake that ended, or a `wake_id` / `generation` that is not the current wake's; the
/// message says which).
pub fn check_token(rec: &Record, token: &str, req: &AckRequest) -> Result<()> {
    let what = match rec.spec.kind {
        Kind::Webhook => "callback token",
        Kind::PullWake => "claim token",
    };
    let invalid = |why: &str| SubscriptionError::TokenInvalid(format!("{what} invalid: {why}"));
    let tg: u64 = token
        .split_once('.')
        .and_then(|(g, _)| g.parse().ok())
        .ok_or_else(|| invalid("malformed (send the token exactly as issued)"))?;
    if tg == 0 || tg > rec.token_generation {
        return Err(invalid("not a token of this subscription"));
    }
    let current = || match &rec.wake {
        Some(w) => format!("the current wake is generation {}", w.generation),
        None => "no wake is current".to_string(),
    };
    if tg < rec.token_generation {
        return Err(SubscriptionError::Fenced(format!("this {what} is of generation {tg}; {}", current())));
    }
    let want = rec.token_sha256.as_bytes();
    let got = sha256_hex(token);
    // Constant-time comparison of the two hashes.
    if want.len() != got.len() || want.iter().zip(got.as_bytes()).fold(0u8, |a, (x, y)| a | (x ^ y)) != 0 {
        return Err(invalid("not a token of this subscription"));
    }
    let ended = || {
        let how = match rec.spec.kind {
            Kind::Webhook => "its lease ended or it was acknowledged done",
            Kind::PullWake => "its claim lapsed, or it was acknowledged done or released",
        };
        SubscriptionError::Fenced(format!("the wake of generation {tg} is no longer current: {how}"))
    };
    let Some(w) = &rec.wake else { return Err(ended()) };
    if w.generation != tg {
        return Err(SubscriptionError::Fenced(format!("this {what} is of generation {tg}; {}", current())));
    }
    if rec.spec.kind == Kind::PullWake && w.holder.is_none() {
        return Err(ended());
    }
    if req.generation != tg {
        return Err(SubscriptionError::Fenced(format!(
            "generation {} is not the current wake's: this {what} and the current wake are of generation {tg}",
            req.generation
        )));
    }
    if req.wake_id != w.id {
        return Err(SubscriptionError::Fenced(format!(
            "wake_id {:?} is not the current wake's ({}, generation {tg})",
            req.wake_id, w.id
        )));
    }
    Ok(())
}

fn apply_acks(rec: &mut Record, acks: &[(String, String)]) -> Result<()> {
    for (stream, offset) in acks {
        let Some(l) = rec.links.get(stream) else {
            return Err(SubscriptionError::InvalidOffset(format!(
                "ack of {stream:?}: not a stream of this subscription"
            )));
        };
        if offset == BEFORE_FIRST {
            return Err(SubscriptionError::InvalidOffset(format!("ack of {stream:?}: the offset must not be -1")));
        }
        let at = position(offset).map_err(|_| {
            SubscriptionError::InvalidOffset(format!("ack of {stream:?}: {offset:?} is not an offset of this server"))
        })?;
        if at < position(&l.acked).unwrap_or((0, 0)) {
            return Err(SubscriptionError::InvalidOffset(format!(
                "ack of {stream:?}: {offset} is before the acknowledged offset {}",
                l.acked
            )));
        }
        if at > position(&l.tail).unwrap_or((0, 0)) {
            return Err(SubscriptionError::InvalidOffset(format!(
                "ack of {stream:?}: {offset} is beyond the stream's tail {}",
                l.tail
            )));
        }
    }
    for (stream, offset) in acks {
        rec.links.get_mut(stream).expect("checked").acked = offset.clone();
    }
    Ok(())
}

/// A webhook callback or a pull-wake ack: checks the token (see [`check_token`]), applies the
/// acks (each must name a stream of the subscription, not move backwards and not pass the
/// tail; all or none apply), renews the wake's lease, and with `done` ends the wake and starts
/// the next one when entries are still pending. Returns `next_wake` and the change.
pub fn ack(rec: &mut Record, kind: Kind, token: &str, req: &AckRequest, now: u64) -> Result<(bool, Change)> {
    if rec.spec.kind != kind {
        return Err(SubscriptionError::invalid(format!("subscription is not {}", kind.as_str())));
    }
    check_token(rec, token, req)?;
    check_lease(rec, now)?;
    apply_acks(rec, &req.acks)?;
    let ttl = rec.spec.lease_ttl_ms;
    if let Some(w) = rec.wake.as_mut() {
        w.deadline_ms = Some(now + ttl);
    }
    if !req.done {
        return Ok((false, Change::default()));
    }
    end_wake(rec);
    let change = wake_if_pending(rec, now, false);
    Ok((change.drive.is_some(), change))
}

/// A pull-wake release: checks the token, ends the wake without acknowledging, and starts the
/// next wake when entries are pending.
pub fn release(rec: &mut Record, token: &str, req: &AckRequest, now: u64) -> Result<Change> {
    if rec.spec.kind != Kind::PullWake {
        return Err(SubscriptionError::invalid("subscription is not pull-wake"));
    }
    check_token(rec, token, req)?;
    check_lease(rec, now)?;
    end_wake(rec);
    Ok(wake_if_pending(rec, now, false))
}

/// A wake whose lease is over is not current, even before the driver (which wakes at the
/// deadline) has ended it: its token is fenced from the deadline on.
fn check_lease(rec: &Record, now: u64) -> Result<()> {
    match rec.wake.as_ref().and_then(|w| w.deadline_ms.map(|d| (w.generation, d))) {
        Some((g, d)) if d <= now => Err(SubscriptionError::Fenced(format!(
            "the wake of generation {g} is no longer current: its lease ended {} ms ago",
            now - d
        ))),
        _ => Ok(()),
    }
}

/// A pull-wake claim by `worker`. Errors: `AlreadyClaimed` (another holder's lease has not
/// expired), `NoPendingWork`, `InvalidRequest` (not pull-wake). Returns the claim reply
/// (`wake_id`, `generation`, `token`, `streams`, `lease_ttl_ms`) and the change (a new driver
/// that watches the lease).
pub fn claim(rec: &mut Record, worker: &str, now: u64) -> Result<(Value, Change)> {
    if rec.spec.kind != Kind::PullWake {
        return Err(SubscriptionError::invalid("subscription is not pull-wake"));
    }
    if let Some(w) = &rec.wake {
        if let Some(h) = &w.holder {
            if w.deadline_ms.is_some_and(|d| d > now) {
                return Err(SubscriptionError::AlreadyClaimed { holder: h.clone(), generation: rec.generation });
            }
            end_wake(rec);
        }
    }
    if !rec.has_pending() {
        return Err(SubscriptionError::NoPendingWork);
    }
    if rec.wake.is_none() {
        let trigger = rec.first_pending().unwrap_or_default().to_string();
        new_wake(rec, &trigger, now, true);
    }
    let ttl = rec.spec.lease_ttl_ms;
    let w = rec.wake.as_mut().expect("a wake");
    w.holder = Some(worker.to_string());
    w.deadline_ms = Some(now + ttl);
    let token = issue_token(rec);
    let w = rec.wake.as_ref().expect("a wake");
    let reply = json!({
        "wake_id": w.id,
        "generation": w.generation,
        "token": token,
        "streams": rec.stream_infos(),
        "lease_ttl_ms": ttl,
    });
    Ok((reply, new_driver(rec)))
}

/// What the driver must do next.
#[derive(Debug, PartialEq, Eq)]
pub enum Step {
    /// Another message drives this subscription (or it was deleted): end this one.
    Superseded,
    /// Nothing to do: the driver token was cleared; end the message.
    Idle,
    /// Look again after this many ms.
    Sleep(u64),
    /// POST this body (already holding a fresh callback token) to the webhook; then report with
    /// [`delivered`] (the wake's id, `wake_id`, names the wake the outcome is for).
    Deliver { generation: u64, wake_id: String, body: String },
    /// Append this wake event to the wake stream; then report with [`announced`].
    Announce { generation: u64, wake_id: String, wake_stream: String, event: String },
}

/// The driver's next step for the message with token `driver`. Expires a wake whose lease ended
/// (and starts the next one when entries are pending). Returns the step and whether the record
/// changed (store it before acting).
pub fn drive(rec: &mut Record, driver: &str, now: u64, callback_url: &str) -> (Step, bool) {
    if rec.driver.as_deref() != Some(driver) {
        return (Step::Superseded, false);
    }
    let mut changed = false;
    loop {
        let Some(w) = &rec.wake else {
            if rec.has_pending() {
                wake_if_pending(rec, now, true);
                changed = true;
                continue;
            }
            rec.driver = None;
            return (Step::Idle, true);
        };
        let expired = w.deadline_ms.is_some_and(|d| d <= now);
        match rec.spec.kind {
            Kind::Webhook => {
                if expired {
                    end_wake(rec);
                    changed = true;
                    continue;
                }
                let deadline = w.deadline_ms.unwrap_or(now);
                if w.delivered {
                    return (Step::Sleep(deadline - now), changed);
                }
                if now < rec.next_attempt_ms {
                    return (Step::Sleep(rec.next_attempt_ms.min(deadline) - now), changed);
                }
                let generation = w.generation;
                let wake_id = w.id.clone();
                let token = w.token.clone().unwrap_or_default();
                let body = json!({
                    "subscription_id": rec.id,
                    "wake_id": wake_id,
                    "generation": generation,
                    "streams": rec.stream_infos(),
                    "callback_url": callback_url,
                    "callback_token": token,
                });
                return (Step::Deliver { generation, wake_id, body: body.to_string() }, changed);
            }
            Kind::PullWake => {
                if expired && w.holder.is_some() {
                    end_wake(rec);
                    changed = true;
                    continue;
                }
                if !w.announced {
                    let event = json!({
                        "type": "wake",
                        "subscription_id": rec.id,
                        "stream": w.triggered_by,
                        "generation": w.generation,
                        "ts": now,
                    });
                    let wake_stream = rec.spec.wake_stream.clone().unwrap_or_default();
                    return (
                        Step::Announce {
                            generation: w.generation,
                            wake_id: w.id.clone(),
                            wake_stream,
                            event: event.to_string(),
                        },
                        changed,
                    );
                }
                if w.holder.is_some() {
                    return (Step::Sleep(w.deadline_ms.unwrap_or(now) - now), changed);
                }
                // Announced and not claimed: the claim that comes starts a new driver.
                rec.driver = None;
                return (Step::Idle, true);
            }
        }
    }
}

/// How a webhook delivery went.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Delivery {
    /// 2xx; `done`: the body was `{"done": true}`.
    Accepted { done: bool },
    /// Not 2xx, or no answer.
    Failed,
}

/// Most time between webhook delivery attempts, ms.
pub const MAX_RETRY_DELAY_MS: u64 = 60_000;

/// Backoff before attempt `retry_count + 1`: 1 s doubling to 60 s, ±20 % jitter.
pub fn retry_delay_ms(retry_count: u32) -> u64 {
    let base = 1000u64.saturating_mul(1u64 << retry_count.saturating_sub(1).min(16)).min(MAX_RETRY_DELAY_MS);
    let jitter = (base as f64 * 0.2 * (rand::random::<f64>() * 2.0 - 1.0)) as i64;
    (base as i64 + jitter).max(0) as u64
}

/// Records a delivery, made by the message with token `driver`, of the wake `wake_id`.
/// Accepted: the subscription is `active`, the lease starts again from now; with `done` the
/// wake's snapshot is acknowledged and the wake ends (the driver goes on to the next one).
/// Failed: `failed`, the next attempt after [`retry_delay_ms`]. A delivery of a wake that
/// already ended (a callback came first) only updates the status. Returns whether the record
/// changed: a delivery by a message that no longer drives the record (another one does, or the
/// subscription was deleted and created again since, its wakes counting from 1 again) changes
/// nothing: its outcome is not about the record's wakes.
pub fn delivered(rec: &mut Record, driver: &str, wake_id: &str, outcome: Delivery, now: u64) -> bool {
    if rec.driver.as_deref() != Some(driver) {
        return false;
    }
    match outcome {
        Delivery::Failed => {
            rec.status = Status::Failed;
            rec.retry_count = rec.retry_count.saturating_add(1);
            rec.next_attempt_ms = now + retry_delay_ms(rec.retry_count);
        }
        Delivery::Accepted { done } => {
            rec.status = Status::Active;
            rec.retry_count = 0;
            rec.next_attempt_ms = 0;
            let ttl = rec.spec.lease_ttl_ms;
            let Some(w) = rec.wake.as_mut().filter(|w| w.id == wake_id) else { return true };
            w.delivered = true;
            w.deadline_ms = Some(now + ttl);
            if done {
                let snapshot = std::mem::take(&mut w.snapshot);
                for (p, tail) in snapshot {
                    if let Some(l) = rec.links.get_mut(&p) {
                        if position(&tail).unwrap_or((0, 0)) > position(&l.acked).unwrap_or((0, 0)) {
                            l.acked = tail;
                        }
                    }
                }
                end_wake(rec);
            }
        }
    }
    true
}

/// Records that the wake event of wake `wake_id` is in the wake stream. Returns whether the
/// record changed (not when that wake is over, or belonged to a deleted subscription of the
/// same id).
pub fn announced(rec: &mut Record, wake_id: &str) -> bool {
    match rec.wake.as_mut().filter(|w| w.id == wake_id && !w.announced) {
        Some(w) => {
            w.announced = true;
            true
        }
        None => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn t(ms: u64) -> String {
        format!("{ms:016}_{:016}", 0)
    }

    fn webhook() -> Record {
        let spec = Spec::from_json(
            &json!({"type": "webhook", "pattern": "events/*", "webhook": {"url": "https://h"}, "lease_ttl_ms": 1000}),
        )
        .unwrap();
        create("s", spec, "now".into(), &[], &[("events/old".into(), t(5))])
    }

    #[test]
    fn append_wakes_once_and_done_ends() {
        let mut r = webhook();
        assert_eq!(appended(&mut r, "other/x", &t(1), 0), None);
        let c = appended(&mut r, "events/a", &t(10), 100).unwrap();
        let d = c.drive.expect("a driver");
        assert_eq!(r.generation, 1);
        // A second append while the wake is current: tail moves, no second driver.
        let c2 = appended(&mut r, "events/a", &t(11), 101).unwrap();
        assert_eq!(c2.drive, None);
        let (step, _) = drive(&mut r, &d, 102, "cb");
        let Step::Deliver { generation, body, .. } = step else { panic!("{step:?}") };
        assert_eq!(generation, 1);
        let v: Value = serde_json::from_str(&body).unwrap();
        let token = v["callback_token"].as_str().unwrap().to_string();
        delivered(&mut r, &d, v["wake_id"].as_str().unwrap(), Delivery::Accepted { done: false }, 103);
        assert_eq!(drive(&mut r, &d, 104, "cb").0, Step::Sleep(999));
        let req = AckRequest {
            wake_id: v["wake_id"].as_str().unwrap().into(),
            generation: 1,
            acks: vec![("events/a".into(), t(11))],
            done: true,
        };
        let (next, c3) = ack(&mut r, Kind::Webhook, &token, &req, 105).unwrap();
        assert!(!next);
        assert_eq!(c3.drive, None);
        assert_eq!(
            ack(&mut r, Kind::Webhook, &token, &req, 106).unwrap_err(),
            SubscriptionError::Fenced(
                "the wake of generation 1 is no longer current: its lease ended or it was acknowledged done".into()
            )
        );
        assert_eq!(drive(&mut r, &d, 107, "cb").0, Step::Idle);
        assert_eq!(r.driver, None);
    }

    #[test]
    fn lease_expiry_starts_next_generation() {
        let mut r = webhook();
        let d = appended(&mut r, "events/a", &t(10), 0).unwrap().drive.unwrap();
        let Step::Deliver { wake_id, .. } = drive(&mut r, &d, 1, "cb").0 else { panic!() };
        delivered(&mut r, &d, &wake_id, Delivery::Accepted { done: false }, 1);
        let (step, changed) = drive(&mut r, &d, 2000, "cb");
        assert!(changed);
        assert!(matches!(step, Step::Deliver { generation: 2, .. }), "{step:?}");
    }

    #[test]
    fn acks_are_checked() {
        let mut r = webhook();
        let d = appended(&mut r, "events/a", &t(10), 0).unwrap().drive.unwrap();
        let Step::Deliver { body, .. } = drive(&mut r, &d, 1, "cb").0 else { panic!() };
        let v: Value = serde_json::from_str(&body).unwrap();
        let token = v["callback_token"].as_str().unwrap();
        let mut req = AckRequest {
            wake_id: v["wake_id"].as_str().unwrap().into(),
            generation: 1,
            acks: vec![("events/a".into(), t(11))],
            done: false,
        };
        assert!(matches!(ack(&mut r, Kind::Webhook, token, &req, 2), Err(SubscriptionError::InvalidOffset(_))));
        req.acks = vec![("nope".into(), t(1))];
        assert!(matches!(ack(&mut r, Kind::Webhook, token, &req, 2), Err(SubscriptionError::InvalidOffset(_))));
        let msg = |r: &mut Record, token: &str, req: &AckRequest| {
            let e = ack(r, Kind::Webhook, token, req, 2).unwrap_err();
            (e.code(), e.to_string())
        };
        assert_eq!(
            msg(&mut r, "1.00", &req),
            ("TOKEN_INVALID", "callback token invalid: not a token of this subscription".into())
        );
        assert_eq!(msg(&mut r, "2.00", &req).0, "TOKEN_INVALID", "a generation not issued yet");
        assert_eq!(
            msg(&mut r, "x", &req),
            ("TOKEN_INVALID", "callback token invalid: malformed (send the token exactly as issued)".into())
        );
        req.acks = vec![];
        req.generation = 0;
        assert_eq!(
            msg(&mut r, token, &req),
            (
                "FENCED",
                "generation 0 is not the current wake's: this callback token and the current wake are of generation 1"
                    .into()
            )
        );
        req.generation = 1;
        req.wake_id = "w_other".into();
        let wake_id = r.wake.as_ref().unwrap().id.clone();
        assert_eq!(
            msg(&mut r, token, &req),
            ("FENCED", format!("wake_id \"w_other\" is not the current wake's ({wake_id}, generation 1)"))
        );

        // The lease ends, entries are pending: generation 2 is delivered; generation 1's token
        // is fenced, and says so.
        let (step, _) = drive(&mut r, &d, 5000, "cb");
        let Step::Deliver { generation: 2, body, .. } = step else { panic!("{step:?}") };
        let v2: Value = serde_json::from_str(&body).unwrap();
        req.wake_id = v2["wake_id"].as_str().unwrap().into();
        assert_eq!(
            msg(&mut r, token, &req),
            ("FENCED", "this callback token is of generation 1; the current wake is generation 2".into())
        );
    }

    #[test]
    fn outcomes_of_a_deleted_incarnation_change_nothing() {
        // Webhook: a delivery of generation 1 is in flight when the subscription is deleted
        // and created again; the new record's first wake is generation 1 too.
        let mut old = webhook();
        let d1 = appended(&mut old, "events/a", &t(10), 0).unwrap().drive.unwrap();
        let Step::Deliver { wake_id: w1, .. } = drive(&mut old, &d1, 1, "cb").0 else { panic!() };
        let mut new = webhook();
        let d2 = appended(&mut new, "events/a", &t(20), 2).unwrap().drive.unwrap();
        assert!(matches!(drive(&mut new, &d2, 3, "cb").0, Step::Deliver { generation: 1, .. }));
        let before = new.clone();
        assert!(!delivered(&mut new, &d1, &w1, Delivery::Accepted { done: true }, 4));
        assert!(!delivered(&mut new, &d1, &w1, Delivery::Failed, 4));
        assert_eq!(new, before, "the old delivery neither acks nor ends the new wake");

        // Pull-wake: an old incarnation's announcement does not count for the new wake.
        let spec = Spec::from_json(&json!({"type": "pull-wake", "pattern": "events/*", "wake_stream": "w"})).unwrap();
        let mut old = create("p", spec.clone(), "now".into(), &[], &[]);
        let d1 = appended(&mut old, "events/a", &t(10), 0).unwrap().drive.unwrap();
        let Step::Announce { wake_id: w1, .. } = drive(&mut old, &d1, 1, "").0 else { panic!() };
        let mut new = create("p", spec, "now".into(), &[], &[]);
        let d2 = appended(&mut new, "events/a", &t(20), 2).unwrap().drive.unwrap();
        assert!(!announced(&mut new, &w1));
        assert!(matches!(drive(&mut new, &d2, 3, "").0, Step::Announce { generation: 1, .. }));
    }

    #[test]
    fn a_lapsed_lease_is_fenced_before_the_driver_ends_it() {
        let mut r = webhook();
        let d = appended(&mut r, "events/a", &t(10), 0).unwrap().drive.unwrap();
        let Step::Deliver { body, .. } = drive(&mut r, &d, 1, "cb").0 else { panic!() };
        let v: Value = serde_json::from_str(&body).unwrap();
        let token = v["callback_token"].as_str().unwrap();
        let req =
            AckRequest { wake_id: v["wake_id"].as_str().unwrap().into(), generation: 1, acks: vec![], done: true };
        // The lease (1 s from creation at 0) is over at 1000, whatever the driver did.
        let e = ack(&mut r, Kind::Webhook, token, &req, 1000).unwrap_err();
        assert_eq!(e.code(), "FENCED", "{e}");
        assert!(r.wake.is_some(), "nothing changed");
        assert!(ack(&mut r, Kind::Webhook, token, &req, 999).is_ok());
    }

    #[test]
    fn pull_wake_claims() {
        let spec = Spec::from_json(
            &json!({"type": "pull-wake", "pattern": "events/*", "wake_stream": "w", "lease_ttl_ms": 1000}),
        )
        .unwrap();
        let mut r = create("p", spec, "now".into(), &[], &[]);
        assert_eq!(claim(&mut r, "w1", 0).unwrap_err(), SubscriptionError::NoPendingWork);
        let d = appended(&mut r, "events/a", &t(10), 0).unwrap().drive.unwrap();
        let Step::Announce { generation: 1, wake_id, .. } = drive(&mut r, &d, 1, "").0 else { panic!() };
        assert!(announced(&mut r, &wake_id));
        assert_eq!(drive(&mut r, &d, 2, "").0, Step::Idle);
        let (reply, c) = claim(&mut r, "w1", 3).unwrap();
        assert!(c.drive.is_some());
        let e = claim(&mut r, "w2", 4).unwrap_err();
        assert_eq!(e, SubscriptionError::AlreadyClaimed { holder: "w1".into(), generation: 1 });
        // After the lease, another worker may claim; the first one's token is fenced.
        let (reply2, _) = claim(&mut r, "w2", 1004).unwrap();
        assert_eq!(reply2["generation"], 2);
        let req =
            AckRequest { wake_id: reply["wake_id"].as_str().unwrap().into(), generation: 1, acks: vec![], done: true };
        assert_eq!(
            ack(&mut r, Kind::PullWake, reply["token"].as_str().unwrap(), &req, 1005).unwrap_err(),
            SubscriptionError::Fenced("this claim token is of generation 1; the current wake is generation 2".into())
        );
        let e = ack(&mut r, Kind::PullWake, "2.00", &req, 1005).unwrap_err();
        assert_eq!(e.to_string(), "claim token invalid: not a token of this subscription");
        // w2 acknowledges everything, done: its token now names a wake that ended.
        let token2 = reply2["token"].as_str().unwrap();
        let req2 = AckRequest {
            wake_id: reply2["wake_id"].as_str().unwrap().into(),
            generation: 2,
            acks: vec![("events/a".into(), t(10))],
            done: true,
        };
        assert!(!ack(&mut r, Kind::PullWake, token2, &req2, 1006).unwrap().0);
        assert_eq!(
            release(&mut r, token2, &req2, 1007).unwrap_err(),
            SubscriptionError::Fenced(
                "the wake of generation 2 is no longer current: its claim lapsed, or it was acknowledged done or released"
                    .into()
            )
        );
    }
}
