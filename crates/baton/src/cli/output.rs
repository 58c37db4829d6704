//! Text output: aligned tables and `key: value` blocks; JSON output for `--json`.

use serde_json::Value;

/// Prints `v` as pretty JSON on stdout.
pub fn print_json(v: &Value) {
    println!("{}", serde_json::to_string_pretty(v).unwrap_or_else(|_| v.to_string()));
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
    }
}
