"""The Kimi K3 forward pass (ARCHITECTURE §4), top to bottom like the spec.

Shapes are in the names: x_TE is [T tokens, E hidden].  Every kernel treats tokens one at
a time in ascending order, so a token's logits do not depend on how many tokens share the
call (§4.10): teacher forcing, full recompute and incremental decode agree bit for bit.
"""
from __future__ import annotations

from typing import Callable

import numpy as np

from . import kernels as K
from .config import ModelConfig
from .errors import StateUnusable
from .state import KDAState, MLAState, SequenceState
from .weights import (DenseWeights, ExpertSource, ExpertWeights, KDAWeights, LayerWeights,
                      MLAWeights, MoEWeights, MXFP4, WeightProvider, mv, mvs)


def _f32(*shape: int) -> np.ndarray:
    return np.empty(shape, dtype=np.float32)


def rmsnorm(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    y = np.empty_like(x)
    K.rmsnorm(x, w, eps, y)
    return y


def situ_mlp(w: DenseWeights, x_TE: np.ndarray, cfg: ModelConfig) -> np.ndarray:
    """down(SiTU-GLU(gate(x), up(x))): the dense layer and the fused shared experts."""
    g, u = mvs((w.gate, w.up), x_TE)
    K.situ_glu(g, u, cfg.situ_b1, cfg.situ_b2, g)
    return mv(w.down, g)


# ---- Kimi Delta Attention (§4.4) -----------------------------------------------------

def kda(w: KDAWeights, x_TE: np.ndarray, st: KDAState, cfg: ModelConfig) -> np.ndarray:
    T = x_TE.shape[0]
    H, D = w.A_log.shape[0], w.o_norm.shape[0]
    q_TP, k_TP, v_TP = _f32(T, H * D), _f32(T, H * D), _f32(T, H * D)
    # every projection of x in one call (the gate's is used last)
    *raw, beta_TH, fa_TD, gate_TP = mvs((w.q_proj, w.k_proj, w.v_proj, w.b_proj, w.f_a,
                                         w.g_proj), x_TE)
    raw = tuple(raw)
    K.shortconv(raw[0], w.q_conv, st.conv_q, q_TP)                # conv + SiLU; history
    K.shortconv(raw[1], w.k_conv, st.conv_k, k_TP)                # keeps raw projections
    K.shortconv(raw[2], w.v_conv, st.conv_v, v_TP)
    K.l2norm_heads(q_TP, D)                                       # q and k only (trap #12)
    K.l2norm_heads(k_TP, D)

    K.sigmoid(beta_TH)                                            # one scalar per head

    z_TP = mv(w.f_b, fa_TD)                                       # shared low rank, no act.
    g_TP, alpha_TP = _f32(T, H * D), _f32(T, H * D)
    K.kda_decay(z_TP, w.A_log, w.dt_bias, cfg.gate_lb, g_TP, alpha_TP)

    o_TP = _f32(T, H * D)
    K.kda_recurrence(st.S, q_TP, k_TP, v_TP, alpha_TP, beta_TH, K.kda_q_scale(D), o_TP)
    if st.log is not None:                                        # a speculative sweep:
        st.log.append(raw + (q_TP, k_TP, v_TP, alpha_TP, beta_TH))  # state.keep_prefix

    o_heads = o_TP.reshape(T * H, D)                              # head-wise norm, one gain
    K.rmsnorm(o_heads, w.o_norm, cfg.rms_eps, o_heads)
    K.mul_sigmoid(o_TP, gate_TP)                                  # norm, then gate,
    return mv(w.o_proj, o_TP)                                     # then project


# ---- Gated MLA, NoPE (§4.5) ----------------------------------------------------------

# The expanded rows go to the cache's key blocks and value planes (state.MLAState) this
# many positions at a time: a whole prompt's rows at once would be one more buffer the
# size of its KV cache (8k positions: 134 MB in mid, 512 MB in K3).
KV_ROWS_AT_ONCE = 256


def mla(w: MLAWeights, x_TE: np.ndarray, st: MLAState, n_past: int,
        cfg: ModelConfig) -> np.ndarray:
    """Attend T new tokens at positions n_past.. (the caller reserved the cache rows)."""
    T = x_TE.shape[0]
    H, dn, dr, dv, R_kv = cfg.n_heads, cfg.qk_nope, cfg.qk_rope, cfg.v_head, cfg.kv_lora
    gated = w.g_proj is not None
    qa_T, c_T, *gate_T = mvs((w.q_a_proj, w.kv_a_proj) + ((w.g_proj,) if gated else ()), x_TE)
    q_T = mv(w.q_b_proj, rmsnorm(qa_T, w.q_a_norm, cfg.rms_eps))
    lat_T = np.ascontiguousarray(c_T[:, :R_kv])
    K.rmsnorm(lat_T, w.kv_a_norm, cfg.rms_eps, lat_T)             # latent only (trap #20)
    st.set_rope(n_past, c_T[:, R_kv:R_kv + dr])                   # raw, never rotated
    for c in range(0, T, KV_ROWS_AT_ONCE):                        # expanded k_nope | v
        st.set_rows(n_past + c, mv(w.kv_b_proj, lat_T[c:c + KV_ROWS_AT_ONCE]))
    o_T = _f32(T, H * dv)
    K.mla_attention(q_T, st.k, st.v, st.rope, n_past, o_T)
    if gated:                                                     # gate BEFORE o_proj
        K.mul_sigmoid(o_T, gate_T[0])
    return mv(w.o_proj, o_T)


# ---- Stable LatentMoE (§4.7) ---------------------------------------------------------

def route(w: MoEWeights, x_E: np.ndarray, cfg: ModelConfig,
          layer: int = -1) -> tuple[np.ndarray, np.ndarray]:
    """The exact router: top-k of all experts (`layer` is for routers that depend on it,
    like the draft model's, which sees only the resident experts)."""
    idx = np.empty(cfg.topk, dtype=np.int32)
    wts = np.empty(cfg.topk, dtype=np.float32)
    K.router(w.router, x_E, w.bias, cfg.topk, cfg.moe_renorm, cfg.routed_scale, idx, wts)
    return idx, wts


PREFILL_CHUNK = 64      # positions per expert union: SYSTEM §4.6's (the reference's) chunk


def latent_moe(w: MoEWeights, x_TE: np.ndarray, layer: int, experts: ExpertSource,
               cfg: ModelConfig, router=route, chunk: int = PREFILL_CHUNK) -> np.ndarray:
    """`chunk`: positions per expert union.  Any size gives the same bits (each token's
    matvec order does not depend on how many tokens share an expert); a larger one reads
    each union once for more positions and gives the expert tiles more tokens, and costs
    its temporaries (memory.moe_chunk_for decides)."""
    acc_TL = np.empty((x_TE.shape[0], w.down_lat.shape[0]), dtype=np.float32)
    shared: list[np.ndarray] = []
    last = (x_TE.shape[0] - 1) // chunk * chunk
    for c0 in range(0, x_TE.shape[0], chunk):
        x = x_TE[c0:c0 + chunk]
        # SYSTEM §4.5: the work that needs no routed expert (the latent down-projection;
        # in the last chunk also the shared expert, on the original x) runs while the
        # chunk's expert reads are in flight; the shared output is still added last
        _routed_aggregate(w, x, layer, experts, cfg, acc_TL[c0:c0 + x.shape[0]], router,
                          (lambda: shared.append(situ_mlp(w.shared, x_TE, cfg)))
                          if c0 == last else None)
    if cfg.latent_norm:                                           # on the aggregate only
        K.rmsnorm(acc_TL, w.lat_norm, cfg.rms_eps, acc_TL)
    y_TE = mv(w.up_lat, acc_TL)
    K.add(y_TE, shared[0])                                        # shared: original x, last
    return y_TE


def route_chunk(w: MoEWeights, x_TE: np.ndarray, cfg: ModelConfig, layer: int = -1,
                router=route) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Every token's selection: (idx [T, k] int32, weights [T, k], count [T] int32), ranks
    j < count[t] valid.  The exact router runs over the whole chunk in one call (the same
    per-token kernel order as `route`); another router (a draft's) is asked per token."""
    T = x_TE.shape[0]
    if router is route:
        idx = np.empty((T, cfg.topk), dtype=np.int32)
        wts = np.empty((T, cfg.topk), dtype=np.float32)
        K.route_tokens(w.router, x_TE, w.bias, cfg.topk, cfg.moe_renorm, cfg.routed_scale,
                       idx, wts)
        return idx, wts, np.full(T, cfg.topk, dtype=np.int32)
    routes = [router(w, x_TE[t], cfg, layer) for t in range(T)]
    k = max(len(i) for i, _ in routes)                            # topk (a draft: fewer)
    idx, wts = np.zeros((T, k), dtype=np.int32), np.zeros((T, k), dtype=np.float32)
    count = np.empty(T, dtype=np.int32)
    for t, (i, wt) in enumerate(routes):
        count[t] = len(i)
        idx[t, :len(i)], wts[t, :len(i)] = i, wt
    return idx, wts, count


def run_expert(ex: ExpertWeights, zl_TL: np.ndarray, tokens: np.ndarray, b1, b2,
               out: np.ndarray) -> None:
    """One routed expert over the tokens that chose it (rows `tokens` of zl_TL), a kernel
    call per step: gather, gate and up matvecs, SiTU, down into `out`.  The path of float
    experts, and the per-call reference K.moe_experts is held to."""
    z = _f32(tokens.shape[0], zl_TL.shape[1])
    K.gather_rows(zl_TL, tokens, z)
    g = mv(ex.w1, z)
    K.situ_glu(g, mv(ex.w3, z), b1, b2, g)
    mv(ex.w2, g, out)


def _routed_aggregate(w: MoEWeights, x_TE: np.ndarray, layer: int, experts: ExpertSource,
                      cfg: ModelConfig, acc_TL: np.ndarray, router=route,
                      while_reading: Callable[[], None] | None = None) -> None:
    """acc[t] = sum_j w_j * expert_j(zl[t]) in selection order, for one chunk of tokens.

    Chunk union: each selected expert is fetched once and runs over all the chunk's tokens
    that chose it; the per-token matvec order does not depend on that count, so this equals
    the per-token MoE bit for bit.  An expert's outputs land in its own contiguous slots of
    d_SL (moe_groups), and the combine sums each token's slots in rank order afterwards
    (the accumulation order is part of the contract, trap #41)."""
    idx, wts, count = route_chunk(w, x_TE, cfg, layer, router)    # full-width x (trap #23)
    n_experts = w.router.shape[0]
    starts = np.empty(n_experts + 1, dtype=np.int32)
    token = np.empty(idx.size, dtype=np.int32)
    pos = np.empty(idx.shape, dtype=np.int32)
    d_SL = np.empty((K.moe_groups(idx, count, n_experts, starts, token, pos),
                     acc_TL.shape[1]), dtype=np.float32)
    s = starts.tolist()
    zl_TL = None
    for group in experts.batches(layer, [e for e in range(n_experts) if s[e + 1] > s[e]]):
        if zl_TL is None:                      # the first group's reads were just issued
            zl_TL = mv(w.down_lat, x_TE)
            if while_reading is not None:
                while_reading()
        # MXFP4 experts (the engine's) run in batches, one thread region each: all that
        # are served before the next one would wait for its read (SYSTEM §4.5: what has
        # landed computes while the rest is read; a list group is resident as a whole)
        next_ready = getattr(group, "next_ready", lambda: True)
        batch: list = []
        for e, ex in group:
            packed = all(isinstance(m, MXFP4) for m in (ex.w1, ex.w3, ex.w2))
            if packed:
                batch.append((e, ex))
            if batch and not (packed and next_ready()):
                K.moe_experts(batch, zl_TL, token, starts, cfg.situ_b1, cfg.situ_b2, d_SL)
                batch = []
            if not packed:                     # float experts (the op fixtures')
                run_expert(ex, zl_TL, token[s[e]:s[e + 1]], cfg.situ_b1, cfg.situ_b2,
                           d_SL[s[e]:s[e + 1]])
        if batch:                              # before the group is let go
            K.moe_experts(batch, zl_TL, token, starts, cfg.situ_b1, cfg.situ_b2, d_SL)
    if zl_TL is None and while_reading is not None:               # nothing was requested
        while_reading()
    K.moe_combine(d_SL, pos, wts, count, acc_TL)                  # selection order


# ---- decoder layer with Block Attention Residuals (§4.3, §4.8) -------------------------

class AttnResStack:
    """The per-call snapshot stack: [max_snapshots, T, E], rebuilt on every forward."""

    def __init__(self, n_snapshots: int, T: int, E: int):
        self.buf = np.empty((max(n_snapshots, 1), T, E), dtype=np.float32)
        self.n = 0

    def push(self, run_TE: np.ndarray) -> None:
        self.buf[self.n] = run_TE
        self.n += 1

    def aggregate(self, run_TE: np.ndarray, phi: np.ndarray, eps: float) -> np.ndarray:
        out = np.empty_like(run_TE)
        K.attnres(self.buf, self.n, run_TE, phi, eps, out)
        return out


def decoder_layer(L: int, h_TE: np.ndarray, stack: AttnResStack, lw: LayerWeights,
                  seqs: list[tuple[slice, KDAState | MLAState, int]], experts: ExpertSource,
                  cfg: ModelConfig, router=route, moe_chunk: int = PREFILL_CHUNK,
                  tap: Callable[[np.ndarray], None] | None = None,
                  ahead: Callable | None = None) -> np.ndarray:
    """One layer over the rows of one or more sequences; h_TE is consumed (updated in place
    as the running sum).  `seqs`: each sequence's rows, its state of this layer and its past
    positions.  Attention runs per sequence on its own rows and state; everything else is
    row by row (each row bit-identical to a one-row call, the token-blocked kernels'
    guarantee), so the weights -- a streamed layer, the union of the rows' experts -- are
    read once for all the sequences of a step.  `tap(a)` sees the layer's input aggregate
    (the previous layer's output as this layer reads it: a block drafter's feature).
    `ahead(L, a, run, stack, lw)` may start this layer's expert reads from a guess before
    its attention runs (lookahead.NextLayerGuess); it changes no value here."""
    run = h_TE                                                    # the block's running sum
    a = stack.aggregate(run, lw.phi_attn, cfg.rms_eps) if stack.n else h_TE
    if tap is not None:
        tap(a)
    if ahead is not None:
        ahead(L, a, run, stack, lw)
    if cfg.is_boundary(L):
        stack.push(run)                                           # push the block sum, then
        run = None                                                # clear it
    x = rmsnorm(a, lw.input_norm, cfg.rms_eps)
    attend = (lambda x_, st, n: kda(lw.attn, x_, st, cfg)) if cfg.is_kda(L) else \
        (lambda x_, st, n: mla(lw.attn, x_, st, n, cfg))
    if len(seqs) == 1:
        y = attend(x, seqs[0][1], seqs[0][2])
    else:
        y = np.concatenate([attend(np.ascontiguousarray(x[rows]), st, n)
                            for rows, st, n in seqs])
    if run is None:
        run = y
    else:
        K.add(run, y)
    m = stack.aggregate(run, lw.phi_mlp, cfg.rms_eps)             # unconditional: stack >= 1
    x2 = rmsnorm(m, lw.post_norm, cfg.rms_eps)
    z = situ_mlp(lw.mlp, x2, cfg) if cfg.is_dense(L) else \
        latent_moe(lw.mlp, x2, L, experts, cfg, router, moe_chunk)
    K.add(run, z)
    return run


# ---- whole model (§4.2, §4.9) --------------------------------------------------------

class Model:
    """Forward pass over a weight provider and an expert source, on the first `n_layers`
    layers (the CLI's --layers binds a partial stack).  `router` replaces the exact
    top-k routing for a draft model only (draft.DraftRouter).  `moe_chunk`: the prefill's
    positions per expert union (latent_moe)."""

    def __init__(self, cfg: ModelConfig, weights: WeightProvider, experts: ExpertSource,
                 n_layers: int | None = None, router=route, moe_chunk: int = PREFILL_CHUNK):
        self.cfg = cfg
        self.moe_chunk = int(moe_chunk)
        self.weights = weights
        self.experts = experts
        self.router = router
        self.n_layers = cfg.n_layers if n_layers is None else int(n_layers)
        self.layers_completed = 0
        self.lookahead = None        # decoder_layer's `ahead` (lookahead.attach sets it)

    def new_state(self, capacity: int, shared_recurrent: bool = False) -> SequenceState:
        return SequenceState(self.cfg, capacity, self.n_layers, shared_recurrent)

    def forward(self, ids, state: SequenceState, all_logits: bool = False, cancel=None,
                on_layer=None, capture: dict | None = None) -> np.ndarray:
        """Run the new ids through the model, advancing `state`.  Returns the logits of
        the last position [V], or of every position [T, V] with all_logits.

        `cancel` (truthy when a stop was asked) is a safe point between layers: the pass
        raises Stopped.  A pass that raises for any reason leaves `state` poisoned (some
        layers advanced, others not), and a poisoned state is refused here.
        `on_layer(L, T)` is called after each layer (prefill progress).
        `capture`: {layer id: None} to fill with that layer's output [T, E] as the next
        layer reads it (the Block AttnRes aggregate; after the last layer the final one,
        before the norm) -- the target features a block drafter reads (drafter.py)."""
        return self.forward_batch([(ids, state)], all_logits, cancel, on_layer, capture)[0]

    def forward_batch(self, items, all_logits: bool = False, cancel=None,
                      on_layer=None, capture: dict | None = None) -> list[np.ndarray]:
        """`forward` for several sequences in one pass: `items` is (new ids, state) per
        sequence, each at its own position and length.  Every layer is bound once and the
        routed experts of all the rows are read once per layer; each sequence's logits are
        bit-identical to its own forward (tests/test_batch.py).  A pass that fails poisons
        every state it carried.  `capture` (see forward) holds all the rows, in item order."""
        for _, state in items:
            if state.poisoned:
                raise StateUnusable(f"sequence state is unusable: {state.poisoned}")
        cfg = self.cfg
        ids = [np.ascontiguousarray(i, dtype=np.int64) for i, _ in items]
        lengths = [a.shape[0] for a in ids]
        T = sum(lengths)
        starts = np.cumsum([0] + lengths)
        pasts = [state.reserve(n) for n, (_, state) in zip(lengths, items)]
        tables = self.weights.tables
        h = _f32(T, cfg.hidden)
        tables.embed_into(np.concatenate(ids) if len(ids) > 1 else ids[0], h)   # gather, widen
        n_boundaries = -(-self.n_layers // cfg.attn_res_block)
        stack = AttnResStack(n_boundaries, T, cfg.hidden)
        self.layers_completed = 0
        try:
            for L in range(self.n_layers):
                if cancel:
                    raise Stopped(f"stopped after layer {L} of {self.n_layers}")
                seqs = []
                for b, (_, state) in enumerate(items):
                    if state.shared_recurrent and cfg.is_kda(L):
                        state.layers[L].reset()                   # the one shared slot
                    seqs.append((slice(starts[b], starts[b + 1]), state.layers[L], pasts[b]))
                lw = self.weights.layer(L)
                tap = None
                if capture is not None and L - 1 in capture:     # a copy: h is updated in place
                    tap = (lambda a, k=L - 1: capture.__setitem__(k, a.copy()))
                try:
                    h = decoder_layer(L, h, stack, lw, seqs, self.experts, cfg, self.router,
                                      self.moe_chunk, tap, self.lookahead)
                finally:
                    self.weights.release(L)
                self.layers_completed = L + 1
                if on_layer is not None:
                    on_layer(L, T)
        except BaseException as e:
            if isinstance(e, Stopped) and self.layers_completed == 0:
                raise                                             # nothing was advanced
            for _, state in items:
                state.poisoned = (f"a forward pass over {T} positions ended at layer "
                                  f"{self.layers_completed} of {self.n_layers} "
                                  f"({type(e).__name__})")
            raise
        for n, past, (_, state) in zip(lengths, pasts, items):
            state.n_cached = past + n
        o = stack.aggregate(h, tables.phi_out, cfg.rms_eps)       # one more before the norm
        if capture is not None and self.n_layers - 1 in capture:
            capture[self.n_layers - 1] = o.copy()
        rows = o if all_logits else o[starts[1:] - 1]             # each sequence's last row
        logits = tables.project(rmsnorm(np.ascontiguousarray(rows), tables.final_norm,
                                        cfg.rms_eps))
        if all_logits:
            return [logits[starts[b]:starts[b + 1]] for b in range(len(items))]
        return [logits[b] for b in range(len(items))]


class Stopped(Exception):
    """A stop request honoured inside a forward pass (between layers)."""


def greedy(logits: np.ndarray) -> int:
    """First index of the maximum (lowest index on ties)."""
    return int(K.argmax(np.ascontiguousarray(logits, dtype=np.float32)))
