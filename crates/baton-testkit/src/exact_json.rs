//! JSON texts that a lossy JSON round trip would change: for tests that params and results come
//! back byte for byte.

/// A JSON object text that a trip through `serde_json::Value` (or any `f64` reading) would
/// change, and two variants of it.
pub struct ExactSample {
    /// The object: `n` floats of 17 significant digits (plain and exponent forms, both signs),
    /// integers beyond 2^53 and beyond 64 bits, `\u` escapes (a surrogate pair among them), keys
    /// out of order, `0.10`, whitespace inside.
    pub text: String,
    /// The same JSON meaning written differently: keys reordered, no whitespace, escapes
    /// decoded, `0.1` for `0.10`, `1e-1`-style exponents for some floats.
    pub same_meaning: String,
    /// `text` with the last digit of one float changed (another value; as an `f64` often the
    /// same).
    pub different: String,
}

/// `n` floats (as JSON number texts) of 17 significant digits, from `seed` (splitmix64).
pub fn floats(n: usize, seed: u64) -> Vec<String> {
    let mut state = seed;
    let mut next = move || {
        state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = state;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    };
    (0..n)
        .map(|i| {
            let r = next();
            let lead = 1 + r % 9;
            let rest = next() % 10_000_000_000_000_000;
            let sign = if r & (1 << 40) != 0 { "-" } else { "" };
            match i % 3 {
                // 0.ddddddddddddddddd
                0 => format!("{sign}0.{lead}{rest:016}"),
                // d.dddddddddddddddde±x
                1 => format!("{sign}{lead}.{rest:016}e{}", (r >> 8) % 61),
                _ => format!("{sign}{lead}.{rest:016}e-{}", 1 + (r >> 8) % 60),
            }
        })
        .collect()
}

/// The sample of [`ExactSample`] with `n` floats from `seed`.
pub fn sample(n: usize, seed: u64) -> ExactSample {
    let fs = floats(n, seed);
    let big = "18446744073709551615, -9223372036854775809, 9007199254740993, 123456789012345678901234567890";
    let text = format!(
        "{{\"z\": {{\"b\": 2, \"a\": 1}}, \"floats\": [{}], \"big\": [{big}], \"text\": \"\\u00e9 \\ud83d\\ude00 \\\"q\\\"\", \"tenth\": 0.10, \"\\u00e9\": true}}",
        fs.join(", ")
    );
    // Same meaning: keys sorted, compact, escapes decoded, exponents moved.
    let moved: Vec<String> = fs
        .iter()
        .map(|f| match f.split_once('e') {
            // d.ddd…e-x → 0.dddd…e-(x-1)
            Some((m, e)) if m.trim_start_matches('-').len() == 18 => {
                let (sign, m) = if let Some(m) = m.strip_prefix('-') { ("-", m) } else { ("", m) };
                let digits = m.replace('.', "");
                let e: i64 = e.parse().expect("exponent");
                format!("{sign}0.{digits}E{:+}", e + 1)
            }
            _ => format!("{f}0"),
        })
        .collect();
    let big_compact = big.replace(' ', "");
    let same_meaning = format!(
        "{{\"big\":[{big_compact}],\"floats\":[{}],\"tenth\":0.1,\"text\":\"é 😀 \\\"q\\\"\",\"z\":{{\"a\":1,\"b\":2}},\"é\":true}}",
        moved.join(",")
    );
    let mut changed = fs.clone();
    let last = changed.len() / 2;
    let f = &mut changed[last];
    let pos = f.find('e').unwrap_or(f.len()) - 1;
    let d = f.as_bytes()[pos];
    let nd = if d == b'9' { '8' } else { (d + 1) as char };
    f.replace_range(pos..pos + 1, &nd.to_string());
    let different = text.replace(&fs.join(", "), &changed.join(", "));
    ExactSample { text, same_meaning, different }
}
