"""Structured output and tool calling through the official `openai` Python client (argv[1]: base
URL, e.g. http://127.0.0.1:8000/v1; argv[2], optional: how many seeds, default 3). The served model is whatever /v1/models lists. Sampled at
temperature 1 over several seeds, so only the constraint keeps the output in its language:
a JSON Schema's output validates (`jsonschema`), a regex and a choice hold, and calls forced by
`tool_choice` ("required", or a named function) come back as `tool_calls` the client parses,
whole and streamed, with arguments their function's schema accepts. Exits non-zero on any
mismatch."""
import json
import re
import sys

import jsonschema
import openai

base = sys.argv[1]
client = openai.OpenAI(base_url=base, api_key="unused")
model = client.models.list().data[0].id
SEEDS = range(int(sys.argv[2]) if len(sys.argv) > 2 else 3)
# A random-weight model spends tokens on whitespace between JSON tokens: room for it.
MAX_TOKENS = 1000

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 20},
        "temperature": {"type": "integer", "minimum": -50, "maximum": 60},
        "sunny": {"type": "boolean"},
        "tags": {"type": "array", "items": {"enum": ["wind", "rain", "snow"]}, "maxItems": 3},
    },
    "required": ["city", "temperature", "sunny"],
    "additionalProperties": False,
}
ask = [{"role": "user", "content": "What is the weather in Paris? Answer in JSON."}]

for seed in SEEDS:
    r = client.chat.completions.create(
        model=model, messages=ask, temperature=1.0, seed=seed, max_tokens=MAX_TOKENS,
        response_format={"type": "json_schema", "json_schema": {"name": "weather", "schema": WEATHER, "strict": True}},
    )
    c = r.choices[0]
    assert c.finish_reason == "stop", (seed, c)
    jsonschema.validate(json.loads(c.message.content), WEATHER)

    r = client.chat.completions.create(
        model=model, messages=ask, temperature=1.0, seed=seed, max_tokens=MAX_TOKENS,
        response_format={"type": "json_object"},
    )
    # Nothing bounds an object without a schema: a random model may still be inside it at
    # max_tokens. Complete, it parses; cut short, it is the start of one.
    c = r.choices[0]
    assert c.message.content.lstrip().startswith("{"), c
    if c.finish_reason == "stop":
        assert isinstance(json.loads(c.message.content), dict), c

    phone = r"[0-9]{3}-[0-9]{4}"
    r = client.completions.create(
        model=model, prompt="My phone number is", temperature=1.0, seed=seed, max_tokens=50,
        extra_body={"guided_regex": phone},
    )
    assert re.fullmatch(phone, r.choices[0].text), r
    assert r.choices[0].finish_reason == "stop", r
    r = client.chat.completions.create(
        model=model, messages=ask, temperature=1.0, seed=seed, max_tokens=50,
        extra_body={"structured_outputs": {"regex": phone}},
    )
    assert re.fullmatch(phone, r.choices[0].message.content), r

    choices = ["sunny", "cloudy", "rain or snow"]
    r = client.chat.completions.create(
        model=model, messages=ask, temperature=1.0, seed=seed, max_tokens=50,
        extra_body={"guided_choice": choices},
    )
    assert r.choices[0].message.content in choices, r
    assert r.choices[0].finish_reason == "stop", r

# A bad schema is refused before anything runs, naming the field.
try:
    client.chat.completions.create(
        model=model, messages=ask, max_tokens=5,
        response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "frobnicate"}}},
    )
    raise AssertionError("a bad schema was accepted")
except openai.BadRequestError as e:
    assert e.status_code == 400 and "frobnicate" in str(e) and "response_format" in str(e), e

TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather",
        "description": "The current weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 20}, "unit": {"enum": ["celsius", "fahrenheit"]}},
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    }},
    {"type": "function", "function": {
        "name": "get_time",
        "description": "The current time in a timezone.",
        "parameters": {
            "type": "object",
            "properties": {"timezone": {"enum": ["UTC", "Europe/Paris"]}},
            "required": ["timezone"],
            "additionalProperties": False,
        },
    }},
]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
named = {"type": "function", "function": {"name": "get_weather"}}


def check_call(name, arguments, want=None):
    assert name in SCHEMAS, name
    assert want is None or name == want, (name, want)
    jsonschema.validate(json.loads(arguments), SCHEMAS[name])


for seed in SEEDS:
    for choice, want in [("required", None), (named, "get_weather")]:
        r = client.chat.completions.create(
            model=model, messages=ask, tools=TOOLS, tool_choice=choice, parallel_tool_calls=False,
            temperature=1.0, seed=seed, max_tokens=MAX_TOKENS,
        )
        c = r.choices[0]
        assert c.finish_reason == "tool_calls", (seed, choice, c)
        assert c.message.content is None, c.message
        assert len(c.message.tool_calls) == 1, c.message
        call = c.message.tool_calls[0]
        assert call.type == "function" and call.id.startswith("call_"), call
        check_call(call.function.name, call.function.arguments, want)

        # One call here too: with parallel calls allowed, a sampled small model may go on
        # calling until max_tokens (SmolLM2 on quantized weights did, 28 calls), which says
        # nothing about the stream's shape (parallel calls: constrain/tests/tools.rs).
        stream = client.chat.completions.create(
            model=model, messages=ask, tools=TOOLS, tool_choice=choice, parallel_tool_calls=False,
            temperature=1.0, seed=seed, max_tokens=MAX_TOKENS, stream=True,
        )
        calls, content, finish = {}, "", None
        for chunk in stream:
            if not chunk.choices:
                continue
            delta = chunk.choices[0].delta
            content += delta.content or ""
            for d in delta.tool_calls or []:
                if d.id is not None:
                    assert d.index not in calls, ("a second head for one call", d)
                    calls[d.index] = {"id": d.id, "name": d.function.name, "arguments": ""}
                calls[d.index]["arguments"] += d.function.arguments or ""
            finish = chunk.choices[0].finish_reason or finish
        assert finish == "tool_calls", (seed, choice, finish, calls)
        assert content == "", content
        assert sorted(calls) == [0], calls
        for call in calls.values():
            check_call(call["name"], call["arguments"], want)

print("openai structured output OK:", model)
