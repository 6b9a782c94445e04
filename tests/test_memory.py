"""Memory planning (SYSTEM §5, §3.2, §4.1, §7.1): presets, the trunk planner on the real
K3 layer sizes, the auto budget, the available-memory probe on synthetic /proc + cgroup
trees, the two refusals, and the printed plan.

The real layer sizes are derived from the tensor shapes of ARCHITECTURE §3.3 (no
checkpoint needed) and checked against the spec's own figures: 108.81 GB packed, layer 0
2.341 GB, a KDA layer ~1.27 GB, an MLA layer ~0.85 GB, and the measured ladder's pinned GB.
"""
from __future__ import annotations

import dataclasses
import json
import math
import re

import pytest

from k3engine import memory as M
from k3engine.config import parse_config

# --- the two configs ---------------------------------------------------------------------

K3 = {
    "hidden_size": 7168, "num_hidden_layers": 93, "vocab_size": 163840, "rms_norm_eps": 1e-5,
    "kda_num_heads": 96, "kda_head_dim": 128, "short_conv_kernel_size": 4,
    "gate_lower_bound": -5.0, "num_attention_heads": 96, "q_lora_rank": 1536,
    "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
    "mla_use_output_gate": True, "num_experts": 896, "num_experts_per_token": 16,
    "num_shared_experts": 2, "routed_expert_hidden_size": 3584, "moe_intermediate_size": 3072,
    "routed_scaling_factor": 1.0, "moe_renormalize": True, "latent_moe_use_norm": True,
    "first_k_dense_replace": 1, "intermediate_size": 33792, "attn_res_block_size": 12,
    "situ_beta": 4.0, "situ_linear_beta": 25.0,
    "full_attn_layers": list(range(4, 93, 4)) + [93],
}
TINY = dict(K3, hidden_size=128, num_hidden_layers=13, vocab_size=256, kda_num_heads=4,
            kda_head_dim=16, num_attention_heads=4, q_lora_rank=64, kv_lora_rank=32,
            qk_nope_head_dim=24, qk_rope_head_dim=8, v_head_dim=16, num_experts=8,
            num_experts_per_token=2, routed_expert_hidden_size=64, moe_intermediate_size=48,
            intermediate_size=96, attn_res_block_size=3, full_attn_layers=[4, 8, 12, 13])

EXPERT_BYTES = 17_547_264          # §1.6
R10_WIDEN = 896 * 7168 * 4 + (6 * 7168 + 1536 + 512 + 3584) * 4 + 4096   # router gate f32 + SF
SF_WIDEN = (6 * 7168 + 1536 + 512 + 3584) * 4 + 4096                     # ~0.2 MB (§3.2)
GB = 1e9


def k3_layer_sizes(cfg) -> list[int]:
    """Packed run per layer from ARCHITECTURE §3.3 shapes: matrices BF16; the KDA conv taps,
    A_log, dt_bias and o_norm F32; the other small vectors BF16; each run rounded up to 4096.
    These dtypes are the ones that reproduce 108.81 GB and the measured ladder (below)."""
    E, P, D, H = cfg.hidden, cfg.kda_proj, cfg.kda_head_dim, cfg.kda_heads
    kda = ((3 * P * E + D * E + P * D + H * E + 2 * P * E) * 2
           + (3 * P * cfg.conv_k + D + P + D) * 4)
    Hm, qd = cfg.n_heads, cfg.qk_nope + cfg.qk_rope
    mla = (cfg.q_lora * E + Hm * qd * cfg.q_lora + (cfg.kv_lora + cfg.qk_rope) * E
           + Hm * (cfg.qk_nope + cfg.v_head) * cfg.kv_lora + 2 * E * Hm * cfg.v_head
           + cfg.q_lora + cfg.kv_lora) * 2
    SI = cfg.shared_inter
    moe = (cfg.n_experts * E + 2 * cfg.latent * E + 3 * SI * E
           + cfg.n_experts + cfg.latent) * 2
    dense = 3 * cfg.dense_inter * E * 2
    norms = 6 * E * 2
    return [M.align_up((mla if cfg.is_mla(L) else kda) + norms
                       + (dense if cfg.is_dense(L) else moe)) for L in range(cfg.n_layers)]


@pytest.fixture(scope="module")
def cfg():
    return parse_config(K3)


@pytest.fixture(scope="module")
def sizes(cfg):
    return k3_layer_sizes(cfg)


@pytest.fixture(scope="module")
def fig(cfg, sizes):
    return M.ModelFigures.for_config(cfg, sizes, EXPERT_BYTES)


# --- presets ----------------------------------------------------------------------------

LIST_PRESETS = """\
presets (trunk / expert-cache, in GB):
  ultra          2.50 / 0.31    ~3 GB planned: streamed model tables, one state slot. Slow.
  laptop         3.00 / 1.00    8.2 GB peak RSS. The ordinary-path floor.
  desktop       16.00 / 10.00   31.9 GB peak RSS.
  workstation   60.00 / 30.00   95.5 GB peak RSS; the expert cache starts to matter here.
  server       110.00 / 13.00   ~128 GB peak RSS; 90 of 93 trunk layers pinned. Fastest.
  max          110.00 / 109.00  ~224 GB peak RSS; trunk pinned and a large expert cache.
  auto            fit / fit     sizes both from this machine's free RAM, trunk-first. Recommended.

All presets stream the trunk, so they need --trunk <packed_dir>.
Run k3 doctor to see which one this machine fits.
"""


def test_presets_table():
    want = {"ultra": (2.5, 0.31, True), "laptop": (3.0, 1.0, False),
            "desktop": (16.0, 10.0, False), "workstation": (60.0, 30.0, False),
            "server": (110.0, 13.0, False), "max": (110.0, 109.0, False)}
    got = {p.name: (p.trunk_gb, p.cache_gb, p.ultra) for p in M.PRESETS.values()}
    assert got == want
    assert list(M.PRESETS) == list(want) and M.PRESET_NAMES[0] == "auto"
    assert (M.DEFAULT_TRUNK_GB, M.DEFAULT_CACHE_GB) == (16.0, 64.0)
    assert M.list_presets_text() == LIST_PRESETS
    print("[gate] presets: six budgets + auto; --list-presets text identical "
          f"({len(LIST_PRESETS.splitlines())} lines, §5.2 format, `k3 doctor` last line)")


# --- the real figures -------------------------------------------------------------------

def test_k3_figures(cfg, sizes, fig):
    # structure: the shapes add up to the §3.7 parameter census (54,394,816,256 trunk params)
    assert sizes[0] == M.align_up(sizes[0]) and len(sizes) == 93
    total = sum(sizes)
    assert f"{total / GB:.2f}" == "108.81", total                        # §2.8
    assert f"{sizes[0] / GB:.3f}" == "2.341"                             # layer 0, dense
    kda, mla = sizes[1], sizes[3]
    assert cfg.is_kda(1) and cfg.is_mla(3)
    assert abs(kda - 1.27 * GB) < 0.005 * GB and abs(mla - 0.85 * GB) < 0.01 * GB
    assert {sizes[L] for L in range(1, 93) if cfg.is_kda(L)} == {kda}
    assert {sizes[L] for L in cfg.mla_layers} == {mla}
    print(f"[gate] K3 runs: layer0 {sizes[0]} B, KDA {kda} B, MLA {mla} B, total "
          f"{M.human(total)} (spec: 2.341 / ~1.27 / ~0.85 / 108.81 GB)")

    # §5.1 fixed costs and §4.1 slot size
    assert M.human(fig.table_bytes) == "4.70 GB"
    assert fig.state_floats_per_layer == 1_683_456
    assert M.human(fig.state_bytes(93, False, False)) == "626.25 MB"
    assert fig.kv_bytes_per_position == M.KV_EXACT_BYTES_K3 == 2_365_440
    assert fig.kv_check_bytes_per_position == M.KV_CHECK_BYTES_K3 == 2_370_000
    assert fig.expert_slot_bytes == 17_555_456 and fig.expert_pool == 82_432
    assert fig.max_blocks == 9 and fig.n_mla == 24 and fig.n_moe_layers == 92
    print("[gate] fixed costs: embed+lm_head 4.70 GB, state 626.25 MB, KV 2,365,440 B/pos "
          "(check constant 2,370,000), expert slot 17,555,456 B")


def test_expert_slots_from_cache_gb(fig):
    table = {0.31: 17, 0.5: 28, 1: 56, 2: 113, 6: 341, 10: 569, 13: 740, 30: 1708,
             64: 3645, 109: 6208}
    got = {gb: fig.expert_slots(gb) for gb in table}
    assert got == table
    print(f"[gate] §4.1 slot counts reproduced for {len(table)} budgets (0.31 GB -> 17 ... "
          "109 GB -> 6208)")


def test_kv_figures_and_rule(fig):
    # ARCHITECTURE §6.3 table: exact vs the rounded constant
    rows = {4096: ("9.69 GB", "9.71 GB"), 8192: ("19.38 GB", "19.42 GB"),
            32768: ("77.51 GB", "77.66 GB"), 131072: ("310.04 GB", "310.64 GB")}
    for n, (exact, rounded) in rows.items():
        assert M.human(fig.kv_bytes(n)) == exact
        assert M.human(n * fig.kv_check_bytes_per_position) == rounded
    # a non-K3 model: the same ratio, rounded up (tiny: 4 MLA layers x 168 floats x 4)
    tiny = M.ModelFigures.for_config(parse_config(TINY), [4096] * 13, 1 << 16)
    assert tiny.kv_bytes_per_position == 2688
    assert tiny.kv_check_bytes_per_position == math.ceil(2688 * 2_370_000 / 2_365_440) == 2694
    print("[gate] KV per position: K3 exact/check 2,365,440/2,370,000 reproduce the §6.3 "
          "table; tiny 2,688 -> check 2,694 (ratio rule, rounded up)")


# --- the trunk planner (§3.2) ----------------------------------------------------------

def test_ring_slot_shrinks_when_layer0_is_pinned(sizes):
    # Nothing pinned: the slot is layer 0's run + W (R10's W: "2.37 GB").
    first = M.plan_trunk(sizes, 3 * 10**9, 2, R10_WIDEN)
    assert first.pinned == () and first.ring_slots == 1
    assert first.slot_bytes == M.align_up(M.align_up(sizes[0]) + R10_WIDEN)
    assert f"{first.slot_bytes / GB:.2f}" == "2.37"
    # A budget that pins layer 0 first: the slot shrinks to the largest KDA layer + W.
    for W, shown in ((R10_WIDEN, "1.29"), (SF_WIDEN, "1.27")):
        t = M.plan_trunk(sizes, 8 * 10**9, 2, W)
        assert 0 in t.pinned
        assert t.slot_bytes == M.align_up(M.align_up(sizes[1]) + W)
        assert f"{t.slot_bytes / GB:.2f}" == shown
        none = M.plan_trunk(sizes, 3 * 10**9, 2, W).slot_bytes
        print(f"[gate] W={W}: nothing pinned -> slot {none / GB:.2f} GB; "
              f"layer 0 pinned -> slot {t.slot_bytes / GB:.2f} GB (spec: 2.37 -> ~1.27), "
              f"pinned {list(t.pinned)} ring {t.ring_slots}")


def test_ladder_prefix_pins(sizes):
    """R10-era prefix pinning reproduces the measured ladder's pinned GB (§11.2) with
    R10's W, and the top rungs' 90 pinned layers at a 110 GB budget with one slot."""
    ladder = {3: "4.95", 7: "9.71", 11: "14.46", 19: "23.96", 27: "33.46", 43: "52.47",
              60: "72.34", 90: "108.19"}
    for n, gb in ladder.items():
        assert f"{(sum(sizes[:n]) + n * R10_WIDEN) / GB:.2f}" == gb, n
    t = M.plan_trunk(sizes, 110 * 10**9, 1, R10_WIDEN, prefix=True)
    assert t.pinned == tuple(range(90)) and f"{t.pinned_bytes / GB:.2f}" == "108.19"
    assert t.hit_rate == 90 / 93
    print(f"[gate] ladder pin GB matched for {len(ladder)} rungs; prefix @110 GB ring 1: "
          f"{t.n_pinned}/93 pinned, {t.pinned_bytes / GB:.2f} GB (ladder: 90, 108.19), "
          f"hit {100 * t.hit_rate:.1f}% (steady 96.8%)")


def test_largest_first_vs_prefix(sizes):
    W = R10_WIDEN
    lf = M.plan_trunk(sizes, 110 * 10**9, 1, W)
    px = M.plan_trunk(sizes, 110 * 10**9, 1, W, prefix=True)
    # both pin 90, but largest-first leaves only MLA layers to stream: a smaller slot
    assert lf.n_pinned == px.n_pinned == 90
    assert lf.largest_unpinned_bytes == sizes[3] and px.largest_unpinned_bytes == sizes[1]
    assert lf.slot_bytes < px.slot_bytes and lf.pinned_bytes > px.pinned_bytes
    assert px.pinned == tuple(range(px.n_pinned))               # a prefix has no holes
    # a budget where largest-first keeps filling after a misfit and the prefix stops
    lf2 = M.plan_trunk(sizes, 110 * 10**9, 2, W)
    px2 = M.plan_trunk(sizes, 110 * 10**9, 2, W, prefix=True)
    assert lf2.pinned_bytes > px2.pinned_bytes
    assert px2.pinned == tuple(range(px2.n_pinned))
    assert any(L not in lf2.pinned for L in range(max(lf2.pinned))), "largest-first skips"
    print(f"[gate] 110 GB ring 1: largest-first slot {lf.slot_bytes / GB:.2f} GB vs prefix "
          f"{px.slot_bytes / GB:.2f} GB; ring 2: largest-first pins "
          f"{lf2.pinned_bytes / GB:.2f} GB ({lf2.n_pinned}) vs prefix "
          f"{px2.pinned_bytes / GB:.2f} GB ({px2.n_pinned})")


def test_trunk_plan_invariants(sizes, fig):
    W = fig.widen_bytes
    checked = 0
    for mb in range(0, 115_001, 997):
        for R in (1, 2, 3):
            for prefix in (False, True):
                t = M.plan_trunk(sizes, mb * 10**6, R, W, prefix)
                assert 1 <= t.passes <= 8 and 1 <= t.ring_slots <= R
                assert t.pinned == tuple(sorted(t.pinned))
                assert t.pinned_bytes == sum(M.align_up(sizes[L]) + W for L in t.pinned)
                assert t.slot_bytes == M.align_up(M.align_up(
                    max([sizes[L] for L in range(93) if L not in t.pinned] or [sizes[-1]]))
                    + W)
                if not t.over_budget:
                    assert t.total_bytes <= t.budget_bytes
                if t.ring_slots < R:
                    assert (t.ring_slots + 1) * t.slot_bytes > t.budget_bytes
                checked += 1
    print(f"[gate] {checked} plans: pinned bytes = sum(align(s)+W), slot sized for the "
          "largest unpinned layer, ring+pinned <= budget, converged within 8 passes")


def test_trunk_monotonic_in_budget(sizes, fig):
    """A larger trunk budget pins at least as many bytes, except at the budget where the
    ring gets one slot deeper (the ring is paid for first); the trunk's footprint (ring +
    pinned) only falls where pinning the largest layer shrinks the ring slot."""
    drops = {"ring deepens": 0, "slot shrinks": 0}
    for R in (1, 2, 3):
        prev = None
        for mb in range(0, 115_000, 10):
            t = M.plan_trunk(sizes, mb * 10**6, R, fig.widen_bytes)
            if prev is not None:
                if t.pinned_bytes < prev.pinned_bytes:
                    assert t.ring_slots > prev.ring_slots, (R, mb)
                    drops["ring deepens"] += 1
                if t.total_bytes < prev.total_bytes:
                    assert t.slot_bytes < prev.slot_bytes, (R, mb)
                    drops["slot shrinks"] += 1
            prev = t
    print(f"[gate] 0..115 GB in 10 MB steps (ring 1/2/3): pinned bytes fell only where the "
          f"ring deepened ({drops['ring deepens']}x), ring+pinned only where the slot shrank "
          f"({drops['slot shrinks']}x)")


def test_ring_clamp_and_held(sizes):
    assert [M.clamp_ring(r) for r in (None, -3, 0, 1, 2, 8, 9, 100)] == [2, 2, 2, 1, 2, 8, 8, 8]
    big = M.plan_trunk(sizes, 200 * 10**9, 20, SF_WIDEN)
    assert big.ring_want == 8 and big.ring_slots == 8 and not big.ring_held
    # laptop: 2 slots do not fit 3 GB -> held at 1, no read-ahead
    t = M.plan_trunk(sizes, 3 * 10**9, 2, R10_WIDEN)
    assert t.ring_slots == 1 and t.ring_held and not t.over_budget
    lines = t.lines(direct=True)
    assert lines == [
        "trunk stream: 108.81 GB packed, 0/93 layers PINNED (0.00 GB), ring 1 x 2.37 GB",
        "              pinned nothing; the ring slot is sized to the largest UNPINNED layer "
        "(2.34 GB",
        "              of a 2.34 GB maximum)",
        "              reads use O_DIRECT (page cache bypassed), pread in parallel 64 MiB chunks",
        "              ring held at 1 slot: 2 slots need 4.73 GB and the trunk budget is "
        "3.00 GB.",
        "              Reads are NOT overlapped with compute. Raise --trunk-gb above 4.73 GB "
        "for the 2 asked for.",
        "              deterministic hit rate 0.0% (a cyclic scan defeats LRU, so a pinned "
        "SET is used instead)",
    ]
    # ring 4 asked, 3 granted
    slot = M.align_up(M.align_up(sizes[0]) + SF_WIDEN)
    t3 = M.plan_trunk(sizes, 3 * slot + slot // 2, 4, SF_WIDEN)
    assert t3.ring_slots == 3 and t3.ring_held
    assert "ring held at 3 slots: 4 slots need" in t3.lines()[4]
    assert "Fewer reads stay in flight." in t3.lines()[5]
    # a budget below one slot: the ring is the floor and the plan counts the slot
    tiny = M.plan_trunk(sizes, 10**9, 2, SF_WIDEN)
    assert tiny.ring_slots == 1 and tiny.over_budget and tiny.pinned == ()
    print("[gate] ring clamp 1..8 (<=0 -> 2); 'ring held at 1 slot' text for laptop; "
          "held at 3 of 4; 1 GB budget -> one over-budget slot")


def test_pinned_lines_and_hit_rate(sizes, fig):
    t = M.plan_trunk(sizes, 60 * 10**9, 2, fig.widen_bytes)
    lines = t.lines(direct=False)
    assert lines[0].startswith(f"trunk stream: 108.81 GB packed, {t.n_pinned}/93 layers PINNED")
    assert "pinned LARGEST FIRST;" in lines[1]
    assert "reads use buffered I/O," in lines[3]
    assert lines[-1].startswith(f"              deterministic hit rate "
                                f"{100 * t.n_pinned / 93:.1f}%")
    px = M.plan_trunk(sizes, 60 * 10**9, 2, fig.widen_bytes, prefix=True)
    assert "pinned as a PREFIX (K3_PIN_PREFIX);" in px.lines()[1]
    print(f"[gate] 60 GB: {t.n_pinned}/93 pinned, hit rate {100 * t.hit_rate:.1f}% = "
          "pinned/93; §3.8 lines for largest-first and prefix")


# --- auto (§5.3) -------------------------------------------------------------------------

def test_auto_numbers():
    a = M.auto_budget(223.9e9, 239e9)
    assert a.line == ("auto budget: 223.9 GB available, 19.6 GB reserved -> trunk 111.0 GB / "
                      "expert cache 93.3 GB")                          # the §7.1 example
    # partial: capped at 0.55 x MemTotal - reserve - 0.5
    a = M.auto_budget(64e9, 70.4e9)
    reserve = 2.0 + 0.05 * 64 + 4.70 + 1.70
    assert a.reserve_gb == pytest.approx(reserve)
    assert a.trunk_gb == pytest.approx(0.55 * 70.4 - reserve - 0.5) and a.cache_gb == 0.5
    # MemTotal unknown: the ceiling is `usable`
    a = M.auto_budget(64e9, 0)
    assert a.trunk_gb == pytest.approx((64 - reserve) - reserve - 0.5)
    # the cap never goes below one slot's 2.5 GB
    assert M.auto_budget(20e9, 20e9).trunk_gb == 2.5
    # below the floor, and unknown
    with pytest.raises(M.BudgetError) as e:
        M.auto_budget(10e9, 16e9)
    assert str(e.value) == ("auto: only 1.1 GB usable after the 8.9 GB reserve; below the "
                            "3.0 GB floor. Pass explicit budgets.") and e.value.exit_code == 2
    with pytest.raises(M.BudgetError, match="pass explicit --trunk-gb/--cache-gb"):
        M.auto_budget(0)
    print("[gate] auto: 223.9 GB -> '19.6 GB reserved -> trunk 111.0 / cache 93.3' (§7.1), "
          "0.55 x MemTotal cap, 2.5 GB cap floor, 3.0 GB refusal")


# --- synthetic /proc + cgroup trees (§5.4) ----------------------------------------------

HOST = 68_746_240 * 1024            # the fake MemAvailable (70.40 GB)
TOTAL = 98_304_000 * 1024


def tree(tmp_path, cgroup: str | None = None, files: dict[str, str] | None = None,
         meminfo: bool = True):
    proc, sys_ = tmp_path / "proc", tmp_path / "sys"
    (proc / "self").mkdir(parents=True)
    sys_.mkdir()
    if meminfo:
        (proc / "meminfo").write_text(
            "MemTotal:       98304000 kB\nMemFree:        12345678 kB\n"
            "MemAvailable:   68746240 kB\nBuffers:          123456 kB\n")
    if cgroup is not None:
        (proc / "self" / "cgroup").write_text(cgroup)
    for rel, text in (files or {}).items():
        p = sys_ / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)
    return str(proc), str(sys_)


def probe(tmp_path, **kw) -> M.MemProbe:
    b, pr = M.available_memory(*tree(tmp_path, **kw))
    assert b == pr.bytes
    print(f"[gate]   probe: {pr.how}")
    return pr


def test_probe_host_only(tmp_path):
    p = probe(tmp_path)
    assert p.known and not p.malformed and p.bytes == HOST and p.cgroup is None
    assert p.total == TOTAL


def test_probe_v2_leaf_cap(tmp_path):
    p = probe(tmp_path, cgroup="0::/user.slice/run-1.scope\n", files={
        "user.slice/run-1.scope/memory.max": "12884901888\n",
        "user.slice/run-1.scope/memory.current": "1073741824\n"})
    assert p.bytes == 11_811_160_064 and p.cgroup_version == 2
    assert p.limit_path.endswith("/user.slice/run-1.scope/memory.max")


def test_probe_v2_max_is_unlimited(tmp_path):
    p = probe(tmp_path, cgroup="0::/user.slice/run-2.scope\n", files={
        "user.slice/run-2.scope/memory.max": "max\n",
        "user.slice/run-2.scope/memory.current": "5\n",
        "user.slice/memory.max": "max\n", "user.slice/memory.current": "6\n"})
    assert p.known and not p.malformed and p.bytes == HOST and p.cgroup is None


def test_probe_v2_nested_parent_binds(tmp_path):
    p = probe(tmp_path, cgroup="0::/user.slice/run-3.scope\n", files={
        "user.slice/run-3.scope/memory.max": "12884901888\n",
        "user.slice/run-3.scope/memory.current": "1073741824\n",
        "user.slice/memory.max": "8589934592\n", "user.slice/memory.current": "2147483648\n"})
    assert p.bytes == 6_442_450_944 and p.limit_path.endswith("/user.slice/memory.max")


def test_probe_v2_leaf_without_files(tmp_path):
    p = probe(tmp_path, cgroup="0::/user.slice/run-4.scope\n", files={
        "user.slice/run-4.scope/cgroup.procs": "",
        "user.slice/memory.max": "4294967296\n", "user.slice/memory.current": "1073741824\n"})
    assert p.bytes == 3_221_225_472 and p.limit_path.endswith("/user.slice/memory.max")


def test_probe_v1(tmp_path):
    files = {"memory/foo/memory.limit_in_bytes": "2147483648\n",
             "memory/foo/memory.usage_in_bytes": "536870912\n"}
    p = probe(tmp_path, cgroup="5:cpu,cpuacct:/\n4:memory:/foo\n3:pids:/\n", files=files)
    assert p.bytes == 1_610_612_736 and p.cgroup_version == 1
    assert p.limit_path.endswith("/memory/foo/memory.limit_in_bytes")


def test_probe_v1_page_counter_max_is_unlimited(tmp_path):
    p = probe(tmp_path, cgroup="4:memory:/foo\n", files={
        "memory/foo/memory.limit_in_bytes": "9223372036854771712\n",
        "memory/foo/memory.usage_in_bytes": "536870912\n"})
    assert p.bytes == HOST and p.cgroup is None


def test_probe_hybrid_v2_line_wins(tmp_path):
    p = probe(tmp_path, cgroup="1:net_cls:/\n0::/user.slice/run-6.scope\n", files={
        "user.slice/run-6.scope/memory.max": "12884901888\n",
        "user.slice/run-6.scope/memory.current": "0\n"})
    assert p.bytes == 12_884_901_888 and p.cgroup_version == 2


def test_probe_loose_cgroup_keeps_host(tmp_path):
    p = probe(tmp_path, cgroup="0::/run-7.scope\n", files={
        "run-7.scope/memory.max": "137438953472\n", "run-7.scope/memory.current": "0\n"})
    assert p.bytes == HOST and p.cgroup == 137_438_953_472


def test_probe_unknown_is_not_zero_refusal(tmp_path, fig):
    p = probe(tmp_path, meminfo=False)
    assert not p.known and not p.malformed and p.bytes == 0
    # unknown disables both refusals (a huge plan is admitted) but auto refuses
    pl = M.plan(fig, preset="max", incremental=True, positions=36864, available_bytes=p)
    assert pl.admitted and "available" not in "\n".join(pl.lines())
    pl = M.plan(fig, preset="auto", available_bytes=p)
    assert not pl.admitted and pl.refusals[0].kind == "auto" and pl.exit_code == 2


@pytest.mark.parametrize("bad", ["garbage\n", "-5\n", "\n", "12 GB\n", "", "DIR"])
def test_probe_garbled_fails_closed(tmp_path, fig, bad):
    files = {"run-5.scope/memory.current": "1\n"}
    if bad != "DIR":
        files["run-5.scope/memory.max"] = bad
    else:
        files["run-5.scope/memory.max/x"] = ""          # a directory where the file belongs
    p = probe(tmp_path, cgroup="0::/run-5.scope\n", files=files)
    assert p.known and p.malformed and p.bytes == 0 and p.detail
    # the plan refuses (exit 1) and says why; the KV check refuses first (exit 2); auto too
    pl = M.plan(fig, preset="laptop", positions=14, available_bytes=p)
    assert [r.kind for r in pl.refusals] == ["unknowable"] and pl.exit_code == 1
    assert p.detail in pl.reasons[0]
    pl = M.plan(fig, preset="laptop", incremental=True, positions=14, available_bytes=p)
    assert [(r.kind, r.exit_code) for r in pl.refusals] == [("unknowable", 2)]
    with pytest.raises(M.BudgetError):
        M.auto_budget(p.bytes, p.total or 0, p.detail)
    print(f"[gate] memory.max {bad!r}: fail closed -> {pl.reasons[0].splitlines()[0]}")


def test_probe_garbled_membership_fails_closed(tmp_path):
    p = probe(tmp_path, cgroup="this line has no colons\n")
    assert p.malformed and p.bytes == 0


def test_auto_from_synthetic_trees(tmp_path, fig):
    """§5.3 on a probe: a 16 GiB v2 cap (1 GiB used) under a 98 GB machine."""
    proc, sys_ = tree(tmp_path, cgroup="0::/k3.scope\n", files={
        "k3.scope/memory.max": str(16 << 30) + "\n", "k3.scope/memory.current": str(1 << 30)})
    b, p = M.available_memory(proc, sys_)
    assert b == 15 << 30
    pl = M.plan(fig, preset="auto", cache_gb=40, positions=14, available_bytes=p,
                total_memory=p.total)
    assert pl.auto.line == ("auto budget: 16.1 GB available, 9.2 GB reserved -> trunk 6.4 GB / "
                            "expert cache 0.5 GB")
    assert pl.cache_gb == 0.5                       # --cache-gb with auto is overwritten
    assert pl.trunk_gb == pytest.approx(b / GB - (8.4 + 0.05 * b / GB) - 0.5)
    assert pl.admitted, pl.reasons
    assert pl.total_bytes <= M.ADMIT * b            # auto's reserve keeps it admissible
    assert pl.preset_line() == ("  preset   : auto (trunk %.2f GB / expert cache 0.50 GB)"
                                % pl.trunk_gb)
    # a 12 GiB cap is below auto's floor
    proc, sys_ = tree(tmp_path / "b", cgroup="0::/k3.scope\n", files={
        "k3.scope/memory.max": str(12 << 30), "k3.scope/memory.current": str(1 << 30)})
    _, p = M.available_memory(proc, sys_)
    pl = M.plan(fig, preset="auto", available_bytes=p, total_memory=p.total)
    assert pl.refusals[0].kind == "auto" and "below the 3.0 GB floor" in pl.reasons[0]
    line = M.plan(fig, preset="auto", available_bytes=15 << 30, total_memory=TOTAL).auto.line
    print(f"[gate] 16 GiB cgroup: {line}; 12 GiB cgroup: auto refuses (floor)")


def test_auto_is_admissible_everywhere(fig):
    """Whatever auto picks must pass its own 0.95 admission (same constant, §5.5)."""
    for A in range(12, 400, 3):
        for total in (0, A * 1.05e9, A * 2e9):
            pl = M.plan(fig, preset="auto", positions=14, available_bytes=int(A * GB),
                        total_memory=total)
            assert pl.admitted, (A, total, pl.reasons)
    print("[gate] auto plans admitted for available 12..399 GB (MemTotal unknown, 1.05x, 2x)")


def test_live_probe_runs():
    b, p = M.available_memory()
    assert b == p.bytes >= 0 and (p.known or b == 0)
    print(f"[gate] this machine: {p.how}")


# --- refusals (§5.5) ----------------------------------------------------------------------

def test_plan_refusal_message(fig):
    pl = M.plan(fig, preset="laptop", positions=14, available_bytes=9_500_000_000)
    assert pl.total_bytes == 9_334_644_480 and not pl.admitted and pl.exit_code == 1
    assert pl.reasons == [
        "REFUSING TO START: this needs 9.33 GB. The machine has 9.50 GB available and a plan "
        "may use at most 9.03 GB of that, so this is 309.64 MB over the limit.\n"
        "Options: a larger box, a smaller --cache-gb, or fewer --layers."]
    # the excess is X - Z, never X - Y (which is negative here)
    assert pl.total_bytes < 9_500_000_000
    # the boundary: need == 0.95 x available is admitted, one byte less available is not
    need = pl.total_bytes
    avail = math.ceil(need / M.ADMIT)
    while M.ADMIT * avail < need:
        avail += 1
    assert M.plan(fig, preset="laptop", positions=14, available_bytes=avail).admitted
    assert not M.plan(fig, preset="laptop", positions=14, available_bytes=avail - 1).admitted
    print(f"[gate] 0.95 refusal text exact; boundary at available {avail} B for need {need} B")


KV_REFUSAL = """\
REFUSING: the KV cache for 4097 positions needs 9.71 GB but only 10.00 GB is
available. This is a MEMORY limit, not an engine ceiling: MLA caches
expanded k and v in fp32 across 24 layers, so context costs ~2.37 MB per
position regardless of budget. Shorten the request, or use full
recompute (drop --incremental), which carries no KV cache at all."""


def test_kv_check(fig):
    kv = M.kv_check(fig, 10, 64 * 10**9)
    assert kv.line == "  KV cache : 23.70 MB for 10 positions (2.37 MB/position)"   # §7.1
    assert kv.refusal is None
    kv = M.kv_check(fig, 4097, 10 * 10**9)
    assert kv.need_bytes == 4097 * 2_370_000 and kv.refusal.message == KV_REFUSAL
    assert kv.refusal.exit_code == 2
    # 0.90 boundary, and unknown availability never refuses
    need = 4097 * 2_370_000
    avail = math.ceil(need / M.KV_ADMIT)
    while M.KV_ADMIT * avail < need:
        avail += 1
    assert M.kv_check(fig, 4097, avail).refusal is None
    assert M.kv_check(fig, 4097, avail - 1).refusal is not None
    assert M.kv_check(fig, 10**6, 0).refusal is None
    # in the plan: only with --incremental, and the KV refusal comes first (exit 2)
    pl = M.plan(fig, preset="laptop", incremental=True, positions=4097,
                available_bytes=10 * 10**9)
    assert [r.kind for r in pl.refusals] == ["kv", "plan"] and pl.exit_code == 2
    assert pl.kv_cache_bytes == 4097 * 2_365_440                 # the plan uses the exact
    assert not M.plan(fig, preset="laptop", positions=4097,
                      available_bytes=10 * 10**9).kv
    print(f"[gate] KV line matches §7.1; 5-line refusal exact; 0.90 boundary at {avail} B; "
          "plan term uses the exact 2,365,440 B/position")


# --- the plan and its printed block (§7.1) -----------------------------------------------

PLAN_EXAMPLE = """\
memory plan
  trunk (STREAMED) 3.00 GB
  embed + lm_head  4.70 GB (resident)
  expert cache     1.00 GB
  recurrent state  626.25 MB
  buffers          4.68 MB
  KV cache         0.00 B
  TOTAL            9.33 GB
  available        65.56 GB"""


def test_printed_block_matches_example(fig):
    pl = M.plan(fig, preset="laptop", positions=5 + 8 + 1, available_bytes=65_560_000_000)
    got, want = pl.lines(), PLAN_EXAMPLE.splitlines()
    assert len(got) == len(want)
    for g, w in zip(got, want):
        if w.startswith("  buffers"):
            # our scratch is the engine's own: same label and format, not the same bytes
            assert re.fullmatch(r"  buffers          \d+\.\d\d [KM]?B", g), g
        else:
            assert g == w
    assert pl.preset_line() == "  preset   : laptop (trunk 3.00 GB / expert cache 1.00 GB)"
    assert pl.admitted and pl.exit_code == 0 and pl.expert_slots == 56 and pl.cache_fits_topk
    print("[gate] memory plan block == §7.1 example line for line (buffers: format only, "
          f"ours {got[5].split()[-2]} MB); preset line exact")
    print("\n".join("[gate]   " + line for line in got))


def test_plan_terms(fig, sizes):
    # resident trunk: the whole trunk of the first NL layers, labelled (resident)
    pl = M.plan(fig, streamed=False, positions=14)
    assert pl.trunk_bytes == sum(sizes) and pl.lines()[1].startswith("  trunk (resident) ")
    assert pl.trunk_plan is None
    pl = M.plan(fig, streamed=False, layers=10, positions=14)
    assert pl.trunk_bytes == sum(sizes[:10]) and pl.recurrent_state_bytes == 10 * 1_683_456 * 4
    # ultra: tables streamed through 4 MiB + 8 KiB, one state slot in full recompute
    pl = M.plan(fig, preset="ultra", positions=14)
    assert pl.ultra and pl.model_table_bytes == (4 << 20) + 8192 + 3 * 7168 * 4
    assert pl.lines()[2] == "  embed + lm_head  4.29 MB (STREAMED)"
    assert pl.recurrent_state_bytes == 1_683_456 * 4 and pl.expert_slots == 17
    pl = M.plan(fig, preset="ultra", incremental=True, positions=14)
    assert pl.recurrent_state_bytes == 93 * 1_683_456 * 4
    # ultra needs a streamed trunk
    pl = M.plan(fig, preset="ultra", streamed=False, positions=14)
    assert pl.refusals[0].kind == "usage" and "--ultra-low-memory needs --trunk" in pl.reasons[0]
    # defaults and explicit overrides
    pl = M.plan(fig, positions=14)
    assert (pl.trunk_gb, pl.cache_gb, pl.preset) == (16.0, 64.0, None)
    assert pl.preset_line() is None
    pl = M.plan(fig, preset="server", cache_gb=40, positions=14)
    assert (pl.trunk_gb, pl.cache_gb) == (110.0, 40.0)
    # a budget below one ring slot: the slot is what gets allocated, and counted
    pl = M.plan(fig, trunk_gb=1.0, positions=14)
    assert pl.trunk_bytes == pl.trunk_plan.slot_bytes > 10**9
    # buffers grow with positions, KV only with --incremental
    assert fig.buffer_bytes(100) > fig.buffer_bytes(14)
    # measured baseline (§5.8): its own line, counted in TOTAL
    pl = M.plan(fig, preset="laptop", positions=14, baseline_bytes=85_000_000)
    assert "  python baseline  85.00 MB (measured)" in pl.lines()
    assert pl.total_bytes == M.plan(fig, preset="laptop", positions=14).total_bytes + 85_000_000
    print("[gate] resident/streamed trunk, --layers, ultra tables/state, defaults, "
          "over-budget slot and baseline terms")


def test_moe_chunk_grows_only_into_free_memory(fig):
    """The prefill's MoE chunk (model.PREFILL_CHUNK = SYSTEM §4.6's 64) grows to 128 or 256
    with a resident trunk only, and only when the extra temporaries fit in half of what
    admission leaves free; with a streamed trunk, the available memory unknown, or a
    refused plan, it stays 64."""
    per = fig.moe_chunk_position_bytes
    assert per == 16 * (3584 * 12 + 3072 * 16) + 3584 * 4     # K3: ~1.49 MB per position
    resident = dict(streamed=False, cache_gb=8, positions=14)
    pl = M.plan(fig, available_bytes=10**9, **resident)
    assert not pl.admitted and M.moe_chunk_for(pl, fig, 64) == 64
    assert M.moe_chunk_for(M.plan(fig, **resident), fig, 64) == 64
    assert M.moe_chunk_for(None, fig, 64) == 64
    streamed = M.plan(fig, preset="laptop", positions=14, available_bytes=10**12)
    assert streamed.admitted and M.moe_chunk_for(streamed, fig, 64) == 64
    base = M.plan(fig, available_bytes=10**13, **resident).total_bytes
    picked = {}
    for extra_mb in (0, 100, 2 * 64 * per / 1e6 - 1, 2 * 64 * per / 1e6 + 1,
                     2 * 192 * per / 1e6 - 1, 2 * 192 * per / 1e6 + 1, 10_000):
        avail = int((base + extra_mb * 1e6) / M.ADMIT) + 1
        pl = M.plan(fig, available_bytes=avail, **resident)
        assert pl.admitted
        picked[round(extra_mb)] = M.moe_chunk_for(pl, fig, 64)
        free = (pl.limit_bytes - pl.total_bytes) / 2
        assert (picked[round(extra_mb)] - 64) * per <= free
    print(f"[gate] MoE chunk by free memory beyond a resident K3 plan (MB -> positions): "
          f"{picked}; streamed laptop plan with 1 TB free: 64")
    assert list(picked.values()) == [64, 64, 64, 128, 128, 256, 256]
    zero = dataclasses.replace(fig, moe_chunk_position_bytes=0)     # unknown: never grows
    assert M.moe_chunk_for(pl, zero, 64) == 64


def test_plan_monotonic_in_budgets(fig):
    prev = None
    for t in [x / 4 for x in range(0, 480)]:
        pl = M.plan(fig, trunk_gb=t, cache_gb=10, positions=14)
        if prev is not None:
            assert pl.total_bytes >= prev.total_bytes
        prev = pl
    prev = None
    for c in [x / 4 for x in range(0, 480)]:
        pl = M.plan(fig, trunk_gb=16, cache_gb=c, positions=14)
        if prev is not None:
            assert pl.total_bytes >= prev.total_bytes
            assert pl.expert_slots >= prev.expert_slots
        prev = pl
    # admission is monotone too: once refused, a bigger budget stays refused
    verdicts = [M.plan(fig, trunk_gb=t, cache_gb=10, positions=14,
                       available_bytes=64 * 10**9).admitted for t in range(0, 120)]
    assert verdicts == sorted(verdicts, reverse=True) and verdicts[0] and not verdicts[-1]
    print(f"[gate] TOTAL monotone over trunk 0..120 GB and cache 0..120 GB; admitted up to "
          f"trunk {verdicts.count(True) - 1} GB at 64 GB available")


def test_plan_event(fig):
    pl = M.plan(fig, preset="desktop", incremental=True, positions=100,
                available_bytes=64 * 10**9)
    ev = pl.as_event()
    json.dumps(ev)
    for key in ("available", "admitted", "preset", "trunk_gb", "cache_gb", "ultra",
                "incremental"):
        assert key in ev
    assert ev["ev"] == "plan" and ev["admitted"] is True and ev["preset"] == "desktop"
    terms = ("trunk_bytes", "model_table_bytes", "expert_cache_bytes", "recurrent_state_bytes",
             "buffer_bytes", "kv_cache_bytes", "baseline_bytes")
    assert all(isinstance(ev[k], int) for k in terms)
    assert sum(ev[k] for k in terms) == ev["total_bytes"] == pl.total_bytes
    assert ev["available"] == 64 * 10**9 and ev["kv_cache_bytes"] == 100 * 2_365_440
    print(f"[gate] plan event: {len(ev)} keys, terms sum to total {ev['total_bytes']} B")


# --- flag order (§5.2) -------------------------------------------------------------------

def test_resolve_budgets():
    r = M.resolve_budgets
    assert r([]) == M.Budgets(None, 16.0, 64.0, False, False)
    b = r([("--preset", "server"), ("--cache-gb", "40")])
    assert (b.preset, b.trunk_gb, b.cache_gb) == ("server", 110.0, 40.0)
    b = r([("--cache-gb", "40"), ("--preset", "server")])
    assert b.cache_gb == 13.0                                    # the later preset wins
    b = r([("--preset", "ultra")])
    assert b.ultra and (b.trunk_gb, b.cache_gb) == (2.5, 0.31)
    b = r([("--ultra-low-memory", None), ("--preset", "laptop")])
    assert not b.ultra                                           # a preset sets ultra too
    b = r([("--preset", "laptop"), ("--ultra-low-memory", None)])
    assert b.ultra
    # auto: a later --trunk-gb X switches it off, the cache keeps its previous value
    b = r([("--cache-gb", "7"), ("--preset", "auto"), ("--trunk-gb", "5")])
    assert (b.auto, b.trunk_gb, b.cache_gb, b.preset) == (False, 5.0, 7.0, "auto")
    b = r([("--trunk-gb", "auto"), ("--cache-gb", "9")])
    assert b.auto and b.plan_kwargs()["trunk_gb"] == "auto"
    b = r([("--preset", "auto"), ("--preset", "laptop")])
    assert not b.auto and b.trunk_gb == 3.0
    with pytest.raises(M.BudgetError, match="uses explicit bounded budgets"):
        r([("--preset", "ultra"), ("--trunk-gb", "auto")])
    with pytest.raises(M.BudgetError) as e:
        r([("--preset", "huge")])
    assert str(e.value).startswith("unknown preset 'huge'\n\npresets (trunk / expert-cache")
    with pytest.raises(M.BudgetError):
        r([("--cache-gb", "lots")])
    print("[gate] argv order: preset then --cache-gb, --cache-gb then preset, auto switched "
          "off by --trunk-gb X, ultra+auto refused, unknown preset lists presets")


def test_resolved_budgets_feed_the_plan(fig):
    b = M.resolve_budgets([("--preset", "auto"), ("--cache-gb", "40")])
    pl = M.plan(fig, **b.plan_kwargs(), positions=14, available_bytes=223_900_000_000)
    assert pl.auto is not None and pl.cache_gb == pytest.approx(93.3, abs=0.05)
    b = M.resolve_budgets([("--preset", "auto"), ("--trunk-gb", "5")])
    pl = M.plan(fig, **b.plan_kwargs(), positions=14, available_bytes=223_900_000_000)
    assert pl.auto is None and (pl.trunk_gb, pl.cache_gb) == (5.0, 64.0)
    print("[gate] resolve_budgets -> plan: auto overwrites the cache; --trunk-gb after auto "
          "keeps the default cache")


def test_several_sequences_are_counted_and_a_refusal_says_how_many_fit(fig):
    """A batch or `k3 serve --parallel N` holds N recurrent states (K3: 626 MB each) and
    all their KV caches; a plan that does not fit says how many of them would."""
    one = M.plan(fig, preset="laptop", incremental=True, positions=513)
    four = M.plan(fig, preset="laptop", incremental=True, positions=4 * 513, sequences=4)
    assert four.recurrent_state_bytes == 4 * one.recurrent_state_bytes
    assert four.kv_cache_bytes == fig.kv_bytes(4 * 513)
    assert any("(4 sequences)" in line for line in four.lines())
    assert not any("sequences" in line for line in one.lines())     # the reference's report
    each = one.recurrent_state_bytes + fig.kv_bytes(513)
    avail = int((one.total_bytes - fig.buffer_bytes(513) + fig.buffer_bytes(4 * 513)
                 + 1.5 * each) / M.ADMIT)
    tight = M.plan(fig, preset="laptop", incremental=True, positions=4 * 513, sequences=4,
                   available_bytes=avail)
    msg = " ".join(r.message for r in tight.refusals)
    print(f"[plan] K3 laptop, 4 sequences of 513 positions: recurrent state "
          f"{M.human(four.recurrent_state_bytes)}, KV {M.human(four.kv_cache_bytes)}; with "
          f"{M.human(avail)} available: ...{msg[-40:]!r}")
    assert [r.kind for r in tight.refusals] == ["plan"]
    assert "2 of the 4 sequences would fit" in msg


def test_human_seconds_picks_the_unit_for_the_magnitude():
    assert [M.human_seconds(s) for s in (0, 8.5e-4, 0.0123, 0.5, 4.561, 125, 4321)] == [
        "0 s", "850 µs", "12.3 ms", "500 ms", "4.56 s", "2 min 5 s", "1 h 12 min"]
