"""Chat (SYSTEM §9): messages and history, the JSONL transcript, exact XTML rendering,
segment-wise encoding, the strict assistant-turn parser, prefix reuse and REPL helpers.

The tokenizer is duck-typed: ``encode(text, allow_special) -> list[int]``,
``decode(ids) -> bytes``, ``id_of(content) -> int | None``, and optionally ``added``
(a mapping whose keys are the added-token ids). Control ids come from
``k3engine.tokenizer.control_ids`` (an object with ``bos, eos, end_of_msg, open, close, sep``
and ``end_ids``), never from hard-coded numbers, so a model with our own vocabulary chats too.

Nothing here prints or exits: refusals raise `ChatError` with the reason, and the caller
(CLI or app) decides the stream and the exit code (§9.3, §9.6).
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Iterable, Iterator, Sequence

from .atomic import open_nofollow, write_atomic
from .errors import EXIT_USAGE, EngineError
from .inputfile import InputFileError, read_regular_file

__all__ = [
    "ChatError", "Message", "ChatOptions", "History", "HistoryLock", "EFFORTS", "effort_text",
    "render_segments", "render_text", "encode_prompt", "parse_reply", "reuse_positions",
    "apply_system", "classify_line", "MAX_PROMPT_IDS", "MAX_LINE_BYTES", "HELP_LINES",
    "USER_PROMPT", "banner_line", "progress_line", "turn_end_line", "reply_text", "reuse_line",
]

SYSTEM, USER, ASSISTANT = "system", "user", "assistant"
ROLES = (SYSTEM, USER, ASSISTANT)

# The checkpoint's encoder accepts only these (_VALID_THINKING_EFFORTS); the effort text lists
# `medium` too, but it is refused as a value.
EFFORTS = ("low", "high", "max")

MAX_PROMPT_IDS = 32_768           # K3_MAX_PROMPT; more is a render refusal (§9.3)
MAX_LINE_BYTES = 16 * 1024 * 1024  # longest JSONL line the reader accepts (§9.1)
HISTORY_LIMIT = 1 << 30           # /dev/zero as --history was read until memory ran out

CTL, TXT = "ctl", "txt"
OPEN, CLOSE, SEP, END_OF_MSG = "<|open|>", "<|close|>", "<|sep|>", "<|end_of_msg|>"

USER_PROMPT = "user> "
HELP_LINES = ("/help  show commands", "/reset clear this conversation", "/exit  leave chat")


class ChatError(EngineError):
    prefix = "chat"
    """A refused chat operation; str() is the reason the caller prints (e.g. `chat: <reason>`)."""


# --------------------------------------------------------------------------- messages


def _check_text(what: str, text: object) -> str:
    if not isinstance(text, str):
        raise ChatError(f"{what} is not a string")
    # NUL cannot be stored: the JSONL reader refuses \u0000 (the C engine's strings end there).
    if "\x00" in text:
        raise ChatError(f"{what} contains a NUL character")
    # A lone surrogate has no UTF-8 form: it could be neither encoded nor saved.
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise ChatError(f"{what} is not valid Unicode (lone surrogate)") from None
    return text


@dataclass(frozen=True)
class Message:
    role: str
    content: str
    reasoning_content: str | None = None

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ChatError(f"unknown role {self.role!r} (expected system, user or assistant)")
        _check_text(f"{self.role} content", self.content)
        if self.reasoning_content is not None:
            if self.role != ASSISTANT:
                raise ChatError(f"reasoning_content is only allowed on assistant messages, "
                                f"not on {self.role}")
            _check_text("assistant reasoning_content", self.reasoning_content)


@dataclass(frozen=True)
class ChatOptions:
    """`thinking=False` is `--no-think`; `effort` is `--thinking-effort` (low, high or max)."""
    thinking: bool = True
    effort: str = "max"

    def __post_init__(self) -> None:
        if self.effort not in EFFORTS:
            raise ChatError(f"thinking_effort must be low, high or max, got {self.effort!r}")


def effort_text(effort: str) -> str:
    """The thinking-effort system message body, verbatim (§9.2); one newline after the first
    sentence. Rendered as ONE text segment: BPE merges across `=max`."""
    if effort not in EFFORTS:
        raise ChatError(f"thinking_effort must be low, high or max, got {effort!r}")
    return ("`thinking_effort` guides on how much to think in your thinking channel (not including "
            "the response channel), supported values include `low`, `medium`, `high`, and `max`.\n"
            f"Now the system is invoked with `thinking_effort={effort}`.")


# --------------------------------------------------------------------------- history


def _expected_role(index: int, first_is_system: bool) -> str:
    """Role required at position `index`: optional system first, then user, assistant, ..."""
    k = index - 1 if first_is_system else index
    return USER if k % 2 == 0 else ASSISTANT


def _position_error(messages: Sequence[Message], index: int) -> str | None:
    """Why messages[index] may not follow messages[:index], or None."""
    m = messages[index]
    if m.role == SYSTEM:
        return None if index == 0 else f"a system message may only come first (message {index + 1})"
    want = _expected_role(index, bool(messages) and messages[0].role == SYSTEM)
    if m.role != want:
        return f"message {index + 1} has role '{m.role}', expected '{want}'"
    return None


class History:
    """A valid transcript (§9.1). Every change keeps it valid: a message that would break the
    rules is refused with `ChatError` and not added."""

    def __init__(self, messages: Iterable[Message] = ()):
        self._messages: list[Message] = []
        for m in messages:
            self.add(m)

    # -- access
    @property
    def messages(self) -> tuple[Message, ...]:
        return tuple(self._messages)

    def __len__(self) -> int:
        return len(self._messages)

    def __iter__(self) -> Iterator[Message]:
        return iter(tuple(self._messages))

    def __getitem__(self, i: int) -> Message:
        return self._messages[i]

    def __eq__(self, other: object) -> bool:
        return isinstance(other, History) and self._messages == other._messages

    def __repr__(self) -> str:
        return f"History({self._messages!r})"

    @property
    def system(self) -> Message | None:
        return self._messages[0] if self._messages and self._messages[0].role == SYSTEM else None

    @property
    def ends_with_user(self) -> bool:
        """An interrupted turn: the REPL resumes it instead of reading a line (§9.4)."""
        return bool(self._messages) and self._messages[-1].role == USER

    def assistant_count(self) -> int:
        """`turn0` of the sampler's turn index (§9.5)."""
        return sum(m.role == ASSISTANT for m in self._messages)

    # -- changes
    def add(self, message: Message) -> None:
        if not isinstance(message, Message):
            raise ChatError(f"not a chat message: {message!r}")
        why = _position_error(self._messages + [message], len(self._messages))
        if why:
            raise ChatError(why)
        _check_savable(message)
        self._messages.append(message)

    def remove_last(self) -> Message:
        """Undo the just-added user message after a render refusal (§9.3, later turns)."""
        if not self._messages:
            raise ChatError("history is empty")
        return self._messages.pop()

    def reset(self) -> None:
        """`/reset`: drop everything except an initial system message."""
        del self._messages[1 if self.system is not None else 0:]

    # -- JSONL file
    @classmethod
    def load(cls, path: str | os.PathLike) -> "History":
        """Read a `--history` file strictly (§9.1). A missing file is an empty history; every
        refusal names `PATH:N`."""
        path = os.fspath(path)
        try:
            data = read_regular_file(path, HISTORY_LIMIT, "history")
        except InputFileError as e:
            if e.missing:
                return cls()
            raise ChatError(f"{path}: cannot read history: {e.problem}") from None
        lines = data.split(b"\n")
        if lines[-1] == b"":  # the final newline ends the last line; it does not open one
            lines.pop()
        history = cls()
        for n, raw in enumerate(lines, start=1):
            if not raw:
                raise ChatError(f"{path}:{n} is blank")
            if len(raw) > MAX_LINE_BYTES:
                raise ChatError(f"{path}:{n} exceeds 16 MiB")
            # The whole history must be valid: each record is also checked where it stands.
            try:
                history.add(_parse_record(raw))
            except ChatError as e:
                raise ChatError(f"{path}:{n}: {e}") from None
        return history

    def to_jsonl(self) -> bytes:
        """The exact bytes `save` writes (§9.1 writer)."""
        return "".join(_record(m) + "\n" for m in self._messages).encode("utf-8")

    def save(self, path: str | os.PathLike) -> None:
        """Rewrite the file atomically (k3engine.atomic.write_atomic: temp file in the same
        directory, mode 0600 -- the file holds every user message and the full reasoning --
        write, fsync, rename).  On any failure the temp file is removed and the old file is
        untouched.  A record the reader would refuse is never written (issue 14: a 17 MiB
        line was saved, and every later start refused the history)."""
        path = os.fspath(path)
        for i, m in enumerate(self._messages, start=1):
            try:
                _check_savable(m)
            except ChatError as e:
                raise ChatError(f"{path}: cannot save history: record {i}: {e}") from None
        try:
            write_atomic(path, self.to_jsonl())
        except OSError as e:
            raise ChatError(f"{path}: cannot save history: {e.strerror or e}") from None


def _record(m: Message) -> str:
    rec = '{"role":' + _jstr(m.role) + ',"content":' + _jstr(m.content)
    if m.role == ASSISTANT and m.reasoning_content is not None:
        rec += ',"reasoning_content":' + _jstr(m.reasoning_content)
    return rec + "}"


def _check_savable(m: Message) -> None:
    """A message whose JSONL line the reader would refuse (§9.1: over 16 MiB) is refused
    before it enters a history, so it is never saved and never sticks the conversation."""
    n = len(_record(m).encode("utf-8"))
    if n > MAX_LINE_BYTES:
        raise ChatError(f"the {m.role} message is {n:,} bytes as a history line; the history "
                        f"reader accepts at most 16 MiB ({MAX_LINE_BYTES:,} bytes) per line")


# --------------------------------------------------------------------------- history lock


class HistoryLock:
    """An exclusive lock on a history file against a second writer (issue 14: two chats on
    one history lost one user's message silently).  The lock is flock() on a hidden
    sidecar `.NAME.lock` beside the history: the history itself is replaced on every save
    (a new inode), so a lock on it would not hold.  The sidecar is never deleted (deleting
    a lock file races with the next locker).  Released by release(), at `with` exit, or
    when the process ends (the kernel drops flock locks of a dead process: no stale lock)."""

    def __init__(self, path: str | os.PathLike):
        self._fd = -1
        self.path = os.fspath(path)
        # the real path: a history reached through a link and directly is one history
        d, base = os.path.split(os.path.realpath(self.path))
        self.lock_path = os.path.join(d, f".{base}.lock")
        try:
            # never through a link planted at the sidecar's name: it is truncated (issue 47)
            fd = open_nofollow(self.lock_path, os.O_RDWR | os.O_CREAT |
                               getattr(os, "O_CLOEXEC", 0), 0o600)
        except OSError as e:
            raise ChatError(f"{self.path}: cannot lock history ({self.lock_path}: "
                            f"{e.strerror or e})") from None
        try:
            got = _try_lock(fd)
        except OSError as e:
            os.close(fd)
            raise ChatError(f"{self.path}: cannot lock history: {e.strerror or e}") from None
        if not got:
            holder = _read_pid(fd)
            os.close(fd)
            who = f" (process {holder})" if holder else ""
            raise ChatError(f"{self.path} is in use by another k3 chat{who}; two chats on "
                            "one history would lose messages. Close the other one, or give "
                            "this one another --history.")
        self._fd = fd
        os.ftruncate(fd, 0)
        os.lseek(fd, 0, os.SEEK_SET)
        os.write(fd, f"{os.getpid()}\n".encode())

    def release(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)          # closing the descriptor drops the flock
            self._fd = -1

    def __enter__(self) -> "HistoryLock":
        return self

    def __exit__(self, *exc) -> None:
        self.release()

    def __del__(self):
        self.release()


def _try_lock(fd: int) -> bool:
    """Take an exclusive, non-blocking lock on the open file; False if another holder has it."""
    try:
        import fcntl
    except ImportError:                   # Windows: a byte-range lock on the first byte
        import msvcrt
        try:
            msvcrt.locking(fd, msvcrt.LK_NBLCK, 1)
            return True
        except OSError:
            return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False


def _read_pid(fd: int) -> int | None:
    try:
        os.lseek(fd, 0, os.SEEK_SET)
        text = os.read(fd, 32).decode("ascii").strip()
        return int(text) if text.isascii() and text.isdigit() else None
    except (OSError, ValueError, UnicodeDecodeError):
        return None


def apply_system(history: History, text: str) -> bool:
    """`--system TEXT` (§9.1): an empty history takes it as its system record (returns True:
    the caller saves immediately); otherwise the first record must be a system record with
    identical content (returns False), else `ChatError` (exit 2)."""
    if not len(history):
        history.add(Message(SYSTEM, text))
        return True
    system = history.system
    if system is None:
        raise ChatError("--system was given but the history does not start with a system message")
    if system.content != text:
        raise ChatError("--system text differs from the system message in the history")
    return False


# --------------------------------------------------------------------------- strict JSONL


class _JsonError(ChatError):
    """A record that is not the strict JSON the reader accepts."""


_WS = " \t\r"
_ESCAPES = {'"': '"', "\\": "\\", "/": "/", "b": "\b", "f": "\f", "n": "\n", "r": "\r", "t": "\t"}
_KEYS = ("role", "content", "reasoning_content")
# Where a plain run of string characters ends: the closing quote, an escape, or a control byte.
_STRING_STOP = re.compile(r'["\\\x00-\x1f]')


def _parse_record(raw: bytes) -> Message:
    """One JSONL record: exactly a JSON object of string values under the known keys.
    Python's json module is not used because it accepts duplicate keys, lone surrogates and
    \\u0000, all of which must be refused here."""
    try:
        s = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise _JsonError(f"invalid UTF-8 at byte {e.start}") from None
    i = _skip_ws(s, 0)
    if i >= len(s) or s[i] != "{":
        raise _JsonError("record is not a JSON object")
    i = _skip_ws(s, i + 1)
    fields: dict[str, str] = {}
    if i < len(s) and s[i] == "}":
        i += 1
    else:
        while True:
            if i >= len(s) or s[i] != '"':
                raise _JsonError("expected a string key")
            key, i = _parse_string(s, i)
            i = _skip_ws(s, i)
            if i >= len(s) or s[i] != ":":
                raise _JsonError(f"expected ':' after key {key!r}")
            i = _skip_ws(s, i + 1)
            if key not in _KEYS:
                raise _JsonError(f"unknown key {key!r}")
            if key in fields:
                raise _JsonError(f"duplicate key {key!r}")
            if i >= len(s) or s[i] != '"':
                raise _JsonError(f"value of {key!r} is not a string")
            fields[key], i = _parse_string(s, i)
            i = _skip_ws(s, i)
            if i < len(s) and s[i] == ",":
                i = _skip_ws(s, i + 1)
                continue
            if i < len(s) and s[i] == "}":
                i += 1
                break
            raise _JsonError("expected ',' or '}' in the object")
    if _skip_ws(s, i) != len(s):
        raise _JsonError("trailing data after the JSON object")
    if "role" not in fields or "content" not in fields:
        raise _JsonError("record needs both role and content")
    return Message(fields["role"], fields["content"], fields.get("reasoning_content"))


def _skip_ws(s: str, i: int) -> int:
    while i < len(s) and s[i] in _WS:
        i += 1
    return i


def _hex4(s: str, i: int) -> int:
    h = s[i:i + 4]
    if len(h) != 4 or any(c not in "0123456789abcdefABCDEF" for c in h):
        raise _JsonError("bad \\u escape")
    return int(h, 16)


def _parse_string(s: str, i: int) -> tuple[str, int]:
    """Parse the string starting at the quote s[i]; returns (value, index after it)."""
    out: list[str] = []
    i += 1
    n = len(s)
    while True:
        stop = _STRING_STOP.search(s, i)
        if stop is None:
            raise _JsonError("unterminated string")
        j = stop.start()
        out.append(s[i:j])
        c = s[j]
        if c == '"':
            return "".join(out), j + 1
        if c != "\\":
            raise _JsonError(f"control byte 0x{ord(c):02x} inside a string")
        if j + 1 >= n:
            raise _JsonError("truncated escape")
        e = s[j + 1]
        if e in _ESCAPES:
            out.append(_ESCAPES[e])
            i = j + 2
            continue
        if e != "u":
            raise _JsonError(f"unknown escape \\{e}")
        cp = _hex4(s, j + 2)
        i = j + 6
        if 0xD800 <= cp <= 0xDBFF:
            if s[i:i + 2] != "\\u":
                raise _JsonError("unpaired high surrogate")
            lo = _hex4(s, i + 2)
            if not 0xDC00 <= lo <= 0xDFFF:
                raise _JsonError("unpaired high surrogate")
            cp = 0x10000 + ((cp - 0xD800) << 10) + (lo - 0xDC00)
            i += 6
        elif 0xDC00 <= cp <= 0xDFFF:
            raise _JsonError("unpaired low surrogate")
        if cp == 0:
            raise _JsonError("\\u0000 is not allowed")
        out.append(chr(cp))


# The §9.1 writer's escaping: `"` `\` newline, CR and tab escaped, other characters below 0x20
# as \u00xx (lowercase hex, as the reference's %04x), everything else raw UTF-8.
_JSTR_ESCAPES = {c: f"\\u{c:04x}" for c in range(0x20)}
_JSTR_ESCAPES.update({ord('"'): '\\"', ord("\\"): "\\\\", ord("\n"): "\\n", ord("\r"): "\\r",
                      ord("\t"): "\\t"})


def _jstr(text: str) -> str:
    return '"' + text.translate(_JSTR_ESCAPES) + '"'


# --------------------------------------------------------------------------- XTML rendering


Segment = tuple[str, str]  # (CTL, token text) or (TXT, text)


def render_segments(history: History | Iterable[Message], opts: ChatOptions = ChatOptions(),
                    generation_prompt: bool = True) -> list[Segment]:
    """The prompt as segments, exactly as §9.2 (and the checkpoint's encoder) lays it out.
    Empty text segments are dropped; the effort text is one segment."""
    if not isinstance(history, History):
        history = History(history)
    if not isinstance(opts, ChatOptions):
        raise ChatError(f"not chat options: {opts!r}")
    segs: list[Segment] = []

    def txt(text: str) -> None:
        if text:
            segs.append((TXT, text))

    def open_(tag: str, attrs: str = "") -> None:
        segs.append((CTL, OPEN))
        txt(tag)
        txt(attrs)
        segs.append((CTL, SEP))

    def close(tag: str) -> None:
        segs.append((CTL, CLOSE))
        txt(tag)
        segs.append((CTL, SEP))

    if opts.thinking:
        open_("message", ' role="system" type="thinking-effort"')
        txt(effort_text(opts.effort))
        close("message")
        segs.append((CTL, END_OF_MSG))
    for m in history:
        open_("message", f' role="{m.role}"')
        if m.role == ASSISTANT:
            # With --no-think the think channel is left out even when reasoning is stored
            # (the encoder's thinking=False); it comes back when thinking is on again.
            if opts.thinking:
                open_("think")
                txt(m.reasoning_content or "")
                close("think")
            open_("response")
            txt(m.content)
            close("response")
        else:
            txt(m.content)
        close("message")
        segs.append((CTL, END_OF_MSG))
    if generation_prompt:
        open_("message", ' role="assistant"')
        open_("think" if opts.thinking else "response")
    return segs


def render_text(history: History | Iterable[Message], opts: ChatOptions = ChatOptions(),
                generation_prompt: bool = True) -> str:
    """The rendered prompt as one string (for byte comparison with §9.2; never encode this
    string whole: BPE would merge across segment boundaries)."""
    return "".join(text for _, text in render_segments(history, opts, generation_prompt))


def encode_prompt(tok, segments: Iterable[Segment], limit: int = MAX_PROMPT_IDS) -> list[int]:
    """Encode each segment on its own and concatenate (§9.2): control segments with specials
    allowed (each must be exactly one id), text with specials disallowed, so text typed by a
    user can never become a control token. Refuses 0 ids or more than `limit` ids."""
    ids: list[int] = []
    for kind, text in segments:
        if kind == CTL:
            got = tok.encode(text, True)
            # Exactly the added token of that name: a single ordinary rank spelled the same
            # would render, but the model would read it as text.
            if len(got) != 1 or got[0] != tok.id_of(text):
                raise ChatError(f"tokenizer does not encode {text} as one control token "
                                f"(got {len(got)} ids)")
        elif kind == TXT:
            got = tok.encode(text, False)
        else:
            raise ChatError(f"unknown segment kind {kind!r}")
        ids.extend(got)
        # The reference encodes into limit+1 slots; the spare one detects overflow.
        if len(ids) > limit:
            raise ChatError(f"rendered prompt exceeds the limit of {limit} ids")
    if not ids:
        raise ChatError("rendered prompt is empty (0 ids)")
    return ids


# --------------------------------------------------------------------------- reply parser


def _text_ids(tok, word: str) -> list[int]:
    ids = list(tok.encode(word, False))
    if not ids:
        raise ChatError(f"tokenizer encodes {word!r} as no ids")
    return ids


def _find(ids: Sequence[int], pattern: Sequence[int], start: int) -> int:
    """First index >= start where `pattern` occurs in `ids`, or -1."""
    pn = len(pattern)
    first = pattern[0]
    for i in range(start, len(ids) - pn + 1):
        if ids[i] == first and list(ids[i:i + pn]) == list(pattern):
            return i
    return -1


def _added_ids(tok, ctl) -> frozenset[int]:
    """Every added/special id: the tokenizer's whole added table where it exposes one
    (`added`, keyed by id), and at least the six control ids."""
    added = getattr(tok, "added", None) or ()
    return frozenset(int(i) for i in added) | {ctl.bos, ctl.eos, ctl.end_of_msg, ctl.open,
                                               ctl.close, ctl.sep}


def parse_reply(tok, ctl, ids: Sequence[int], thinking: bool) -> tuple[str | None, str]:
    """Split one generated assistant turn (§9.3) into (reasoning_content, content).

    Thinking on:  REASONING <|close|>think<|sep|><|open|>response<|sep|> CONTENT
                  <|close|>response<|sep|><|close|>message<|sep|> END
    Thinking off: CONTENT <|close|>response<|sep|><|close|>message<|sep|> END
    END is exactly one id, either of `ctl.end_ids`. The first boundary splits reasoning from
    content; an added id inside either payload is refused, because stored text is re-encoded
    without specials and a restart would differ from the live turn. reasoning_content is None
    with thinking off. Raises ChatError(reason) (the caller prints `malformed assistant turn`).
    """
    ids = [int(i) for i in ids]
    think, response, message = (_text_ids(tok, w) for w in ("think", "response", "message"))
    boundary = [ctl.close, *think, ctl.sep, ctl.open, *response, ctl.sep]
    closure = [ctl.close, *response, ctl.sep, ctl.close, *message, ctl.sep]
    if not ids:
        raise ChatError("no ids were generated")
    split = body = 0
    if thinking:
        split = _find(ids, boundary, 0)
        if split < 0:
            raise ChatError("no <|close|>think<|sep|><|open|>response<|sep|> boundary after "
                            "the reasoning")
        body = split + len(boundary)
    end = _find(ids, closure, body)
    if end < 0:
        raise ChatError("no <|close|>response<|sep|><|close|>message<|sep|> closure")
    after = len(ids) - (end + len(closure))
    if after == 0:
        raise ChatError("missing end id after the closure")
    if after > 1:
        raise ChatError(f"{after} ids after the closure; expected exactly one end id")
    if ids[-1] not in tuple(ctl.end_ids):
        ends = " or ".join(str(e) for e in ctl.end_ids)
        raise ChatError(f"id {ids[-1]} after the closure is not an end id ({ends})")
    added = _added_ids(tok, ctl)
    for name, lo, hi in (("reasoning", 0, split), ("response", body, end)):
        bad = next((i for i in ids[lo:hi] if i in added), None)
        if bad is not None:
            raise ChatError(f"unexpected control token {bad} in the {name}")
    # The model may emit bytes that are not valid UTF-8; they are kept as U+FFFD, so such a
    # turn re-encodes differently (prefix reuse then simply finds nothing to reuse).
    reasoning = _decode(tok, ids[:split]) if thinking else None
    return reasoning, _decode(tok, ids[body:end])


def _decode(tok, ids: Sequence[int]) -> str:
    return bytes(tok.decode(ids)).decode("utf-8", errors="replace")


# --------------------------------------------------------------------------- prefix reuse


def reuse_positions(record: Sequence[int], prompt: Sequence[int], *, cached: int | None = None,
                    tainted: bool = False) -> int:
    """How many positions of the new `prompt` the cached state already holds (§9.4).

    `record` is the exact ids fed so far (prefill span, then one id per step; the final end id
    is never fed), `cached` the cache's position count (defaults to len(record)). All or
    nothing: the recurrent state cannot be truncated, so a partial match reuses nothing, and a
    prompt equal to or shorter than the record reuses nothing (no rewind)."""
    n = len(record)
    if cached is None:
        cached = n
    if (not tainted and 0 < n < len(prompt) and n == cached
            and list(prompt[:n]) == list(record)):
        return n
    return 0


# --------------------------------------------------------------------------- REPL and lines


def classify_line(line: str) -> tuple[str, str]:
    """One REPL input line (§9.4) -> (kind, text). Trailing \\n/\\r are stripped; commands are
    whole-line and exact. kind is 'exit', 'help', 'reset', 'empty' (ignored) or 'message'."""
    text = line.rstrip("\r\n")
    kind = {"/exit": "exit", "/help": "help", "/reset": "reset", "": "empty"}.get(text, "message")
    return kind, text


def banner_line(n_ids: int, gen: int, sampling: bool, opts: ChatOptions) -> str:
    mode = "temperature/top-p sampling" if sampling else "greedy"
    think = f"thinking_effort={opts.effort}" if opts.thinking else "thinking off"
    return f"  XTML prompt: {n_ids} ids, generation limit {gen}, {mode}, {think}"


def progress_line(i: int, gen: int, token_id: int, seconds: float) -> str:
    return f"chat: token {i}/{gen} id {token_id} ({seconds:.0f} s)"


def turn_end_line(end_id: int, ctl) -> str:
    name = END_OF_MSG if end_id == ctl.end_of_msg else "[EOS]"
    return f"chat: turn ended by {name} ({end_id})"


def reply_text(reasoning: str | None, content: str, thinking: bool) -> str:
    """What stdout shows for a parsed turn: `<think>` whenever thinking is on (even empty)."""
    out = f"<think>{reasoning or ''}</think>\n" if thinking else ""
    return out + f"<response>{content}</response>\n"


def reuse_line(reused: int, n_prompt: int) -> str:
    return (f"chat: {reused} of {n_prompt} prompt positions already cached, "
            f"prefill for {n_prompt - reused}")


class ChatSetupError(ChatError):
    """The chat cannot start on these files (no tokenizer, control tokens not declared):
    exit 2, like a configuration the reference refuses (DESIGN: end-of-turn ids)."""
    exit_code = EXIT_USAGE


# --------------------------------------------------------------------------- streaming

class ReplyStream:
    """parse_reply while the reply is generated: each id in, (phase, visible text) out.

    Phases: 'thinking' (the reasoning, thinking on), 'response' (the content), 'control'
    (the closure, the end id and markup, never shown).  Ids that could be the start of
    the reasoning/response boundary or of the closure are held back until they either
    complete it (hidden) or cannot (shown), so the concatenated texts of each phase equal
    parse_reply's reasoning and content for every well-formed turn (test_run_api.py checks
    that on generated turns).  Each phase has its own UTF-8 stream decoder, flushed when
    the phase ends, exactly like parse_reply's one-shot decode of each span."""

    def __init__(self, tok, ctl, thinking: bool):
        from .tokenizer import StreamDecoder
        think, response, message = (_text_ids(tok, w) for w in ("think", "response", "message"))
        self._boundary = [ctl.close, *think, ctl.sep, ctl.open, *response, ctl.sep]
        self._closure = [ctl.close, *response, ctl.sep, ctl.close, *message, ctl.sep]
        self._added = _added_ids(tok, ctl)
        self._tok = tok
        self._decoder = StreamDecoder(tok)
        self._held: list[int] = []
        self.phase = "thinking" if thinking else "response"

    def _text(self, ids) -> str:
        return "".join(self._decoder.push(i) for i in ids if i not in self._added)

    def push(self, tok_id: int) -> tuple[str, str]:
        if self.phase == "control":
            return "control", ""
        pattern = self._boundary if self.phase == "thinking" else self._closure
        self._held.append(int(tok_id))
        if self._held == pattern:                      # a boundary or the closure: hidden
            self._held = []
            ended, tail = self.phase, self._decoder.flush()
            self.phase = "response" if ended == "thinking" else "control"
            return ended, tail
        k = 0                                          # keep the longest held suffix that
        while self._held[k:] != pattern[:len(self._held) - k]:   # could still start it
            k += 1
        shown, self._held = self._held[:k], self._held[k:]
        return self.phase, self._text(shown)

    def flush(self) -> str:
        """End of the stream: what was held back, in the current phase."""
        if self.phase == "control":
            return ""
        held, self._held = self._held, []
        return self._text(held) + self._decoder.flush()
