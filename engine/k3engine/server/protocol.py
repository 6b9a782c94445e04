"""The OpenAI wire format as `k3 serve` speaks it: what a request may say, how a refusal
looks, and the bodies of responses and stream chunks.

Validation is strict on types and lenient on names: a field of the wrong type is refused
(400, `param` naming it); a field we do not know is ignored, as OpenAI's own server does.
A field we know but cannot honour (`n` > 1, `tools`, `logprobs`) is refused rather than
silently dropped, so a client never believes it got what it asked for.

Mapping to the engine (say it once, here):
  * sampling: no temperature/top_p/top_k/seed -> greedy (the engine's default; OpenAI's
    is temperature 1); temperature 0 -> greedy; otherwise the k3 flags of the same names.
  * reasoning_effort: low/high/max -> thinking effort; none -> thinking off.  `medium`
    and `minimal` are refused: the checkpoint's chat encoder accepts only low/high/max.
  * max_completion_tokens wins over max_tokens (the newer name); absent -> the server's
    --gen (4096 by default).
"""
from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from ..chat import ChatError, History, Message

ROLE_MAP = {"system": "system", "developer": "system", "user": "user",
            "assistant": "assistant"}
EFFORTS = ("none", "low", "high", "max")
MAX_STOPS = 8


class ApiError(Exception):
    """A refusal in OpenAI's error shape: {"error": {message, type, param, code}}."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = \
            status, message, type_, param, code
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}


@dataclass(frozen=True)
class Limits:
    max_body_bytes: int = 8 << 20          # 413 above this, before any parsing
    max_messages: int = 1024
    max_prompt_ids: int = 32768            # session.MAX_PROMPT; checked after rendering
    max_tokens: int = 4096                 # session.MAX_GEN; also the default


# --------------------------------------------------------------------------- schema

class _Strict(BaseModel):
    # strict: "5" is not 5 and 1 is not true; ignore: unknown fields are dropped
    model_config = ConfigDict(strict=True, extra="ignore")


class ChatMessageIn(_Strict):
    role: Literal["system", "developer", "user", "assistant"]
    content: Any = None               # a string or text parts: checked in _content
    reasoning_content: str | None = None


class StreamOptions(_Strict):
    include_usage: bool = False


class _Sampling(_Strict):
    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    top_k: int | None = Field(default=None, ge=0)          # vLLM/SGLang's extension
    seed: int | None = Field(default=None, ge=0, le=2**64 - 1)
    stop: Any = None                  # a string or a list of strings: checked in _common
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int | None = Field(default=None, ge=1)
    logprobs: bool | int | None = None


class ChatRequestIn(_Sampling):
    messages: list[ChatMessageIn]
    max_completion_tokens: int | None = Field(default=None, ge=1)
    reasoning_effort: str | None = None
    tools: list[Any] | None = None


class CompletionRequestIn(_Sampling):
    prompt: Any                       # text or token ids: checked in parse_completion
    echo: bool = False


# --------------------------------------------------------------------------- parsed

@dataclass(frozen=True)
class SamplingIn:
    temperature: float | None
    top_p: float | None
    top_k: int | None
    seed: int | None
    greedy: bool

    def run_sampling(self):
        from ..generate import Sampling
        return Sampling(temperature=self.temperature, top_p=self.top_p, top_k=self.top_k,
                        seed=self.seed, greedy=self.greedy)


@dataclass(frozen=True)
class GenRequest:
    """A validated request, in the engine's terms.  Exactly one of `history` (chat) and
    `prompt` (completions: ids, or text tokenized with added tokens recognised) is set."""
    kind: str                              # "chat" | "completion"
    model: str
    gen: int
    sampling: SamplingIn
    stops: tuple[str, ...]
    stream: bool
    include_usage: bool
    history: History | None = None
    thinking: bool = True
    effort: str = "max"
    prompt: str | tuple[int, ...] | None = None


def parse_json(body: bytes, limits: Limits) -> Any:
    if len(body) > limits.max_body_bytes:
        raise too_large(limits)
    try:
        return json.loads(body)
    except (ValueError, UnicodeDecodeError) as e:
        raise ApiError(400, f"request body is not valid JSON: {e}") from None


def too_large(limits: Limits) -> ApiError:
    return ApiError(413, f"request body exceeds {limits.max_body_bytes} bytes",
                    code="request_too_large")


def _validated(cls, data: Any):
    if not isinstance(data, dict):
        raise ApiError(400, "request body must be a JSON object")
    try:
        return cls.model_validate(data)
    except ValidationError as e:
        err = e.errors()[0]
        loc = ".".join(str(p) for p in err["loc"])
        raise ApiError(400, f"{loc}: {err['msg']}", param=loc or None) from None


def _common(r: _Sampling, model_id: str, limits: Limits, max_tokens: int | None
            ) -> dict:
    if r.model is not None and r.model != model_id:
        raise ApiError(404, f"the model '{r.model}' does not exist; this server serves "
                            f"'{model_id}'", param="model", code="model_not_found")
    if r.n not in (None, 1):
        raise ApiError(400, "n > 1 is not supported (one generation at a time)", param="n")
    if r.logprobs:
        raise ApiError(400, "logprobs are not supported", param="logprobs")
    gen = limits.max_tokens if max_tokens is None else max_tokens
    if gen > limits.max_tokens:
        raise ApiError(400, f"max_tokens {gen} exceeds this server's limit of "
                            f"{limits.max_tokens}", param="max_tokens")
    stops = _strings(r.stop, "stop", "a string or a list of strings")
    if len(stops) > MAX_STOPS:
        raise ApiError(400, f"at most {MAX_STOPS} stop strings", param="stop")
    if any(s == "" for s in stops):
        raise ApiError(400, "a stop string may not be empty", param="stop")
    t = r.temperature
    greedy = t == 0
    sampling = SamplingIn(None if greedy else t, r.top_p, r.top_k or None, r.seed, greedy)
    if r.stream_options is not None and not r.stream:
        raise ApiError(400, "stream_options needs stream: true", param="stream_options")
    return dict(model=model_id, gen=gen, sampling=sampling, stops=stops, stream=r.stream,
                include_usage=bool(r.stream_options and r.stream_options.include_usage))


def _strings(value: Any, param: str, what: str) -> tuple[str, ...]:
    if value is None:
        return ()
    if isinstance(value, str):
        return (value,)
    if isinstance(value, list) and all(isinstance(v, str) for v in value):
        return tuple(value)
    raise ApiError(400, f"{param}: expected {what}", param=param)


def _content(i: int, m: ChatMessageIn) -> str:
    """A message's text: a string, or OpenAI's content parts when all are text."""
    param = f"messages.{i}.content"
    c = m.content
    if c is None:
        if m.role != "assistant":
            raise ApiError(400, f"{param}: required for role {m.role}", param=param)
        return ""
    if isinstance(c, str):
        return c
    if isinstance(c, list) and all(isinstance(p, dict) and p.get("type") == "text"
                                   and isinstance(p.get("text"), str) for p in c):
        return "".join(p["text"] for p in c)
    raise ApiError(400, f"{param}: expected a string or a list of text parts (this model "
                        f"reads text only)", param=param)


def parse_chat(data: Any, model_id: str, limits: Limits) -> GenRequest:
    """A /v1/chat/completions body -> GenRequest, or ApiError.  The transcript rules
    (optional system first, then user/assistant alternating, ending with user) are the
    chat history's own (chat.History), so the server and `k3 --chat` accept the same."""
    r = _validated(ChatRequestIn, data)
    if len(r.messages) > limits.max_messages:
        raise ApiError(400, f"{len(r.messages)} messages exceed this server's limit of "
                            f"{limits.max_messages}", param="messages")
    if not r.messages:
        raise ApiError(400, "messages must not be empty", param="messages")
    if r.tools:
        raise ApiError(400, "tools are not supported by this server", param="tools")
    effort = r.reasoning_effort
    if effort is not None and effort not in EFFORTS:
        raise ApiError(400, f"reasoning_effort must be one of {', '.join(EFFORTS)} (the "
                            f"model's encoder refuses '{effort}')", param="reasoning_effort")
    history = History()
    try:
        for i, m in enumerate(r.messages):
            role = ROLE_MAP[m.role]
            reasoning = m.reasoning_content if role == "assistant" else None
            if m.reasoning_content is not None and role != "assistant":
                raise ApiError(400, f"messages.{i}.reasoning_content: only assistant "
                                    f"messages carry reasoning", param=f"messages.{i}")
            history.add(Message(role, _content(i, m), reasoning))
    except ChatError as e:
        raise ApiError(400, f"messages: {e}", param="messages") from None
    if not history.ends_with_user:
        raise ApiError(400, "messages: the last message must be from the user",
                       param="messages")
    max_tokens = r.max_completion_tokens if r.max_completion_tokens is not None \
        else r.max_tokens
    return GenRequest("chat", history=history, thinking=effort != "none",
                      effort=effort if effort not in (None, "none") else "max",
                      **_common(r, model_id, limits, max_tokens))


def parse_completion(data: Any, model_id: str, limits: Limits) -> GenRequest:
    r = _validated(CompletionRequestIn, data)
    if r.echo:
        raise ApiError(400, "echo is not supported", param="echo")
    p = r.prompt
    if isinstance(p, list) and all(type(i) is int for i in p):   # bool is not an id
        prompt = tuple(p)
        if any(i < 0 for i in prompt):
            raise ApiError(400, "prompt ids must be non-negative", param="prompt")
    elif isinstance(p, str):
        prompt = p
    else:
        raise ApiError(400, "prompt: expected a string or a list of token ids (one prompt "
                            "per request)", param="prompt")
    if not prompt:
        raise ApiError(400, "prompt must not be empty", param="prompt")
    return GenRequest("completion", prompt=prompt,
                      **_common(r, model_id, limits, r.max_tokens))


# --------------------------------------------------------------------------- responses

def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def usage_body(prompt: int, completion: int, reasoning: int) -> dict:
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "completion_tokens_details": {"reasoning_tokens": reasoning}}


def chat_body(rid: str, model: str, created: int, content: str, reasoning: str | None,
              finish: str, usage: dict, ext: dict) -> dict:
    msg = {"role": "assistant", "content": content}
    if reasoning is not None:
        msg["reasoning_content"] = reasoning
    return {"id": rid, "object": "chat.completion", "created": created, "model": model,
            "choices": [{"index": 0, "message": msg, "finish_reason": finish,
                         "logprobs": None}],
            "usage": usage, "k3": ext}


def chat_chunk(rid: str, model: str, created: int, delta: dict,
               finish: str | None = None) -> dict:
    return {"id": rid, "object": "chat.completion.chunk", "created": created,
            "model": model, "choices": [{"index": 0, "delta": delta,
                                         "finish_reason": finish, "logprobs": None}]}


def completion_body(rid: str, model: str, created: int, text: str, finish: str | None,
                    usage: dict | None = None, ext: dict | None = None) -> dict:
    body = {"id": rid, "object": "text_completion", "created": created, "model": model,
            "choices": [{"index": 0, "text": text, "finish_reason": finish,
                         "logprobs": None}]}
    if usage is not None:
        body["usage"] = usage
    if ext is not None:
        body["k3"] = ext
    return body


def usage_chunk(rid: str, model: str, created: int, obj: str, usage: dict,
                ext: dict) -> dict:
    """The last chunk of a stream with include_usage: no choices, the usage (OpenAI's
    shape), and our extension figures."""
    return {"id": rid, "object": obj, "created": created, "model": model, "choices": [],
            "usage": usage, "k3": ext}


def sse(obj: dict | str) -> bytes:
    data = obj if isinstance(obj, str) else json.dumps(obj, ensure_ascii=False,
                                                       separators=(",", ":"))
    return f"data: {data}\n\n".encode("utf-8")


def now() -> int:
    return int(time.time())
