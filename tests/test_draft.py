"""Hybrid decode (SYSTEM §6.10 `--draft-trunk`): a draft model proposes, the exact model
verifies.  Whatever the draft proposes, the ids are the exact model's greedy ids; the
draft's lockstep (snapshot, rewind, catch-up) decides only how many are accepted, so the
gates also check acceptance where it is predictable: the exact trunk used as its own
draft must have every proposal accepted."""
from __future__ import annotations

import json
import os

import numpy as np
import pytest

from engine_helpers import GOLDEN_SEED, decode, make_tiny
from k3engine.checkpoint import CheckpointError
from k3engine.draft import DraftModel, DraftRouter, ResidentOnly
from k3engine.experts import ExpertCache
from k3engine.memory import plan
from k3engine.model import Model
from k3engine.loading import load_draft, load_model, open_model
from k3engine.speculative import SpecWidth
from k3engine.trunk import TrunkError, draft_quantised, pack_trunk, qdq_bf16_rows
from test_cli import GOLDEN

PROMPT, WANT = GOLDEN["prompt_ids"], GOLDEN["generated_ids"]


# ---- the quantise-dequantise rule ----------------------------------------------------

def _bf16(x: np.ndarray) -> np.ndarray:
    b = np.ascontiguousarray(x, np.float32).view(np.uint32)
    return ((b + 0x7FFF + ((b >> 16) & 1)) >> 16).astype(np.uint16)


def _f32(u: np.ndarray) -> np.ndarray:
    return (u.astype(np.uint32) << 16).view(np.float32)


def test_qdq_rows_error_bound_and_exact_cases():
    rng = np.random.default_rng(7)
    x = rng.standard_normal((6, 96)).astype(np.float32) * np.float32([[1], [1e-3], [50], [0],
                                                                      [1], [1]])
    x[4] = (np.arange(96) - 48) / 128.0            # on the 8-bit grid of its own row max
    x[4, 0] = 127 / 128.0                          # (scale 1/128): survives exactly
    buf = bytearray(_bf16(x).tobytes())
    before = _f32(np.frombuffer(bytes(buf), np.uint16).reshape(6, 96))
    qdq_bf16_rows(buf, 0, (6, 96), 8)
    after = _f32(np.frombuffer(bytes(buf), np.uint16).reshape(6, 96))
    scale = np.abs(before).max(axis=1) / 127
    err = np.abs(after - before).max(axis=1)
    # half a quantisation step, plus the BF16 rounding of the result (2^-8 relative)
    bound = scale / 2 + np.abs(before).max(axis=1) * 2.0 ** -8
    print(f"[gate] qdq 8-bit per row: worst error / bound = {np.max(err / np.maximum(bound, 1e-30)):.3f}")
    assert np.all(err <= bound)
    assert np.all(after[3] == 0)                   # an all-zero row stays zero (no 0/0)
    assert np.array_equal(after[4], before[4])
    assert not np.array_equal(after, before)       # it did quantise
    coarse = bytearray(_bf16(x).tobytes())
    qdq_bf16_rows(coarse, 0, (6, 96), 2)
    assert len(np.unique(_f32(np.frombuffer(bytes(coarse), np.uint16).reshape(6, 96))[0])) <= 3


def test_qdq_rows_only_touches_its_tensor():
    rng = np.random.default_rng(8)
    x = _bf16(rng.standard_normal((4, 32)))
    buf = bytearray(b"\xAB" * 64 + x.tobytes() + b"\xCD" * 64)
    qdq_bf16_rows(buf, 64, (4, 32), 8)
    assert buf[:64] == b"\xAB" * 64 and buf[-64:] == b"\xCD" * 64


# ---- packing a draft trunk, and what refuses it --------------------------------------

@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny(tmp_path_factory.mktemp("draft") / "tiny", GOLDEN_SEED)


@pytest.fixture(scope="module")
def trunks(tiny, tmp_path_factory):
    base = tmp_path_factory.mktemp("draft")
    exact = pack_trunk(tiny, str(base / "exact"))
    d8 = pack_trunk(tiny, str(base / "d8"), draft_bits=8)                 # I8R, the default
    d2 = pack_trunk(tiny, str(base / "d2"), draft_bits=2, draft_format="bf16")
    q8 = pack_trunk(tiny, str(base / "q8"), draft_bits=8, draft_format="bf16")
    return exact, d8, d2, q8


def test_bf16_draft_trunk_layout_equals_the_exact_trunk(trunks):
    exact, _, _, d8 = trunks
    assert exact.draft is None and d8.draft == {"method": "qdq", "bits": 8, "format": "bf16",
                                                "granularity": "row", "source": "tiny"}
    eb = open(exact.bin_path, "rb").read()
    db = open(d8.bin_path, "rb").read()
    assert len(eb) == len(db)
    changed = same = 0
    for le, ld in zip(exact.layers, d8.layers):
        assert (le.file_off, le.nbytes, le.tensors) == (ld.file_off, ld.nbytes, ld.tensors)
        for name, t in le.tensors.items():
            a = eb[le.file_off + t.off:le.file_off + t.off + t.nbytes]
            b = db[le.file_off + t.off:le.file_off + t.off + t.nbytes]
            if draft_quantised(_Named(name, t)):
                changed += a != b
            else:
                assert a == b, f"{name} is not a matrix and must be copied verbatim"
                same += 1
    print(f"[gate] BF16 draft trunk: {changed} matrices quantised, {same} other tensors "
          f"verbatim (router included)")
    assert changed > 20 and same > 20


class _Named:
    def __init__(self, name, t):
        self.name, self.dtype, self.shape = name, t.dtype, t.shape


def test_i8r_draft_trunk_holds_int8_rows_of_the_same_values(trunks):
    """The I8R container stores exactly the integers and scales whose products the BF16
    draft holds (up to that format's rounding to BF16); vectors and routers verbatim."""
    exact, d8, _, q8 = trunks
    assert d8.draft["format"] == "i8r" and d8.draft["method"] == "int8"
    eb, db, qb = (open(m.bin_path, "rb").read() for m in (exact, d8, q8))
    n_i8r = 0
    for L, (le, ld, lq) in enumerate(zip(exact.layers, d8.layers, q8.layers)):
        assert set(le.tensors) == set(ld.tensors)
        for name, t in le.tensors.items():
            d = ld.tensors[name]
            raw = db[ld.file_off + d.off:ld.file_off + d.off + d.nbytes]
            if d.dtype == "I8R":
                n_i8r += 1
                rows, cols = t.shape
                assert d.shape == t.shape and d.nbytes == 4 * rows + rows * cols
                scale = np.frombuffer(raw[:4 * rows], np.float32)
                q = np.frombuffer(raw[4 * rows:], np.int8).reshape(rows, cols)
                assert np.abs(q).max() <= 127
                u = np.frombuffer(qb[lq.file_off + t.off:lq.file_off + t.off + t.nbytes],
                                  np.uint16).reshape(rows, cols)
                assert np.array_equal(_bf16(q.astype(np.float32) * scale[:, None]), u)
            else:
                assert d.dtype == t.dtype and not draft_quantised(_Named(name, t))
                assert raw == eb[le.file_off + t.off:le.file_off + t.off + t.nbytes]
    ratio = d8.total_bytes() / exact.total_bytes()
    print(f"[gate] I8R draft trunk: {n_i8r} int8 matrices, {ratio:.2f} x the exact trunk's "
          f"bytes; int8 x scale equals the BF16 draft's values")
    assert n_i8r > 20 and ratio < 0.7


@pytest.mark.parametrize("edit,message", [
    (lambda j: j.pop("draft"), "dtype 'I8R', which this reader does not decode outside a "
                               "draft trunk"),
    (lambda j: j.update(draft={"bits": "eight"}), "malformed 'draft' entry"),
])
def test_damaged_draft_manifest_is_refused(trunks, tmp_path, edit, message):
    """An I8R tensor only means something in a manifest that says it is a draft (else an
    exact model could bind int8 rows); a malformed draft entry is refused outright."""
    src = trunks[1].trunk_dir
    d = tmp_path / "bad"
    d.mkdir()
    os.link(os.path.join(src, "trunk.bin"), d / "trunk.bin")
    j = json.load(open(os.path.join(src, "trunk.json")))
    edit(j)
    (d / "trunk.json").write_text(json.dumps(j))
    from k3engine.trunk import TrunkManifest
    with pytest.raises(CheckpointError, match=message):
        TrunkManifest.load(str(d))


def test_exact_model_refuses_a_draft_trunk(tiny, trunks):
    from k3engine.config import load_config
    cfg = load_config(os.path.join(tiny, "config.json"))
    with pytest.raises(TrunkError, match=r"d8/trunk.json: this is a quantised draft trunk"):
        open_model(tiny, cfg, trunk_dir=trunks[1].trunk_dir)


def test_draft_pack_never_overwrites_an_exact_trunk(tiny, trunks, tmp_path):
    exact = trunks[0]
    d = tmp_path / "t"
    pack_trunk(tiny, str(d))
    before = {f: (d / f).read_bytes() for f in os.listdir(d)}
    with pytest.raises(TrunkError, match="holds an exact packed trunk"):
        pack_trunk(tiny, str(d), draft_bits=8)
    assert {f: (d / f).read_bytes() for f in os.listdir(d)} == before
    assert exact.draft is None


# ---- routing of the draft --------------------------------------------------------------

@pytest.fixture
def exact_lm(tiny, trunks):
    lm = _load(tiny, trunks[0].trunk_dir)
    yield lm
    lm.close()


def _load(tiny, trunk_dir, draft_dir=None, cache_gb=0.1):
    from k3engine.config import load_config
    cfg = load_config(os.path.join(tiny, "config.json"))
    setup = open_model(tiny, cfg, trunk_dir=trunk_dir, draft_dir=draft_dir)
    p = plan(setup.figures, trunk_gb=1, cache_gb=cache_gb, streamed=True, incremental=True,
             positions=64, draft_sizes=setup.draft_sizes, draft_gb=1)
    lm = load_model(setup, plan=p, cache_bytes=int(p.expert_cache_bytes))
    lm.setup, lm.plan = setup, p
    return lm


def test_cache_only_routing_picks_resident_experts_and_reads_nothing(exact_lm):
    lm = exact_lm
    cache: ExpertCache = lm.experts
    cfg = lm.cfg
    L = next(L for L in range(cfg.n_layers) if not cfg.is_dense(L))
    resident = [1, 4, 6]
    list(cache.batches(L, resident))                     # make exactly these resident
    w = lm.model.weights.layer(L).mlp
    lm.model.weights.release(L)
    x = np.random.default_rng(3).standard_normal(cfg.hidden).astype(np.float32)
    def snapshot():
        return (cache.total.requests, cache.total.bytes_read, cache.trace.requests,
                cache.policy.snapshot())             # e.g. LRU's recency order
    before = snapshot()
    idx, wts = DraftRouter(cache, 2, cache_only=True)(w, x, cfg, L)
    assert set(idx.tolist()) <= set(resident) and len(idx) == 2
    from k3engine import kernels as K
    s = K.router(w.router, x, w.bias, 1, cfg.moe_renorm, cfg.routed_scale,
                 np.empty(1, np.int32), np.empty(1, np.float32))
    sel = s + w.bias                                     # the biased selection score
    ranked = [e for e in sorted(range(cfg.n_experts), key=lambda e: (-sel[e], e))
              if e in resident]
    assert idx.tolist() == ranked[:2]                    # the best two resident, in order
    if cfg.moe_renorm:
        assert abs(float(wts.sum()) - cfg.routed_scale) < 1e-5
    got = list(ResidentOnly(cache).batches(L, idx.tolist()))[0]
    assert [e for e, _ in got] == idx.tolist()
    assert snapshot() == before, "cache-only draft routing must not count, trace or read"
    empty = DraftRouter(cache, 2, cache_only=True)(w, x, cfg, L + 1 if L + 1 < cfg.n_layers
                                                        else L - 1)
    assert len(empty[0]) == 0                            # nothing resident in that layer
    with pytest.raises(KeyError):
        cache.peek(L, 0)


# ---- the gates: ids equal greedy whatever the draft says --------------------------------

def _hybrid(tiny, trunks, which: str, spec=4, topk=2, cache_only=False, auto=False,
            mutate=None):
    exact, d8, d2, q8 = trunks
    draft_dir = {"exact": exact, "8-bit": d8, "2-bit": d2, "8-bit bf16": q8}[which].trunk_dir
    lm = _load(tiny, exact.trunk_dir, draft_dir)
    try:
        draft = load_draft(lm, lm.setup, lm.plan, len(PROMPT) + len(WANT) + 1, topk,
                           cache_only)
        if mutate:
            mutate(draft)
        res = decode(lm, PROMPT, len(WANT), spec=spec, proposer=draft, spec_auto=auto)
        draft.close()
        return res, draft
    finally:
        lm.close()


@pytest.mark.parametrize("which,cache_only,auto", [
    ("exact", False, False), ("8-bit", False, False), ("8-bit", True, False),
    ("8-bit bf16", False, False),
    ("2-bit", False, False), ("8-bit", False, True), ("exact", True, True)])
def test_hybrid_ids_equal_greedy(tiny, trunks, which, cache_only, auto):
    res, draft = _hybrid(tiny, trunks, which, cache_only=cache_only, auto=auto)
    sp = res.spec
    print(f"[gate] hybrid, {which} draft{', cache-only' if cache_only else ''}"
          f"{', --spec-auto' if auto else ''}: {sp.rounds} rounds, {sp.drafted} drafted, "
          f"{sp.accepted} accepted, {res.steps} steps for {len(WANT)} ids; "
          f"ids equal greedy: {res.ids == WANT}")
    assert res.ids == WANT
    assert sp.rounds > 0 and draft.steps > 0
    if which == "exact" and not cache_only:
        # the exact trunk with the exact routing proposes exactly the greedy continuation
        assert sp.accepted == sp.drafted


def test_rejected_proposals_are_rewound(tiny, trunks):
    """Corrupt the second token of every proposal from the exact trunk: every round must
    then keep exactly one draft.  Without the rewind the draft would carry the rejected
    token into its next proposals and lose even that one."""
    def corrupt_second(draft: DraftModel):
        propose = draft.propose

        def wrapped(seq, cap):
            d = propose(seq, cap)
            if len(d) > 1:
                d[1] = (d[1] + 1) % 256
            return d
        draft.propose = wrapped
    res, _ = _hybrid(tiny, trunks, "exact", mutate=corrupt_second)
    sp = res.spec
    print(f"[gate] hybrid with the second draft of every round corrupted: {sp.rounds} rounds, "
          f"{sp.accepted} accepted; ids equal greedy: {res.ids == WANT}")
    assert res.ids == WANT
    multi = sp.rounds                  # every round here drafts >= 2 (cap = min(4, left - 1))
    assert sp.accepted == multi


def test_spec_width_adapts():
    w = SpecWidth(4, adaptive=True)
    w.update(4, 4)
    assert w.n == 5 and w.ready()
    w.update(5, 2)
    assert w.n == 3 and w.ready()
    for _ in range(10):
        w.update(w.n, w.n)
    assert w.n == 8                                    # the cap of §6.10
    # drafts that keep missing: width 1, and ever longer pauses of plain steps
    pauses = []
    for _ in range(7):
        w.update(w.n, 0)
        n = 0
        while not w.ready():
            n += 1
        pauses.append(n)
    assert w.n == 1 and pauses == [1, 2, 4, 8, 16, 16, 16]
    w.update(1, 1)                                     # one hit ends the backoff
    w.update(2, 0)
    assert w.pause == 1
    fixed = SpecWidth(4)
    fixed.update(4, 0)
    assert fixed.n == 4 and fixed.ready()


def test_plan_counts_the_draft(tiny, trunks):
    from k3engine.config import load_config
    cfg = load_config(os.path.join(tiny, "config.json"))
    setup = open_model(tiny, cfg, trunk_dir=trunks[0].trunk_dir,
                       draft_dir=trunks[1].trunk_dir)
    try:
        kw = dict(trunk_gb=1, cache_gb=0.1, streamed=True, incremental=True, positions=40)
        without = plan(setup.figures, **kw)
        full = plan(setup.figures, draft_sizes=setup.draft_sizes, draft_gb=1, **kw)
        small = plan(setup.figures, draft_sizes=setup.draft_sizes, draft_gb=0, **kw)
        f = setup.figures
        extra = 2 * f.state_bytes(cfg.n_layers, False, True) + f.kv_bytes(40)
        assert full.total_bytes - without.total_bytes == full.draft_bytes
        assert full.draft_bytes == full.draft_plan.total_bytes + extra
        assert full.draft_plan.n_pinned == cfg.n_layers
        # no budget: nothing pinned, one ring slot, and the slot (not the 0) is charged
        assert small.draft_plan.n_pinned == 0 and small.draft_plan.ring_slots == 1
        assert small.draft_bytes == small.draft_plan.slot_bytes + extra
        assert any(line.startswith("  draft model") for line in full.lines())
        assert not any("draft" in line for line in without.lines())
        assert full.as_event()["draft_bytes"] == full.draft_bytes
        # a sweep of 4 drafts holds a snapshot, 5 positions of logged recurrent inputs and
        # 5 logits rows; the draft's own proposals hold 4
        spec = plan(setup.figures, draft_sizes=setup.draft_sizes, draft_gb=1, spec=4, **kw)
        assert spec.spec_bytes == f.speculation_bytes(cfg.n_layers, 5) > f.state_bytes(
            cfg.n_layers, False, True)
        assert spec.draft_bytes - full.draft_bytes == f.speculation_bytes(cfg.n_layers, 4) - \
            f.speculation_bytes(cfg.n_layers, 0)
        assert spec.total_bytes - full.total_bytes == spec.spec_bytes + \
            spec.draft_bytes - full.draft_bytes
        assert any(line.startswith("  speculation") for line in spec.lines())
        assert plan(setup.figures, spec=4, **dict(kw, incremental=False)).spec_bytes == 0
    finally:
        setup.ck.close()


# ---- the real `k3` process --------------------------------------------------------------

from test_cli import PROMPT as PROMPT_ARG, k3  # noqa: E402


def test_cli_hybrid_decode_report_and_out_keys(tiny, trunks, tmp_path):
    out = tmp_path / "o.json"
    p = k3(tiny, "--ids", PROMPT_ARG, "--gen", len(WANT), "--incremental", "--trunk",
           trunks[0].trunk_dir, "--draft-trunk", trunks[1].trunk_dir, "--draft-trunk-gb", 0,
           "--spec-auto", "--out", out)
    assert p.returncode == 0, p.stderr
    j = json.loads(out.read_text())
    print(f"[cli] hybrid decode, 8-bit draft streamed through one slot, --spec-auto: "
          f"{j['spec_accepted']}/{j['spec_drafted']} accepted; ids equal greedy: "
          f"{j['generated_ids'] == WANT}")
    assert j["generated_ids"] == WANT
    assert list(j)[18:] == ["spec_rounds", "spec_drafted", "spec_accepted", "draft_trunk",
                            "draft_trunk_gb", "draft_topk", "draft_cache_only", "draft_seconds",
                            "draft_forwards", "draft_trunk_bytes_read", "spec_auto",
                            "spec_auto_final_width", "spec_auto_mean_width",
                            "lookahead_predicted", "lookahead_useful", "lookahead_wasted",
                            "lookahead_bytes", "lookahead_wasted_bytes", "lookahead_recall"]
    assert j["draft_trunk"] == trunks[1].trunk_dir and j["draft_topk"] == 2
    assert j["draft_trunk_gb"] == 0.0 and j["draft_cache_only"] is False
    # streamed through one slot: every draft forward re-reads the whole draft trunk
    assert j["draft_trunk_bytes_read"] >= j["draft_forwards"] * trunks[1].total_bytes()
    assert "  draft model " in p.stdout and "pinned 0/13 layers, ring 1 slots" in p.stdout
    assert "hybrid decode: draft trunk" in p.stdout and "adaptive width" in p.stdout
    assert (f"hybrid decode: {j['spec_rounds']} rounds, {j['spec_drafted']} drafted, "
            f"{j['spec_accepted']} accepted") in p.stdout
    assert "speculative decode:" not in p.stdout


def test_cli_exact_trunk_as_cache_only_draft(tiny, trunks, tmp_path):
    out = tmp_path / "o.json"
    p = k3(tiny, "--ids", PROMPT_ARG, "--gen", len(WANT), "--incremental", "--trunk",
           trunks[0].trunk_dir, "--draft-trunk", trunks[0].trunk_dir, "--draft-cache-only",
           "--draft-topk", 2, "--spec", 3, "--out", out)
    assert p.returncode == 0, p.stderr
    j = json.loads(out.read_text())
    assert j["generated_ids"] == WANT and j["draft_cache_only"] is True
    assert "NOT quantised" in p.stdout and "among cached experts only" in p.stdout
    assert "up to 3 tokens per sweep" in p.stdout


@pytest.mark.parametrize("extra,code,message", [
    (["--draft-topk", "0"], 2, "--draft-topk 0 is out of range"),
    (["--draft-topk", "3"], 2, "--draft-topk 3 exceeds the model's top-2"),
    (["--draft-topk", "two"], 2, "bad --draft-topk value 'two'"),
    (["--draft-trunk-gb", "-1"], 2, "--draft-trunk-gb must be >= 0"),
    (["--draft-trunk-gb", "nan"], 2, "bad --draft-trunk-gb value 'nan'"),
    (["--preset", "ultra"], 2, "--ultra-low-memory cannot be combined with --draft-trunk"),
])
def test_cli_draft_usage_errors(tiny, trunks, extra, code, message):
    p = k3(tiny, "--ids", PROMPT_ARG, "--incremental", "--trunk", trunks[0].trunk_dir,
           "--draft-trunk", trunks[1].trunk_dir, *extra)
    assert p.returncode == code and message in p.stderr, p.stderr


def test_cli_draft_works_in_chat(tiny, trunks):
    """Ours, not the reference's (which refuses it): the draft model proposes in chat as
    in batch runs, implying --spec 4 (the chat's ids are gated in test_chat_spec.py)."""
    from k3engine.cli import build_gen, build_load, parse_args
    o = parse_args([tiny, "--chat", "--tok", tiny, "--trunk", trunks[0].trunk_dir,
                    "--draft-trunk", trunks[1].trunk_dir])
    load, gen = build_load(o), build_gen(o)
    assert load.draft is not None and load.draft.trunk_dir == trunks[1].trunk_dir
    assert load.spec == gen.spec == 4 and load.incremental


@pytest.mark.parametrize("args,warning", [
    (["--draft-trunk", "{d}", "--trunk", "{t}"], "--draft-trunk needs --incremental and --trunk"),
    (["--draft-trunk", "{d}", "--incremental"], "--draft-trunk needs --incremental and --trunk"),
    (["--draft-topk", "2", "--incremental"], "--draft-topk needs --draft-trunk"),
    (["--draft-cache-only"], "--draft-cache-only needs --draft-trunk"),
    (["--spec-auto", "--incremental"], "--spec-auto needs --spec, --draft-trunk or --draft-model"),
])
def test_cli_draft_options_without_their_prerequisite_are_ignored(tiny, trunks, tmp_path,
                                                                  args, warning):
    out = tmp_path / "o.json"
    args = [a.format(d=trunks[1].trunk_dir, t=trunks[0].trunk_dir) for a in args]
    p = k3(tiny, "--ids", PROMPT_ARG, "--gen", 4, "--out", out, *args)
    assert p.returncode == 0, p.stderr
    assert f"k3: {warning}; ignored" in p.stderr
    j = json.loads(out.read_text())
    assert j["generated_ids"] == WANT[:4] and "spec_rounds" not in j
    assert "hybrid decode" not in p.stdout


def test_cli_refuses_a_draft_trunk_as_the_trunk_and_a_short_draft(tiny, trunks, tmp_path):
    p = k3(tiny, "--ids", PROMPT_ARG, "--trunk", trunks[1].trunk_dir)
    assert p.returncode == 1 and "this is a quantised draft trunk (8-bit)" in p.stderr
    short = tmp_path / "short"
    assert k3("pack-trunk", tiny, short, "--layers", 5, "--draft-bits", 8).returncode == 0
    p = k3(tiny, "--ids", PROMPT_ARG, "--incremental", "--trunk", trunks[0].trunk_dir,
           "--draft-trunk", short)
    assert p.returncode == 1 and "packed trunk has 5 layers, need 13" in p.stderr


def test_cli_pack_draft_refusals(tiny, trunks, tmp_path):
    p = k3("pack-trunk", tiny, tmp_path / "x", "--draft-bits", 9)
    assert p.returncode == 2 and "--draft-bits 9 is out of range" in p.stderr
    exact = trunks[0].trunk_dir
    before = open(os.path.join(exact, "trunk.bin"), "rb").read()
    p = k3("pack-trunk", tiny, exact, "--draft-bits", 8)
    assert p.returncode == 1 and "holds an exact packed trunk" in p.stderr
    assert open(os.path.join(exact, "trunk.bin"), "rb").read() == before


def test_cli_hybrid_resumed_from_a_state_file(tiny, trunks, tmp_path):
    """The draft's state is not in the state file (SYSTEM §6.9): after --load-state its first
    proposal feeds the whole restored sequence.  Same ids as the plain resumed run."""
    state = tmp_path / "s.k3s"
    assert k3(tiny, "--ids", PROMPT_ARG, "--gen", 8, "--incremental", "--save-state", state,
              "--out", tmp_path / "a.json").returncode == 0
    runs = {}
    for name, extra in (("plain", []), ("hybrid", ["--trunk", trunks[0].trunk_dir,
                                                   "--draft-trunk", trunks[1].trunk_dir])):
        out = tmp_path / f"{name}.json"
        p = k3(tiny, "--ids", WANT[7], "--gen", 10, "--incremental", "--load-state", state,
               "--out", out, *extra)
        assert p.returncode == 0, p.stderr
        runs[name] = json.loads(out.read_text())
    h = runs["hybrid"]
    print(f"[cli] resumed hybrid vs resumed plain: {h['generated_ids']} vs "
          f"{runs['plain']['generated_ids']} ({h['spec_accepted']}/{h['spec_drafted']} accepted)")
    assert h["generated_ids"] == runs["plain"]["generated_ids"] and h["spec_rounds"] > 0
    assert h["full_ids"] == runs["plain"]["full_ids"]
