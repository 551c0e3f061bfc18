//! The OpenAPI document served at `/openapi.json` is true of the running coordinator: every
//! route the code registers is documented, every documented operation exists, and what the
//! live cluster answers matches the documented response schemas.

mod common;

use common::*;
use serde_json::{json, Value};

/// Checks `v` against the JSON-schema subset the document uses; returns what does not match.
fn check(doc: &Value, schema: &Value, v: &Value, at: &str, errors: &mut Vec<String>) {
    if let Some(r) = schema.get("$ref").and_then(Value::as_str) {
        let name = r.trim_start_matches("#/components/schemas/");
        let target = &doc["components"]["schemas"][name];
        assert!(!target.is_null(), "dangling $ref {r}");
        return check(doc, target, v, at, errors);
    }
    if let Some(alts) = schema.get("oneOf").and_then(Value::as_array) {
        let ok = alts.iter().any(|s| {
            let mut e = Vec::new();
            check(doc, s, v, at, &mut e);
            e.is_empty()
        });
        if !ok {
            errors.push(format!("{at}: {v} matches none of oneOf"));
        }
        return;
    }
    if let Some(t) = schema.get("type") {
        let types: Vec<&str> = match t {
            Value::String(s) => vec![s.as_str()],
            Value::Array(a) => a.iter().filter_map(Value::as_str).collect(),
            _ => vec![],
        };
        let matches = |ty: &str| match ty {
            "object" => v.is_object(),
            "array" => v.is_array(),
            "string" => v.is_string(),
            "integer" => v.is_u64() || v.is_i64(),
            "number" => v.is_number(),
            "boolean" => v.is_boolean(),
            "null" => v.is_null(),
            _ => false,
        };
        if !types.iter().any(|t| matches(t)) {
            errors.push(format!("{at}: {v} is not {types:?}"));
            return;
        }
    }
    if let Some(e) = schema.get("enum").and_then(Value::as_array) {
        if !e.contains(v) {
            errors.push(format!("{at}: {v} not in {e:?}"));
        }
    }
    if let Some(o) = v.as_object() {
        for r in schema.get("required").and_then(Value::as_array).into_iter().flatten() {
            let k = r.as_str().unwrap();
            if !o.contains_key(k) {
                errors.push(format!("{at}: missing required `{k}` in {v}"));
            }
        }
        if let Some(props) = schema.get("properties").and_then(Value::as_object) {
            for (k, s) in props {
                if let Some(x) = o.get(k) {
                    check(doc, s, x, &format!("{at}.{k}"), errors);
                }
            }
            if schema.get("additionalProperties") == Some(&Value::Bool(false)) {
                for k in o.keys().filter(|k| !props.contains_key(*k)) {
                    errors.push(format!("{at}: undocumented field `{k}`"));
                }
            }
        }
    }
    if let (Some(items), Some(a)) = (schema.get("items"), v.as_array()) {
        for (i, x) in a.iter().enumerate() {
            check(doc, items, x, &format!("{at}[{i}]"), errors);
        }
    }
}

/// Paths registered with `.route("...")` in a source file.
fn routes_in(src: &str) -> Vec<String> {
    src.split(".route(\"").skip(1).filter_map(|s| s.split('"').next()).map(str::to_string).collect()
}

#[test]
fn the_openapi_document_is_true_of_the_running_coordinator() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    // Every route the code registers is documented.
    let doc: Value = serde_json::from_str(cleave_coordinator::server::OPENAPI).unwrap();
    let paths = doc["paths"].as_object().unwrap();
    let code = [include_str!("../coordinator/src/server.rs"), include_str!("../coordinator/src/cluster/admin.rs")];
    let registered: Vec<String> = code.iter().flat_map(|s| routes_in(s)).collect();
    assert!(registered.len() >= 14, "route scan found too few routes: {registered:?}");
    for r in &registered {
        assert!(paths.contains_key(r), "route {r} is not in openapi.json");
    }

    let c = TestCluster::start(&tiny_llama(), &["both"], &[]);
    runtime().block_on(async {
        c.wait_nodes(1).await;
        // The served document is the checked-in one.
        let served: Value =
            c.client.get(format!("{}/openapi.json", c.http)).send().await.unwrap().json().await.unwrap();
        assert_eq!(served, doc);
        // Some traffic, so that latency windows are not empty.
        c.complete(greedy("Hello there", 4)).await;
        let id = c.nodes_state().await[0]["id"].as_u64().unwrap();
        // Every documented operation exists (a missing route is 404 "no route" or 405), and
        // every JSON answer matches its documented schema.
        for (path, ops) in paths {
            for (method, op) in ops.as_object().unwrap() {
                let node = if method == "delete" { "999999".to_string() } else { id.to_string() };
                let concrete = path.replace("{id}", &node);
                let m = reqwest::Method::from_bytes(method.to_uppercase().as_bytes()).unwrap();
                let body = match (method.as_str(), path.as_str()) {
                    ("post", "/v1/completions") => json!({"prompt": "Hi", "max_tokens": 2}),
                    ("post", "/v1/chat/completions") => {
                        json!({"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2})
                    }
                    ("post", "/tokenize") => json!({"prompt": "Hi"}),
                    ("post", "/detokenize") => json!({"tokens": [1, 2]}),
                    ("post", "/admin/nodes/{id}/role") => json!({"role": "both"}),
                    ("post", "/admin/nodes/{id}/drain") => json!({"then": "stay"}),
                    ("put", "/admin/planner") => json!({"mode": "advise"}),
                    ("post", "/dashboard/login") => json!({"token": ADMIN_TOKEN}),
                    _ => Value::Null,
                };
                let mut req = c.client.request(m, format!("{}{concrete}", c.http)).bearer_auth(ADMIN_TOKEN);
                if !body.is_null() {
                    req = req.json(&body);
                }
                let r = req.send().await.unwrap();
                let status = r.status().as_u16();
                let text = r.text().await.unwrap();
                assert_ne!(status, 405, "{method} {path} is documented but not routed");
                assert!(!text.contains("no route for"), "{method} {path} is documented but not routed: {text}");
                let answer = &op["responses"][status.to_string()];
                assert!(!answer.is_null(), "{method} {path} answered {status}, which is not documented: {text}");
                if let Some(schema) = answer["content"]["application/json"].get("schema") {
                    let v: Value = serde_json::from_str(&text)
                        .unwrap_or_else(|e| panic!("{method} {path}: not JSON ({e}): {text}"));
                    let mut errors = Vec::new();
                    check(&doc, schema, &v, &format!("{method} {path}"), &mut errors);
                    assert!(errors.is_empty(), "{errors:#?}");
                }
                if path == "/admin/nodes/{id}/drain" {
                    // Undo the drain so that the rest of the walk has a node to use.
                    c.admin(reqwest::Method::POST, &format!("/admin/nodes/{id}/role"), Some(json!({"role": "both"})))
                        .await;
                }
            }
        }
    });
}
