//! Offsets (PROTOCOL.md §8).
//!
//! An [`Offset`] is the position *after* one entry of a stream. Its text form is
//! `MMMMMMMMMMMMMMMM_SSSSSSSSSSSSSSSS`: two zero-padded 16-digit decimal numbers (the entry's
//! millisecond and sequence, as in a Redis Stream entry id). That form is URL-safe, fixed-width
//! (so lexicographic order equals stream order), never `-1` nor `now`, and unique for entries
//! appended in the same millisecond (the sequence part differs). The start of every stream is
//! [`Offset::ZERO`] (`0000000000000000_0000000000000000`).
//!
//! This module uses no other module of the crate, so that errors can carry offsets: the public
//! parsers that fail with a [`StreamError`](crate::StreamError) (`Offset::parse`, `Offset`'s
//! `FromStr`, `ReadFrom::parse`) are thin wrappers of `parse_token` and `parse_read_from` kept
//! in `error.rs`, next to that error.

use std::fmt;

/// A position in a stream: the point just after the entry with this id (§8).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub struct Offset {
    /// Milliseconds part (Redis entry id `ms`).
    pub ms: u64,
    /// Sequence part (Redis entry id `seq`).
    pub seq: u64,
}

const PART: usize = 16;
const MAX_PART: u64 = 9_999_999_999_999_999;

impl Offset {
    /// The start of every stream (before the first entry).
    pub const ZERO: Offset = Offset { ms: 0, seq: 0 };

    /// Builds an offset from its two parts.
    pub const fn new(ms: u64, seq: u64) -> Self {
        Self { ms, seq }
    }

    /// Parses the Redis entry id form `ms-seq`.
    pub fn from_redis_id(id: &str) -> Option<Offset> {
        let (ms, seq) = id.split_once('-')?;
        Some(Offset { ms: ms.parse().ok()?, seq: seq.parse().ok()? })
    }

    /// The Redis entry id form `ms-seq`.
    pub fn to_redis_id(&self) -> String {
        format!("{}-{}", self.ms, self.seq)
    }
}

impl fmt::Display for Offset {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:016}_{:016}", self.ms.min(MAX_PART), self.seq.min(MAX_PART))
    }
}

/// Where a read starts (§5.6, §8 "Sentinel Values").
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ReadFrom {
    /// `-1`: the beginning of the stream (the earliest retained entry after a trim).
    Start,
    /// `now`: the current tail; no existing data is returned.
    Now,
    /// After a previously returned offset.
    At(Offset),
}

/// The protocol token `\d{16}_\d{16}` (§8), or `None` for anything else.
pub(crate) fn parse_token(input: &str) -> Option<Offset> {
    let b = input.as_bytes();
    if b.len() != 2 * PART + 1 || b[PART] != b'_' {
        return None;
    }
    let digits = |s: &[u8]| -> Option<u64> {
        if s.iter().all(u8::is_ascii_digit) {
            std::str::from_utf8(s).ok()?.parse().ok()
        } else {
            None
        }
    };
    Some(Offset { ms: digits(&b[..PART])?, seq: digits(&b[PART + 1..])? })
}

/// `-1`, `now` or an offset token (§5.6, §8), or `None` for anything else (the empty string
/// included).
pub(crate) fn parse_read_from(input: &str) -> Option<ReadFrom> {
    match input {
        "-1" => Some(ReadFrom::Start),
        "now" => Some(ReadFrom::Now),
        other => parse_token(other).map(ReadFrom::At),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip_and_order() {
        let a = Offset::new(1_732_934_123_456, 0);
        let b = Offset::new(1_732_934_123_456, 1);
        let c = Offset::new(1_732_934_123_457, 0);
        assert_eq!(a.to_string(), "0001732934123456_0000000000000000");
        assert!(a.to_string() < b.to_string() && b.to_string() < c.to_string());
        assert_eq!(parse_token(&b.to_string()), Some(b));
        assert_eq!(Offset::ZERO.to_string(), "0000000000000000_0000000000000000");
        assert_eq!(Offset::from_redis_id("5-7"), Some(Offset::new(5, 7)));
        assert_eq!(Offset::new(5, 7).to_redis_id(), "5-7");
    }

    #[test]
    fn malformed() {
        for bad in [
            "",
            "0,1",
            "a b",
            "0000000000000000-0000000000000000",
            "../x",
            "1_1",
            "000000000000000a_0000000000000000",
            "0000000000000000_00000000000000000",
        ] {
            assert_eq!(parse_read_from(bad), None, "{bad}");
        }
        assert_eq!(parse_read_from("-1"), Some(ReadFrom::Start));
        assert_eq!(parse_read_from("now"), Some(ReadFrom::Now));
    }
}
