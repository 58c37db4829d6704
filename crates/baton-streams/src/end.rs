//! How a stream ends: its one end ([`EndState`]: reason and final offset) and what an ender is told
//! ([`Ended`]). Below `error.rs`, which carries an [`EndState`] in `StreamError::Closed`.

use std::fmt;

use crate::offset::Offset;

/// Why a stream ended (Baton run semantics; a protocol close is `Finished`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum EndReason {
    /// The producer finished (or a protocol `Stream-Closed: true`).
    Finished,
    /// Someone cancelled the run.
    Cancelled,
    /// No append and no keepalive for `silence_timeout`.
    ProducerLost,
}

impl EndReason {
    /// `finished`, `cancelled` or `producer_lost`.
    pub fn as_str(&self) -> &'static str {
        match self {
            EndReason::Finished => "finished",
            EndReason::Cancelled => "cancelled",
            EndReason::ProducerLost => "producer_lost",
        }
    }

    pub(crate) fn parse(s: &str) -> Option<Self> {
        match s {
            "finished" => Some(EndReason::Finished),
            "cancelled" => Some(EndReason::Cancelled),
            "producer_lost" => Some(EndReason::ProducerLost),
            _ => None,
        }
    }
}

impl fmt::Display for EndReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// The one end of a stream: its reason and final offset (the tail when it ended).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct EndState {
    pub reason: EndReason,
    pub final_offset: Offset,
}

/// What an ender (finish, cancel, close, producer_lost) is told: the stream's one end, and
/// whether this call is the one that ended it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Ended {
    pub end: EndState,
    pub ended_now: bool,
}
