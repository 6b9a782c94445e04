"""The Anthropic Messages API (`POST /v1/messages`) as `k3 serve` speaks it.

A request becomes the same `GenRequest(kind="chat")` the OpenAI chat route builds, so both
run through the one engine adapter and greedy output is the same on the same transcript.
The field rules follow protocol.py's: a wrong type is refused (400, the message names the
field), an unknown field is ignored, a known field we cannot honour (ANTHROPIC_REFUSED) is
refused.  Errors have Anthropic's shape (ApiError.anthropic_body).

Mapping to the engine (said once, here):
  * system (a string or text blocks) -> the system message; text blocks are joined as
    they are (as OpenAI's text parts are); an assistant's `thinking` block -> its
    reasoning, rendered into the think channel as `reasoning_content` is.
  * thinking: absent or {type: disabled} -> thinking off (Anthropic's default);
    {type: enabled, budget_tokens: B} -> thinking on with effort low (B < 4096),
    high (B < 16384) or max; {type: adaptive} -> on at max (the model's own default);
    output_config.effort low/high/max, when given, is the effort.  The budget picks an
    effort only: thinking is not cut at B (max_tokens bounds the whole reply).
    display: omitted -> the thinking blocks are sent empty.
  * sampling: as the OpenAI route (no temperature/top_p/top_k -> greedy; 0 -> greedy).
  * usage: input_tokens are the prompt tokens read this time, cache_read_input_tokens
    those the kept state supplied (Anthropic's split: their sum is the prompt).
"""
from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from ..chat import ChatError, History, Message
from .protocol import (EFFORTS, ApiError, GenRequest, Limits, ModelNames, StrictModel,
                       check_ends_with_user, check_message_count, empty, gen_of, never,
                       new_id, refuse_unhonoured, sampling_of, sse, stops_of, validated)

# effort from a thinking budget: the K3 encoder's three efforts over Anthropic's range
# (budgets start at 1,024; 4k-16k is the "medium" thinking its docs describe)
EFFORT_BUDGETS = ((4096, "low"), (16384, "high"))

ANTHROPIC_REFUSED = {
    "tools": empty, "tool_choice": lambda v: v == {"type": "none"},
    "container": never, "mcp_servers": empty, "context_management": never,
    "output_format": never, "speed": lambda v: v == "standard",
}
# accepted and ignored: informational, routing or billing hints with one answer here, and
# cache_control (our prompt cache matches prefixes without being asked)
ANTHROPIC_IGNORED = ("metadata", "service_tier", "cache_control", "diagnostics",
                     "inference_geo", "user_profile_id", "workspace_id")


class AnthropicMessageIn(StrictModel):
    role: Literal["user", "assistant"]
    content: Any                      # a string or content blocks: checked in _blocks


class ThinkingIn(StrictModel):
    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: int | None = Field(default=None, ge=1)
    display: Literal["summarized", "omitted"] | None = None


class OutputConfigIn(StrictModel):
    effort: str | None = None
    format: Any = None


class MessagesRequestIn(StrictModel):
    model: str
    messages: list[AnthropicMessageIn]
    max_tokens: int = Field(ge=1)
    system: Any = None
    stop_sequences: list[str] | None = None
    stream: bool = False
    temperature: float | None = Field(default=None, ge=0, le=1)
    top_p: float | None = Field(default=None, gt=0, le=1)
    top_k: int | None = Field(default=None, ge=0)
    thinking: ThinkingIn | None = None
    output_config: OutputConfigIn | None = None


def effort_for(budget: int) -> str:
    return next((e for b, e in EFFORT_BUDGETS if budget < b), "max")


def _blocks(value: Any, param: str, thinking_ok: bool) -> tuple[str, str | None]:
    """(text, reasoning) of a string or a list of content blocks.  Text blocks are read
    (their cache_control is a hint our prompt cache does not need); an assistant's
    thinking block is its reasoning; any other block (image, document, tool_use,
    tool_result, redacted_thinking ...) is refused by name."""
    if isinstance(value, str):
        return value, None
    if not isinstance(value, list):
        raise ApiError(400, f"{param}: expected a string or a list of content blocks",
                       param=param)
    text, reasoning = [], None
    for j, b in enumerate(value):
        kind = b.get("type") if isinstance(b, dict) else None
        if kind == "text" and isinstance(b.get("text"), str):
            text.append(b["text"])
        elif kind == "thinking" and thinking_ok and isinstance(b.get("thinking"), str) \
                and reasoning is None:
            reasoning = b["thinking"]              # its signature is ours to ignore
        else:
            raise ApiError(400, f"{param}.{j}: a content block of type {kind!r} is not "
                                f"supported (this model reads text; an assistant turn may "
                                f"carry one thinking block)", param=f"{param}.{j}")
    return "".join(text), reasoning


def parse_messages(data: Any, models: ModelNames, limits: Limits
                   ) -> tuple[GenRequest, bool]:
    """A /v1/messages body -> (the chat GenRequest, whether thinking text is shown), or
    ApiError."""
    refuse_unhonoured(data, ANTHROPIC_REFUSED)
    r = validated(MessagesRequestIn, data)
    check_message_count(len(r.messages), limits)
    history = History()
    try:
        if r.system is not None:
            system, _ = _blocks(r.system, "system", False)
            history.add(Message("system", system))
        for i, m in enumerate(r.messages):
            text, reasoning = _blocks(m.content, f"messages.{i}.content",
                                      m.role == "assistant")
            history.add(Message(m.role, text, reasoning))
    except ChatError as e:
        raise ApiError(400, f"messages: {e}", param="messages") from None
    check_ends_with_user(history)
    t = r.thinking
    if t is not None and t.type == "enabled" and t.budget_tokens is None:
        raise ApiError(400, "thinking.budget_tokens: required when thinking is enabled",
                       param="thinking.budget_tokens")
    thinking = t is not None and t.type != "disabled"
    effort = effort_for(t.budget_tokens) if thinking and t.type == "enabled" else "max"
    oc = r.output_config
    if oc is not None and oc.format is not None:
        raise ApiError(400, "output_config.format: structured output is not supported",
                       param="output_config.format")
    if oc is not None and oc.effort is not None:
        if oc.effort not in EFFORTS[1:]:
            raise ApiError(400, f"output_config.effort: one of low, high, max (the model's "
                                f"encoder refuses '{oc.effort}')", param="output_config.effort")
        effort = oc.effort                       # said outright: wins over the budget
    return GenRequest("chat", model=models.check(r.model),
                      gen=gen_of(r.max_tokens, limits, "max_tokens"),
                      sampling=sampling_of(r.temperature, r.top_p, r.top_k, None),
                      stops=stops_of(r.stop_sequences, "stop_sequences"), stream=r.stream,
                      include_usage=False, history=history, thinking=thinking,
                      effort=effort), not (t is not None and t.display == "omitted")


# --------------------------------------------------------------------------- the wire

def usage_of(prompt: int, reused: int, output: int) -> dict:
    return {"input_tokens": prompt - reused, "output_tokens": output,
            "cache_read_input_tokens": reused, "cache_creation_input_tokens": 0}


class MessagesWire:
    """One /v1/messages request's stream events and body (see protocol.ChatWire)."""

    def __init__(self, req: GenRequest, end_ids: frozenset[int], show_thinking=True):
        self.req, self.rid, self.end_ids = req, new_id("msg"), end_ids
        self.show_thinking = show_thinking       # thinking.display: omitted -> False
        self.block: str | None = None        # the open content block's type
        self.index = -1

    def error_body(self, e: ApiError) -> dict:
        return e.anthropic_body()

    def opening(self, waiting: bool) -> bytes:
        # message_start carries the input token count, known once the job starts: a job
        # still waiting gets a ping first (Anthropic's own keep-alive event, which its
        # clients skip wherever it comes)
        return sse({"type": "ping"}, "ping") if waiting else b""

    def started(self, item) -> bytes:
        msg = self._message([], None, None, usage_of(item.prompt_ids, item.reused, 0))
        return sse({"type": "message_start", "message": msg}, "message_start")

    def delta(self, item) -> bytes:
        kind = "thinking" if item.kind == "reasoning" else "text"
        out = self._open(kind) if self.block != kind else b""
        if kind == "thinking" and not self.show_thinking:
            return out                           # the block is there, its text is not
        d = {"type": "thinking_delta", "thinking": item.text} if kind == "thinking" \
            else {"type": "text_delta", "text": item.text}
        return out + sse({"type": "content_block_delta", "index": self.index, "delta": d},
                         "content_block_delta")

    def done(self, item) -> bytes:
        out = self._open("text") if self.block is None else b""   # content is never empty
        out += self._close()
        reason, seq = self._stop(item)
        u = usage_of(item.usage["prompt_tokens"], item.ext["reused_positions"],
                     item.usage["completion_tokens"])
        out += sse({"type": "message_delta", "delta": {"stop_reason": reason,
                                                       "stop_sequence": seq},
                    "usage": u, "k3": item.ext}, "message_delta")
        return out + sse({"type": "message_stop"}, "message_stop")

    def failed(self, e: ApiError) -> bytes:
        return sse(e.anthropic_body(), "error")

    def body(self, parts: dict[str, list[str]], item) -> dict:
        content = []
        if parts["reasoning"]:
            shown = "".join(parts["reasoning"]) if self.show_thinking else ""
            content.append({"type": "thinking", "thinking": shown, "signature": ""})
        if parts["content"] or not content:
            content.append({"type": "text", "text": "".join(parts["content"])})
        reason, seq = self._stop(item)
        body = self._message(content, reason, seq,
                             usage_of(item.usage["prompt_tokens"],
                                      item.ext["reused_positions"],
                                      item.usage["completion_tokens"]))
        return {**body, "k3": item.ext}

    # -- helpers -------------------------------------------------------------------
    def _message(self, content, reason, seq, usage) -> dict:
        return {"id": self.rid, "type": "message", "role": "assistant",
                "model": self.req.model, "content": content, "stop_reason": reason,
                "stop_sequence": seq, "usage": usage}

    def _open(self, kind: str) -> bytes:
        out = self._close()
        self.block, self.index = kind, self.index + 1
        block = {"type": "thinking", "thinking": "", "signature": ""} if kind == "thinking" \
            else {"type": "text", "text": ""}
        return out + sse({"type": "content_block_start", "index": self.index,
                          "content_block": block}, "content_block_start")

    def _close(self) -> bytes:
        if self.block is None:
            return b""
        self.block = None
        return sse({"type": "content_block_stop", "index": self.index},
                   "content_block_stop")

    def _stop(self, item) -> tuple[str, str | None]:
        """stop_reason and stop_sequence.  `stop` is an end id (end_turn) or a stop string
        (the adapter names the one that matched: ext["stop"])."""
        if item.finish == "length":
            return "max_tokens", None
        if item.finish == "stop":
            ids = item.ext["ids"]
            if (ids and ids[-1] in self.end_ids) or not self.req.stops:
                return "end_turn", None
            return "stop_sequence", item.ext.get("stop")
        return item.finish, None                 # "cancelled": the client is gone
