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
