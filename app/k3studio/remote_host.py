"""The chat against a remote OpenAI-compatible endpoint, behind the same interface the chat
panel uses for this machine's engine (worker.EngineHost): the same requests (send,
regenerate, stop, conversation commands) and the same observations (conversation,
turnStarted, records, turnFinished, busyChanged, errored), with the same dict shapes.

The conversation is a `k3engine.chat.History` here too, so the transcript rules and the
JSONL files are the engine's.  A turn streams on a short-lived request thread; each text
piece comes back to the GUI thread as one record.  A reply that ends with
finish_reason `stop` closes the turn (it joins the conversation); `length` or a Stop leaves
a draft, exactly as a local reply without an end id.

What a remote run can tell: time to first token, tokens/s and the server's token counts;
memory, I/O and expert-cache figures are local-only, and the reply's stats say so.
"""
from __future__ import annotations

import threading
import time

from PySide6.QtCore import QObject, Signal, Slot

from k3engine.conversation import Conversation, PendingReply

from .remote_client import Delta, Endpoint, RemoteError

LOCAL_ONLY = "memory and I/O plots are local-only"
REMOTE_CANNOT_CONTINUE = ("A remote reply cannot be continued (the server keeps no state for "
                          "it): Regenerate answers again, or reply to it as it is.")


def request_body(history, spec, model: str) -> dict:
    """The OpenAI request for the reply to `history` with the chat panel's settings."""
    msgs = []
    for m in history:
        d = {"role": m.role, "content": m.content}
        if m.role == "assistant" and m.reasoning_content is not None:
            d["reasoning_content"] = m.reasoning_content
        msgs.append(d)
    body = {"model": model, "messages": msgs, "max_tokens": spec.gen,
            "reasoning_effort": spec.effort if spec.thinking else "none"}
    if spec.greedy:
        body["temperature"] = 0
    else:
        body.update(temperature=spec.temperature, top_p=spec.top_p)
        if spec.top_k:
            body["top_k"] = spec.top_k
        if spec.seed:
            body["seed"] = spec.seed
    return body


class RemoteHost(QObject):
    busyChanged = Signal(bool)
    status = Signal(str)
    conversation = Signal(object)
    turnStarted = Signal(object)
    records = Signal(object)
    prefillProgress = Signal(object)     # never emitted: a remote prefill reports nothing
    turnFinished = Signal(object)
    pendingChanged = Signal(object)      # the incomplete last reply (dict) or None
    errored = Signal(object)
    _post = Signal(object)               # request thread -> GUI thread (queued)

    def __init__(self, parent=None):
        super().__init__(parent)
        # the transcript: the engine's Conversation without an engine (history, the
        # incomplete reply and how it is answered, regenerate, edit-and-fork, take back)
        self.conv = Conversation(None)
        self.messages: list[dict] = []
        self.base_url, self.api_key, self.model = "", "", ""
        self.busy = False
        self.where = ""                  # the stats line's last words ("" = remote URL)
        self._endpoint: Endpoint | None = None     # the request in flight
        self._turn: dict | None = None
        self._post.connect(self._on_post)

    @property
    def history(self):
        return self.conv.history

    @property
    def pending(self) -> dict | None:
        p = self.conv.pending
        return None if p is None else dict(p.as_dict(), how=REMOTE_CANNOT_CONTINUE)

    # -- configuration ------------------------------------------------------------------
    def configure(self, base_url: str, api_key: str, model: str) -> None:
        self.base_url, self.api_key, self.model = base_url, api_key, model

    @property
    def connected(self) -> bool:
        return bool(self.base_url and self.model)

    # -- conversation commands (as EngineHost) -------------------------------------------
    def _emit_conversation(self) -> None:
        self.messages = self.conv.messages()
        self.conversation.emit(self.messages)
        self.pendingChanged.emit(self.pending)

    def _fail(self, message: str, during: str, kind: str = "RemoteError") -> None:
        self.errored.emit(dict(code=1, kind=kind, message=message, during=during,
                               meaning="remote endpoint"))

    def _guard(self, during: str, fn) -> bool:
        """Apply one change to the conversation; a refusal is reported.  The transcript is
        re-sent either way; False when it was refused."""
        from k3engine.chat import ChatError
        try:
            fn()
            ok = True
        except ChatError as e:
            self._fail(str(e), during, "ChatError")
            ok = False
        self._emit_conversation()
        return ok

    def new_conversation(self, system_prompt: str = "") -> None:
        from k3engine.chat import History, Message
        self._guard("new conversation", lambda: setattr(self, "conv", Conversation(
            None, History([Message("system", system_prompt)] if system_prompt else []))))

    def open_conversation(self, path: str, extra: dict | None = None) -> None:
        """As EngineHost: the sidecar's incomplete reply is shown and answerable (never
        continued: the server keeps no state for it)."""
        from .conversations import restored

        def change():
            history, marks, pending = restored(path, extra, continuable=False)
            self.conv = Conversation(None, history, incomplete=marks)
            self.conv.pending = pending
        self._guard("open conversation", change)

    def save_conversation(self, path: str) -> None:
        self._guard("save conversation", lambda: self.history.save(path))

    def set_system(self, text: str) -> None:
        self._guard("system prompt", lambda: self.conv.set_system(text))

    def take_back(self) -> None:
        self._guard("edit", self.conv.take_back)

    def refresh_conversation(self) -> None:
        self._emit_conversation()

    # -- turns ----------------------------------------------------------------------------
    def _answer(self, during: str, change, spec) -> None:
        """A change to the transcript, then a turn; a refused change ends the turn."""
        if self._guard(during, change):
            self._start(spec)
        else:
            self.turnFinished.emit({"failed": True, "n": 0})

    def send(self, text: str, spec) -> None:
        """An incomplete reply is answered as it is (it joins the transcript); a failed
        turn's message is replaced."""
        self._answer("send", lambda: self.conv.add_user(text), spec)

    def edit(self, index: int, text: str, spec) -> None:
        """Replace the user message at `index` and answer it (what followed is dropped)."""
        self._answer("edit", lambda: self.conv.edit(index, text), spec)

    def continue_reply(self, spec) -> None:
        self._fail("a remote reply cannot be continued (the server kept no state for it): "
                   "Regenerate answers again, or reply to it as it is", "continue")
        self.turnFinished.emit({"failed": True, "n": 0})

    def regenerate(self, spec) -> None:
        self.conv.drop_reply()
        self._emit_conversation()
        self._start(spec)

    def stop(self) -> None:
        ep = self._endpoint
        if ep is not None:
            ep.abort()

    def _start(self, spec) -> None:
        if not self.connected or not self.history.ends_with_user:
            self._fail("not connected to a remote endpoint: connect in Setup" if not
                       self.connected else "there is no user message to answer", "turn")
            self.turnFinished.emit({"failed": True, "n": 0})
            return
        try:
            ep = Endpoint(self.base_url, self.api_key)
        except RemoteError as e:
            self._fail(str(e), "turn")
            self.turnFinished.emit({"failed": True, "n": 0})
            return
        self._endpoint = ep
        self._turn = dict(spec=spec, parts={"thinking": [], "response": []}, n=0)
        self._set_busy(True)
        self.turnStarted.emit(dict(prompt_ids="remote", gen=spec.gen, thinking=spec.thinking,
                                   command=f"k3 # remote: POST {self.base_url}/chat/"
                                           f"completions, model {self.model}",
                                   t=time.monotonic()))
        body = request_body(self.history, spec, self.model)
        threading.Thread(target=self._stream, args=(ep, body), name="k3studio-remote",
                         daemon=True).start()

    def _stream(self, ep: Endpoint, body: dict) -> None:
        """The request thread: everything it learns goes to the GUI thread via _post."""
        try:
            t_last = time.monotonic()
            for item in ep.stream_chat(body):
                if isinstance(item, Delta):
                    now = time.monotonic()
                    self._post.emit(("piece", item, now - t_last))
                    t_last = now
                else:
                    self._post.emit(("done", item, None))
        except RemoteError as e:
            self._post.emit(("error", str(e), None))
        except Exception as e:            # noqa: BLE001 - reported, never lost
            self._post.emit(("error", f"{type(e).__name__}: {e}", None))

    @Slot(object)
    def _on_post(self, msg) -> None:
        kind, item, seconds = msg
        turn = self._turn
        if turn is None:
            return
        if kind == "piece":
            phase = "thinking" if item.kind == "reasoning" else "response"
            turn["parts"][phase].append(item.text)
            turn["n"] += 1
            self.records.emit([dict(i=turn["n"], id=-1, text_delta=item.text, phase=phase,
                                    seconds=seconds)])
            return
        self._turn, self._endpoint = None, None
        if kind == "error":
            self._set_busy(False)
            self._fail(item, "remote turn")
            self.turnFinished.emit({"failed": True, "n": 0})
            self._emit_conversation()
            return
        self._finish(turn, item)

    def _finish(self, turn: dict, done) -> None:
        from k3engine.chat import ChatError, Message
        spec = turn["spec"]
        content = "".join(turn["parts"]["response"])
        reasoning = "".join(turn["parts"]["thinking"]) if spec.thinking else None
        usage = done.usage or {}
        n = int(usage.get("completion_tokens", turn["n"]))
        first = done.first_token_seconds or 0.0
        decode = done.seconds - first
        closed = done.finish == "stop"
        info = dict(
            failed=False, n=n, ids=[], prompt_ids=usage.get("prompt_tokens", 0), reused=0,
            seconds=done.seconds, first_token_seconds=first,
            s_per_token=done.seconds / n if n else 0.0,
            tokens_per_s=(n - 1) / decode if n > 1 and decode > 0 else 0.0,
            end_id="stop" if closed else None, end_name="the server (stop)" if closed else None,
            interrupted=done.finish == "cancelled", reasoning=reasoning, content=content,
            tail="", gen=spec.gen, thinking=spec.thinking, finish=done.finish, remote=True)
        info["stats"] = remote_stats(info, usage, self.where or
                                     f"remote {self.base_url}; {LOCAL_ONLY}")
        if not closed and turn["n"]:
            ids = done.extra.get("ids") or [-1] * n        # k3 serve says which ids
            self.conv.pending = PendingReply(list(ids), 0, 0, content, reasoning,
                                             "stopped" if info["interrupted"] else "limit",
                                             continuable=False)
        else:
            self.conv.pending = None
        self._set_busy(False)
        self.turnFinished.emit(info)
        if closed:
            try:
                self.history.add(Message("assistant", content, reasoning))
            except ChatError as e:
                self._fail(f"the reply could not be added to the conversation: {e}", "turn",
                           "ChatError")
        self._emit_conversation()

    def _set_busy(self, busy: bool) -> None:
        self.busy = busy
        self.busyChanged.emit(busy)


def remote_stats(info: dict, usage: dict, where: str) -> str:
    """The stats line under a remote reply: only what a remote run can tell."""
    n = info["n"]
    parts = [f"{n} token{'s' if n != 1 else ''}",
             f"first token {info['first_token_seconds']:.2f} s"]
    if info["tokens_per_s"]:
        parts.append(f"{info['tokens_per_s']:.1f} tokens/s")
    if usage.get("prompt_tokens") is not None:
        parts.append(f"prompt {usage['prompt_tokens']} tokens")
    reasoning = (usage.get("completion_tokens_details") or {}).get("reasoning_tokens")
    if reasoning is not None:
        parts.append(f"{reasoning} reasoning")
    parts.append(f"finish {info['finish']}")
    parts.append(where)
    return " · ".join(parts)
