"""The chat sampler (SYSTEM §9.5): PCG32 stream, draw order, selection rules, exactness.

The reference models in this file are written independently from the spec's pseudocode
(plain loops, NumPy uint64 wraparound for the PRNG) so that they do not share code paths
with `k3engine.sampler`.
"""
from __future__ import annotations

import math

import numpy as np
import pytest

from k3engine.sampler import Pcg32, Sampler, SamplerError, select, splitmix64

L4 = np.array([0.0, 1.0, 2.0, 3.0], dtype=np.float32)


# --------------------------------------------------------------------------- reference model


class RefPcg32:
    """PCG32 XSH-RR from its definition, in NumPy uint64 arithmetic (wraps mod 2^64)."""

    def __init__(self, seed: int, turn: int):
        with np.errstate(over="ignore"):
            x = np.uint64(seed) ^ (np.uint64(turn) * np.uint64(0x9E3779B97F4A7C15))
            outs = []
            for _ in range(2):
                x = x + np.uint64(0x9E3779B97F4A7C15)
                z = x
                z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
                z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
                outs.append(z ^ (z >> np.uint64(31)))
        st, sq = outs
        self.inc = (sq << np.uint64(1)) | np.uint64(1)
        self.state = np.uint64(0)
        self.next32()
        with np.errstate(over="ignore"):
            self.state = self.state + st
        self.next32()

    def next32(self) -> int:
        old = self.state
        with np.errstate(over="ignore"):
            self.state = old * np.uint64(6364136223846793005) + self.inc
        xs = int((((old >> np.uint64(18)) ^ old) >> np.uint64(27)) & np.uint64(0xFFFFFFFF))
        rot = int(old >> np.uint64(59))
        return ((xs >> rot) | (xs << ((32 - rot) % 32))) & 0xFFFFFFFF

    def unit(self, left_first: bool = True) -> float:
        a = self.next32()
        b = self.next32()
        if not left_first:
            a, b = b, a
        return ((a << 21) ^ (b & 0x1FFFFF)) / 2.0 ** 53


def ref_select(logits, T, top_p, top_k, rng):
    """§9.5 selection, literally, with Python floats (IEEE float64) and plain loops."""
    n = len(logits)
    vals = [float(v) for v in np.asarray(logits, np.float32)]
    best = 0
    for i in range(1, n):
        if vals[i] > vals[best]:
            best = i
    m = vals[best] / T
    p = [math.exp(v / T - m) for v in vals]
    s = 0.0
    for v in p:
        s += v
    if not math.isfinite(s) or not s > 0:
        return best
    p = [v / s for v in p]
    order = sorted(range(n), key=lambda i: (-p[i], i))
    w = min(top_k, n) if top_k > 0 else n
    keep, k = 0.0, 0
    while k < w and keep < top_p:
        keep += p[order[k]]
        k += 1
    k = max(k, 1)
    r = rng.unit() * keep
    acc = 0.0
    for i in range(k):
        acc += p[order[i]]
        if r < acc or i == k - 1:
            return order[i]
    raise AssertionError("unreachable")


def draws(logits, T, top_p, top_k, seed, turn, count):
    s = Sampler(T, top_p, top_k, seed, greedy=False)
    s.new_turn(turn)
    return [s.sample(np.asarray(logits, np.float32)) for _ in range(count)]


# --------------------------------------------------------------------------- PCG32


def test_splitmix64_reference_value():
    # The published splitmix64 test vector: state 0 -> first output 0xe220a8397b1dcdaf.
    assert splitmix64(0) == (0x9E3779B97F4A7C15, 0xE220A8397B1DCDAF)


@pytest.mark.parametrize("seed,turn", [(0, 0), (1234, 5), (42, 1), (2**64 - 1, 2**64 - 1),
                                       (0xDEADBEEFCAFEF00D, 17)])
def test_pcg32_matches_independent_reimplementation(seed, turn):
    ours, ref = Pcg32(seed, turn), RefPcg32(seed, turn)
    assert [ours.next32() for _ in range(64)] == [ref.next32() for _ in range(64)]
    assert [ours.unit() for _ in range(64)] == [ref.unit() for _ in range(64)]


def test_spec_check_values_left_draw_first():
    r = Pcg32(1234, 5)
    assert [r.unit() for _ in range(3)] == [0.29755768598262433, 0.8410052951428906,
                                            0.016662590664056065]
    # The other evaluation order gives a different stream (§9.5): we must not be using it.
    assert RefPcg32(1234, 5).unit(left_first=False) == 0.4311371139246366


@pytest.mark.parametrize("T,top_p,top_k,seed,turn,want", [
    (0.7, 0.9, 0, 1234, 5, "3 2 3 3 3 3 3 3 3 3 3 2 3 3 3 3 3 3 3 3"),
    (1.0, 0.95, 0, 42, 1, "1 3 3 2 3 3 3 3 3 2 3 3 3 3 3 3 3 3 3 3"),
    (1.0, 0.95, 2, 42, 1, "2 3 3 2 3 3 3 3 3 3 3 3 3 3 3 3 3 3 3 3"),
])
def test_spec_check_sequences(T, top_p, top_k, seed, turn, want):
    got = draws(L4, T, top_p, top_k, seed, turn, 20)
    assert " ".join(map(str, got)) == want


def test_turns_are_distinct_streams():
    a, b = Pcg32(7, 1), Pcg32(7, 2)
    assert [a.next32() for _ in range(8)] != [b.next32() for _ in range(8)]
    s = Sampler(1.0, 0.95, 0, 7, greedy=False)
    s.new_turn(3)
    first = [s.sample(L4) for _ in range(30)]
    s.new_turn(3)  # reseeding the same turn restarts the same stream
    assert [s.sample(L4) for _ in range(30)] == first


# --------------------------------------------------------------------------- exactness


def test_same_seed_replays_50_draws():
    assert draws(L4, 0.7, 0.9, 0, 1234, 5, 50) == draws(L4, 0.7, 0.9, 0, 1234, 5, 50)


@pytest.mark.parametrize("n,T,top_p,top_k", [(7, 1.0, 1.0, 0), (50, 0.7, 0.9, 0),
                                             (300, 1.3, 0.95, 20), (2000, 0.4, 0.5, 0),
                                             (64, 1.0, 0.999, 64)])
def test_select_matches_literal_spec_model(n, T, top_p, top_k):
    gen = np.random.default_rng(n)
    for trial in range(5):
        logits = (gen.standard_normal(n) * 4).astype(np.float32)
        logits[gen.integers(0, n, size=n // 7)] = logits[0]  # plenty of exact ties
        ours, ref = Pcg32(99, trial), RefPcg32(99, trial)
        for _ in range(20):
            assert select(logits, T, top_p, top_k, ours, greedy=False) == \
                ref_select(logits, T, top_p, top_k, ref)


def test_sums_are_sequential_like_the_c_loop():
    # The implementation relies on ufunc.accumulate adding strictly left to right; np.sum
    # (pairwise) and Python's sum() (compensated since 3.12) round differently on such data.
    p = np.random.default_rng(3).random(100_003) * np.logspace(-12, 0, 100_003)
    acc, seq = np.add.accumulate(p), 0.0
    for i, v in enumerate(p.tolist()):
        seq += v
        if i % 9973 == 0:
            assert acc[i] == seq
    assert acc[-1] == seq


# --------------------------------------------------------------------------- distribution


def _hoeffding_margin(n_draws: int, n_bins: int, fail_prob: float = 1e-6) -> float:
    """Per-bin margin t with P(any |freq - p| >= t) <= fail_prob for a correct sampler:
    Hoeffding gives 2*exp(-2*N*t^2) per bin, union bound over the bins."""
    return math.sqrt(math.log(2 * n_bins / fail_prob) / (2 * n_draws))


@pytest.mark.parametrize("logits,T,top_p,top_k", [
    ([0.0, 1.0, 2.0, 3.0], 1.0, 1.0, 0),          # plain softmax
    ([0.5, -1.0, 2.0, 1.5, 0.0], 0.8, 0.9, 0),    # top-p cuts the tail, rest renormalised
    ([0.5, -1.0, 2.0, 1.5, 0.0], 1.5, 1.0, 3),    # top-k keeps three, renormalised
])
def test_empirical_distribution_matches_truncated_softmax(logits, T, top_p, top_k):
    """Frequencies over N draws against the exact kept-and-renormalised probabilities.
    Statistical bound: false-failure probability <= 1e-6 for a correct sampler (Hoeffding +
    union bound, `_hoeffding_margin`); the draws are deterministic for the fixed seed."""
    N = 40_000
    lg = np.asarray(logits, np.float64)
    p = np.exp(lg / T - lg.max() / T)
    p /= p.sum()
    order = sorted(range(len(p)), key=lambda i: (-p[i], i))
    w = min(top_k, len(p)) if top_k else len(p)
    kept, keep = [], 0.0
    for i in order[:w]:
        if keep >= top_p:
            break
        kept.append(i)
        keep += p[i]
    want = np.zeros(len(p))
    want[kept] = p[kept] / p[kept].sum()

    got = np.bincount(draws(logits, T, top_p, top_k, 2024, 1, N), minlength=len(p)) / N
    t = _hoeffding_margin(N, len(p))
    print(f"[gate] sampler distribution T={T} top_p={top_p} top_k={top_k}: max |freq-p| "
          f"{np.max(np.abs(got - want)):.4f} <= {t:.4f} (N={N}, false-failure bound 1e-6)")
    assert np.all(got[want == 0] == 0), "a truncated token was drawn"
    assert np.max(np.abs(got - want)) < t


# --------------------------------------------------------------------------- truncation


EQUAL4 = np.zeros(4, np.float32)  # p = 0.25 exactly for every id: exact boundaries


@pytest.mark.parametrize("top_p,allowed", [
    (0.25, {0}),                # keep reaches 0.25 >= top_p after one id
    (0.2500001, {0, 1}),
    (0.5, {0, 1}),              # 0.25 + 0.25 == 0.5 exactly: stops there
    (0.5000001, {0, 1, 2}),
    (0.75, {0, 1, 2}),
    (1.0, {0, 1, 2, 3}),
])
def test_top_p_boundaries_exact(top_p, allowed):
    got = set(draws(EQUAL4, 1.0, top_p, 0, 5, 1, 400))
    assert got == allowed  # never outside, and every kept id does occur in 400 draws


@pytest.mark.parametrize("top_k,allowed", [(1, {2}), (2, {2, 1}), (3, {2, 1, 3}),
                                           (4, {0, 1, 2, 3})])
def test_top_k_keeps_the_k_most_likely(top_k, allowed):
    logits = np.array([-1.0, 1.0, 1.5, 0.5], np.float32)
    got = set(draws(logits, 2.0, 1.0, top_k, 11, 2, 2000))
    assert got == allowed


def test_top_k_ties_broken_by_lowest_id():
    logits = np.array([3.0, 5.0, 5.0, 5.0, 1.0], np.float32)
    assert set(draws(logits, 1.0, 1.0, 2, 3, 1, 500)) == {1, 2}


def test_top_k_at_or_above_vocab_equals_off():
    ref = draws(L4, 1.0, 0.95, 0, 8, 4, 200)
    assert draws(L4, 1.0, 0.95, 4, 8, 4, 200) == ref
    assert draws(L4, 1.0, 0.95, 1000, 8, 4, 200) == ref


def test_top_k_and_top_p_combine_smaller_set_wins():
    # top-k=3 allows {3, 2, 1}; top-p=0.5 already stops after id 3 (p ~ 0.64).
    assert set(draws(L4, 1.0, 0.5, 3, 1, 1, 300)) == {3}


# --------------------------------------------------------------------------- greedy, edges


def test_greedy_is_argmax_lowest_index_on_ties():
    s = Sampler()  # greedy by default
    assert s.sample(np.array([1.0, 5.0, 5.0, 2.0], np.float32)) == 1
    assert s.sample(np.array([-0.0, 0.0], np.float32)) == 0
    # NaN never compares greater than the current best (the C loop)...
    assert s.sample(np.array([0.0, np.nan, 1.0, np.nan], np.float32)) == 2
    # ...so a NaN at index 0 is never replaced, exactly as in the reference.
    assert s.sample(np.array([np.nan, 1.0], np.float32)) == 0


def test_greedy_draws_do_not_advance_the_stream():
    a, b = Sampler(1.0, 0.95, 0, 42, greedy=False), Sampler(1.0, 0.95, 0, 42, greedy=False)
    a.new_turn(2)
    b.new_turn(2)
    assert select(L4, 1.0, 0.95, 0, a._rng, greedy=True) == 3
    select(L4, 1.0, 0.95, 0, a._rng, greedy=True)
    assert a.sample(L4) == b.sample(L4)
    assert a._rng.state == b._rng.state


def test_greedy_override_needs_no_turn():
    s = Sampler(0.7, 0.9, 5, 1234, greedy=True)
    assert [s.sample(L4) for _ in range(5)] == [3] * 5


def test_masked_logit_never_chosen_in_20000_draws():
    masked = np.array([0.0, 1.0, 2.0, -1e30], np.float32)
    assert 3 not in draws(masked, 1.0, 1.0, 0, 7, 0, 20_000)


def test_single_logit_always_chosen():
    assert draws(np.array([5.0], np.float32), 1.0, 0.95, 0, 1, 1, 50) == [0] * 50


def test_non_finite_sum_falls_back_to_argmax_without_a_draw():
    s, ref = Sampler(1.0, 0.95, 0, 9, greedy=False), Pcg32(9, 1)
    s.new_turn(1)
    assert s.sample(np.array([0.0, np.inf, 1.0], np.float32)) == 1
    assert s.sample(np.array([-np.inf, -np.inf], np.float32)) == 0
    assert s._rng.state == ref.state


@pytest.mark.parametrize("greedy", [False, True])
@pytest.mark.parametrize("kwargs", [dict(temperature=0.0), dict(temperature=-1.0),
                                    dict(temperature=float("nan")), dict(top_p=0.0),
                                    dict(top_p=1.5), dict(top_p=float("nan")), dict(top_k=-1)])
def test_invalid_settings_refused_even_in_greedy(kwargs, greedy):
    settings = dict(temperature=1.0, top_p=0.95, top_k=0) | kwargs
    with pytest.raises(SamplerError):
        Sampler(**settings, seed=1, greedy=greedy)
    with pytest.raises(SamplerError):
        select(L4, settings["temperature"], settings["top_p"], settings["top_k"],
               Pcg32(1, 1), greedy=greedy)


def test_bad_logits_refused():
    s = Sampler(greedy=True)
    with pytest.raises(SamplerError):
        s.sample(np.zeros(0, np.float32))
    with pytest.raises(SamplerError):
        s.sample(np.zeros(4, np.float64))  # float32 only: a silent cast would change values
    with pytest.raises(SamplerError):
        Sampler(greedy=False).sample(L4)   # sampling before new_turn: no stream yet


def test_seed_and_turn_range():
    with pytest.raises(SamplerError):
        Sampler(seed=-1)
    with pytest.raises(SamplerError):
        Sampler(seed=2**64)
    Sampler(seed=2**64 - 1, greedy=False).new_turn(2**64 - 1)


# --------------------------------------------------------------------------- CLI rules


def test_from_flags_switches_sampling_on():
    assert Sampler.from_flags().greedy
    for flags in (dict(temperature=0.8), dict(top_p=0.5), dict(top_k=5), dict(seed=3)):
        s = Sampler.from_flags(**flags, clock=lambda: 77)
        assert s.sampling
    assert Sampler.from_flags(temperature=0.8, greedy=True).greedy
    s = Sampler.from_flags(top_k=5, clock=lambda: 77)
    assert (s.temperature, s.top_p, s.top_k, s.seed) == (1.0, 0.95, 5, 77)
    assert Sampler.from_flags(seed=3).seed == 3


def test_banner_lines():
    s = Sampler.from_flags(seed=18446744073709551615, temperature=0.7)
    assert s.mode_text() == "temperature/top-p sampling"
    assert s.banner_line() == ("  sampler  : PCG32 seed 18446744073709551615, temperature 0.700, "
                               "top-p 0.950")
    s = Sampler.from_flags(seed=1, top_k=40)
    assert s.banner_line().endswith("top-p 0.950, top-k 40")
    assert Sampler().banner_line() is None and Sampler().mode_text() == "greedy"
