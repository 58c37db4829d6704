//! [`RawJson`]: command params and results kept as the JSON text they were given in, and the
//! meaning-based comparison of submit bodies (idempotent resubmits).

use std::collections::BTreeMap;
use std::fmt;

use serde::de::DeserializeOwned;
use serde::{Deserialize, Deserializer, Serialize, Serializer};
use serde_json::value::RawValue;
use serde_json::Value;

/// A JSON value kept as its text, byte for byte: numbers of any size and precision
/// (`0.42451918914251396`, `18446744073709551615`, `1e400`), string escapes (`"\u00e9"` stays six
/// characters), object key order and the whitespace inside the value are never changed; only
/// whitespace around the value is dropped. Command params ([`crate::Command::params`]) and
/// results ([`crate::CommandState::result`]) are `RawJson`, so a command comes back from the
/// store, over HTTP and on every backend exactly as it was submitted, and a handler's result
/// exactly as the handler wrote it.
///
/// Build one from text ([`RawJson::from_string`], [`RawJson::from_slice`]), from a
/// [`serde_json::Value`] (`From`, so `json!(…)` works wherever a `RawJson` is taken) or from any
/// `Serialize` value ([`RawJson::to_json`]); read it as text ([`RawJson::get`]) or decode it
/// ([`RawJson::parse`]: straight from the text, so a `u128`, a `String` or a
/// `Box<RawValue>` field loses nothing; through a `Value`, integers beyond `u64`/`i64` become
/// `f64`).
///
/// **Same meaning.** A resubmit of a command id is the same command when its type and params have
/// the same *meaning* as the stored ones (the stored text stays the first one):
///
/// * whitespace and object key order do not matter; a key given twice counts with its last value;
/// * strings (and keys) compare by the text they decode to: `"\u00e9"` = `"é"`;
/// * numbers compare by their exact decimal value *and* kind, integer (no fraction, no exponent)
///   or not: `0.1` = `0.10` = `1e-1`, `100.0` = `1e2`, `-0` = `0`, but `1` ≠ `1.0` (a handler
///   decoding an integer accepts only the first) and `0.42451918914251396` ≠
///   `0.4245191891425139` (no rounding to `f64`); integers of any size compare exactly.
///
/// A string with a lone UTF-16 surrogate escape (`"\ud83d"`) has no meaning, and params nested
/// more than [`MAX_PARAMS_NESTING`] deep are more than a handler can decode: such a submit is
/// refused ([`crate::CommandError::InvalidParams`]).
///
/// Equality (`==`) is equality of the text. Serialized with serde_json it is written as is;
/// deserialized it takes the value's text (with a serde_json deserializer: `from_str`,
/// `from_slice`, `from_reader`; from a `Value` it takes that value's serialization).
#[derive(Clone)]
pub struct RawJson(Box<RawValue>);

impl PartialEq for RawJson {
    fn eq(&self, other: &Self) -> bool {
        self.get() == other.get()
    }
}

impl Eq for RawJson {}

/// True when the text reads as a [`Value`] equal to `other` (numbers as serde_json reads them:
/// integers beyond `u64`/`i64` as `f64`); false when it does not read as a `Value`.
impl PartialEq<Value> for RawJson {
    fn eq(&self, other: &Value) -> bool {
        self.parse::<Value>().is_ok_and(|v| v == *other)
    }
}

impl PartialEq<RawJson> for Value {
    fn eq(&self, other: &RawJson) -> bool {
        other == self
    }
}

impl RawJson {
    /// `null`.
    pub fn null() -> Self {
        RawJson(RawValue::from_string("null".into()).expect("null is JSON"))
    }

    /// The JSON text `json` (surrounding whitespace dropped). Errors: not one JSON value (the
    /// error names line and column).
    pub fn from_string(json: String) -> Result<Self, serde_json::Error> {
        RawValue::from_string(json).map(RawJson)
    }

    /// The JSON text in `json` (UTF-8; surrounding whitespace dropped). Errors: not UTF-8 or not
    /// one JSON value.
    pub fn from_slice(json: &[u8]) -> Result<Self, serde_json::Error> {
        serde_json::from_slice::<Box<RawValue>>(json).map(RawJson)
    }

    /// `value` serialized to JSON. Errors: those of `serde_json::to_string` (e.g. a map with
    /// non-string keys).
    pub fn to_json<T: Serialize + ?Sized>(value: &T) -> Result<Self, serde_json::Error> {
        serde_json::value::to_raw_value(value).map(RawJson)
    }

    /// The JSON text.
    pub fn get(&self) -> &str {
        self.0.get()
    }

    /// True for `null`.
    pub fn is_null(&self) -> bool {
        self.get() == "null"
    }

    /// Decodes the text as `T` (e.g. a params struct, or a [`serde_json::Value`]). Errors: the
    /// text does not decode as `T` (for a `Value`: a number beyond the `f64` range, a lone UTF-16
    /// surrogate escape).
    pub fn parse<T: DeserializeOwned>(&self) -> Result<T, serde_json::Error> {
        serde_json::from_str(self.get())
    }

    /// The value as serde_json's [`RawValue`].
    pub fn as_raw(&self) -> &RawValue {
        &self.0
    }

    /// The boxed [`RawValue`].
    pub fn into_raw(self) -> Box<RawValue> {
        self.0
    }
}

impl Default for RawJson {
    /// `null`.
    fn default() -> Self {
        RawJson::null()
    }
}

impl From<Value> for RawJson {
    fn from(v: Value) -> Self {
        RawJson::from(&v)
    }
}

impl From<&Value> for RawJson {
    fn from(v: &Value) -> Self {
        RawJson::to_json(v).expect("a Value always serializes")
    }
}

impl From<Box<RawValue>> for RawJson {
    fn from(v: Box<RawValue>) -> Self {
        RawJson(v)
    }
}

impl fmt::Display for RawJson {
    /// The JSON text.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.get())
    }
}

impl fmt::Debug for RawJson {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "RawJson({})", self.get())
    }
}

impl Serialize for RawJson {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        self.0.serialize(s)
    }
}

impl<'de> Deserialize<'de> for RawJson {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        Box::<RawValue>::deserialize(d).map(RawJson)
    }
}

/// The canonical form of a submit body (type and params) for idempotency checks: two bodies are
/// the same command exactly when their canonical forms are equal. The rule ("same meaning"):
///
/// * whitespace and object key order do not matter; a key given twice counts with its last
///   value (as serde_json reads it);
/// * strings (and keys) compare by the text they decode to: `"\u00e9"` = `"é"`;
/// * numbers compare by their exact decimal value *and* by kind, integer (no fraction, no
///   exponent) or not: `0.1` = `0.10` = `1e-1` = `0.100e0`, `100.0` = `1e2`, `-0` = `0`,
///   `0.0` = `-0.0`, but `1` ≠ `1.0` (a handler decoding an integer accepts only the first),
///   and `0.42451918914251396` ≠ `0.4245191891425139` (no rounding to `f64`); integers of any
///   size compare exactly. (An exponent too long for 18 digits compares by its text.)
///
/// Errors: a string that does not decode (a lone UTF-16 surrogate escape such as `"\ud83d"`);
/// arrays and objects nested more than [`MAX_PARAMS_NESTING`] deep.
///
/// The form starts with `v2` and a newline, so it never equals a [`legacy_canonical_body`].
pub(crate) fn canonical_body(command_type: &str, params: &RawJson) -> Result<String, serde_json::Error> {
    let mut out = String::from("v2\n");
    out.push_str(&serde_json::to_string(command_type).expect("string"));
    out.push('\n');
    canonical(params.get(), &mut out)?;
    Ok(out)
}

/// The deepest nesting of arrays and objects in params: 127, what serde_json (its recursion
/// limit of 128) decodes as a [`Value`] or a derived struct. [`RawJson`] itself keeps any depth
/// (serde_json skips over a raw value without that limit), so the limit is applied here, on
/// every submit: deeper params are refused (a 1 MiB body can nest 500,000 deep).
pub const MAX_PARAMS_NESTING: usize = 127;

/// An array or object being written by [`canonical`].
enum Open {
    /// An array: its elements go straight into the output; `first` until one is written.
    Array { first: bool },
    /// An object: `outer` is the output before it, each value is written into a fresh buffer
    /// and kept under its decoded key (a key given twice: the last value), `key` the key whose
    /// value comes next.
    Object { outer: String, entries: BTreeMap<String, String>, key: Option<String> },
}

/// Writes the canonical form of the JSON text `raw` (valid JSON, as [`RawJson`] checked) in one
/// pass over it, with a stack of the arrays and objects open (no recursion: a `RawJson` may
/// nest far deeper than a thread's stack allows, and refusing one that is too deep reads no
/// further than [`MAX_PARAMS_NESTING`] levels into it).
fn canonical(raw: &str, out: &mut String) -> Result<(), serde_json::Error> {
    let bytes = raw.as_bytes();
    let mut stack: Vec<Open> = Vec::new();
    let mut cur = String::new();
    let mut i = 0;
    while i < bytes.len() {
        let b = bytes[i];
        // Separators carry nothing once the text is known to be JSON.
        if matches!(b, b' ' | b'\t' | b'\n' | b'\r' | b',' | b':') {
            i += 1;
            continue;
        }
        if matches!(b, b']' | b'}') {
            i += 1;
            match stack.pop() {
                Some(Open::Array { .. }) => cur.push(']'),
                Some(Open::Object { outer, entries, .. }) => {
                    let mut obj = outer;
                    obj.push('{');
                    for (n, (k, v)) in entries.iter().enumerate() {
                        if n > 0 {
                            obj.push(',');
                        }
                        obj.push_str(&serde_json::to_string(k).expect("string"));
                        obj.push(':');
                        obj.push_str(v);
                    }
                    obj.push('}');
                    cur = obj;
                }
                None => unreachable!("valid JSON closes only what it opened"),
            }
            value_done(&mut stack, &mut cur);
            continue;
        }
        // A key, or the start of a value.
        let key_next = matches!(stack.last(), Some(Open::Object { key: None, .. }));
        if !key_next {
            if let Some(Open::Array { first }) = stack.last_mut() {
                if !std::mem::take(first) {
                    cur.push(',');
                }
            }
        }
        match b {
            b'[' | b'{' => {
                if stack.len() >= MAX_PARAMS_NESTING {
                    return Err(serde::de::Error::custom(format_args!(
                        "arrays and objects are nested more than {MAX_PARAMS_NESTING} deep; flatten the params"
                    )));
                }
                i += 1;
                if b == b'[' {
                    cur.push('[');
                    stack.push(Open::Array { first: true });
                } else {
                    let outer = std::mem::take(&mut cur);
                    stack.push(Open::Object { outer, entries: BTreeMap::new(), key: None });
                }
            }
            b'"' => {
                let start = i;
                i += 1;
                while bytes[i] != b'"' {
                    i += if bytes[i] == b'\\' { 2 } else { 1 };
                }
                i += 1;
                let s: String = serde_json::from_str(&raw[start..i])?;
                if key_next {
                    if let Some(Open::Object { key, .. }) = stack.last_mut() {
                        *key = Some(s);
                    }
                } else {
                    cur.push_str(&serde_json::to_string(&s).expect("string"));
                    value_done(&mut stack, &mut cur);
                }
            }
            _ => {
                let start = i;
                while i < bytes.len() && matches!(bytes[i], b'-' | b'+' | b'.' | b'0'..=b'9' | b'a'..=b'z' | b'E') {
                    i += 1;
                }
                let token = &raw[start..i];
                if matches!(b, b'-' | b'0'..=b'9') {
                    canonical_number(token, &mut cur);
                } else {
                    cur.push_str(token);
                }
                value_done(&mut stack, &mut cur);
            }
        }
    }
    out.push_str(&cur);
    Ok(())
}

/// A value was written into `cur`: an object's value is moved under its key.
fn value_done(stack: &mut [Open], cur: &mut String) {
    if let Some(Open::Object { entries, key, .. }) = stack.last_mut() {
        let k = key.take().expect("a value in an object follows its key");
        entries.insert(k, std::mem::take(cur));
    }
}

/// A JSON number (valid, as serde_json checked): an integer as its digits (`-0` as `0`); any
/// other number as `<sign><significant digits>e<exponent>` of its exact value (`0e0` for zero).
fn canonical_number(raw: &str, out: &mut String) {
    let (negative, body) = match raw.strip_prefix('-') {
        Some(rest) => (true, rest),
        None => (false, raw),
    };
    let (mantissa, exp_text) = match body.find(['e', 'E']) {
        Some(i) => (&body[..i], Some(&body[i + 1..])),
        None => (body, None),
    };
    let (int, frac) = match mantissa.split_once('.') {
        Some((i, f)) => (i, Some(f)),
        None => (mantissa, None),
    };
    if frac.is_none() && exp_text.is_none() {
        if int.bytes().all(|b| b == b'0') {
            out.push('0');
        } else {
            if negative {
                out.push('-');
            }
            out.push_str(int);
        }
        return;
    }
    let exp: i128 = match exp_text {
        None => 0,
        Some(e) if e.trim_start_matches(['+', '-']).len() <= 18 => e.parse().expect("JSON exponent"),
        Some(_) => {
            out.push('~');
            out.push_str(raw);
            return;
        }
    };
    let frac = frac.unwrap_or("");
    let digits: String = format!("{int}{frac}");
    let digits = digits.trim_start_matches('0');
    let significant = digits.trim_end_matches('0');
    if significant.is_empty() {
        out.push_str("0e0");
        return;
    }
    let exponent = exp - frac.len() as i128 + (digits.len() - significant.len()) as i128;
    if negative {
        out.push('-');
    }
    out.push_str(significant);
    out.push('e');
    out.push_str(&exponent.to_string());
}

/// The canonical body of the versions before [`canonical_body`] (type and params read as a
/// `serde_json::Value`, keys sorted): a Redis state stored by them carries its hash, so a
/// resubmit whose new hash differs is checked against this one before it is called a conflict.
/// `None` when the params do not read as a `Value` (those versions refused such a submit).
pub(crate) fn legacy_canonical_body(command_type: &str, params: &RawJson) -> Option<String> {
    fn write(v: &Value, out: &mut String) {
        match v {
            Value::Object(m) => {
                let mut keys: Vec<&String> = m.keys().collect();
                keys.sort();
                out.push('{');
                for (i, k) in keys.iter().enumerate() {
                    if i > 0 {
                        out.push(',');
                    }
                    out.push_str(&serde_json::to_string(k).expect("string"));
                    out.push(':');
                    write(&m[*k], out);
                }
                out.push('}');
            }
            Value::Array(a) => {
                out.push('[');
                for (i, x) in a.iter().enumerate() {
                    if i > 0 {
                        out.push(',');
                    }
                    write(x, out);
                }
                out.push(']');
            }
            other => out.push_str(&other.to_string()),
        }
    }
    let params: Value = params.parse().ok()?;
    let mut out = serde_json::to_string(command_type).expect("string");
    out.push('\n');
    write(&params, &mut out);
    Some(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn raw(s: &str) -> RawJson {
        RawJson::from_string(s.to_string()).unwrap()
    }

    fn canon(s: &str) -> String {
        canonical_body("t", &raw(s)).unwrap()
    }

    #[test]
    fn text_is_kept() {
        for s in [
            r#"{"b":1,"a":[0.42451918914251396,18446744073709551615,-9223372036854775809]}"#,
            r#""\u00e9\ud83d\ude00""#,
            "123456789012345678901234567890",
            "1e400",
            "{ \"x\" :\t0.10 }",
        ] {
            let r = raw(s);
            assert_eq!(r.get(), s);
            assert_eq!(serde_json::to_string(&r).unwrap(), s);
            let back: RawJson = serde_json::from_str(&format!("[ {s} ]")).map(|v: Vec<RawJson>| v[0].clone()).unwrap();
            assert_eq!(back.get(), s);
        }
        assert_eq!(raw("  null \n").get(), "null");
        assert!(RawJson::from_string("{".into()).is_err());
        assert_eq!(RawJson::from(serde_json::json!({"b": 1, "a": "é"})).get(), r#"{"a":"é","b":1}"#);
    }

    #[test]
    fn same_meaning_same_body() {
        let same = [
            (r#"{"b": 1, "a": {"y": [1, 2], "x": null}}"#, r#"{"a":{"x":null,"y":[1,2]},"b":1}"#),
            (r#""\u00e9""#, r#""é""#),
            (r#"{"\u00e9": 1}"#, r#"{"é": 1}"#),
            ("0.1", "0.10"),
            ("0.1", "1e-1"),
            ("0.1", "0.0100E1"),
            ("100.0", "1e2"),
            ("-0", "0"),
            ("0.0", "-0.0e5"),
            ("18446744073709551615", "18446744073709551615"),
            (r#"{"a": 1, "a": 2}"#, r#"{"a": 2}"#),
        ];
        for (a, b) in same {
            assert_eq!(canon(a), canon(b), "{a} vs {b}");
        }
        let different = [
            ("1", "1.0"),
            ("100", "1e2"),
            ("0.42451918914251396", "0.4245191891425139"),
            ("123456789012345678901234567890", "123456789012345678901234567891"),
            ("18446744073709551616", "18446744073709551616.0"),
            ("[1, 2]", "[2, 1]"),
            (r#""1""#, "1"),
            ("1e400", "1e401"),
        ];
        for (a, b) in different {
            assert_ne!(canon(a), canon(b), "{a} vs {b}");
        }
        assert_ne!(canonical_body("t", &raw("1")).unwrap(), canonical_body("u", &raw("1")).unwrap());
        assert!(canonical_body("t", &raw(r#""\ud83d""#)).is_err());
    }

    /// The recursive walk of the version that introduced the `v2` form: states it stored carry
    /// hashes of its output, so the one-pass walk must write exactly the same.
    fn recursive_walk(raw: &str, out: &mut String) {
        match raw.as_bytes().first() {
            Some(b'{') => {
                let m: BTreeMap<String, &RawValue> = serde_json::from_str(raw).unwrap();
                out.push('{');
                for (i, (k, v)) in m.iter().enumerate() {
                    if i > 0 {
                        out.push(',');
                    }
                    out.push_str(&serde_json::to_string(k).unwrap());
                    out.push(':');
                    recursive_walk(v.get(), out);
                }
                out.push('}');
            }
            Some(b'[') => {
                let a: Vec<&RawValue> = serde_json::from_str(raw).unwrap();
                out.push('[');
                for (i, v) in a.iter().enumerate() {
                    if i > 0 {
                        out.push(',');
                    }
                    recursive_walk(v.get(), out);
                }
                out.push(']');
            }
            Some(b'"') => {
                let s: String = serde_json::from_str(raw).unwrap();
                out.push_str(&serde_json::to_string(&s).unwrap());
            }
            Some(b'-' | b'0'..=b'9') => canonical_number(raw, out),
            _ => out.push_str(raw),
        }
    }

    #[test]
    fn one_pass_writes_what_the_recursive_walk_wrote() {
        let corpus = [
            "null",
            "true",
            " false ",
            "-0",
            "1E+2",
            "0.100e-0003",
            r#""a\"b\\\u00e9\n/\ud83d\ude00""#,
            "[]",
            "{}",
            "[ [ ], { }, [[]], {\"a\":{}} ]",
            r#"{"b": 1, "a": {"y": [1, 2.50, -3e3], "x": null}, "a": [true, false, null, "z"]}"#,
            r#"[ {"d" : [1 , {"d":1,"c":{"\u00e9":"é","e":[]}}], "c":"x"} , 2, "3", [4.0, [5e0]] ]"#,
            r#"{"k\"ey": {"": ["", {"": ""}]}, "": 0}"#,
            "\t[\r\n1 ,\t2\n]\n",
        ];
        for text in corpus {
            let mut expected = String::new();
            recursive_walk(raw(text).get(), &mut expected);
            let mut got = String::new();
            canonical(raw(text).get(), &mut got).unwrap();
            assert_eq!(got, expected, "{text}");
        }
    }

    /// Params nested as deep as a `Value` decodes are canonical; deeper ones are refused, never
    /// walked level by level (that overflowed the stack at some thousands of levels, killing
    /// the process, and took time quadratic in the depth).
    #[test]
    fn nesting_is_bounded_like_serde_json() {
        let nested = |depth: usize, open: &str, leaf: &str, close: &str| {
            format!("{}{leaf}{}", open.repeat(depth), close.repeat(depth))
        };
        for depth in [MAX_PARAMS_NESTING - 1, MAX_PARAMS_NESTING, MAX_PARAMS_NESTING + 1, 10_000, 500_000] {
            for (open, close) in [("[", "]"), (r#"{"k":"#, "}"), (r#"[{"k":"#, "}]")] {
                let text = nested(depth, open, "1", close);
                let params = raw(&text);
                let decodes = params.parse::<Value>().is_ok();
                let levels = depth * if open.len() == 6 { 2 } else { 1 };
                assert_eq!(decodes, levels <= MAX_PARAMS_NESTING, "{levels} levels");
                // On a thread with a small stack, as a server's worker has.
                let r = std::thread::Builder::new()
                    .stack_size(256 << 10)
                    .spawn(move || canonical_body("t", &params).map_err(|e| e.to_string()))
                    .unwrap()
                    .join()
                    .unwrap();
                match r {
                    Ok(_) => assert!(decodes, "{levels} levels"),
                    Err(e) => {
                        assert!(!decodes, "{levels} levels: {e}");
                        assert!(e.contains("nested more than 127 deep"), "{e}");
                    }
                }
            }
        }
        // Scalars at the deepest level still count as that level's values.
        assert!(canonical_body("t", &raw(&nested(MAX_PARAMS_NESTING, "[", r#""\u00e9""#, "]"))).is_ok());
    }

    #[test]
    fn legacy_body_is_the_old_format() {
        assert_eq!(
            legacy_canonical_body("t", &raw(r#"{"b": 1.50, "a": "\u00e9"}"#)).unwrap(),
            "\"t\"\n{\"a\":\"é\",\"b\":1.5}"
        );
        assert_eq!(legacy_canonical_body("t", &raw("1e400")), None);
    }
}
