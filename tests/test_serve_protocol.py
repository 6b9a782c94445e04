"""The server's pure parts: stop strings over split deltas, and request validation."""
from __future__ import annotations

import pytest

pytest.importorskip("pydantic", reason="k3 serve needs fastapi (and so pydantic)")

from k3engine.server.protocol import (ApiError, Limits, ModelNames, parse_chat,  # noqa
                                      parse_completion)
from k3engine.server.stops import StopMatcher  # noqa: E402


def run_stops(stops, deltas):
    m = StopMatcher(tuple(stops))
    out = [m.push(d) for d in deltas]
    return "".join(out) + m.flush(), m.hit, out


@pytest.mark.parametrize("split", [1, 2, 3, 5, 100])
def test_stop_found_across_any_split(split):
    text = "alpha beta\n\nUser: gamma"
    deltas = [text[i:i + split] for i in range(0, len(text), split)]
    got, hit, _ = run_stops(["\n\nUser:"], deltas)
    assert got == "alpha beta" and hit == "\n\nUser:"


def test_held_text_is_released_when_it_is_not_a_stop():
    got, hit, out = run_stops(["abc"], ["xa", "b", "d", "e"])
    assert got == "xabde" and hit is None
    assert out[0] == "x" and out[1] == ""          # "a", then "ab", held as a possible start
    got, _, _ = run_stops(["abc"], ["xab"])        # the end of generation releases it
    assert got == "xab"


def test_earliest_stop_wins_and_nothing_after_it():
    got, hit, _ = run_stops(["cd", "b"], ["abcdef", "more"])
    assert got == "a" and hit == "b"


def test_no_stops_passes_everything():
    assert run_stops([], ["a", "b"])[0] == "ab"


LIM = Limits(max_messages=4, max_tokens=100)
M = ModelNames("m")


def chat(**body):
    body.setdefault("messages", [{"role": "user", "content": "hi"}])
    return parse_chat(body, M, LIM)


def test_chat_mapping():
    r = chat(max_tokens=5, max_completion_tokens=7, temperature=0, reasoning_effort="low",
             stop="x", messages=[{"role": "developer", "content": "sys"},
                                 {"role": "user", "content": [{"type": "text", "text": "a"},
                                                              {"type": "text", "text": "b"}]},
                                 {"role": "assistant", "content": None,
                                  "reasoning_content": "r"},
                                 {"role": "user", "content": "c"}])
    assert r.gen == 7 and r.sampling.greedy and r.stops == ("x",)
    assert r.thinking and r.effort == "low"
    m = r.history.messages
    assert [x.role for x in m] == ["system", "user", "assistant", "user"]
    assert m[1].content == "ab" and m[2].reasoning_content == "r" and m[2].content == ""
    assert chat(reasoning_effort="none").thinking is False
    d = chat()
    assert d.gen == 100 and not d.sampling.greedy and d.sampling.temperature is None


@pytest.mark.parametrize("body,status,param", [
    (dict(temperature="1"), 400, "temperature"),
    (dict(temperature=3), 400, "temperature"),
    (dict(top_p=0), 400, "top_p"),
    (dict(seed=-1), 400, "seed"),
    (dict(stream="yes"), 400, "stream"),
    (dict(n=2), 400, "n"),
    (dict(n=True), 400, "n"),                  # true == 1 in Python; not a count
    (dict(tools=[{"type": "function"}]), 400, "tools"),
    (dict(model="other"), 404, "model"),
    (dict(stream_options={"include_usage": True}), 400, "stream_options"),
    (dict(messages=[{"role": "user", "content": "a"}] * 5), 400, "messages"),
    (dict(messages=[]), 400, "messages"),
    (dict(messages=[{"role": "user", "content": "a", "reasoning_content": "r"}]), 400,
     "messages.0"),
    (dict(messages=[{"role": "user", "content": [{"type": "image_url"}]}]), 400,
     "messages.0.content"),
    (dict(messages=[{"role": "user", "content": "a\x00b"}]), 400, "messages"),
])
def test_chat_refusals(body, status, param):
    with pytest.raises(ApiError) as e:
        chat(**body)
    assert e.value.status == status and e.value.param == param
    assert e.value.body()["error"]["message"]


def test_completion_prompts():
    assert parse_completion({"prompt": [1, 2]}, M, LIM).prompt == (1, 2)
    assert parse_completion({"prompt": "text"}, M, LIM).prompt == "text"
    for bad in ([1, True], [-1], [], "", [[1, 2]], 5):
        with pytest.raises(ApiError):
            parse_completion({"prompt": bad}, M, LIM)


# ---------------------------------------------------------------- control text, nesting

from k3engine.server.stops import TextFilter  # noqa: E402


@pytest.mark.parametrize("split", [1, 2, 3, 7, 100])
def test_control_text_is_removed_across_any_split(split):
    text = "a<|close|>message<|sep|>b<c|d<|sep|"
    deltas = [text[i:i + split] for i in range(0, len(text), split)]
    f = TextFilter(("<|close|>", "<|sep|>"))
    out = [f.push(d) for d in deltas]
    assert "".join(out) + f.flush() == "amessageb<c|d<|sep|"   # an unfinished one stays
    assert not any("<|sep|>" in o or "<|close|>" in o for o in out)


def test_removing_one_control_string_cannot_leave_another():
    f = TextFilter(("<|sep|>",))
    assert f.push("x<|se<|sep|>p|>y") + f.flush() == "xy"


def test_json_depth_counts_structure_not_strings():
    from k3engine.server.protocol import json_depth
    assert json_depth(b'{"a": [1, {"b": []}]}') == 4
    assert json_depth(b'{"a": "[[[{{{", "b": "\\"[[", "c": [[]]}') == 3
    assert json_depth(b"[" * 1000 + b"]" * 1000) == 1000
    assert json_depth(b'"unterminated [[[[') == 0
    assert json_depth(b"5") == 0


def test_a_nesting_bomb_is_refused_before_the_decoder():
    from k3engine.server.protocol import parse_json
    with pytest.raises(ApiError) as e:
        parse_json(b"[" * 100_000 + b"]" * 100_000, Limits())
    assert e.value.status == 400 and e.value.code == "too_deeply_nested"
    assert parse_json(b"[" * 64 + b"]" * 64, Limits()) is not None


# ---------------------------------------------------------------- model names

def test_model_names():
    names = ModelNames("demo", ("claude-x", "gpt-x"))
    assert names.check(None) == "demo" and names.check("gpt-x") == "gpt-x"
    assert names.listed() == ["demo", "claude-x", "gpt-x"]
    with pytest.raises(ApiError) as e:
        names.check("other")
    assert e.value.status == 404 and "'claude-x'" in e.value.message
    assert ModelNames("demo", any=True).check("anything") == "anything"


def test_serve_options_refuse_bad_bounds():
    from k3engine.server.main import check_options, parser
    ok = parser().parse_args(["m", "--alias", "a", "--alias", "b"])
    assert check_options(ok) is None and ok.alias == ["a", "b"]
    for bad in (["--timeout-header", "0"], ["--timeout-body", "-1"],
                ["--sse-keepalive", "0"], ["--max-connections", "0"], ["--alias", " "]):
        assert check_options(parser().parse_args(["m", *bad])), bad


# ---------------------------------------------------------------- /v1/messages mapping

from k3engine.server.messages import parse_messages  # noqa: E402


def messages(**body):
    body.setdefault("model", "m")
    body.setdefault("max_tokens", 10)
    body.setdefault("messages", [{"role": "user", "content": "hi"}])
    return parse_messages(body, M, LIM)


@pytest.mark.parametrize("budget,effort", [(1024, "low"), (4095, "low"), (4096, "high"),
                                           (16383, "high"), (16384, "max"), (10**6, "max")])
def test_thinking_budget_maps_to_an_effort(budget, effort):
    r, shown = messages(thinking={"type": "enabled", "budget_tokens": budget})
    assert r.thinking and r.effort == effort and shown


def test_messages_mapping():
    r, shown = messages(
        system=[{"type": "text", "text": "be "}, {"type": "text", "text": "brief"}],
        stop_sequences=["x"], temperature=0, top_k=5,
        output_config={"effort": "low"},
        thinking={"type": "adaptive", "display": "omitted"},
        messages=[{"role": "user", "content": [{"type": "text", "text": "a",
                                                "cache_control": {"type": "ephemeral"}}]},
                  {"role": "assistant", "content": [
                      {"type": "thinking", "thinking": "r", "signature": "s"},
                      {"type": "text", "text": "b"}]},
                  {"role": "user", "content": "c"}])
    assert r.kind == "chat" and r.gen == 10 and r.stops == ("x",) and r.sampling.greedy
    assert r.thinking and r.effort == "low" and not shown
    m = r.history.messages
    assert [(x.role, x.content) for x in m] == [("system", "be brief"), ("user", "a"),
                                                ("assistant", "b"), ("user", "c")]
    assert m[2].reasoning_content == "r"
    off, _ = messages()
    assert not off.thinking and not off.sampling.greedy          # absent: off; no fields
    assert messages(thinking={"type": "disabled"})[0].thinking is False


@pytest.mark.parametrize("body,starts", [
    (dict(max_tokens=101), "max_tokens"),
    (dict(model="x"), "model"),
    (dict(temperature=1.5), "temperature"),
    (dict(tools=[{"name": "t"}]), "tools"),
    (dict(system=[{"type": "image"}]), "system.0"),
    (dict(messages=[{"role": "user", "content": [{"type": "text", "text": "a"},
                                                 {"type": "tool_result"}]}]),
     "messages.0.content.1"),
    (dict(messages=[{"role": "user", "content": [{"type": "thinking", "thinking": "r"}]}]),
     "messages.0.content.0"),                                  # thinking: assistant only
    (dict(messages=[{"role": "system", "content": "s"}]), "messages.0.role"),
    (dict(stop_sequences=["a"] * 9), "stop_sequences"),
])
def test_messages_refusals_name_the_field(body, starts):
    with pytest.raises(ApiError) as e:
        messages(**body)
    assert e.value.anthropic_body()["error"]["message"].startswith(starts), e.value.message
