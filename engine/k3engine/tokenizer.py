"""Kimi K3 tokenizer: strict loading of `tiktoken.model` + `tokenizer_config.json` (SYSTEM §8).

Encoding is done by the `tiktoken` package (rank BPE in Rust, with the exact Kimi
pre-tokenizer pattern of §8.4), fed the checkpoint's own files. The Encoding is always
constructed directly: `tiktoken.get_encoding` would try to download, and nothing here may
touch the network.

Loading is strict: a half-loaded tokenizer is worse than none, so every malformed line or
entry raises `TokenizerError` naming the file, the line where there is one, and the problem.
"""
from __future__ import annotations

import base64
import binascii
import codecs
import importlib.resources
import json
import pathlib
import re
from dataclasses import dataclass
from typing import Iterable

import tiktoken
from .errors import EngineError

from .inputfile import InputFileError, MiB, read_regular_file
from .strict_json import STRICT_HOOKS, JSONFormatError, Refused, check_tree

MODEL_FILE = "tiktoken.model"
CONFIG_FILE = "tokenizer_config.json"

# Every id (rank or added token) lives in [0, ID_LIMIT): the released embedding has 163,840 rows.
ID_LIMIT = 163_840
# A longer base64 field is implausible (the C loader's limit; with padding it admits tokens of
# at most 510 bytes, and the real vocabulary is far below that).
MAX_B64_CHARS = 682
MODEL_LIMIT = 64 * MiB     # the released tiktoken.model is about 2.5 MB
CONFIG_LIMIT = 16 * MiB

# §8.4, verbatim from the checkpoint's tokenization_kimi.py; order matters (leftmost
# alternative wins). Parity tests compare this with the file's own pattern, extracted by `ast`.
KIMI_PAT_ALTERNATIVES = (
    r"""[\p{Han}]+""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""\p{N}{1,3}""",
    r""" ?[^\s\p{L}\p{N}]+[\r\n]*""",
    r"""\s*[\r\n]+""",
    r"""\s+(?!\S)""",
    r"""\s+""",
)
KIMI_PAT_STR = "|".join(KIMI_PAT_ALTERNATIVES)

# Names of the control tokens the chat needs (§8.1, §9); their ids are always looked up in the
# added tokens, so a model with our own vocabulary chats as well as the real one.
BOS, EOS, END_OF_MSG, OPEN, CLOSE, SEP = (
    "[BOS]", "[EOS]", "<|end_of_msg|>", "<|open|>", "<|close|>", "<|sep|>")

_B64_CHARS = re.compile(rb"[A-Za-z0-9+/=]*")
_PLAIN_LINE = re.compile(rb"([A-Za-z0-9+/]+)(=*) ([0-9]{1,6})\r?")
_DECIMAL = re.compile(r"[0-9]+")  # ASCII only: str.isdecimal() would accept other scripts' digits


class TokenizerError(EngineError):
    """A tokenizer file is missing or malformed, or lacks a token the caller needs."""


def _where(path: pathlib.Path, line: int | None = None) -> str:
    return f"{path}:{line}" if line is not None else str(path)


# --------------------------------------------------------------------------- loading


def load_ranks(path: str | pathlib.Path) -> dict[bytes, int]:
    """Read a `tiktoken.model` file: `<base64 of the token bytes> <rank>` per line (§8.1)."""
    path = pathlib.Path(path)
    data = _read(path, MODEL_LIMIT)
    ranks: dict[bytes, int] = {}
    line_of_rank: dict[int, int] = {}
    a2b = binascii.a2b_base64
    for lineno, line in enumerate(data.split(b"\n"), start=1):
        # Fast path for the 163,584 well-formed lines of the real file: it accepts only what
        # the checks below would accept, and leaves every other line to them for the message.
        m = _PLAIN_LINE.fullmatch(line)
        if m is not None:
            body, pad, digits = m.groups()
            n = len(body)
            if n + len(pad) <= MAX_B64_CHARS and n % 4 != 1:
                rank = int(digits)
                token = a2b(body + b"=" * (-n % 4))
                if rank < ID_LIMIT and rank not in line_of_rank and token not in ranks:
                    ranks[token] = rank
                    line_of_rank[rank] = lineno
                    continue

        line = line[:-1] if line.endswith(b"\r") else line
        if not line.strip():
            continue
        where = _where(path, lineno)
        token, rank = _parse_line(line, where)
        if rank in line_of_rank:
            raise TokenizerError(f"{where}: duplicate rank {rank} (first on line {line_of_rank[rank]})")
        if token in ranks:
            first = line_of_rank[ranks[token]]
            raise TokenizerError(f"{where}: duplicate token bytes {token!r} (first on line {first})")
        ranks[token] = rank
        line_of_rank[rank] = lineno

    if not ranks:
        raise TokenizerError(f"{path}: no rank lines (empty vocabulary)")
    # Byte-level BPE starts every piece from single bytes; without all 256 of them tiktoken
    # would panic on the first text containing the missing byte, long after loading.
    missing = [b for b in range(256) if bytes([b]) not in ranks]
    if missing:
        listed = ", ".join(f"0x{b:02x}" for b in missing[:8]) + (" ..." if len(missing) > 8 else "")
        raise TokenizerError(f"{path}: {len(missing)} single byte(s) have no rank ({listed}); "
                             "byte-level BPE needs all 256")
    return ranks


def _parse_line(line: bytes, where: str) -> tuple[bytes, int]:
    """Token bytes and rank of one line, or TokenizerError saying what is wrong with it."""
    field, sep, rank_text = line.partition(b" ")
    if not sep:
        raise TokenizerError(f"{where}: line has no space between token and rank")
    return _decode_b64(field, where), _parse_rank(rank_text, where)


def _decode_b64(field: bytes, where: str) -> bytes:
    if len(field) > MAX_B64_CHARS:
        raise TokenizerError(f"{where}: base64 field of {len(field)} characters exceeds "
                             f"{MAX_B64_CHARS} (implausible token)")
    if not _B64_CHARS.fullmatch(field):
        bad = next(chr(c) for c in field if not _B64_CHARS.fullmatch(bytes([c])))
        raise TokenizerError(f"{where}: character {bad!r} outside the base64 alphabet")
    # Decoding stops at the first '=' (§8.1); anything but more padding after it is garbage.
    body, _, pad = field.partition(b"=")
    if pad.strip(b"="):
        raise TokenizerError(f"{where}: base64 data after '=' padding")
    if len(body) % 4 == 1:
        raise TokenizerError(f"{where}: truncated base64 field {field.decode()!r}")
    token = base64.b64decode(body + b"=" * (-len(body) % 4))
    if not token:
        raise TokenizerError(f"{where}: empty token")
    return token


def _parse_rank(text: bytes, where: str) -> int:
    # NEW in §8.1: the C loader's atoi accepted junk; we require a plain decimal integer.
    s = text.decode("ascii", "replace")
    if not _DECIMAL.fullmatch(s):
        raise TokenizerError(f"{where}: rank {s!r} is not a decimal integer")
    digits = s.lstrip("0") or "0"
    # Length first: int() of a huge digit string is slow, and refused beyond 4300 digits.
    if len(digits) > len(str(ID_LIMIT)) or int(digits) >= ID_LIMIT:
        shown = digits if len(digits) <= 20 else digits[:20] + "..."
        raise TokenizerError(f"{where}: rank {shown} outside [0, {ID_LIMIT})")
    return int(digits)


def load_added_tokens(path: str | pathlib.Path) -> tuple[dict[int, str], dict]:
    """Read `added_tokens_decoder` from a `tokenizer_config.json` (§8.1).

    Returns ({id: content}, the whole parsed JSON object). Ids come from the keys."""
    path = pathlib.Path(path)
    try:
        text = _read(path, CONFIG_LIMIT).decode("utf-8")
    except UnicodeDecodeError as e:
        raise TokenizerError(f"{path}: not UTF-8 (byte offset {e.start})") from None
    try:
        cfg = json.loads(text, object_pairs_hook=_no_duplicate_keys, **STRICT_HOOKS)
        check_tree(cfg, str(path))
    except json.JSONDecodeError as e:
        raise TokenizerError(f"{_where(path, e.lineno)}: invalid JSON: {e.msg} (column {e.colno})") from None
    except _DuplicateKey as e:
        raise TokenizerError(f"{path}: invalid JSON: duplicate key {e.args[0]!r}") from None
    except Refused as e:
        raise TokenizerError(f"{path}: invalid JSON: {e}") from None
    except JSONFormatError as e:
        raise TokenizerError(str(e)) from None
    except RecursionError:
        raise TokenizerError(f"{path}: invalid JSON: nested too deeply") from None
    if not isinstance(cfg, dict):
        raise TokenizerError(f"{path}: top level is not a JSON object")
    if "added_tokens_decoder" not in cfg:
        raise TokenizerError(f"{path}: missing added_tokens_decoder")
    decoder = cfg["added_tokens_decoder"]
    if not isinstance(decoder, dict):
        raise TokenizerError(f"{path}: added_tokens_decoder is not an object")

    added: dict[int, str] = {}
    id_of: dict[str, int] = {}
    for key, entry in decoder.items():
        where = _where(path, _line_of(text, json.dumps(key)))
        if not _DECIMAL.fullmatch(key):
            raise TokenizerError(f"{where}: added_tokens_decoder key {key!r} is not a decimal id")
        tid = int(key)
        if tid >= ID_LIMIT:
            raise TokenizerError(f"{where}: added token id {tid} outside [0, {ID_LIMIT})")
        if not isinstance(entry, dict) or "content" not in entry:
            raise TokenizerError(f"{where}: added token {key} has no content")
        content = entry["content"]
        if not isinstance(content, str) or not content:
            raise TokenizerError(f"{where}: added token {key} content is not a non-empty string")
        if "special" in entry and not isinstance(entry["special"], bool):
            raise TokenizerError(f"{where}: added token {key} 'special' is not true/false")
        if content in id_of:
            # encode() maps content -> id, so two ids with one content would be ambiguous.
            raise TokenizerError(f"{where}: added token {key} repeats the content {content!r} "
                                 f"of id {id_of[content]}")
        added[tid] = content
        id_of[content] = tid
    return added, cfg


class _DuplicateKey(Exception):
    pass


def _read(path: pathlib.Path, limit: int) -> bytes:
    try:
        return read_regular_file(path, limit, "tokenizer file")
    except InputFileError as e:
        if e.missing:
            raise TokenizerError(f"{path}: tokenizer file not found") from None
        raise TokenizerError(str(e)) from None


def check_rank_layout(ranks: dict[bytes, int], added: dict[int, str], model_path,
                      config_path) -> None:
    """The ranks must be exactly 0..n-1 and the added tokens must start at n (SYSTEM §8.1:
    they sit at ids ranks + index).  Silent-failure trap (issue 14, finding 4): a
    tiktoken.model cut at a line boundary is a valid file of fewer ranks; it loaded and
    tokenised differently.  tokenizer_config.json's added-token offsets say how many
    ranks the vocabulary has."""
    n = len(ranks)
    top = max(ranks.values())
    if top != n - 1:
        have = set(ranks.values())
        missing = next(r for r in range(n) if r not in have)
        raise TokenizerError(f"{model_path}: the ranks are not contiguous ({n} ranks, highest "
                             f"{top}; rank {missing} is missing)")
    if added and min(added) != n:
        raise TokenizerError(f"{model_path} has {n} ranks (0..{n - 1}) but {config_path} "
                             f"places its added tokens from id {min(added)}: the model file "
                             f"is cut or belongs to another vocabulary")


def _no_duplicate_keys(pairs: list[tuple[str, object]]) -> dict:
    # json.loads silently keeps the last of two equal keys; an id listed twice is an error.
    out: dict = {}
    for k, v in pairs:
        if k in out:
            raise _DuplicateKey(k)
        out[k] = v
    return out


def _line_of(text: str, needle: str) -> int | None:
    """1-based line of the first occurrence of `needle` (for messages only)."""
    pos = text.find(needle)
    return None if pos < 0 else text.count("\n", 0, pos) + 1


# --------------------------------------------------------------------------- tokenizer


class Tokenizer:
    """Kimi rank-BPE tokenizer over a `tiktoken.model` + `tokenizer_config.json` pair."""

    def __init__(self, ranks: dict[bytes, int], added: dict[int, str], *,
                 name: str = "kimi", model_path: pathlib.Path | None = None,
                 config_path: pathlib.Path | None = None):
        self.model_path = model_path
        self.config_path = config_path
        clash = sorted(set(added) & set(ranks.values()))
        if clash:
            raise TokenizerError(f"{config_path or CONFIG_FILE}: added token id {clash[0]} "
                                 f"({added[clash[0]]!r}) is also a rank in {model_path or MODEL_FILE}")
        self.added: dict[int, str] = dict(sorted(added.items()))
        self._id_of = {content: tid for tid, content in self.added.items()}
        self.n_ranks = len(ranks)
        self.max_rank = max(ranks.values())
        self.vocab_size = max(self.max_rank, max(self.added, default=-1)) + 1

        self._enc = tiktoken.Encoding(name, pat_str=KIMI_PAT_STR, mergeable_ranks=ranks,
                                      special_tokens=dict(self._id_of))
        # id -> bytes for decode (§8.5): added tokens contribute their literal content.
        table: list[bytes | None] = [None] * self.vocab_size
        for token, rank in ranks.items():
            table[rank] = token
        for tid, content in self.added.items():
            table[tid] = content.encode("utf-8")
        self._bytes = table
        # Earliest position, then longest token there (§8.3): `re` tries alternatives left to
        # right at the earliest matching position, so listing longer contents first yields the
        # longest match. (tiktoken's own special splitting does not promise longest-match.)
        contents = sorted(self._id_of, key=lambda c: (-len(c), c))
        self._special_re = re.compile("|".join(map(re.escape, contents))) if contents else None

    @classmethod
    def from_dir(cls, path: str | pathlib.Path) -> "Tokenizer":
        d = pathlib.Path(path)
        if not d.is_dir():
            raise TokenizerError(f"{d}: tokenizer directory not found")
        model_path, config_path = d / MODEL_FILE, d / CONFIG_FILE
        ranks = load_ranks(model_path)
        added, _ = load_added_tokens(config_path)
        tok = cls(ranks, added, model_path=model_path, config_path=config_path)
        check_rank_layout(ranks, added, model_path, config_path)
        return tok

    # -- encoding

    def encode(self, text: str, allow_special: bool) -> list[int]:
        """Ids of `text` (§8.3). With allow_special, any added-token string in the text becomes
        that token; without, such strings are ordinary text (chat user input, §9.2)."""
        if not allow_special or self._special_re is None:
            return self._ordinary(text)
        out: list[int] = []
        i = 0
        for m in self._special_re.finditer(text):
            out += self._ordinary(text[i:m.start()])
            out.append(self._id_of[m.group()])
            i = m.end()
        out += self._ordinary(text[i:])
        return out

    def _ordinary(self, text: str) -> list[int]:
        if not text:
            return []
        # disallowed_special=() so tiktoken neither raises on nor recognises added-token text.
        return self._enc.encode(text, allowed_special=set(), disallowed_special=())

    # -- decoding

    def token_bytes(self, token_id: int) -> bytes | None:
        """Bytes of one id, or None for an id outside the table."""
        if 0 <= token_id < self.vocab_size:
            return self._bytes[token_id]
        return None

    def decode(self, ids: Iterable[int]) -> bytes:
        """Concatenated bytes of `ids` (§8.5); unknown ids are skipped. May end mid-UTF-8."""
        table, n = self._bytes, self.vocab_size
        return b"".join(b for i in ids if 0 <= i < n and (b := table[i]) is not None)

    # -- lookups and report

    def id_of(self, content: str) -> int | None:
        """Id of the added token whose content is exactly `content`, or None."""
        return self._id_of.get(content)

    def report_line(self) -> str:
        return (f"[TOK] {self.n_ranks} ranks (max id {self.max_rank}) + {len(self.added)} "
                f"added tokens | kimi=1 rankbpe=1")

    def __repr__(self) -> str:
        return f"Tokenizer({self.model_path or '<memory>'}, vocab_size={self.vocab_size})"


class StreamDecoder:
    """Turns ids (or their bytes) into text deltas without mojibake at token boundaries.

    A token may end inside a multi-byte UTF-8 sequence (§8.5); the incremental decoder holds
    such bytes back until the sequence completes. Bytes that can never form valid UTF-8 become
    U+FFFD, exactly as a one-shot `bytes.decode('utf-8', 'replace')` of the whole stream would.
    """

    def __init__(self, tok: Tokenizer | None = None):
        self._tok = tok
        self._dec = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, token_id: int) -> str:
        """Text completed by one more id (possibly empty)."""
        if self._tok is None:
            raise TypeError("StreamDecoder.push needs a Tokenizer; use feed(bytes)")
        return self.feed(self._tok.token_bytes(token_id) or b"")

    def feed(self, data: bytes) -> str:
        """Text completed by one more chunk of bytes (possibly empty)."""
        return self._dec.decode(data, final=False)

    def flush(self) -> str:
        """End of stream: an incomplete trailing sequence comes out as U+FFFD."""
        out = self._dec.decode(b"", final=True)
        self._dec.reset()
        return out


# --------------------------------------------------------------------------- control ids


@dataclass(frozen=True)
class ControlIds:
    bos: int
    eos: int
    end_of_msg: int
    open: int
    close: int
    sep: int

    @property
    def end_ids(self) -> tuple[int, int]:
        """Either id ends a chat turn (§8.2): the model emits [EOS], config.json names end_of_msg."""
        return (self.end_of_msg, self.eos)


def control_ids(tok: Tokenizer, config_json: dict | None, *,
                config_name: str = "config.json") -> ControlIds:
    """The chat's control ids, looked up by name in the added tokens (never hard-coded).

    Raises TokenizerError when the tokenizer does not declare them, or when `config_json`'s
    `eos_token_id` names an id that is neither of the two end ids."""
    where = tok.config_path or CONFIG_FILE
    names = (BOS, EOS, END_OF_MSG, OPEN, CLOSE, SEP)
    missing = [n for n in names if tok.id_of(n) is None]
    if missing:
        raise TokenizerError(f"{where}: added_tokens_decoder lacks the control token(s) "
                             f"{', '.join(missing)} needed by chat")
    ids = ControlIds(*(tok.id_of(n) for n in names))  # type: ignore[arg-type]
    if config_json is not None and "eos_token_id" in config_json:
        declared = config_json["eos_token_id"]
        values = declared if isinstance(declared, list) else [declared]
        for v in values:
            if isinstance(v, bool) or not isinstance(v, int) or v not in ids.end_ids:
                raise TokenizerError(
                    f"{config_name}: eos_token_id {declared!r} is neither {END_OF_MSG} "
                    f"({ids.end_of_msg}) nor {EOS} ({ids.eos}) of {where}")
    return ids


def default_tokenizer_dir() -> pathlib.Path:
    """Our own vocabulary (DESIGN "Our vocabulary"), shipped as package data."""
    res = importlib.resources.files("k3engine") / "data" / "tokenizer"
    # k3engine is a regular on-disk package (also in the PyInstaller bundle), so this is a
    # real directory path; tiktoken and the loaders need real files.
    return pathlib.Path(str(res))
