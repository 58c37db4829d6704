//! Offsets (PROTOCOL.md §8).
//!
//! An [`Offset`] is the position *after* one entry of a stream. Its text form is
//! `MMMMMMMMMMMMMMMM_SSSSSSSSSSSSSSSS`: two zero-padded 16-digit decimal numbers (the entry's
//! millisecond and sequence, as in a Redis Stream entry id). That form is URL-safe, fixed-width
//! (so lexicographic order equals stream order), never `-1` nor `now`, and unique for entries
//! appended in the same millisecond (the sequence part differs). The start of every stream is
//! [`Offset::ZERO`] (`0000000000000000_0000000000000000`).
//!
//! Over HTTP an offset travels as a *token*: the text form followed by `_` and the 12-hex-digit
//! [`OffsetTag`] of the stream's incarnation ([`Offset::token`]), e.g.
//! `0001732934123456_0000000000000000_3fa8c2d1e0b4`. A stream deleted and re-created at the same
//! path is a new incarnation with another tag, so an offset saved from the old one is recognized
//! (and refused, [`StreamError::OffsetIncarnation`](crate::StreamError::OffsetIncarnation)) instead of being
//! read as a position in the new one. The tag is a suffix, so tokens of one stream still sort in
//! stream order; the untagged form (offsets Baton handed out before tags, and [`Offset`]'s
//! `Display`) is still accepted, unchecked. A fork's incarnation carries its source's tag (see
//! [`OffsetTag::of`]), so the source's offsets up to the fork point are the fork's too.
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

impl Offset {
    /// The token of this offset in a stream of incarnation `incarnation`: the text form, `_`, and
    /// the incarnation's [`OffsetTag`]; the bare text form when `incarnation` is empty (unknown).
    pub fn token(&self, incarnation: &str) -> String {
        if incarnation.is_empty() {
            return self.to_string();
        }
        format!("{self}_{}", OffsetTag::of(incarnation))
    }
}

/// Which incarnation of a stream an offset token belongs to: 48 bits, written as 12 lowercase
/// hex digits at the end of the token.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct OffsetTag(u64);

const TAG_DIGITS: usize = 12;
const TAG_MASK: u64 = (1 << 48) - 1;

impl OffsetTag {
    /// The tag of an incarnation: a fork's incarnation is `<source tag>.<own id>` and has its
    /// source's tag (so the lineage shares offsets); any other incarnation's tag is the low 48 bits
    /// of its FNV-1a hash.
    pub fn of(incarnation: &str) -> OffsetTag {
        if let Some((tag, _)) = incarnation.split_once('.') {
            if let Some(t) = parse_tag(tag) {
                return t;
            }
        }
        let mut h: u64 = 0xcbf2_9ce4_8422_2325;
        for b in incarnation.bytes() {
            h ^= u64::from(b);
            h = h.wrapping_mul(0x0100_0000_01b3);
        }
        OffsetTag(h & TAG_MASK)
    }
}

impl fmt::Display for OffsetTag {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:012x}", self.0)
    }
}

fn parse_tag(s: &str) -> Option<OffsetTag> {
    if s.len() != TAG_DIGITS || !s.bytes().all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b)) {
        return None;
    }
    u64::from_str_radix(s, 16).ok().map(OffsetTag)
}

/// Where a read starts (§5.6, §8 "Sentinel Values").
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ReadFrom {
    /// `-1`: the beginning of the stream (the earliest retained entry after a trim).
    Start,
    /// `now`: the current tail; no existing data is returned.
    Now,
    /// After a previously returned offset (any incarnation: not checked).
    At(Offset),
    /// After a previously returned offset token of the incarnation with this tag; a stream of
    /// another incarnation refuses it ([`StreamError::OffsetIncarnation`](crate::StreamError::OffsetIncarnation)).
    Tagged(Offset, OffsetTag),
}

impl ReadFrom {
    /// The position without its tag, and the tag.
    pub fn untagged(self) -> (ReadFrom, Option<OffsetTag>) {
        match self {
            ReadFrom::Tagged(o, t) => (ReadFrom::At(o), Some(t)),
            other => (other, None),
        }
    }
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

/// A tagged token `\d{16}_\d{16}_[0-9a-f]{12}` or the untagged `\d{16}_\d{16}`, or `None`.
pub(crate) fn parse_tagged(input: &str) -> Option<(Offset, Option<OffsetTag>)> {
    let plain = 2 * PART + 1;
    if input.len() == plain + 1 + TAG_DIGITS && input.as_bytes()[plain] == b'_' {
        return Some((parse_token(&input[..plain])?, Some(parse_tag(&input[plain + 1..])?)));
    }
    parse_token(input).map(|o| (o, None))
}

/// `-1`, `now` or an offset token, tagged or not (§5.6, §8), or `None` for anything else (the
/// empty string included).
pub(crate) fn parse_read_from(input: &str) -> Option<ReadFrom> {
    match input {
        "-1" => Some(ReadFrom::Start),
        "now" => Some(ReadFrom::Now),
        other => match parse_tagged(other)? {
            (o, Some(t)) => Some(ReadFrom::Tagged(o, t)),
            (o, None) => Some(ReadFrom::At(o)),
        },
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
        for bad in [
            "0000000000000000_0000000000000000_",
            "0000000000000000_0000000000000000_3FA8C2D1E0B4",
            "0000000000000000_0000000000000000_3fa8c2d1e0b",
            "0000000000000000_0000000000000000-3fa8c2d1e0b4",
        ] {
            assert_eq!(parse_read_from(bad), None, "{bad}");
        }
    }

    #[test]
    fn tokens() {
        let o = Offset::new(1_732_934_123_456, 2);
        let inc = "0193a1b2c3d47e8f9a0b1c2d3e4f5a6b";
        let token = o.token(inc);
        assert_eq!(token.len(), 46);
        assert!(token.starts_with("0001732934123456_0000000000000002_"));
        assert_eq!(parse_read_from(&token), Some(ReadFrom::Tagged(o, OffsetTag::of(inc))));
        assert_ne!(OffsetTag::of(inc), OffsetTag::of("0193a1b2c3d47e8f9a0b1c2d3e4f5a6c"));
        // A fork's incarnation carries its source's tag.
        let fork = format!("{}.0193a1b2c3d47e8f9a0b1c2d3e4f5a6d", OffsetTag::of(inc));
        assert_eq!(OffsetTag::of(&fork), OffsetTag::of(inc));
        assert_eq!(o.token(""), o.to_string());
        // Tokens of one incarnation sort in stream order.
        assert!(Offset::new(5, 9).token(inc) < Offset::new(6, 0).token(inc));
        assert_eq!(ReadFrom::Tagged(o, OffsetTag::of(inc)).untagged(), (ReadFrom::At(o), Some(OffsetTag::of(inc))));
    }
}
