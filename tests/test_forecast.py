"""The pre-flight forecast (k3engine.forecast, `k3 forecast`): structure, what each figure
is computed from, monotonicity, the machine-figure cache, and the CLI's JSON.  No timing
is asserted: the machine figures here are given, not measured (except the one test that
checks the measuring code runs and is cached)."""
from __future__ import annotations

import json

import numpy as np
import pytest

from k3engine import forecast as F
from k3engine import kernels as K
from k3engine.cli import main as k3_main
from k3engine.experts import POLICIES
from k3engine.memory import PRESETS
from k3engine.tools import forecast as tool
from k3engine.tools.sim_cache import trace_keys
from k3engine.trunk import pack_trunk

from conftest import peer_dir
from engine_helpers import make_tiny

GIVEN = F.MachineFigures(
    identity={"cpu": "test"}, read_bps={"1": 1e9, "4": 2e9, "16": 3e9}, direct=True,
    bf16_bps=10e9, bf16_call_s=50e-6, mxfp4_bps=3e9, mxfp4_call_s=30e-6, call_seconds=5e-6,
    baseline_bytes=40_000_000, threads=2, measured_at="2026-12-01T00:00:00Z", source="given")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("forecast")
    model = make_tiny(root / "tiny")
    pack_trunk(model, str(root / "trunk"))
    return model, str(root / "trunk")


def test_released_k3_shapes_match_the_published_sizes():
    """The released model from its shapes alone: 108.81 GB of packed trunk (SYSTEM §2.8,
    within the small vectors' open dtype), the largest run 2.341 GB (layer 0), one expert
    17,547,264 B and its slot 17,555,456 B (§1.6, §4.1), the 4.70 GB model tables."""
    m = F.released_k3()
    f = m.figures
    print(f"[oracle] released K3: trunk {sum(f.layer_sizes):,} B, largest "
          f"{max(f.layer_sizes):,} B, expert {f.expert_bytes:,} B")
    assert abs(sum(f.layer_sizes) / 1e9 - 108.81) < 0.02
    assert abs(max(f.layer_sizes) / 1e9 - 2.341) < 0.001 and f.layer_sizes[0] == max(f.layer_sizes)
    assert f.expert_bytes == 17_547_264 and f.expert_slot_bytes == 17_555_456
    assert f.expert_pool == 92 * 896
    assert round(f.table_bytes / 1e9, 2) == 4.70
    assert m.streamed and "path" not in json.dumps(m.shape)


def test_released_k3_reads_per_token_at_nothing_pinned():
    """Nothing pinned and a cache far below the pool: the whole trunk plus ~all of the
    25.83 GB of experts per token (SYSTEM §5.2's 135 GB)."""
    fc = F.forecast(F.released_k3(), GIVEN, trunk_gb=3.0, cache_gb=1.0, prompt_len=16, gen=8)
    assert fc.plan.trunk_plan.n_pinned == 0
    assert fc.trunk_bytes_per_token == sum(F.released_k3().figures.layer_sizes)
    assert 25.5e9 < fc.expert_bytes_per_token <= 25.83e9
    assert fc.bytes_read_per_token == fc.trunk_bytes_per_token + int(fc.expert_bytes_per_token)


def test_every_figure_says_what_it_came_from():
    fc = F.forecast(F.released_k3(), GIVEN, preset="desktop", prompt_len=32, gen=8)
    text = " ".join(fc.assumptions)
    for needle in ("peak RSS", "hit rate", "device read", "BF16", "MXFP4", "prefill", "given"):
        assert needle in text, needle
    d = fc.as_json()
    for key in ("s_per_token", "ttft_s", "peak_rss_bytes", "bytes_read_per_token",
                "assumptions", "plan", "machine"):
        assert key in d, key
    json.dumps(d)                                    # serialisable


def test_more_cache_never_predicts_more_bytes_read():
    m = F.released_k3()
    last = None
    for cache in (0.5, 1, 8, 64, 256, 1024, 1500):
        fc = F.forecast(m, GIVEN, trunk_gb=110.0, cache_gb=cache, prompt_len=8, gen=8)
        if last is not None:
            assert fc.bytes_read_per_token <= last.bytes_read_per_token, cache
            assert fc.s_per_token <= last.s_per_token + 1e-12, cache
            assert fc.hit_rate >= last.hit_rate
        last = fc
    assert last.hit_rate == pytest.approx(1.0)        # the whole pool fits


def test_more_trunk_never_predicts_more_trunk_reads():
    m = F.released_k3()
    reads = [F.forecast(m, GIVEN, trunk_gb=t, cache_gb=1.0).trunk_bytes_per_token
             for t in (3, 16, 60, 110, 120)]
    assert reads == sorted(reads, reverse=True) and reads[-1] == 0


@pytest.mark.parametrize("name", ["lru", "s3fifo"])
def test_trace_hit_rate_is_the_replay_of_the_runs_policy(name, monkeypatch):
    """With a trace, the hit rate is the replay of the policy a run would use
    (K3_CACHE_POLICY) at the plan's slot count."""
    monkeypatch.setenv("K3_CACHE_POLICY", name)
    rng = np.random.default_rng(0)
    pairs = np.stack([rng.integers(1, 4, 5000), rng.integers(0, 32, 5000)], axis=1)
    keys = trace_keys(pairs.astype(np.int32))
    hits = F.TraceRouting(keys, "a test trace")
    assert hits.description.startswith(f"{POLICIES[name].title} replay")
    policy = POLICIES[name](40)
    tail = [policy.access(k) for k in keys][len(keys) // 2:]     # warm: the second half
    assert hits.steady_hit(40, None) == sum(tail) / len(tail)
    assert hits.steady_hit(200, None) >= hits.steady_hit(40, None)
    assert hits.distinct(None, 0) == len(set(keys))


def test_uniform_hit_rate_cold_start_and_steady_state():
    m = F.released_k3()
    u = F.UniformRouting()
    pool = m.figures.expert_pool
    assert u.steady_hit(pool // 4, m) == pytest.approx(0.25)
    early, later = u.decode_hit(pool, m, 1), u.decode_hit(pool, m, 50)
    assert 0 < early < later <= 1.0                 # the cache fills as experts are seen


def test_local_checkpoint_streamed_and_resident(tiny):
    model, trunk = tiny
    streamed = F.local_model(model, trunk)
    resident = F.local_model(model)
    assert streamed.streamed and not resident.streamed
    assert "tiny" not in streamed.name and "/" not in streamed.name     # no path in the name
    fs = F.forecast(streamed, GIVEN, trunk_gb=0.0, cache_gb=0.01, prompt_len=4, gen=4)
    fr = F.forecast(resident, GIVEN, cache_gb=1.0, prompt_len=4, gen=4)
    assert fs.trunk_bytes_per_token == sum(streamed.figures.layer_sizes) > 0
    assert fr.trunk_bytes_per_token == 0 and fr.plan.trunk_plan is None
    assert fs.peak_rss_bytes > GIVEN.baseline_bytes


def test_splits_keep_the_total(tiny):
    model, trunk = tiny
    shape = F.local_model(model, trunk)
    rows = F.splits(shape, GIVEN, 0.05, steps=5)
    assert len(rows) == 5
    for t, c, fc in rows:
        assert t + c == pytest.approx(0.05, abs=2e-3)
        assert fc.plan.trunk_gb == pytest.approx(t)
    trunks = [t for t, _, _ in rows]
    assert trunks == sorted(trunks)


def test_machine_figures_cached_by_identity(tmp_path, monkeypatch):
    """The measuring code runs (a short device test and calibration), the result is cached
    under the identity, reused, and a damaged cache file is remeasured, not trusted."""
    from k3engine import calibrate as C
    monkeypatch.setattr(C, "READ_SCRATCH_BYTES", 16 * 10**6)
    monkeypatch.setattr(C, "READ_SECONDS", 0.2)
    monkeypatch.setattr(C, "KERNEL_SECONDS", 0.05)
    monkeypatch.setattr(C, "COLD_ROTATION", 1)
    cache = tmp_path / "figures.json"
    m1 = F.machine_figures(str(tmp_path), 1, path=str(cache))
    assert m1.source == "measured" and m1.bf16_bps > 0 and m1.read_rate(16) > 0
    stored = json.loads(cache.read_text())
    assert list(stored) == [F.identity_key(F.machine_identity(str(tmp_path), 1))]
    assert not any(str(tmp_path) in json.dumps(v) for v in stored.values())  # no paths
    m2 = F.machine_figures(str(tmp_path), 1, path=str(cache))
    assert m2.source.startswith("cache") and m2.bf16_bps == m1.bf16_bps
    cache.write_text("{not json")
    m3 = F.machine_figures(str(tmp_path), 1, path=str(cache))
    assert m3.source == "measured"
    json.loads(cache.read_text())


def test_overrides_recompute_another_machine():
    m = GIVEN.with_overrides(read_gbs=4.6)
    assert m.read_rate(1) == m.read_rate(16) == 4.6e9
    assert "given" in m.source and "4.6" in m.source


def _given_cache(tmp_path, monkeypatch):
    monkeypatch.setattr(F, "machine_figures", lambda *a, **k: GIVEN)


def test_bf16_rate_follows_the_models_row_width():
    """Short rows stream slower, so the BF16 rate a model is priced at is the one measured
    at its hidden width: interpolated in log2(width) between measured widths, clamped at
    the ends; a given rate (another machine's) applies to every width; figures without
    widths (an older calibration) are used as they are."""
    from dataclasses import replace
    m = replace(GIVEN, bf16_width_bps={"1024": 5e9, "4096": 9e9, "7168": 10e9})
    got = {w: m.at_width(w).bf16_bps for w in (256, 1024, 2048, 4096, 7168, 16384)}
    print(f"[forecast] BF16 rate by width: { {w: r / 1e9 for w, r in got.items()} } GB/s")
    assert got == {256: 5e9, 1024: 5e9, 2048: 7e9, 4096: 9e9, 7168: 10e9, 16384: 10e9}
    assert GIVEN.at_width(2048) is GIVEN
    assert m.with_overrides(bf16_gbs=20).at_width(2048).bf16_bps == 20e9
    k3 = F.released_k3()                                   # hidden 7168
    kw = dict(preset="desktop", prompt_len=16, gen=8)
    assert F.forecast(k3, m, **kw).s_per_token == \
        F.forecast(k3, replace(m, bf16_width_bps={}), **kw).s_per_token
    narrow = replace(m, bf16_width_bps={"1024": 5e9, "7168": 5e9})
    assert F.forecast(k3, narrow, **kw).s_per_token > F.forecast(k3, m, **kw).s_per_token


def test_a_prefill_is_priced_at_the_prefill_rates():
    """A prompt's BF16 matvecs run through the panels (compute-bound, several times the
    bytes/s of a one-token step) and its experts serve several tokens per run: with the
    prefill probes' rates a long prompt's time to first token drops, a decode step does
    not move, the expert rate is interpolated in seconds per byte between 1 and 4 tokens
    per run, and a given (another machine's) rate replaces the probe's."""
    from dataclasses import replace
    m = replace(GIVEN, bf16_prefill_bps=40e9, mxfp4_prefill_bps=6e9)
    assert m.bf16_rate(1) == m.bf16_rate(K.PANEL_MIN_TOKENS - 1) == 10e9
    assert m.bf16_rate(K.PANEL_MIN_TOKENS) == m.bf16_rate(2048) == 40e9
    assert replace(m, bf16_prefill_bps=5e9).bf16_rate(512) == 10e9     # never below T = 1
    assert GIVEN.bf16_rate(512) == 10e9 and GIVEN.mxfp4_rate(4) == 3e9   # not measured
    assert m.mxfp4_rate(1) == 3e9 and m.mxfp4_rate(4) == m.mxfp4_rate(40) == 6e9
    assert m.mxfp4_rate(2.5) == pytest.approx(1 / (0.5 / 3e9 + 0.5 / 6e9))
    assert m.with_overrides(bf16_gbs=20).bf16_rate(512) == 20e9
    assert m.with_overrides(mxfp4_gbs=2).mxfp4_rate(4) == 2e9
    k3 = F.released_k3()
    kw = dict(preset="desktop", gen=8)
    long_old, long_new = (F.forecast(k3, g, prompt_len=2048, **kw) for g in (GIVEN, m))
    print(f"[forecast] K3 desktop, 2048-position prompt: ttft {long_old.ttft_s:.0f} s at "
          f"the T = 1 rates, {long_new.ttft_s:.0f} s at the prefill rates; decode "
          f"{long_old.s_per_token:.3f} / {long_new.s_per_token:.3f} s/token")
    assert long_new.ttft_s < long_old.ttft_s
    short = [F.forecast(k3, g, prompt_len=1, **kw) for g in (GIVEN, m)]
    assert short[0].ttft_s == short[1].ttft_s


def test_cli_json_for_the_released_model(tmp_path, monkeypatch, capsys):
    _given_cache(tmp_path, monkeypatch)
    assert k3_main(["forecast", "k3", "--preset", "laptop", "--prompt-len", "32",
                    "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    for key in ("s_per_token", "ttft_s", "peak_rss_bytes", "bytes_read_per_token"):
        assert isinstance(d[key], (int, float)) and d[key] > 0, key
    assert d["plan"]["trunk_gb"] == PRESETS["laptop"].trunk_gb
    assert d["prompt_len"] == 32


def test_cli_flags_apply_in_argv_order(tmp_path, monkeypatch, capsys):
    _given_cache(tmp_path, monkeypatch)
    assert k3_main(["forecast", "k3", "--preset", "server", "--cache-gb", "40", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert (d["plan"]["trunk_gb"], d["plan"]["cache_gb"]) == (110.0, 40.0)


def test_cli_text_and_local_checkpoint(tiny, monkeypatch, capsys):
    model, trunk = tiny
    monkeypatch.setattr(F, "machine_figures", lambda *a, **k: GIVEN)
    assert k3_main(["forecast", model, "--trunk", trunk, "--trunk-gb", "0",
                    "--cache-gb", "0.01"]) == 0
    out = capsys.readouterr().out
    assert "peak RSS" in out and "computed from:" in out and "s/token" in out


def test_cli_trace_is_replayed_with_the_cache_policy(tmp_path, monkeypatch, capsys):
    """--trace with --cache-policy: the shipped K3 trace at a 64 GB cache (3,645 slots),
    second half, through each policy (S3-FIFO keeps more of it, SYSTEM §4.10)."""
    _given_cache(tmp_path, monkeypatch)
    monkeypatch.delenv("K3_CACHE_POLICY", raising=False)
    trace = str(peer_dir() / "expert_trace.bin")
    got = {}
    for policy in ([], ["--cache-policy", "lru"], ["--cache-policy", "s3fifo"]):
        assert k3_main(["forecast", "k3", "--trunk-gb", "120", "--cache-gb", "64", "--trace",
                        trace, *policy, "--json"]) == 0
        d = json.loads(capsys.readouterr().out)
        got[policy[-1] if policy else "default"] = d["expert_hit_rate"]
        assert any(a.startswith(f"expert hit rate: {'S3-FIFO' if 's3fifo' in policy else 'LRU'}"
                                f" replay of the trace") for a in d["assumptions"])
    print(f"[forecast] K3 trace at 64 GB, steady hit rate: {got}")
    assert got["default"] == got["lru"] < got["s3fifo"]
    with pytest.raises(SystemExit) as e:                    # argparse: usage, exit 2
        tool.main(["k3", "--trace", trace, "--cache-policy", "arc"])
    assert e.value.code == 2 and "invalid choice: 'arc'" in capsys.readouterr().err


def test_cli_refuses_bad_input(tmp_path, monkeypatch, capsys):
    _given_cache(tmp_path, monkeypatch)
    assert tool.main([str(tmp_path / "absent")]) == 1
    assert "not a directory" in capsys.readouterr().err
    assert tool.main(["k3", "--preset", "nonesuch"]) == 2
    (tmp_path / "m").mkdir()
    assert tool.main([str(tmp_path / "m")]) in (1, 2)      # no config.json: named refusal
    assert "config" in capsys.readouterr().err.lower()


def test_expert_overlap_hides_expert_reads_behind_compute():
    """The §4.5 pipeline the engine runs (the default): a layer waits only for the expert
    reads its latent down-projection, shared expert and hit experts do not cover (not the
    whole layer's compute: attention and the missed experts cannot run meanwhile), never
    more than the sum K3_NO_EXPERT_PIPELINE=1 gives (--no-expert-pipeline)."""
    m = F.released_k3()
    c = F._layer_costs(m, GIVEN, 1, 8.0, set(), 16)
    for L in (0, 5):
        print(f"[forecast] K3 layer {L}: compute {c.compute[L] * 1e3:.1f} ms, of it "
              f"{c.overlap[L] * 1e3:.1f} ms beside 8 of 16 experts' reads")
    assert c.overlap[0] == 0.0                             # dense: nothing to overlap
    assert 0 < c.overlap[5] < c.compute[5]
    down_shared = m.overlap_bytes[5] / GIVEN.bf16_bps
    # 16 runs in 1 + 8 batches (cut at each miss), half of them beside the 8 reads
    half_experts = ((1 + 8) * GIVEN.mxfp4_call_s
                    + 16 * m.figures.expert_bytes / GIVEN.mxfp4_bps) * 8 / 16
    assert abs(c.overlap[5] - (down_shared + half_experts)) < 1e-12
    kw = dict(trunk_gb=16, cache_gb=60, streamed=False, prompt_len=8, gen=4)
    serial = F.forecast(m, GIVEN, expert_overlap=False, **kw)
    hidden = F.forecast(m, GIVEN, **kw)
    assert hidden.s_per_token < serial.s_per_token
    assert hidden.s_per_token >= max(serial.compute_s, serial.io_s) - 1e-9
    assert hidden.bytes_read_per_token == serial.bytes_read_per_token
    assert any("§4.5 pipeline" in a for a in hidden.assumptions)
    assert any("K3_NO_EXPERT_PIPELINE" in a for a in serial.assumptions)


def test_ultra_streams_the_lm_head_every_token():
    m = F.released_k3()
    plain = F.forecast(m, GIVEN, trunk_gb=2.5, cache_gb=0.31)
    ultra = F.forecast(m, GIVEN, preset="ultra")
    assert ultra.plan.ultra and not plain.plan.ultra
    assert ultra.trunk_bytes_per_token == plain.trunk_bytes_per_token + m.lm_head_bytes
    assert ultra.peak_rss_bytes < plain.peak_rss_bytes          # the tables are not held


def test_reads_share_one_device():
    """The expert misses and the trunk reader's prefetch read from one device: a step
    never takes less than all its reads at the device's rate, and a known case comes out
    as processor sharing says.  Two ring layers (1.0 s of reading each, prefetched one
    ahead), 0.1 s of compute and 0.5 s of expert misses each: layer 0 is read (1.0), layer
    1's prefetch runs 1.0-2.0; the experts of layer 0 are read from 1.1 and share the
    device with it (done at 2.1, the prefetch at 2.5); layer 1 waits for it, computes to
    2.6 and reads its experts alone: 3.1 s, against 2.6 when the two reads were scheduled
    as if on two devices (below the 3.0 s the device needs for the bytes)."""
    c = F._Costs(compute=[0.1, 0.1], expert_io=[0.5, 0.5], sync_read=[0.0, 0.0],
                 ring_read=[1.0, 1.0])
    step, comp, io = F._step_seconds(c, 2)
    print(f"[model] two ring layers + expert misses: step {step:.3f} s (device floor 3.0), "
          f"compute {comp:.2f}, read timers {io:.3f}")
    assert step == pytest.approx(3.1) and comp == pytest.approx(0.2)
    # the timers: two trunk reads (the prefetch slowed by the 0.5 it shared) + experts
    assert io == pytest.approx(1.0 + 1.5 + 1.0 + 0.5)
    rng = np.random.default_rng(17)
    for _ in range(200):
        n = int(rng.integers(1, 9))
        ring = [float(x) if rng.random() < 0.7 else 0.0 for x in rng.random(n)]
        c = F._Costs(compute=list(rng.random(n) * 0.3), expert_io=list(rng.random(n) * 0.5),
                     sync_read=[0.0] * n, ring_read=ring)
        for slots in (1, 2, 3):
            step, _, io = F._step_seconds(c, slots)
            floor = sum(c.expert_io) + sum(c.ring_read)
            assert step >= floor - 1e-9, (c, slots, step, floor)
            assert io >= floor - 1e-9


# the elements each small kernel works on, from its arguments (LayerWork's kinds)
ELEMENTS = {"router": ("router", lambda a: a[0].size),
            "route_tokens": ("router", lambda a: a[0].size * a[1].shape[0]),
            "situ_glu": ("situ", lambda a: a[0].size),
            "kda_recurrence": ("kda_state", lambda a: a[0].size * a[1].shape[0]),
            "shortconv": ("conv", lambda a: a[0].size), "kda_decay": ("decay", lambda a: a[0].size),
            "mul_sigmoid": ("gate", lambda a: a[0].size),
            "attnres": ("attnres", lambda a: (a[1] + 1) * a[2].size)}


def _counted_pass(lm, ids: list[int], st) -> list[dict]:
    """Kernel calls per layer of one forward pass (every compute entry point counted), and
    under "<kind>" the elements of each LayerWork kind."""
    from k3engine import kernels as K
    per_layer, now = [], {}

    def counted(name, fn):
        def call(*a):
            now[name] = now.get(name, 0) + 1
            if name == "moe_experts":    # a batch of routed experts, each run over its tokens
                now["#runs"] = now.get("#runs", 0) + len(a[0])
                now["<situ"] = now.get("<situ", 0) + sum(
                    int(a[3][e + 1] - a[3][e]) * ex.w1.shape[0] for e, ex in a[0])
            if name in ELEMENTS:
                kind, n = ELEMENTS[name]
                now["<" + kind] = now.get("<" + kind, 0) + n(a)
            return fn(*a)
        return call

    saved = {n: getattr(K, n) for n in K.KERNEL_ENTRY_POINTS}
    for n, fn in saved.items():
        setattr(K, n, counted(n, fn))
    try:
        def on_layer(L, T):
            per_layer.append(dict(now))
            now.clear()
        lm.model.forward(ids, st, on_layer=on_layer)
        per_layer[0].pop("embed")        # the model's, before layer 0
    finally:
        for n, fn in saved.items():
            setattr(K, n, fn)
    return per_layer


def test_layer_work_counts_the_forwards_calls(tiny):
    """The forecast prices each layer's kernel calls from the config (LayerWork); the
    forward's own calls, counted per layer on the tiny model (KDA and MLA, dense and MoE
    layers), must be what it counts: a decode step (one position, topk experts) and a
    70-position prefill (two chunks, each running every expert its tokens chose).  A
    change to the forward's structure that this misses fails here, not silently in the
    forecast's seconds."""
    from engine_helpers import load
    lm = load(tiny[0])
    cfg = lm.cfg
    work = F.layer_work(cfg)
    st = lm.model.new_state(80)
    prompt = [int(i) for i in np.random.default_rng(5).integers(0, cfg.vocab, 70)]
    rows = {}
    for name, ids in (("prefill", prompt), ("decode", [7])):
        used = []                       # distinct experts per chunk of each MoE layer
        counted = _counted_pass(lm, ids, st)
        for L, (w, got) in enumerate(zip(work, counted)):
            chunks = -(-len(ids) // 64)
            moe = not cfg.is_dense(L)
            runs, batches = got.get("#runs", 0), got.get("moe_experts", 0)
            # one batch of experts per chunk, split only where the next expert's read was
            # still in flight (timing-dependent: the calls LayerWork does not count)
            extra = batches - chunks if moe else 0
            assert 0 <= extra <= max(runs - chunks, 0), (name, L, batches, runs)
            want = w.calls_fixed + chunks * w.calls_per_chunk + extra
            elements = {k[1:]: v for k, v in got.items() if k.startswith("<")}
            calls = sum(v for k, v in got.items() if k[0] not in "<#")
            print(f"[counts] {name} layer {L} ({'K' if cfg.is_kda(L) else 'M'}"
                  f"{'D' if cfg.is_dense(L) else 'E'}): forward {calls} calls, "
                  f"LayerWork {want} ({runs} expert runs in {batches} batches); "
                  f"elements {elements}")
            assert calls == want, (name, L, got)
            expect = {k: v * len(ids) for k, v in w.elements.items() if v and k != "mla"}
            if name == "prefill":       # chunk unions: routed SiTU runs over chosen tokens
                expect["situ"] = len(ids) * (cfg.topk * cfg.moe_inter + cfg.shared_inter
                                             if moe else cfg.dense_inter)
            assert elements == expect, (name, L, elements, expect)
            if name == "decode" and moe:
                assert runs == cfg.topk
            used.append(runs)
        rows[name] = used
    assert any(r > cfg.topk for r in rows["prefill"])   # the prefill ran chunk unions


def test_a_model_that_fits_in_the_cache_is_priced_hot(tiny):
    """in_cache: the tiny model (a few MB) fits in half the last-level cache, so its matvecs
    are priced at the hot figures; the released K3 never is."""
    from dataclasses import replace
    hot = replace(GIVEN, hot={"llc_bytes": 64 << 20, "bf16_bps": 40e9, "bf16_call_s": 5e-6,
                              "mxfp4_bps": 12e9, "mxfp4_call_s": 3e-6})
    small = F.local_model(tiny[0])
    assert F.in_cache(small, hot).bf16_bps == 40e9 and F.in_cache(small, GIVEN) is GIVEN
    assert F.in_cache(F.released_k3(), hot) is hot
    cold_fc, hot_fc = (F.forecast(small, m, cache_gb=1.0) for m in (GIVEN, hot))
    print(f"[forecast] tiny model: {cold_fc.s_per_token * 1e3:.3f} ms/token cold, "
          f"{hot_fc.s_per_token * 1e3:.3f} hot")
    assert hot_fc.s_per_token < cold_fc.s_per_token
    assert any("last-level cache" in a for a in hot_fc.assumptions)
    assert not any("last-level cache" in a for a in cold_fc.assumptions)


def test_the_apps_session_trace_is_in_the_forecast_rss():
    """The app's runs keep a What-if trace window (4 MiB, counted by the planner); the
    forecast the Memory tab shows counts it too, exactly its bytes."""
    from k3engine.memory import TRACE_PAIR_BYTES, trace_window
    m = F.released_k3()
    plain = F.forecast(m, GIVEN, trunk_gb=3.0, cache_gb=1.0)
    kept = F.forecast(m, GIVEN, trunk_gb=3.0, cache_gb=1.0, trace_window=trace_window())
    print(f"[forecast] peak RSS {plain.peak_rss_bytes:,} B, with the app's trace window "
          f"{kept.peak_rss_bytes:,} B")
    assert kept.peak_rss_bytes - plain.peak_rss_bytes == TRACE_PAIR_BYTES * trace_window()


def test_a_batch_shares_the_trunk_pass():
    """forecast(batch=B): one step for B sequences reads the trunk once and the union of
    their experts once, so the bytes per generated token fall and the aggregate rate rises
    with B, but by less than B (the union grows, compute is per row)."""
    one = F.forecast(F.released_k3(), GIVEN, preset="laptop", prompt_len=16, gen=8)
    figs = {B: F.forecast(F.released_k3(), GIVEN, preset="laptop", prompt_len=16, gen=8,
                          batch=B) for B in (2, 4, 8)}
    rates = [1 / one.s_per_token] + [figs[B].batch_tokens_per_s for B in (2, 4, 8)]
    per_tok = [one.bytes_read_per_token] + [figs[B].batch_bytes_per_token for B in (2, 4, 8)]
    print(f"[forecast] K3 laptop, B=1/2/4/8: tokens/s {['%.4f' % r for r in rates]}, "
          f"GB read per token {['%.1f' % (b / 1e9) for b in per_tok]}")
    assert rates == sorted(rates) and per_tok == sorted(per_tok, reverse=True)
    assert rates[-1] < 8 * rates[0]
    assert figs[4].as_json()["batch"] == 4 and "batch" not in one.as_json()
    assert any("batch of 4" in a for a in figs[4].assumptions)


def test_block_drafting_is_a_batch_pass_shared_by_the_accepted_tokens():
    """forecast(accept=A, block=N): one verification pass over N positions costs what a
    step of N rows costs (the trunk once, the union of their experts: --batch's union), and
    yields A + 1 tokens; more accepted drafts never cost more a token, and a pass that
    accepts nothing is dearer than plain decoding."""
    k3 = F.released_k3()
    plain = F.forecast(k3, GIVEN, preset="laptop", prompt_len=16, gen=8)
    batch = F.forecast(k3, GIVEN, preset="laptop", prompt_len=16, gen=8, batch=8)
    blocks = {A: F.forecast(k3, GIVEN, preset="laptop", prompt_len=16, gen=8, accept=A,
                            block=8).block for A in (0.0, 2.5, 6.5)}
    print(f"[forecast] K3 laptop, block 8: s/token at A=0/2.5/6.5 "
          f"{[blocks[A]['s_per_token'] for A in (0.0, 2.5, 6.5)]} (plain "
          f"{plain.s_per_token:.3f}); GB a token "
          f"{[round(blocks[A]['bytes_per_token'] / 1e9, 1) for A in (0.0, 2.5, 6.5)]}")
    assert abs(blocks[2.5]["pass_s"] - batch.batch_step_s) < 1e-3
    assert abs(blocks[2.5]["bytes_per_token"] * 3.5 - batch.batch_bytes_per_token * 8) < 1e3
    s = [blocks[A]["s_per_token"] for A in (0.0, 2.5, 6.5)]
    assert s == sorted(s, reverse=True)
    assert blocks[0.0]["s_per_token"] > plain.s_per_token
    assert blocks[6.5]["tokens_per_pass"] == 7.5 and blocks[6.5]["trunk_bytes_per_token"] \
        == int(plain.trunk_bytes_per_token / 7.5)
    assert not plain.block and "block_drafting" not in plain.as_json()


def test_lookahead_reads_early_and_wastes_the_guess_it_got_wrong():
    """forecast(lookahead_recall=R): R x the misses are read from the layer's start and
    used, (1 - R) x read for nothing on the same device.  A perfect guess is never slower
    than none; a useless one only adds reads; read-bound K3 at laptop gains little."""
    k3 = F.released_k3()
    la = {R: F.forecast(k3, GIVEN, preset="laptop", prompt_len=16, gen=8,
                        lookahead_recall=R).lookahead for R in (0.0, 0.75, 1.0)}
    plain = F.forecast(k3, GIVEN, preset="laptop", prompt_len=16, gen=8)
    per = plain.expert_bytes_per_token
    print(f"[forecast] K3 laptop lookahead s/token at recall 0/0.75/1: "
          f"{[la[R]['s_per_token'] for R in (0.0, 0.75, 1.0)]} (without {plain.s_per_token:.3f}); "
          f"wasted GB a token {[round(la[R]['wasted_bytes_per_token'] / 1e9, 2) for R in la]}")
    for R, d in la.items():
        assert abs(d["overlapped_bytes_per_token"] - R * per) <= 1
        assert abs(d["wasted_bytes_per_token"] - (1 - R) * per) <= 1
        assert d["bytes_read_per_token"] == int(plain.bytes_read_per_token
                                                + (1 - R) * per) or \
            abs(d["bytes_read_per_token"] - plain.bytes_read_per_token - (1 - R) * per) < 2
    assert la[1.0]["s_per_token"] <= plain.s_per_token + 1e-3
    assert la[0.0]["s_per_token"] >= plain.s_per_token - 1e-3
    assert any("lookahead" in a for a in F.forecast(k3, GIVEN, preset="laptop",
                                                    lookahead_recall=0.5).assumptions)


def test_cli_prices_block_drafting_and_lookahead(tmp_path, monkeypatch, capsys):
    _given_cache(tmp_path, monkeypatch)
    assert k3_main(["forecast", "k3", "--preset", "laptop", "--accept", "2.5",
                    "--lookahead-recall", "0.75", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["block_drafting"]["tokens_per_pass"] == 3.5 and d["block_drafting"]["block"] == 16
    assert d["lookahead"]["recall"] == 0.75
    assert k3_main(["forecast", "k3", "--preset", "laptop", "--accept", "6.5", "--block",
                    "8"]) == 0
    out = capsys.readouterr().out
    assert "block drafting" in out and "7.5 tokens per" in out
    for bad in (["--accept", "16"], ["--block", "8"], ["--lookahead-recall", "2"]):
        with pytest.raises(SystemExit):
            k3_main(["forecast", "k3", *bad])
