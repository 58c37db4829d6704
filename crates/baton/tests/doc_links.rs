//! Every relative link in README.md, docs/*.md and the examples' READMEs points at a file that
//! exists, and every `#anchor` at a heading of that file (GitHub's anchor rules). Links to
//! `http(s)://` and `mailto:` are not checked (no network in tests).

use std::collections::HashSet;
use std::path::{Path, PathBuf};

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..").canonicalize().unwrap()
}

/// The Markdown files checked: README.md, docs/*.md, examples/*/README.md.
fn markdown_files() -> Vec<PathBuf> {
    let root = root();
    let mut files = vec![root.join("README.md")];
    let mut docs: Vec<PathBuf> = std::fs::read_dir(root.join("docs"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|x| x == "md"))
        .collect();
    docs.sort();
    files.extend(docs);
    for e in std::fs::read_dir(root.join("examples")).unwrap() {
        let readme = e.unwrap().path().join("README.md");
        if readme.exists() {
            files.push(readme);
        }
    }
    files
}

/// The text outside fenced code blocks and inline code spans (links there are not links).
fn prose(text: &str) -> String {
    let mut out = String::new();
    let mut fenced = false;
    for line in text.lines() {
        if line.trim_start().starts_with("```") {
            fenced = !fenced;
            out.push('\n');
            continue;
        }
        if fenced {
            out.push('\n');
            continue;
        }
        let mut in_code = false;
        for c in line.chars() {
            if c == '`' {
                in_code = !in_code;
            } else if !in_code {
                out.push(c);
            }
        }
        out.push('\n');
    }
    out
}

/// The targets of inline links `[text](target)` (an optional `"title"` dropped).
fn links(text: &str) -> Vec<String> {
    let text = prose(text);
    let mut out = Vec::new();
    let mut rest = text.as_str();
    while let Some(i) = rest.find("](") {
        rest = &rest[i + 2..];
        let Some(end) = rest.find(')') else { break };
        let target = rest[..end].split_whitespace().next().unwrap_or("").trim_matches(['<', '>']);
        if !target.is_empty() {
            out.push(target.to_string());
        }
        rest = &rest[end..];
    }
    out
}

/// GitHub's anchor of a heading: lower case, letters, digits, `-` and `_` kept, spaces to `-`,
/// everything else dropped; a repeated anchor gets `-1`, `-2`, ….
fn anchors(markdown: &str) -> HashSet<String> {
    let mut seen = HashSet::new();
    let mut fenced = false;
    for line in markdown.lines() {
        if line.trim_start().starts_with("```") {
            fenced = !fenced;
        }
        if fenced || !line.starts_with('#') {
            continue;
        }
        let heading = line.trim_start_matches('#').trim();
        let mut slug = String::new();
        for c in heading.chars() {
            if c.is_alphanumeric() || c == '-' || c == '_' {
                slug.extend(c.to_lowercase());
            } else if c == ' ' {
                slug.push('-');
            }
        }
        let mut candidate = slug.clone();
        let mut n = 0;
        while seen.contains(&candidate) {
            n += 1;
            candidate = format!("{slug}-{n}");
        }
        seen.insert(candidate);
    }
    seen
}

/// The broken relative links of `file` (`file: link (why)`).
fn broken_links(file: &Path) -> Vec<String> {
    let text = std::fs::read_to_string(file).unwrap();
    let mut broken = Vec::new();
    for link in links(&text) {
        if link.starts_with("http://") || link.starts_with("https://") || link.starts_with("mailto:") {
            continue;
        }
        let (path, anchor) = match link.split_once('#') {
            Some((p, a)) => (p, Some(a)),
            None => (link.as_str(), None),
        };
        let target = if path.is_empty() { file.to_path_buf() } else { file.parent().unwrap().join(path) };
        let shown = file.strip_prefix(root()).unwrap_or(file).display().to_string();
        if !target.exists() {
            broken.push(format!("{shown}: {link} (no such file)"));
            continue;
        }
        if let Some(a) = anchor {
            if target.extension().is_some_and(|x| x == "md") {
                let target_text = std::fs::read_to_string(&target).unwrap();
                if !anchors(&target_text).contains(a) {
                    broken.push(format!("{shown}: {link} (no heading with anchor #{a})"));
                }
            }
        }
    }
    broken
}

#[test]
fn relative_links_in_the_docs_resolve() {
    let broken: Vec<String> = markdown_files().iter().flat_map(|f| broken_links(f)).collect();
    assert!(broken.is_empty(), "broken links:\n{}", broken.join("\n"));
}

#[test]
fn the_checker_finds_broken_links_and_anchors() {
    let dir = std::env::temp_dir().join(format!("baton-doc-links-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(dir.join("other.md"), "# Other\n## Health and metrics\n## Health and metrics\n").unwrap();
    let doc = dir.join("doc.md");
    std::fs::write(
        &doc,
        "# Doc\n[a](other.md) [b](other.md#health-and-metrics) [c](other.md#health-and-metrics-1)\n\
         [d](missing.md) [e](other.md#metrics) [f](#doc) [g](#nope) [h](https://example.com/x)\n\
         `[i](in-code.md)`\n```\n[j](in-a-block.md)\n```\n",
    )
    .unwrap();
    let broken = broken_links(&doc);
    assert_eq!(broken.len(), 3, "{broken:?}");
    assert!(broken[0].ends_with("missing.md (no such file)"), "{broken:?}");
    assert!(broken[1].ends_with("other.md#metrics (no heading with anchor #metrics)"), "{broken:?}");
    assert!(broken[2].ends_with("#nope (no heading with anchor #nope)"), "{broken:?}");
    let _ = std::fs::remove_dir_all(&dir);
}
