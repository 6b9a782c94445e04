"""Numeric kernels (Cython, nogil, OpenMP).  See _kernels.pyx for the exactness rules."""
from ._kernels import (  # noqa: F401
    add, argmax, attnres, axpy, embed, fnv_fold_words, get_num_threads, kda_decay, kda_q_scale,
    i8r_matvec, isa, isas_available, kda_recurrence, l2norm_heads, matvec, mla_attention, mul_sigmoid, mxfp4_dequant,
    mxfp4_matvec, par_min_work, rmsnorm, route_scores, router, set_isa, set_num_threads, set_simd, shortconv,
    sigmoid, simd_active, situ_glu,
)
