"""Weight containers and the two interfaces the forward pass reads weights through.

A large matrix ("M" class, ARCHITECTURE §3.3) is kept in its shipped form: a float32 array,
a uint16 array of BF16 bit patterns (widened inside the matvec), or an `MXFP4` pair of
packed nibbles + E8M0 scales (and, in a draft trunk only, `I8R` int8 rows + scales).  `mv`
is the one matvec entry point for all of them, so the same forward pass runs on op-fixture
float32 weights, BF16 checkpoints, MXFP4 experts and draft trunks.

The forward pass asks a `WeightProvider` for a layer's weights (then releases it) and an
`ExpertSource` for one routed expert; resident, streamed and cached implementations can
be swapped without touching the math.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator, Protocol, Sequence, Union

import numpy as np

from . import kernels as K


@dataclass(frozen=True)
class MXFP4:
    packed: np.ndarray   # uint8 [rows, n/2]; element 2j in the low nibble of byte j
    scales: np.ndarray   # uint8 [rows, n/32]; E8M0

    @property
    def shape(self) -> tuple[int, int]:
        return (self.packed.shape[0], self.packed.shape[1] * 2)


@dataclass(frozen=True)
class I8R:
    """A draft trunk's int8 matrix: q [rows, n] int8, one float32 scale per row."""
    q: np.ndarray
    scales: np.ndarray

    @property
    def shape(self) -> tuple[int, int]:
        return self.q.shape


Matrix = Union[np.ndarray, MXFP4, I8R]


def mv(W: Matrix, X: np.ndarray, Y: np.ndarray | None = None) -> np.ndarray:
    """Y[t] = W @ X[t] for every row t of X [T, in], each token in the exact §5.3/§5.6
    order (independent of T, so prefill equals decode bit for bit)."""
    if Y is None:
        Y = np.empty((X.shape[0], W.shape[0]), dtype=np.float32)
    if isinstance(W, MXFP4):
        K.mxfp4_matvec(W.packed, W.scales, X, Y)
    elif isinstance(W, I8R):
        K.i8r_matvec(W.q, W.scales, X, Y)
    else:
        K.matvec(W, X, Y)
    return Y


def mvs(Ws: Sequence[Matrix], X: np.ndarray) -> list[np.ndarray]:
    """mv(W, X) for several matrices sharing the input X, in one kernel call (one thread
    region) when they are all plain BF16/float32 arrays; bits as one mv each."""
    Ys = [np.empty((X.shape[0], W.shape[0]), dtype=np.float32) for W in Ws]
    if all(isinstance(W, np.ndarray) for W in Ws):
        K.matvecs(list(Ws), X, Ys)
    else:                                     # MXFP4 / I8R matrices (a draft trunk)
        for W, Y in zip(Ws, Ys):
            mv(W, X, Y)
    return Ys


@dataclass
class KDAWeights:
    q_proj: Matrix
    k_proj: Matrix
    v_proj: Matrix
    q_conv: np.ndarray      # [P, K] float32 (checkpoint shape [P, 1, K])
    k_conv: np.ndarray
    v_conv: np.ndarray
    f_a: Matrix             # [D, E]
    f_b: Matrix             # [P, D]
    b_proj: Matrix          # [H, E]
    g_proj: Matrix          # [P, E]
    o_proj: Matrix          # [E, P]
    A_log: np.ndarray       # [H] float32: per HEAD (the checkpoint pads it to D)
    dt_bias: np.ndarray     # [P]
    o_norm: np.ndarray      # [D], shared by all heads


@dataclass
class MLAWeights:
    q_a_proj: Matrix
    q_a_norm: np.ndarray
    q_b_proj: Matrix
    kv_a_proj: Matrix       # [R_kv + d_r, E]: latent and the shared rope key
    kv_a_norm: np.ndarray   # [R_kv]: the latent part only
    kv_b_proj: Matrix
    o_proj: Matrix
    g_proj: Matrix | None   # None when mla_use_output_gate is false


@dataclass
class DenseWeights:
    gate: Matrix
    up: Matrix
    down: Matrix


@dataclass
class ExpertWeights:
    w1: Matrix              # gate [I, L_t]
    w3: Matrix              # up   [I, L_t]
    w2: Matrix              # down [L_t, I]


@dataclass
class MoEWeights:
    router: np.ndarray      # [N_x, E] float32 or BF16 bits (read by the router's own kernel)
    bias: np.ndarray        # [N_x] e_score_correction_bias
    down_lat: Matrix        # [L_t, E]
    up_lat: Matrix          # [E, L_t]
    lat_norm: np.ndarray    # [L_t]
    shared: DenseWeights    # the fused shared experts (width I * N_s)


@dataclass
class LayerWeights:
    input_norm: np.ndarray
    post_norm: np.ndarray
    phi_attn: np.ndarray    # f32(self_attention_res_norm * self_attention_res_proj)
    phi_mlp: np.ndarray     # f32(mlp_res_norm * mlp_res_proj)
    attn: KDAWeights | MLAWeights
    mlp: DenseWeights | MoEWeights


@dataclass
class ModelTables:
    embed: np.ndarray       # [V, E] BF16 bits or float32
    lm_head: Matrix         # [V, E]
    final_norm: np.ndarray
    phi_out: np.ndarray     # f32(output_attn_res_norm * output_attn_res_proj)

    def embed_into(self, ids: np.ndarray, out: np.ndarray) -> None:
        """Gather and widen the embedding rows of `ids` into out [T, E]."""
        K.embed(self.embed, ids, out)

    def project(self, x: np.ndarray) -> np.ndarray:
        """Logits [T, V] of the normalised rows x [T, E]."""
        return mv(self.lm_head, x)


def fold_phi(norm: np.ndarray, proj: np.ndarray) -> np.ndarray:
    """AttnRes folds norm gain and 1xE projection into one float32 vector (§4.8)."""
    return (np.asarray(norm, np.float32).reshape(-1) *
            np.asarray(proj, np.float32).reshape(-1)).astype(np.float32)


class WeightProvider(Protocol):
    tables: ModelTables

    def layer(self, L: int) -> LayerWeights: ...

    def release(self, L: int) -> None: ...


class ExpertSource(Protocol):
    def batches(self, layer: int, experts: list[int]) -> Iterator[list[tuple[int, ExpertWeights]]]:
        """Yield the requested experts in groups that are resident together; a group
        stays valid until the next one is requested."""
        ...
