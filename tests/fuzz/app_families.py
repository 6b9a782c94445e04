"""Fuzz families for K3 Studio's own files (issue 47): a conversation's meta.json and
transcript, remote_keys.json and the settings file, each damaged the ways families.py
damages the engine's inputs, then read by the app's real loaders.

The property: the app's loaders never raise (but opening a damaged transcript, which
raises ChatError naming it); a file they cannot use is moved to `damaged/` with its bytes
unchanged (never deleted); the other conversation in the folder is always listed and found
by search; a conversation whose files were read saves and exports again; no key stored in
remote_keys.json is lost; every settings value is finite, within its range and one of its
choices.
"""
from __future__ import annotations

import json
import logging
import math
import os
import shutil
import tempfile

from hypothesis import strategies as st

from k3engine.chat import ChatError, History, Message

from .families import JSON_ODD, SOME_EDITS, WORK, Family, Violation, history_lines, raw_edit

# the loaders log each file they move aside: thousands of lines in a run, not wanted here
logging.getLogger("k3studio").addHandler(logging.NullHandler())

GOOD = "20260101-000000-aaaaaa"
CASE = "20260102-000000-bbbbbb"


def in_folder(what: str):
    """check(data) run as check(data, folder) in a fresh folder (removed after); an
    exception other than Violation breaks the property (it would be a traceback)."""
    def wrap(check):
        def run(data):
            folder = tempfile.mkdtemp(dir=WORK)
            try:
                return check(data, folder)
            except Violation:
                raise
            except BaseException as e:
                raise Violation(f"{what}: {type(e).__name__}: {e}") from e
            finally:
                shutil.rmtree(folder, ignore_errors=True)
        return run
    return wrap


def _damaged_copies(folder: str, name: str) -> list[bytes]:
    d = os.path.join(folder, "damaged")
    if not os.path.isdir(d):
        return []
    out = []
    for n in sorted(os.listdir(d)):
        if n.startswith(name + "."):
            with open(os.path.join(d, n), "rb") as f:
                out.append(f.read())
    return out


def _deep(draw) -> bytes:
    n = draw(st.sampled_from([70, 1000, 100_000]))
    return draw(st.sampled_from([b"[" * n, b"[" * n + b"]" * n, b'{"a":' * n + b"1" + b"}" * n]))


# --- a conversation's meta.json --------------------------------------------------------------

@st.composite
def meta_bytes(draw) -> bytes:
    if draw(st.integers(0, 9)) == 0:
        return _deep(draw)
    doc: object = {"title": "Case", "created": 1.0, "updated": 2.0, "model_dir": "",
                   "incomplete": {"content": "cut", "reasoning": None, "ids": [1, 2],
                                  "why": "stopped"},
                   "extra": {"incomplete_messages": [1]}}
    for _ in range(draw(st.integers(0, 3))):
        key = draw(st.sampled_from(["title", "created", "updated", "model_dir", "incomplete",
                                    "extra", "id"]))
        doc[key] = draw(st.one_of(JSON_ODD, st.just("\ud800"), st.just({"content": 5}),
                                  st.just({"incomplete_messages": draw(JSON_ODD)})))
    if draw(st.integers(0, 8)) == 0:
        doc = draw(JSON_ODD)
    text = json.dumps(doc, ensure_ascii=draw(st.booleans()))
    return raw_edit(text.encode("utf-8", "surrogatepass"), draw(SOME_EDITS))


def _store_with(folder: str, transcript: bytes | None, meta: bytes | None):
    from k3studio.conversations import ConversationStore, Meta
    root = os.path.join(folder, "conversations")
    store = ConversationStore(root)
    store.save(GOOD, History([Message("user", "hello good"), Message("assistant", "hi")]),
               Meta(GOOD, title="Good"))
    for name, data in ((CASE + ".jsonl", transcript), (CASE + ".meta.json", meta)):
        if data is not None:
            with open(os.path.join(root, name), "wb") as f:
                f.write(data)
    return store, root


def _common(store, root: str, name: str, data: bytes) -> str:
    """The checks every conversation family shares; returns the outcome."""
    listed = {m.id for m in store.list()}
    if GOOD not in listed or GOOD not in {m.id for m in store.search("hello")}:
        raise Violation("the good conversation is missing from the list or the search")
    store.search("case x")
    moved = _damaged_copies(root, name)
    if moved:
        if moved != [data]:
            raise Violation(f"{name} was moved aside with other bytes")
        if os.path.lexists(os.path.join(root, name)):
            raise Violation(f"{name} was moved aside but is still in the folder")
        return "moved aside"
    if not os.path.exists(os.path.join(root, name)):
        raise Violation(f"{name} disappeared without being moved aside")
    return "read"


@in_folder("meta.json")
def check_meta(data: bytes, folder: str) -> str:
    store, root = _store_with(folder, b'{"role":"user","content":"case"}\n', data)
    outcome = _common(store, root, CASE + ".meta.json", data)
    history, meta = store.load(CASE)
    store.save(CASE, history, meta)
    store.export_markdown(CASE, os.path.join(folder, "out.md"))
    store.load(CASE)
    return outcome


# --- a conversation's transcript -------------------------------------------------------------

@st.composite
def transcript_bytes(draw) -> bytes:
    if draw(st.integers(0, 9)) == 0:
        return _deep(draw) + b"\n"
    lines = [b'{"role":"user","content":"case one"}\n']
    for _ in range(draw(st.integers(0, 3))):
        lines.append(draw(history_lines()))
    return b"".join(lines)


@in_folder("transcript")
def check_transcript(data: bytes, folder: str) -> str:
    store, root = _store_with(folder, data, b'{"title": "Case"}')
    outcome = _common(store, root, CASE + ".jsonl", data)
    if outcome == "read":
        try:
            history, meta = store.load(CASE)
        except ChatError as e:
            if CASE not in str(e) or _damaged_copies(root, CASE + ".jsonl") != [data]:
                raise Violation(f"a refused transcript not named or not kept: {e}") from e
            return "moved aside on open"
        store.save(CASE, history, meta)
        store.export_markdown(CASE, os.path.join(folder, "out.md"))
    return outcome


# --- remote_keys.json -------------------------------------------------------------------------

@st.composite
def key_bytes(draw) -> bytes:
    if draw(st.integers(0, 9)) == 0:
        return _deep(draw)
    doc: object = {"https://a": "k1", "https://b": "k2"}
    for _ in range(draw(st.integers(0, 2))):
        doc[draw(st.sampled_from(["https://a", "https://c", "\ud800", ""]))] = draw(
            st.one_of(JSON_ODD, st.just("k3")))
    if draw(st.integers(0, 8)) == 0:
        doc = draw(JSON_ODD)
    text = json.dumps(doc, ensure_ascii=draw(st.booleans()))
    return raw_edit(text.encode("utf-8", "surrogatepass"), draw(SOME_EDITS))


@in_folder("remote_keys.json")
def check_keys(data: bytes, folder: str) -> str:
    from k3studio.secrets_store import KeyStore
    os.environ["K3STUDIO_KEY_STORE"] = "file"
    try:
        path = os.path.join(folder, "remote_keys.json")
        with open(path, "wb") as f:
            f.write(data)
        ks = KeyStore(folder)
        ks.set("https://new", "kn")
        moved = _damaged_copies(folder, "remote_keys.json")
        if moved:                           # every key kept: the file's bytes, unchanged
            if moved != [data]:
                raise Violation("remote_keys.json was moved aside with other bytes")
        else:                               # read: every key in it still there
            before = json.loads(data)
            if not isinstance(before, dict) or not all(isinstance(v, str)
                                                       for v in before.values()):
                raise Violation("a key file that is not all text keys was read, not kept")
            for url, key in before.items():
                if url != "https://new" and ks.get(url) != key:
                    raise Violation(f"the key of {url!r} was lost")
        if ks.get("https://new") != "kn":
            raise Violation("the new key was not stored")
        return "moved aside" if moved else "read"
    finally:
        os.environ.pop("K3STUDIO_KEY_STORE", None)


# --- the settings file ------------------------------------------------------------------------

SETTING_VALUES = st.one_of(
    st.sampled_from(["inf", "-inf", "nan", "1e400", "-99999999999", "9" * 20, "-1", "0",
                     "3.5", "true", "", "@ByteArray(x)", "lru", "dark", "max", "\u00b2"]),
    st.integers(-2**70, 2**70).map(str), st.floats().map(repr), st.text(max_size=8))


@st.composite
def settings_text(draw) -> bytes:
    from dataclasses import fields

    from k3studio.settings import StudioSettings
    names = [f.name for f in fields(StudioSettings)] + ["expert_cache_gb", "effort_level"]
    lines = ["[General]"]
    for _ in range(draw(st.integers(1, 8))):
        value = draw(SETTING_VALUES).replace("\n", " ").replace("\r", " ")
        lines.append(f"{draw(st.sampled_from(names))}={value}")
    return raw_edit("\n".join(lines).encode("utf-8", "surrogatepass") + b"\n",
                    draw(SOME_EDITS))


@in_folder("settings")
def check_settings(data: bytes, folder: str) -> str:
    from PySide6.QtCore import QSettings

    from k3studio import settings as S
    path = os.path.join(folder, "s.ini")
    with open(path, "wb") as f:
        f.write(data)
    warned = _Count()
    S.log.addHandler(warned)
    try:
        s = S.load(QSettings(path, QSettings.IniFormat))
    finally:
        S.log.removeHandler(warned)
    for name, (lo, hi) in S.RANGES.items():
        v = getattr(s, name)
        if not (isinstance(v, (int, float)) and math.isfinite(v) and lo <= v <= hi):
            raise Violation(f"settings: {name} = {v!r} after load")
    for name, choices in S.CHOICES.items():
        if getattr(s, name) not in choices:
            raise Violation(f"settings: {name} = {getattr(s, name)!r} after load")
    S.save(QSettings(path, QSettings.IniFormat), s)
    return "clamped or defaulted" if warned.n else "read"


class _Count(logging.Handler):
    def __init__(self):
        super().__init__()
        self.n = 0

    def emit(self, record) -> None:
        self.n += 1


APP_FAMILIES = [
    Family("app meta.json", meta_bytes(), check_meta),
    Family("app transcript", transcript_bytes(), check_transcript),
    Family("app key file", key_bytes(), check_keys),
    Family("app settings", settings_text(), check_settings),
]
