//! Text output: aligned tables and `key: value` blocks; JSON output for `--json`.

use serde::de::{Deserialize, Deserializer, MapAccess, SeqAccess, Visitor};
use serde_json::value::RawValue;
use serde_json::Value;

/// Prints `v` as pretty JSON on stdout.
pub fn print_json(v: &Value) {
    println!("{}", serde_json::to_string_pretty(v).unwrap_or_else(|_| v.to_string()));
}

/// Prints the JSON text `text` pretty on stdout, every key, string and number exactly as
/// written and objects in their order (a `Value` would round numbers, sort keys and re-escape
/// strings); text that is not JSON is printed as is.
pub fn print_json_exact(text: &str) {
    println!("{}", pretty_exact(text).unwrap_or_else(|| text.trim().to_string()));
}

/// The JSON text `text` indented like `serde_json::to_string_pretty` (two spaces, `"key": value`),
/// with keys, strings, numbers and key order exactly as written; arrays and objects more than
/// [`PRETTY_DEPTH`] deep are written as they are (on one line, as given). `None` when it is not
/// JSON.
pub fn pretty_exact(text: &str) -> Option<String> {
    let raw: &RawValue = serde_json::from_str(text).ok()?;
    let mut out = String::new();
    write_pretty(raw, 0, 0, &mut out).ok()?;
    Some(out)
}

/// An object's entries (keys and values as their text, in order) or an array's elements.
enum Container<'a> {
    Object(Vec<(&'a RawValue, &'a RawValue)>),
    Array(Vec<&'a RawValue>),
}

impl<'de: 'a, 'a> Deserialize<'de> for Container<'a> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = Container<'de>;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("an object or an array")
            }
            fn visit_map<A: MapAccess<'de>>(self, mut m: A) -> Result<Container<'de>, A::Error> {
                let mut out = Vec::new();
                while let Some(k) = m.next_key::<&RawValue>()? {
                    out.push((k, m.next_value::<&RawValue>()?));
                }
                Ok(Container::Object(out))
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut s: A) -> Result<Container<'de>, A::Error> {
                let mut out = Vec::new();
                while let Some(v) = s.next_element::<&RawValue>()? {
                    out.push(v);
                }
                Ok(Container::Array(out))
            }
        }
        d.deserialize_any(V)
    }
}

/// How deep [`pretty_exact`] indents. A raw value keeps any depth (serde_json skips over one
/// without its recursion limit), and each level here is a call: a stream message nested 500,000
/// deep overflowed the CLI's stack.
pub const PRETTY_DEPTH: usize = 128;

fn write_pretty(raw: &RawValue, depth: usize, indent: usize, out: &mut String) -> serde_json::Result<()> {
    let text = raw.get();
    if !matches!(text.as_bytes().first(), Some(b'{' | b'[')) || depth >= PRETTY_DEPTH {
        out.push_str(text);
        return Ok(());
    }
    let pad = |out: &mut String, n: usize| out.extend(std::iter::repeat_n(' ', n));
    match serde_json::from_str::<Container>(text)? {
        Container::Object(entries) if entries.is_empty() => out.push_str("{}"),
        Container::Array(items) if items.is_empty() => out.push_str("[]"),
        Container::Object(entries) => {
            out.push_str("{\n");
            for (i, (k, v)) in entries.iter().enumerate() {
                pad(out, indent + 2);
                out.push_str(k.get());
                out.push_str(": ");
                write_pretty(v, depth + 1, indent + 2, out)?;
                out.push_str(if i + 1 < entries.len() { ",\n" } else { "\n" });
            }
            pad(out, indent);
            out.push('}');
        }
        Container::Array(items) => {
            out.push_str("[\n");
            for (i, v) in items.iter().enumerate() {
                pad(out, indent + 2);
                write_pretty(v, depth + 1, indent + 2, out)?;
                out.push_str(if i + 1 < items.len() { ",\n" } else { "\n" });
            }
            pad(out, indent);
            out.push(']');
        }
    }
    Ok(())
}

/// The text of field `key` of the JSON object `text` (`None`: not an object, or no such key).
pub fn raw_field<'a>(text: &'a str, key: &str) -> Option<&'a str> {
    let m: std::collections::BTreeMap<String, &RawValue> = serde_json::from_str(text).ok()?;
    m.get(key).map(|r| r.get())
}

/// A table with a header row; columns are left-aligned and separated by two spaces, except
/// those listed in `right` (numbers), which are right-aligned.
pub struct Table {
    header: Vec<String>,
    rows: Vec<Vec<String>>,
    right: Vec<usize>,
}

impl Table {
    pub fn new(header: &[&str]) -> Self {
        Table { header: header.iter().map(|s| s.to_string()).collect(), rows: Vec::new(), right: Vec::new() }
    }

    /// Right-aligns these columns.
    pub fn right(mut self, cols: &[usize]) -> Self {
        self.right = cols.to_vec();
        self
    }

    pub fn row(&mut self, cells: Vec<String>) {
        self.rows.push(cells);
    }

    pub fn render(&self) -> String {
        let n = self.header.len();
        let mut width = vec![0usize; n];
        for r in std::iter::once(&self.header).chain(&self.rows) {
            for (i, c) in r.iter().enumerate().take(n) {
                width[i] = width[i].max(c.chars().count());
            }
        }
        let mut out = String::new();
        for r in std::iter::once(&self.header).chain(&self.rows) {
            let mut line = String::new();
            for (i, c) in r.iter().enumerate().take(n) {
                let pad = width[i] - c.chars().count();
                if i > 0 {
                    line.push_str("  ");
                }
                if self.right.contains(&i) {
                    line.push_str(&" ".repeat(pad));
                    line.push_str(c);
                } else {
                    line.push_str(c);
                    if i + 1 < n {
                        line.push_str(&" ".repeat(pad));
                    }
                }
            }
            out.push_str(line.trim_end());
            out.push('\n');
        }
        out
    }

    pub fn print(&self) {
        print!("{}", self.render());
    }
}

/// A JSON value as one short cell: strings bare, null as `-`, others compact JSON.
pub fn cell(v: Option<&Value>) -> String {
    match v {
        None | Some(Value::Null) => "-".to_string(),
        Some(Value::String(s)) => s.clone(),
        Some(other) => other.to_string(),
    }
}

/// Whether to colour output written to a stream: only a terminal (`is_terminal`), and not when
/// `NO_COLOR` is set to a non-empty value (<https://no-color.org>). The log lines of `baton serve`
/// and `baton worker` (on stderr) follow it, so logs written to a file or a pipe carry no escape
/// codes.
pub fn colour(is_terminal: bool) -> bool {
    is_terminal && std::env::var_os("NO_COLOR").is_none_or(|v| v.is_empty())
}

/// A count and its noun, singular for exactly one: `count("1", "consumer", "consumers")` is
/// `1 consumer`, `count("2", …)` `2 consumers` (`n` as printed, e.g. a [`cell`]).
pub fn count(n: &str, one: &str, many: &str) -> String {
    format!("{n} {}", if n == "1" { one } else { many })
}

/// Shortens `s` to `max` characters with a trailing `…`.
pub fn clip(s: &str, max: usize) -> String {
    if s.chars().count() <= max {
        s.to_string()
    } else {
        let mut t: String = s.chars().take(max.saturating_sub(1)).collect();
        t.push('…');
        t
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tables_align() {
        let mut t = Table::new(&["NAME", "N"]).right(&[1]);
        t.row(vec!["a".into(), "10".into()]);
        t.row(vec!["long".into(), "2".into()]);
        assert_eq!(t.render(), "NAME   N\na     10\nlong   2\n");
        assert_eq!(clip("abcdef", 4), "abc…");
        assert_eq!(count("1", "consumer", "consumers"), "1 consumer");
        assert_eq!(count("0", "consumer", "consumers"), "0 consumers");
        assert_eq!(count("21", "CPU", "CPUs"), "21 CPUs");
    }

    #[test]
    fn exact_pretty_json() {
        let v = serde_json::json!({"a": [1, {"b": null}], "c": {}, "d": [], "e": "x"});
        assert_eq!(pretty_exact(&v.to_string()).unwrap(), serde_json::to_string_pretty(&v).unwrap());
        let text = r#"{"z": 0.42451918914251396, "\u00e9": ["\ud83d\ude00", 18446744073709551615]}"#;
        assert_eq!(
            pretty_exact(text).unwrap(),
            "{\n  \"z\": 0.42451918914251396,\n  \"\\u00e9\": [\n    \"\\ud83d\\ude00\",\n    18446744073709551615\n  ]\n}"
        );
        assert_eq!(pretty_exact("{"), None);
        // Beyond PRETTY_DEPTH, as written: no call per level (50,000 levels overflowed).
        let deep = format!("{}{}", "[".repeat(50_000), "]".repeat(50_000));
        let pretty = std::thread::Builder::new()
            .stack_size(1 << 20)
            .spawn(move || pretty_exact(&deep).unwrap())
            .unwrap()
            .join()
            .unwrap();
        let inner = format!("{}{}", "[".repeat(50_000 - PRETTY_DEPTH), "]".repeat(50_000 - PRETTY_DEPTH));
        assert!(pretty.contains(&format!("{}{inner}\n", " ".repeat(2 * PRETTY_DEPTH))));
        assert_eq!(pretty.matches('\n').count(), 2 * PRETTY_DEPTH);
        assert_eq!(raw_field(r#"{"params": {"b": 1.50, "a": 2}}"#, "params"), Some(r#"{"b": 1.50, "a": 2}"#));
    }
}
