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
  damaged/         files that could not be read, moved aside (damaged.py), never deleted

Both files are created 0600 (they hold every message: DESIGN "Files that hold conversation
content").  Writes are atomic (atomic.write_atomic, both files), so a crash leaves the
previous version, never half a file.  The
folder is the app's own: a link planted in it is refused, never written through (issue 47),
and a file in it that cannot be read is moved aside without stopping anything else.
"""
from __future__ import annotations

import json
import logging
import os
import secrets
import shutil
import time
from dataclasses import asdict, dataclass, field

from k3engine.atomic import open_dir, write_atomic
from k3engine.chat import HISTORY_LIMIT, ChatError, History, Message
from k3engine.inputfile import InputFileError, read_regular_file

from .damaged import (DamagedFile, check_regular, check_regular_dir, move_aside,
                      read_json_object)

log = logging.getLogger("k3studio")

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
        m.incomplete = _incomplete(cid, raw.get("incomplete"))
        if isinstance(raw.get("extra"), dict):
            m.extra = dict(raw["extra"])
            marks = m.extra.get("incomplete_messages")
            if marks is not None and not (isinstance(marks, list) and all(
                    type(i) is int and 0 <= i < 1 << 31 for i in marks)):
                # the worker and the Markdown export index with these (issue 47: a badly
                # typed list crashed the export): dropped, not guessed at
                log.warning("%s: incomplete_messages %.80r is not a list of message "
                            "indices; ignored", cid, marks)
                del m.extra["incomplete_messages"]
        return m


_INCOMPLETE_TYPES = {"content": (str,), "reasoning": (str, type(None)), "why": (str,),
                     "ids": (list,)}


def _incomplete(cid: str, raw) -> dict | None:
    """The sidecar's incomplete reply with its known fields of the right type only (a
    wrong type is dropped and logged, so nothing downstream meets a number as text)."""
    if raw is None:
        return None
    if not isinstance(raw, dict):
        log.warning("%s: incomplete reply is not an object; ignored", cid)
        return None
    out = {}
    for k, v in raw.items():
        kinds = _INCOMPLETE_TYPES.get(k)
        if kinds is None or isinstance(v, kinds) and (
                k != "ids" or all(type(t) is int and 0 <= t < 1 << 31 for t in v)):
            out[k] = v
        else:
            log.warning("%s: incomplete reply field %r has a wrong type; ignored", cid, k)
    return out if out.get("content") or out.get("reasoning") else None


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


def restored(path: str, extra: dict | None, continuable: bool = True):
    """A conversation file as a host opens it: (history, the indices of replies that were
    cut short and then answered, the incomplete last reply or None).  `extra` is what the
    sidecar holds ({"incomplete": ..., "incomplete_messages": [...]}); the reply's engine
    state is gone, so it is continuable only when its ids are known and the host can
    resume from them (`continuable`: this machine's engine, not a remote one)."""
    from k3engine.conversation import PendingReply
    history = History.load(path)
    x = extra or {}
    marks = {int(i) for i in x.get("incomplete_messages") or () if 0 <= int(i) < len(history)}
    p = x.get("incomplete")
    ids = [int(i) for i in (p.get("ids") or ()) if isinstance(i, int)] if p else []
    pending = PendingReply(ids, 0, 0, p.get("content") or "", p.get("reasoning"),
                           p.get("why") or "stopped",
                           continuable=continuable and bool(ids) and min(ids) >= 0) \
        if p and history.ends_with_user else None
    return history, marks, pending


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
        fd = open_dir(root)
        try:
            os.fchmod(fd, 0o700)    # a folder an older version made with the umask's mode
        except OSError:
            pass                    # not ours to change: the files in it are 0600 anyway
        finally:
            os.close(fd)

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
        """The sidecar; a missing one gives defaults (the transcript is what matters, and a
        person may drop any §9.1 file into the folder), a damaged one is moved aside."""
        path = self._meta_path(cid)
        try:
            m = Meta.from_json(cid, read_json_object(path, "conversation metadata") or {})
        except DamagedFile as e:
            move_aside(path, e.problem)
            m = Meta(cid)
        if not m.updated:
            try:
                m.updated = m.created = os.path.getmtime(self.path(cid))
            except OSError:
                pass
        return m

    def _transcript(self, cid: str) -> History:
        """History.load (strict, errors name PATH:N) of a regular file of the folder; a
        transcript it refuses is moved aside with its sidecar and ChatError raised."""
        path = self.path(cid)
        try:
            check_regular(path, HISTORY_LIMIT)
            return History.load(path)
        except (DamagedFile, ChatError) as e:
            why = e.problem if isinstance(e, DamagedFile) else str(e).removeprefix(path + ":")
            self.set_aside(cid, why.strip())
            raise ChatError(f"{path}: {why.strip()} (moved to the damaged folder)") from None

    def set_aside(self, cid: str, why: str) -> None:
        """Move a damaged conversation's files to damaged/ (never deleted)."""
        for p in (self.path(cid), self._meta_path(cid)):
            if os.path.lexists(p):
                move_aside(p, why if p == self.path(cid) else "its transcript is damaged")

    def load(self, cid: str) -> tuple[History, Meta]:
        """The transcript and its sidecar."""
        history = self._transcript(cid)
        meta = self.meta(cid)
        if not meta.title:
            meta.title = default_title(history)
        return history, meta

    def list(self) -> list[Meta]:
        """Every conversation, most recently changed first; one that cannot be read is
        moved aside (damaged.py) and the others are listed."""
        metas = []
        for cid in self.ids():
            try:
                check_regular(self.path(cid), HISTORY_LIMIT)
                m = self.meta(cid)
                if not m.title:
                    m.title = default_title(self._transcript(cid))
            except DamagedFile as e:
                self.set_aside(cid, e.problem)
                continue
            except ChatError:
                continue                # _transcript moved it aside
            metas.append(m)
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
                hay = read_regular_file(self.path(m.id), HISTORY_LIMIT, "history").decode(
                    "utf-8", "replace").lower()
            except InputFileError:
                hay = ""
            # the JSONL escapes newlines and quotes; search the decoded texts instead
            texts = [m.title.lower()]
            for line in hay.splitlines():
                try:
                    rec = json.loads(line)
                except (ValueError, RecursionError):
                    continue
                if isinstance(rec, dict):   # a valid JSON line that is no record: skipped
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
        """Rewrite both files, 0600, never through a link planted in the folder (History
        checked every message's line length as it was added: what History.save checks)."""
        now = time.time()
        meta.created = meta.created or now
        meta.updated = now
        if not meta.title:
            meta.title = default_title(history)
        write_atomic(self.path(cid), history.to_jsonl(), mode=PRIVATE, inside=self.root)
        self.save_meta(meta)

    def save_meta(self, meta: Meta) -> None:
        # A lone surrogate (no UTF-8 file can hold one) is written as "?": before, it failed
        # this save and every later one of the conversation (issue 47).
        data = json.dumps({k: v for k, v in asdict(meta).items() if k != "id"},
                          ensure_ascii=False, indent=1).encode("utf-8", "replace")
        write_atomic(self._meta_path(meta.id), data, mode=PRIVATE, inside=self.root)

    def rename(self, cid: str, title: str) -> Meta:
        meta = self.meta(cid)
        meta.title = " ".join(title.split()) or meta.title
        self.save_meta(meta)
        return meta

    def delete(self, cid: str) -> None:
        """Move the conversation to the trash (Undo puts it back; the next start empties
        the trash)."""
        self._move(cid, to_trash=True)

    def undo_delete(self, cid: str) -> bool:
        return self._move(cid, to_trash=False)

    def _move(self, cid: str, to_trash: bool) -> bool:
        """Between the folder and .trash/, by directory descriptors: a .trash that is a
        link is refused, never used to move a conversation out of the folder."""
        path = os.path.join(self.root, TRASH)
        try:
            check_regular_dir(path)
        except DamagedFile as e:
            move_aside(path, e.problem)
        root = open_dir(self.root)
        try:
            trash = open_dir(path, inside=self.root, create=True)
        except BaseException:
            os.close(root)
            raise
        src, dst = (root, trash) if to_trash else (trash, root)
        moved = False
        try:
            for name in (cid + ".jsonl", cid + META_SUFFIX):
                try:
                    os.replace(name, name, src_dir_fd=src, dst_dir_fd=dst)
                    moved = True
                except FileNotFoundError:
                    pass
        finally:
            os.close(root)
            os.close(trash)
        return moved

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
