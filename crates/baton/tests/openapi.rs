//! The route table (`baton::http::routes`) against the running server: `/openapi.json`
//! describes exactly its routes (both ways), every route in it is really served (never the
//! fallback, never 405), every route gets the auth its table entry declares, and the error
//! bodies the server sends match the schemas the document gives them.

use crate::common;

use std::collections::BTreeSet;

use baton::http::openapi::{openapi_path, Docs};
use baton::http::routes::{table, Route};
use baton_testkit::TestBackend;
use common::*;
use serde_json::Value;

fn routes() -> Vec<Route> {
    table(&Docs { queues: &[] })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn spec_covers_every_route_and_nothing_else() {
    let srv = start(TestBackend::Memory, |c| c.queues = baton::settings::default_queues()).await;
    let res = client().get(format!("{}/openapi.json", srv.base)).send().await.unwrap();
    assert_eq!(header(&res, "content-type"), Some("application/json"));
    let spec: Value = serde_json::from_str(&res.text().await.unwrap()).unwrap();
    assert_eq!(spec["openapi"], "3.1.0");

    let from_router: BTreeSet<(String, String)> = routes()
        .iter()
        .flat_map(|r| r.methods().into_iter().map(move |m| (openapi_path(r.path), m.to_ascii_lowercase())))
        .collect();
    let mut from_spec = BTreeSet::new();
    for (path, item) in spec["paths"].as_object().unwrap() {
        for (method, op) in item.as_object().unwrap() {
            assert!(op["responses"].as_object().is_some_and(|r| !r.is_empty()), "{method} {path} has no responses");
            from_spec.insert((path.clone(), method.clone()));
        }
    }
    let missing: Vec<_> = from_router.difference(&from_spec).collect();
    let extra: Vec<_> = from_spec.difference(&from_router).collect();
    assert!(missing.is_empty(), "routes missing from /openapi.json: {missing:?}");
    assert!(extra.is_empty(), "/openapi.json documents routes the router lacks: {extra:?}");
    assert!(from_router.len() >= 25, "{}", from_router.len());

    // operationIds are unique, and every link names one.
    let mut ids = BTreeSet::new();
    for item in spec["paths"].as_object().unwrap().values() {
        for op in item.as_object().unwrap().values() {
            assert!(
                ids.insert(op["operationId"].as_str().unwrap().to_string()),
                "duplicate operationId {}",
                op["operationId"]
            );
        }
    }
    let mut links = 0;
    for item in spec["paths"].as_object().unwrap().values() {
        for op in item.as_object().unwrap().values() {
            for resp in op["responses"].as_object().unwrap().values() {
                for l in resp.get("links").and_then(Value::as_object).into_iter().flat_map(|m| m.values()) {
                    assert!(ids.contains(l["operationId"].as_str().unwrap()), "link to unknown {}", l["operationId"]);
                    links += 1;
                }
            }
        }
    }
    assert!(links >= 7, "{links}");
    // The configured queues are the queue parameter's examples.
    let submit = &spec["paths"]["/v1/queues/{queue}/commands"]["post"];
    assert_eq!(submit["parameters"][0]["schema"]["examples"], serde_json::json!(["default"]));

    // Every $ref resolves.
    let text = spec.to_string();
    for part in text.split("\"$ref\":\"#/components/schemas/").skip(1) {
        let name = &part[..part.find('"').unwrap()];
        assert!(spec["components"]["schemas"].get(name).is_some(), "dangling $ref {name}");
    }

    // Each (path, method) of the table is served by the router: not the fallback, not 405.
    for r in routes() {
        let path = r.path.replace("{*path}", "probe/x").replace("{queue}", "default").replace("{id}", "x");
        for m in r.methods() {
            let res = client().request(m.parse().unwrap(), format!("{}{path}", srv.base)).send().await.unwrap();
            let status = res.status();
            if header(&res, "content-type") == Some("text/event-stream") {
                assert_eq!(status.as_u16(), 200, "{m} {path}");
                continue;
            }
            let body = res.text().await.unwrap();
            assert_ne!(status.as_u16(), 405, "{m} {path}: {body}");
            assert!(!body.contains("no_route"), "{m} {path} fell through to the fallback: {body}");
        }
    }
    // And the fallback itself is detectable (so the check above can fail).
    let body = client().get(format!("{}/v1/nothing-here", srv.base)).send().await.unwrap().text().await.unwrap();
    assert!(body.contains("no_route"), "{body}");
    srv.stop().await;
}

const ANY: &str = "anything-secret-0123456789";

/// Every route of the table, every method it serves and one it does not (PATCH), gets on a
/// server with tokens what the table declares (`Route::access`): no token is 401 except on
/// public routes; a valid token with no scope at all is 403 exactly where the route needs a
/// stream or queue operation (or admin), and passes where any token will do.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_route_gets_the_access_the_table_declares() {
    use baton::auth::Access;
    let srv = start(TestBackend::Memory, |c| {
        c.queues = baton::settings::default_queues();
        c.run_workers = false;
        c.tokens =
            vec![baton::settings::TokenConfig::new("nobody", ANY, &["read"], &["none-such"], &["none-such"]).unwrap()];
    })
    .await;
    let mut checked = 0;
    for r in routes() {
        let path = r.path.replace("{*path}", "probe/x").replace("{queue}", "default").replace("{id}", "x");
        let methods: Vec<reqwest::Method> =
            r.methods().iter().map(|m| m.parse().unwrap()).chain([reqwest::Method::PATCH]).collect();
        for m in methods {
            let access = r.access(&m.as_str().parse().unwrap());
            let url = format!("{}{path}", srv.base);
            let res = client().request(m.clone(), &url).send().await.unwrap();
            let anonymous = res.status().as_u16();
            let anonymous_body = res.text().await.unwrap();
            let scoped_out = client().request(m.clone(), &url).bearer_auth(ANY).send().await.unwrap().status().as_u16();
            let what = format!("{m} {} ({access:?}): without a token {anonymous}, out of scope {scoped_out}", r.path);
            match access {
                // The subscription callback routes authenticate with their own token: their
                // handler's 401 is the protocol's `TOKEN_INVALID`, never Baton's `unauthorized`.
                Access::Public if anonymous == 401 => {
                    let v: Value = serde_json::from_str(&anonymous_body).unwrap();
                    assert!(v["error"]["code"] == "TOKEN_INVALID" && scoped_out != 403, "{what}: {v}");
                }
                Access::Public => assert!(anonymous != 401 && anonymous != 403 && scoped_out != 403, "{what}"),
                Access::Token => assert!(anonymous == 401 && scoped_out != 401 && scoped_out != 403, "{what}"),
                Access::Stream(_) | Access::StreamCreate | Access::Queue(_) | Access::Admin => {
                    assert!(anonymous == 401 && scoped_out == 403, "{what}")
                }
            }
            checked += 1;
        }
    }
    assert!(checked >= 35, "{checked}");
    srv.stop().await;
}

/// A schema of /openapi.json, `$ref`s resolved.
fn resolve<'a>(spec: &'a Value, schema: &'a Value) -> &'a Value {
    match schema.get("$ref").and_then(Value::as_str) {
        Some(r) => &spec["components"]["schemas"][r.trim_start_matches("#/components/schemas/")],
        None => schema,
    }
}

/// Where `v` does not match `schema` (types, required keys, no undocumented keys, enums), by
/// JSON pointer; empty when it matches.
fn mismatches(spec: &Value, schema: &Value, v: &Value, at: &str) -> Vec<String> {
    let schema = resolve(spec, schema);
    let mut out = Vec::new();
    let kind = match v {
        Value::Null => "null",
        Value::Bool(_) => "boolean",
        Value::Number(n) if n.is_i64() || n.is_u64() => "integer",
        Value::Number(_) => "number",
        Value::String(_) => "string",
        Value::Array(_) => "array",
        Value::Object(_) => "object",
    };
    let types: Vec<&str> = match &schema["type"] {
        Value::String(t) => vec![t.as_str()],
        Value::Array(ts) => ts.iter().filter_map(Value::as_str).collect(),
        _ => vec![],
    };
    if !types.is_empty() && !types.iter().any(|t| *t == kind || (*t == "number" && kind == "integer")) {
        out.push(format!("{at}: a {kind}, documented {types:?}"));
    }
    if let Some(values) = schema["enum"].as_array() {
        if !values.contains(v) {
            out.push(format!("{at}: {v} is not one of {values:?}"));
        }
    }
    if let Value::Object(m) = v {
        for k in schema["required"].as_array().into_iter().flatten().filter_map(Value::as_str) {
            if !m.contains_key(k) {
                out.push(format!("{at}: required key {k:?} missing"));
            }
        }
        if let Some(props) = schema["properties"].as_object() {
            for (k, field) in m {
                match props.get(k) {
                    Some(s) => out.extend(mismatches(spec, s, field, &format!("{at}/{k}"))),
                    None => out.push(format!("{at}: key {k:?} is not documented")),
                }
            }
        }
    }
    if let (Value::Array(items), Some(s)) = (v, schema.get("items")) {
        for (i, it) in items.iter().enumerate() {
            out.extend(mismatches(spec, s, it, &format!("{at}/{i}")));
        }
    }
    out
}

/// The error bodies the server really sends match the schema /openapi.json documents for that
/// route, method and status (or the operation's `default`), key by key.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn documented_error_shapes_match_real_errors() {
    let srv = start(TestBackend::Memory, |c| {
        c.queues = baton::settings::default_queues();
        c.run_workers = false;
        c.max_body = 16;
    })
    .await;
    let secured = start(TestBackend::Memory, |c| {
        c.queues = baton::settings::default_queues();
        c.run_workers = false;
        c.tokens =
            vec![baton::settings::TokenConfig::new("nobody", ANY, &["read"], &["none-such"], &["none-such"]).unwrap()];
    })
    .await;
    let c = client();
    let spec: Value =
        serde_json::from_str(&c.get(format!("{}/openapi.json", srv.base)).send().await.unwrap().text().await.unwrap())
            .unwrap();
    let put = |p: &str, ct: &str| c.put(format!("{}/v1/stream/{p}", srv.base)).header("content-type", ct).send();
    put("acme/closed", "text/plain").await.unwrap();
    c.post(format!("{}/v1/stream/acme/closed", srv.base)).header("stream-closed", "true").send().await.unwrap();
    c.post(format!("{}/v1/queues/default/commands", srv.base))
        .body(r#"{"id": "done", "type": "echo"}"#)
        .send()
        .await
        .unwrap();
    c.post(format!("{}/v1/commands/done/cancel", srv.base)).send().await.unwrap();

    // (server, method, request path, body, documented path, expected status, expected code)
    let error_schema = serde_json::json!({ "$ref": "#/components/schemas/Error" });
    let cases: Vec<(&TestServer, &str, &str, &str, &str, u16, &str)> = vec![
        (&srv, "GET", "/v1/stream/acme/missing", "", "/v1/stream/{path}", 404, "not_found"),
        (&srv, "GET", "/v1/stream/acme/closed?offset=zz", "", "/v1/stream/{path}", 400, "malformed_offset"),
        (&srv, "POST", "/v1/stream/acme/closed", "x", "/v1/stream/{path}", 409, "stream_closed"),
        (&srv, "POST", "/v1/stream/acme/closed", "0123456789abcdefg", "/v1/stream/{path}", 413, "body_too_large"),
        (&srv, "DELETE", "/v1/stream/acme/missing", "", "/v1/stream/{path}", 404, "not_found"),
        (&srv, "PUT", "/v1/stream", "", "/v1/stream", 400, "bad_request"),
        (&srv, "GET", "/v1/commands/missing", "", "/v1/commands/{id}", 404, "not_found"),
        (&srv, "GET", "/v1/commands/done?wait=soon", "", "/v1/commands/{id}", 400, "invalid_wait"),
        (&srv, "POST", "/v1/commands/done/cancel", "", "/v1/commands/{id}/cancel", 409, "already_terminal"),
        (&srv, "POST", "/v1/queues/default/commands", "{", "/v1/queues/{queue}/commands", 400, "invalid_json"),
        (&srv, "POST", "/v1/queues/nope/commands", "{}", "/v1/queues/{queue}/commands", 404, "unknown_queue"),
        (&srv, "GET", "/v1/queues/nope", "", "/v1/queues/{queue}", 404, "unknown_queue"),
        (
            &srv,
            "POST",
            "/v1/queues/default/commands/batch",
            "{",
            "/v1/queues/{queue}/commands/batch",
            400,
            "invalid_json",
        ),
        (
            &srv,
            "POST",
            "/v1/queues/default/commands/batch",
            r#"{"commands": []}"#,
            "/v1/queues/{queue}/commands/batch",
            400,
            "invalid_body",
        ),
        (
            &srv,
            "POST",
            "/v1/queues/nope/commands/batch",
            r#"{"commands": [{"type": "echo"}]}"#,
            "/v1/queues/{queue}/commands/batch",
            404,
            "unknown_queue",
        ),
        (
            &srv,
            "GET",
            "/v1/queues/default/dead-letters?limit=0",
            "",
            "/v1/queues/{queue}/dead-letters",
            400,
            "invalid_limit",
        ),
        (
            &srv,
            "POST",
            "/v1/queues/default/dead-letters/x/replay",
            "",
            "/v1/queues/{queue}/dead-letters/{id}/replay",
            400,
            "invalid_id",
        ),
        (&srv, "GET", "/v1/dashboard/events?status=DONE", "", "/v1/dashboard/events", 400, "invalid_status"),
        // Not an operation (an unserved method, no route): the `Error` schema itself.
        (&srv, "PUT", "/v1/commands/done", "", "", 405, "method_not_allowed"),
        (&srv, "GET", "/v1/nothing-here", "", "", 404, "no_route"),
        (&secured, "GET", "/v1/stream/acme/x", "", "/v1/stream/{path}", 401, "unauthorized"),
        (&secured, "GET", "/v1/queues/default", "", "/v1/queues/{queue}", 403, "forbidden"),
        (
            &secured,
            "GET",
            "/v1/queues/default?access_token=a&access_token=b",
            "",
            "/v1/queues/{queue}",
            400,
            "duplicate_credentials",
        ),
        // Marked cases: `text:` sends a JSON route text/plain, `padded:` headers over the limit.
        (
            &srv,
            "POST",
            "text:/v1/queues/default/commands",
            "{}",
            "/v1/queues/{queue}/commands",
            415,
            "unsupported_media_type",
        ),
        (&srv, "GET", "padded:/v1/queues/default", "", "/v1/queues/{queue}", 431, "headers_too_large"),
        (&srv, "GET", "padded:/healthz", "", "/healthz", 431, "headers_too_large"),
    ];
    for (server, method, marked, body, documented, status, code) in cases {
        let (mark, path) = marked.split_once(':').filter(|(m, _)| !m.contains('/')).unwrap_or(("", marked));
        let mut rb = client().request(method.parse().unwrap(), format!("{}{path}", server.base));
        if server.base == secured.base && status == 403 {
            rb = rb.bearer_auth(ANY);
        }
        if !body.is_empty() {
            let json = path.contains("/commands") && mark != "text";
            let ct = if json { "application/json" } else { "text/plain" };
            rb = rb.header("content-type", ct).body(body.to_string());
        }
        if mark == "padded" {
            rb = rb.header("x-padding", "p".repeat(20_000));
        }
        let res = rb.send().await.unwrap();
        assert_eq!(res.status().as_u16(), status, "{method} {path}");
        assert_eq!(header(&res, "content-type"), Some("application/json"), "{method} {path}");
        let v: Value = serde_json::from_str(&res.text().await.unwrap()).unwrap();
        assert_eq!(v["error"], code, "{method} {path}: {v}");
        let schema = if documented.is_empty() {
            &error_schema
        } else {
            let op = &spec["paths"][documented][method.to_ascii_lowercase()];
            let responses = op["responses"].as_object().unwrap_or_else(|| panic!("{method} {documented} undocumented"));
            let documented_resp = responses.get(&status.to_string()).or(responses.get("default")).unwrap();
            &documented_resp["content"]["application/json"]["schema"]
        };
        assert!(schema.is_object(), "{method} {documented} {status}: no JSON schema documented");
        let bad = mismatches(&spec, schema, &v, "");
        assert!(bad.is_empty(), "{method} {path} {status}: {v}\n{}", bad.join("\n"));
    }
    // The checker itself: a body in the shape the document used to claim for stream errors fails.
    let old_claim = serde_json::json!({ "error": { "code": "not_found", "message": "…" } });
    assert!(!mismatches(&spec, &error_schema, &old_claim, "").is_empty());
    srv.stop().await;
    secured.stop().await;
}
