//! Breaking the production Redis settings through the `baton` binary: edge cases of the
//! `--redis*` flags and TOML keys (each error must say what to fix), and passwords that must
//! never show in errors, logs or `/`.

use crate::common;

use std::process::Command;
use std::time::Duration;

use baton::server::Server;
use baton::settings::{RedisArgs, ServeArgs};
use baton_testkit::RedisServer;
use common::client;

/// `baton serve ARGS --listen 127.0.0.1:0` with extra environment: exit code, stdout + stderr.
fn serve(args: &[&str], env: &[(&str, &str)]) -> (Option<i32>, String) {
    let mut c = Command::new(env!("CARGO_BIN_EXE_baton"));
    c.arg("serve").args(args).args(["--listen", "127.0.0.1:0"]);
    for (k, v) in env {
        c.env(k, v);
    }
    let out = c.output().unwrap();
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    (out.status.code(), text)
}

fn temp_dir(tag: &str) -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!("baton-brk18-{tag}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

#[test]
fn redis_flag_edge_cases_say_what_to_fix() {
    let dead = "redis://127.0.0.1:1";
    let cases: &[(&[&str], &str)] = &[
        (&["--redis-sentinel", dead, "--redis-sentinel-master", ""], "--redis-sentinel-master NAME"),
        (&["--redis-sentinel", dead, "--redis-sentinel-master", "  "], "--redis-sentinel-master NAME"),
        (&["--redis-sentinel", "", "--redis-sentinel-master", "m"], "--redis-sentinel needs at least one URL"),
        (&["--redis", dead, "--redis-wait-replicas", "1", "--redis-wait-timeout", "0"], "from 1ms to 4s; got 0ns"),
        (&["--redis", dead, "--redis-wait-replicas", "1", "--redis-wait-timeout", "5s"], "from 1ms to 4s; got 5s"),
        (&["--redis", dead, "--redis-wait-timeout", "1s"], "--redis-wait-timeout needs --redis-wait-replicas"),
        (&["--redis", "rediss://127.0.0.1:1", "--redis-client-cert", "/c.pem"], "--redis-client-key"),
        (&["--redis", "rediss://127.0.0.1:1", "--redis-client-key", "/k.pem"], "--redis-client-cert"),
        (&["--redis-password-file", "/nonexistent/pw"], "--redis-password-file: cannot read /nonexistent/pw"),
        (
            &["--redis", dead, "--redis-password-file", "/nonexistent/pw"],
            "--redis-password-file: cannot read /nonexistent/pw",
        ),
    ];
    for (args, want) in cases {
        let (code, out) = serve(args, &[]);
        assert_ne!(code, Some(0), "{args:?} started");
        assert!(out.contains(want), "{args:?}: expected {want:?} in:\n{out}");
    }
}

#[test]
fn toml_keys_redis_sentinel_list_and_password_file() {
    let dir = temp_dir("toml");
    let pw = dir.join("pw");
    std::fs::write(&pw, "top-secret-pw\r\n").unwrap();
    let file = dir.join("baton.toml");
    // A list of sentinels without the master's name.
    std::fs::write(&file, "redis_sentinel = [\"redis://127.0.0.1:1\", \"redis://127.0.0.1:2\"]\n").unwrap();
    let (code, out) = serve(&["--config", file.to_str().unwrap()], &[]);
    assert_ne!(code, Some(0));
    assert!(out.contains("--redis-sentinel-master NAME"), "{out}");
    // With it, the sentinels are tried (none runs): the error names them, not the password.
    std::fs::write(
        &file,
        format!(
            "redis_sentinel = [\"redis://127.0.0.1:1\", \"redis://127.0.0.1:2\"]\nredis_sentinel_master = \"m\"\n\
             redis_password_file = \"{}\"\n",
            pw.display()
        ),
    )
    .unwrap();
    let (code, out) = serve(&["--config", file.to_str().unwrap()], &[]);
    assert_ne!(code, Some(0));
    assert!(out.contains("127.0.0.1:1") && out.contains("127.0.0.1:2"), "{out}");
    assert!(!out.contains("top-secret-pw"), "the password is shown:\n{out}");
    std::fs::remove_dir_all(dir).unwrap();
}

/// A wrong password in every place it can be given: the binary's output never shows it.
#[test]
fn wrong_passwords_never_show() {
    let redis = RedisServer::start_with_requirepass(Default::default(), "right-pw-1");
    let port = redis.port();
    let dir = temp_dir("pw");
    let pw = dir.join("pw");
    std::fs::write(&pw, "wrong-pw-file\n").unwrap();
    type Run<'a> = (Vec<String>, Vec<(&'a str, &'a str)>, &'a str);
    let runs: Vec<Run> = vec![
        (vec!["--redis".into(), format!("redis://:wrong/pw-url@127.0.0.1:{port}")], vec![], "wrong/pw-url"),
        (vec!["--redis".into(), format!("redis://:wrong-pw-url2@127.0.0.1:{port}")], vec![], "wrong-pw-url2"),
        (
            vec!["--redis".into(), format!("redis://127.0.0.1:{port}")],
            vec![("BATON_REDIS_PASSWORD", "wrong-pw-env")],
            "wrong-pw-env",
        ),
        (
            vec![
                "--redis".into(),
                format!("redis://127.0.0.1:{port}"),
                "--redis-password-file".into(),
                pw.display().to_string(),
            ],
            vec![],
            "wrong-pw-file",
        ),
        (
            vec![
                "--redis".into(),
                format!("redis://127.0.0.1:{port}"),
                "--redis-password".into(),
                "wrong-pw-flag".into(),
                "--redis-password-file".into(),
                pw.display().to_string(),
            ],
            vec![],
            "wrong-pw-flag",
        ),
    ];
    for (args, env, secret) in runs {
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let (code, out) = serve(&args, &env);
        assert_ne!(code, Some(0), "{args:?} started");
        if secret.contains('/') {
            assert!(out.contains("percent-encode any of / ? # @ % in a password"), "{out}");
        }
        eprintln!("--- {secret}:\n{out}");
        assert!(!out.contains(secret), "the password {secret:?} is shown:\n{out}");
    }
    std::fs::remove_dir_all(dir).unwrap();
}

/// The password in the URL and in a file: `/` and the dashboard's JSON describe the backend
/// without it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn root_page_never_shows_the_password() {
    let redis = RedisServer::start_with_requirepass(Default::default(), "url-pw-right");
    let cfg = ServeArgs {
        redis: RedisArgs {
            redis: Some(format!("redis://:url-pw-right@127.0.0.1:{}", redis.port())),
            ..Default::default()
        },
        listen: Some("127.0.0.1:0".parse().unwrap()),
        ..Default::default()
    }
    .resolve()
    .unwrap();
    let server = match tokio::time::timeout(Duration::from_secs(10), Server::start(cfg)).await {
        Ok(r) => r.unwrap(),
        Err(_) => panic!("start timed out"),
    };
    let base = server.base_url();
    for path in ["/", "/?format=json"] {
        let body = client()
            .get(format!("{base}{path}"))
            .header("accept", "application/json")
            .send()
            .await
            .unwrap()
            .text()
            .await
            .unwrap();
        assert!(!body.contains("url-pw-right"), "{path} shows the password: {body}");
        assert!(!body.contains("pw-right"), "{path} shows the password: {body}");
    }
    server.shutdown().await;
}
