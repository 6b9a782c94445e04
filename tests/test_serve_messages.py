"""`k3 serve` through the official `anthropic` client (POST /v1/messages), and the request
fields both protocols refuse, against a real server process on loopback serving a
generated demo model (random weights: replies rarely close, so most stops are
`max_tokens`; the stop-sequence case cuts a greedy reply read back first).

Exactness across protocols: /v1/messages builds the same GenRequest the OpenAI chat route
builds, so greedy ids, text and thinking equal /v1/chat/completions on the same transcript
(and so `k3 --chat`, which test_serve.py compares with that route)."""
from __future__ import annotations

import json
import re
import urllib.error
import urllib.request
from pathlib import Path

import pytest

anthropic = pytest.importorskip("anthropic", reason="the anthropic client is in the test extra")
openai = pytest.importorskip("openai", reason="the openai client is in the test extra")

from serve_helpers import make_demo, serve  # noqa: E402

KEY = "test-key-a7c2"
ALIAS = "claude-k3-local"
GEN_CEILING = 64


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    return make_demo(str(tmp_path_factory.mktemp("serve_msg") / "demo"))


@pytest.fixture(scope="module")
def server(demo):
    with serve(demo, "--api-key", KEY, "--queue", "1", "--gen", str(GEN_CEILING),
               "--alias", ALIAS, "--max-body-bytes", "200000", "--access-log") as s:
        yield s


@pytest.fixture
def claude(server):
    server.wait_idle()
    return anthropic.Anthropic(base_url=server.url, api_key=KEY, max_retries=0, timeout=600)


@pytest.fixture
def oai(server):
    server.wait_idle()
    return openai.OpenAI(base_url=server.base_url, api_key=KEY, max_retries=0, timeout=600)


GREEDY = {"temperature": 0}         # the SDK no longer takes it as an argument


def user(text):
    return {"role": "user", "content": text}


def raw(server, path, body, headers=None):
    """(status, JSON body) of a POST, whatever the status."""
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    req = urllib.request.Request(server.url + path, data, method="POST", headers={
        "Content-Type": "application/json", "x-api-key": KEY, **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=600) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


# ---------------------------------------------------------------- same output as OpenAI

@pytest.mark.parametrize("thinking,effort", [
    (None, "none"),                                        # absent: off (Anthropic's default)
    ({"type": "disabled"}, "none"),
    ({"type": "enabled", "budget_tokens": 2048}, "low"),
    ({"type": "enabled", "budget_tokens": 8192}, "high"),
    ({"type": "enabled", "budget_tokens": 32000}, "max"),
    ({"type": "adaptive"}, "max"),
])
def test_greedy_messages_equal_chat_completions(claude, oai, thinking, effort):
    system = "Be brief."
    turns = [user("Hello"),
             {"role": "assistant", "content": [{"type": "thinking", "thinking": "Greet back.",
                                                "signature": ""},
                                               {"type": "text", "text": "Hi."}]},
             user("What is a mixture of experts?")]
    extra = {} if thinking is None else {"thinking": thinking}
    m = claude.messages.create(model="demo", system=system, messages=turns, max_tokens=8,
                               extra_body=GREEDY, **extra)
    o = oai.chat.completions.create(
        model="demo", max_tokens=8, temperature=0, reasoning_effort=effort,
        messages=[{"role": "system", "content": system}, user("Hello"),
                  {"role": "assistant", "content": "Hi.", "reasoning_content": "Greet back."},
                  user("What is a mixture of experts?")])
    got, want = m.model_extra["k3"], o.model_extra["k3"]
    print(f"[gate] /v1/messages {thinking} vs chat effort {effort}: {got['ids']} "
          f"vs {want['ids']}")
    assert got["ids"] == want["ids"] and len(got["ids"]) == 8
    blocks = {b.type: b for b in m.content}
    msg = o.choices[0].message
    if effort == "none":
        assert "thinking" not in blocks and blocks["text"].text == msg.content
    else:
        assert blocks["thinking"].thinking == msg.model_extra["reasoning_content"]
        assert blocks.get("text", None) is None or blocks["text"].text == msg.content
    assert m.stop_reason == "max_tokens" and o.choices[0].finish_reason == "length"
    assert m.usage.output_tokens == o.usage.completion_tokens == 8
    assert m.usage.input_tokens + m.usage.cache_read_input_tokens == o.usage.prompt_tokens


def test_stream_equals_non_stream_with_the_thinking_split(claude):
    kw = dict(model="demo", max_tokens=12, messages=[user("Tell me about disks.")],
              thinking={"type": "enabled", "budget_tokens": 2048}, extra_body=GREEDY)
    whole = claude.messages.create(**kw)
    events = []
    with claude.messages.stream(**kw) as s:
        for ev in s:
            events.append(ev)
        final = s.get_final_message()
    kinds = [e.type for e in events if e.type not in ("thinking", "text")]
    print(f"[gate] stream events: {kinds}")
    assert kinds[0] == "message_start" and kinds[-2:] == ["message_delta", "message_stop"]
    starts = [e.content_block.type for e in events if e.type == "content_block_start"]
    assert starts[0] == "thinking" and kinds.count("content_block_stop") == len(starts)
    assert [b.model_dump(exclude_none=True) for b in final.content] == \
        [b.model_dump(exclude_none=True) for b in whole.content]
    assert final.content[0].thinking                       # the reasoning came as thinking
    assert final.stop_reason == whole.stop_reason == "max_tokens"
    assert final.usage.output_tokens == whole.usage.output_tokens == 12
    delta = next(e for e in events if e.type == "message_delta")
    assert delta.model_extra["k3"]["ids"] == whole.model_extra["k3"]["ids"]


# ---------------------------------------------------------------- usage with cached tokens

def test_usage_reports_cached_tokens_on_both_apis(claude, oai):
    """The same transcript twice: the second request reuses the kept state up to its last
    user message (the adapter's reused_positions), which both usages report."""
    turns = [user("Hello"), {"role": "assistant", "content": "Hi."}, user("More, please.")]
    oai.completions.create(model="demo", prompt=[99], max_tokens=1)        # no kept chat
    first = claude.messages.create(model="demo", max_tokens=3, messages=turns)
    again = claude.messages.create(model="demo", max_tokens=3, messages=turns)
    k3 = again.model_extra["k3"]
    print(f"[gate] anthropic usage first {first.usage.model_dump(exclude_none=True)}, again "
          f"{again.usage.model_dump(exclude_none=True)}, reused {k3['reused_positions']}")
    assert first.usage.cache_read_input_tokens == 0
    assert again.usage.cache_read_input_tokens == k3["reused_positions"] > 0
    assert again.usage.input_tokens == k3["prompt_positions"] - k3["reused_positions"] > 0
    with claude.messages.stream(model="demo", max_tokens=3, messages=turns) as s:
        streamed = s.get_final_message()
    assert streamed.usage.cache_read_input_tokens == k3["reused_positions"]
    assert streamed.usage.input_tokens == again.usage.input_tokens

    messages = [user("Hello"), {"role": "assistant", "content": "Hi."}, user("More, please.")]
    oai.chat.completions.create(model="demo", messages=messages, max_tokens=3)
    o = oai.chat.completions.create(model="demo", messages=messages, max_tokens=3)
    chunks = list(oai.chat.completions.create(model="demo", messages=messages, max_tokens=3,
                                              stream=True,
                                              stream_options={"include_usage": True}))
    cached = o.usage.prompt_tokens_details.cached_tokens
    print(f"[gate] openai cached_tokens {cached} of {o.usage.prompt_tokens}")
    assert cached == o.model_extra["k3"]["reused_positions"] > 0
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == cached


# ---------------------------------------------------------------- stop sequences

def test_stop_sequence_ends_trims_and_is_named(claude):
    base = dict(model="demo", messages=[user("Count for me.")], extra_body=GREEDY)
    full = claude.messages.create(max_tokens=12, **base).content[0].text
    k = next(i for i in range(1, len(full) - 2) if full.find(full[i:i + 3]) == i)
    stop = full[k:k + 3]
    cut = claude.messages.create(max_tokens=12, stop_sequences=[stop], **base)
    print(f"[gate] stop {stop!r}: {full!r} -> {cut.content[0].text!r}")
    assert cut.content[0].text == full[:k]
    assert cut.stop_reason == "stop_sequence" and cut.stop_sequence == stop
    with claude.messages.stream(max_tokens=12, stop_sequences=[stop], **base) as s:
        text = "".join(s.text_stream)
        final = s.get_final_message()
    assert text == full[:k] and final.stop_reason == "stop_sequence"
    assert final.stop_sequence == stop


# ---------------------------------------------------------------- names, keys

def test_aliases_and_both_key_headers(server, claude):
    r = claude.messages.create(model=ALIAS, max_tokens=2, messages=[user("x")])
    assert r.model == ALIAS and r.usage.output_tokens == 2
    bearer = anthropic.Anthropic(base_url=server.url, api_key=None, auth_token=KEY,
                                 max_retries=0, timeout=600)
    assert bearer.messages.create(model="demo", max_tokens=1, messages=[user("x")]).content
    o = openai.OpenAI(base_url=server.base_url, api_key=KEY, max_retries=0)
    assert [m.id for m in o.models.list().data] == ["demo", ALIAS]
    status, body = raw(server, "/v1/chat/completions",            # x-api-key on OpenAI's
                       {"model": ALIAS, "messages": [user("x")], "max_tokens": 1})
    assert status == 200 and body["model"] == ALIAS


def test_accept_any_model_flag(demo):
    with serve(demo, "--accept-any-model", "--gen", "4") as s:
        c = anthropic.Anthropic(base_url=s.url, api_key="none", max_retries=0, timeout=600)
        assert c.messages.create(model="claude-sonnet-9", max_tokens=1,
                                 messages=[user("x")]).model == "claude-sonnet-9"


# ---------------------------------------------------------------- errors, refusals

def test_errors_have_the_anthropic_shape(server, claude):
    bad = anthropic.Anthropic(base_url=server.url, api_key="wrong", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError) as e:
        bad.messages.create(model="demo", max_tokens=1, messages=[user("x")])
    assert e.value.body == {"type": "error", "error": {
        "type": "authentication_error", "message": e.value.body["error"]["message"]}}
    with pytest.raises(anthropic.NotFoundError) as e:
        claude.messages.create(model="other", max_tokens=1, messages=[user("x")])
    assert e.value.body["error"]["type"] == "not_found_error"
    assert "'other'" in e.value.body["error"]["message"]
    with pytest.raises(anthropic.BadRequestError) as e:
        claude.messages.create(model="demo", max_tokens=GEN_CEILING + 1, messages=[user("x")])
    assert e.value.body["error"]["message"].startswith("max_tokens")
    assert KEY not in "".join(server.lines)


@pytest.mark.parametrize("body,named", [
    ({"max_tokens": None}, "max_tokens"),                       # required here
    ({"temperature": 1.5}, "temperature"),                      # Anthropic's range is 0..1
    ({"tools": [{"name": "f", "input_schema": {"type": "object"}}]}, "tools"),
    ({"tool_choice": {"type": "auto"}}, "tool_choice"),
    ({"mcp_servers": [{"type": "url", "url": "http://x", "name": "x"}]}, "mcp_servers"),
    ({"container": "c"}, "container"),
    ({"output_config": {"format": {"type": "json_schema", "schema": {}}}},
     "output_config.format"),
    ({"output_config": {"effort": "medium"}}, "output_config.effort"),
    ({"thinking": {"type": "enabled"}}, "thinking.budget_tokens"),
    ({"thinking": {"type": "between_tools"}}, "thinking.type"),
    ({"speed": "fast"}, "speed"),
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]},
     "messages.0.content.0"),
    ({"messages": [user("a"), {"role": "assistant", "content": "b"}]}, "messages"),
    ({"stop_sequences": [""]}, "stop_sequences"),
])
def test_anthropic_refusals_name_the_field(server, body, named):
    req = {"model": "demo", "max_tokens": 4, "messages": [user("x")], **body}
    req = {k: v for k, v in req.items() if v is not None}
    status, err = raw(server, "/v1/messages", req)
    assert status == 400 and err["type"] == "error", err
    assert err["error"]["type"] == "invalid_request_error"
    assert err["error"]["message"].startswith(named), err


@pytest.mark.parametrize("field,value", [
    ("tools", [{"type": "function", "function": {"name": "f"}}]),
    ("functions", [{"name": "f"}]), ("tool_choice", "auto"), ("function_call", "auto"),
    ("response_format", {"type": "json_object"}), ("logit_bias", {"5": 10}),
    ("logprobs", True), ("top_logprobs", 2), ("n", 2), ("best_of", 2), ("echo", True),
    ("suffix", "x"), ("frequency_penalty", 0.5), ("presence_penalty", 0.5),
    ("audio", {"voice": "alloy", "format": "wav"}), ("modalities", ["text", "audio"]),
    ("prediction", {"type": "content", "content": "x"}), ("web_search_options", {}),
    ("store", True), ("verbosity", "low"),
])
@pytest.mark.parametrize("route", ["/v1/chat/completions", "/v1/completions"])
def test_openai_refusals_name_the_field(server, route, field, value):
    from k3engine.server.protocol import OPENAI_REFUSED
    assert field in OPENAI_REFUSED
    req = {"model": "demo", "max_tokens": 2, field: value}
    req.update({"messages": [user("x")]} if route.endswith("chat/completions")
               else {"prompt": "x"})
    status, err = raw(server, route, req, {"Authorization": f"Bearer {KEY}"})
    assert status == 400 and err["error"]["param"] == field, err
    assert err["error"]["code"] == "unsupported_field" and field in err["error"]["message"]


def test_values_that_ask_for_nothing_are_accepted(oai):
    r = oai.chat.completions.create(model="demo", messages=[user("x")], max_tokens=2, n=1,
                                    tools=[], tool_choice="none", logprobs=False,
                                    response_format={"type": "text"}, frequency_penalty=0,
                                    presence_penalty=0, modalities=["text"], store=False,
                                    user="u", metadata={"a": "b"}, parallel_tool_calls=False)
    assert r.usage.completion_tokens == 2


@pytest.mark.parametrize("shape", ["openai", "anthropic"])
def test_a_nesting_bomb_is_400_through_the_clients(server, claude, oai, shape):
    bomb = json.loads("[" * 200 + "]" * 200)
    if shape == "openai":
        with pytest.raises(openai.BadRequestError) as e:
            oai.chat.completions.create(model="demo", messages=[user("x")],
                                        extra_body={"x": bomb})
        assert e.value.body["code"] == "too_deeply_nested"
    else:
        with pytest.raises(anthropic.BadRequestError) as e:
            claude.messages.create(model="demo", max_tokens=1, messages=[user("x")],
                                   extra_body={"x": bomb})
        assert "levels deep" in e.value.body["error"]["message"]
    assert not any("Traceback" in line for line in server.lines)


def test_the_field_list_names_every_field_the_code_knows():
    """docs/serving.md's tables list each request field the server honours, ignores or
    refuses, for both protocols: a field added to the code without a line there fails."""
    from k3engine.server.messages import (ANTHROPIC_IGNORED, ANTHROPIC_REFUSED,
                                          MessagesRequestIn)
    from k3engine.server.protocol import (OPENAI_IGNORED, OPENAI_REFUSED, ChatRequestIn,
                                          CompletionRequestIn)
    doc = (Path(__file__).resolve().parents[1] / "docs" / "serving.md").read_text()
    sections = doc.split("### Request fields")[1]
    openai_part, anthropic_part = sections.split("#### Anthropic")

    def first_cells(part):             # every `name` in a table row's first cell
        return {n for cell in re.findall(r"^\| (`[^|]+)\|", part, re.M)
                for n in re.findall(r"`([a-z_.]+)`", cell)}
    listed = {"openai": first_cells(openai_part), "anthropic": first_cells(anthropic_part)}
    want_openai = (set(ChatRequestIn.model_fields) | set(CompletionRequestIn.model_fields)
                   | set(OPENAI_REFUSED) | set(OPENAI_IGNORED))
    want_anthropic = (set(MessagesRequestIn.model_fields) | set(ANTHROPIC_REFUSED)
                      | set(ANTHROPIC_IGNORED))
    assert want_openai - listed["openai"] == set()
    assert want_anthropic - listed["anthropic"] == set()


def test_access_log_through_the_flag(server, claude):
    """`k3 serve --access-log` (it logged nothing before: uvicorn's access logger at our
    warning level) writes a line per request to stderr, without keys or content."""
    import time
    claude.messages.create(model="demo", max_tokens=1, messages=[user("secret words")])
    end = time.monotonic() + 10
    while not any(" POST /v1/messages 200 " in x for x in server.lines):
        assert time.monotonic() < end, server.lines[-5:]
        time.sleep(0.05)
    line = next(x for x in server.lines if " POST /v1/messages 200 " in x)
    assert re.fullmatch(r"k3 serve: 127\.0\.0\.1 POST /v1/messages 200 \d+\.\d{3}s\n", line)
    assert not any(KEY in x or "secret" in x for x in server.lines)
