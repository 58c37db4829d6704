//! `crates/baton/src` imports in one direction. The crate's modules are layers ([`CRATE`]): a
//! module may use (`crate::<module>`) only itself and the modules listed before it. Inside a
//! module made of files (`src/<module>/`), the same holds for its files ([`INSIDE`]): a file may
//! use (`super::<file>`, `crate::<module>::<file>`) only the files listed before it, and never
//! the items of `mod.rs` (the top of its module); `super::super` is refused everywhere.
//!
//! The sources are read as text: comments, string and character literals are skipped; a file's
//! `#[cfg(test)]` module at its end is not checked (tests may reach anything).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

/// The crate's layers, bottom first (the table of lib.rs's docs).
const CRATE: &[&str] = &["shutdown", "settings", "telemetry", "auth", "webhooks", "workers", "http", "server", "cli"];

/// The files of each module made of files, bottom first (`mod.rs` is above them all).
const INSIDE: &[(&str, &[&str])] = &[
    ("settings", &["values", "redis", "tokens", "queues"]),
    (
        "http",
        &[
            "json",
            "names",
            "errors",
            "headers",
            "state",
            "plumbing",
            "openapi",
            "edge",
            "sse",
            "streams",
            "subscriptions",
            "commands",
            "remote",
            "queues",
            "feed",
            "dashboard",
            "ops",
            "access",
            "routes",
        ],
    ),
    ("server", &["listen"]),
    ("cli", &["exit", "output", "args", "client", "streams", "commands", "queues", "subscriptions", "bench"]),
];

fn src() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("src")
}

/// The source with comments, string contents and character literals blanked out (lengths and
/// line breaks kept), cut at a trailing `#[cfg(test)]` module.
fn code_of(text: &str) -> String {
    let b: Vec<char> = text.chars().collect();
    let mut out = String::with_capacity(text.len());
    let mut i = 0;
    let blank = |out: &mut String, c: char| out.push(if c == '\n' { '\n' } else { ' ' });
    while i < b.len() {
        let c = b[i];
        let next = b.get(i + 1).copied();
        if c == '/' && next == Some('/') {
            while i < b.len() && b[i] != '\n' {
                blank(&mut out, b[i]);
                i += 1;
            }
        } else if c == '/' && next == Some('*') {
            let mut depth = 0;
            while i < b.len() {
                if b[i] == '/' && b.get(i + 1) == Some(&'*') {
                    depth += 1;
                    out.push_str("  ");
                    i += 2;
                } else if b[i] == '*' && b.get(i + 1) == Some(&'/') {
                    depth -= 1;
                    out.push_str("  ");
                    i += 2;
                    if depth == 0 {
                        break;
                    }
                } else {
                    blank(&mut out, b[i]);
                    i += 1;
                }
            }
        } else if c == 'r' && (next == Some('"') || (next == Some('#') && !b[i.saturating_sub(1)].is_alphanumeric())) {
            // A raw string: r"…", r#"…"#, …
            let mut j = i + 1;
            let mut hashes = 0;
            while b.get(j) == Some(&'#') {
                hashes += 1;
                j += 1;
            }
            if b.get(j) != Some(&'"') {
                out.push(c);
                i += 1;
                continue;
            }
            let close: String = std::iter::once('"').chain(std::iter::repeat_n('#', hashes)).collect();
            let rest: String = b[j + 1..].iter().collect();
            let len = rest.find(&close).map_or(rest.chars().count(), |at| rest[..at].chars().count()) + close.len();
            for &ch in &b[i..(j + 1 + len).min(b.len())] {
                blank(&mut out, ch);
            }
            i = j + 1 + len;
        } else if c == '"' {
            blank(&mut out, c);
            i += 1;
            while i < b.len() && b[i] != '"' {
                if b[i] == '\\' {
                    blank(&mut out, b[i]);
                    i += 1;
                }
                if i < b.len() {
                    blank(&mut out, b[i]);
                    i += 1;
                }
            }
            if i < b.len() {
                blank(&mut out, b[i]);
                i += 1;
            }
        } else if c == '\'' {
            // A character literal ('x', '\n', '\u{..}'), or a lifetime ('a).
            let end = if next == Some('\\') {
                (i + 3..b.len()).find(|k| b[*k] == '\'')
            } else if b.get(i + 2) == Some(&'\'') {
                Some(i + 2)
            } else {
                None
            };
            match end {
                Some(e) => {
                    for &ch in &b[i..=e] {
                        blank(&mut out, ch);
                    }
                    i = e + 1;
                }
                None => {
                    out.push(c);
                    i += 1;
                }
            }
        } else {
            out.push(c);
            i += 1;
        }
    }
    match out.rfind("#[cfg(test)]") {
        Some(at) if out[at..].trim_start_matches("#[cfg(test)]").trim_start().starts_with("mod ") => {
            out[..at].to_string()
        }
        _ => out,
    }
}

/// The first path segments after each `prefix` (`prefix{a, b::c}` gives `a` and `b`), with the
/// line they are on.
fn uses_after(code: &str, prefix: &str) -> Vec<(String, usize)> {
    let ident = |s: &str| -> String { s.chars().take_while(|c| c.is_alphanumeric() || *c == '_').collect() };
    let mut out = Vec::new();
    let mut from = 0;
    while let Some(at) = code[from..].find(prefix) {
        let start = from + at;
        from = start + prefix.len();
        let before = code[..start].chars().last();
        if before.is_some_and(|c| c.is_alphanumeric() || c == '_' || c == ':') {
            continue;
        }
        let line = code[..start].matches('\n').count() + 1;
        let rest = &code[from..];
        if let Some(group) = rest.strip_prefix('{') {
            // Top-level items of the group.
            let mut depth = 0;
            let mut item_start = true;
            for (k, c) in group.char_indices() {
                match c {
                    '{' => depth += 1,
                    '}' if depth == 0 => break,
                    '}' => depth -= 1,
                    ',' if depth == 0 => item_start = true,
                    c if item_start && !c.is_whitespace() => {
                        item_start = false;
                        let name = ident(&group[k..]);
                        if !name.is_empty() {
                            out.push((name, line));
                        }
                    }
                    _ => {}
                }
            }
        } else {
            let name = ident(rest);
            if !name.is_empty() {
                out.push((name, line));
            }
        }
    }
    out
}

/// Every `.rs` file under `dir`.
fn files(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    for e in std::fs::read_dir(dir).unwrap() {
        let p = e.unwrap().path();
        if p.is_dir() {
            out.extend(files(&p));
        } else if p.extension().is_some_and(|x| x == "rs") {
            out.push(p);
        }
    }
    out.sort();
    out
}

fn position(list: &[&str], name: &str) -> Option<usize> {
    list.iter().position(|m| *m == name)
}

/// The violations of the rules (module docs) in the crate's sources.
fn violations() -> Vec<String> {
    let root = src();
    let inside: BTreeMap<&str, &[&str]> = INSIDE.iter().copied().collect();
    let mut bad = Vec::new();
    for path in files(&root) {
        let rel = path.strip_prefix(&root).unwrap().to_string_lossy().replace('\\', "/");
        if rel == "lib.rs" || rel == "main.rs" {
            continue;
        }
        let parts: Vec<&str> = rel.trim_end_matches(".rs").split('/').collect();
        let top = parts[0];
        let Some(layer) = position(CRATE, top) else {
            bad.push(format!("{rel}: module {top} is not in the layer list"));
            continue;
        };
        let code = code_of(&std::fs::read_to_string(&path).unwrap());
        for (name, line) in uses_after(&code, "crate::") {
            match position(CRATE, &name) {
                Some(l) if l > layer => bad.push(format!("{rel}:{line}: {top} uses crate::{name}, a layer above it")),
                Some(_) => {}
                None => bad.push(format!("{rel}:{line}: crate::{name} is not a module of the layer list")),
            }
        }
        if let Some((line, _)) = code.lines().enumerate().find(|(_, l)| l.contains("super::super")) {
            bad.push(format!("{rel}:{}: super::super", line + 1));
        }
        // A file inside a module made of files.
        if parts.len() == 2 && parts[1] != "mod" {
            let file = parts[1];
            let Some(order) = inside.get(top) else {
                bad.push(format!("{rel}: module {top} has files but no order in INSIDE"));
                continue;
            };
            let Some(me) = position(order, file) else {
                bad.push(format!("{rel}: file {file} is not in the order of {top}"));
                continue;
            };
            let mut used = uses_after(&code, "super::");
            used.extend(uses_after(&code, &format!("crate::{top}::")));
            for (name, line) in used {
                match position(order, &name) {
                    Some(k) if k < me => {}
                    Some(_) => bad.push(format!("{rel}:{line}: {top}/{file} uses {name}, listed after it")),
                    None => bad.push(format!("{rel}:{line}: {top}/{file} uses {name} of {top}/mod.rs (its top)")),
                }
            }
        } else if parts.len() > 2 {
            bad.push(format!("{rel}: nested deeper than one directory; give it an order"));
        }
    }
    bad
}

#[test]
fn modules_import_only_layers_below_them() {
    let bad = violations();
    assert!(bad.is_empty(), "imports against the layers:\n{}", bad.join("\n"));
}

/// The layer list is the crate's module list (lib.rs); each module made of files has every
/// file in its order.
#[test]
fn the_lists_cover_every_module_and_file() {
    let lib = code_of(&std::fs::read_to_string(src().join("lib.rs")).unwrap());
    let mut declared: Vec<&str> = lib
        .lines()
        .filter_map(|l| l.trim().strip_prefix("pub mod ").or(l.trim().strip_prefix("mod ")))
        .map(|m| m.trim_end_matches(';').trim())
        .collect();
    declared.sort();
    let mut layers = CRATE.to_vec();
    layers.sort();
    assert_eq!(declared, layers, "the modules of lib.rs");
    for (module, order) in INSIDE {
        let mut on_disk: Vec<String> = std::fs::read_dir(src().join(module))
            .unwrap()
            .map(|e| e.unwrap().path().file_stem().unwrap().to_string_lossy().into_owned())
            .filter(|f| f != "mod")
            .collect();
        on_disk.sort();
        let mut listed: Vec<String> = order.iter().map(|s| s.to_string()).collect();
        listed.sort();
        assert_eq!(on_disk, listed, "the files of src/{module}");
    }
}

/// The checker sees what it must (so the tests above can fail).
#[test]
fn the_checker_finds_upward_uses() {
    let code = code_of(
        "use crate::http::x; // crate::cli in a comment\nlet s = \"crate::cli\"; let c = '\"'; fn f<'a>() {}\n\
         use super::{state::AppState, errors};\nuse crate::{auth, cli::X};\n#[cfg(test)]\nmod tests { use crate::cli; }\n",
    );
    let names = |p: &str| uses_after(&code, p).into_iter().map(|(n, _)| n).collect::<Vec<_>>();
    assert_eq!(names("crate::"), ["http", "auth", "cli"]);
    assert_eq!(names("super::"), ["state", "errors"]);
    assert!(!code.contains("mod tests"));
}
