//! The analysis on logs this test writes: grouping, counts, order, first occurrence, bursts, and
//! the caps that bound memory (line length, signature table).

mod common;

use std::io::{BufReader, Cursor};

use incident_triage::analysis::{read_line_capped, Analyzer, Limits, Severity};

fn analyze(path: &std::path::Path, limits: Limits) -> Analyzer {
    let mut r = BufReader::new(std::fs::File::open(path).unwrap());
    let mut a = Analyzer::new(limits);
    let mut line = Vec::new();
    loop {
        let n = read_line_capped(&mut r, &mut line, a.limits().max_line_len).unwrap();
        if n == 0 {
            break a;
        }
        a.feed(&line, n);
    }
}

#[test]
fn groups_counts_orders_and_finds_the_burst() {
    let dir = common::TempDir::new("analysis");
    let path = dir.path().join("app.log");
    common::write_app_log(&path, 6000);
    let size = std::fs::metadata(&path).unwrap().len();
    let mut a = analyze(&path, Limits::default());
    let t = a.totals();
    assert_eq!(t.lines, 6000);
    assert_eq!(t.bytes, size);
    assert_eq!(t.timestamped_lines, 6000);
    assert_eq!(t.signatures, 4, "four signatures once numbers, ips, uuids and timestamps are masked");
    let f = a.findings(10);
    let sigs: Vec<&str> = f.iter().map(|f| f.signature.as_str()).collect();
    assert_eq!(
        sigs,
        [
            "ERROR db: connection to <ip> refused (attempt <n>)",
            "ERROR payments: upstream timed out after <n>ms (request <uuid>)",
            "ERROR worker-<n>: panic: index out of range [<n>] with length <n>",
            "WARN cache: slow response from node-<n> (<n> ms)",
        ]
    );
    assert!(f.windows(2).take(2).all(|w| w[0].count >= w[1].count), "errors ordered by count");
    assert_eq!(f[3].severity, Severity::Warning);
    assert_eq!(f.iter().map(|f| f.count).sum::<u64>(), t.errors + t.warnings);
    // First occurrence: the line number and timestamp of the first matching line.
    let text = std::fs::read_to_string(&path).unwrap();
    let first_db = text.lines().position(|l| l.contains("ERROR db:")).unwrap() as u64 + 1;
    assert_eq!(f[0].first.line, first_db);
    assert_eq!(f[0].first.at.as_deref(), Some(&text.lines().nth(first_db as usize - 1).unwrap()[..24]));
    // The burst of timeouts (only in lines 3000..3300) is found; steady signatures have none.
    let burst = f[1].burst.as_ref().expect("the timeout burst");
    assert_eq!(burst.window, "1 min");
    assert!(burst.count >= 20 && burst.times_mean >= 4.0, "{burst:?}");
    assert!(f[1].first.line > 3000 && f[1].last.line < 3301);
    assert!(f[0].burst.is_none(), "steady errors are not a burst: {:?}", f[0].burst);
}

#[test]
fn untimestamped_logs_use_line_windows() {
    let mut text = String::new();
    for i in 0..5000 {
        if (2000..2100).contains(&i) {
            text.push_str(&format!("kernel: Out of memory: Killed process {i} (java)\n"));
        } else if i % 50 == 0 {
            text.push_str(&format!("sshd: Failed password for user{} from 192.168.1.{}\n", i % 7, i % 200));
        } else {
            text.push_str("systemd: Started session.\n");
        }
    }
    let mut a = Analyzer::new(Limits::default());
    let mut r = Cursor::new(text.into_bytes());
    let mut line = Vec::new();
    while let Ok(n @ 1..) = read_line_capped(&mut r, &mut line, 1024) {
        a.feed(&line, n);
    }
    let f = a.findings(5);
    assert_eq!(f[0].signature, "kernel: Out of memory: Killed process <n> (java)");
    assert_eq!(f[0].count, 100);
    let b = f[0].burst.as_ref().unwrap();
    assert_eq!((b.window.as_str(), b.start.as_str()), ("1000 lines", "line 2001"));
    assert_eq!(f[1].signature, "sshd: Failed password for user<n> from <ip>");
}

#[test]
fn long_lines_and_many_signatures_stay_bounded() {
    // A 3 MB line without a newline is read through a 4 KiB cap.
    let mut big = vec![b'x'; 3 << 20];
    big.extend_from_slice(b"\nERROR tail\n");
    let mut r = Cursor::new(big);
    let mut line = Vec::new();
    assert_eq!(read_line_capped(&mut r, &mut line, 4096).unwrap(), (3 << 20) + 1);
    assert_eq!(line.len(), 4096);
    assert_eq!(read_line_capped(&mut r, &mut line, 4096).unwrap(), 11);
    assert_eq!(line, b"ERROR tail");
    assert_eq!(read_line_capped(&mut r, &mut line, 4096).unwrap(), 0);
    // The signature table stops at its cap; the rest is counted, not grouped.
    let limits = Limits { max_signatures: 100, ..Limits::default() };
    let mut a = Analyzer::new(limits);
    for i in 0..1000u32 {
        let word: String = i.to_string().bytes().map(|d| (b'a' + d - b'0') as char).collect();
        a.feed(format!("ERROR module {word} failed").as_bytes(), 20);
    }
    let t = a.totals();
    assert_eq!((t.signatures, t.signatures_capped, t.untracked_lines, t.errors), (100, true, 900, 1000));
}
