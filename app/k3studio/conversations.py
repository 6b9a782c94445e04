"""Conversations on disk: one folder, one reference JSONL file per conversation.

Layout (`<AppDataLocation>/conversations/`, DESIGN "Conversations"):

  <id>.jsonl       the transcript, exactly SYSTEM §9.1 (`k3 --history <id>.jsonl` reads it)
  <id>.meta.json   everything §9.1 cannot hold: the title, times, the model it was run on,
                   and an incomplete last reply (stopped or limit-hit).  A reference reader
                   is given only the .jsonl and never opens this sidecar, so an incomplete
                   reply can never be mistaken for an official assistant turn: the .jsonl
                   of a conversation whose last reply is incomplete ends with the user
                   message (§9.4: an interrupted turn).
  .trash/          deleted conversations, until Undo or the next start (`purge_trash`)

Both files are created 0600 (they hold every message: DESIGN "Files that hold conversation
content").  Writes are atomic (the transcript via History.save, the sidecar via
atomic.write_atomic), so a crash leaves the previous version, never half a file.
"""
from __future__ import annotations

import json
import os
import secrets
import shutil
import time
from dataclasses import asdict, dataclass, field

from k3engine.atomic import write_atomic
from k3engine.chat import History, Message

FOLDER = "conversations"
TRASH = ".trash"
META_SUFFIX = ".meta.json"
TITLE_CHARS = 48
PRIVATE = 0o600


@dataclass
class Meta:
    id: str
    title: str = ""
    created: float = 0.0
    updated: float = 0.0
    model_dir: str = ""               # the model the conversation was last run on
    trunk_dir: str = ""
    tok_dir: str = ""
    # An incomplete last reply: {"content", "reasoning", "ids", "why"} (why: "stopped" or
    # "limit").  Held here, never in the .jsonl (see the module docstring).
    incomplete: dict | None = None
    extra: dict = field(default_factory=dict)

    @classmethod
    def from_json(cls, cid: str, raw: dict) -> "Meta":
        m = cls(cid)
        for k in ("title", "model_dir", "trunk_dir", "tok_dir"):
            if isinstance(raw.get(k), str):
                setattr(m, k, raw[k])
        for k in ("created", "updated"):
            if isinstance(raw.get(k), (int, float)):
                setattr(m, k, float(raw[k]))
        if isinstance(raw.get("incomplete"), dict):
            m.incomplete = raw["incomplete"]
        if isinstance(raw.get("extra"), dict):
            m.extra = raw["extra"]
        return m


def default_title(messages) -> str:
    """The first user message, on one line, shortened: what a person recognises."""
    for m in messages:
        role = m.role if isinstance(m, Message) else m["role"]
        if role == "user":
            text = " ".join((m.content if isinstance(m, Message) else m["content"]).split())
            return text if len(text) <= TITLE_CHARS else text[:TITLE_CHARS - 1] + "…"
    return "New conversation"


def history_of(messages: list[dict]) -> History:
    """The panels' message dicts (role, content, reasoning) as a validated History."""
    return History(Message(m["role"], m["content"],
                           m.get("reasoning") if m["role"] == "assistant" else None)
                   for m in messages)


def to_markdown(history: History, meta: Meta) -> str:
    """A readable export: the title, then each message under its speaker; reasoning is a
    quoted block, an incomplete reply is marked as such."""
    out = [f"# {meta.title or default_title(history)}", ""]
    names = {"system": "System", "user": "You", "assistant": "K3"}
    cut = set(meta.extra.get("incomplete_messages") or ())
    for i, m in enumerate(history):
        out.append(f"## {names[m.role]}" + (" (incomplete reply)" if i in cut else ""))
        out.append("")
        if m.reasoning_content:
            out.extend("> " + line for line in m.reasoning_content.splitlines())
            out.append("")
        out.append(m.content)
        out.append("")
    inc = meta.incomplete
    if inc and (inc.get("content") or inc.get("reasoning")):
        why = "stopped" if inc.get("why") == "stopped" else "reached the generation limit"
        out.append(f"## K3 (incomplete: {why})")
        out.append("")
        if inc.get("reasoning"):
            out.extend("> " + line for line in str(inc["reasoning"]).splitlines())
            out.append("")
        out.append(str(inc.get("content", "")))
        out.append("")
    return "\n".join(out)


class ConversationStore:
    """The conversations folder.  Ids are file names: `YYYYmmdd-HHMMSS-<hex>`."""

    def __init__(self, root: str):
        self.root = root
        os.makedirs(root, mode=0o700, exist_ok=True)

    # -- paths ------------------------------------------------------------------------
    def path(self, cid: str) -> str:
        return os.path.join(self.root, cid + ".jsonl")

    def _meta_path(self, cid: str, root: str | None = None) -> str:
        return os.path.join(root or self.root, cid + META_SUFFIX)

    @staticmethod
    def id_of(path: str) -> str:
        return os.path.basename(path)[:-len(".jsonl")]

    # -- reading ----------------------------------------------------------------------
    def ids(self) -> list[str]:
        try:
            names = os.listdir(self.root)
        except OSError:
            return []
        return [n[:-6] for n in names if n.endswith(".jsonl") and not n.startswith(".")]

    def meta(self, cid: str) -> Meta:
        """The sidecar; a missing or damaged one gives defaults (the transcript is what
        matters, and a person may drop any §9.1 file into the folder)."""
        try:
            with open(self._meta_path(cid), encoding="utf-8") as f:
                raw = json.load(f)
            m = Meta.from_json(cid, raw if isinstance(raw, dict) else {})
        except (OSError, ValueError):
            m = Meta(cid)
        if not m.updated:
            try:
                m.updated = m.created = os.path.getmtime(self.path(cid))
            except OSError:
                pass
        return m

    def load(self, cid: str) -> tuple[History, Meta]:
        """The transcript (History.load: strict, errors name PATH:N) and its sidecar."""
        history = History.load(self.path(cid))
        meta = self.meta(cid)
        if not meta.title:
            meta.title = default_title(history)
        return history, meta

    def list(self) -> list[Meta]:
        """Every conversation, most recently changed first."""
        metas = [self.meta(cid) for cid in self.ids()]
        for m in metas:
            if not m.title:
                try:
                    m.title = default_title(History.load(self.path(m.id)))
                except Exception:       # noqa: BLE001 - a damaged file still gets listed
                    m.title = m.id
        return sorted(metas, key=lambda m: (m.updated, m.id), reverse=True)

    def search(self, query: str) -> list[Meta]:
        """Conversations whose title or any message (content or reasoning) contains every
        word of the query, case-insensitively; an empty query lists them all."""
        words = query.lower().split()
        metas = self.list()
        if not words:
            return metas
        out = []
        for m in metas:
            try:
                with open(self.path(m.id), encoding="utf-8", errors="replace") as f:
                    hay = f.read().lower()
            except OSError:
                hay = ""
            # the JSONL escapes newlines and quotes; search the decoded texts instead
            texts = [m.title.lower()]
            for line in hay.splitlines():
                try:
                    rec = json.loads(line)
                except ValueError:
                    continue
                texts.extend(str(v) for k, v in rec.items() if k != "role")
            inc = m.incomplete or {}
            texts.extend(str(inc.get(k, "")).lower() for k in ("content", "reasoning"))
            blob = "\n".join(texts)
            if all(w in blob for w in words):
                out.append(m)
        return out

    # -- writing ----------------------------------------------------------------------
    def new_id(self) -> str:
        while True:
            cid = time.strftime("%Y%m%d-%H%M%S") + "-" + secrets.token_hex(3)
            if not os.path.exists(self.path(cid)):
                return cid

    def save(self, cid: str, history: History, meta: Meta) -> None:
        """Rewrite both files (History.save is mkstemp-based: 0600)."""
        now = time.time()
        meta.created = meta.created or now
        meta.updated = now
        if not meta.title:
            meta.title = default_title(history)
        history.save(self.path(cid))
        self.save_meta(meta)

    def save_meta(self, meta: Meta) -> None:
        data = json.dumps({k: v for k, v in asdict(meta).items() if k != "id"},
                          ensure_ascii=False, indent=1).encode("utf-8")
        write_atomic(self._meta_path(meta.id), data, mode=PRIVATE)

    def rename(self, cid: str, title: str) -> Meta:
        meta = self.meta(cid)
        meta.title = " ".join(title.split()) or meta.title
        self.save_meta(meta)
        return meta

    def delete(self, cid: str) -> None:
        """Move the conversation to the trash (Undo puts it back; the next start empties
        the trash)."""
        trash = os.path.join(self.root, TRASH)
        os.makedirs(trash, mode=0o700, exist_ok=True)
        for src in (self.path(cid), self._meta_path(cid)):
            if os.path.exists(src):
                os.replace(src, os.path.join(trash, os.path.basename(src)))

    def undo_delete(self, cid: str) -> bool:
        trash = os.path.join(self.root, TRASH)
        back = False
        for name in (cid + ".jsonl", cid + META_SUFFIX):
            src = os.path.join(trash, name)
            if os.path.exists(src):
                os.replace(src, os.path.join(self.root, name))
                back = True
        return back

    def purge_trash(self) -> None:
        shutil.rmtree(os.path.join(self.root, TRASH), ignore_errors=True)

    # -- export -----------------------------------------------------------------------
    def export_jsonl(self, cid: str, dest: str) -> None:
        """A plain §9.1 copy (the sidecar stays behind: the export is what k3 reads)."""
        history, _ = self.load(cid)
        history.save(dest)

    def export_markdown(self, cid: str, dest: str) -> None:
        history, meta = self.load(cid)
        write_atomic(dest, to_markdown(history, meta).encode("utf-8"), mode=PRIVATE)


def default_root(data_dir: str) -> str:
    return os.path.join(data_dir, FOLDER)
