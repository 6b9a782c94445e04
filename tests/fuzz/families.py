"""Structure-aware fuzz families for every parser of a file or list a person can hand k3.

Each family is a Hypothesis strategy that builds a well-formed input and then damages it the
way a hostile or unlucky source would (wrong types, absurd counts, shifted offsets, cut
files, raw byte flips), plus a `check` that runs the real parser on it and enforces one
property:

    the parser refuses with its documented error (the exit code the CLI maps it to) and a
    message naming the file, or it accepts and what it produced is identical to what the
    unmodified input gives (or, where the mutation may legitimately change meaning, obeys
    the format's invariants);  never any other exception (a traceback), never a hang.

`check` returns the outcome's class ("accepted", "refused", or for the shard header the
differential verdict against the safetensors library), which the runners count.
"""
from __future__ import annotations

import json
import os
import struct
import tempfile
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np
from hypothesis import strategies as st

from k3engine.chat import ChatError, History
from k3engine.checkpoint import CheckpointError, parse_header, Checkpoint
from k3engine.config import ConfigError, load_config, to_flat_dict
from k3engine.errors import describe
from k3engine.ids import IdsError, parse_ids
from k3engine.state import MLAState, SequenceState
from k3engine.statefile import StateFileError, load_state, save_state
from k3engine.tokenizer import Tokenizer, TokenizerError
from k3engine.tools.make_checkpoint import dims_config

WORK = tempfile.mkdtemp(prefix="k3fuzz-")


class Violation(AssertionError):
    """The property failed: a traceback, a silent change, or a message without the file."""


def _refused(e: BaseException, path: str, codes: tuple[int, ...] | None) -> str:
    """Check a refusal: the documented exit code (as errors.describe maps it; None for a
    usage error the CLI maps itself) and the file (or flag) named in the message."""
    d = describe(e)
    if codes is not None and d is None:
        raise Violation(f"{type(e).__name__} is not an engine failure: {e}") from e
    if codes is not None and d[0] not in codes:
        raise Violation(f"{type(e).__name__} maps to exit {d[0]}, expected {codes}: {e}")
    if path not in str(e):
        raise Violation(f"message does not name {path}: {e}")
    return "refused"


def attempt(what: str, fn: Callable[[], Any], refusals, where: str,
            codes: tuple[int, ...] | None):
    """(fn's result, None) when it accepts, (None, the refusal) when it refuses as
    documented; any other exception breaks the property (it would be a traceback)."""
    try:
        return fn(), None
    except KeyboardInterrupt:
        raise
    except refusals as e:
        _refused(e, where, codes)
        return None, e
    except BaseException as e:
        raise Violation(f"{what} raised {type(e).__name__}: {e}") from e


# --- mutation helpers ---------------------------------------------------------------------

JSON_ODD = st.one_of(
    st.none(), st.booleans(), st.integers(-2**70, 2**70), st.sampled_from([0, -1, 1, 2**31, 2**63, 10**12]),
    st.floats(allow_nan=False, allow_infinity=False), st.sampled_from([1e-400, 0.5, -0.0, 1e308]),
    st.text(max_size=8), st.lists(st.integers(-3, 5), max_size=4), st.just({}), st.just([[[]]]))

RAW_EDITS = st.one_of(
    st.tuples(st.just("flip"), st.integers(0, 10**6), st.integers(1, 255)),
    st.tuples(st.just("cut"), st.integers(0, 10**6), st.just(0)),
    st.tuples(st.just("insert"), st.integers(0, 10**6), st.integers(0, 255)),
    st.tuples(st.just("none"), st.just(0), st.just(0)))


# Damage on one input in four: an input the parser refuses at its first byte tests little.
SOME_EDITS = st.integers(0, 3).flatmap(lambda k: RAW_EDITS if k == 0 else st.just(("none", 0, 0)))


def raw_edit(data: bytes, edit) -> bytes:
    kind, at, val = edit
    if not data or kind == "none":
        return data
    at %= len(data)
    if kind == "flip":
        return data[:at] + bytes([data[at] ^ val]) + data[at + 1:]
    if kind == "cut":
        return data[:at]
    return data[:at] + bytes([val]) + data[at:]


def _write(name: str, data: bytes) -> str:
    path = os.path.join(WORK, name)
    with open(path, "wb") as f:
        f.write(data)
    return path


# --- shard header (and the differential against safetensors) -------------------------------

DTYPES = ["U8", "BF16", "F16", "F32"] * 3 + ["I8", "F64", "BOOL", "F8_E4M3", "bf16", "", "U16"]
SIZES = {"U8": 1, "BF16": 2, "F16": 2, "F32": 4, "I8": 1, "F64": 8, "BOOL": 1, "F8_E4M3": 1,
         "U16": 2}


@dataclass
class ShardCase:
    header: dict
    data: bytes
    text_edit: tuple
    prefix_delta: int
    pad: bytes
    trailing: int


@st.composite
def shard_cases(draw) -> ShardCase:
    n = draw(st.integers(0, 4))
    header: dict[str, Any] = {}
    if draw(st.integers(0, 2)) == 0:
        header["__metadata__"] = draw(st.integers(0, 3).flatmap(lambda k: JSON_ODD if k == 0 else st.one_of(
            st.just({"format": "pt"}), st.dictionaries(st.text(max_size=4), st.text(max_size=4),
                                                       max_size=2))))
    off = 0
    for i in range(n):
        name = draw(st.one_of(st.just(f"t{i}"), st.text(min_size=1, max_size=6),
                              st.just("n" * draw(st.sampled_from([511, 512])))))
        dtype = draw(st.sampled_from(DTYPES))
        shape = draw(st.lists(st.integers(0, 4), max_size=draw(st.sampled_from([2, 2, 2, 5]))))
        nbytes = int(np.prod(shape, dtype=np.int64)) * SIZES.get(dtype, 1)
        entry = {"dtype": dtype, "shape": shape, "data_offsets": [off, off + nbytes]}
        mut = draw(st.sampled_from(["ok"] * 16 + ["offset", "shape", "drop", "extra", "type"]))
        if mut == "offset":
            k = draw(st.integers(0, 1))
            entry["data_offsets"][k] += draw(st.integers(-8, 8))
        elif mut == "shape":
            entry["shape"] = draw(st.one_of(JSON_ODD, st.lists(JSON_ODD, max_size=3)))
        elif mut == "drop":
            del entry[draw(st.sampled_from(["dtype", "shape", "data_offsets"]))]
        elif mut == "extra":
            entry[draw(st.text(max_size=4))] = draw(JSON_ODD)
        elif mut == "type":
            entry = draw(JSON_ODD)
        header[name] = entry
        off += nbytes
    data = (bytes(range(256)) * (off // 256 + 1))[:off]
    return ShardCase(header, data, draw(SOME_EDITS),
                     draw(st.sampled_from([0] * 12 + [-8, -6, -1, 1, 6])),
                     draw(st.sampled_from([b""] * 4 + [b" " * 7, b"\t\n ", b"\0\0", b" " * 14])),
                     draw(st.sampled_from([0] * 12 + [-3, 3, 8])))


def shard_bytes(c: ShardCase) -> bytes:
    hb = raw_edit(json.dumps(c.header).encode("utf-8", "surrogatepass"), c.text_edit) + c.pad
    data = c.data + b"\0" * max(c.trailing, 0)
    if c.trailing < 0:
        data = data[:c.trailing]
    return struct.pack("<Q", max(0, len(hb) + c.prefix_delta)) + hb + data


def safetensors_verdict(path: str) -> tuple[bool, dict | str]:
    from safetensors import safe_open
    try:
        with safe_open(path, framework="numpy") as f:
            out = {}
            for k in f.keys():
                sl = f.get_slice(k)
                out[k] = (sl.get_dtype(), list(sl.get_shape()))
            return True, out
    except BaseException as e:       # the library raises SafetensorError, or panics
        if isinstance(e, KeyboardInterrupt):
            raise
        return False, f"{type(e).__name__}: {str(e)[:80]}"


def check_shard(c: ShardCase) -> str:
    """Differential: what safetensors rejects we reject; where we accept, both read the same
    tensors.  Returns 'both-accept', 'both-reject' or 'stricter:<reason>'."""
    path = _write("fuzz.safetensors", shard_bytes(c))
    theirs_ok, theirs = safetensors_verdict(path)
    res, err = attempt("parse_header", lambda: parse_header(path), CheckpointError, path, (1,))
    if err:
        return "both-reject" if not theirs_ok else "stricter:" + stricter_reason(str(err))
    entries, _ = res
    if not theirs_ok:
        raise Violation(f"we accept what safetensors rejects ({theirs})")
    ours = {e.name: (e.dtype, list(e.shape)) for e in entries}
    if ours != theirs:
        raise Violation(f"we read {ours}, safetensors reads {theirs}")
    return "both-accept"


def stricter_reason(msg: str) -> str:
    for key, reason in (("unsupported dtype", "dtype outside U8/BF16/F16/F32 (the engine's)"),
                        ("rank > 4", "rank > 4 (the reference's limit)"),
                        ("longer than 511", "name over 511 bytes (the reference's buffer)"),
                        ("duplicate", "duplicate key (safetensors keeps one silently)"),
                        ("__metadata__", "__metadata__ not an object of strings (null)"),
                        ("missing shape", "missing shape"),
                        ("duplicate key", "duplicate key in an entry")):
        if key in msg:
            return reason
    return "other: " + msg.split(": ", 1)[-1][:60]


# --- shard index (model.safetensors.index.json) ------------------------------------------

@dataclass
class IndexCase:
    doc: Any
    edit: tuple


@st.composite
def index_cases(draw) -> IndexCase:
    wm = {f"t{i}": "model.safetensors" for i in range(draw(st.integers(0, 3)))}
    doc: Any = {"metadata": {"total_size": 1}, "weight_map": wm}
    op = draw(st.sampled_from(["ok", "value", "weight_map", "root", "name"]))
    if op == "value" and wm:
        wm[next(iter(wm))] = draw(JSON_ODD)
    elif op == "weight_map":
        doc["weight_map"] = draw(JSON_ODD)
    elif op == "root":
        doc = draw(JSON_ODD)
    elif op == "name":
        wm["x"] = draw(st.sampled_from(["../model.safetensors", "/etc/passwd", "a/b", "",
                                        "missing.safetensors", ".", "model.safetensors"]))
    return IndexCase(doc, draw(SOME_EDITS))


_INDEX_MODEL: list[str] = []


def _index_model() -> str:
    if not _INDEX_MODEL:
        d = os.path.join(WORK, "indexed")
        os.makedirs(d, exist_ok=True)
        hb = json.dumps({"t0": {"dtype": "U8", "shape": [1], "data_offsets": [0, 1]}}).encode()
        with open(os.path.join(d, "model.safetensors"), "wb") as f:
            f.write(struct.pack("<Q", len(hb)) + hb + b"x")
        _INDEX_MODEL.append(d)
    return _INDEX_MODEL[0]


def check_index(c: IndexCase) -> str:
    d = _index_model()
    path = os.path.join(d, "model.safetensors.index.json")
    with open(path, "wb") as f:
        f.write(raw_edit(json.dumps(c.doc).encode(), c.edit))
    ck, refused = attempt("Checkpoint", lambda: Checkpoint(d), CheckpointError, d, (1,))
    if refused:                              # the message names the index or the shard it lacks
        return "refused"
    with ck:
        if ck.names() != ["t0"]:            # the index never changes what is read
            raise Violation(f"index changed the tensors read: {ck.names()}")
    return "accepted"


# --- config.json ----------------------------------------------------------------------------

_TINY = to_flat_dict(dims_config("tiny"))


@dataclass
class ConfigCase:
    doc: Any
    edit: tuple
    changed: bool


@st.composite
def config_cases(draw) -> ConfigCase:
    doc: Any = dict(_TINY)
    changed = False
    for _ in range(draw(st.integers(0, 3))):
        key = draw(st.sampled_from(sorted(_TINY)))
        op = draw(st.sampled_from(["set", "set", "del", "nest"]))
        changed = True
        if op == "set":
            doc[key] = draw(JSON_ODD)
        elif op == "del":
            doc.pop(key, None)
        else:
            doc = {"text_config": doc} if isinstance(doc, dict) else doc
    if draw(st.integers(0, 9)) == 0:
        doc = draw(JSON_ODD)
        changed = True
    edit = draw(SOME_EDITS)
    return ConfigCase(doc, edit, changed or edit[0] != "none")


def check_config(c: ConfigCase) -> str:
    path = _write("config.json", raw_edit(json.dumps(c.doc).encode(), c.edit))
    cfg, refused = attempt("load_config", lambda: load_config(path), ConfigError, path, (2,))
    if refused:
        return "refused"
    if not c.changed and cfg != load_config(_write("config_orig.json", json.dumps(_TINY).encode())):
        raise Violation("the unmodified config reads differently")
    # accepted: re-validation (ranges included) must hold; counts stay iterable
    type(cfg)(**{k: getattr(cfg, k) for k in cfg.__dataclass_fields__ if k not in ("shape", "source")})
    cfg.layer_map()
    return "accepted"


# --- trunk.json -----------------------------------------------------------------------------

@dataclass
class TrunkCase:
    edits: list
    raw: tuple


TRUNK_FIELDS = ["file_off", "nbytes", "tensors", "sha256", "layer"]
TENSOR_FIELDS = ["off", "nbytes", "dtype", "shape"]


@st.composite
def trunk_cases(draw) -> TrunkCase:
    edits = []
    for _ in range(draw(st.sampled_from([0, 0, 1, 1, 2, 3]))):
        where = draw(st.sampled_from(["layer", "tensor", "top"]))
        L = draw(st.integers(0, 12))
        if where == "layer":
            edits.append(("layer", L, draw(st.sampled_from(TRUNK_FIELDS)),
                          draw(st.one_of(JSON_ODD, st.integers(-2, 2).map(lambda k: k * 4096)))))
        elif where == "tensor":
            edits.append(("tensor", L, draw(st.integers(0, 30)),
                          draw(st.sampled_from(TENSOR_FIELDS)),
                          draw(st.one_of(JSON_ODD, st.integers(-64, 64)))))
        else:
            edits.append(("top", draw(st.sampled_from(["align", "layers", "draft", "n_layers"])),
                          draw(JSON_ODD)))
    return TrunkCase(edits, draw(SOME_EDITS))


_TRUNK: dict = {}


def trunk_fixture():
    """A tiny checkpoint and its packed trunk, made once per process."""
    if not _TRUNK:
        from k3engine.tools.make_checkpoint import make_checkpoint
        from k3engine.trunk import pack_trunk
        model = os.path.join(WORK, "tiny")
        make_checkpoint(model, dims_config("tiny"), seed=7)
        trunk = os.path.join(WORK, "trunk0")
        m = pack_trunk(model, trunk)
        with open(os.path.join(trunk, "trunk.json"), "rb") as f:
            _TRUNK.update(model=model, trunk=trunk, json=f.read(), manifest=m,
                          ck=Checkpoint(model))
    return _TRUNK


def _apply_trunk_edit(doc: dict, e) -> bool:
    try:
        if e[0] == "layer":
            doc["layers"][e[1]][e[2]] = e[3]
        elif e[0] == "tensor":
            ts = doc["layers"][e[1]]["tensors"]
            if not ts:
                return False                     # an earlier edit emptied the layer
            name = sorted(ts)[e[2] % len(ts)]
            v = e[4]
            if e[3] in ("off", "nbytes") and isinstance(v, int) and -64 <= v <= 64:
                v = ts[name][e[3]] + v          # a nearby, plausible value
            ts[name][e[3]] = v
        else:
            doc[e[1]] = e[2]
        return True
    except (KeyError, IndexError, TypeError):
        return False


def check_trunk(c: TrunkCase) -> str:
    from k3engine.trunk import TrunkError, TrunkManifest
    fx = trunk_fixture()
    doc = json.loads(fx["json"])
    for e in c.edits:
        _apply_trunk_edit(doc, e)
    d = os.path.join(WORK, "trunk")
    os.makedirs(d, exist_ok=True)
    bin_path = os.path.join(d, "trunk.bin")
    if not os.path.exists(bin_path):
        os.symlink(os.path.join(fx["trunk"], "trunk.bin"), bin_path)
    jp = os.path.join(d, "trunk.json")
    with open(jp, "wb") as f:
        f.write(raw_edit(json.dumps(doc).encode(), c.raw))
    def load():
        m = TrunkManifest.load(d)
        m.check_against(fx["ck"], len(fx["manifest"].layers))
        return m
    m, refused = attempt("TrunkManifest", load, TrunkError, d, (1,))   # names trunk.json/.bin
    if refused:
        return "refused"
    # accepted and matched to the checkpoint: it must read exactly the original bytes
    for a, b in zip(m.layers, fx["manifest"].layers):
        if (a.file_off, a.tensors) != (b.file_off, b.tensors):
            raise Violation("an edited trunk.json was accepted and binds other bytes")
    return "accepted"


# --- state file -----------------------------------------------------------------------------

@dataclass
class StateCase:
    field_edits: list
    raw: tuple


HEADER_FIELDS = {"version": 4, "n_bound": 56, "n_mla": 60, "cached": 64, "nseq": 68}


@st.composite
def state_cases(draw) -> StateCase:
    edits = [(draw(st.sampled_from(sorted(HEADER_FIELDS))),
              draw(st.one_of(st.sampled_from([0, -1, 1, 2**31 - 1, 300_000_000]),
                             st.integers(-2**31, 2**31 - 1))))
             for _ in range(draw(st.sampled_from([0, 0, 1, 2])))]
    return StateCase(edits, draw(SOME_EDITS))


_STATE: dict = {}


def _state_fixture():
    if not _STATE:
        cfg = dims_config("tiny")
        src = SequenceState(cfg, 8, 4)
        rng = np.random.default_rng(3)
        for lay in src.layers:
            for a in vars(lay).values():
                if isinstance(a, np.ndarray):
                    a[...] = rng.standard_normal(a.shape)
        src.n_cached = 5
        for lay in src.layers:                  # rows past the cached positions are not saved
            if isinstance(lay, MLAState):
                lay.set_rows(5, np.zeros((8 - 5, lay.width), np.float32))
                lay.set_rope(5, np.zeros((8 - 5, lay.rope.shape[1]), np.float32))
        path = os.path.join(WORK, "orig.k3st")
        save_state(path, src, [1, 2, 3, 4, 5, 6])
        with open(path, "rb") as f:
            _STATE.update(cfg=cfg, src=src, data=f.read())
    return _STATE


def _arrays(state):
    return [a for lay in state.layers for a in vars(lay).values() if isinstance(a, np.ndarray)]


def check_state(c: StateCase) -> str:
    fx = _state_fixture()
    data = bytearray(fx["data"])
    for name, v in c.field_edits:
        struct.pack_into("<i", data, HEADER_FIELDS[name], v)
    path = _write("fuzz.k3st", raw_edit(bytes(data), c.raw))
    from k3engine.statefile import peek_state
    dst = SequenceState(fx["cfg"], 8, 4)
    def load():
        peek_state(path)
        return load_state(path, dst)
    ids, refused = attempt("load_state", load, StateFileError, path, (1,))
    if refused:
        if any(np.any(a) for a in _arrays(dst)):
            raise Violation("a refused load changed the target state")
        return "refused"
    if ids != [1, 2, 3, 4, 5, 6] or dst.n_cached != 5 or not all(
            np.array_equal(a.view(np.uint32), b.view(np.uint32))
            for a, b in zip(_arrays(dst), _arrays(fx["src"]))):
        raise Violation("an edited state file restored a different state")
    return "accepted"


# --- history line ---------------------------------------------------------------------------

@st.composite
def history_lines(draw) -> bytes:
    role = draw(st.sampled_from(["system", "user", "assistant"] * 3 + ["tool", "", "User"]))
    content = draw(st.integers(0, 4).flatmap(lambda k: st.text(max_size=40) if k else
                                             st.sampled_from(["\ud800", "a\x00b", "\\u0000"])))
    rec: Any = {"role": role, "content": content}
    if draw(st.integers(0, 3)) == 0:
        rec["reasoning_content"] = draw(st.one_of(st.text(max_size=10), JSON_ODD))
    if draw(st.integers(0, 5)) == 0:
        rec[draw(st.text(max_size=5))] = draw(JSON_ODD)
    if draw(st.integers(0, 8)) == 0:
        rec = draw(JSON_ODD)
    line = json.dumps(rec, ensure_ascii=draw(st.booleans())).encode("utf-8", "surrogatepass")
    first = b'{"role":"user","content":"hi"}\n' if role == "assistant" else b""
    return first + raw_edit(line, draw(SOME_EDITS)) + draw(st.sampled_from([b"\n", b"", b"\r\n"]))


def check_history(data: bytes) -> str:
    path = _write("h.jsonl", data)
    h, refused = attempt("History.load", lambda: History.load(path), ChatError, path, (1,))
    if refused:
        return "refused"
    again = os.path.join(WORK, "h2.jsonl")
    try:
        h.save(again)
    except ChatError as e:
        raise Violation(f"a history that loaded cannot be saved: {e}") from e
    if History.load(again) != h:
        raise Violation("a saved history loads back differently")
    return "accepted"


# --- tokenizer files ------------------------------------------------------------------------

import base64  # noqa: E402


def _tok_lines(extra_ranks: int = 8) -> list[bytes]:
    lines = [base64.b64encode(bytes([b])) + b" " + str(b).encode() for b in range(256)]
    lines += [base64.b64encode(bytes([97 + i % 26, 98 + i % 20])) + b" " + str(256 + i).encode()
              for i in range(extra_ranks)]
    return lines


@dataclass
class TokCase:
    lines: list
    added: Any
    edit_model: tuple
    edit_config: tuple


@st.composite
def tok_cases(draw) -> TokCase:
    lines = _tok_lines()
    op = draw(st.sampled_from(["ok"] * 6 + ["cut", "rank", "token", "dup"]))
    if op == "cut":
        del lines[draw(st.integers(200, len(lines) - 1)):]
    elif op == "rank":
        i = draw(st.integers(0, len(lines) - 1))
        lines[i] = lines[i].split(b" ")[0] + b" " + draw(st.sampled_from(
            [b"-1", b"1e3", b"\xd9\xa1", b"99999999999999999999", b"", b"0x10", b"300"]))
    elif op == "token":
        i = draw(st.integers(0, len(lines) - 1))
        lines[i] = draw(st.binary(max_size=12)) + b" " + lines[i].split(b" ")[-1]
    elif op == "dup":
        lines.append(lines[draw(st.integers(0, len(lines) - 1))])
    n = 264
    names = ["[BOS]", "[EOS]", "<|end_of_msg|>", "<|open|>", "<|close|>", "<|sep|>"]
    added: Any = {str(n + i): {"content": c, "special": True} for i, c in enumerate(names)}
    aop = draw(st.sampled_from(["ok"] * 8 + ["id", "content", "special", "root", "surrogate"]))
    if aop == "id":
        added[draw(st.sampled_from(["-1", "0", "163840", "1e3", "\u0662", str(n + 10)]))] = \
            {"content": "<|x|>"}
    elif aop == "content":
        added[str(n)]["content"] = draw(JSON_ODD)
    elif aop == "special":
        added[str(n)]["special"] = draw(JSON_ODD)
    elif aop == "root":
        added = draw(JSON_ODD)
    elif aop == "surrogate":
        added[str(n)]["content"] = "<|\ud800|>"
    return TokCase(lines, added, draw(RAW_EDITS) if draw(st.integers(0, 3)) == 0 else ("none", 0, 0),
                   draw(RAW_EDITS) if draw(st.integers(0, 3)) == 0 else ("none", 0, 0))


SAMPLE = "Hello, world! [BOS] ab ba \u4e2d\u6587 <|open|>x<|close|>"


def check_tok(c: TokCase) -> str:
    d = os.path.join(WORK, "tok")
    os.makedirs(d, exist_ok=True)
    _write("tok/tiktoken.model", raw_edit(b"\n".join(c.lines) + b"\n", c.edit_model))
    _write("tok/tokenizer_config.json",
                raw_edit(json.dumps({"added_tokens_decoder": c.added}).encode("utf-8", "surrogatepass"),
                         c.edit_config))
    tok, refused = attempt("Tokenizer.from_dir", lambda: Tokenizer.from_dir(d), TokenizerError,
                           d, (1,))                     # names tiktoken.model or the config
    if refused:
        return "refused"
    ids = tok.encode(SAMPLE, True)
    if tok.decode(ids).decode("utf-8") != SAMPLE:
        raise Violation("an accepted tokenizer does not round-trip the sample")
    return "accepted"


# --- ids lists ------------------------------------------------------------------------------

IDS_ALPHABET = "0123456789 ,\t\n-+.e\u0661\u0662\u00b2\u2460\uff11\u00a0x"


def check_ids(text: str) -> str:
    ids, err = attempt("parse_ids", lambda: parse_ids(text, "--ids"), IdsError, "--ids", None)
    if err:
        return "refused"
    pieces = text.replace(",", " ").split()
    if not text.isascii() or ids != [int(p) for p in pieces] or any(i >= 2**31 for i in ids):
        raise Violation(f"ids {ids} from {text!r}")
    return "accepted"


@dataclass
class Family:
    name: str
    strategy: Any
    check: Callable[[Any], str]
    counts: dict = field(default_factory=dict)


FAMILIES = [
    Family("shard header", shard_cases(), check_shard),
    Family("shard index", index_cases(), check_index),
    Family("config", config_cases(), check_config),
    Family("trunk.json", trunk_cases(), check_trunk),
    Family("state file", state_cases(), check_state),
    Family("history line", history_lines(), check_history),
    Family("tokenizer files", tok_cases(), check_tok),
    Family("ids list", st.text(alphabet=IDS_ALPHABET, max_size=24), check_ids),
]


# --- end to end: the real `k3` process on a damaged model ---------------------------------

@dataclass
class E2ECase:
    target: str
    case: Any


@st.composite
def e2e_cases(draw) -> E2ECase:
    target = draw(st.sampled_from(["config", "header", "trunk"]))
    if target == "config":
        return E2ECase(target, draw(config_cases()))
    if target == "trunk":
        return E2ECase(target, draw(trunk_cases()))
    return E2ECase(target, (draw(RAW_EDITS), draw(st.sampled_from([0, 0, -6, -1, 1, 8]))))


_E2E: dict = {}


def _k3(model: str, *extra: str):
    import subprocess
    import sys
    return subprocess.run([sys.executable, "-m", "k3engine", model, "--ids", "1,2,3", "--gen",
                           "2", "--out", os.path.join(WORK, "e2e_out.json"), *extra],
                          capture_output=True, text=True, timeout=300)


def _ids(stdout: str) -> str | None:
    for line in stdout.splitlines():
        if line.startswith("generated ids:"):
            return line
    return None


def check_e2e(c: E2ECase) -> str:
    """Through the real process: exit 0 with the unmodified model's ids, or a documented
    refusal (1 damaged file, 2 config) naming the file; never a traceback."""
    import shutil
    fx = trunk_fixture()
    if not _E2E:
        base = _k3(fx["model"], "--trunk", fx["trunk"])
        assert base.returncode == 0, base.stderr
        _E2E["ids"] = _ids(base.stdout)
    model = os.path.join(WORK, "e2e_model")
    trunk = os.path.join(WORK, "e2e_trunk")
    for d in (model, trunk):
        shutil.rmtree(d, ignore_errors=True)
    shutil.copytree(fx["model"], model)
    shutil.copytree(fx["trunk"], trunk)
    named = model
    if c.target == "config":
        with open(os.path.join(model, "config.json"), "wb") as f:
            f.write(raw_edit(json.dumps(c.case.doc).encode(), c.case.edit))
    elif c.target == "header":
        p = os.path.join(model, "model.safetensors")
        with open(p, "rb") as f:
            raw = f.read()
        n = int.from_bytes(raw[:8], "little")
        edit, delta = c.case
        head = raw_edit(raw[8:8 + n], edit)
        with open(p, "wb") as f:
            f.write(struct.pack("<Q", max(0, len(head) + delta)) + head + raw[8 + n:])
    else:
        doc = json.loads(fx["json"])
        for e in c.case.edits:
            _apply_trunk_edit(doc, e)
        with open(os.path.join(trunk, "trunk.json"), "wb") as f:
            f.write(raw_edit(json.dumps(doc).encode(), c.case.raw))
        named = trunk
    p = _k3(model, "--trunk", trunk)
    if "Traceback" in p.stderr:
        raise Violation(f"k3 printed a traceback (exit {p.returncode}): {p.stderr[-400:]}")
    if p.returncode == 0:
        if _ids(p.stdout) != _E2E["ids"]:
            raise Violation(f"exit 0 with other ids: {_ids(p.stdout)} vs {_E2E['ids']}")
        return "same ids"
    if p.returncode not in (1, 2) or named not in p.stderr:
        raise Violation(f"exit {p.returncode} without naming {named}: {p.stderr[-300:]}")
    return f"exit {p.returncode}"


SLOW_FAMILIES = [Family("k3 end to end", e2e_cases(), check_e2e)]


# --- K3 Studio's own files (tests/fuzz/app_families.py; needs the app and PySide6) ----------

try:
    from .app_families import APP_FAMILIES  # noqa: E402
except ImportError:                         # an engine-only install: the engine families run
    APP_FAMILIES = []
FAMILIES += APP_FAMILIES
