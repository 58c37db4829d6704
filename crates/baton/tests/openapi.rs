//! `/openapi.json` describes exactly the router's routes (both ways), and every route in the
//! table is really served (probed on a live server: never the fallback, never 405).

mod common;

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
