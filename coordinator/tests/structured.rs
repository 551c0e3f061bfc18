//! Structured output and tool calling at the edge, against a scripted backend: every way of
//! asking for a constraint becomes the one `Constraint` the nodes get (compiled against the
//! tiny model's vocabulary), every refusal is a 400 naming its field, tools reach the prompt
//! (through a template that renders them, or as text when it cannot), and calls in the output
//! come back as OpenAI's `tool_calls`, whole and streamed.

mod common;

use cleave_coordinator::{CoordinatorArgs, ModelInfo};
use cleave_protocol::Constraint;
use common::*;
use serde_json::{json, Value};

fn chat(extra: Value) -> Value {
    let mut body =
        json!({"messages": [{"role": "user", "content": "What is the weather in Paris?"}], "max_tokens": 64});
    for (k, v) in extra.as_object().unwrap() {
        body[k] = v.clone();
    }
    body
}

fn weather_tools() -> Value {
    json!([
        {"type": "function", "function": {
            "name": "get_weather",
            "description": "The weather in a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
        }},
        {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}
    ])
}

async fn error_of(resp: reqwest::Response) -> Value {
    assert_eq!(resp.status(), 400);
    let v: Value = resp.json().await.unwrap();
    assert_eq!(v["error"]["type"], "invalid_request_error", "{v}");
    v["error"].clone()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_way_of_asking_becomes_one_constraint() {
    let mut h = start(args(), Mode::Script(vec![22557])).await;
    let schema = json!({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]});
    let cases = [
        (json!({"response_format": {"type": "text"}}), None),
        (json!({"response_format": {"type": "json_object"}}), Some(Constraint::JsonObject)),
        (
            json!({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema, "strict": true}}}),
            Some(Constraint::JsonSchema(schema.to_string())),
        ),
        (json!({"guided_json": schema}), Some(Constraint::JsonSchema(schema.to_string()))),
        (json!({"guided_json": schema.to_string()}), Some(Constraint::JsonSchema(schema.to_string()))),
        (json!({"guided_regex": "[0-9]{3}"}), Some(Constraint::Regex("[0-9]{3}".into()))),
        (json!({"guided_choice": ["yes", "no"]}), Some(Constraint::Choice(vec!["yes".into(), "no".into()]))),
        (json!({"guided_grammar": "start: \"a\" | \"b\""}), Some(Constraint::Lark("start: \"a\" | \"b\"".into()))),
        (json!({"structured_outputs": {"json": schema}}), Some(Constraint::JsonSchema(schema.to_string()))),
        (json!({"structured_outputs": {"regex": "x+"}}), Some(Constraint::Regex("x+".into()))),
        (json!({"structured_outputs": {"choice": ["a"]}}), Some(Constraint::Choice(vec!["a".into()]))),
        (json!({"structured_outputs": {"grammar": "start: \"a\""}}), Some(Constraint::Lark("start: \"a\"".into()))),
        (json!({"structured_outputs": {"json_object": true}}), Some(Constraint::JsonObject)),
    ];
    for (extra, want) in cases {
        for (path, body) in [
            ("/v1/chat/completions", chat(extra.clone())),
            ("/v1/completions", {
                let mut b = extra.clone();
                b["prompt"] = json!("x");
                b["max_tokens"] = json!(4);
                b
            }),
        ] {
            let r = h.post(path, body).await;
            assert_eq!(r.status(), 200, "{path} {extra}: {}", r.text().await.unwrap());
            assert_eq!(h.next_seen().await.params.constraint, want, "{path} {extra}");
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_refusal_names_its_field() {
    let h = start(args(), Mode::Script(vec![22557])).await;
    let tools = weather_tools();
    let history = |calls: Value| {
        json!({"messages": [
            {"role": "user", "content": "x"},
            {"role": "assistant", "content": null, "tool_calls": calls},
            {"role": "user", "content": "y"}
        ]})
    };
    let cases = [
        (json!({"response_format": {"type": "xml"}}), "response_format.type", "xml"),
        (json!({"response_format": "json"}), "response_format", "type"),
        (
            json!({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}),
            "response_format.json_schema.schema",
            "required",
        ),
        (
            json!({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "frobnicate"}}}}),
            "response_format.json_schema.schema",
            "frobnicate",
        ),
        (json!({"guided_json": [1, 2]}), "guided_json", "JSON Schema"),
        (json!({"guided_regex": "a(b"}), "guided_regex", "regex"),
        (json!({"guided_regex": 5}), "guided_regex", "string"),
        (json!({"guided_regex": ""}), "guided_regex", "empty"),
        (json!({"guided_choice": []}), "guided_choice", "empty"),
        (json!({"guided_choice": "a"}), "guided_choice", "sequence"),
        (json!({"guided_grammar": "start: undefined_rule"}), "guided_grammar", "undefined_rule"),
        (
            json!({"structured_outputs": {"json": {}, "regex": "a"}}),
            "structured_outputs.regex",
            "structured_outputs.json",
        ),
        (
            json!({"structured_outputs": {"whitespace_pattern": " "}}),
            "structured_outputs.whitespace_pattern",
            "unknown field",
        ),
        (json!({"response_format": {"type": "json_object"}, "guided_regex": "a"}), "guided_regex", "response_format"),
        (json!({"tools": {"name": "f"}}), "tools", "sequence"),
        (json!({"tools": [{"type": "code_interpreter", "function": {"name": "f"}}]}), "tools[0].type", "function"),
        (
            json!({"tools": [{"type": "function", "function": {"name": "bad name"}}]}),
            "tools[0].function.name",
            "bad name",
        ),
        (
            json!({"tools": [{"type": "function", "function": {"name": "x".repeat(65)}}]}),
            "tools[0].function.name",
            "64",
        ),
        (json!({"tools": [{"type": "function", "function": {}}]}), "tools[0].function", "name"),
        (
            json!({"tools": [{"type": "function", "function": {"name": "f"}}, {"type": "function", "function": {"name": "f"}}]}),
            "tools[1].function.name",
            "two tools",
        ),
        (
            json!({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}]}),
            "tools[0].function.parameters",
            "object",
        ),
        (
            json!({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {"a": {"type": "frobnicate"}}}}}]}),
            "tools[0].function.parameters",
            "frobnicate",
        ),
        (json!({"tools": tools, "tool_choice": "sometimes"}), "tool_choice", "sometimes"),
        (
            json!({"tools": tools, "tool_choice": {"type": "function", "function": {"name": "nope"}}}),
            "tool_choice.function.name",
            "nope",
        ),
        (json!({"tools": tools, "tool_choice": {"type": "function"}}), "tool_choice", "function"),
        (json!({"tool_choice": "required"}), "tool_choice", "tools"),
        (
            json!({"tools": tools, "tool_choice": "required", "response_format": {"type": "json_object"}}),
            "tool_choice",
            "response_format",
        ),
    ];
    for (extra, param, needle) in cases {
        let e = error_of(h.post("/v1/chat/completions", chat(extra.clone())).await).await;
        assert_eq!(e["param"], param, "{extra}: {e}");
        let message = e["message"].as_str().unwrap();
        assert!(message.contains(param) && message.contains(needle), "{extra}: {message:?} lacks {param} or {needle}");
    }
    let bad_args =
        history(json!([{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{not json"}}]));
    let e = error_of(h.post("/v1/chat/completions", bad_args).await).await;
    assert_eq!(e["param"], "messages[1].tool_calls[0].function.arguments", "{e}");
    let e = error_of(h.post("/v1/chat/completions", history(json!([{"id": "c1"}]))).await).await;
    assert_eq!(e["param"], "messages[1].tool_calls[0]", "{e}");
    let on_user = json!({"messages": [{"role": "user", "content": "x", "tool_calls": []}]});
    let e = error_of(h.post("/v1/chat/completions", on_user).await).await;
    assert_eq!(e["param"], "messages[0].tool_calls", "{e}");
}

/// The tiny model's template knows nothing of tools (and refuses any role but user and
/// assistant): the tools are described in the first user message, an assistant's calls are
/// written into its content and tool results become a user turn, in the Hermes form.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tools_reach_a_template_that_cannot_render_them_as_text() {
    let mut h = start(args(), Mode::Script(vec![22557])).await;
    let decode = |h: &Harness, ids: &[u32]| h.model.tokenizer.decode(ids, false).unwrap();
    let messages = json!([
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": null, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}
        ]},
        {"role": "tool", "tool_call_id": "call_1", "content": "{\"temp\": 21}"},
        {"role": "tool", "tool_call_id": "call_2", "content": "sunny"},
    ]);
    let r =
        h.post("/v1/chat/completions", json!({"messages": messages, "tools": weather_tools(), "max_tokens": 4})).await;
    assert_eq!(r.status(), 200, "{}", r.text().await.unwrap());
    let seen = h.next_seen().await;
    let prompt = decode(&h, &seen.prompt);
    assert!(prompt.contains("[INST] # Tools\n\nYou may call one or more functions"), "{prompt}");
    assert!(prompt.contains("\"name\":\"get_weather\""), "the tool's JSON is listed: {prompt}");
    assert!(prompt.contains("Weather in Paris? [/INST]"), "{prompt}");
    assert!(
        prompt.contains(
            "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\":\"Paris\"}}\n</tool_call></s>"
        ),
        "{prompt}"
    );
    assert!(
        prompt.contains("[INST] <tool_response>\n{\"temp\": 21}\n</tool_response>\n<tool_response>\nsunny\n</tool_response> [/INST]"),
        "{prompt}"
    );
    assert_eq!(seen.params.constraint, None, "auto constrains nothing");

    // tool_choice none: the tools are not described.
    let r = h.post("/v1/chat/completions", chat(json!({"tools": weather_tools(), "tool_choice": "none"}))).await;
    assert_eq!(r.status(), 200);
    let seen = h.next_seen().await;
    assert!(!decode(&h, &seen.prompt).contains("# Tools"));

    // Forced: a grammar of calls, to any tool or to the named one only.
    for (choice, names) in [
        (json!("required"), &["get_weather", "get_time"][..]),
        (json!({"type": "function", "function": {"name": "get_time"}}), &["get_time"][..]),
    ] {
        let r = h.post("/v1/chat/completions", chat(json!({"tools": weather_tools(), "tool_choice": choice}))).await;
        assert_eq!(r.status(), 200, "{choice}");
        let Some(Constraint::Lark(grammar)) = h.next_seen().await.params.constraint else {
            panic!("{choice}: no grammar")
        };
        assert!(grammar.contains("<tool_call>"), "{grammar}");
        for name in ["get_weather", "get_time"] {
            assert_eq!(grammar.contains(name), names.contains(&name), "{choice}: {grammar}");
        }
    }
}

/// A model folder whose template is a Llama 3 style one that renders `tools`, `tool_calls` and
/// the `tool` role itself.
fn llama3_style_model() -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!("cleave-llama3-tools-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let tiny = tiny_llama();
    for f in ["tokenizer.json", "config.json", "generation_config.json", "special_tokens_map.json"] {
        std::fs::copy(tiny.join(f), dir.join(f)).unwrap();
    }
    let mut config: Value =
        serde_json::from_str(&std::fs::read_to_string(tiny.join("tokenizer_config.json")).unwrap()).unwrap();
    config["chat_template"] = json!(
        "{{ bos_token }}{% if tools is defined %}[TOOLS]{% for t in tools %}{{ t.function.name }}={{ t.function.parameters | tojson }};{% endfor %}[/TOOLS]{% endif %}\
         {% for m in messages %}[{{ m.role }}]{% if m.tool_calls is defined %}{% for c in m.tool_calls %}<|python_tag|>{{ {'name': c.function.name, 'parameters': c.function.arguments} | tojson }}{% endfor %}\
         {% elif m.role == 'tool' or m.role == 'ipython' %}(result {{ m.tool_call_id }}: {{ m.content }}){% else %}{{ m.content }}{% endif %}{% endfor %}\
         {% if add_generation_prompt %}[assistant]{% endif %}"
    );
    std::fs::write(dir.join("tokenizer_config.json"), config.to_string()).unwrap();
    dir
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_template_that_renders_tools_gets_them_and_llama_json_calls_are_parsed() {
    let args = CoordinatorArgs { model: Some(llama3_style_model()), ..args() };
    let m = ModelInfo::from_args(&args).unwrap();
    let output = "{\"name\": \"get_weather\", \"parameters\": {\"city\": \"Paris\"}}";
    let mut h = start(args, Mode::Script(ids(&m, output))).await;
    let messages = json!([
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "tool_calls": [
            {"id": "call_9", "type": "function", "function": {"name": "get_weather", "arguments": "{\"city\": \"Lyon\"}"}}
        ]},
        {"role": "tool", "tool_call_id": "call_9", "content": "rain"},
    ]);
    let v: Value = h
        .post("/v1/chat/completions", json!({"messages": messages, "tools": weather_tools(), "max_tokens": 64}))
        .await
        .json()
        .await
        .unwrap();
    let seen = h.next_seen().await;
    let prompt = h.model.tokenizer.decode(&seen.prompt, false).unwrap();
    assert!(prompt.contains("[TOOLS]get_weather={\"type\": \"object\", \"properties\": {\"city\""), "{prompt}");
    assert!(
        prompt.contains("[assistant]<|python_tag|>{\"name\": \"get_weather\", \"parameters\": {\"city\": \"Lyon\"}}"),
        "{prompt}"
    );
    assert!(prompt.contains("[tool](result call_9: rain)"), "{prompt}");
    assert!(!prompt.contains("# Tools"), "the template rendered them itself: {prompt}");
    let choice = &v["choices"][0];
    assert_eq!(choice["finish_reason"], "tool_calls", "{v}");
    assert_eq!(choice["message"]["content"], Value::Null, "{v}");
    assert_eq!(choice["message"]["tool_calls"][0]["function"]["name"], "get_weather", "{v}");
    let args: Value =
        serde_json::from_str(choice["message"]["tool_calls"][0]["function"]["arguments"].as_str().unwrap()).unwrap();
    assert_eq!(args, json!({"city": "Paris"}));

    // Forced, in this family's form: the JSON object alone, arguments under "parameters".
    let r = h.post("/v1/chat/completions", chat(json!({"tools": weather_tools(), "tool_choice": "required"}))).await;
    assert_eq!(r.status(), 200);
    let Some(Constraint::Lark(grammar)) = h.next_seen().await.params.constraint else { panic!("no grammar") };
    assert!(grammar.contains("parameters") && !grammar.contains("<tool_call>"), "{grammar}");
}

const CALL: &str =
    "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\", \"days\": [1, 2]}}\n</tool_call>";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn calls_in_the_output_come_back_as_tool_calls_whole_and_streamed() {
    let m = ModelInfo::from_args(&args()).unwrap();
    let script = ids(&m, &format!("Let me check. {CALL}"));
    let h = start(args(), Mode::Script(script.clone())).await;
    let body = chat(json!({"tools": weather_tools()}));
    let v: Value = h.post("/v1/chat/completions", body.clone()).await.json().await.unwrap();
    let choice = &v["choices"][0];
    assert_eq!(choice["finish_reason"], "tool_calls", "{v}");
    assert_eq!(choice["message"]["content"], " Let me check.", "{v}");
    let call = &choice["message"]["tool_calls"][0];
    assert!(call["id"].as_str().unwrap().starts_with("call_"), "{call}");
    assert_eq!((call["type"].as_str(), call["function"]["name"].as_str()), (Some("function"), Some("get_weather")));
    let whole_args = call["function"]["arguments"].as_str().unwrap().to_owned();
    assert_eq!(serde_json::from_str::<Value>(&whole_args).unwrap(), json!({"city": "Paris", "days": [1, 2]}));

    let mut streaming = body.clone();
    streaming["stream"] = json!(true);
    let text = h.post("/v1/chat/completions", streaming).await.text().await.unwrap();
    let chunks = sse_chunks(&text);
    let mut content = String::new();
    let mut args = String::new();
    let mut heads = Vec::new();
    let mut finish = Vec::new();
    for c in &chunks {
        let choice = &c["choices"][0];
        if let Some(s) = choice["delta"]["content"].as_str() {
            assert!(!s.contains('<'), "a tag leaked into the content: {s:?}");
            content.push_str(s);
        }
        for d in choice["delta"]["tool_calls"].as_array().into_iter().flatten() {
            assert_eq!(d["index"], 0, "{d}");
            if let Some(id) = d.get("id") {
                assert!(args.is_empty(), "the call's head comes first: {d}");
                heads.push((id.clone(), d["type"].clone(), d["function"]["name"].clone()));
            }
            args.push_str(d["function"]["arguments"].as_str().unwrap_or(""));
        }
        if let Some(f) = choice["finish_reason"].as_str() {
            finish.push(f.to_owned());
        }
    }
    assert_eq!(content, " Let me check.", "the same content as the whole answer");
    assert_eq!(heads.len(), 1, "{text}");
    assert_eq!((heads[0].1.as_str(), heads[0].2.as_str()), (Some("function"), Some("get_weather")));
    assert!(heads[0].0.as_str().unwrap().starts_with("call_"));
    assert_eq!(args, whole_args, "streamed arguments concatenate to the whole answer's");
    let pieces = chunks.iter().filter(|c| c["choices"][0]["delta"]["tool_calls"].is_array()).count();
    assert!(pieces > 3, "the arguments arrive in pieces as the tokens do ({pieces} chunks)");
    assert_eq!(finish, ["tool_calls"]);

    // tool_choice none: nothing is parsed; cut short by max_tokens: "length".
    let none: Value = h
        .post("/v1/chat/completions", chat(json!({"tools": weather_tools(), "tool_choice": "none"})))
        .await
        .json()
        .await
        .unwrap();
    assert_eq!(none["choices"][0]["finish_reason"], "stop");
    assert!(none["choices"][0]["message"]["content"].as_str().unwrap().contains("<tool_call>"), "{none}");
    assert!(none["choices"][0]["message"].get("tool_calls").is_none(), "{none}");
    let mut short = chat(json!({"tools": weather_tools()}));
    short["max_tokens"] = json!(script.len() - 3);
    let cut: Value = h.post("/v1/chat/completions", short).await.json().await.unwrap();
    assert_eq!(cut["choices"][0]["finish_reason"], "length", "{cut}");
    assert_eq!(cut["choices"][0]["message"]["tool_calls"][0]["function"]["name"], "get_weather", "{cut}");
}
