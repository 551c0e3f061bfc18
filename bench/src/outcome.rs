//! What became of each request, finer than success or failure, and whether the server
//! documents it.
//!
//! [`Outcome`] names every way a request can end: a complete answer, a disconnect the client
//! chose, an HTTP error by status and OpenAI error `type`, an `error` event inside a stream, a
//! timeout, a transport failure, a truncated stream. [`ErrorContract`] is the server's list of
//! the errors it may answer, read from its OpenAPI document (per path: the statuses whose
//! response is the `Error` schema; the `enum` of the error `type`, when the document gives
//! one; an `error` object inside a stream wherever the document's `SseEvent` schema says so).
//! A soak passes only when every outcome is one the contract allows: a timeout (a hang), a
//! broken connection or a truncated stream never is.
//!
//! Pure functions of their inputs; no IO.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;

use serde_json::Value;

use crate::{BenchError, Result};

/// How one request ended.
#[derive(Debug, Clone, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Outcome {
    /// A complete answer.
    #[default]
    Ok,
    /// The client closed the stream on purpose (`--mix disconnect`).
    Disconnected,
    /// A non-2xx status; `error_type` is the body's `error.type` when the body is OpenAI's
    /// error shape (`{"error": {"message": string, "type": string, ...}}`), else `None`.
    Http { status: u16, error_type: Option<String> },
    /// The stream carried an `error` object; its `type` when it is OpenAI's error shape.
    StreamError { error_type: Option<String> },
    /// No complete answer within the request timeout: a hang.
    Timeout,
    /// Connecting, sending or reading failed (refused, reset, closed mid-body).
    Transport,
    /// The stream ended without `[DONE]` or a finish reason, or inside an SSE line; or a JSON
    /// answer that is not the endpoint's response shape.
    Truncated,
}

impl Outcome {
    /// The outcome of a non-2xx answer with this body.
    pub fn http(status: u16, body: &str) -> Outcome {
        let error_type = serde_json::from_str::<Value>(body).ok().and_then(|v| openai_error_type(&v["error"]));
        Outcome::Http { status, error_type }
    }

    /// The outcome of an `error` value found inside a stream.
    pub fn stream_error(error: &Value) -> Outcome {
        Outcome::StreamError { error_type: openai_error_type(error) }
    }

    /// Whether this is an error (a complete answer and a disconnect by design are not).
    pub fn is_error(&self) -> bool {
        !matches!(self, Outcome::Ok | Outcome::Disconnected)
    }

    /// A stable label: `ok`, `disconnected`, `http_429_rate_limit_error`, `http_500_unshaped`,
    /// `stream_error_server_error`, `timeout`, `transport`, `truncated`.
    pub fn label(&self) -> String {
        let ty = |t: &Option<String>| t.clone().unwrap_or_else(|| "unshaped".into());
        match self {
            Outcome::Ok => "ok".into(),
            Outcome::Disconnected => "disconnected".into(),
            Outcome::Http { status, error_type } => format!("http_{status}_{}", ty(error_type)),
            Outcome::StreamError { error_type } => format!("stream_error_{}", ty(error_type)),
            Outcome::Timeout => "timeout".into(),
            Outcome::Transport => "transport".into(),
            Outcome::Truncated => "truncated".into(),
        }
    }
}

impl Outcome {
    /// The outcome a [`Outcome::label`] names (a result file read back).
    pub fn from_label(label: &str) -> Option<Outcome> {
        let ty = |t: &str| (t != "unshaped").then(|| t.to_owned());
        Some(match label {
            "ok" => Outcome::Ok,
            "disconnected" => Outcome::Disconnected,
            "timeout" => Outcome::Timeout,
            "transport" => Outcome::Transport,
            "truncated" => Outcome::Truncated,
            _ => {
                if let Some(t) = label.strip_prefix("stream_error_") {
                    Outcome::StreamError { error_type: ty(t) }
                } else {
                    let (status, t) = label.strip_prefix("http_")?.split_once('_')?;
                    Outcome::Http { status: status.parse().ok()?, error_type: ty(t) }
                }
            }
        })
    }
}

impl fmt::Display for Outcome {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.label())
    }
}

impl serde::Serialize for Outcome {
    fn serialize<S: serde::Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
        s.serialize_str(&self.label())
    }
}

/// `error.type` of an OpenAI error object: `{"message": string, "type": string, ...}`.
fn openai_error_type(error: &Value) -> Option<String> {
    error.get("message")?.as_str()?;
    error.get("type")?.as_str().map(str::to_owned)
}

/// The errors a server documents, per API path (see the module docs).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ErrorContract {
    /// Per path (`/v1/completions`): the statuses documented with the `Error` schema.
    statuses: BTreeMap<String, BTreeSet<u16>>,
    /// The documented values of `error.type`; `None` when the document does not list them.
    types: Option<BTreeSet<String>>,
    /// Whether the document says a stream may carry an `error` object.
    stream_errors: bool,
}

impl ErrorContract {
    /// Reads the contract from an OpenAPI 3 document whose error responses refer to
    /// `#/components/schemas/Error`.
    pub fn from_openapi(doc: &Value) -> Result<ErrorContract> {
        let bad = |what: &str| BenchError::Server(format!("OpenAPI document: {what}"));
        let paths = doc.get("paths").and_then(Value::as_object).ok_or_else(|| bad("no `paths` object"))?;
        let error_ref = "#/components/schemas/Error";
        let mut statuses: BTreeMap<String, BTreeSet<u16>> = BTreeMap::new();
        for (path, ops) in paths {
            let Some(ops) = ops.as_object() else { continue };
            for op in ops.values() {
                let Some(responses) = op.get("responses").and_then(Value::as_object) else { continue };
                for (code, resp) in responses {
                    let Ok(code) = code.parse::<u16>() else { continue };
                    let is_error = resp
                        .get("content")
                        .and_then(Value::as_object)
                        .is_some_and(|c| c.values().any(|m| m["schema"]["$ref"].as_str() == Some(error_ref)));
                    if code >= 400 && is_error {
                        statuses.entry(path.clone()).or_default().insert(code);
                    }
                }
            }
        }
        let schemas = &doc["components"]["schemas"];
        if schemas.get("Error").is_none() {
            return Err(bad("no components.schemas.Error"));
        }
        let types = schemas["Error"]["properties"]["error"]["properties"]["type"]["enum"]
            .as_array()
            .map(|a| a.iter().filter_map(Value::as_str).map(str::to_owned).collect());
        let stream_errors = schemas["SseEvent"]["description"].as_str().is_some_and(|d| d.contains("`error`"));
        Ok(ErrorContract { statuses, types, stream_errors })
    }

    /// Whether `outcome` of a request to `path` is allowed: not an error, or an error the
    /// document lists for that path in OpenAI's shape with a documented `type`.
    pub fn allows(&self, path: &str, outcome: &Outcome) -> bool {
        let type_ok = |t: &Option<String>| match (t, &self.types) {
            (None, _) => false,
            (Some(_), None) => true,
            (Some(t), Some(types)) => types.contains(t),
        };
        match outcome {
            Outcome::Ok | Outcome::Disconnected => true,
            Outcome::Http { status, error_type } => {
                self.statuses.get(path).is_some_and(|s| s.contains(status)) && type_ok(error_type)
            }
            Outcome::StreamError { error_type } => self.stream_errors && type_ok(error_type),
            Outcome::Timeout | Outcome::Transport | Outcome::Truncated => false,
        }
    }

    /// The statuses documented for `path` (empty when the path is not documented).
    pub fn statuses(&self, path: &str) -> Vec<u16> {
        self.statuses.get(path).map(|s| s.iter().copied().collect()).unwrap_or_default()
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    fn doc(types: Option<Vec<&str>>) -> Value {
        let err = json!({"description": "An error", "content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}});
        let mut ty = json!({"type": "string"});
        if let Some(t) = types {
            ty["enum"] = json!(t);
        }
        json!({
            "paths": {
                "/v1/completions": {"post": {"responses": {
                    "200": {"description": "ok", "content": {"application/json": {"schema": {"$ref": "#/components/schemas/CompletionResponse"}}}},
                    "400": err, "429": err, "503": err
                }}},
                "/health": {"get": {"responses": {"503": {"description": "not ready"}}}}
            },
            "components": {"schemas": {
                "Error": {"type": "object", "properties": {"error": {"type": "object", "properties": {"message": {"type": "string"}, "type": ty}}}},
                "SseEvent": {"description": "a chunk, or an `error` object if the request fails mid-stream"}
            }}
        })
    }

    #[test]
    fn http_bodies_are_classified_by_status_and_openai_type() {
        let shaped = r#"{"error":{"message":"at capacity","type":"rate_limit_error","param":null,"code":"rate_limit_exceeded"}}"#;
        assert_eq!(
            Outcome::http(429, shaped),
            Outcome::Http { status: 429, error_type: Some("rate_limit_error".into()) }
        );
        assert_eq!(Outcome::http(429, shaped).label(), "http_429_rate_limit_error");
        // Not OpenAI's shape: no message, not JSON, a type that is not a string.
        for body in [r#"{"error":{"type":"x"}}"#, "Bad Gateway", r#"{"error":{"message":"m","type":3}}"#, ""] {
            assert_eq!(Outcome::http(502, body).label(), "http_502_unshaped", "{body}");
        }
        let ev = json!({"message": "node died", "type": "server_error"});
        assert_eq!(Outcome::stream_error(&ev).label(), "stream_error_server_error");
        assert_eq!(Outcome::stream_error(&json!("boom")).label(), "stream_error_unshaped");
        assert!(!Outcome::Ok.is_error() && !Outcome::Disconnected.is_error());
        for o in [
            Outcome::Ok,
            Outcome::Disconnected,
            Outcome::http(429, shaped),
            Outcome::http(502, ""),
            Outcome::stream_error(&ev),
            Outcome::stream_error(&json!(1)),
            Outcome::Timeout,
            Outcome::Transport,
            Outcome::Truncated,
        ] {
            assert_eq!(Outcome::from_label(&o.label()), Some(o.clone()), "{o}");
        }
        assert_eq!(Outcome::from_label("http_x_y"), None);
        assert_eq!(Outcome::from_label("sideways"), None);
        assert!(Outcome::Timeout.is_error() && Outcome::Transport.is_error() && Outcome::Truncated.is_error());
    }

    #[test]
    fn the_contract_comes_from_the_error_responses_of_each_path() {
        let c = ErrorContract::from_openapi(&doc(Some(vec!["rate_limit_error", "invalid_request_error"]))).unwrap();
        assert_eq!(c.statuses("/v1/completions"), vec![400, 429, 503]);
        // A response without the Error schema is not an error kind of the API.
        assert!(c.statuses("/health").is_empty());
        let http = |s: u16, t: &str| Outcome::Http { status: s, error_type: Some(t.into()) };
        let p = "/v1/completions";
        assert!(c.allows(p, &http(429, "rate_limit_error")));
        assert!(!c.allows(p, &http(500, "rate_limit_error")), "status not documented");
        assert!(!c.allows(p, &http(429, "server_error")), "type not in the enum");
        assert!(!c.allows(p, &Outcome::Http { status: 429, error_type: None }), "not OpenAI-shaped");
        assert!(!c.allows("/v1/chat/completions", &http(429, "rate_limit_error")), "path not documented");
        assert!(c.allows(p, &Outcome::Ok) && c.allows(p, &Outcome::Disconnected));
        for never in [Outcome::Timeout, Outcome::Transport, Outcome::Truncated] {
            assert!(!c.allows(p, &never), "{never}");
        }
        assert!(c.allows(p, &Outcome::StreamError { error_type: Some("invalid_request_error".into()) }));
        assert!(!c.allows(p, &Outcome::StreamError { error_type: Some("teapot".into()) }));
    }

    #[test]
    fn without_an_enum_any_string_type_is_allowed_and_stream_errors_need_the_sse_note() {
        let c = ErrorContract::from_openapi(&doc(None)).unwrap();
        assert!(c.allows("/v1/completions", &Outcome::Http { status: 400, error_type: Some("anything".into()) }));
        let mut d = doc(None);
        d["components"]["schemas"]["SseEvent"]["description"] = json!("a chunk");
        let c = ErrorContract::from_openapi(&d).unwrap();
        assert!(!c.allows("/v1/completions", &Outcome::StreamError { error_type: Some("server_error".into()) }));
        assert!(ErrorContract::from_openapi(&json!({"paths": {}})).is_err(), "no Error schema");
        assert!(ErrorContract::from_openapi(&json!({})).is_err(), "no paths");
    }

    #[test]
    fn cleave_s_own_document_parses() {
        let text = include_str!("../../coordinator/openapi.json");
        let c = ErrorContract::from_openapi(&serde_json::from_str(text).unwrap()).unwrap();
        let statuses = c.statuses("/v1/completions");
        assert!(statuses.contains(&429) && statuses.contains(&503), "{statuses:?}");
        assert_eq!(statuses, c.statuses("/v1/chat/completions"));
        assert!(c.stream_errors);
    }
}
