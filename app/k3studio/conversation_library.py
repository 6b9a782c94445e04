"""Which conversation is open, kept saved: the glue between the engine's transcript, the
conversations folder and the sidebar.

Every snapshot of the transcript the engine sends (after each accepted message and each
turn) is written to the open conversation's files -- nothing waits for a Save.  A
conversation gets its files with its first user message, so New never leaves empty files
behind and never loses the previous conversation (it stays in the list).  Opening one
restores its transcript on the engine and, when the model it was run on is on disk and is
not the one loaded, selects and loads that model (`wantsModel`).
"""
from __future__ import annotations

import os

from PySide6.QtCore import QObject, Signal

from .conversations import ConversationStore, Meta, history_of


class ConversationLibrary(QObject):
    changed = Signal(str)             # the open conversation (id, "" = new) or its entry
    switched = Signal(str)            # another conversation is open (new: "")
    wantsModel = Signal(str, str, str)    # model_dir, trunk_dir, tok_dir to load
    failed = Signal(str)              # a file could not be written or read: why

    def __init__(self, store: ConversationStore, host, parent=None):
        super().__init__(parent)
        self.store = store
        self.host = host
        self.current: str | None = None
        self.meta: Meta | None = None
        self.model: tuple[str, str, str] = ("", "", "")   # what the engine has loaded
        self._saved: list[dict] | None = None
        self._opening = False
        self._next_incomplete: dict | None = None
        # the chat's host (this machine, a remote endpoint) and each one's open conversation
        self.backend: dict | None = None  # a remote host's endpoint and model, for the meta
        self._key = "local"
        self._parked: dict[str, tuple] = {}
        # the reply being generated, saved as an incomplete reply as its first tokens come
        # and then about once a second, so a crash (kill -9) loses at most that much of it;
        # the next start shows it, and Continue resumes it (issue 47)
        self._draft = None               # conversation.ReplyDraft while a turn streams
        self._paused = False             # carry_to: the chat is changing hosts
        host.conversation.connect(self._snapshot)
        host.pendingChanged.connect(self._pending)
        host.turnStarted.connect(self._turn_started)
        host.records.connect(self._streamed)
        host.turnFinished.connect(self._turn_finished)

    # -- the open conversation ----------------------------------------------------------
    @property
    def path(self) -> str:
        return self.store.path(self.current) if self.current else ""

    def new(self, system_prompt: str = "") -> None:
        self.current, self.meta, self._saved = None, None, None
        self._next_incomplete = None
        self.host.new_conversation(system_prompt)
        self.switched.emit("")
        self.changed.emit("")

    def open(self, cid: str) -> bool:
        """Open a conversation of the folder; False (and `failed`) when it cannot be read."""
        try:
            history, meta = self.store.load(cid)
        except Exception as e:          # noqa: BLE001 - shown, the open one stays
            path = self.store.path(cid)
            self.failed.emit(str(e) if str(e).startswith(path) else f"{path}: {e}")
            return False
        self.current, self.meta = cid, meta
        self._saved = None
        self._opening = True
        self.host.open_conversation(self.store.path(cid), self._sidecar())
        self.switched.emit(cid)
        self.changed.emit(cid)
        want = (meta.model_dir, meta.trunk_dir, meta.tok_dir)
        if (meta.model_dir and want != self.model
                and os.path.isfile(os.path.join(meta.model_dir, "config.json"))):
            self.wantsModel.emit(*want)
        return True

    def _sidecar(self) -> dict:
        """What a host opening the conversation needs from its meta file."""
        return dict(incomplete=self.meta.incomplete,
                    incomplete_messages=self.meta.extra.get("incomplete_messages", []))

    def carry_to(self, host, switch, system_prompt: str = "") -> None:
        """The same conversation on another host (the app's engine <-> its local server's
        slot): `host` opens it as saved (or starts empty with `system_prompt` when nothing
        was said), then `switch()` makes it the host the chat talks to.  Nothing is
        written meanwhile: the host left behind still reports its own, older state as the
        switch happens, and it must not overwrite the file."""
        self._paused = True
        try:
            if self.current:
                host.open_conversation(self.path, self._sidecar())
            else:
                host.new_conversation(system_prompt)
            switch()
        finally:
            self._paused = False

    def import_file(self, path: str) -> str | None:
        """A §9.1 file from anywhere becomes a conversation of the folder (a copy)."""
        from k3engine.chat import History
        try:
            history = History.load(path)
        except Exception as e:          # noqa: BLE001
            self.failed.emit(str(e))
            return None
        cid = self.store.new_id()
        self.store.save(cid, history, Meta(cid, title=os.path.splitext(
            os.path.basename(path))[0]))
        self.open(cid)
        return cid

    def forget(self, cid: str) -> None:
        """The open conversation was deleted: continue in a new one."""
        if cid == self.current:
            self.new(next((m["content"] for m in self.host.messages
                           if m["role"] == "system"), ""))

    def follow(self, key: str, backend: dict | None = None) -> None:
        """The chat now talks to another host (`key`: "local" or "remote"): each keeps its
        own open conversation, saved and listed alike; the one it had comes back (none for
        a host seen the first time).  `backend` (a remote endpoint and model) goes into the
        meta of what it saves."""
        self.backend = backend
        if key == self._key:
            return
        self._parked[self._key] = (self.current, self.meta, self._saved,
                                   self._next_incomplete)
        self._key = key
        self.current, self.meta, self._saved, self._next_incomplete = \
            self._parked.pop(key, (None, None, None, None))
        self.switched.emit(self.current or "")
        self.changed.emit(self.current or "")

    def set_model(self, model_dir: str, trunk_dir: str, tok_dir: str) -> None:
        """The model now loaded; the open conversation remembers it from its next save."""
        self.model = (model_dir, trunk_dir, tok_dir)

    def _pending(self, p: dict | None) -> None:
        """A stopped or limit-hit reply (or None once it is completed, answered or
        dropped): kept in the sidecar, never in the .jsonl (conversations.py)."""
        if self._opening or self._paused:
            return                       # the one just read from the sidecar
        inc = {k: v for k, v in p.items() if k != "continuable"} if p else None
        if self.meta is None and inc is None:
            return
        if self.meta is not None and self.meta.incomplete == inc:
            return
        self._next_incomplete = inc
        if self.meta is not None:
            self.meta.incomplete = inc
            self._write(self.host.messages, force=True)

    # -- the reply being generated (crash safety) ----------------------------------------
    def _turn_started(self, info: dict) -> None:
        from k3engine.conversation import ReplyDraft
        prior = info.get("prior") or {}
        self._draft = ReplyDraft(prior.get("ids") or (), prior.get("content") or "",
                                 prior.get("reasoning") or ("" if info.get("thinking")
                                                            else None))

    def _streamed(self, records: list) -> None:
        d = self._draft
        if d is None:
            return
        for r in records:
            d.push(r.get("id", -1), r.get("phase"), r.get("text_delta") or "")
        if d.due():
            self._pending(d.as_dict())

    def _turn_finished(self, _info) -> None:
        self._draft = None               # the engine's own pending (or none) follows it

    def set_reply_stats(self, stats: dict) -> None:
        """Each reply's figures (the chat panel's, by transcript index), kept in the meta
        file so they show again when the conversation is reopened."""
        if self.meta is None or self.meta.extra.get("reply_stats", {}) == stats:
            return
        if stats:
            self.meta.extra["reply_stats"] = stats
        else:
            self.meta.extra.pop("reply_stats", None)
        try:
            self.store.save_meta(self.meta)
        except Exception as e:          # noqa: BLE001 - the figures stay on screen
            self.failed.emit(f"could not save the conversation: {e}")

    # -- saving -------------------------------------------------------------------------
    def _snapshot(self, msgs: list) -> None:
        if self._paused:
            return
        if self._opening:                # the transcript just read: nothing new to write
            self._opening = False
            self._saved = list(msgs)
            return
        self._write(msgs)

    def _write(self, msgs: list, force: bool = False) -> None:
        if not any(m["role"] == "user" for m in msgs):
            return                       # nothing said yet: no file
        if not force and msgs == self._saved:
            return
        if self.current is None:
            self.current = self.store.new_id()
            self.meta = Meta(self.current, incomplete=self._next_incomplete)
            self.changed.emit(self.current)
        meta = self.meta
        # replies that were cut short and then answered: in the transcript (they are the
        # context of what follows), marked here for the app and the Markdown export
        marks = [i for i, m in enumerate(msgs) if m.get("incomplete")]
        if marks:
            meta.extra["incomplete_messages"] = marks
        else:
            meta.extra.pop("incomplete_messages", None)
        if self.backend:
            meta.extra["backend"] = dict(self.backend)
        else:
            meta.extra.pop("backend", None)
            if self.model[0]:
                meta.model_dir, meta.trunk_dir, meta.tok_dir = self.model
        try:
            self.store.save(self.current, history_of(msgs), meta)
        except Exception as e:          # noqa: BLE001 - the transcript stays on the engine
            self.failed.emit(f"could not save the conversation: {e}")
            return
        self._saved = list(msgs)
        self.changed.emit(self.current)   # the list refreshes (new title, new order)
