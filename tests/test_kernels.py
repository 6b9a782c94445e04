"""Tier 0: the Cython kernels bit for bit against independent exact-order references.

Every test here guards one silent-failure trap of ARCHITECTURE §8 (the trap number is in
each docstring).  The references below are written from the specification only, never
from the kernel source:

* matvec (§5.3): float64, sixteen explicit lanes over full blocks of 16, the fixed tree
  b[l] = (a[l]+a[l+4]) + (a[l+8]+a[l+12]), acc = (b0+b1) + (b2+b3), then the tail ascending;
* MXFP4 matvec (§5.6): per 32-group eight lanes (element e -> lane e mod 8, ascending),
  b[l] = s[l]+s[l+4], sub = (b0+b1)+(b2+b3), acc += sub * 2^(b-127), groups with scale
  255 skipped, y = f32(acc);
* float32 chains with NumPy float32 scalars/arrays, one rounding per operation;
* expf / tanhf from the C library through ctypes (never NumPy's float32 transcendentals).

Loops run over the reduction index explicitly; they are vectorised only over independent
outputs (rows, channels), which cannot change any rounding.  Comparisons are on bit
patterns (`.view(np.uint32)`).  Each test prints "[gate] ..." lines saying what it compared.
Several tests also print a *witness*: a plausible wrong variant and how many values it
gets wrong, proving that the test would notice the trap.
"""
from __future__ import annotations

import ast
import contextlib
import ctypes
import ctypes.util
import os
import platform
import subprocess
import sys
import sysconfig

import numpy as np
import pytest

from conftest import REPO, load_fixture, tens
from k3engine import kernels as K
from k3engine.state import MLAState

# ---- plumbing ---------------------------------------------------------------------------

_libm = ctypes.CDLL(ctypes.util.find_library("m"))
_expf = _libm.expf
_expf.restype, _expf.argtypes = ctypes.c_float, [ctypes.c_float]
_tanhf = _libm.tanhf
_tanhf.restype, _tanhf.argtypes = ctypes.c_float, [ctypes.c_float]

F1 = np.float32(1.0)
PAR_MIN_WORK = K.par_min_work()   # the kernels go parallel at this many multiply-adds


def c_expf(x) -> np.float32:
    """glibc expf of a float32 value."""
    return np.float32(_expf(float(x)))


def c_tanhf(x) -> np.float32:
    return np.float32(_tanhf(float(x)))


def c_sigmoid(x) -> np.float32:
    """sigma(x) = 1 / (1 + expf(-x)) in float32, a real division (§0.3)."""
    x = np.float32(x)
    with np.errstate(over="ignore"):
        return F1 / (F1 + c_expf(-x))


def bits(a) -> np.ndarray:
    return np.ascontiguousarray(a, dtype=np.float32).view(np.uint32)


def assert_bitwise(name: str, got, want) -> None:
    g, w = bits(got).reshape(-1), bits(want).reshape(-1)
    assert g.shape == w.shape, f"{name}: shapes {g.shape} vs {w.shape}"
    bad = np.flatnonzero(g != w)
    print(f"[gate] {name}: {g.size} values bit-compared, {bad.size} differ")
    if bad.size:
        i = int(bad[0])
        gf, wf = g.view(np.float32)[i], w.view(np.float32)[i]
        raise AssertionError(f"{name}: {bad.size}/{g.size} values differ; first at flat "
                             f"index {i}: got {gf!r} (0x{g[i]:08x}) want {wf!r} (0x{w[i]:08x})")


def n_diff(a, b) -> int:
    return int(np.count_nonzero(bits(a).reshape(-1) != bits(b).reshape(-1)))


@contextlib.contextmanager
def threads(n: int):
    prev = K.get_num_threads()
    K.set_num_threads(n)
    try:
        yield
    finally:
        K.set_num_threads(prev)


@contextlib.contextmanager
def isa(name: str):
    """Force one row-kernel instruction set (scalar / avx2 / avx512) for a block."""
    prev = K.isa()
    K.set_isa(name)
    try:
        yield
    finally:
        K.set_isa(prev)


def simd_isas() -> list[str]:
    """The SIMD paths this CPU runs (each is compared with the scalar reference path)."""
    return [n for n in K.isas_available() if n != "scalar"]


def rng(seed: int) -> np.random.Generator:
    return np.random.default_rng(seed)


def rand_f32(r, shape, scale=1.0) -> np.ndarray:
    return (r.standard_normal(shape) * scale).astype(np.float32)


def adversarial_f32(r, shape) -> np.ndarray:
    """Values spread over 2^+-40 with random signs (wide dynamic range, no structure)."""
    mant = r.uniform(1.0, 2.0, shape)
    expo = r.integers(-40, 41, shape)
    sign = r.choice([-1.0, 1.0], shape)
    return (sign * np.ldexp(mant, expo)).astype(np.float32)


def cancelling_matvec(r, rows, n):
    """Order-revealing data: half of the inputs form pairs (i, j) with W[:, j] = -W[:, i] =
    +-2^24..2^60 and x[j] = x[i], so the exact sum is the sum of the small terms, but a double
    accumulator holding a huge partial sum absorbs the small terms that arrive meanwhile:
    which ones are lost depends on the summation ORDER.  Every W value is BF16-exact."""
    W = rand_f32(r, (rows, n), 0.05)
    x = r.uniform(0.5, 1.0, n).astype(np.float32)
    pairs = r.permutation(n)[: (n // 4) * 2].reshape(-1, 2)
    x[pairs[:, 1]] = x[pairs[:, 0]]
    big = np.ldexp(r.choice([-1.0, 1.0], (rows, len(pairs))),
                   r.integers(24, 61, (rows, len(pairs)))).astype(np.float32)
    W[:, pairs[:, 0]], W[:, pairs[:, 1]] = big, -big
    W = (W.view(np.uint32) & 0xFFFF0000).view(np.float32)       # truncate to BF16-exact
    return np.ascontiguousarray(W), x


def cancelling_mxfp4(r, rows, n):
    """Order-revealing MXFP4 data: inside each 32-group, pairs of elements in different lanes
    (e mod 8) get opposite codes and the same huge x, so they cancel exactly while absorbing
    the small terms around them."""
    codes = r.integers(0, 16, (rows, n), dtype=np.uint16).astype(np.uint8)
    x = rand_f32(r, n)
    for g in range(n // 32):
        perm = 32 * g + r.permutation(32)[:8].reshape(4, 2)
        for i, j in perm:
            if i % 8 == j % 8:
                continue
            mag = r.integers(1, 8, rows).astype(np.uint8)
            sign = r.integers(0, 2, rows).astype(np.uint8) * 8
            codes[:, i], codes[:, j] = mag | sign, mag | (sign ^ 8)
            x[i] = x[j] = np.float32(np.ldexp(1.0, int(r.integers(40, 70))))
    P = (codes[:, 0::2] | (codes[:, 1::2] << 4)).astype(np.uint8)
    S = r.integers(118, 125, (rows, n // 32), dtype=np.uint16).astype(np.uint8)
    return np.ascontiguousarray(P), S, x


def random_bf16(r, shape) -> np.ndarray:
    """Random BF16 bit patterns, exponent 0xFF (inf/NaN) excluded (SF self-test recipe)."""
    b = r.integers(0, 1 << 16, shape, dtype=np.uint32).astype(np.uint16)
    bad = ((b >> 7) & 0xFF) == 0xFF
    while bad.any():
        b[bad] = r.integers(0, 1 << 16, int(bad.sum()), dtype=np.uint32).astype(np.uint16)
        bad = ((b >> 7) & 0xFF) == 0xFF
    return b


def widen_bf16(b: np.ndarray) -> np.ndarray:
    """BF16 -> float32 by a 16-bit shift (§5.5), done here independently of the kernels."""
    return (b.astype(np.uint32) << 16).view(np.float32)


def mv(W, X) -> np.ndarray:
    """Kernel matvec, allocating the output.  X is [T, n]."""
    X = np.ascontiguousarray(X, np.float32)
    Y = np.empty((X.shape[0], W.shape[0]), np.float32)
    K.matvec(W, X, Y)
    return Y


def mv4(P, S, X) -> np.ndarray:
    X = np.ascontiguousarray(X, np.float32)
    Y = np.empty((X.shape[0], P.shape[0]), np.float32)
    K.mxfp4_matvec(P, S, X, Y)
    return Y


# ---- independent references -------------------------------------------------------------

def ref_matvec(W32: np.ndarray, x32: np.ndarray) -> np.ndarray:
    """§5.3 exact order for one input vector; W32 [R, n] float32 values, x32 [n].  Returns
    float32 [R].  Lanes are explicit; the work is vectorised over rows only."""
    WT = np.ascontiguousarray(W32.astype(np.float64).T)     # WT[i] = column i (all rows)
    x = x32.astype(np.float64)
    R, n = W32.shape
    nfull = n - n % 16
    a = [np.zeros(R) for _ in range(16)]
    for c in range(0, nfull, 16):
        for l in range(16):                                  # noqa: E741
            a[l] = a[l] + WT[c + l] * x[c + l]               # exact product, one rounding
    b = [(a[l] + a[l + 4]) + (a[l + 8] + a[l + 12]) for l in range(4)]
    acc = (b[0] + b[1]) + (b[2] + b[3])
    for i in range(nfull, n):                                # the tail, ascending
        acc = acc + WT[i] * x[i]
    with np.errstate(over="ignore"):
        return acc.astype(np.float32)


def ref_matvec_seq(W32, x32) -> np.ndarray:
    """Wrong-on-purpose variant: one sequential double accumulator (the router's order)."""
    WT = np.ascontiguousarray(W32.astype(np.float64).T)
    x = x32.astype(np.float64)
    acc = np.zeros(W32.shape[0])
    for i in range(W32.shape[1]):
        acc = acc + WT[i] * x[i]
    with np.errstate(over="ignore"):
        return acc.astype(np.float32)


def ref_matvec_4lane(W32, x32) -> np.ndarray:
    """Wrong-on-purpose variant: the pre-1.0 kernel (lane i mod 4, (a0+a1)+(a2+a3))."""
    WT = np.ascontiguousarray(W32.astype(np.float64).T)
    x = x32.astype(np.float64)
    a = [np.zeros(W32.shape[0]) for _ in range(4)]
    for i in range(W32.shape[1]):
        a[i % 4] = a[i % 4] + WT[i] * x[i]
    with np.errstate(over="ignore"):
        return ((a[0] + a[1]) + (a[2] + a[3])).astype(np.float32)


E2M1 = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
                 -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0], np.float64)


def mxfp4_codes(packed: np.ndarray, low_is_even: bool = True) -> np.ndarray:
    """4-bit codes in element order.  §5.6: byte j holds element 2j in its LOW nibble."""
    lo, hi = packed & 15, packed >> 4
    codes = np.empty((packed.shape[0], packed.shape[1] * 2), np.uint8)
    codes[:, 0::2], codes[:, 1::2] = (lo, hi) if low_is_even else (hi, lo)
    return codes


def ref_mxfp4_dequant(packed, scales, low_is_even=True) -> np.ndarray:
    vals = E2M1[mxfp4_codes(packed, low_is_even)]
    sc = np.repeat(scales.astype(np.int64), 32, axis=1)
    with np.errstate(over="ignore"):
        out = (vals * np.ldexp(1.0, sc - 127)).astype(np.float32)
    out[sc == 255] = 0.0
    return out


def ref_mxfp4_matvec(packed, scales, x32) -> np.ndarray:
    """§5.6 exact order for one input vector.  Returns float32 [rows]."""
    vals = E2M1[mxfp4_codes(packed)]                         # [R, n] float64, exact
    VT = np.ascontiguousarray(vals.T)
    x = x32.astype(np.float64)
    R, n = vals.shape
    acc = np.zeros(R)
    for g in range(n // 32):
        s = [np.zeros(R) for _ in range(8)]
        for e in range(32):                                  # ascending element order
            s[e % 8] = s[e % 8] + VT[32 * g + e] * x[32 * g + e]
        b = [s[l] + s[l + 4] for l in range(4)]
        sub = (b[0] + b[1]) + (b[2] + b[3])
        sb = scales[:, g].astype(np.int64)
        with np.errstate(over="ignore", invalid="ignore"):
            acc = np.where(sb == 255, acc, acc + sub * np.ldexp(1.0, sb - 127))
    with np.errstate(over="ignore"):
        return acc.astype(np.float32)


def ref_mxfp4_matvec_seq(packed, scales, x32) -> np.ndarray:
    """Wrong-on-purpose variant: one sequential double sum per group."""
    vals = E2M1[mxfp4_codes(packed)]
    VT = np.ascontiguousarray(vals.T)
    x = x32.astype(np.float64)
    acc = np.zeros(vals.shape[0])
    for g in range(vals.shape[1] // 32):
        sub = np.zeros(vals.shape[0])
        for e in range(32):
            sub = sub + VT[32 * g + e] * x[32 * g + e]
        sb = scales[:, g].astype(np.int64)
        acc = np.where(sb == 255, acc, acc + sub * np.ldexp(1.0, sb - 127))
    return acc.astype(np.float32)


def ref_rmsnorm(X32, w32, eps32, gain_first=True) -> np.ndarray:
    """§4.1: s = sequential double sum of squares; r = f32(1/sqrt(s/n + f64(eps)));
    y = f32(f32(w*x)*r) (SF, gain first) or, with gain_first=False, f32(w*f32(x*r)) (REF)."""
    T, n = X32.shape
    XT = np.ascontiguousarray(X32.astype(np.float64).T)
    s = np.zeros(T)
    for i in range(n):
        s = s + XT[i] * XT[i]
    r = (1.0 / np.sqrt(s / n + float(np.float32(eps32)))).astype(np.float32)[:, None]
    if gain_first:
        return (w32[None, :] * X32) * r          # float32 array ops: one rounding each
    return w32[None, :] * (X32 * r)


def ref_kda_recurrence(S, Q, Kk, V, A, B, q_scale):
    """§4.4 steps 1-4 in float32, each product rounded before the add (no FMA).
    Loops over the reduction index i; vectorised over the value channel j only."""
    S = S.copy()
    H, D, _ = S.shape
    T = Q.shape[0]
    O = np.zeros((T, H * D), np.float32)
    qs = np.float32(q_scale)
    for t in range(T):
        for h in range(H):
            sl = slice(h * D, (h + 1) * D)
            q, k, v, a = Q[t, sl] * qs, Kk[t, sl], V[t, sl], A[t, sl]
            beta = B[t, h]
            Sh = S[h]
            for i in range(D):                                   # 1. decay rows
                Sh[i] = Sh[i] * a[i]
            u = np.zeros(D, np.float32)                          # 2. u = S^T k
            for i in range(D):
                u = u + k[i] * Sh[i]
            for i in range(D):                                   # 3. delta write
                kb = k[i] * beta
                Sh[i] = Sh[i] + kb * (v - u)
            o = np.zeros(D, np.float32)                          # 4. o = S^T q, updated S
            for i in range(D):
                o = o + q[i] * Sh[i]
            O[t, sl] = o
    return S, O


def ref_kda_recurrence_fma(S, Q, Kk, V, A, B, q_scale):
    """Wrong-on-purpose variant: the two f32 dot products contracted into FMAs
    (product not rounded before the add).  Only used as a witness."""
    S = S.copy()
    H, D, _ = S.shape
    O = np.zeros((Q.shape[0], H * D), np.float32)
    qs = np.float32(q_scale)

    def fma(acc, x, y):
        return (acc.astype(np.float64) + np.float64(x) * y.astype(np.float64)).astype(np.float32)

    for t in range(Q.shape[0]):
        for h in range(H):
            sl = slice(h * D, (h + 1) * D)
            q, k, v, a = Q[t, sl] * qs, Kk[t, sl], V[t, sl], A[t, sl]
            Sh = S[h]
            for i in range(D):
                Sh[i] = Sh[i] * a[i]
            u = np.zeros(D, np.float32)
            for i in range(D):
                u = fma(u, k[i], Sh[i])
            for i in range(D):
                Sh[i] = Sh[i] + (k[i] * B[t, h]) * (v - u)
            o = np.zeros(D, np.float32)
            for i in range(D):
                o = fma(o, q[i], Sh[i])
            O[t, sl] = o
    return S, O


def random_kda_inputs(r, T, H, D):
    Q = rand_f32(r, (T, H * D))
    Kk = rand_f32(r, (T, H * D))
    for t in range(T):                       # L2-normalised keys like the real layer
        for h in range(H):
            sl = slice(h * D, (h + 1) * D)
            Kk[t, sl] /= np.float32(np.sqrt(np.sum(Kk[t, sl].astype(np.float64) ** 2)))
    V = rand_f32(r, (T, H * D))
    A = r.uniform(0.005, 0.999, (T, H * D)).astype(np.float32)
    B = r.uniform(0.05, 0.95, (T, H)).astype(np.float32)
    S0 = rand_f32(r, (H, D, D), 0.5)
    return S0, Q, Kk, V, A, B


# ---- 1. matvec order and BF16 widening ----------------------------------------------------

@pytest.mark.parametrize("rows,n", [(129, 257), (64, 16), (33, 15), (300, 7168 + 5)])
def test_matvec_f32_exact_order(rows, n):
    """Trap #38 (float64 reductions in the 16-lane order of §5.3): the f32 matvec equals the
    independent exact-order reference bitwise, including a non-multiple-of-16 tail, on random
    data, wide-range data and order-revealing cancelling data (on which a sequential double
    sum, the pre-1.0 4-lane kernel or a float32 sum give different bits)."""
    r = rng(1000 + n)
    for label, (W, x) in (("random", (rand_f32(r, (rows, n)), rand_f32(r, n))),
                          ("wide-range", (adversarial_f32(r, (rows, n)), adversarial_f32(r, n))),
                          ("cancelling", cancelling_matvec(r, rows, n))):
        want = ref_matvec(W, x)
        assert_bitwise(f"matvec f32 {rows}x{n} {label} vs exact-order ref",
                       mv(W, x[None])[0], want)
    if n >= 32:
        seq, four = n_diff(ref_matvec_seq(W, x), want), n_diff(ref_matvec_4lane(W, x), want)
        f32acc = n_diff((W * x[None]).sum(axis=1, dtype=np.float32), want)
        print(f"[gate]   witness on cancelling data: sequential double differs in {seq}/{rows} "
              f"rows, 4-lane (pre-1.0) in {four}/{rows}, float32 accumulation in {f32acc}/{rows}")
        assert seq > 0 and four > 0 and f32acc > 0, "data no longer discriminates the order"


def test_matvec_bf16_equals_f32_bitwise():
    """Traps #37 (BF16 widening is a 16-bit shift, no rounding) and #38: SF's self-test, 129x257
    random BF16 bit patterns without exponent 0xFF; the bf16 matvec must equal the f32 matvec
    on the widened values bit for bit, and both must equal the exact-order reference."""
    r = rng(37)
    Wb = random_bf16(r, (129, 257))
    Wf = widen_bf16(Wb)
    X = rand_f32(r, (3, 257))
    yb, yf = mv(Wb, X), mv(Wf, X)
    assert_bitwise("matvec bf16 vs f32 129x257 (random bf16 patterns)", yb, yf)
    want = np.stack([ref_matvec(Wf, X[t]) for t in range(3)])
    assert_bitwise("matvec bf16 129x257 vs exact-order ref", yb, want)
    print(f"[gate]   patterns include {int(np.sum(((Wb >> 7) & 0xFF) == 0))} zero/subnormal "
          f"weights; {int(np.sum(~np.isfinite(want)))} outputs overflow float32 (as in the ref)")
    Wc, x = cancelling_matvec(r, 129, 257)
    Wcb = (Wc.view(np.uint32) >> 16).astype(np.uint16)
    assert_bitwise("matvec bf16 vs f32 129x257 (cancelling data)", mv(Wcb, x[None]), mv(Wc, x[None]))


def test_i8r_matvec_order_and_threads():
    """A draft trunk's int8 rows: the 16-lane double order of the float paths with the row
    scale applied after the sum (one rounding), so int8 values widened to float32 through
    the f32 matvec give the same sum; 1 and 2 threads and batch vs one token agree."""
    r = rng(88)
    for rows, n in ((129, 257), (33, 15), (300, 2048 + 3)):
        q = r.integers(-127, 128, (rows, n)).astype(np.int8)
        s = (r.random(rows) + 0.01).astype(np.float32)
        X = rand_f32(r, (3, n))
        Y = np.empty((3, rows), np.float32)
        K.i8r_matvec(q, s, X, Y)
        sums = np.stack([ref_matvec(q.astype(np.float32), x).astype(np.float64) for x in X])
        # the kernel keeps the double sum and rounds once, after the scale
        plain = np.empty_like(Y)
        K.i8r_matvec(q, np.ones(rows, np.float32), X, plain)
        assert_bitwise(f"i8r {rows}x{n} unit scales vs exact-order ref", plain,
                       sums.astype(np.float32))
        assert np.max(np.abs(Y - sums * s) / (np.abs(sums * s) + 1e-30)) < 1e-6
        one = np.empty_like(Y)
        with threads(1):
            K.i8r_matvec(q, s, X, one)
        single = np.empty((1, rows), np.float32)
        K.i8r_matvec(q, s, X[1:2], single)
        assert_bitwise(f"i8r {rows}x{n} 1 vs 2 threads", one, Y)
        assert_bitwise(f"i8r {rows}x{n} one token vs batch", single[0], Y[1])
    with pytest.raises(ValueError):
        K.i8r_matvec(q, s[:-1], X, Y)


# ---- 2. MXFP4 --------------------------------------------------------------------------------

def _mxfp4_fixture():
    fx = load_fixture("mxfp4.json")
    P = tens(fx, "packed", np.float64).astype(np.uint8)
    S = tens(fx, "scales", np.float64).astype(np.uint8)
    return fx, np.ascontiguousarray(P), np.ascontiguousarray(S)


def test_mxfp4_fixture_dequant_and_swapped_nibble_witness():
    """Trap #35 (low nibble = even element, E2M1 sign in bit 3, E8M0 = 2^(b-127), groups of
    32 along the input): K.mxfp4_dequant equals `expected` exactly on real checkpoint bytes;
    our own swapped-nibble decode reproduces `first64` and differs from `expected`."""
    fx, P, S = _mxfp4_fixture()
    assert P.shape == (fx["rows"], fx["packed_cols"]) and S.shape == (fx["rows"], fx["scale_cols"])
    assert np.array_equal(np.asarray(fx["e2m1_lut"], np.float64), E2M1)
    want = tens(fx, "expected")
    got = K.mxfp4_dequant(P, S)
    bad = int(np.count_nonzero(got != want))           # -0.0 == 0.0 on purpose
    print(f"[gate] mxfp4 fixture dequant: {want.size} values, {bad} differ "
          f"(scales {int(S.min())}..{int(S.max())})")
    assert got.shape == want.shape and bad == 0
    ours = ref_mxfp4_dequant(P, S)
    assert np.array_equal(ours, want), "the test's own decoder disagrees with the fixture"
    swapped = ref_mxfp4_dequant(P, S, low_is_even=False).reshape(-1)[:64]
    first64 = np.asarray(fx["expected_swapped_nibbles"]["first64"], np.float32)
    n_sw = int(np.count_nonzero(swapped != want.reshape(-1)[:64]))
    print(f"[gate] mxfp4 swapped-nibble decode: first 64 equal first64: "
          f"{np.array_equal(swapped, first64)}; differs from expected in {n_sw}/64")
    assert np.array_equal(swapped, first64)
    assert n_sw > 0


def test_mxfp4_matvec_fixture_bytes():
    """Traps #35/#38: the fused MXFP4 matvec on the real fixture bytes agrees with
    dequantise-then-K.matvec within 1e-6 relative (§5.7) and equals the independent
    exact-order reference of §5.6 bitwise (random x, plus adversarial x)."""
    _, P, S = _mxfp4_fixture()
    r = rng(35)
    for label, X in (("random", rand_f32(r, (2, P.shape[1] * 2))),
                     ("adversarial", adversarial_f32(r, (2, P.shape[1] * 2)))):
        y = mv4(P, S, X)
        yd = mv(K.mxfp4_dequant(P, S), X)
        rel = float(np.max(np.abs(y.astype(np.float64) - yd)) / np.max(np.abs(yd)))
        print(f"[gate] mxfp4 fused vs dequant+matvec ({label} x, 64x3584, T=2): "
              f"max|d|/max|y| = {rel:.2e}, {n_diff(y, yd)} of {y.size} outputs not bitwise equal")
        assert rel < 1e-6
        want = np.stack([ref_mxfp4_matvec(P, S, X[t]) for t in range(2)])
        assert_bitwise(f"mxfp4 matvec ({label} x) vs exact-order ref", y, want)



def test_mxfp4_matvec_exact_order_cancelling():
    """Trap #38 for MXFP4 (§5.6 order: 8 lanes per group, then the group scale, groups
    ascending): bitwise equal to the exact-order reference on order-revealing data (opposite
    codes times the same huge x in different lanes); a sequential in-group sum differs."""
    r = rng(356)
    P, S, x = cancelling_mxfp4(r, 96, 1024)
    y = mv4(P, S, x[None])[0]
    want = ref_mxfp4_matvec(P, S, x)
    assert_bitwise("mxfp4 matvec 96x1024 cancelling vs exact-order ref", y, want)
    seq = ref_mxfp4_matvec_seq(P, S, x)
    yd = mv(K.mxfp4_dequant(P, S), x[None])[0]
    print(f"[gate]   witness: sequential in-group order differs in {n_diff(seq, want)}/96 rows; "
          f"dequantise+16-lane matvec in {n_diff(yd, want)}/96")
    assert n_diff(seq, want) > 0


def test_mxfp4_scale_255_group_contributes_zero():
    """Trap #36 (E8M0 byte 255 = NaN in OCP -> the whole group contributes zero), with the
    neighbouring edge scales 0 (2^-127, float32 subnormal) and 254 (2^127) in the same rows."""
    r = rng(36)
    rows, n = 8, 4 * 32
    P = r.integers(0, 256, (rows, n // 2), dtype=np.uint16).astype(np.uint8)
    S = np.array([[120, 255, 127, 124]] * 4 + [[0, 255, 1, 127]] * 2 + [[254, 255, 253, 127]] * 2,
                 np.uint8)
    x = rand_f32(r, n)
    x[:96] *= np.float32(2.0 ** -20)          # keep the 2^126..2^127-scaled groups finite
    y = mv4(P, S, x[None])[0]
    # the same rows with group 1 replaced by zero nibbles and an ordinary scale
    Pz, Sz = P.copy(), S.copy()
    Pz[:, 16:32], Sz[:, 1] = 0, 127
    yz = mv4(Pz, Sz, x[None])[0]
    assert_bitwise("mxfp4 matvec: scale-255 group == zero group", y, yz)
    assert np.all(np.isfinite(y)), "a 255 group leaked inf/NaN (decoded as 2^128?)"
    assert_bitwise("mxfp4 matvec with scales 0/254/255 vs exact-order ref", y,
                   ref_mxfp4_matvec(P, S, x))
    dq = K.mxfp4_dequant(P, S)
    assert np.all(dq[:, 32:64] == 0.0), "dequant of a 255 group is not zero"
    ours = ref_mxfp4_dequant(P, S)
    same = np.array_equal(dq, ours) and np.array_equal(np.isinf(dq), np.isinf(ours))
    print(f"[gate] mxfp4 dequant with scales 0/254/255: equal to the exact decode: {same}; "
          f"scale-0 group has {int(np.sum((dq[4:6, :32] != 0) & (np.abs(dq[4:6, :32]) < 1.2e-38)))} "
          f"subnormals; scale-254 group has {int(np.sum(np.isinf(dq[6:, :32])))} infinities "
          f"(|E2M1| >= 2 overflows float32 at 2^127)")
    assert same
    # scale 0 is 2^-127 exactly (not flushed): 0.5 * 2^-127 = 2^-128 must survive
    one = np.zeros((1, 16), np.uint8)
    one[0, 0] = 1                                  # element 0 = +0.5, rest +0
    assert K.mxfp4_dequant(one, np.zeros((1, 1), np.uint8))[0, 0] == np.float32(2.0 ** -128)
    assert K.mxfp4_dequant(one, np.full((1, 1), 254, np.uint8))[0, 0] == np.float32(2.0 ** 126)


# ---- 3. instruction-set paths and token blocking --------------------------------------------

def assert_same_values(name: str, got, want) -> None:
    """Bitwise, except that any NaN equals any NaN.  Trap: C does not fix which operand's
    payload an add propagates when both are NaN (the compiler may commute a + b), so NaN
    payloads are not part of the contract; NaN positions and every other bit are."""
    g, w = bits(got).reshape(-1).copy(), bits(want).reshape(-1).copy()
    gn, wn = np.isnan(g.view(np.float32)), np.isnan(w.view(np.float32))
    assert np.array_equal(gn, wn), f"{name}: NaN positions differ ({gn.sum()} vs {wn.sum()})"
    g[gn] = w[wn] = 0x7FC00000
    print(f"[gate]   ({int(wn.sum())} NaN outputs compared as NaN)")
    assert_bitwise(name, g.view(np.float32), w.view(np.float32))


def special_f32(r, shape) -> np.ndarray:
    """[rows, n] Gaussian values with denormals and zeros of both signs everywhere, and +-inf
    and NaN in every fourth row only (rows 1, 5, ...), so most outputs stay finite and
    compare bit for bit while some exercise inf/NaN propagation."""
    a = rand_f32(r, shape)
    rows, n = shape
    k = max(1, n // 50)
    for i in range(rows):
        pick = r.choice(n, size=(5, k), replace=5 * k > n)     # tiny rows: may overlap
        a[i, pick[0]] = np.float32(1e-40) * r.choice([-1, 1], k).astype(np.float32)
        a[i, pick[1]] = np.float32(-0.0)
        if i % 4 == 1:
            a[i, pick[2]], a[i, pick[3]], a[i, pick[4]] = np.inf, -np.inf, np.nan
    return a


def mv_kind(kind, WW, X):
    """One matvec call of the given kind ('f32', 'bf16', 'i8r', 'mxfp4') on the current path;
    WW is the matrix, or its (packed, scales) / (q, scales) pair."""
    if kind == "mxfp4":
        return mv4(WW[0], WW[1], X)
    if kind == "i8r":
        Y = np.empty((X.shape[0], WW[0].shape[0]), np.float32)
        K.i8r_matvec(WW[0], WW[1], X, Y)
        return Y
    return mv(WW, X)


def all_isas_mv(kind, WW, X):
    """{isa: output} for one matvec over every path this CPU runs."""
    out = {}
    for name in K.isas_available():
        with isa(name):
            assert K.isa() == name
            out[name] = mv_kind(kind, WW, X)
    return out


def _need_simd():
    if not simd_isas():
        pytest.skip("no SIMD path on this CPU/build: only the scalar path exists, nothing to "
                    "compare it with")


def test_isa_paths_bitwise_identical_random_and_cancelling():
    """Traps #37/#38 (every SIMD path must keep the exact lane partition and tree; FMA is exact
    here because the products are exact in double): f32, bf16, I8R and MXFP4 matvec give
    identical bits on the scalar, AVX2 and AVX-512 paths, on 300x(7168+5) (MXFP4 300x7168
    with scales 0/254/255 mixed in), including order-revealing cancelling rows, and every
    tail length 0..15; the scalar path equals the independent exact-order reference."""
    _need_simd()
    r = rng(4242)
    n = 7168 + 5
    Wc, xc = cancelling_matvec(r, 300, n)
    W = np.concatenate([rand_f32(r, (150, n)), Wc[:150]])
    Wb = (W.view(np.uint32) >> 16).astype(np.uint16)     # rows 150.. : the cancelling rows
    Wb[:150] = random_bf16(r, (150, n))                  # rows ..149: random BF16 patterns
    X = np.stack([rand_f32(r, n), adversarial_f32(r, n), xc])
    P = r.integers(0, 256, (300, 7168 // 2), dtype=np.uint16).astype(np.uint8)
    S = r.integers(118, 125, (300, 7168 // 32), dtype=np.uint16).astype(np.uint8)
    S[::7, ::5] = 255
    S[1::7, ::3] = 0
    S[2::11, 1::4] = 254
    Pc, Sc, x4c = cancelling_mxfp4(r, 300, 7168)
    P[150:], S[150:] = Pc[150:], Sc[150:]
    X4 = np.stack([rand_f32(r, 7168), adversarial_f32(r, 7168), x4c])
    X4[:2] *= np.float32(2.0 ** -12)
    Q = r.integers(-128, 128, (300, n)).astype(np.int8)
    qs = (r.random(300) + 0.01).astype(np.float32)
    cases = (("f32 300x7173", "f32", W, X), ("bf16 300x7173", "bf16", Wb, X),
             ("mxfp4 300x7168", "mxfp4", (P, S), X4), ("i8r 300x7173", "i8r", (Q, qs), X))
    for label, kind, WW, XX in cases:
        out = all_isas_mv(kind, WW, XX)
        for name in simd_isas():
            assert_bitwise(f"{name} vs scalar {label} (T=3: random, wide-range, cancelling x)",
                           out[name], out["scalar"])
        if kind == "f32":
            assert_bitwise("scalar f32 matvec, cancelling x, vs exact-order ref",
                           out["scalar"][2], ref_matvec(W, X[2]))
        if kind == "mxfp4":
            assert_bitwise("scalar mxfp4 matvec, cancelling x, vs exact-order ref",
                           out["scalar"][2], ref_mxfp4_matvec(P, S, X4[2]))
    for m in range(16, 32):                  # every tail length 0..15, on every path
        Wm, xm = cancelling_matvec(r, 17, m)
        want = ref_matvec(Wm, xm)
        for name, y in all_isas_mv("f32", Wm, xm[None]).items():
            assert n_diff(y[0], want) == 0, f"{name} width {m}"
        Wmb = (Wm.view(np.uint32) >> 16).astype(np.uint16)
        for name, y in all_isas_mv("bf16", Wmb, xm[None]).items():
            assert n_diff(y[0], want) == 0, f"{name} bf16 width {m}"
    print(f"[gate] {', '.join(K.isas_available())} vs ref, widths 16..31 (all tail lengths): "
          f"all equal")


@pytest.mark.parametrize("rows,n", [(1, 1), (3, 15), (5, 17), (33, 47), (129, 257)])
def test_isa_paths_bitwise_identical_odd_sizes_and_specials(rows, n):
    """The same comparison on odd shapes (fewer rows than a tile, widths below one block of
    16, ragged tails) with denormals, signed zeros, +-inf and NaN in weights and inputs for
    f32/bf16 (BF16 patterns here include exponent 0xFF), and in the inputs of I8R and MXFP4
    (whose weights cannot hold them); every path, T = 5 tokens."""
    _need_simd()
    r = rng(rows * 1000 + n)
    W = special_f32(r, (rows, n))
    Wb = random_bf16(r, (rows, n))
    Wb[1::4] = r.integers(0, 1 << 16, Wb[1::4].shape, dtype=np.uint32)   # inf/NaN patterns
    Q = r.integers(-128, 128, (rows, n)).astype(np.int8)
    qs = (r.random(rows) + 0.01).astype(np.float32)
    X = special_f32(r, (5, n))
    X[0] = rand_f32(r, n)                                 # one all-finite token
    n4 = 32 * max(1, n // 32)
    P = r.integers(0, 256, (rows, n4 // 2), dtype=np.uint16).astype(np.uint8)
    S = r.integers(0, 256, (rows, n4 // 32), dtype=np.uint16).astype(np.uint8)
    X4 = special_f32(r, (5, n4))
    X4[0] = rand_f32(r, n4)
    for label, kind, WW, XX in (("f32", "f32", W, X), ("bf16", "bf16", Wb, X),
                                ("i8r", "i8r", (Q, qs), X), ("mxfp4", "mxfp4", (P, S), X4)):
        out = all_isas_mv(kind, WW, XX)
        for name in simd_isas():
            assert_same_values(f"{name} vs scalar {label} {rows}x{n} with specials",
                               out[name], out["scalar"])
    finite = np.isfinite(W).all(axis=1)
    with isa("scalar"):
        assert_bitwise(f"scalar f32 {rows}x{n}, finite rows, token 0 vs exact-order ref",
                       mv(W[finite], X[:1])[0], ref_matvec(W[finite], X[0]))


@pytest.mark.parametrize("rows", [1, 2, 3, 5, 6, 7, 9, 35])
def test_isa_paths_bitwise_identical_one_token_every_row_tile(rows):
    """T = 1 runs other tiles than T > 1 (AVX-512: 4 rows per pass, AVX2: 2; MXFP4 blocks
    of 8 rows in lanes), so every row remainder (and fewer rows than a tile) is compared
    with the scalar path one token at a time, with the special weights and inputs of the
    test above (BF16 exponent 0xFF, +-inf, NaN, -0.0, denormals; MXFP4 scale bytes 0, 254,
    255), widths 16..47, 450 (14 MXFP4 groups: ragged 8- and 4-group blocks) and 1027.
    (Thread splits: the token-blocked test below, above the parallel threshold.)"""
    _need_simd()
    r = rng(7000 + rows)
    for n in (16, 31, 47, 450, 1027):
        W = special_f32(r, (rows, n))
        Wb = random_bf16(r, (rows, n))
        Wb[1::4] = r.integers(0, 1 << 16, Wb[1::4].shape, dtype=np.uint32)  # inf/NaN patterns
        Wb[0, : min(n, 8)] = [0x8000, 0x0001, 0x807F, 0x7F80, 0xFF80, 0x7FC1, 0x0080, 0x8001][
            : min(n, 8)]                                   # -0, subnormals, +-inf, NaN, min normal
        Q = r.integers(-128, 128, (rows, n)).astype(np.int8)
        qs = (r.random(rows) + 0.01).astype(np.float32)
        n4 = 32 * max(1, n // 32)
        P = r.integers(0, 256, (rows, n4 // 2), dtype=np.uint16).astype(np.uint8)
        S = r.integers(110, 130, (rows, n4 // 32), dtype=np.uint16).astype(np.uint8)
        S.reshape(-1)[::3] = 255
        S.reshape(-1)[1::5] = 0
        S.reshape(-1)[2::7] = 254
        for t in range(2):                                 # a finite token, a special one
            X = rand_f32(r, (1, n)) if t == 0 else special_f32(r, (1, n))
            X4 = rand_f32(r, (1, n4)) if t == 0 else special_f32(r, (1, n4))
            for label, kind, WW, XX in (("f32", "f32", W, X), ("bf16", "bf16", Wb, X),
                                        ("i8r", "i8r", (Q, qs), X),
                                        ("mxfp4", "mxfp4", (P, S), X4)):
                out = all_isas_mv(kind, WW, XX)
                for name in simd_isas():
                    assert_same_values(f"{name} vs scalar {label} {rows}x{n} T=1 token {t}",
                                       out[name], out["scalar"])


KINDS = ("f32", "bf16", "i8r", "mxfp4")
# T = 1..9: full and ragged token tiles; 13, 25, 31: across one and two of the row drivers'
# L2-sized token blocks (256 KiB: 15 tokens of 2085 inputs, 14 on AVX2's 2-token tiles),
# with ragged tiles at each edge; T >= 5 on AVX-512 runs BF16, F32 and I8R through the
# panels (k3dot.h), whose token blocks hold 48 tokens: 50 crosses one, ragged 2-token tile
TOKEN_COUNTS = (*range(1, 10), 13, 25, 31, 50)
TOKENS = TOKEN_COUNTS[-1]


def _blocking_inputs(r, kind, rows, n):
    if kind == "f32":
        return rand_f32(r, (rows, n)), rand_f32(r, (TOKENS, n))
    if kind == "bf16":
        return random_bf16(r, (rows, n)), rand_f32(r, (TOKENS, n))
    if kind == "i8r":
        return ((r.integers(-128, 128, (rows, n)).astype(np.int8),
                 (r.random(rows) + 0.01).astype(np.float32)), rand_f32(r, (TOKENS, n)))
    n4 = n - n % 32
    P = r.integers(0, 256, (rows, n4 // 2), dtype=np.uint16).astype(np.uint8)
    S = r.integers(118, 125, (rows, n4 // 32), dtype=np.uint16).astype(np.uint8)
    S[::5, ::3] = 255
    return (P, S), rand_f32(r, (TOKENS, n4))


@pytest.mark.parametrize("kind", KINDS)
def test_token_blocked_equals_one_token_every_T_isa_threads(kind):
    """Trap #45 for the token-blocked tiles (a weight block widened once, applied to up to 4
    tokens; 2 rows share each x block) and the drivers' token blocks: for every T of
    TOKEN_COUNTS on every path at 1 and 2 threads, Y[t] equals the one-token call Y[t:t+1]
    bit for bit, on 517 rows (odd: a ragged row tile and a ragged last chunk) x 2085 inputs
    (a ragged tail; 2080 = 8 panel k-blocks of 256 and one of 32), above the parallel
    threshold so 2 threads really split the rows."""
    r = rng(45 + KINDS.index(kind))
    rows, n = 517, 2085
    assert rows * (n - n % 32) >= PAR_MIN_WORK
    WW, X = _blocking_inputs(r, kind, rows, n)
    for name in K.isas_available():
        with isa(name):
            with threads(1):
                single = np.concatenate([mv_kind(kind, WW, X[t:t + 1])
                                         for t in range(TOKENS)])
            for nt in (1, 2):
                with threads(nt):
                    for T in TOKEN_COUNTS:
                        got = mv_kind(kind, WW, X[:T])
                        assert n_diff(got, single[:T]) == 0, \
                            f"{kind} {name} T={T} threads={nt}: blocked != one-token"
    print(f"[gate] {kind} {rows}x{n}: T={TOKEN_COUNTS} blocked == {TOKENS} one-token calls, "
          f"bitwise, on {', '.join(K.isas_available())} at 1 and 2 threads")
    with isa("scalar"):
        if kind in ("f32", "bf16"):
            W32 = WW if kind == "f32" else widen_bf16(WW)
            assert_bitwise(f"{kind} one-token vs exact-order ref", single[3], ref_matvec(W32, X[3]))
        elif kind == "mxfp4":
            assert_bitwise("mxfp4 one-token vs exact-order ref", single[3],
                           ref_mxfp4_matvec(WW[0], WW[1], X[3]))


@pytest.mark.parametrize("kind", ("f32", "bf16", "i8r"))
def test_wide_inputs_tiles_equal_panels(kind):
    """Above 2,730 inputs a panel's token block holds fewer than 48 tokens, and AMD's
    AVX-512 cores run such matvecs on the 2 x 4 tiles instead (K.set_panel_wide_tiles,
    k3dot.h says why).  Both choices, and the CPU's own, give the one-token calls' bits:
    389 rows (a ragged row tile) x 2803 inputs (a ragged tail; 20 tokens a panel block),
    T = 5, 13 and 50 (ragged tiles, two token blocks of the panel, three of the tiles), at 1
    and 2 threads."""
    if "avx512" not in K.isas_available():
        pytest.skip("NOT RUN: this CPU has no AVX-512 (the switch is AVX-512's)")
    r = rng(2803 + KINDS.index(kind))
    rows, n = 389, 2803
    assert rows * n >= PAR_MIN_WORK
    WW, X = _blocking_inputs(r, kind, rows, n)
    with isa("avx512"):
        with threads(1):
            single = np.concatenate([mv_kind(kind, WW, X[t:t + 1]) for t in range(TOKENS)])
        try:
            for mode in (0, 1, -1):
                K.set_panel_wide_tiles(mode)
                for nt in (1, 2):
                    with threads(nt):
                        for T in (5, 13, 50):
                            got = mv_kind(kind, WW, X[:T])
                            assert n_diff(got, single[:T]) == 0, \
                                f"{kind} wide mode {mode} T={T} threads={nt}: != one-token"
        finally:
            K.set_panel_wide_tiles(-1)
    print(f"[gate] {kind} {rows}x{n}: T=5,13,50 on panels, on tiles and by the CPU == one-token "
          f"calls, bitwise, at 1 and 2 threads")


def test_mxfp4_decoded_once_equals_tiles_and_one_token():
    """AVX-512's MXFP4 path that decodes each group once for all of a call's tokens (T >= 8,
    k3_mxfp4_rows8_tokens_avx512) against its 4-token tiles (K.set_mx_tokens_min off) and
    the scalar one-token calls, bit for bit (AVX2 keeps its tiles, which decode per tile:
    a decoded-once AVX2 form ran 0.92-0.98x on the Xeon; its T-token calls are held to the
    scalar here too): 517 rows (a ragged 8-row block) x 2080 inputs (65 groups: a ragged
    8-group chunk and 4-group stage), dead groups (scale 255) and scales 0/254, special
    inputs, T = 8, 13 and 70 (across the 64-token chunk, ragged), at 1 and 2 threads."""
    _need_simd()
    r = rng(4711)
    rows, n = 517, 2080
    P = r.integers(0, 256, (rows, n // 2), dtype=np.uint16).astype(np.uint8)
    S = r.integers(110, 130, (rows, n // 32), dtype=np.uint16).astype(np.uint8)
    S.reshape(-1)[::7] = 255
    S.reshape(-1)[1::11] = 0
    S.reshape(-1)[2::13] = 254
    X = rand_f32(r, (70, n))
    X[5] = special_f32(r, (1, n))[0]
    X[5][~np.isfinite(X[5])] = 0.0                  # finite: compared bit for bit
    with isa("scalar"):
        single = np.concatenate([mv4(P, S, X[t:t + 1]) for t in range(70)])
    for name in simd_isas():
        with isa(name):
            for nt in (1, 2):
                with threads(nt):
                    for T in (8, 13, 70):
                        got = mv4(P, S, X[:T])
                        K.set_mx_tokens_min(1 << 40)
                        try:
                            tiles = mv4(P, S, X[:T])
                        finally:
                            K.set_mx_tokens_min(0)
                        assert_bitwise(f"mxfp4 {name} decoded-once vs tiles T={T} "
                                       f"threads={nt}", got, tiles)
                        assert n_diff(got, single[:T]) == 0, \
                            f"mxfp4 {name} decoded-once vs scalar one-token T={T} threads={nt}"
    print(f"[gate] mxfp4 {rows}x{n} decoded-once == tiles == scalar one-token on "
          f"{', '.join(simd_isas())}, T = 8, 13, 70, 1 and 2 threads")


def _spanned_f32(r, n: int, spans) -> np.ndarray:
    """One token whose group g has a chosen span (bits from its largest value's top to the
    lowest set bit of any value): full 24-bit mantissas spread over spans[g] - 24 binades
    (spans below 24: values with trailing zero bits), random signs."""
    x = np.empty(n, np.float32)
    for g, span in enumerate(spans):
        top = int(r.integers(-20, 20))
        if span >= 24:
            e = top - r.integers(0, span - 23, 32)
            e[0], e[1] = top, top - (span - 24)       # both ends present
            m = r.integers(1 << 23, 1 << 24, 32) | 1  # lowest bit set
            v = np.ldexp(m.astype(np.float64), e - 23)
        else:                                         # span bits of integer mantissa
            m = r.integers(1, 1 << span, 32)
            m[0] = (1 << (span - 1)) | 1
            v = np.ldexp(m.astype(np.float64), top)
        x[32 * g:32 * g + 32] = v * r.choice([-1.0, 1.0], 32)
    return x


def test_mxfp4_integer_path_equals_scalar():
    """The one-token MXFP4 matvec on VNNI byte products (k3mxint.h) against the scalar
    reference, bit for bit: every group span from 1 to 60 bits (the integer path takes
    spans <= 43; the rest, inf/NaN and subnormal-laden groups take the double path inside
    the same row, and a token with fewer than 2/3 exact groups the old path), all-zero
    groups, -0.0, scales 0/254/255, rows 1..40 (ragged 16-row and 8-row blocks), 1 to 67
    groups (ragged 8-group chunks), every digit-plane cap, 1 and 2 threads.  The groups'
    plan (mxq_groups) must show both paths taken."""
    if not K.mxq_supported():
        pytest.skip("NOT RUN: this CPU lacks AVX-512 VNNI/VBMI/CD, the integer path's "
                    "instructions (its dispatcher keeps the double path)")
    r = rng(5151)
    seen_exact = seen_double = compared = unplanned = 0
    cases = [(rows, ng) for rows in (1, 7, 8, 9, 15, 16, 17, 40) for ng in (1, 3, 9)]
    cases += [(33, 67), (16, 60)]
    spans = np.arange(1, 61)
    for rows, ng in cases:
        n = 32 * ng
        P = r.integers(0, 256, (rows, n // 2), dtype=np.uint16).astype(np.uint8)
        S = r.integers(100, 155, (rows, ng), dtype=np.uint16).astype(np.uint8)
        S.reshape(-1)[::7] = 255
        S.reshape(-1)[1::11] = 0
        S.reshape(-1)[2::13] = 254
        for rep in range(3):
            x = _spanned_f32(r, n, r.choice(spans[(0, 0, 29)[rep]:(43, 50, 60)[rep]], ng))
            if rep == 1:
                x[32 * int(r.integers(ng)):][:32] = 0.0
                x[int(r.integers(n))] = np.float32(-0.0)
                x[int(r.integers(n))] = np.float32(1e-45)
            if rep == 2 and ng > 1:
                x[int(r.integers(n))] = r.choice([np.inf, -np.inf, np.nan])
            X = x[None, :]
            with isa("scalar"):
                want = mv4(P, S, X)
            for cap in (6, 5, 4, 2):
                K.set_mxq(True, planes=cap)
                try:
                    planes, exact = K.mxq_groups(x)
                    for nt in (1, 2):
                        with threads(nt):
                            got = mv4(P, S, X)
                        if n_diff(got, want):
                            assert_bitwise(f"mxfp4 integer path {rows}x{n} cap {cap} "
                                           f"{nt} threads", got, want)
                        compared += got.size
                finally:
                    K.set_mxq(True, planes=6)
                assert planes <= cap
                if planes:
                    seen_exact += int(exact.sum())
                    seen_double += int((~exact).sum())
                else:
                    unplanned += 1
    assert seen_exact > 500 and seen_double > 20 and unplanned > 20, \
        (seen_exact, seen_double, unplanned)
    print(f"[gate] mxfp4 integer path == scalar: {compared} outputs bit-compared over "
          f"{len(cases)} shapes; in planned calls {seen_exact} groups on integers and "
          f"{seen_double} on doubles; {unplanned} calls left to the old path")


def test_mxfp4_integer_path_few_tokens_equals_scalar():
    """Two-token calls take the integer path together (one weight transpose for both) when
    both tokens have a plan: each token's own spans, planes and exact groups (a group exact
    for one token and not the other takes both paths in one pass), against the scalar
    form, bit for bit; calls with an unplanned token or of 3..8 tokens keep the double path
    and agree too.  (The pair loop itself was checked at T = 3, 5, 7 with the limit raised:
    mutations feeding the second token the first's inputs or a wrong weight offset failed
    here.)"""
    if not K.mxq_supported():
        pytest.skip("NOT RUN: this CPU lacks AVX-512 VNNI/VBMI/CD")
    r = rng(5153)
    spans = np.arange(1, 61)
    compared = 0
    for rows, ng in ((1, 3), (9, 5), (16, 9), (33, 17), (40, 67)):
        n = 32 * ng
        P = r.integers(0, 256, (rows, n // 2), dtype=np.uint16).astype(np.uint8)
        S = r.integers(100, 155, (rows, ng), dtype=np.uint16).astype(np.uint8)
        S.reshape(-1)[::7] = 255
        S.reshape(-1)[1::11] = 0
        for T in (2, 3, 5, 7, 8):
            X = np.stack([_spanned_f32(r, n, r.choice(spans[:(43, 50, 60)[t % 3]], ng))
                          for t in range(T)])
            with isa("scalar"):
                want = mv4(P, S, X)
            for nt in (1, 2):
                with threads(nt):
                    got = mv4(P, S, X)
                if n_diff(got, want):
                    assert_bitwise(f"mxfp4 integer path {rows}x{n} T={T} {nt} threads",
                                   got, want)
                compared += got.size
    print(f"[gate] mxfp4 integer path, 2..8-token calls == scalar: {compared} outputs "
          f"bit-compared")


def test_mxfp4_integer_path_plans_spans_exactly():
    """mxq_groups' plan is the proof's condition: a group runs on integers iff its span is
    <= 43 bits and fits the plane cap (planes = ceil((span + 2) / 8)); all-zero groups run
    on integers; inf/NaN never."""
    if not K.mxq_supported():
        pytest.skip("NOT RUN: this CPU lacks AVX-512 VNNI/VBMI/CD")
    r = rng(5152)
    spans = list(range(1, 61)) + list(range(1, 44)) * 3     # 2/3 exact or more: planned
    x = _spanned_f32(r, 32 * len(spans), spans)
    planes, exact = K.mxq_groups(x)
    want = np.array([s <= 43 for s in spans])
    assert (exact == want).all(), [s for s, e, w in zip(spans, exact, want) if e != w]
    assert planes == 6
    K.set_mxq(True, planes=5)
    try:
        _, exact5 = K.mxq_groups(x)
    finally:
        K.set_mxq(True, planes=6)
    assert (exact5 == np.array([(s + 2 + 7) // 8 <= 5 for s in spans])).all()
    z = np.zeros(128, np.float32)
    z[40] = np.nan
    planes, exact = K.mxq_groups(z)
    assert planes == 1 and exact.tolist() == [True, False, True, True]
    z[70] = np.inf                                           # half exact: not planned
    assert K.mxq_groups(z)[0] == 0
    print(f"[gate] integer-path plan: spans 1..43 exact, 44..60 double; cap 5 -> spans "
          f"<= 38; zero group exact, NaN group double; under 2/3 exact -> no plan")


def test_isa_selection_env_and_refusals():
    """K3_KERNEL_ISA forces a path at import (so a whole run can be pinned to one); a typo is
    ignored with a warning naming the variable; set_isa refuses unknown names and paths the
    CPU lacks (running them would crash, not just be slow)."""
    code = "from k3engine import kernels as K; print(K.isa())"
    for want in K.isas_available():
        got = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                             env={**os.environ, "K3_KERNEL_ISA": want}, check=True)
        assert got.stdout.strip() == want, (want, got.stdout, got.stderr)
    bad = subprocess.run([sys.executable, "-W", "always", "-c", code], capture_output=True,
                         text=True, env={**os.environ, "K3_KERNEL_ISA": "avx9000"},
                         check=True)
    assert bad.stdout.strip() == K.isas_available()[-1]
    assert "K3_KERNEL_ISA" in bad.stderr and "avx9000" in bad.stderr
    print(f"[gate] K3_KERNEL_ISA selects each of {K.isas_available()}; a typo warns: "
          f"{bad.stderr.strip().splitlines()[-1][:100]}")
    with pytest.raises(ValueError, match="unknown kernel ISA"):
        K.set_isa("sse9")
    missing = [n for n in ("scalar", "avx2", "avx512") if n not in K.isas_available()]
    for name in missing:
        with pytest.raises(ValueError, match="not supported by this CPU"):
            K.set_isa(name)
    prev = K.isa()
    K.set_simd(False)
    assert K.isa() == "scalar" and not K.simd_active()
    K.set_isa(prev)


# ---- 4. thread-count independence ------------------------------------------------------------

def test_results_independent_of_thread_count():
    """§5.1 (never split one reduction across threads; thread count must not change bits):
    matvec, MXFP4 matvec, kda_recurrence and mla_attention at 1 and 2 threads (on k3pool.h's
    threads and on OpenMP's), every ISA path, on shapes above the parallel threshold
    (K.par_min_work() multiply-adds)."""
    r = rng(5)
    W = rand_f32(r, (512, 1029))
    Wb = random_bf16(r, (512, 1029))
    X = rand_f32(r, (3, 1029))
    P = r.integers(0, 256, (512, 512), dtype=np.uint16).astype(np.uint8)
    S = r.integers(118, 125, (512, 32), dtype=np.uint16).astype(np.uint8)
    X4 = rand_f32(r, (3, 1024))
    H, D, T = 8, 32, 32
    assert H * D * D * T * 4 >= PAR_MIN_WORK
    S0, Q, Kk, V, A, B = random_kda_inputs(r, T, H, D)
    Hm, dn, dr, dv, Tm, past = 8, 32, 16, 32, 8, 248
    assert Tm * Hm * (past + Tm) * (dn + dv) >= PAR_MIN_WORK
    assert 3 * 512 * 1024 >= PAR_MIN_WORK
    Qm = rand_f32(r, (Tm, Hm * (dn + dr)), 0.3)
    KV = rand_f32(r, (past + Tm + 3, Hm * (dn + dv)))
    R = rand_f32(r, (past + Tm + 3, dr))

    def run():
        Skda, Okda = S0.copy(), np.empty((T, H * D), np.float32)
        K.kda_recurrence(Skda, Q, Kk, V, A, B, K.kda_q_scale(D), Okda)
        Om = np.empty((Tm, Hm * dv), np.float32)
        mla_rows(Qm, KV, R, past, Hm, dn, dv, Om)
        return {"matvec f32 512x1029": mv(W, X), "matvec bf16 512x1029": mv(Wb, X),
                "mxfp4 512x1024": mv4(P, S, X4), "kda_recurrence out": Okda,
                "kda_recurrence state": Skda, "mla_attention": Om}

    for path in K.isas_available():            # MLA has a portable and an AVX-512 loop
        with isa(path):
            with threads(1):
                one = run()
            with threads(2):
                two = run()
                with pool(False):              # OpenMP's regions instead of k3pool.h
                    omp = run()
        for name in one:
            assert_bitwise(f"{path} threads 1 vs 2: {name}", two[name], one[name])
            assert_bitwise(f"{path} threads 1 vs 2 on OpenMP: {name}", omp[name], one[name])


@contextlib.contextmanager
def pool(on: bool):
    K.set_pool(on)
    try:
        yield
    finally:
        K.set_pool(True)


def _pool_work(r):
    """A decode step's kinds of pool loop: T = 1 matvecs (16-row items or longer), MXFP4,
    KDA heads, MLA heads; returns a function giving their outputs."""
    Wb = random_bf16(r, (2048, 512))
    x = rand_f32(r, (1, 512))
    P = r.integers(0, 256, (1024, 512), dtype=np.uint16).astype(np.uint8)
    S = r.integers(118, 125, (1024, 32), dtype=np.uint16).astype(np.uint8)
    x4 = rand_f32(r, (1, 1024))
    H, D = 16, 128
    S0, Q, Kk, V, A, B = random_kda_inputs(r, 1, H, D)
    assert Wb.size >= PAR_MIN_WORK and P.size * 2 >= PAR_MIN_WORK
    assert H * D * D * 4 >= PAR_MIN_WORK

    def run():
        Skda, Okda = S0.copy(), np.empty((1, H * D), np.float32)
        K.kda_recurrence(Skda, Q, Kk, V, A, B, K.kda_q_scale(D), Okda)
        return [mv(Wb, x), mv4(P, S, x4), Okda, Skda]
    return run


def _rounds_until_workers_help(run, most=300) -> int:
    """Rounds of run() until a pool worker has run an item (most + 1: never).  A caller
    takes items too and never waits for a worker to wake, so a pool whose workers never
    start or never see a task gives right answers on one thread; only this count shows it.
    A working pool needs a round or two (a worker starts, or wakes, within a few ms)."""
    before = K.pool_stats()[1]
    for k in range(1, most + 1):
        run()
        if K.pool_stats()[1] > before:
            return k
    return most + 1


def test_pool_workers_take_items():
    """With 2 compute threads the pool's worker runs some of a decode step's items (the
    matvecs', MXFP4's and KDA heads' loops), and with 1 it runs none."""
    run = _pool_work(rng(79))
    with threads(1):
        before = K.pool_stats()[1]
        for _ in range(20):
            run()
        alone = K.pool_stats()[1] - before
    with threads(2):
        k = _rounds_until_workers_help(run)
    print(f"[threads] pool workers {K.pool_stats()[0]}; items they ran in 20 rounds at 1 "
          f"thread: {alone}; rounds at 2 threads until they ran one: {k}")
    assert alone == 0 and k <= 300


def test_pool_callers_on_two_threads_at_once():
    """k3pool.h runs one caller's task at a time; a second thread calling a kernel while a
    task runs (the kernels release the GIL: the app's engine thread and a server thread
    could) runs its items alone.  Two Python threads x 40 rounds of T = 1 matvecs, MXFP4,
    KDA at 2 compute threads: every output equals the serial result bit for bit, and
    neither hangs."""
    import threading
    run = _pool_work(rng(77))
    with threads(1):
        want = run()
    errors, done = [], []

    def caller():
        try:
            for _ in range(40):
                for name, got, w in zip(("bf16", "mxfp4", "kda out", "kda state"), run(), want):
                    if n_diff(got, w):
                        errors.append(name)
            done.append(1)
        except Exception as e:          # noqa: BLE001 - reported below
            errors.append(repr(e))
    with threads(2):
        ts = [threading.Thread(target=caller) for _ in range(2)]
        for t in ts:
            t.start()
        for t in ts:
            t.join(timeout=120)
    print(f"[threads] 2 callers x 40 rounds x 4 outputs at 2 compute threads: "
          f"{len(done)} finished, {len(errors)} differ or failed {errors[:3]}")
    assert len(done) == 2 and not errors


_SCRATCH_CHILD = """
import threading, numpy as np, psutil
from k3engine import kernels as K
K.set_num_threads(1)
r = np.random.default_rng(1)
H, dn, dr, dv, npos = 2, 16, 8, 16, 60000
Q = r.standard_normal((1, H * (dn + dr))).astype(np.float32)
Kb = r.standard_normal((H, npos // 8, dn, 8)).astype(np.float32)
Vc = r.standard_normal((H, npos, dv)).astype(np.float32)
Rb = r.standard_normal((npos // 8, dr, 8)).astype(np.float32)
O = np.empty((1, H * dv), np.float32)
def one():
    K.mla_attention(Q, Kb, Vc, Rb, npos - 1, O)
one()
rss0 = psutil.Process().memory_info().rss
for i in range(200):
    t = threading.Thread(target=one)
    t.start()
    t.join()
print((psutil.Process().memory_info().rss - rss0) / 1e6)
"""


def test_kernel_scratch_is_freed_when_its_thread_ends():
    """k3pool.h gives each thread that runs MLA or KDA items a scratch buffer of its own
    (MLA's: the scores of every position, ~1.9 MB of which a 60,000-position context
    touches 480 KB).  A key's destructor frees it when the thread ends: 200 short-lived
    Python threads (a thread per request or per chat) each calling MLA once grow the
    process by a few MB, not the ~385 MB the buffers would hold if kept (measured with the
    destructor removed)."""
    out = subprocess.run([sys.executable, "-c", _SCRATCH_CHILD], capture_output=True,
                         text=True, timeout=300, check=True).stdout.split()
    grew = float(out[-1])
    print(f"[threads] 200 threads x one 60,000-position MLA call: RSS grew {grew:.1f} MB")
    assert grew < 100


@pytest.mark.skipif(not hasattr(os, "fork"), reason="NOT RUN: no os.fork on this platform")
def test_pool_works_in_a_forked_child():
    """A forked child has none of the parent's pool workers (threads do not survive fork):
    k3pool.h's atfork handler forgets them (and resets its lock, which a worker may have
    held), so the child's first 2-thread kernel starts its own.  The child computes the
    parent's outputs bit for bit, its own workers then take items, all within 60 s (an
    alarm kills a hung child)."""
    run = _pool_work(rng(78))
    with threads(2):
        want = run()                    # the parent has started its workers
        pid = os.fork()
        if pid == 0:                    # the child: exit status says what happened
            import signal
            signal.alarm(60)
            try:
                same = all(n_diff(g, w) == 0 for g, w in zip(run(), want))
                helped = _rounds_until_workers_help(run) <= 300
                os._exit(0 if same and helped else 3 if not same else 5)
            except BaseException:       # noqa: BLE001 - any failure is a status
                os._exit(4)
    _, status = os.waitpid(pid, 0)
    print(f"[threads] forked child at 2 compute threads: wait status {status} "
          f"(0: same bits, workers help; 3: differ; 4: raised; 5: no worker ran an item; "
          f"signal 14: hung)")
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0


# ---- 5. C-library transcendentals -------------------------------------------------------------

def _sweep(r) -> np.ndarray:
    grid = np.linspace(-110.0, 110.0, 8801)
    mags = np.ldexp(1.0, np.arange(-30, 8))
    rand = r.standard_normal(6000) * r.choice([0.1, 1.0, 5.0, 20.0], 6000)
    special = [0.0, -0.0, 88.72, -88.72, 103.97, -103.97, 16.6, -16.6, np.inf, -np.inf]
    return np.concatenate([grid, mags, -mags, rand, special]).astype(np.float32)


def test_sigmoid_uses_libm_expf():
    """Trap #39 (C-library expf, real divide): K.sigmoid (in place, 2-D float32) equals
    f32(1) / (f32(1) + glibc expf(-x)) bitwise on a sweep of ~15,000 values."""
    xs = _sweep(rng(39))
    want = np.array([c_sigmoid(v) for v in xs], np.float32)
    got = xs.copy().reshape(1, -1)
    K.sigmoid(got)
    assert_bitwise("sigmoid vs 1/(1+libm expf(-x))", got[0], want)
    with np.errstate(over="ignore"):
        npy = F1 / (F1 + np.exp(-xs))                      # NumPy's float32 exp
        recip = (F1 / (F1 + np.exp(-xs.astype(np.float64)))).astype(np.float32)
    print(f"[gate]   witness: NumPy float32 exp differs in {n_diff(npy, want)}, "
          f"float64-then-round in {n_diff(recip, want)} of {xs.size} values")


def test_situ_glu_uses_libm_tanhf_expf():
    """Traps #39 and #28: SiTU-GLU against a ctypes-libm reference bitwise:
    a = f32(f32(b1 * tanhf(g / b1)) * sigma(g)) (sigma of the UNCAPPED gate, true division),
    c = f32(b2 * tanhf(u / b2)), y = f32(a * c)."""
    r = rng(28)
    n = 12000
    mag = 2.0 ** r.uniform(-10, 11, (2, n))       # log-uniform 1e-3 .. 2e3
    G, U = (mag * r.choice([-1.0, 1.0], (2, n))).astype(np.float32)
    G[:96], U[:96] = np.repeat([0.1, 1, 4, 25, 100, 1000], 16), np.tile([-1000, 1000], 48)
    b1, b2 = np.float32(4.0), np.float32(25.0)
    want = np.empty(n, np.float32)
    for i in range(n):
        a = b1 * c_tanhf(G[i] / b1)
        a = a * c_sigmoid(G[i])
        c = b2 * c_tanhf(U[i] / b2)
        want[i] = a * c
    got = np.empty((1, n), np.float32)
    K.situ_glu(G[None].copy(), U[None].copy(), b1, b2, got)
    assert_bitwise("situ_glu vs libm tanhf/expf reference", got[0], want)
    assert np.max(np.abs(got)) <= b1 * b2 + 0.01
    capped = np.array([(b1 * c_tanhf(g / b1)) * c_sigmoid(b1 * c_tanhf(g / b1)) *
                       (b2 * c_tanhf(u / b2)) for g, u in zip(G[:2000], U[:2000])], np.float32)
    with np.errstate(over="ignore"):
        npy = ((b1 * np.tanh(G / b1)) * (F1 / (F1 + np.exp(-G)))) * (b2 * np.tanh(U / b2))
    print(f"[gate]   witness: sigma of the CAPPED gate differs in {n_diff(capped, want[:2000])}/2000; "
          f"NumPy float32 tanh/exp differs in {n_diff(npy, want)}/{n}")
    assert n_diff(capped, want[:2000]) > 0


# glibc releases whose expf/tanhf benchmarks/check_libm_replica.c compared with k3math.h's
# replicas over all 2^32 floats (0 differences, AVX2 and AVX-512); on these, a CPU with the
# path must use them.
LIBM_REPLICA_VERIFIED = {"2.36"}


@pytest.mark.parametrize("path", ["avx2", "avx512"])
def test_libm_replicas_equal_libm_bitwise(path):
    """k3math.h's expf/tanhf (SiTU's) on one SIMD path against the linked libm, bitwise, on
    every 1021st float bit pattern (4.2 M: every sign, exponent and NaN class) plus the
    values that reach each expm1f branch, and the two expf arguments only glibc's fused
    form gets right.  The replicas must be active on a verified glibc: the load-time check
    silently falls back to libm, so a broken replica would otherwise show only as lost
    speed."""
    if path not in K.isas_available():
        pytest.skip(f"NOT RUN: this CPU has no {path} (its replicas cannot run here)")
    libc, ver = platform.libc_ver()
    with isa(path):
        if not K.libm_replicas_active():
            assert not (libc == "glibc" and ver in LIBM_REPLICA_VERIFIED), \
                f"the {path} replicas failed the load-time check on glibc {ver}, which was verified"
            pytest.skip(f"NOT RUN: the {path} replicas differ from this libm ({libc} {ver}) at "
                        f"load, so SiTU calls libm (exact by construction)")
        pats = np.arange(0, 1 << 32, 1021, dtype=np.uint64).astype(np.uint32)
        edges = np.concatenate([np.linspace(-30, 30, 200_001), np.ldexp(1.0, np.arange(-60, 8)),
                                -np.ldexp(1.0, np.arange(-60, 8)),
                                [float.fromhex('0x1.04845ep+5'), float.fromhex('-0x1.f8cbb2p+5'),
                                 0.5 * np.log(2), 1.5 * np.log(2), 22.0, 88.0, -88.0, 88.72]])
        x = np.concatenate([pats.view(np.float32), edges.astype(np.float32)])
        x = np.concatenate([x, np.zeros(-x.size % 16, np.float32)])   # whole vectors only
        t_rep, e_rep, t_lib, e_lib = (np.empty_like(x) for _ in range(4))
        assert K.tanh_exp(x, t_rep, e_rep, True), "the replicas did not run"
        assert not K.tanh_exp(x, t_lib, e_lib, False)
    assert_bitwise(f"{path} tanhf replica vs libm", t_rep, t_lib)
    assert_bitwise(f"{path} expf replica vs libm", e_rep, e_lib)


@pytest.mark.parametrize("nthreads", [1, 2])
def test_situ_glu_replicas_equal_libm_path(nthreads):
    """situ_glu (and through it the MoE's hidden rows) on each SIMD path's replicas equals
    the per-element libm path (set_isa('scalar')) bitwise on 1 M values over 2^-20 .. 2^20
    with both signs, zeros, infinities and a ragged tail (not a multiple of 16 or 8)."""
    r = rng(2836)
    n = (1 << 20) + 13
    mag = 2.0 ** r.uniform(-20, 20, (2, n))
    G, U = (mag * r.choice([-1.0, 1.0], (2, n))).astype(np.float32)
    G[:6] = U[-6:] = [0.0, -0.0, np.inf, -np.inf, 1e-30, -1e-30]
    G, U = G.reshape(1, n), U.reshape(1, n)
    fast, ref = np.empty_like(G), np.empty_like(G)
    with threads(nthreads):
        with isa("scalar"):
            K.situ_glu(G, U, np.float32(4.0), np.float32(25.0), ref)
        for name in simd_isas():
            with isa(name):
                K.situ_glu(G, U, np.float32(4.0), np.float32(25.0), fast)
                print(f"[gate]   replicas active: {K.libm_replicas_active()} (ISA {name})")
            assert_bitwise(f"situ_glu {name} vs scalar libm, {nthreads} thread(s)", fast, ref)


# ---- 6. batch independence -------------------------------------------------------------------

def test_batch_of_seven_equals_seven_single_tokens():
    """Trap #45 (per-token arithmetic independent of the batch size T): matvec (f32, bf16)
    and MXFP4 matvec of T=7 rows equal seven calls with T=1, bitwise, at 2 threads."""
    r = rng(45)
    n = 1029
    W, Wb = rand_f32(r, (300, n)), random_bf16(r, (300, n))
    X = rand_f32(r, (7, n))
    P = r.integers(0, 256, (300, 512), dtype=np.uint16).astype(np.uint8)
    S = r.integers(118, 125, (300, 32), dtype=np.uint16).astype(np.uint8)
    X4 = rand_f32(r, (7, 1024))
    with threads(2):
        for name, f, XX in (("f32", lambda x: mv(W, x), X), ("bf16", lambda x: mv(Wb, x), X),
                            ("mxfp4", lambda x: mv4(P, S, x), X4)):
            batch = f(XX)
            single = np.concatenate([f(XX[t:t + 1]) for t in range(7)])
            assert_bitwise(f"{name} matvec T=7 vs 7 x T=1", batch, single)


# ---- 7. router -------------------------------------------------------------------------------

def ref_route(s, bias, k, renorm, scale):
    """§4.7.1 selection and weights.  Selection: repeatedly the lowest index with the strictly
    greatest f32(s + bias) among those not taken; weights from the UNBIASED s."""
    sel = (s + bias).astype(np.float32)
    taken, idx = np.zeros(len(s), bool), []
    for _ in range(k):
        best = -1
        for e in range(len(s)):
            if not taken[e] and (best < 0 or sel[e] > sel[best]):
                best = e
        taken[best] = True
        idx.append(best)
    w = s[idx].astype(np.float32)
    if renorm and k > 1:
        tot = 0.0
        for j in range(k):
            tot += float(w[j])
        inv = np.float32(1.0 / (tot + 1e-20))
        w = w * inv
    return np.array(idx, np.int32), (w * np.float32(scale)).astype(np.float32)


def route(s, bias, k, renorm=True, scale=1.0):
    idx, w = np.empty(k, np.int32), np.empty(k, np.float32)
    K.route_scores(np.asarray(s, np.float32), np.asarray(bias, np.float32), k, renorm,
                   np.float32(scale), idx, w)
    return idx, w


def test_router_ties_lowest_index_and_descending_order():
    """Trap #41 (ties -> lowest index; selection order = descending biased score, which fixes
    the MoE accumulation order)."""
    idx, _ = route([0.3, 0.6, 0.6, 0.2, 0.6, 0.1, 0.6, 0.5], np.zeros(8), 3)
    print(f"[gate] router plain ties: idx {idx.tolist()} (want [1, 2, 4])")
    assert idx.tolist() == [1, 2, 4]
    # ties created by the bias only: s + bias == 0.75 exactly at 5, 2, 6
    s = np.array([0.5, 0.25, 0.5, 0.125, 0.0625, 0.25, 0.625, 0.9375], np.float32)
    b = np.array([0.0, 0.0, 0.25, 0.0, 0.0, 0.5, 0.125, -0.5], np.float32)
    idx, w = route(s, b, 3)
    print(f"[gate] router bias-made ties: idx {idx.tolist()} (want [2, 5, 6])")
    assert idx.tolist() == [2, 5, 6]
    wi, ww = ref_route(s, b, 3, True, 1.0)
    assert_bitwise("router bias-made ties weights", w, ww)
    r = rng(41)
    for trial in range(200):
        N = int(r.integers(8, 97))
        k = int(r.integers(2, min(N, 16) + 1))
        s = r.uniform(0, 1, N).astype(np.float32)
        s[r.integers(0, N, N // 4)] = s[0]              # plenty of exact ties
        bias = np.linspace(-0.15, 0.15, N).astype(np.float32) * (trial % 2)
        idx, w = route(s, bias, k, True, 2.5)
        ridx, rw = ref_route(s, bias, k, True, 2.5)
        sel = (s + bias).astype(np.float32)
        assert idx.tolist() == ridx.tolist(), f"trial {trial}: {idx} vs {ridx}"
        assert idx.tolist() == np.argsort(-sel, kind="stable")[:k].tolist()
        assert n_diff(w, rw) == 0, f"trial {trial}: weights {w} vs {rw}"
    print("[gate] router: 200 random trials with ties: order == stable descending sort, "
          "weights bitwise equal to the reference")


def test_router_k1_does_not_renormalise():
    """Trap #42 (renormalise only when k > 1, as SF): with k = 1 and renorm on, the weight is
    f32(s * scale), not 1.0 * scale."""
    s = np.array([0.2, 0.7, 0.4], np.float32)
    idx, w = route(s, np.zeros(3), 1, True, 2.5)
    print(f"[gate] router k=1 renorm on: idx {idx.tolist()}, weight {w[0]!r} "
          f"(want {np.float32(0.7) * np.float32(2.5)!r}, not 2.5)")
    assert idx.tolist() == [1] and bits(w[0]) == bits(np.float32(0.7) * np.float32(2.5))
    _, w2 = route(s, np.zeros(3), 2, True, 1.0)
    _, rw2 = ref_route(s, np.zeros(3), 2, True, 1.0)
    assert_bitwise("router k=2 renormalised weights", w2, rw2)


def test_router_weights_from_unbiased_scores():
    """Trap #24 (routing bias only selects; weights are the unbiased sigmoids, renormalised and
    scaled): the bias flips the selection, the weights still come from s."""
    s = np.array([0.60, 0.55, 0.50, 0.45], np.float32)
    b = np.array([0.00, 0.00, 0.20, 0.18], np.float32)
    idx, w = route(s, b, 2, True, 1.0)
    ridx, rw = ref_route(s, b, 2, True, 1.0)
    biased = (s + b).astype(np.float32)[idx]
    wrong = (biased * np.float32(1.0 / (float(biased[0]) + float(biased[1]) + 1e-20)))
    print(f"[gate] router bias flips selection: idx {idx.tolist()} (unbiased top-2 would be "
          f"[0, 1]); weights {w.tolist()} vs biased-score weights {wrong.tolist()}")
    assert idx.tolist() == [2, 3] == ridx.tolist()
    assert_bitwise("router weights from unbiased scores", w, rw)
    assert n_diff(w, wrong) == 2


def test_router_logits_sequential_double():
    """Trap #38 (router logits: ONE sequential double accumulator, i ascending, not the
    16-lane matvec): K.router scores equal sigma(f32(sequential double sum)) bitwise for f32
    and bf16 gates, on cancelling data where the 16-lane order would change the scores."""
    r = rng(380)
    N, E = 64, 704
    W, x = cancelling_matvec(r, N, E)
    x = np.ascontiguousarray(x)
    want = np.array([c_sigmoid(v) for v in ref_matvec_seq(W, x)], np.float32)
    idx, w = np.empty(4, np.int32), np.empty(4, np.float32)
    got = K.router(W, x, np.zeros(N, np.float32), 4, True, 1.0, idx, w)
    assert_bitwise("router scores (f32 gate, cancelling) vs sequential-double ref", got, want)
    lane16 = np.array([c_sigmoid(v) for v in ref_matvec(W, x)], np.float32)
    print(f"[gate]   witness: 16-lane logits would change {n_diff(lane16, want)}/{N} scores")
    assert n_diff(lane16, want) > 0
    Wb = (W.view(np.uint32) >> 16).astype(np.uint16)          # W is BF16-exact
    got_b = K.router(Wb, x, np.zeros(N, np.float32), 4, True, 1.0, idx, w)
    assert_bitwise("router scores (bf16 gate) vs sequential-double ref", got_b, want)
    ridx, rw = ref_route(want, np.zeros(N, np.float32), 4, True, 1.0)
    assert idx.tolist() == ridx.tolist() and n_diff(w, rw) == 0


def test_router_lanes_keep_each_experts_chain_on_every_path():
    """k3route.h runs blocks of 8 experts (one AVX-512 vector, two AVX2 ones), one
    sequential chain per lane, a block at a time, with the experts and inputs past the full
    blocks finished by the scalar chain: on every path, for expert counts and widths that leave every kind of remainder
    (and bf16 gates), the scores equal sigma(f32(sequential double sum)) bitwise."""
    r = rng(381)
    shapes = ((64, 704), (37, 33), (8, 8), (9, 7), (7, 16), (100, 64), (33, 129), (1, 9))
    for name in K.isas_available():
        with isa(name):
            for N, E in shapes:
                W, x = cancelling_matvec(r, N, E)
                x = np.ascontiguousarray(x)
                for gate in (W, (W.view(np.uint32) >> 16).astype(np.uint16)):
                    Wf = gate if gate.dtype == np.float32 else \
                        (gate.astype(np.uint32) << 16).view(np.float32)
                    want = np.array([c_sigmoid(v) for v in ref_matvec_seq(Wf, x)], np.float32)
                    k = min(4, N)
                    idx, w = np.empty(k, np.int32), np.empty(k, np.float32)
                    got = K.router(gate, x, np.zeros(N, np.float32), k, True, 1.0, idx, w)
                    assert n_diff(got, want) == 0, (name, N, E, gate.dtype)
    print(f"[gate] router scores on {', '.join(K.isas_available())}: {len(shapes)} shapes x "
          f"f32/bf16 gates equal the sequential-double reference bitwise")


def test_router_one_token_split_over_threads_keeps_each_chain():
    """One token's logits are split between threads in items of 32 experts (k3route.h's
    ranges; each expert's chain whole in one item): at 1 and 2 threads, through K.router
    and route_tokens, with expert counts that leave a partial item and a partial block of
    8, the scores equal the sequential-double reference bitwise and the top-k is the
    reference's."""
    r = rng(382)
    E = 4104                                   # 4 * N * E > the parallel threshold
    for N in (101, 72, 65):
        assert 4 * N * E >= PAR_MIN_WORK
        W, x = cancelling_matvec(r, N, E)
        x = np.ascontiguousarray(x)
        want = np.array([c_sigmoid(v) for v in ref_matvec_seq(W, x)], np.float32)
        ridx, rw = ref_route(want, np.zeros(N, np.float32), 6, True, 1.0)
        for name in K.isas_available():
            for nt in (1, 2):
                with isa(name), threads(nt):
                    for gate in (W, (W.view(np.uint32) >> 16).astype(np.uint16)):
                        idx, w = np.empty(6, np.int32), np.empty(6, np.float32)
                        got = K.router(gate, x, np.zeros(N, np.float32), 6, True, 1.0, idx, w)
                        assert_bitwise(f"router N={N} {name} {nt}t {gate.dtype}", got, want)
                        I, Wt = np.empty((1, 6), np.int32), np.empty((1, 6), np.float32)
                        K.route_tokens(gate, x[None, :], np.zeros(N, np.float32), 6, True,
                                       1.0, I, Wt)
                        assert I[0].tolist() == idx.tolist() == ridx.tolist()
                        assert n_diff(Wt[0], rw) == 0 and n_diff(w, rw) == 0
    print(f"[gate] router, one token over 1 and 2 threads: N = 101, 72, 65 x {E} inputs on "
          f"{', '.join(K.isas_available())}, f32/bf16 gates: scores and top-6 equal the "
          f"sequential-double reference (pool items taken by workers so far: "
          f"{K.pool_stats()[1]})")


# ---- 8. KDA decay ---------------------------------------------------------------------------

def ref_kda_decay(Z, A_log, dt_bias, g_min, a_index):
    """§4.4 decay with libm expf; a_index(c) says which A_log entry channel c uses."""
    T, P = Z.shape
    G, Al = np.empty((T, P), np.float32), np.empty((T, P), np.float32)
    gm = np.float32(g_min)
    for c in range(P):
        e = c_expf(A_log[a_index(c)])
        for t in range(T):
            u = e * (Z[t, c] + dt_bias[c])
            G[t, c] = gm * c_sigmoid(u)
            Al[t, c] = c_expf(G[t, c])
    return G, Al


def kernel_decay(Z, A_log, dt_bias, g_min=-5.0):
    G, Al = np.empty_like(Z), np.empty_like(Z)
    K.kda_decay(Z, A_log, dt_bias, np.float32(g_min), G, Al)
    return G, Al


def test_kda_decay_saturates_to_exactly_one():
    """Trap #8 (alpha = 1.0 exactly is legal saturation when sigma(u) underflows): very
    negative u gives alpha == 1.0 and finite g <= 0, no NaN."""
    H, D = 2, 8
    Z = np.array([[-1e4] * 8 + [-200.0] * 4 + [-90.0, -40.0, -20.0, -17.0]], np.float32)
    A_log = np.array([0.0, 0.5], np.float32)
    G, Al = kernel_decay(Z, A_log, np.zeros(H * D, np.float32))
    print(f"[gate] kda_decay very negative u: alpha {sorted(set(Al[0].tolist()))}, "
          f"g range [{G.min()!r}, {G.max()!r}]")
    assert np.all(Al == np.float32(1.0)) and np.all(np.isfinite(G)) and np.all(G <= 0)
    Gr, Ar = ref_kda_decay(Z, A_log, np.zeros(H * D, np.float32), -5.0, lambda c: c // D)
    assert_bitwise("kda_decay saturated g vs libm ref", G, Gr)
    assert_bitwise("kda_decay saturated alpha vs libm ref", Al, Ar)


def test_kda_decay_A_log_indexed_per_head():
    """Trap #5 (A_log per HEAD: exp(A_log[h]) scales all D channels of head h; dt_bias per
    channel, added before scaling, #7): bitwise against a libm reference; a per-channel index
    (A_log[c mod H]) or the checkpoint's D-long padded vector indexed by d would differ."""
    r = rng(5)
    H, D, T = 4, 16, 3
    A_log = np.linspace(-0.4, 1.2, H).astype(np.float32)
    Z = rand_f32(r, (T, H * D))
    dt = rand_f32(r, H * D, 0.5)
    G, Al = kernel_decay(Z, A_log, dt)
    Gr, Ar = ref_kda_decay(Z, A_log, dt, -5.0, lambda c: c // D)
    assert_bitwise("kda_decay g vs per-head libm ref", G, Gr)
    assert_bitwise("kda_decay alpha vs per-head libm ref", Al, Ar)
    Gw, _ = ref_kda_decay(Z, A_log, dt, -5.0, lambda c: c % H)
    padded = np.concatenate([A_log, np.zeros(D - H, np.float32)])
    Gp, _ = ref_kda_decay(Z, padded, dt, -5.0, lambda c: c % D)
    print(f"[gate]   witness: A_log[c mod H] differs in {n_diff(Gw, G)}/{G.size} g values; "
          f"padded A_log[d] in {n_diff(Gp, G)}/{G.size}")
    assert n_diff(Gw, G) > G.size // 2 and n_diff(Gp, G) > G.size // 2


# ---- 9. RMSNorm gains ------------------------------------------------------------------------

def test_rmsnorm_gain_applied_gain_first():
    """Trap #16 (every norm gain applied; SF order y = f32(f32(w*x)*r)): random gains, bitwise
    against the reference; the REF order w*(x*r) and a gain-less norm are shown to differ."""
    r = rng(16)
    for n in (128, 7168, 133):
        X = rand_f32(r, (5, n), 3.0)
        w = (1.0 + rand_f32(r, n, 0.3)).astype(np.float32)
        eps = np.float32(1e-5)
        Y = np.empty_like(X)
        K.rmsnorm(X, w, eps, Y)
        want = ref_rmsnorm(X, w, eps)
        assert_bitwise(f"rmsnorm {5}x{n} random gains vs gain-first ref", Y, want)
        other = ref_rmsnorm(X, w, eps, gain_first=False)
        nogain = ref_rmsnorm(X, np.ones(n, np.float32), eps)
        print(f"[gate]   witness: REF order w*(x*r) differs in {n_diff(other, want)}/{Y.size}, "
              f"gain ignored in {n_diff(nogain, want)}/{Y.size}")
        assert n_diff(other, want) > 0 and n_diff(nogain, want) > Y.size // 2
    Yi = X.copy()
    K.rmsnorm(Yi, w, eps, Yi)                              # documented in-place use
    assert_bitwise("rmsnorm in place", Yi, want)


# ---- 10. no FMA in float32 chains ------------------------------------------------------------

@pytest.mark.parametrize("T,H,D", [(8, 4, 16), (4, 8, 32), (3, 2, 128), (5, 3, 17), (3, 2, 33)])
def test_kda_recurrence_no_fma_bitwise(T, H, D):
    """Trap #40 (no FMA contraction in float32 chains) and #14 (decay -> read -> write ->
    output from the updated S): K.kda_recurrence equals a NumPy float32 step-by-step
    reference (each product rounded before the add) bitwise; an FMA-contracted variant
    differs."""
    r = rng(40 + D)
    S0, Q, Kk, V, A, B = random_kda_inputs(r, T, H, D)
    qs = K.kda_q_scale(D)
    assert bits(qs) == bits(F1 / np.sqrt(np.float32(D)))
    S, O = S0.copy(), np.empty((T, H * D), np.float32)
    K.kda_recurrence(S, Q, Kk, V, A, B, qs, O)
    Sr, Or = ref_kda_recurrence(S0, Q, Kk, V, A, B, qs)
    assert_bitwise(f"kda_recurrence out T={T} H={H} D={D}", O, Or)
    assert_bitwise(f"kda_recurrence state T={T} H={H} D={D}", S, Sr)
    # odd D matters: GCC vectorises these dot products in pairs (product, then ordered adds)
    # and only the odd trailing element would be fused if contraction were on (-march=native)
    Sf, Of = ref_kda_recurrence_fma(S0, Q, Kk, V, A, B, qs)
    print(f"[gate]   witness: FMA-contracted dot products differ in {n_diff(Of, Or)}/{O.size} "
          f"outputs, {n_diff(Sf, Sr)}/{S.size} state values")
    assert n_diff(Of, Or) > 0


def ref_shortconv(X, w, hist):
    """§4.4 ShortConv + SiLU, float32: acc = w[K-1]*x_t, then + w[j]*hist[j] oldest -> newest,
    each product rounded; history keeps the raw input; silu(acc) = acc * sigma(acc) (libm)."""
    T, C = X.shape
    Kt = w.shape[1]
    hist = hist.copy()
    Y = np.empty_like(X)
    for t in range(T):
        acc = w[:, Kt - 1] * X[t]
        for j in range(Kt - 1):
            acc = acc + w[:, j] * hist[:, j]
        hist = np.concatenate([hist[:, 1:], X[t][:, None]], axis=1)
        Y[t] = acc * np.array([c_sigmoid(a) for a in acc], np.float32)
    return Y, hist


def ref_attnres(V, phi, eps):
    """§4.8 for one token: V [n_sources, E] (snapshots oldest -> newest, running sum last)."""
    n, E = V.shape
    Vd = V.astype(np.float64)
    q = np.zeros(n)
    for i in range(E):
        q = q + Vd[:, i] * Vd[:, i]
    r = (1.0 / np.sqrt(q / E + float(np.float32(eps)))).astype(np.float32)
    vr = (V * r[:, None]).astype(np.float64)                  # f32(v * r), then widened
    dot = np.zeros(n)
    for i in range(E):
        dot = dot + vr[:, i] * float(phi[i])
    sc = dot.astype(np.float32)
    mx = sc[0]
    for s in range(1, n):
        if sc[s] > mx:
            mx = sc[s]
    e = [c_expf(sc[s] - mx) for s in range(n)]
    Z = 0.0
    for s in range(n):
        Z += float(e[s])
    p = [np.float32(float(e[s]) / Z) for s in range(n)]
    out = np.zeros(E, np.float32)
    for s in range(n):
        out = out + p[s] * V[s]
    return out


def mla_rows(Q, KV, R, n_past, H, dn, dv, O):
    """K.mla_attention over the spec's cache rows KV [n, H*(dn+dv)], laid out as the state
    holds them (key blocks and value planes, state.MLAState)."""
    st = MLAState.zeros(H, dn, dv, R.shape[1], KV.shape[0])
    st.set_rows(0, KV)
    st.set_rope(0, R)
    K.mla_attention(Q, st.k, st.v, st.rope, n_past, O)


def ref_mla(Q, KV, R, n_past, H, dn, dv):
    """§4.5 attention over the cache: one double accumulator (nope then rope terms),
    sc = f32(f32(d) * kappa), kappa = f32(1/sqrtf(dn+dr)); libm softmax with a double
    normaliser; value sum in float32, positions ascending from 0."""
    T, dr = Q.shape[0], R.shape[1]
    dq, dkv = dn + dr, dn + dv
    kappa = F1 / np.sqrt(np.float32(dq))
    O = np.empty((T, H * dv), np.float32)
    for t in range(T):
        p = n_past + t
        for h in range(H):
            q = Q[t, h * dq:(h + 1) * dq].astype(np.float64)
            keys = KV[:p + 1, h * dkv:h * dkv + dn].astype(np.float64)
            rope = R[:p + 1].astype(np.float64)
            d = np.zeros(p + 1)
            for i in range(dn):
                d = d + q[i] * keys[:, i]
            for i in range(dr):
                d = d + q[dn + i] * rope[:, i]
            sc = d.astype(np.float32) * kappa
            mx = np.max(sc)
            e = [c_expf(sc[s] - mx) for s in range(p + 1)]
            Z = 0.0
            for s in range(p + 1):
                Z += float(e[s])
            o = np.zeros(dv, np.float32)
            for s in range(p + 1):
                o = o + np.float32(float(e[s]) / Z) * KV[s, h * dkv + dn:(h + 1) * dkv]
            O[t, h * dv:(h + 1) * dv] = o
    return O


def test_float32_chains_shortconv_axpy_bitwise():
    """Trap #40 (no FMA in float32 chains) and #11 (ShortConv: current tap first, history
    oldest -> newest, raw history carried): K.shortconv and K.axpy against float32 references
    with every product rounded before the add, bitwise; the carried history is compared too."""
    r = rng(400)
    T, C, Kt = 6, 67, 4
    X, w = rand_f32(r, (T, C), 2.0), rand_f32(r, (C, Kt), 0.6)
    hist0 = rand_f32(r, (C, Kt - 1), 2.0)
    hist, Y = hist0.copy(), np.empty_like(X)
    K.shortconv(X, w, hist, Y)
    Yr, hr = ref_shortconv(X, w, hist0)
    assert_bitwise("shortconv out (T=6, C=67, K=4, carried history)", Y, Yr)
    assert_bitwise("shortconv history after", hist, hr)
    for T, C, Kt in ((1, 67, 4), (2, 67, 4), (3, 19, 4), (5, 33, 2)):   # T < K-1 included
        X, w = rand_f32(r, (T, C), 2.0), rand_f32(r, (C, Kt), 0.6)
        hist0 = rand_f32(r, (C, Kt - 1), 2.0)
        hist, Y = hist0.copy(), np.empty_like(X)
        K.shortconv(X, w, hist, Y)
        Yr, hr = ref_shortconv(X, w, hist0)
        assert n_diff(Y, Yr) == 0 and n_diff(hist, hr) == 0, f"shortconv T={T} K={Kt}"
    # above the parallel threshold: 1 and 2 threads, and the same rows fed in pieces
    # (1, 2, 3, ... positions per call, history carried) as incremental decode does
    T, C, Kt = 700, 513, 4
    assert T * C * Kt >= PAR_MIN_WORK
    X, w = rand_f32(r, (T, C), 2.0), rand_f32(r, (C, Kt), 0.6)
    hist0 = rand_f32(r, (C, Kt - 1), 2.0)
    outs = []
    for nt in (1, 2):
        with threads(nt):
            hist, Y = hist0.copy(), np.empty_like(X)
            K.shortconv(X, w, hist, Y)
            outs.append((Y, hist))
    assert n_diff(outs[0][0], outs[1][0]) == 0 and n_diff(outs[0][1], outs[1][1]) == 0
    hist, pieces, t, k = hist0.copy(), [], 0, 1
    while t < T:
        Yp = np.empty((min(k, T - t), C), np.float32)
        K.shortconv(np.ascontiguousarray(X[t:t + k]), w, hist, Yp)
        pieces.append(Yp)
        t, k = t + k, k + 1
    assert_bitwise(f"shortconv T={T} C={C} whole (1 == 2 threads) vs fed in pieces",
                   outs[0][0], np.concatenate(pieces))
    assert n_diff(outs[0][1], hist) == 0
    acc, d = rand_f32(r, 1031), rand_f32(r, 1031)
    wj = np.float32(0.3711)
    want = acc + wj * d                                   # two float32 roundings
    got = acc.copy()
    K.axpy(got, wj, d)
    assert_bitwise("axpy acc + f32(w*d) (MoE aggregate)", got, want)
    fused = (acc.astype(np.float64) + np.float64(wj) * d.astype(np.float64)).astype(np.float32)
    print(f"[gate]   witness: a fused w*d+acc differs in {n_diff(fused, want)}/{want.size}")
    assert n_diff(fused, want) > 0


def test_attnres_and_mla_exact_order():
    """Traps #38/#40 for the two attention-like kernels (double scores and normalisers,
    float32 value sums, libm expf), #30 (AttnRes values are the raw sources) and #18/#21
    (MLA scale 1/sqrt(dn+dr), causal): bitwise against the references, odd widths."""
    r = rng(318)
    n_snap, T, E = 4, 3, 133
    stack = rand_f32(r, (n_snap, T, E), 2.0)
    run = rand_f32(r, (T, E), 3.0)
    phi = rand_f32(r, E, 0.2)
    out = np.empty((T, E), np.float32)
    K.attnres(stack, n_snap, run, phi, np.float32(1e-5), out)
    want = np.stack([ref_attnres(np.concatenate([stack[:, t], run[t][None]]), phi, 1e-5)
                     for t in range(T)])
    assert_bitwise(f"attnres {n_snap}+1 sources, T={T}, E={E}", out, want)
    # 1..9 sources (the keys run four sources' chains side by side, then the rest one by
    # one; K3 aggregates up to 9) and a T above the parallel threshold at 1 and 2 threads
    T, E = 700, 513
    assert T * E * 3 >= PAR_MIN_WORK
    for n_snap in range(9):
        stack = rand_f32(r, (max(n_snap, 1), T, E), 2.0)
        run = rand_f32(r, (T, E), 3.0)
        outs = []
        for nt in (1, 2):
            with threads(nt):
                outs.append(np.empty((T, E), np.float32))
                K.attnres(stack, n_snap, run, np.resize(phi, E), np.float32(1e-5), outs[-1])
        assert n_diff(outs[0], outs[1]) == 0, f"attnres {n_snap}+1 sources: 1 vs 2 threads"
        ph = np.resize(phi, E)
        for t in (0, 351, T - 1):
            want = ref_attnres(np.concatenate([stack[:n_snap, t], run[t][None]]), ph, 1e-5)
            assert n_diff(outs[0][t], want) == 0, f"attnres {n_snap}+1 sources, token {t}"
    print(f"[gate] attnres 1..9 sources, T={T}, E={E}: 1 == 2 threads, tokens 0/351/{T - 1} "
          f"== ref, bitwise")
    H, dn, dr, dv, Tm, past = 3, 23, 7, 13, 5, 4
    Q = rand_f32(r, (Tm, H * (dn + dr)), 0.5)
    KV = rand_f32(r, (past + Tm + 2, H * (dn + dv)))
    R = rand_f32(r, (past + Tm + 2, dr))
    O = np.empty((Tm, H * dv), np.float32)
    mla_rows(Q, KV, R, past, H, dn, dv, O)
    assert_bitwise(f"mla_attention T={Tm} past={past} H={H} dn={dn} dr={dr} dv={dv}", O,
                   ref_mla(Q, KV, R, past, H, dn, dv))


def test_mla_prefill_equals_per_position_and_ref():
    """Trap #45 for MLA (the restructured loops: scores four positions at a time, the value
    sum row by row into dv accumulators; on AVX-512, blocks of 8 tokens per head with the
    tokens in the double lanes): a 13-token prefill (a full block and a ragged one) over a
    6-position past equals 13 one-token calls and the exact-order reference bitwise on
    every path, so every score-tail length 0..3 and a dv tail of 3 occur (this shape stays
    below the parallel threshold; test_results_independent_of_thread_count splits one).  Witness: summing values in descending position order
    (what a careless reordering would do) changes bits on the same data."""
    r = rng(21)
    H, dn, dr, dv, Tm, past = 2, 37, 9, 19, 13, 6
    Q = rand_f32(r, (Tm, H * (dn + dr)), 0.7)
    KV = rand_f32(r, (past + Tm, H * (dn + dv)))
    R = rand_f32(r, (past + Tm, dr))
    want = ref_mla(Q, KV, R, past, H, dn, dv)
    check_mla_every_path("mla prefill", Q, KV, R, past, H, dn, dv, want)
    wrong = np.empty((1, H * dv), np.float32)
    p = past + Tm - 1
    sc = ref_mla_weights(Q[-1], KV, R, p, H, dn, dr)
    o = np.zeros(dv, np.float32)
    for s in range(p, -1, -1):
        o = o + sc[0][s] * KV[s, dn:dn + dv]
    wrong[0, :dv] = o
    print(f"[gate]   witness: descending value order differs in "
          f"{n_diff(wrong[0, :dv], want[-1, :dv])}/{dv} outputs of head 0")
    assert n_diff(wrong[0, :dv], want[-1, :dv]) > 0


def test_mla_prefill_with_zero_denormal_and_tiny_weights():
    """A real model's softmax gives many weights that are exactly 0 or denormal (a
    1,024-position prefill of the mid checkpoint: 62 % and 10 %), which random test data
    never reaches; any shortcut in the value sum (skipping zero weights, working around
    the denormal assists) must keep the float32 sums' bits.  Peaked scores (the query
    scaled up: gaps of ~70-110 nats) over 151 positions put weights at 0, in the denormal
    range and just above it; values carry tiny, denormal, zero, infinite and NaN entries
    (0 * inf is NaN, so a zero weight cannot simply be skipped).  Every path equals the
    one-token calls, and the exact-order reference, bitwise; the weight classes print."""
    r = rng(1126)
    H, dn, dr, dv, Tm, past = 2, 16, 8, 35, 21, 130
    Q = rand_f32(r, (Tm, H * (dn + dr)), 30.0)
    KV = rand_f32(r, (past + Tm, H * (dn + dv)))
    KV[:, dn:dn + dv] *= np.float32(2.0) ** r.integers(-40, 8, (past + Tm, dv)).astype(np.float32)
    KV[3, dn + 1], KV[5, dn + 2], KV[7, dn + 4] = 1e-41, -3e-39, 0.0
    KV[9, dn + 5], KV[11, dn + 6] = np.inf, np.nan              # head 0 only
    R = rand_f32(r, (past + Tm, dr), 3.0)
    w = np.concatenate([ref_mla_weights(Q[t], KV, R, past + t, H, dn, dr)[0] for t in range(Tm)])
    tiny = np.finfo(np.float32).tiny
    print(f"[gate]   head-0 weights: {np.mean(w == 0):.0%} zero, "
          f"{np.mean((w > 0) & (w < tiny)):.0%} denormal, "
          f"{np.mean((w >= tiny) & (w < 2.0 ** -100)):.0%} in [2^-126, 2^-100)")
    assert np.any(w == 0) and np.any((w > 0) & (w < tiny)) and np.any((w >= tiny) & (w < 2.0 ** -100))
    with np.errstate(invalid="ignore"):                         # 0 * inf, on purpose
        want = ref_mla(Q, KV, R, past, H, dn, dv)
    check_mla_every_path("mla tiny weights", Q, KV, R, past, H, dn, dv, want)


def test_mla_one_token_over_a_long_context():
    """A decode step's token (AVX-512: k3mla.h's one-token path, positions in the double
    lanes 32 at a time, expf on the checked replica, the value sum row by row in chunks of
    128 channels) equals the exact-order reference and the same token inside a block,
    bitwise: contexts that end inside and on the 8- and 32-position blocks, dims with and
    without 8-wide tails, more than 128 value channels (a second, ragged chunk)."""
    r = rng(4096)
    for H, dn, dr, dv, past, Tm in ((2, 37, 9, 150, 75, 9), (1, 32, 16, 32, 55, 10),
                                    (3, 8, 8, 16, 0, 33)):
        Q = rand_f32(r, (Tm, H * (dn + dr)), 0.6)
        KV = rand_f32(r, (past + Tm, H * (dn + dv)))
        R = rand_f32(r, (past + Tm, dr))
        want = ref_mla(Q, KV, R, past, H, dn, dv)
        check_mla_every_path(f"mla one token H={H} dn={dn} dr={dr} dv={dv} past={past}", Q,
                             KV, R, past, H, dn, dv, want)


def test_mla_prefill_over_several_items():
    """A prompt longer than one work item of the AVX-512 path (8 blocks of 8 tokens per
    item, sharing each cache row's reads): tokens in the first, a full middle and a ragged
    last item (133 = 64 + 64 + 5, over a 5-position past) equal one-token calls and the
    exact-order reference bitwise on every path, odd widths."""
    r = rng(133)
    H, dn, dr, dv, Tm, past = 2, 19, 5, 21, 133, 5
    Q = rand_f32(r, (Tm, H * (dn + dr)), 0.6)
    KV = rand_f32(r, (past + Tm, H * (dn + dv)))
    R = rand_f32(r, (past + Tm, dr))
    check_mla_every_path("mla three items", Q, KV, R, past, H, dn, dv,
                         ref_mla(Q, KV, R, past, H, dn, dv))


def check_mla_every_path(label, Q, KV, R, past, H, dn, dv, want):
    """On every ISA (avx512: items of up to 8 blocks of 8 tokens, and a lone token's own
    form, k3mla.h), a T-token mla_attention equals T one-token calls and `want` (the
    exact-order reference), bitwise."""
    Tm = Q.shape[0]
    for name in K.isas_available():
        with isa(name):
            O = np.empty((Tm, H * dv), np.float32)
            mla_rows(Q, KV, R, past, H, dn, dv, O)
            one = np.empty_like(O)
            for t in range(Tm):
                mla_rows(Q[t:t + 1], KV, R, past + t, H, dn, dv, one[t:t + 1])
        assert_bitwise(f"{label} T={Tm} vs per-position, {name}", O, one)
        assert_bitwise(f"{label} T={Tm} vs exact-order ref, {name}", O, want)


def ref_mla_weights(q_row, KV, R, p, H, dn, dr):
    """Per-head softmax weights f32(e/Z) of ref_mla for one token at position p."""
    dq, dkv = dn + dr, KV.shape[1] // H
    kappa = F1 / np.sqrt(np.float32(dq))
    out = []
    for h in range(H):
        q = q_row[h * dq:(h + 1) * dq].astype(np.float64)
        d = np.zeros(p + 1)
        for i in range(dn):
            d = d + q[i] * KV[:p + 1, h * dkv + i].astype(np.float64)
        for i in range(dr):
            d = d + q[dn + i] * R[:p + 1, i].astype(np.float64)
        sc = d.astype(np.float32) * kappa
        e = [c_expf(v - np.max(sc)) for v in sc]
        Z = 0.0
        for v in e:
            Z += float(v)
        out.append(np.array([np.float32(float(v) / Z) for v in e], np.float32))
    return out


# ---- 11. build flags -------------------------------------------------------------------------

def test_build_flags_no_contraction_no_fast_math():
    """Trap #40 (and §5.4): setup.py compiles with -ffp-contract=off and never with
    -ffast-math, -Ofast, -funsafe-math-optimizations or -fassociative-math; the Python
    build's own CFLAGS (prepended by setuptools) do not enable them either."""
    text = (REPO / "setup.py").read_text()
    tree = ast.parse(text)
    args = None
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "compile_args"
                                                for t in node.targets):
            args = ast.literal_eval(node.value)
    print(f"[gate] setup.py compile_args = {args}")
    assert args is not None, "setup.py no longer defines compile_args as a literal list"
    assert "-ffp-contract=off" in args
    docstring = ast.get_docstring(tree, clean=False)
    strings = [n.value for n in ast.walk(tree) if isinstance(n, ast.Constant)
               and isinstance(n.value, str) and n.value != docstring]
    forbidden = ("-ffast-math", "-Ofast", "-funsafe-math-optimizations", "-fassociative-math",
                 "-ffp-contract=fast", "-ffp-contract=on")
    for flag in forbidden:
        assert flag not in args, flag
        hits = [v for v in strings if flag in v.split()]
        assert not hits, f"{flag} appears in a setup.py string: {hits}"
    print(f"[gate] no fast-math/contraction flag in any of the {len(strings)} string literals "
          f"of setup.py (docstring excluded)")
    cflags = " ".join(str(sysconfig.get_config_var(v) or "") for v in ("CFLAGS", "OPT", "CCSHARED"))
    print(f"[gate] interpreter CFLAGS/OPT checked for fast-math flags: {cflags.split()[:8]} ...")
    for flag in forbidden:
        assert flag not in cflags.split(), f"python's build flags contain {flag}"


def test_embed_and_attnres_refuse_a_wrong_output_shape():
    """Bounds checking is off in the kernels: a wrong output shape must be refused up front,
    never written past."""
    W = np.zeros((8, 4), np.uint16)
    with pytest.raises(ValueError):
        K.embed(W, np.array([1, 2, 3], np.int64), np.zeros((2, 4), np.float32))
    with pytest.raises(ValueError):
        K.embed(W, np.array([1], np.int64), np.zeros((1, 5), np.float32))
    stack = np.zeros((2, 3, 4), np.float32)
    run = np.zeros((3, 4), np.float32)
    with pytest.raises(ValueError):
        K.attnres(stack, 1, run, np.zeros(4, np.float32), 1e-5, np.zeros((2, 4), np.float32))


def test_openmp_workers_wait_passively():
    """Importing the kernels sets OMP_WAIT_POLICY=passive before libgomp loads (a spinning
    worker takes the core the readers need: kernels/__init__.py), unless the user set it."""
    import subprocess
    import sys
    code = "import os, k3engine.kernels; print(os.environ['OMP_WAIT_POLICY'])"
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    got = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                         text=True, check=True).stdout.split()
    mine = subprocess.run([sys.executable, "-c", code], env=dict(env, OMP_WAIT_POLICY="active"),
                          capture_output=True, text=True, check=True).stdout.split()
    print(f"[threads] OMP_WAIT_POLICY unset -> {got[-1]}; set by the user -> {mine[-1]}")
    assert got[-1] == "passive" and mine[-1] == "active"


def test_matvecs_equals_one_matvec_per_matrix():
    """matvecs (one widening, one thread region for matrices sharing an input) gives each
    output the bits of its own matvec call: BF16 and float32 mixed, row counts with tails
    (and an empty matrix), T = 1 and T = 5, every ISA at 1 and 2 threads (above the
    parallel threshold); a foreign dtype or a shape that does not fit is refused."""
    r = rng(120)
    n = 512
    Ws = [(rand_f32(r, (rows, n)).view(np.uint32) >> 16).astype(np.uint16) if i % 2 == 0
          else rand_f32(r, (rows, n)) for i, rows in enumerate((1037, 40, 0, 2049, 8))]
    assert sum(W.shape[0] for W in Ws) * n >= PAR_MIN_WORK
    for T in (1, 5):
        X = rand_f32(r, (T, n))
        want = []
        for W in Ws:
            y = np.empty((T, W.shape[0]), np.float32)
            K.matvec(W, X, y)
            want.append(y)
        for name in K.isas_available():
            for nt in (1, 2):
                with isa(name), threads(nt):
                    got = [np.full((T, W.shape[0]), np.nan, np.float32) for W in Ws]
                    K.matvecs(Ws, X, got)
                for i, (g, w) in enumerate(zip(got, want)):
                    assert_bitwise(f"matvecs T={T} {name} {nt}t matrix {i} [{Ws[i].shape[0]}x"
                                   f"{n} {Ws[i].dtype}] vs matvec", g, w)
    X = rand_f32(r, (1, n))
    with pytest.raises(TypeError, match="float32 or bf16"):
        K.matvecs([Ws[0].astype(np.float64)], X, [np.empty((1, 1037), np.float32)])
    with pytest.raises(ValueError, match="matvec shapes"):
        K.matvecs([Ws[0]], X, [np.empty((1, 1036), np.float32)])
    with pytest.raises(ValueError, match="2 matrices but 1 outputs"):
        K.matvecs(Ws[:2], X, [np.empty((1, 1037), np.float32)])
