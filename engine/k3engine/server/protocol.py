"""The OpenAI wire format as `k3 serve` speaks it: what a request may say, how a refusal
looks, and the bodies of responses and stream chunks.

Validation is strict on types and lenient on names: a field of the wrong type is refused
(400, `param` naming it); a field we do not know is ignored, as OpenAI's own server does.
A field we know but cannot honour (OPENAI_REFUSED: `tools`, `n` > 1, `logit_bias`, ...) is
refused rather than silently dropped, so a client never believes it got what it asked for.
docs/serving.md lists every field and what the server does with it (a test checks that
every field named here is listed there).

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
import re
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

    def anthropic_body(self) -> dict:
        """The same refusal in the Anthropic shape ({"type": "error", "error": {type,
        message}}): it has no `param`, so every message names its field itself."""
        return {"type": "error", "error": {"type": ANTHROPIC_ERROR_TYPES.get(
            self.status, "api_error" if self.status >= 500 else "invalid_request_error"),
            "message": self.message}}


# Anthropic's error types by status (its API reference, "Errors")
ANTHROPIC_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error",
                         403: "permission_error", 404: "not_found_error",
                         413: "request_too_large", 429: "rate_limit_error",
                         500: "api_error", 503: "overloaded_error", 529: "overloaded_error"}


@dataclass(frozen=True)
class ModelNames:
    """Which `model` names a request may give: the served id, the --alias names, or (with
    --accept-any-model) any name.  Responses echo the name the client gave."""
    served: str
    aliases: tuple[str, ...] = ()
    any: bool = False

    def listed(self) -> list[str]:
        return [self.served, *(a for a in self.aliases if a != self.served)]

    def check(self, name: str | None) -> str:
        if name is None:
            return self.served
        if self.any or name == self.served or name in self.aliases:
            return name
        raise ApiError(404, f"model: '{name}' does not exist; this server serves "
                            f"{', '.join(repr(n) for n in self.listed())}", param="model",
                       code="model_not_found")


@dataclass(frozen=True)
class Progress:
    """Prefill progress, posted by the engine adapter between prompt chunks (optional:
    the adapter of today posts only Started; the routes pass it on as a `k3` SSE comment)."""
    done: int                               # prompt positions read so far
    total: int


@dataclass(frozen=True)
class Limits:
    max_body_bytes: int = 8 << 20          # 413 above this, before any parsing
    max_messages: int = 1024
    max_prompt_ids: int = 32768            # session.MAX_PROMPT; checked after rendering
    max_tokens: int = 4096                 # session.MAX_GEN; also the default
    max_depth: int = 64                    # JSON nesting, checked before the decoder


# ------------------------------------------------------------------ what is refused

def empty(v) -> bool:                       # absent, null, false, empty
    return not v


def never(v) -> bool:                       # any value asks for something (even {})
    return False


# Fields a client may send that this server cannot honour: each maps to the test a value
# must pass to be accepted (the value that asks for nothing).  Anything else is a 400 that
# names the field, never a 200 that silently did less.  `null` always passes.
OPENAI_REFUSED = {
    "tools": empty, "functions": empty,
    "tool_choice": lambda v: v == "none", "function_call": lambda v: v == "none",
    "response_format": lambda v: v == {"type": "text"},
    "logit_bias": empty, "logprobs": empty, "top_logprobs": empty,
    "n": lambda v: v == 1 and type(v) is int, "best_of": lambda v: v == 1 and type(v) is int,
    "echo": empty, "suffix": empty,
    "frequency_penalty": lambda v: v == 0, "presence_penalty": lambda v: v == 0,
    "audio": never, "modalities": lambda v: v == ["text"], "prediction": never,
    "web_search_options": never, "store": empty, "verbosity": never,
}
# accepted and ignored: informational, or meaningless here (parallel_tool_calls without
# tools; a cache key: our prompt cache matches prefixes by itself)
OPENAI_IGNORED = ("user", "metadata", "parallel_tool_calls", "safety_identifier",
                  "prompt_cache_key", "prompt_cache_retention", "service_tier")
WHY = {"tools": "tool calling is not supported by this server",
       "functions": "function calling is not supported by this server",
       "tool_choice": "tool calling is not supported by this server",
       "function_call": "function calling is not supported by this server",
       "response_format": "structured output is not supported (only {\"type\": \"text\"})",
       "n": "one choice per request (n must be 1)", "best_of": "best_of must be 1",
       "store": "stored completions are not supported"}


def refuse_unhonoured(data: Any, table: dict) -> None:
    """400 naming the first field in `table` whose value asks for what we cannot do."""
    if not isinstance(data, dict):
        return
    for name, ok in table.items():
        v = data.get(name)
        if v is not None and not ok(v):
            raise ApiError(400, f"{name}: {WHY.get(name, 'not supported by this server')}",
                           param=name, code="unsupported_field")


# --------------------------------------------------------------------------- schema

class StrictModel(BaseModel):
    # strict: "5" is not 5 and 1 is not true; ignore: unknown fields are dropped
    model_config = ConfigDict(strict=True, extra="ignore")


class ChatMessageIn(StrictModel):
    role: Literal["system", "developer", "user", "assistant"]
    content: Any = None               # a string or text parts: checked in _content
    reasoning_content: str | None = None


class StreamOptions(StrictModel):
    include_usage: bool = False


class _Sampling(StrictModel):
    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    top_k: int | None = Field(default=None, ge=0)          # vLLM/SGLang's extension
    seed: int | None = Field(default=None, ge=0, le=2**64 - 1)
    stop: Any = None                  # a string or a list of strings: checked in _common
    stream: bool = False
    stream_options: StreamOptions | None = None


class ChatRequestIn(_Sampling):
    messages: list[ChatMessageIn]
    max_completion_tokens: int | None = Field(default=None, ge=1)
    reasoning_effort: str | None = None


class CompletionRequestIn(_Sampling):
    prompt: Any                       # text or token ids: checked in parse_completion


# --------------------------------------------------------------------------- parsed

@dataclass(frozen=True)
class SamplingIn:
    temperature: float | None
    top_p: float | None
    top_k: int | None
    seed: int | None
    greedy: bool

    def to_sampling(self):
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
    depth = json_depth(body)
    if depth > limits.max_depth:
        # json.loads recurses per level: 1,000 `[` end in a RecursionError (a 500) there
        raise ApiError(400, f"request body nests {depth} levels deep; the limit is "
                            f"{limits.max_depth}", code="too_deeply_nested")
    try:
        return json.loads(body)
    except (ValueError, UnicodeDecodeError) as e:
        raise ApiError(400, f"request body is not valid JSON: {e}") from None


# a string, or an unterminated one running to the end: this pattern never fails once it
# starts, so it never backtracks (a failing one goes quadratic on `"\\"\\"...`)
_STRING = re.compile(rb'"[^"\\]*(?:\\.?[^"\\]*)*"?', re.S)
_NOT_BRACKET = re.compile(rb"[^\[\]{}]+")


def json_depth(body: bytes) -> int:
    """The deepest nesting of arrays and objects in `body`, brackets inside strings not
    counted; computed without recursion (and in C: regex + NumPy), so any body within the
    size limit is measured quickly.  Malformed JSON gives some count; the decoder then
    refuses it anyway."""
    brackets = _NOT_BRACKET.sub(b"", _STRING.sub(b"", body))
    if not brackets:
        return 0
    import numpy as np
    b = np.frombuffer(brackets, dtype=np.uint8)
    step = np.where((b == ord("[")) | (b == ord("{")), 1, -1)
    return int(np.cumsum(step).max())


def too_large(limits: Limits) -> ApiError:
    return ApiError(413, f"request body exceeds {limits.max_body_bytes} bytes",
                    code="request_too_large")


def validated(cls, data: Any):
    if not isinstance(data, dict):
        raise ApiError(400, "request body must be a JSON object")
    try:
        return cls.model_validate(data)
    except ValidationError as e:
        err = e.errors()[0]
        loc = ".".join(str(p) for p in err["loc"])
        raise ApiError(400, f"{loc}: {err['msg']}", param=loc or None) from None


def _common(r: _Sampling, models: ModelNames, limits: Limits, max_tokens: int | None
            ) -> dict:
    if r.stream_options is not None and not r.stream:
        raise ApiError(400, "stream_options needs stream: true", param="stream_options")
    return dict(model=models.check(r.model), gen=gen_of(max_tokens, limits, "max_tokens"),
                sampling=sampling_of(r.temperature, r.top_p, r.top_k, r.seed),
                stops=stops_of(r.stop, "stop"), stream=r.stream,
                include_usage=bool(r.stream_options and r.stream_options.include_usage))


# the rules both protocols share (the Anthropic route calls these too)

def gen_of(max_tokens: int | None, limits: Limits, param: str) -> int:
    gen = limits.max_tokens if max_tokens is None else max_tokens
    if gen > limits.max_tokens:
        raise ApiError(400, f"{param} {gen} exceeds this server's limit of "
                            f"{limits.max_tokens}", param=param)
    return gen


def sampling_of(t: float | None, top_p: float | None, top_k: int | None,
                seed: int | None) -> SamplingIn:
    greedy = t == 0
    return SamplingIn(None if greedy else t, top_p, top_k or None, seed, greedy)


def stops_of(value: Any, param: str) -> tuple[str, ...]:
    stops = _strings(value, param, "a string or a list of strings")
    if len(stops) > MAX_STOPS:
        raise ApiError(400, f"{param}: at most {MAX_STOPS} stop strings", param=param)
    if any(s == "" for s in stops):
        raise ApiError(400, f"{param}: a stop string may not be empty", param=param)
    return stops


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


def parse_chat(data: Any, models: ModelNames, limits: Limits) -> GenRequest:
    """A /v1/chat/completions body -> GenRequest, or ApiError.  The transcript rules
    (optional system first, then user/assistant alternating, ending with user) are the
    chat history's own (chat.History), so the server and `k3 --chat` accept the same."""
    refuse_unhonoured(data, OPENAI_REFUSED)
    r = validated(ChatRequestIn, data)
    check_message_count(len(r.messages), limits)
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
    check_ends_with_user(history)
    max_tokens = r.max_completion_tokens if r.max_completion_tokens is not None \
        else r.max_tokens
    return GenRequest("chat", history=history, thinking=effort != "none",
                      effort=effort if effort not in (None, "none") else "max",
                      **_common(r, models, limits, max_tokens))


def check_message_count(n: int, limits: Limits) -> None:
    if n > limits.max_messages:
        raise ApiError(400, f"messages: {n} messages exceed this server's limit of "
                            f"{limits.max_messages}", param="messages")
    if not n:
        raise ApiError(400, "messages must not be empty", param="messages")


def check_ends_with_user(history: History) -> None:
    if not history.ends_with_user:
        raise ApiError(400, "messages: the last message must be from the user (an "
                            "assistant message to continue is not supported)",
                       param="messages")


def parse_completion(data: Any, models: ModelNames, limits: Limits) -> GenRequest:
    refuse_unhonoured(data, OPENAI_REFUSED)
    r = validated(CompletionRequestIn, data)
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
                      **_common(r, models, limits, r.max_tokens))


# --------------------------------------------------------------------------- responses

def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def usage_body(prompt: int, completion: int, reasoning: int) -> dict:
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "completion_tokens_details": {"reasoning_tokens": reasoning}}


def with_cached(usage: dict, ext: dict) -> dict:
    """OpenAI's usage plus prompt_tokens_details.cached_tokens: the prompt positions the
    kept state supplied (the adapter's reused_positions)."""
    return {**usage, "prompt_tokens_details": {"cached_tokens": ext["reused_positions"]}}


def chat_body(rid: str, model: str, created: int, content: str, reasoning: str | None,
              finish: str, usage: dict, ext: dict) -> dict:
    msg = {"role": "assistant", "content": content}
    if reasoning is not None:
        msg["reasoning_content"] = reasoning
    return {"id": rid, "object": "chat.completion", "created": created, "model": model,
            "choices": [{"index": 0, "message": msg, "finish_reason": finish,
                         "logprobs": None}],
            "usage": with_cached(usage, ext), "k3": ext}


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
        body["usage"] = with_cached(usage, ext)
        body["k3"] = ext
    return body


def usage_chunk(rid: str, model: str, created: int, obj: str, usage: dict,
                ext: dict) -> dict:
    """The last chunk of a stream with include_usage: no choices, the usage (OpenAI's
    shape), and our extension figures."""
    return {"id": rid, "object": obj, "created": created, "model": model, "choices": [],
            "usage": with_cached(usage, ext), "k3": ext}


def sse(obj: dict | str, event: str | None = None) -> bytes:
    data = obj if isinstance(obj, str) else json.dumps(obj, ensure_ascii=False,
                                                       separators=(",", ":"))
    head = f"event: {event}\n" if event else ""
    return f"{head}data: {data}\n\n".encode("utf-8")


# SSE comment lines: every client's parser skips them, so they keep a connection (and the
# proxies and client timeouts on it) alive, and carry our prefill figures without
# inventing an event type a strict client would trip on.
KEEPALIVE = b": keep-alive\n\n"


def progress_comment(done: int, total: int) -> bytes:
    return f': k3 {{"prefill":{{"done":{done},"total":{total}}}}}\n\n'.encode()


# --------------------------------------------------------------------------- wires
# A wire renders one request's engine items in its protocol: the events of a stream
# (bytes) and the body of a non-streamed answer.  app.py drives all of them the same way.

class ChatWire:
    """/v1/chat/completions."""

    def __init__(self, req: GenRequest):
        self.req, self.rid, self.created = req, new_id("chatcmpl"), now()

    def error_body(self, e: ApiError) -> dict:
        return e.body()

    def opening(self, waiting: bool) -> bytes:
        """The stream's first bytes, sent with the headers; `waiting`: the job has not
        started (the first event may then need nothing from the engine)."""
        # this one needs nothing from the engine, so it is always the first event
        return sse(chat_chunk(self.rid, self.req.model, self.created,
                              {"role": "assistant", "content": ""}))

    def started(self, item) -> bytes:
        return b""

    def delta(self, item) -> bytes:
        field = "reasoning_content" if item.kind == "reasoning" else "content"
        return sse(chat_chunk(self.rid, self.req.model, self.created, {field: item.text}))

    def done(self, item) -> bytes:
        out = sse(chat_chunk(self.rid, self.req.model, self.created, {}, item.finish))
        if self.req.include_usage:
            out += sse(usage_chunk(self.rid, self.req.model, self.created,
                                   "chat.completion.chunk", item.usage, item.ext))
        return out + sse("[DONE]")

    def failed(self, e: ApiError) -> bytes:
        # headers are sent: the error goes in the stream, in the same shape
        return sse(e.body()) + sse("[DONE]")

    def body(self, parts: dict[str, list[str]], item) -> dict:
        reasoning = "".join(parts["reasoning"]) if self.req.thinking else None
        return chat_body(self.rid, self.req.model, self.created, "".join(parts["content"]),
                         reasoning, item.finish, item.usage, item.ext)


class CompletionWire(ChatWire):
    """/v1/completions: its text passes a TextFilter that removes control-token text (the
    adapter's text stream leaves out only the end ids)."""

    def __init__(self, req: GenRequest, hidden: tuple[str, ...]):
        from .stops import TextFilter
        self.req, self.rid, self.created = req, new_id("cmpl"), now()
        self.filter = TextFilter(hidden)

    def opening(self, waiting: bool) -> bytes:
        return KEEPALIVE if waiting else b""  # this protocol has no content-free chunk

    def delta(self, item) -> bytes:
        text = self.filter.push(item.text)
        return sse(completion_body(self.rid, self.req.model, self.created, text, None)) \
            if text else b""

    def done(self, item) -> bytes:
        tail = self.filter.flush()
        out = sse(completion_body(self.rid, self.req.model, self.created, tail, None)) \
            if tail else b""
        out += sse(completion_body(self.rid, self.req.model, self.created, "", item.finish))
        if self.req.include_usage:
            out += sse(usage_chunk(self.rid, self.req.model, self.created, "text_completion",
                                   item.usage, item.ext))
        return out + sse("[DONE]")

    def body(self, parts: dict[str, list[str]], item) -> dict:
        text = self.filter.push("".join(parts["text"])) + self.filter.flush()
        return completion_body(self.rid, self.req.model, self.created, text, item.finish,
                               item.usage, item.ext)


def now() -> int:
    return int(time.time())
