"""`moeshard serve` against the official OpenAI Python client (and curl for raw SSE).

Run by tools/server-tests/run.sh with MOESHARD_SERVER_URL (http://HOST:PORT) and
MOESHARD_SERVER_MODEL set; the server is expected to run with --parallel 2 and a short
--sse-keepalive (crates/cli/tests/server.rs starts it that way on a fixture model).
"""

import json
import os
import subprocess
import threading
import time

import httpx2 as httpx
import openai
import pytest

URL = os.environ["MOESHARD_SERVER_URL"]
MODEL = os.environ["MOESHARD_SERVER_MODEL"]


@pytest.fixture(scope="module")
def client():
    return openai.OpenAI(base_url=URL + "/v1", api_key="unused", max_retries=0, timeout=120)


def chat(client, **kw):
    args = dict(
        model=MODEL,
        messages=[{"role": "user", "content": "Tell me about the sea."}],
        max_tokens=12,
        temperature=0,
    )
    args.update(kw)
    return client.chat.completions.create(**args)


def test_models(client):
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert client.models.retrieve(MODEL).id == MODEL


def test_chat_non_stream(client):
    r = chat(client)
    assert r.object == "chat.completion"
    assert r.model == MODEL
    c = r.choices[0]
    assert c.message.role == "assistant"
    assert isinstance(c.message.content, str)
    assert c.finish_reason in ("stop", "length")
    u = r.usage
    assert u.prompt_tokens > 0
    assert 1 <= u.completion_tokens <= 12
    assert u.total_tokens == u.prompt_tokens + u.completion_tokens


def test_chat_stream_matches_non_stream(client):
    full = chat(client, seed=5)
    stream = chat(client, seed=5, stream=True, stream_options={"include_usage": True})
    text, finish, usage, roles = "", None, None, []
    for chunk in stream:
        assert chunk.object == "chat.completion.chunk"
        if chunk.usage is not None:
            usage = chunk.usage
            assert chunk.choices == []
            continue
        d = chunk.choices[0].delta
        if d.role:
            roles.append(d.role)
        text += d.content or ""
        finish = chunk.choices[0].finish_reason or finish
    assert roles == ["assistant"]
    assert text == full.choices[0].message.content
    assert finish == full.choices[0].finish_reason
    assert usage.completion_tokens == full.usage.completion_tokens
    assert usage.prompt_tokens == full.usage.prompt_tokens


def test_sampling_is_deterministic_given_a_seed(client):
    kw = dict(temperature=1.0, top_p=0.9, seed=1234, max_tokens=16)
    a = chat(client, **kw).choices[0].message.content
    b = chat(client, **kw).choices[0].message.content
    assert a == b


def test_usage_counts_generated_tokens(client):
    r = chat(client, max_tokens=7, extra_body={"ignore_eos": True})
    assert r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 7
    r = chat(client, max_completion_tokens=5, extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 5


def test_second_turn_reuses_the_cached_prefix(client):
    msgs = [{"role": "user", "content": "Count the waves, one by one, please."}]
    first = chat(client, messages=msgs, max_tokens=8)
    msgs += [
        {"role": "assistant", "content": first.choices[0].message.content},
        {"role": "user", "content": "And again?"},
    ]
    second = chat(client, messages=msgs, max_tokens=8)
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert cached >= first.usage.prompt_tokens - 1, (cached, first.usage)


def test_completions(client):
    r = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=10, temperature=0)
    assert r.object == "text_completion"
    assert isinstance(r.choices[0].text, str)
    assert r.usage.completion_tokens <= 10
    s = client.completions.create(
        model=MODEL, prompt="Once upon a time", max_tokens=10, temperature=0, stream=True
    )
    text = "".join(c.choices[0].text for c in s if c.choices)
    assert text == r.choices[0].text
    e = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=10, temperature=0, echo=True)
    assert e.choices[0].text == "Once upon a time" + r.choices[0].text


def test_completion_with_token_prompt(client):
    r = client.completions.create(model=MODEL, prompt=[1, 2, 3, 4], max_tokens=3, temperature=0)
    assert r.usage.prompt_tokens == 4


def test_stop_sequences(client):
    kw = dict(model=MODEL, prompt="The", max_tokens=40, temperature=0, extra_body={"ignore_eos": True})
    full = client.completions.create(**kw).choices[0].text
    # A stop string taken from the middle of the greedy text: the text must end right before
    # its first occurrence.
    chars = full[len(full) // 3 : len(full) // 3 + 2]
    if not chars:
        pytest.skip(f"the greedy text is too short to cut: {full!r}")
    cut = client.completions.create(stop=[chars, "\u0000never"], **kw)
    assert cut.choices[0].text == full[: full.index(chars)]
    assert cut.choices[0].finish_reason == "stop"
    stream = client.completions.create(stop=chars, stream=True, **kw)
    assert "".join(c.choices[0].text for c in stream if c.choices) == full[: full.index(chars)]


def test_bad_model_is_404(client):
    with pytest.raises(openai.NotFoundError) as e:
        chat(client, model="no-such-model")
    assert e.value.status_code == 404
    assert e.value.code == "model_not_found"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("no-such-model")


def test_invalid_parameters_are_400(client):
    with pytest.raises(openai.BadRequestError) as e:
        chat(client, n=17)
    assert e.value.param == "n"
    with pytest.raises(openai.BadRequestError):
        chat(client, temperature=5)
    with pytest.raises(openai.BadRequestError):
        chat(client, messages=[])
    with pytest.raises(openai.BadRequestError) as e:
        chat(client, logprobs=True, top_logprobs=21)
    assert e.value.param == "top_logprobs"


TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}


def test_chat_logprobs(client):
    r = chat(client, logprobs=True, top_logprobs=3, extra_body={"ignore_eos": True}, max_tokens=6)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens == 6
    for t in content:
        assert len(t.top_logprobs) == 3
        # Greedy: the chosen token is the most likely one.
        assert t.token == t.top_logprobs[0].token and t.logprob == t.top_logprobs[0].logprob
        assert t.logprob <= 0
    whole = b"".join(bytes(t.bytes) for t in content)
    assert whole.decode("utf-8", "replace") == r.choices[0].message.content
    stream = chat(client, logprobs=True, top_logprobs=3, extra_body={"ignore_eos": True}, max_tokens=6, stream=True)
    streamed = [t for c in stream if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.content]
    assert [(t.token, t.logprob) for t in streamed] == [(t.token, t.logprob) for t in content]


def test_completion_logprobs(client):
    r = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=5, temperature=0, logprobs=2, extra_body={"ignore_eos": True})
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 5
    assert lp.text_offset[0] == 0
    assert lp.text_offset == sorted(lp.text_offset)
    assert all(len(t) <= 2 for t in lp.top_logprobs)


def test_n_choices_share_the_prompt_and_have_their_own_seeds(client):
    kw = dict(n=3, temperature=1.0, seed=7, max_tokens=8, extra_body={"ignore_eos": True})
    r = chat(client, **kw)
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert r.usage.completion_tokens == 24
    again = chat(client, **kw)
    assert [c.message.content for c in again.choices] == [c.message.content for c in r.choices]
    # Choice 0 of n is the n=1 answer with the same seed.
    one = chat(client, **{**kw, "n": 1})
    assert one.choices[0].message.content == r.choices[0].message.content
    texts = {}
    for chunk in chat(client, stream=True, **kw):
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + (c.delta.content or "")
    assert [texts[i] for i in range(3)] == [c.message.content for c in r.choices]


def test_tools_reach_the_template_and_tool_messages_round_trip(client):
    # The server runs with the real Qwen3 template (--chat-template-file); this tiny model
    # does not call tools by itself, so the request shapes are what is checked here.
    msgs = [
        {"role": "user", "content": "Weather in Paris?", "name": "ann"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18 C and sunny"},
    ]
    r = chat(client, messages=msgs, tools=[TOOL], max_tokens=4)
    assert r.choices[0].finish_reason in ("stop", "length", "tool_calls")
    p = httpx.post(URL + "/apply-template", json={"messages": msgs, "tools": [TOOL]}).json()["prompt"]
    assert "<tools>" in p and '"name": "get_weather"' in p
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in p
    assert "<tool_response>\n18 C and sunny\n</tool_response>" in p
    none = httpx.post(URL + "/apply-template", json={"messages": msgs[:1], "tools": [TOOL], "tool_choice": "none"}).json()["prompt"]
    assert "<tools>" not in none
    with pytest.raises(openai.BadRequestError) as e:
        chat(client, tools=[TOOL], tool_choice="required")
    assert e.value.param == "tool_choice"


PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "member": {"type": "boolean"},
        "tags": {"type": "array", "items": {"enum": ["red", "green"]}, "maxItems": 2},
    },
    "required": ["name", "age", "member"],
    "additionalProperties": False,
}


def assert_person(text):
    # The schema's constraints, checked by hand (no validator in the pinned set).
    v = json.loads(text)
    assert isinstance(v, dict) and set(v) <= set(PERSON["properties"]), v
    assert {"name", "age", "member"} <= set(v), v
    assert isinstance(v["name"], str) and len(v["name"]) <= 6, v
    assert type(v["age"]) is int and 0 <= v["age"] <= 150, v
    assert type(v["member"]) is bool, v
    tags = v.get("tags", [])
    assert isinstance(tags, list) and len(tags) <= 2 and set(tags) <= {"red", "green"}, v


def test_json_schema_response_format_gives_valid_json(client):
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "strict": True, "schema": PERSON}}
    kw = dict(response_format=fmt, temperature=1.0, seed=3, max_tokens=400)
    r = chat(client, **kw)
    assert r.choices[0].finish_reason == "stop"
    assert_person(r.choices[0].message.content)
    streamed = "".join(c.choices[0].delta.content or "" for c in chat(client, stream=True, **kw) if c.choices)
    assert streamed == r.choices[0].message.content
    with pytest.raises(openai.BadRequestError) as e:
        chat(client, response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "integer", "minimum": 3, "maximum": 1}}})
    assert e.value.status_code == 400 and e.value.param == "response_format"


def test_thinking_switch_reaches_the_template():
    msgs = [{"role": "user", "content": "hi"}]
    off = httpx.post(URL + "/apply-template", json={"messages": msgs, "chat_template_kwargs": {"enable_thinking": False}}).json()
    assert off["prompt"].endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    on = httpx.post(URL + "/apply-template", json={"messages": msgs, "enable_thinking": True}).json()
    assert on["prompt"].endswith("<|im_start|>assistant\n")


def test_tokenize_and_detokenize():
    t = httpx.post(URL + "/tokenize", json={"content": "Hello world"}).json()["tokens"]
    assert t and all(isinstance(i, int) for i in t)
    assert httpx.post(URL + "/detokenize", json={"tokens": t}).json()["content"] == "Hello world"
    pieces = httpx.post(URL + "/tokenize", json={"content": "Hello world", "with_pieces": True}).json()["tokens"]
    assert [p["id"] for p in pieces] == t and "".join(p["piece"] for p in pieces) == "Hello world"
    bad = httpx.post(URL + "/detokenize", json={"tokens": [10**9]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"


def test_cors_preflight_and_headers():
    pre = httpx.request("OPTIONS", URL + "/v1/chat/completions", headers={
        "Origin": "https://example.org", "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization, content-type"})
    assert pre.status_code == 200
    assert pre.headers["access-control-allow-origin"] == "*"
    r = httpx.get(URL + "/v1/models", headers={"Origin": "https://example.org"})
    assert r.headers["access-control-allow-origin"] == "*"


def test_malformed_json_is_400():
    r = httpx.post(URL + "/v1/chat/completions", content=b'{"model": "x", "messages": [', headers={"content-type": "application/json"})
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error"
    assert "JSON" in err["message"]
    r = httpx.post(URL + "/v1/completions", content=b'{"prompt": {"not": "a prompt"}}')
    assert r.status_code == 400


def test_unknown_route_is_404_json():
    r = httpx.get(URL + "/v1/nothing")
    assert r.status_code == 404
    assert "error" in r.json()


def test_health_and_metrics():
    h = httpx.get(URL + "/health")
    assert h.status_code == 200 and h.json()["status"] == "ok"
    m = httpx.get(URL + "/metrics")
    assert m.status_code == 200
    values = {}
    for line in m.text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.split(" ")
            values[name] = float(value)
    for name in [
        "moeshard_requests_total",
        "moeshard_generated_tokens_total",
        "moeshard_decode_tokens_per_second",
        "moeshard_requests_queued",
        "moeshard_kv_cache_usage_ratio",
    ]:
        assert name in values, name
    assert values["moeshard_requests_total"] > 0
    assert values["moeshard_generated_tokens_total"] > 0


def curl_stream(body, timeout=60):
    out = subprocess.run(
        ["curl", "-sSN", "--max-time", str(timeout), URL + "/v1/chat/completions",
         "-H", "Content-Type: application/json", "-d", json.dumps(body)],
        capture_output=True, text=True, check=True,
    )
    return out.stdout


def test_curl_sse():
    out = curl_stream({"model": MODEL, "stream": True, "max_tokens": 5, "temperature": 0,
                       "messages": [{"role": "user", "content": "hi"}]})
    events = [line for line in out.split("\n") if line.startswith("data: ")]
    assert events[-1] == "data: [DONE]", out
    chunks = [json.loads(e[len("data: "):]) for e in events[:-1]]
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert chunks[-1]["choices"][0]["finish_reason"] in ("stop", "length")
    # SSE framing: every event is followed by a blank line.
    assert "\n\n" in out and out.endswith("\n\n")


def metric(name):
    for line in httpx.get(URL + "/metrics").text.splitlines():
        if line.startswith(name + " "):
            return float(line.split(" ")[1])
    raise KeyError(name)


def test_sse_keepalive_while_queued():
    # Both slots busy with endless streams: a third stream waits in the queue and gets
    # keep-alive comments (the server runs with a short --sse-keepalive) while it waits.
    long = {"model": MODEL, "max_tokens": 6000, "temperature": 0, "ignore_eos": True, "stream": True,
            "messages": [{"role": "user", "content": "Write a long story."}]}
    stop = threading.Event()

    def hog():
        with httpx.stream("POST", URL + "/v1/chat/completions", json=long, timeout=120) as r:
            for _ in r.iter_lines():
                if stop.is_set():
                    break

    cancelled = metric("moeshard_requests_cancelled_total")
    threads = [threading.Thread(target=hog) for _ in range(2)]
    for t in threads:
        t.start()
    try:
        deadline = time.time() + 30
        while metric("moeshard_requests_processing") < 2:
            assert time.time() < deadline, "the two streams never ran"
            time.sleep(0.01)
        out = subprocess.run(
            ["curl", "-sSN", "--max-time", "1", URL + "/v1/chat/completions", "-H", "Content-Type: application/json",
             "-d", json.dumps({**long, "max_tokens": 3})],
            capture_output=True, text=True,
        ).stdout
    finally:
        stop.set()
        for t in threads:
            t.join()
    assert out.count(": keepalive") >= 3, out[:500]
    # Every client left: all three generations are cancelled.
    deadline = time.time() + 30
    while metric("moeshard_requests_cancelled_total") < cancelled + 3:
        assert time.time() < deadline, "the streams were not cancelled"
        time.sleep(0.02)
