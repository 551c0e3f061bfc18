"""Drives a running cleave with the official `openai` Python client (argv[1]: base URL, e.g.
http://127.0.0.1:8000/v1; argv[2]: model name; argv[3], optional: the CA bundle an https
server's certificate is checked against). Exits non-zero on any mismatch."""
import sys

import openai

base, model = sys.argv[1], sys.argv[2]
if len(sys.argv) > 3:
    assert base.startswith("https://"), base
    client = openai.OpenAI(base_url=base, api_key="unused", http_client=openai.DefaultHttpxClient(verify=sys.argv[3]))
else:
    client = openai.OpenAI(base_url=base, api_key="unused")

assert [m.id for m in client.models.list().data] == [model]

full = client.completions.create(model=model, prompt="The capital of France is", max_tokens=12, temperature=0)
assert full.choices[0].finish_reason in ("length", "stop"), full
assert full.usage.completion_tokens >= 1, full.usage

chunks = client.completions.create(
    model=model, prompt="The capital of France is", max_tokens=12, temperature=0, stream=True,
    stream_options={"include_usage": True},
)
streamed, usage = "", None
for c in chunks:
    if c.choices:
        streamed += c.choices[0].text
    if c.usage is not None:
        usage = c.usage
assert streamed == full.choices[0].text, (streamed, full.choices[0].text)
assert usage is not None and usage.completion_tokens == full.usage.completion_tokens, usage

messages = [{"role": "user", "content": "Say hello."}]
chat = client.chat.completions.create(model=model, messages=messages, max_tokens=10, temperature=0)
stream = client.chat.completions.create(model=model, messages=messages, max_tokens=10, temperature=0, stream=True)
text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
assert text == chat.choices[0].message.content, (text, chat.choices[0].message.content)

try:
    client.completions.create(model="no-such-model", prompt="x", max_tokens=1)
    raise AssertionError("unknown model accepted")
except openai.BadRequestError as e:
    assert e.status_code == 400

print("openai client OK:", repr(streamed), repr(text))
