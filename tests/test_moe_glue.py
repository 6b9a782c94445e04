"""Tier 0: the per-chunk MoE glue kernels (route_tokens, moe_groups, gather_rows,
moe_combine, moe_experts) and the threaded elementwise kernels, bit for bit against the per-token Python
path they replaced (issue 13).

The reference `old_routed_aggregate` below is the Python path model.py ran before: one
`K.router` call per token, a dict of (token, rank) users per expert, a fancy-index gather
per expert, a per-row scatter, and `K.axpy` per (token, rank) in selection order.  Every
comparison is on ids and float32 bit patterns, over T = 1..70 so the 64-position MoE chunk
(model.PREFILL_CHUNK) is crossed, with ties in the router scores (duplicated router rows,
equal biased scores) and with a draft-style router that picks fewer experts, or none.
"""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from k3engine import kernels as K
from k3engine import model as M
from k3engine.weights import MXFP4, DenseWeights, ExpertWeights, MoEWeights, mv
from test_kernels import (PAR_MIN_WORK, assert_bitwise, c_sigmoid, c_tanhf, isa, rand_f32,
                          ref_kda_decay, rng, threads)


def bf16_bits(a: np.ndarray) -> np.ndarray:
    """float32 -> BF16 bit patterns by truncation (any bits will do for a kernel test)."""
    return (np.ascontiguousarray(a, np.float32).view(np.uint32) >> 16).astype(np.uint16)


def tied_router(r, N: int, E: int, dtype) -> tuple[np.ndarray, np.ndarray]:
    """Router weights [N, E] with tied experts: rows 1 and 5 copy row 0 (and share a bias
    that usually selects all three: the tie is resolved by index), row 9 copies row 8."""
    W = rand_f32(r, (N, E), 0.05)
    W[1] = W[5] = W[0]
    W[9] = W[8]
    bias = np.zeros(N, np.float32)
    bias[[0, 1, 5]] = 0.5                  # the tied trio is usually selected, in index order
    W = bf16_bits(W) if dtype == "bf16" else W
    return W, bias


def per_token_route(W, X, bias, k, renorm, scale):
    idx, wts = np.empty((X.shape[0], k), np.int32), np.empty((X.shape[0], k), np.float32)
    for t in range(X.shape[0]):
        K.router(W, np.ascontiguousarray(X[t]), bias, k, renorm, np.float32(scale), idx[t], wts[t])
    return idx, wts


@pytest.mark.parametrize("dtype", ["f32", "bf16"])
@pytest.mark.parametrize("k,renorm", [(1, True), (4, True), (6, False)])
def test_route_tokens_equals_router_per_token(dtype, k, renorm):
    """route_tokens over T rows equals T calls of K.router: ids exactly, weights bitwise,
    ties (identical rows, so identical sigmoid scores) resolved to the lowest index, at 1
    and 2 threads (the shapes cross the parallel threshold)."""
    r = rng(41)
    N, E = 67, 320                         # N not a multiple of 4: the chains' tail runs
    W, bias = tied_router(r, N, E, dtype)
    X = rand_f32(r, (70, E))
    X[3] = 0.0                             # every score sigma(0): all N tied
    assert N * E * 70 >= PAR_MIN_WORK
    ties = 0
    for T in (1, 2, 3, 4, 5, 8, 17, 63, 64, 65, 70):
        want_i, want_w = per_token_route(W, X[:T], bias, k, renorm, 1.5)
        for nt in (1, 2):
            idx, wts = np.empty((T, k), np.int32), np.empty((T, k), np.float32)
            with threads(nt):
                K.route_tokens(W, X[:T], bias, k, renorm, np.float32(1.5), idx, wts)
            assert idx.tolist() == want_i.tolist(), f"T={T} threads={nt}: ids differ"
            assert_bitwise(f"route_tokens {dtype} k={k} T={T} threads={nt}", wts, want_w)
        ties += sum(set(row) & {0, 1, 5} == {0, 1, 5} for row in idx.tolist())
    tied_order = [0, 1, 5] + [e for e in range(N) if e not in (0, 1, 5)]
    assert idx[3].tolist() == tied_order[:k]       # all scores tied: biased first, then by id
    print(f"[gate] rows that selected the whole tied trio 0, 1, 5: {ties}")


def test_route_tokens_refuses_bad_shapes():
    W, bias = tied_router(rng(1), 16, 16, "f32")
    X = rand_f32(rng(2), (3, 16))
    with pytest.raises(ValueError, match=r"\[T, k\]"):
        K.route_tokens(W, X, bias, 2, True, 1.0, np.empty((3, 3), np.int32),
                       np.empty((3, 2), np.float32))
    with pytest.raises(ValueError, match="shapes"):
        K.route_tokens(W, X, bias, 17, True, 1.0, np.empty((3, 17), np.int32),
                       np.empty((3, 17), np.float32))


def python_groups(idx, count):
    users: dict[int, list[tuple[int, int]]] = {}
    for t in range(idx.shape[0]):
        for j in range(count[t]):
            users.setdefault(int(idx[t, j]), []).append((t, j))
    return users


@pytest.mark.parametrize("T", [1, 2, 7, 64, 65, 70])
def test_moe_groups_and_combine_equal_the_python_path(T):
    """moe_groups puts expert e's (token, rank) selections in slots starts[e].., tokens
    ascending, exactly the old users dict; moe_combine equals zero-fill then axpy per rank
    in selection order, bitwise (-0.0 outputs included), with counts 0..k per token."""
    r = rng(T)
    N, k, L = 23, 5, 40
    idx = np.stack([r.permutation(N)[:k] for _ in range(T)]).astype(np.int32)
    count = r.integers(0, k + 1, T).astype(np.int32)
    count[0] = k
    starts, token, pos = np.empty(N + 1, np.int32), np.empty(T * k, np.int32), np.empty((T, k), np.int32)
    n = K.moe_groups(idx, count, N, starts, token, pos)
    users = python_groups(idx, count)
    assert n == int(count.sum())
    for e in range(N):
        rows = users.get(e, [])
        assert starts[e + 1] - starts[e] == len(rows)
        assert token[starts[e]:starts[e + 1]].tolist() == [t for t, _ in rows]
        for s, (t, j) in zip(range(starts[e], starts[e + 1]), rows):
            assert pos[t, j] == s
    d_TkL = rand_f32(r, (T, k, L), 3.0)
    d_TkL[0, 0, :5] = -0.0
    wts = rand_f32(r, (T, k))
    D = np.empty((n, L), np.float32)
    for t in range(T):
        for j in range(count[t]):
            D[pos[t, j]] = d_TkL[t, j]
    want = np.empty((T, L), np.float32)
    want.fill(0.0)
    for t in range(T):
        for j in range(count[t]):
            K.axpy(want[t], wts[t, j], d_TkL[t, j])
    got = np.full((T, L), np.nan, np.float32)
    K.moe_combine(D, pos, wts, count, got)
    assert_bitwise(f"moe_combine T={T} vs axpy per rank", got, want)
    rows = token[:n]
    z = np.empty((n, L), np.float32)
    K.gather_rows(want, rows, z)
    assert_bitwise("gather_rows vs fancy index", z, want[rows])


def test_moe_groups_refuses_out_of_range_ids():
    idx = np.array([[0, 30]], np.int32)
    with pytest.raises(ValueError, match="outside"):
        K.moe_groups(idx, np.array([2], np.int32), 23, np.empty(24, np.int32),
                     np.empty(2, np.int32), np.empty((1, 2), np.int32))


# ---- the whole routed aggregate against the old per-token Python path --------------------

def old_routed_aggregate(w, x_TE, layer, experts, cfg, acc_TL, router):
    """model._routed_aggregate as it was before issue 13 (the reference)."""
    T = x_TE.shape[0]
    routes = [router(w, x_TE[t], cfg, layer) for t in range(T)]
    k = max(len(idx) for idx, _ in routes)
    users = python_groups(np.array([np.pad(i, (0, k - len(i))) for i, _ in routes], np.int32),
                          [len(i) for i, _ in routes])
    d_TkL = np.empty((T, k, acc_TL.shape[1]), dtype=np.float32)
    zl_TL = mv(w.down_lat, x_TE)
    for group in experts.batches(layer, sorted(users)):
        for e, ex in group:
            rows = users[e]
            z = np.ascontiguousarray(zl_TL[[t for t, _ in rows]])
            g = mv(ex.w1, z)
            K.situ_glu(g, mv(ex.w3, z), cfg.situ_b1, cfg.situ_b2, g)
            d = mv(ex.w2, g)
            for r_, (t, j) in enumerate(rows):
                d_TkL[t, j] = d[r_]
    acc_TL.fill(0.0)
    for t, (_, wts) in enumerate(routes):
        for j in range(len(wts)):
            K.axpy(acc_TL[t], wts[j], d_TkL[t, j])


def old_latent_moe(w, x_TE, layer, experts, cfg, router):
    acc_TL = np.empty((x_TE.shape[0], w.down_lat.shape[0]), dtype=np.float32)
    for c0 in range(0, x_TE.shape[0], M.PREFILL_CHUNK):
        x = x_TE[c0:c0 + M.PREFILL_CHUNK]
        old_routed_aggregate(w, x, layer, experts, cfg, acc_TL[c0:c0 + x.shape[0]], router)
    if cfg.latent_norm:
        K.rmsnorm(acc_TL, w.lat_norm, cfg.rms_eps, acc_TL)
    y_TE = mv(w.up_lat, acc_TL)
    K.add(y_TE, M.situ_mlp(w.shared, x_TE, cfg))
    return y_TE


class ReadingGroup(list):
    """A group whose next expert is sometimes "still being read" (ExpertCache's _Group):
    the MoE then runs what it was served so far as a batch of its own."""

    def __init__(self, pairs, r):
        super().__init__(pairs)
        self.r = r

    def next_ready(self) -> bool:
        return bool(self.r.random() < 0.5)


class GroupedExperts:
    """Experts served in groups of 3 (a bounded cache's batches), float32, BF16 or MXFP4;
    with `reading`, groups that split their batches at random."""

    def __init__(self, ex, reading=None):
        self.ex, self.reading = ex, reading

    def batches(self, layer, experts):
        for i in range(0, len(experts), 3):
            pairs = [(e, self.ex[e]) for e in experts[i:i + 3]]
            yield ReadingGroup(pairs, self.reading) if self.reading else pairs


def rand_mxfp4(r, rows: int, n: int) -> MXFP4:
    """Random MXFP4 bytes, about 5 % of the groups skipped (scale byte 255)."""
    S = r.integers(118, 130, (rows, n // 32), dtype=np.uint16).astype(np.uint8)
    S[r.random(S.shape) < 0.05] = 255
    return MXFP4(r.integers(0, 256, (rows, n // 2), dtype=np.uint16).astype(np.uint8), S)


def tiny_moe(r, dtype):
    N, E, Lt, I, Is = 18, 48, 24, 40, 32
    if dtype == "mxfp4":                   # routed experts MXFP4 (groups of 32), trunk f32
        Lt, I = 32, 64
    m = (lambda a: bf16_bits(a)) if dtype == "bf16" else (lambda a: a)
    W, bias = tied_router(r, N, E, "f32")
    w = MoEWeights(router=m(W), bias=bias, down_lat=m(rand_f32(r, (Lt, E), 0.2)),
                   up_lat=m(rand_f32(r, (E, Lt), 0.2)), lat_norm=rand_f32(r, (Lt,)),
                   shared=DenseWeights(m(rand_f32(r, (Is, E), 0.2)), m(rand_f32(r, (Is, E), 0.2)),
                                       m(rand_f32(r, (E, Is), 0.2))))
    if dtype == "mxfp4":
        ex = {e: ExpertWeights(w1=rand_mxfp4(r, I, Lt), w3=rand_mxfp4(r, I, Lt),
                               w2=rand_mxfp4(r, Lt, I)) for e in range(N)}
    else:
        ex = {e: ExpertWeights(w1=m(rand_f32(r, (I, Lt), 0.3)), w3=m(rand_f32(r, (I, Lt), 0.3)),
                               w2=m(rand_f32(r, (Lt, I), 0.3))) for e in range(N)}
    cfg = SimpleNamespace(topk=4, moe_renorm=True, routed_scale=np.float32(2.5), situ_b1=4.0,
                          situ_b2=25.0, latent_norm=True, rms_eps=1e-5)
    return w, GroupedExperts(ex), cfg


def draft_like(w, x_E, cfg, layer):
    """A router that picks fewer experts than top-k, and none for some tokens (like the
    draft's cache-only router with few residents)."""
    k = int(abs(float(x_E[0])) * 10) % 4
    if k == 0:
        return np.empty(0, np.int32), np.empty(0, np.float32)
    idx, wts = np.empty(k, np.int32), np.empty(k, np.float32)
    K.router(w.router, x_E, w.bias, k, cfg.moe_renorm, cfg.routed_scale, idx, wts)
    return idx, wts


def nothing_resident(w, x_E, cfg, layer):
    """The cache-only draft router with no expert resident: the shared experts only."""
    return np.empty(0, np.int32), np.empty(0, np.float32)


@pytest.mark.parametrize("dtype", ["f32", "bf16", "mxfp4", "mxfp4-reading"])
@pytest.mark.parametrize("router", [M.route, draft_like, nothing_resident],
                         ids=["exact", "draft-like", "nothing-resident"])
def test_latent_moe_equals_the_old_python_path(dtype, router):
    """latent_moe (route_tokens + moe_groups + gather_rows or moe_experts + moe_combine)
    equals the old per-token path bitwise for every T = 1..70 (64-position chunks crossed),
    with tied router scores, experts served in groups of 3 (MXFP4: run as batches, split at
    random where a read would still be in flight), and a router that picks 0..3 experts."""
    r = rng(70)
    w, experts, cfg = tiny_moe(r, dtype.split("-")[0])
    if dtype.endswith("reading"):
        experts.reading = rng(71)
    X = rand_f32(r, (70, w.router.shape[1]))
    X[5] = 0.0                             # all scores tied
    for T in range(1, 71):
        want = old_latent_moe(w, X[:T], 1, experts, cfg, router)
        got = M.latent_moe(w, X[:T], 1, experts, cfg, router)
        assert np.array_equal(got.view(np.uint32), want.view(np.uint32)), f"T={T} differs"
    print(f"[gate] latent_moe {dtype} router={router.__name__}: T = 1..70 bit-identical to the "
          f"per-token Python path")


def _expert_batch(r, T: int, N: int = 12, L: int = 64, inter: int = 160, Lout: int = 40,
                  k: int = 4):
    """N MXFP4 experts (inter = 10 row chunks of 16, Lout = 2.5: a row tail), T tokens
    choosing k each: (group, Z, token, starts, slots)."""
    ex = {e: ExpertWeights(rand_mxfp4(r, inter, L), rand_mxfp4(r, inter, L),
                           rand_mxfp4(r, Lout, inter)) for e in range(N)}
    Z = rand_f32(r, (T, L))
    idx = np.array([r.choice(N, k, replace=False) for _ in range(T)], np.int32)
    starts, token = np.empty(N + 1, np.int32), np.empty(T * k, np.int32)
    S = K.moe_groups(idx, np.full(T, k, np.int32), N, starts, token, np.empty((T, k), np.int32))
    s = starts.tolist()
    return [(e, ex[e]) for e in range(N) if s[e + 1] > s[e]], Z, token, starts, S


DECODE_BATCH = dict(N=16, L=128, inter=512, Lout=136, k=8)   # one token, above the threshold


@pytest.mark.parametrize("T, shape", [(1, {}), (1, DECODE_BATCH), (5, {}), (70, {})])
def test_moe_experts_equals_the_per_expert_calls(T, shape):
    """moe_experts (one thread region for a batch of experts) equals model.run_expert
    (gather_rows, three mxfp4_matvec and situ_glu per expert), bitwise, on every ISA at 1 and 2 threads (T = 70
    and the one-token DECODE_BATCH cross the parallel threshold; the latter's items span
    several 16-row chunks, as a decode step's do), with row tails and skipped groups."""
    group, Z, token, starts, S = _expert_batch(rng(90), T, **shape)
    s = starts.tolist()
    Lout = group[0][1].w2.shape[0]
    want = np.empty((S, Lout), np.float32)
    for e, ex in group:
        M.run_expert(ex, Z, token[s[e]:s[e + 1]], np.float32(4.0), np.float32(25.0),
                     want[s[e]:s[e + 1]])
    work = sum((s[e + 1] - s[e]) * ex.w1.shape[0] * (2 * Z.shape[1] + Lout) for e, ex in group)
    print(f"[moe_experts] T={T}: {len(group)} experts, {S} slots, {work} multiply-adds "
          f"({'parallel' if work >= PAR_MIN_WORK else 'one thread'})")
    for name in K.isas_available():
        for nt in (1, 2):
            with isa(name), threads(nt):
                got = np.full((S, Lout), np.nan, np.float32)
                K.moe_experts(group, Z, token, starts, np.float32(4.0), np.float32(25.0), got)
            assert_bitwise(f"moe_experts T={T} {name} {nt} threads vs per-expert calls",
                           got, want)


def test_moe_experts_refuses_what_does_not_fit():
    """Shapes that do not fit, a slot naming a row past Z and an expert without slots are
    refused with a message naming the expert, before anything is computed."""
    group, Z, token, starts, S = _expert_batch(rng(91), 3)
    D = np.zeros((S, 40), np.float32)
    e0, ex0 = group[0]
    cases = {
        "w2": [(e0, ExpertWeights(ex0.w1, ex0.w3, rand_mxfp4(rng(1), 40, 64)))] + group[1:],
        "w3": [(e0, ExpertWeights(ex0.w1, rand_mxfp4(rng(1), 128, 64), ex0.w2))] + group[1:],
        "no valid slots": group + [(99, ex0)],
    }
    for problem, bad in cases.items():
        with pytest.raises(ValueError, match=problem):
            K.moe_experts(bad, Z, token, starts, np.float32(4.0), np.float32(25.0), D)
    bad_token = token.copy()
    bad_token[0] = 3
    with pytest.raises(ValueError, match="names row 3 of 3"):
        K.moe_experts(group, Z, bad_token, starts, np.float32(4.0), np.float32(25.0), D)
    assert not D.any()                     # refused before the region ran
    print(f"[gate] moe_experts refused {len(cases) + 1} bad batches, D untouched")


# ---- elementwise kernels: raw pointers, threaded when large, libm per element -------------

def test_elementwise_kernels_threads_and_libm():
    """situ_glu, sigmoid, mul_sigmoid, add, kda_decay and shortconv on arrays above the parallel
    threshold: 2 threads equal 1 thread bitwise, and a sample of elements equals the
    ctypes-libm reference."""
    r = rng(54)
    T, n = 5, 16384
    assert T * n * 16 >= PAR_MIN_WORK
    G, U, X = rand_f32(r, (T, n), 6.0), rand_f32(r, (T, n), 40.0), rand_f32(r, (T, n))
    b1, b2 = np.float32(4.0), np.float32(25.0)
    A_log = rng(8).standard_normal(16).astype(np.float32)
    out = {}
    for nt in (1, 2):
        with threads(nt):
            y = np.empty_like(G)
            K.situ_glu(G, U, b1, b2, y)
            s = G.copy()
            K.sigmoid(s)
            ms = X.copy()
            K.mul_sigmoid(ms, G)
            a = X.copy()
            K.add(a, U)
            dg, da = np.empty_like(G), np.empty_like(G)
            K.kda_decay(G, A_log, X[0], np.float32(-5.0), dg, da)
            hist, conv = np.zeros((n, 3), np.float32), np.empty_like(G)
            K.shortconv(X, rng(9).standard_normal((n, 4)).astype(np.float32), hist, conv)
            out[nt] = (y, s, ms, a, dg, da, conv, hist)
    for name, a1, a2 in zip(("situ_glu", "sigmoid", "mul_sigmoid", "add", "kda g", "kda alpha",
                             "shortconv", "shortconv history"), out[1], out[2]):
        assert_bitwise(f"{name} 2 threads vs 1", a2, a1)
    y, s, ms, a, dg, da = out[1][:6]
    sample = [(t, i) for t in range(T) for i in range(0, n, 97)]
    # the product order of the kernel: a = f32(b1*tanhf) * sigma, then a * c
    want = np.array([np.float32(np.float32(b1 * c_tanhf(G[t, i] / b1)) * c_sigmoid(G[t, i]))
                     * np.float32(b2 * c_tanhf(U[t, i] / b2)) for t, i in sample], np.float32)
    assert_bitwise("situ_glu sample vs libm", [y[t, i] for t, i in sample], want)
    assert_bitwise("sigmoid sample vs libm", [s[t, i] for t, i in sample],
                   [c_sigmoid(G[t, i]) for t, i in sample])
    assert_bitwise("mul_sigmoid sample vs libm", [ms[t, i] for t, i in sample],
                   [X[t, i] * c_sigmoid(G[t, i]) for t, i in sample])
    Zs = G[:, :1024]
    gr, ar = ref_kda_decay(Zs, A_log, X[0, :1024], -5.0, lambda c: c // (n // 16))
    assert_bitwise("kda_decay g sample vs libm (exp(A_log) per head)", dg[:, :1024], gr)
    assert_bitwise("kda_decay alpha sample vs libm", da[:, :1024], ar)
