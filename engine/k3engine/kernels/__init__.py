"""Numeric kernels (Cython, nogil, OpenMP).  See _kernels.pyx for the exactness rules."""
import os

# libgomp's default wait policy keeps a worker spinning after every parallel region.  A
# decode step runs hundreds of regions with Python in between, so the spinning worker holds
# a core the whole step: whatever else wants it (the trunk and expert reader threads, the
# app, any other process) waits in the run queue.  On this project's 2-vCPU machine with
# one other busy process, a 2-thread resident mid-checkpoint step took 3.2-3.5 s spinning
# and 0.29-0.53 s passive (1 thread: 0.39-0.48; docs/benchmarks-engine.md, "Threads").
# libgomp reads the variable when it is loaded, i.e. when _kernels is imported below; a
# user's own setting wins.  tests/test_kernels.py::test_openmp_workers_wait_passively
# (A decode step's loops - matvecs, experts, KDA heads, MLA heads - no longer use OpenMP:
# they run on k3pool.h's threads, which stay awake between kernels yet yield their CPU;
# OpenMP is left with prefill-only loops, where each region is long.)
os.environ.setdefault("OMP_WAIT_POLICY", "passive")
from ._kernels import (  # noqa: F401
    add, argmax, attnres, axpy, embed, fnv_fold_words, gather_rows, get_num_threads, kda_decay,
    kda_q_scale, KEY_BLOCK, moe_combine, moe_experts, moe_groups, route_tokens,
    i8r_matvec, isa, isas_available, kda_recurrence, l2norm_heads, libm_replicas_active, matvec, matvecs, mla_attention, mul_sigmoid, mxfp4_dequant,
    mxfp4_matvec, mxq_active, mxq_groups, mxq_supported, PANEL_MIN_TOKENS, PANEL_WIDE_INPUTS, panel_wide_tiles, par_min_work, rmsnorm, route_scores, router, set_isa, set_num_threads, set_simd,
    set_mx_tokens_min, set_mxq, set_panel_min_tokens, set_panel_wide_tiles, set_pool, pool_stats, set_token_block_bytes, shortconv,
    sigmoid, simd_active, situ_glu, tanh_exp,
)

# The entry points that compute (the forward calls these; the rest set or report how).
KERNEL_ENTRY_POINTS = (
    "add", "argmax", "attnres", "axpy", "embed", "gather_rows", "i8r_matvec", "kda_decay",
    "kda_q_scale", "kda_recurrence", "l2norm_heads", "matvec", "matvecs", "mla_attention",
    "moe_combine", "moe_experts", "moe_groups", "mul_sigmoid", "mxfp4_matvec", "rmsnorm",
    "route_tokens", "router", "shortconv", "sigmoid", "situ_glu",
)
