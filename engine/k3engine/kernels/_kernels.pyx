# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True, initializedcheck=False
"""Every numeric kernel of the forward pass (ARCHITECTURE §4-§5), nogil, threads over
independent outputs only (rows, heads, tokens, channels), never over one reduction, so
results do not depend on the thread count.  The loops a decode step runs hundreds of times
(matvecs, experts, KDA and MLA heads) use k3pool.h's threads (`_run`); the rest OpenMP.

Float32 traps handled here (each has a test in tests/test_kernels.py):
* Cython writes `1.0` as a C double literal; a float expression that touches it is silently
  evaluated in double.  Every float32 chain below uses the typed constants F1/F0 instead.
* expf/tanhf come from libm (NumPy's float32 SIMD versions differ in the last bit and fail
  the peer's `moe` fixture); SiTU's and sigma's, on AVX2 and AVX-512, from k3math.h's replicas of
  glibc's own code, used only when they equal the linked libm at load
  (libm_replicas_active).
* No FMA in float32 chains: the build passes -ffp-contract=off (setup.py).  The row kernels
  of k3dot.h use explicit FMA only inside double reductions whose products are exact,
  where it rounds exactly like the separate multiply and add.
"""
from libc.math cimport expf, tanhf, sqrt, sqrtf, ldexp
from libc.stdint cimport int8_t, uint8_t, uint16_t, int32_t, int64_t, uint64_t
from libc.stdlib cimport malloc, calloc, free
from cython.parallel cimport prange, parallel
import os
import warnings

import numpy as np

cdef extern from "k3dot.h" nogil:
    void k3_mv_rows_f32(const float *W, long ldw, long n, long o0, long o1, const double *Xd,
                        long ntok, const float *scale, float *Y, long ldy)
    void k3_mv_rows_bf16(const uint16_t *W, long ldw, long n, long o0, long o1,
                         const double *Xd, long ntok, const float *scale, float *Y, long ldy)
    void k3_mv_rows_i8(const int8_t *W, long ldw, long n, long o0, long o1, const double *Xd,
                       long ntok, const float *scale, float *Y, long ldy)
    void k3_mv_rows_mxfp4(const uint8_t *P, const uint8_t *S, long n, long o0, long o1,
                          const double *Xd, long ntok, float *Y, long ldy)
    float k3_bf16_to_f32(uint16_t b)
    int k3_set_isa(int isa)
    void k3_set_token_block_bytes(long b)
    void k3_set_panel_min_tokens(long t)
    void k3_set_panel_wide_tiles(int mode)
    int k3_panel_wide_tiles_on()
    void k3_set_mx_tokens_min(long t)
    enum: K3_PANEL_MIN_TOKENS
    long K3_PANEL_WIDE_INPUTS
    int k3_isa()
    int k3_isa_best()
    void k3_e8m0_init()
    const double K3_E2M1[16]

cdef extern from "k3mxint.h" nogil:
    ctypedef struct k3_mxq_group:
        int32_t exact
    ctypedef struct k3_mxq:
        int planes
        long ngroups, nexact
        k3_mxq_group *g
    k3_mxq *k3_mxq_make(const double *x, long n)
    void k3_mv_rows_mxfp4q(const uint8_t *P, const uint8_t *S, long n, long o0, long o1,
                           const double *Xd, long ntok, float *Y, long ldy, k3_mxq **qs)
    enum: K3_MXQ_TOKENS_MAX
    int k3_set_mxq(int on, int planes)
    int k3_mxq_active()
    int k3_mxq_supported()

cdef extern from "k3pool.h" nogil:
    ctypedef void (*k3_task_fn)(void *ctx, long item) noexcept nogil
    void k3_pool_run(k3_task_fn fn, void *ctx, long n, int threads)
    void *k3_scratch(size_t bytes)
    int k3_pool_started()
    long k3_pool_items_by_workers()
    long k3_pool_spin_us

cdef extern from "k3math.h" nogil:
    float k3_sigm(float x)
    void k3_situ_rows(const float *g, const float *u, long n, float b1, float b2, float *yf,
                      double *yd)
    void k3_sigm_rows(const float *g, long n, float *y, int mul)
    void k3_math_init()
    int k3_math_active()
    int k3_tanh_exp_rows(const float *x, long n, float *t, float *e, int replica)

cdef extern from "k3route.h" nogil:
    void k3_route_logits_f32(const float *W, long N, long n, const double *x, double *out,
                             long e0, long e1)
    void k3_route_logits_bf16(const uint16_t *W, long N, long n, const double *x,
                              double *out, long e0, long e1)

cdef extern from "k3mla.h" nogil:
    long k3_mla_block_work(long dq, long dv, long npos)
    int K3_MLA_G
    int K3_KEY_BLOCK
    void k3_mla_block_avx512(const float *Q, long ldq, const float *Kh, const float *Vh,
                             long ldv, const float *R, long dn, long dr, long dv, long p0,
                             int ntok, float kappa, float *O, long ldo, double *work)

cdef float F1 = 1.0
cdef float F0 = 0.0
cdef float L2_EPS = 1e-6          # float32 constant, widened where used (§4.1)
DEF MAX_SOURCES = 256             # AttnRes sources per aggregation (real K3: 9)
DEF MAX_TOPK = 64                 # reference ceiling (config rule 5)

k3_e8m0_init()                    # scale tables and the CPU probe, once, before any thread
k3_isa_best()
k3_set_panel_wide_tiles(-1)
k3_math_init()                    # the libm replicas checked against this process's libm

ISA_NAMES = ("scalar", "avx2", "avx512")   # index = the C enum (k3dot.h)
ISA_ENV = "K3_KERNEL_ISA"


def isas_available():
    """The row-kernel paths this CPU can run, slowest first (always includes 'scalar')."""
    return ISA_NAMES[:k3_isa_best() + 1]


def set_isa(name):
    """Force the row kernels' instruction set: 'scalar', 'avx2', 'avx512' or 'auto' (the
    best this CPU has).  All paths compute identical bits; the switch exists so tests can
    prove it.  A path the CPU lacks is refused (it would crash, not just run slowly)."""
    if name == "auto":
        k3_set_isa(-1)
        return
    if name not in ISA_NAMES:
        raise ValueError(f"unknown kernel ISA {name!r}: expected one of "
                         f"{', '.join(ISA_NAMES)} or auto")
    if name not in isas_available():
        raise ValueError(f"kernel ISA {name!r} is not supported by this CPU "
                         f"(available: {', '.join(isas_available())})")
    k3_set_isa(ISA_NAMES.index(name))


def set_token_block_bytes(long nbytes):
    """The row drivers' token block, in bytes of widened inputs (0: the built-in 256 KiB).
    No bit depends on it; benchmarks switch it to measure what the blocking buys."""
    k3_set_token_block_bytes(nbytes)


PANEL_MIN_TOKENS = K3_PANEL_MIN_TOKENS    # the built-in threshold (the forecast prices by it)
PANEL_WIDE_INPUTS = K3_PANEL_WIDE_INPUTS  # wider inputs: a panel block short of 48 tokens
KEY_BLOCK = K3_KEY_BLOCK  # positions per MLA key block (state.MLAState's layout)


def set_panel_min_tokens(long ntok):
    """The fewest tokens a BF16, F32 or I8R matvec runs through the AVX-512 panels (0: the
    built-in 5; a huge value: never, the tiles only).  No bit depends on it; benchmarks
    A/B it."""
    k3_set_panel_min_tokens(ntok)


def set_panel_wide_tiles(int mode):
    """Whether AVX-512 matvecs wider than 2,730 inputs (a panel token block short of 48
    tokens) take the tiles instead of the panels: -1 by the CPU (AMD: tiles, k3dot.h says
    why), 0 panels, 1 tiles.  No bit depends on it; tests and benchmarks A/B it."""
    k3_set_panel_wide_tiles(mode)


def panel_wide_tiles():
    """Whether AVX-512 matvecs wider than 2,730 inputs take the tiles
    (set_panel_wide_tiles)."""
    return bool(k3_panel_wide_tiles_on())


def set_mx_tokens_min(long ntok):
    """The fewest tokens an AVX-512 MXFP4 matvec decodes each group once for (0: the
    built-in 8; a huge value: never, the 4-token tiles only).  No bit depends on it;
    benchmarks and tests A/B it."""
    k3_set_mx_tokens_min(ntok)


def set_mxq(on=True, int planes=0):
    """Switch the integer path of MXFP4 matvecs of one or two tokens (k3mxint.h: VNNI byte
    products wherever a group's sum is exact in any order, the double path elsewhere).  `planes`
    caps the digit planes a group may take (1..6; 0 keeps the cap; groups needing more take
    the double path).  No bit depends on either; tests and benchmarks A/B them.  Returns
    whether the path is in use (False where the CPU lacks AVX-512 VNNI/VBMI)."""
    return bool(k3_set_mxq(1 if on else 0, planes))


def mxq_groups(const float[::1] x):
    """How the integer path would take one token x (len a multiple of 32): (planes, exact)
    with exact[g] True where group g's sum runs on integers (False: the double path).
    (0, all False) when the path is off or fewer than 2/3 of the groups qualify (the whole
    call then takes the double path)."""
    cdef Py_ssize_t n = x.shape[0], i
    exact = np.zeros(n // 32, dtype=bool)
    cdef double[::1] xd = np.empty(max(n, 1), dtype=np.float64)
    for i in range(n):
        xd[i] = x[i]
    cdef k3_mxq *q = k3_mxq_make(&xd[0], n)
    if q == NULL:
        return 0, exact
    try:
        for i in range(q.ngroups):
            exact[i] = q.g[i].exact != 0
        return q.planes, exact
    finally:
        free(q)


def mxq_active():
    """Whether MXFP4 matvecs of one or two tokens take the integer path (needs the avx512
    row path active and AVX-512 VNNI/VBMI/CD on the CPU)."""
    return bool(k3_mxq_active())


def mxq_supported():
    """Whether this CPU can run the integer path at all."""
    return bool(k3_mxq_supported())


def isa():
    """The row-kernel path in use: 'scalar', 'avx2' or 'avx512'."""
    return ISA_NAMES[k3_isa()]


def _isa_from_env():
    want = os.environ.get(ISA_ENV, "auto").strip().lower() or "auto"
    try:
        set_isa(want)
    except ValueError as e:       # a typo or a foreign CPU must not stop the engine
        k3_set_isa(-1)
        warnings.warn(f"{ISA_ENV}={want!r} ignored: {e}; using {isa()}", RuntimeWarning)


_isa_from_env()
# K3_MXFP4_INT=0 keeps 1-2-token MXFP4 matvecs on the double path (benchmarks A/B whole
# runs with it; the bits are the same either way).
if os.environ.get("K3_MXFP4_INT", "1").strip() == "0":
    k3_set_mxq(0, 0)

cdef int _nthreads = 1
# Below this many multiply-adds a parallel region costs more than it saves (measured on the
# demo model: 2 threads at 1<<15 ran 5x slower than 1 thread).  Bits never depend on it.
cdef long PAR_MIN_WORK = 1 << 20


def set_num_threads(int n):
    """Compute threads for every kernel (>= 1)."""
    global _nthreads
    if n < 1:
        raise ValueError("threads must be >= 1")
    _nthreads = n


def get_num_threads():
    return _nthreads


def par_min_work():
    """Multiply-adds at which a kernel goes parallel (tests size their shapes above it)."""
    return PAR_MIN_WORK


def set_simd(bint on):
    """set_isa('auto') or set_isa('scalar') (kept for callers that only know on/off)."""
    set_isa("auto" if on else "scalar")


def simd_active():
    return k3_isa() != 0


cdef inline int _threads_for(long work) noexcept nogil:
    return _nthreads if work >= PAR_MIN_WORK else 1


cdef bint _use_pool = True


def set_pool(bint on, long spin_us=-1):
    """The decode step's loops (matvecs, experts, KDA and MLA heads) on k3pool.h's threads
    (on, the default) or on OpenMP regions (off: benchmarks and tests A/B them); spin_us
    >= 0 sets how long an idle pool worker stays awake.  No bit depends on either."""
    global _use_pool, k3_pool_spin_us
    _use_pool = on
    if spin_us >= 0:
        k3_pool_spin_us = spin_us


def pool_stats():
    """(workers started, items the workers have run) of k3pool.h, for tests."""
    return k3_pool_started(), k3_pool_items_by_workers()


cdef void _run(k3_task_fn fn, void *ctx, Py_ssize_t n, int nt) noexcept nogil:
    """fn(ctx, i) for every i < n on nt threads, items taken dynamically (k3pool.h)."""
    cdef Py_ssize_t i
    if _use_pool or nt <= 1:
        k3_pool_run(fn, ctx, n, nt)
    else:
        for i in prange(n, num_threads=nt, schedule="dynamic"):
            fn(ctx, i)


def libm_replicas_active():
    """True when SiTU and sigma run on k3math.h's replicas of libm's expf/tanhf for the
    selected path (AVX2 or AVX-512: the CPU runs it and its replicas equalled the linked
    libm at load); False: every element calls libm."""
    return bool(k3_math_active())


def tanh_exp(const float[::1] X, float[::1] T, float[::1] E, bint replica):
    """T = tanhf(X), E = expf(X) by k3math.h's replicas (replica, when active) or by libm
    (tests compare the two).  Returns True if the replicas ran."""
    if T.shape[0] != X.shape[0] or E.shape[0] != X.shape[0]:
        raise ValueError("tanh_exp shapes do not match")
    if X.shape[0] == 0:
        return False
    cdef int r
    with nogil:
        r = k3_tanh_exp_rows(&X[0], X.shape[0], &T[0], &E[0], replica)
    return bool(r)


# ---- matvec (§5.3, §5.6) -------------------------------------------------------------

def matvec(W, const float[:, ::1] X, float[:, ::1] Y):
    """Y[t, o] = sum_i W[o, i] * X[t, i] with the 16-lane double order, per token.
    W is float32 or BF16 bit patterns (uint16), row-major [out, in].  With T > 1 each weight
    block is widened once for a tile of up to 4 tokens (k3dot.h); per-token bits are those
    of a T = 1 call.  (matvecs of one matrix: the same checks, thread loop and row chunks.)"""
    matvecs([W], X, [Y])


cdef _check_mv(long wout, long win, const float[:, ::1] X, float[:, ::1] Y):
    if X.shape[1] != win or Y.shape[1] != wout or X.shape[0] != Y.shape[0]:
        raise ValueError(f"matvec shapes: W [{wout},{win}] X [{X.shape[0]},{X.shape[1]}] "
                         f"Y [{Y.shape[0]},{Y.shape[1]}]")


cdef double[:, ::1] _widened(const float[:, ::1] X):
    """The inputs widened to double once per call (exact), not once per output row, into a
    buffer starting on a 64-byte line.  Why aligned: the SIMD paths load x 64 bytes at a
    time, and NumPy's own buffers often start 16 bytes into a line (large ones are mmap'd
    after a 16-byte header), which splits every such load across two lines (BF16 panel,
    2048 x 2048, T = 512, 1 thread, a C harness: 28 G multiply-adds/s aligned, 23 at +16).
    Not for one token: its row is read from L1 for every weight row, and the aligned copy
    would add ~1.4 us to each of a decode step's hundreds of calls."""
    cdef Py_ssize_t T = X.shape[0], n = X.shape[1]
    if T == 1:
        return np.asarray(X, dtype=np.float64)
    buf = np.empty(T * n + 8, np.float64)
    cdef Py_ssize_t off = (-buf.ctypes.data % 64) // 8
    Xd = buf[off:off + T * n].reshape(T, n)
    Xd[...] = X
    return Xd


# Rows per parallel work item: a multiple of every tile height, small enough to balance.
DEF ROW_CHUNK = 16
DEF PREFILL_TOKENS = 32     # from here on a matvec's work items are 64..PREFILL_ROWS rows
DEF PREFILL_ROWS = 256
DEF DECODE_ITEMS_PER_THREAD = 8   # T = 1: items as long as this many per thread allows


cdef inline Py_ssize_t _row_chunk(Py_ssize_t T, Py_ssize_t rows) noexcept nogil:
    """Rows per work item for T tokens over `rows` rows in all.  Why larger for a prefill:
    each item streams its tokens' widened inputs (MBs at T = 512) from L3 once, and the
    panels re-read a token block from L2 once per 4-row tile; 64-row items read them a
    quarter as often (BF16 2048 x 2048, T = 512, 1 thread, a C harness: 16.0 -> 21.8 G
    multiply-adds/s), and 256-row items a sixteenth (T = 256, Xeon: 29.2 -> 34.4 G in
    the harness).  Only while that leaves >= 4 items per thread: with many cores the
    balance matters more.  Why larger for a decode step (T = 1): a 16-row item of a
    2048-wide BF16 matrix is 64 KB, so each thread's stream broke off every 64 KB (and its
    prefetch ran into the other thread's rows); 8 items per thread keep the dynamic
    balance (a thread whose CPU is taken leaves its items to the others).  Intel Xeon,
    2 threads, resident mid decode step 149-158 -> 133-139 ms quiet and 203-217 -> 196-204
    ms with a busy loop on one CPU (docs/benchmarks-engine.md, 2026-12-02 Xeon).  No bit
    depends on it."""
    cdef Py_ssize_t rc
    if T >= PREFILL_TOKENS and rows >= 4 * ROW_CHUNK * 4 * _nthreads:
        rc = rows // (4 * _nthreads) // ROW_CHUNK * ROW_CHUNK
        return min(rc, PREFILL_ROWS)
    if T == 1:
        return max(rows // (DECODE_ITEMS_PER_THREAD * _nthreads) // ROW_CHUNK * ROW_CHUNK,
                   ROW_CHUNK)
    return ROW_CHUNK


DEF MV_F32 = 0
DEF MV_BF16 = 1
DEF MV_I8 = 2
DEF MV_MXFP4 = 3

cdef struct _MvTask:               # row chunks of matrices sharing one input
    const void **w                   # weights (packed nibbles for MXFP4)
    const void **aux                 # I8R row scales / MXFP4 group scales, else NULL
    int *kind
    long *rows
    float **y
    const int32_t *items             # (matrix, chunk) pairs; NULL: matrix 0, chunk = item
    long n, T, rc
    const double *Xd
    k3_mxq **q                       # each token's integer-path form (MXFP4, T <= 2) or NULL


cdef void _mv_item(void *ctx, long it) noexcept nogil:
    cdef _MvTask *m = <_MvTask *>ctx
    cdef long g = 0, c = it, o0, o1
    if m.items != NULL:
        g, c = m.items[2 * it], m.items[2 * it + 1]
    o0, o1 = c * m.rc, min(m.rows[g], (c + 1) * m.rc)
    if m.kind[g] == MV_BF16:
        k3_mv_rows_bf16(<const uint16_t *>m.w[g], m.n, m.n, o0, o1, m.Xd, m.T, NULL, m.y[g],
                        m.rows[g])
    elif m.kind[g] == MV_F32:
        k3_mv_rows_f32(<const float *>m.w[g], m.n, m.n, o0, o1, m.Xd, m.T, NULL, m.y[g],
                       m.rows[g])
    elif m.kind[g] == MV_I8:
        k3_mv_rows_i8(<const int8_t *>m.w[g], m.n, m.n, o0, o1, m.Xd, m.T,
                      <const float *>m.aux[g], m.y[g], m.rows[g])
    else:
        k3_mv_rows_mxfp4q(<const uint8_t *>m.w[g], <const uint8_t *>m.aux[g], m.n, o0, o1,
                          m.Xd, m.T, m.y[g], m.rows[g], m.q)


cdef void _mv_one(int kind, const void *w, const void *aux, long rows, long n,
                  const float[:, ::1] X, float[:, ::1] Y):
    """One matrix's row chunks (mxfp4_matvec, i8r_matvec)."""
    cdef long T = X.shape[0]
    if rows == 0 or T == 0:
        return
    cdef double[:, ::1] Xd = _widened(X)
    cdef float *yp = &Y[0, 0]
    cdef _MvTask m
    m.w, m.aux, m.kind, m.rows, m.y, m.items = &w, &aux, &kind, &rows, &yp, NULL
    m.n, m.T, m.rc, m.Xd = n, T, _row_chunk(T, rows), &Xd[0, 0]
    m.q = _plans(&Xd[0, 0], n, T) if kind == MV_MXFP4 else NULL
    try:
        with nogil:
            _run(_mv_item, &m, (rows + m.rc - 1) // m.rc, _threads_for(rows * n * T))
    finally:
        _free_plans(m.q, T)


cdef k3_mxq **_plans(const double *Xd, long n, long T) noexcept nogil:
    """Each of T tokens (rows of Xd) prepared for the integer MXFP4 path (k3mxint.h), or
    NULL where that path does not apply (more tokens than it takes, path off)."""
    if T < 1 or T > K3_MXQ_TOKENS_MAX or not k3_mxq_active():
        return NULL
    cdef k3_mxq **qs = <k3_mxq **>calloc(T, sizeof(k3_mxq *))
    cdef long t
    if qs != NULL:
        for t in range(T):
            qs[t] = k3_mxq_make(Xd + t * n, n)
    return qs


cdef void _free_plans(k3_mxq **qs, long T) noexcept nogil:
    cdef long t
    if qs != NULL:
        for t in range(T):
            free(qs[t])
        free(qs)


def matvecs(list Ws, const float[:, ::1] X, list Ys):
    """Ys[i] = Ws[i] @ X for matrices sharing one input (a layer's projections of its normed
    x): X widened once and one thread loop (`_run`) over every matrix's row chunks.  Each
    Ys[i] has the bits of `matvec(Ws[i], X, Ys[i])`; only the loops are merged (at 2 threads
    a KDA layer's six projections took 2.89 ms as six OpenMP regions, 2.57 ms as one)."""
    cdef Py_ssize_t G = len(Ws), T = X.shape[0], n = X.shape[1], g, c, it, na = 0
    cdef long work = 0
    cdef Py_ssize_t rc, all_rows = 0
    if len(Ys) != G:
        raise ValueError(f"matvecs: {G} matrices but {len(Ys)} outputs")
    if G == 0:
        return
    cdef const void **wp = <const void **>malloc(G * sizeof(void *))
    cdef const void **aux = <const void **>calloc(G, sizeof(void *))
    cdef float **yp = <float **>malloc(G * sizeof(float *))
    cdef long *rows = <long *>malloc(G * sizeof(long))
    cdef int *kind = <int *>malloc(G * sizeof(int))
    cdef int32_t *items = NULL
    cdef const uint16_t[:, ::1] Wb
    cdef const float[:, ::1] Wf
    cdef float[:, ::1] Yv
    cdef double[:, ::1] Xd
    cdef _MvTask m
    try:
        if wp == NULL or aux == NULL or yp == NULL or rows == NULL or kind == NULL:
            raise MemoryError("matvecs: no memory for the matrices")
        for g in range(G):
            W, Y = Ws[g], Ys[g]
            if W.dtype == np.uint16:
                Wb = W
                wp[g], rows[g], kind[g] = &Wb[0, 0], Wb.shape[0], MV_BF16
                _check_mv(Wb.shape[0], Wb.shape[1], X, Y)
            elif W.dtype == np.float32:
                Wf = W
                wp[g], rows[g], kind[g] = &Wf[0, 0], Wf.shape[0], MV_F32
                _check_mv(Wf.shape[0], Wf.shape[1], X, Y)
            else:
                raise TypeError(f"matvec weights must be float32 or bf16 (uint16), got "
                                f"{W.dtype}")
            Yv = Y
            yp[g] = &Yv[0, 0] if rows[g] else NULL
            all_rows += rows[g]
            work += rows[g] * n * T
        rc = _row_chunk(T, all_rows)
        for g in range(G):
            na += (rows[g] + rc - 1) // rc
        items = <int32_t *>malloc(max(2 * na, 1) * sizeof(int32_t))
        if items == NULL:
            raise MemoryError("matvecs: no memory for the row chunks")
        it = 0
        for g in range(G):
            for c in range((rows[g] + rc - 1) // rc):
                items[2 * it], items[2 * it + 1], it = g, c, it + 1
        Xd = _widened(X)
        m.w, m.aux, m.kind, m.rows, m.y, m.items = wp, aux, kind, rows, yp, items
        m.n, m.T, m.rc, m.Xd, m.q = n, T, rc, &Xd[0, 0], NULL
        with nogil:
            _run(_mv_item, &m, na, _threads_for(work))
    finally:
        free(wp)
        free(aux)
        free(yp)
        free(rows)
        free(kind)
        free(items)


def mxfp4_matvec(const uint8_t[:, ::1] P, const uint8_t[:, ::1] S,
                 const float[:, ::1] X, float[:, ::1] Y):
    """MXFP4 matvec straight from the nibbles (§5.6): P [out, n/2], S [out, n/32]."""
    cdef Py_ssize_t nout = P.shape[0], n = P.shape[1] * 2
    if S.shape[0] != nout or S.shape[1] * 32 != n:
        raise ValueError(f"MXFP4 scales [{S.shape[0]},{S.shape[1]}] do not fit packed "
                         f"[{P.shape[0]},{P.shape[1]}] with groups of 32")
    _check_mv(nout, n, X, Y)
    if nout:
        _mv_one(MV_MXFP4, &P[0, 0], &S[0, 0], nout, n, X, Y)


def i8r_matvec(const int8_t[:, ::1] Q, const float[::1] S, const float[:, ::1] X,
               float[:, ::1] Y):
    """Y[t, o] = S[o] * sum_i Q[o, i] * X[t, i]: int8 rows with one float32 scale each
    (a draft trunk's I8R matrices), the sum in the 16-lane double order."""
    cdef Py_ssize_t nout = Q.shape[0], n = Q.shape[1]
    if S.shape[0] != nout:
        raise ValueError(f"I8R scales [{S.shape[0]}] do not fit rows [{nout}]")
    _check_mv(nout, n, X, Y)
    if nout:
        _mv_one(MV_I8, &Q[0, 0], &S[0], nout, n, X, Y)


def mxfp4_dequant(const uint8_t[:, ::1] P, const uint8_t[:, ::1] S):
    """Dequantise to float32 (tests and tools only: the engine never materialises an
    expert).  A group whose scale byte is 255 dequantises to zeros, matching the matvec."""
    cdef Py_ssize_t r, j, rows = P.shape[0], n = P.shape[1] * 2
    if S.shape[0] != rows or S.shape[1] * 32 != n:
        raise ValueError("MXFP4 scales do not fit the packed matrix with groups of 32")
    out = np.empty((rows, n), dtype=np.float32)
    cdef float[:, ::1] Y = out
    cdef uint8_t code, sb
    with nogil:
        for r in range(rows):
            for j in range(n):
                code = (P[r, j >> 1] >> 4) if (j & 1) else (P[r, j >> 1] & 15)
                sb = S[r, j >> 5]
                if sb == 255:
                    Y[r, j] = F0
                else:
                    Y[r, j] = <float>(K3_E2M1[code] * ldexp(1.0, <int>sb - 127))
    return out


# ---- norms and activations (§4.1) ----------------------------------------------------

cdef inline void _rms_row(const float *x, const float *w, float eps, Py_ssize_t n,
                          float *y) noexcept nogil:
    cdef double s = 0.0
    cdef Py_ssize_t i
    for i in range(n):
        s += <double>x[i] * <double>x[i]
    cdef float r = <float>(1.0 / sqrt(s / <double>n + <double>eps))
    cdef float wx
    for i in range(n):
        wx = w[i] * x[i]          # gain first, then the scale (SF order, trap #16)
        y[i] = wx * r


def rmsnorm(const float[:, ::1] X, const float[::1] w, float eps, float[:, ::1] Y):
    """Row-wise RMSNorm; Y may be X (in place)."""
    cdef Py_ssize_t t, T = X.shape[0], n = X.shape[1]
    if w.shape[0] != n or Y.shape[0] != T or Y.shape[1] != n:
        raise ValueError("rmsnorm shapes do not match")
    with nogil:
        for t in range(T):
            _rms_row(&X[t, 0], &w[0], eps, n, &Y[t, 0])


def l2norm_heads(float[:, ::1] X, Py_ssize_t D):
    """In place: each D-slice of each row scaled by 1/sqrt(sum of squares + 1e-6) (§4.1)."""
    cdef Py_ssize_t t, h, i, T = X.shape[0], H = X.shape[1] // D
    cdef double s
    cdef float r
    if H * D != X.shape[1]:
        raise ValueError("l2norm_heads: width is not a multiple of the head dim")
    with nogil:
        for t in range(T):
            for h in range(H):
                s = 0.0
                for i in range(D):
                    s += <double>X[t, h * D + i] * <double>X[t, h * D + i]
                r = <float>(1.0 / sqrt(s + <double>L2_EPS))
                for i in range(D):
                    X[t, h * D + i] = X[t, h * D + i] * r


# The elementwise kernels below walk raw pointers over the whole C-contiguous array (no
# per-element memoryview indexing) and split the elements over threads when there are
# enough: each element is computed alone with libm's expf/tanhf, or SiTU's with k3math.h's
# replicas of them (§5.4: a generic vectorised exp/tanh is not bit-identical), so no bit
# depends on the thread.
DEF TRANSCENDENTAL_WORK = 16      # one libm expf/tanhf counted as this many multiply-adds
DEF ELEMENT_BLOCK = 1024          # elements per work item of SiTU and sigma (16 | it)


def situ_glu(const float[:, ::1] G, const float[:, ::1] U, float b1, float b2,
             float[:, ::1] Y):
    """Y = SiTU(G) * capped U elementwise; Y may be G (in place)."""
    cdef Py_ssize_t i, T = G.shape[0], n = G.shape[1]
    if U.shape[0] != T or U.shape[1] != n or Y.shape[0] != T or Y.shape[1] != n:
        raise ValueError("situ_glu shapes do not match")
    if T * n == 0:
        return
    cdef const float *g = &G[0, 0]
    cdef const float *u = &U[0, 0]
    cdef float *y = &Y[0, 0]
    cdef Py_ssize_t nb = (T * n + ELEMENT_BLOCK - 1) // ELEMENT_BLOCK
    with nogil:
        for i in prange(nb, num_threads=_threads_for(T * n * TRANSCENDENTAL_WORK),
                        schedule="static"):
            k3_situ_rows(g + i * ELEMENT_BLOCK, u + i * ELEMENT_BLOCK,
                         min(ELEMENT_BLOCK, T * n - i * ELEMENT_BLOCK), b1, b2,
                         y + i * ELEMENT_BLOCK, NULL)


cdef void _sigm_blocks(const float *g, Py_ssize_t n, float *y, int mul) noexcept nogil:
    """y = sigma(g) (mul 0) or y * sigma(g) (mul 1) over n elements, in thread blocks."""
    cdef Py_ssize_t i, nb = (n + ELEMENT_BLOCK - 1) // ELEMENT_BLOCK
    for i in prange(nb, num_threads=_threads_for(n * TRANSCENDENTAL_WORK), schedule="static"):
        k3_sigm_rows(g + i * ELEMENT_BLOCK, min(ELEMENT_BLOCK, n - i * ELEMENT_BLOCK),
                     y + i * ELEMENT_BLOCK, mul)


def sigmoid(float[:, ::1] X):
    """In place X = sigma(X), float32 (KDA beta)."""
    cdef Py_ssize_t n = X.shape[0] * X.shape[1]
    if n == 0:
        return
    with nogil:
        _sigm_blocks(&X[0, 0], n, &X[0, 0], 0)


def mul_sigmoid(float[:, ::1] X, const float[:, ::1] G):
    """In place X = f32(X * sigma(G)) (output gates)."""
    cdef Py_ssize_t T = X.shape[0], n = X.shape[1]
    if G.shape[0] != T or G.shape[1] != n:
        raise ValueError("mul_sigmoid shapes do not match")
    if T * n == 0:
        return
    with nogil:
        _sigm_blocks(&G[0, 0], T * n, &X[0, 0], 1)


def add(float[:, ::1] A, const float[:, ::1] B):
    """In place A = f32(A + B)."""
    cdef Py_ssize_t i, T = A.shape[0], n = A.shape[1]
    if B.shape[0] != T or B.shape[1] != n:
        raise ValueError("add shapes do not match")
    if T * n == 0:
        return
    cdef float *a = &A[0, 0]
    cdef const float *b = &B[0, 0]
    with nogil:
        for i in range(T * n):
            a[i] = a[i] + b[i]


def axpy(float[::1] acc, float w, const float[::1] d):
    """In place acc = f32(acc + f32(w * d)) (MoE aggregate, §4.7.2)."""
    cdef Py_ssize_t i, n = acc.shape[0]
    cdef float p
    if d.shape[0] != n:
        raise ValueError("axpy shapes do not match")
    with nogil:
        for i in range(n):
            p = w * d[i]
            acc[i] = acc[i] + p


def argmax(const float[::1] x):
    """Index of the maximum, lowest index on ties (§4.9, trap #41)."""
    cdef Py_ssize_t i, best = 0, n = x.shape[0]
    if n == 0:
        raise ValueError("argmax of an empty vector")
    for i in range(1, n):
        if x[i] > x[best]:
            best = i
    return best


def embed(W, const int64_t[::1] ids, float[:, ::1] out):
    """Gather embedding rows and widen (BF16 by shift; never multiplied)."""
    cdef Py_ssize_t t, i, T = ids.shape[0]
    cdef const uint16_t[:, ::1] Wb
    cdef const float[:, ::1] Wf
    # bounds checking is off: a wrong output shape would write out of bounds silently
    if out.shape[0] < T or out.shape[1] != W.shape[1]:
        raise ValueError(f"embed: output {out.shape[0]}x{out.shape[1]} does not hold {T} rows "
                         f"of {W.shape[1]}")
    if W.dtype == np.uint16:
        Wb = W
        for t in range(T):
            if ids[t] < 0 or ids[t] >= Wb.shape[0]:
                raise ValueError(f"token id {ids[t]} is outside the vocabulary of {Wb.shape[0]}")
            for i in range(Wb.shape[1]):
                out[t, i] = k3_bf16_to_f32(Wb[ids[t], i])
    else:
        Wf = W
        for t in range(T):
            if ids[t] < 0 or ids[t] >= Wf.shape[0]:
                raise ValueError(f"token id {ids[t]} is outside the vocabulary of {Wf.shape[0]}")
            for i in range(Wf.shape[1]):
                out[t, i] = Wf[ids[t], i]


# ---- KDA (§4.4) ----------------------------------------------------------------------

def shortconv(const float[:, ::1] X, const float[:, ::1] w, float[:, ::1] hist,
              float[:, ::1] Y):
    """Causal depthwise conv + SiLU per channel, tokens in order, history carried.
    X [T, C] raw projections; w [C, K]; hist [C, K-1] oldest first (updated); Y [T, C].
    Y[t, c] = w[c, K-1] * x_t, then + w[c, j] * x_{t-(K-1)+j} for j = 0..K-2 (oldest first),
    x_s for s < 0 being hist[c, s + K-1]: each output from its own inputs, so tokens run
    in any order on any thread, and channels innermost in rows (vectorised across them).
    Why not a channel at a time: that walked X down its columns, 8 ms per 512 x 2048 call
    (2.5 % of a prefill)."""
    cdef Py_ssize_t c, t, j, T = X.shape[0], C = X.shape[1], K = w.shape[1], src
    if w.shape[0] != C or hist.shape[0] != C or hist.shape[1] != K - 1 or Y.shape[0] != T \
            or Y.shape[1] != C:
        raise ValueError("shortconv shapes do not match")
    if T * C == 0:
        return
    wT_arr = np.ascontiguousarray(np.asarray(w).T)         # [K, C]: taps by channel
    hT_arr = np.ascontiguousarray(np.asarray(hist).T)      # [K-1, C]: the history before
    cdef const float[:, ::1] wT = wT_arr
    cdef const float[:, ::1] hT = hT_arr
    cdef float *y
    cdef const float *xs
    with nogil:
        for t in prange(T, num_threads=_threads_for(C * T * K), schedule="static"):
            y = &Y[t, 0]
            for c in range(C):
                y[c] = wT[K - 1, c] * X[t, c]               # current input first
            for j in range(K - 1):                          # then history, oldest -> newest
                src = t - (K - 1) + j
                xs = &X[src, 0] if src >= 0 else &hT[src + K - 1, 0]
                for c in range(C):
                    y[c] = y[c] + wT[j, c] * xs[c]
        for j in range(K - 1):                              # history keeps the RAW inputs
            src = T - (K - 1) + j
            for c in range(C):
                hist[c, j] = X[src, c] if src >= 0 else hT[src + K - 1, c]
        _sigm_blocks(&Y[0, 0], T * C, &Y[0, 0], 1)          # SiLU: acc * sigma(acc)


def kda_decay(const float[:, ::1] Z, const float[::1] A_log, const float[::1] dt_bias,
              float g_min, float[:, ::1] G, float[:, ::1] alpha):
    """g = g_min * sigma(exp(A_log[h]) * (z + dt_bias)); alpha = exp(g).
    A_log is indexed by HEAD (trap #5), dt_bias by channel, added before scaling (#7).
    exp(A_log[h]) is taken once per head (the same expf of the same float per element)."""
    cdef Py_ssize_t i, c, T = Z.shape[0], P = Z.shape[1], H = A_log.shape[0]
    cdef Py_ssize_t D = P // H if H else 0
    cdef float u, g
    if H == 0 or H * D != P or dt_bias.shape[0] != P or G.shape[0] != T or G.shape[1] != P \
            or alpha.shape[0] != T or alpha.shape[1] != P:
        raise ValueError("kda_decay shapes do not match")
    if T * P == 0:
        return
    eA_arr = np.empty(H, dtype=np.float32)
    cdef float[::1] eA = eA_arr
    cdef const float *z = &Z[0, 0]
    cdef float *gp = &G[0, 0]
    cdef float *ap = &alpha[0, 0]
    with nogil:
        for c in range(H):
            eA[c] = expf(A_log[c])
        for i in prange(T * P, num_threads=_threads_for(T * P * 2 * TRANSCENDENTAL_WORK),
                        schedule="static"):
            c = i % P
            u = z[i] + dt_bias[c]
            u = eA[c // D] * u
            g = g_min * k3_sigm(u)
            gp[i] = g
            ap[i] = expf(g)            # exactly 1.0 is legal saturation (trap #8)


def kda_q_scale(Py_ssize_t D):
    cdef float d = <float>D
    return F1 / sqrtf(d)


cdef struct _KdaTask:               # kda_recurrence: one item per head
    float *S
    const float *Q
    const float *K
    const float *V
    const float *alpha
    const float *beta
    float *O
    float q_scale
    long H, D, T
    long lq, lk, lv, la, lb, lo       # row strides
    int oom


cdef void _kda_head(void *ctx, long h) noexcept nogil:
    cdef _KdaTask *m = <_KdaTask *>ctx
    cdef long D = m.D, base = h * m.D, t, i, j
    cdef float *u = <float *>k3_scratch(4 * D * sizeof(float))
    cdef float *qh
    cdef float *o
    cdef float *diff
    cdef float *row
    cdef float kb, a, ki, qi, p
    if u == NULL:
        m.oom = 1                            # reported after the loop (no raise in nogil)
        return
    qh, o, diff = u + D, u + 2 * D, u + 3 * D
    for t in range(m.T):
        for j in range(D):
            qh[j] = m.Q[t * m.lq + base + j] * m.q_scale
            u[j] = F0
            o[j] = F0
        for i in range(D):                         # 1. decay row i; 2. u += k_i S[i]
            a = m.alpha[t * m.la + base + i]
            ki = m.K[t * m.lk + base + i]
            row = m.S + (h * D + i) * D
            for j in range(D):
                row[j] = row[j] * a
                p = ki * row[j]
                u[j] = u[j] + p
        for j in range(D):
            diff[j] = m.V[t * m.lv + base + j] - u[j]
        for i in range(D):                         # 3. delta write; 4. read UPDATED row
            kb = m.K[t * m.lk + base + i] * m.beta[t * m.lb + h]
            qi = qh[i]
            row = m.S + (h * D + i) * D
            for j in range(D):
                p = kb * diff[j]
                row[j] = row[j] + p
                p = qi * row[j]
                o[j] = o[j] + p
        for j in range(D):
            m.O[t * m.lo + base + j] = o[j]


def kda_recurrence(float[:, :, ::1] S, const float[:, ::1] Q, const float[:, ::1] K,
                   const float[:, ::1] V, const float[:, ::1] alpha, const float[:, ::1] beta,
                   float q_scale, float[:, ::1] O):
    """Delta-rule recurrence per head, tokens in order (§4.4 steps 1-4).
    S [H, D, D] row = key channel (updated); Q, K, V, alpha [T, H*D]; beta [T, H]; O [T, H*D].

    Two passes over S per token instead of four, row by row (contiguous, vectorisable over
    the value channel j): pass 1 decays row i and adds its term to u[j]; pass 2 writes the
    delta into row i and adds the updated row's term to o[j].  Every u[j] and o[j] still
    sums its float32 terms over the key channel i ascending from 0, and each S element sees
    the same two roundings in the same order, so the bits are those of the four-step form."""
    cdef Py_ssize_t H = S.shape[0], D = S.shape[1], T = Q.shape[0]
    if S.shape[2] != D or Q.shape[1] != H * D or beta.shape[1] != H:
        raise ValueError("kda_recurrence shapes do not match")
    if H == 0 or D == 0 or T == 0:
        return
    cdef _KdaTask m
    m.S, m.Q, m.K, m.V, m.alpha, m.beta, m.O = &S[0, 0, 0], &Q[0, 0], &K[0, 0], &V[0, 0], \
        &alpha[0, 0], &beta[0, 0], &O[0, 0]
    m.q_scale, m.H, m.D, m.T, m.oom = q_scale, H, D, T, 0
    m.lq, m.lk, m.lv, m.la, m.lb, m.lo = Q.shape[1], K.shape[1], V.shape[1], alpha.shape[1], \
        beta.shape[1], O.shape[1]
    with nogil:
        _run(_kda_head, &m, H, _threads_for(H * D * D * T * 4))
    if m.oom:
        raise MemoryError("kda_recurrence: no memory for its per-thread buffers")


# ---- MLA (§4.5) ----------------------------------------------------------------------

cdef inline const float *_key_at(const float *blocks, long d, long s) noexcept nogil:
    """Position s's lane of key blocks of d dimensions (state.MLAState): dimension i is
    K3_KEY_BLOCK floats on."""
    return blocks + (s // K3_KEY_BLOCK) * K3_KEY_BLOCK * d + s % K3_KEY_BLOCK


cdef inline double _qk(const float *q, const float *k, const float *qr, const float *rk,
                       Py_ssize_t dn, Py_ssize_t dr) noexcept nogil:
    """One q.k score: ONE double accumulator, nope dims then rope dims (§5.2).  k and rk
    point at the position's lane of its key blocks (_key_at)."""
    cdef double d = 0.0
    cdef Py_ssize_t i
    for i in range(dn):
        d = d + <double>q[i] * <double>k[K3_KEY_BLOCK * i]
    for i in range(dr):                      # rope slots unrotated, key shared by heads
        d = d + <double>qr[i] * <double>rk[K3_KEY_BLOCK * i]
    return d


cdef struct _MlaTask:               # mla_attention's items: (token, head) or (block, head)
    const float *Q
    const float *K                    # [H][blocks][dn][8]: head h's keys at K + h * hk
    const float *V                    # [H][cap][dv]: head h's values at V + h * hv
    const float *R                    # [blocks][dr][8]
    float *O
    long lq, lo                       # row strides of Q and O
    long hk, hv                       # head strides of K and V
    long T, H, dn, dr, dv, n_past, npos
    float kappa
    int oom


cdef void _mla_token_head(void *ctx, long th) noexcept nogil:
    """One (token, head) of the portable path."""
    cdef _MlaTask *m = <_MlaTask *>ctx
    cdef long H = m.H, dn = m.dn, dr = m.dr, dv = m.dv, dq = m.dn + m.dr
    cdef long t = th // H, h = th % H, p = m.n_past + th // H, s, i, j, b = K3_KEY_BLOCK
    cdef const float *kh = m.K + h * m.hk
    cdef float *sc = <float *>k3_scratch((m.npos + dv) * sizeof(float))
    cdef float *accv
    cdef const float *q
    cdef const float *qr
    cdef const float *k0
    cdef const float *r0
    cdef const float *vrow
    cdef double d, d0, d1, d2, d3, Z
    cdef float mx, e, wgt
    if sc == NULL:
        m.oom = 1                            # reported after the loop (no raise in nogil)
        return
    accv = sc + m.npos
    q = m.Q + t * m.lq + h * dq
    qr = q + dn
    s = 0
    while s + 4 <= p + 1:                    # causal: s <= p, always (trap #21)
        k0 = _key_at(kh, dn, s)              # s .. s+3: lanes of one key block
        r0 = _key_at(m.R, dr, s)
        d0 = 0.0
        d1 = 0.0
        d2 = 0.0
        d3 = 0.0
        for i in range(dn):
            d0 = d0 + <double>q[i] * <double>k0[b * i]
            d1 = d1 + <double>q[i] * <double>k0[b * i + 1]
            d2 = d2 + <double>q[i] * <double>k0[b * i + 2]
            d3 = d3 + <double>q[i] * <double>k0[b * i + 3]
        for i in range(dr):
            d0 = d0 + <double>qr[i] * <double>r0[b * i]
            d1 = d1 + <double>qr[i] * <double>r0[b * i + 1]
            d2 = d2 + <double>qr[i] * <double>r0[b * i + 2]
            d3 = d3 + <double>qr[i] * <double>r0[b * i + 3]
        sc[s] = (<float>d0) * m.kappa
        sc[s + 1] = (<float>d1) * m.kappa
        sc[s + 2] = (<float>d2) * m.kappa
        sc[s + 3] = (<float>d3) * m.kappa
        s = s + 4
    while s <= p:
        d = _qk(q, _key_at(kh, dn, s), qr, _key_at(m.R, dr, s), dn, dr)
        sc[s] = (<float>d) * m.kappa
        s = s + 1
    mx = sc[0]
    for s in range(1, p + 1):
        if sc[s] > mx:
            mx = sc[s]
    Z = 0.0
    for s in range(p + 1):
        e = expf(sc[s] - mx)
        sc[s] = e
        Z = Z + <double>e
    for s in range(p + 1):
        sc[s] = <float>(<double>sc[s] / Z)
    for j in range(dv):
        accv[j] = F0
    for s in range(p + 1):                   # row by row: v of position s is contiguous
        wgt = sc[s]
        vrow = m.V + h * m.hv + s * dv
        for j in range(dv):
            accv[j] = accv[j] + wgt * vrow[j]
    for j in range(dv):
        m.O[t * m.lo + h * dv + j] = accv[j]


cdef void _mla_block_head(void *ctx, long item) noexcept nogil:
    """One (head, up to 8 * K3_MLA_G consecutive tokens) of the AVX-512 path (k3mla.h)."""
    cdef _MlaTask *m = <_MlaTask *>ctx
    cdef long dq = m.dn + m.dr, h = item % m.H, t0 = (item // m.H) * 8 * K3_MLA_G
    cdef double *work = <double *>k3_scratch(k3_mla_block_work(dq, m.dv, m.npos) * sizeof(double))
    if work == NULL:
        m.oom = 1
        return
    k3_mla_block_avx512(m.Q + t0 * m.lq + h * dq, m.lq, m.K + h * m.hk, m.V + h * m.hv,
                        m.dv, m.R, m.dn, m.dr, m.dv, m.n_past + t0,
                        <int>min(8 * K3_MLA_G, m.T - t0),
                        m.kappa, m.O + t0 * m.lo + h * m.dv, m.lo, work)


def mla_attention(const float[:, ::1] Q, const float[:, :, :, ::1] Kb,
                  const float[:, :, ::1] Vc, const float[:, :, ::1] Rb, Py_ssize_t n_past,
                  float[:, ::1] O):
    """Causal attention of T new tokens (positions n_past .. n_past+T-1, already written to
    the cache) over the cache, as state.MLAState holds it: Kb [H, blocks, dn, KEY_BLOCK]
    each head's k_nope in blocks of KEY_BLOCK positions (lane = position within the block);
    Vc [H, cap, dv] each head's value rows; Rb [blocks, dr, KEY_BLOCK] the shared rope keys
    in the same blocks.  Q [T, H*(dn+dr)]; O [T, H*dv].

    Memory order, not summation order, is what the loops choose: scores are computed four
    positions at a time (four independent double chains, each in its own exact order, so
    the chains overlap instead of waiting on each other's adds), and the value sum walks
    the head's value rows in order into dv float32 accumulators, each of which still adds
    its terms in ascending position order from 0.  On the AVX-512 path the items are
    (head, up to 8 blocks of 8 consecutive tokens), each computed by k3mla.h with the same
    per-output orders, the blocks sharing each key block's reads; a decode step's one token
    has its own form there (its heads are the items; 32 positions scored at a time in the
    double lanes, straight from the key blocks).  docs/benchmarks-kernels.md."""
    cdef Py_ssize_t T = Q.shape[0], H = Kb.shape[0], dn = Kb.shape[2], dv = Vc.shape[2]
    cdef Py_ssize_t dr = Rb.shape[1], dq = dn + dr, dkv = dn + dv, npos = n_past + T
    cdef Py_ssize_t b = K3_KEY_BLOCK
    if (Q.shape[1] != H * dq or Vc.shape[0] != H or Kb.shape[3] != b or Rb.shape[2] != b
            or O.shape[1] != H * dv or O.shape[0] != T):
        raise ValueError("mla_attention shapes do not match")
    if npos > Vc.shape[1] or npos > b * Kb.shape[1] or npos > b * Rb.shape[0]:
        raise ValueError(f"MLA cache overflow: {npos} positions, capacity {Vc.shape[1]}")
    if T == 0 or H == 0:
        return
    cdef _MlaTask m
    m.Q, m.K, m.V, m.R, m.O = &Q[0, 0], &Kb[0, 0, 0, 0], &Vc[0, 0, 0], &Rb[0, 0, 0], &O[0, 0]
    m.lq, m.lo = Q.shape[1], O.shape[1]
    m.hk, m.hv = Kb.shape[1] * dn * b, Vc.shape[1] * dv
    m.T, m.H, m.dn, m.dr, m.dv, m.n_past, m.npos = T, H, dn, dr, dv, n_past, npos
    m.kappa = F1 / sqrtf(<float>dq)      # 1/sqrt(dn+dr), NOT 1/sqrt(dn) (trap #18)
    m.oom = 0
    cdef int nt = _threads_for(T * H * npos * dkv)
    with nogil:
        if k3_isa() == 2:
            _run(_mla_block_head, &m, H * ((T + 8 * K3_MLA_G - 1) // (8 * K3_MLA_G)), nt)
        else:
            _run(_mla_token_head, &m, T * H, nt)
    if m.oom:
        raise MemoryError(f"mla_attention: no memory for its {npos}-position scores")


# ---- router (§4.7.1) -----------------------------------------------------------------

def router(W, const float[::1] x, const float[::1] bias, int k, bint renorm, float scale,
           int32_t[::1] idx, float[::1] weights):
    """Top-k selection on sigma(logit)+bias, weights from the UNBIASED sigma (trap #24).
    Logits use ONE sequential double accumulator, not the 16-lane matvec."""
    cdef Py_ssize_t N = W.shape[0], E = W.shape[1]
    if x.shape[0] != E or bias.shape[0] != N or k < 1 or k > N or k > MAX_TOPK:
        raise ValueError("router shapes do not match")
    scores = np.empty(N, dtype=np.float32)
    cdef float[::1] s = scores
    cdef bint bf16 = W.dtype == np.uint16
    cdef const void *wp = _router_weights(W)
    work = np.empty(E + N, dtype=np.float64)
    cdef double[::1] wk = work
    with nogil:
        _router_scores_raw(wp, bf16, &x[0], N, E, &wk[0], &wk[E], &s[0], _router_threads(N, E))
    _select(s, bias, k, renorm, scale, idx, weights)
    return scores


def route_scores(const float[::1] s, const float[::1] bias, int k, bint renorm, float scale,
                 int32_t[::1] idx, float[::1] weights):
    """Selection and weighting from given sigmoid scores (op fixtures, tests)."""
    if s.shape[0] != bias.shape[0] or k < 1 or k > s.shape[0] or k > MAX_TOPK:
        raise ValueError("route_scores shapes do not match")
    _select(s, bias, k, renorm, scale, idx, weights)


cdef _select(const float[::1] s, const float[::1] bias, int k, bint renorm, float scale,
             int32_t[::1] idx, float[::1] weights):
    cdef Py_ssize_t N = s.shape[0]
    sel_arr = np.empty(N, dtype=np.float32)
    taken_arr = np.empty(N, dtype=np.uint8)
    cdef float[::1] sel = sel_arr
    cdef uint8_t[::1] taken = taken_arr
    _select_raw(&s[0], &bias[0], N, k, renorm, scale, &sel[0], &taken[0], &idx[0], &weights[0])


# ---- AttnRes (§4.8) ------------------------------------------------------------------

cdef inline void _attnres_keys(const float **v, Py_ssize_t n, Py_ssize_t E, const float *phi,
                               double eps, float *sc) noexcept nogil:
    """sc[s] = f32(sum_i f32(v_s[i] * r_s) * phi[i]), r_s = f32(1 / sqrt(mean(v_s^2) + eps)),
    each sum in double from 0.0 in element order.  Four sources' chains run side by side
    (a last block of fewer repeats its last source; the repeats are not stored): why: one
    chain is bound by the add's latency (4 cycles an element), and a 512-position prefill
    spent 0.65 ms per position here; each chain's order is unchanged."""
    cdef Py_ssize_t s, i, k, m
    cdef double q[4]
    cdef double dot[4]
    cdef float r[4]
    cdef const float *a[4]
    for s in range(0, n, 4):
        m = min(4, n - s)
        for k in range(4):
            a[k] = v[s + min(k, m - 1)]
            q[k] = 0.0
            dot[k] = 0.0
        for i in range(E):
            q[0] = q[0] + <double>a[0][i] * <double>a[0][i]
            q[1] = q[1] + <double>a[1][i] * <double>a[1][i]
            q[2] = q[2] + <double>a[2][i] * <double>a[2][i]
            q[3] = q[3] + <double>a[3][i] * <double>a[3][i]
        for k in range(4):
            r[k] = <float>(1.0 / sqrt(q[k] / <double>E + eps))
        for i in range(E):
            dot[0] = dot[0] + <double>(a[0][i] * r[0]) * <double>phi[i]
            dot[1] = dot[1] + <double>(a[1][i] * r[1]) * <double>phi[i]
            dot[2] = dot[2] + <double>(a[2][i] * r[2]) * <double>phi[i]
            dot[3] = dot[3] + <double>(a[3][i] * r[3]) * <double>phi[i]
        for k in range(m):
            sc[s + k] = <float>dot[k]


cdef void _attnres_token(const float *st, Py_ssize_t sstride, Py_ssize_t n_snap,
                         const float *run, const float *phi, Py_ssize_t E, double eps,
                         float *out) noexcept nogil:
    """One token of attnres: sources st + s * sstride (s < n_snap), then run."""
    cdef Py_ssize_t s, i, n = n_snap + 1
    cdef double Z
    cdef float mx
    cdef float sc[MAX_SOURCES]
    cdef const float *v[MAX_SOURCES]
    for s in range(n_snap):
        v[s] = st + s * sstride
    v[n_snap] = run
    _attnres_keys(v, n, E, phi, eps, sc)
    mx = sc[0]
    for s in range(1, n):
        if sc[s] > mx:
            mx = sc[s]
    Z = 0.0
    for s in range(n):
        sc[s] = expf(sc[s] - mx)
        Z = Z + <double>sc[s]
    for s in range(n):
        sc[s] = <float>(<double>sc[s] / Z)
    for i in range(E):                  # value sums: sources in order per element
        out[i] = F0 + sc[0] * v[0][i]
    for s in range(1, n):
        for i in range(E):
            out[i] = out[i] + sc[s] * v[s][i]


def attnres(const float[:, :, ::1] stack, Py_ssize_t n_snap, const float[:, ::1] run,
            const float[::1] phi, float eps, float[:, ::1] out):
    """Aggregate sources stack[0..n_snap-1][t] then run[t] (oldest -> newest, running sum
    last).  Keys are RMS-normalised, values are the raw sources (trap #30).  out must not
    alias run or stack.  Tokens are independent: any thread, same bits."""
    cdef Py_ssize_t T = run.shape[0], E = run.shape[1], n = n_snap + 1, t
    if n > MAX_SOURCES or n_snap > stack.shape[0] or phi.shape[0] != E:
        raise ValueError("attnres shapes do not match")
    if n_snap > 0 and (stack.shape[1] < T or stack.shape[2] != E):
        raise ValueError("attnres stack shape does not match")
    if out.shape[0] != T or out.shape[1] != E:   # bounds checking is off: check it here
        raise ValueError("attnres output shape does not match")
    if T == 0:
        return
    cdef const float *st0 = &stack[0, 0, 0] if n_snap > 0 else NULL
    cdef Py_ssize_t sstride = stack.shape[1] * E
    with nogil, parallel(num_threads=_threads_for(T * E * n * 3)):
        for t in prange(T, schedule="static"):
            _attnres_token(st0 + t * E if n_snap > 0 else NULL, sstride, n_snap, &run[t, 0],
                           &phi[0], E, <double>eps, &out[t, 0])


# ---- state-file payload hash (SYSTEM §6.9) -------------------------------------------

def fnv_fold_words(uint64_t h, const uint64_t[::1] words):
    """h = (h ^ w) * FNV_PRIME mod 2^64 over little-endian 64-bit words, in order.  A
    sequential chain (cannot be vectorised exactly), so it runs here at memory speed
    instead of as a Python-int loop."""
    cdef Py_ssize_t i
    cdef uint64_t prime = 0x100000001B3
    with nogil:
        for i in range(words.shape[0]):
            h = (h ^ words[i]) * prime
    return h


# ---- the per-token glue in one call each (issue 13) -----------------------------------
# Routing of a whole chunk, the expert grouping and the MoE combine: what model.py did per
# token and per expert in Python, now one nogil call each.  Same orders as the per-token
# kernels above (router: ONE sequential double accumulator per logit, strictly-greater
# top-k, renorm; combine: acc[t] = F0 + w_j * d_j in selection order), so same bits.

cdef float _no_weights = 0.0       # what an empty router matrix points at (never read)


cdef const void *_router_weights(W) except NULL:
    """The router matrix's first element (BF16 bits or float32, C-contiguous [N, E]); W
    itself keeps the buffer alive while the pointer is used."""
    cdef const uint16_t[:, ::1] Wb
    cdef const float[:, ::1] Wf
    if W.dtype == np.uint16:
        Wb = W
        return &Wb[0, 0] if Wb.shape[0] * Wb.shape[1] else &_no_weights
    Wf = W
    return &Wf[0, 0] if Wf.shape[0] * Wf.shape[1] else &_no_weights


# A token's logits split over threads in items of this many experts (4 blocks of 8: K3's
# 896 are 28 items, mid's 128 four).  Each expert's chain is whole in one item, so no bit
# depends on the split (tests/test_kernels.py, the router at 1 and 2 threads).
DEF ROUTE_ITEM = 32
# One router multiply-add counted as this many for the parallel threshold: a chain per
# expert with a transpose per 64 weights runs ~6.4 G/s a core (mid's router, hot), against
# ~25 for a matvec, so mid's 128 x 2048 router (~40 us) is worth a second thread.
DEF ROUTER_WORK = 4

ctypedef struct _RouteTask:
    const void *W
    bint bf16
    const double *xd
    double *logit
    Py_ssize_t N, E


cdef void _route_item(void *ctx, long it) noexcept nogil:
    cdef _RouteTask *m = <_RouteTask *>ctx
    cdef long e0 = it * ROUTE_ITEM
    cdef long e1 = min(e0 + ROUTE_ITEM, m.N)
    if m.bf16:
        k3_route_logits_bf16(<const uint16_t *>m.W, m.N, m.E, m.xd, m.logit, e0, e1)
    else:
        k3_route_logits_f32(<const float *>m.W, m.N, m.E, m.xd, m.logit, e0, e1)


cdef void _router_scores_raw(const void *W, bint bf16, const float *x, Py_ssize_t N,
                             Py_ssize_t E, double *xd, double *logit, float *s,
                             int nt) noexcept nogil:
    """s[e] = sigma(f32(logit e)); the logits by k3route.h (ONE sequential double chain per
    expert) on nt threads; xd [E] and logit [N] are the caller's scratch."""
    cdef Py_ssize_t e, i
    cdef _RouteTask m
    for i in range(E):
        xd[i] = <double>x[i]
    for e in range(N):
        logit[e] = 0.0
    if E > 0:
        m.W = W
        m.bf16 = bf16
        m.xd = xd
        m.logit = logit
        m.N = N
        m.E = E
        _run(_route_item, &m, (N + ROUTE_ITEM - 1) // ROUTE_ITEM, nt)
    for e in range(N):
        s[e] = k3_sigm(<float>logit[e])


cdef inline int _router_threads(Py_ssize_t N, Py_ssize_t E) noexcept nogil:
    return _threads_for(ROUTER_WORK * N * E) if N > ROUTE_ITEM else 1


cdef void _select_raw(const float *s, const float *bias, Py_ssize_t N, int k, bint renorm,
                      float scale, float *sel, uint8_t *taken, int32_t *idx,
                      float *weights) noexcept nogil:
    """Top-k of s + bias (ties to the lowest index), weights from the UNBIASED s."""
    cdef Py_ssize_t e, j, best
    cdef double tot
    cdef float inv
    for e in range(N):
        sel[e] = s[e] + bias[e]          # biased score: selection only
        taken[e] = 0
    for j in range(k):
        best = -1
        for e in range(N):               # strictly greater: ties go to the lowest index
            if not taken[e] and (best < 0 or sel[e] > sel[best]):
                best = e
        taken[best] = 1
        idx[j] = <int32_t>best
        weights[j] = s[best]
    if renorm and k > 1:                 # SF skips renormalisation for k = 1 (trap #42)
        tot = 0.0
        for j in range(k):
            tot = tot + <double>weights[j]
        inv = <float>(1.0 / (tot + 1e-20))
        for j in range(k):
            weights[j] = weights[j] * inv
    for j in range(k):
        weights[j] = weights[j] * scale


def route_tokens(W, const float[:, ::1] X, const float[::1] bias, int k, bint renorm,
                 float scale, int32_t[:, ::1] idx, float[:, ::1] weights):
    """`router` for every row of X [T, E] in one call: idx/weights [T, k].  Tokens are
    independent, so they may run on any thread (each token's bits are those of `router`)."""
    cdef Py_ssize_t N = W.shape[0], E = W.shape[1], T = X.shape[0], t
    if X.shape[1] != E or bias.shape[0] != N or k < 1 or k > N or k > MAX_TOPK:
        raise ValueError("route_tokens shapes do not match")
    if idx.shape[0] != T or weights.shape[0] != T or idx.shape[1] != k or weights.shape[1] != k:
        raise ValueError("route_tokens outputs must be [T, k]")
    if T == 0 or N == 0:
        return
    cdef bint bf16 = W.dtype == np.uint16
    cdef const void *wp = _router_weights(W)
    cdef double *buf = NULL      # (set by each thread; initialised: GCC's flow analysis)
    cdef float *sc = NULL
    cdef int oom[1]
    oom[0] = 0
    # Threads split the tokens; one token (every decode step) splits its experts instead
    cdef int nt1 = _router_threads(N, E) if T == 1 else 1
    with nogil, parallel(num_threads=_threads_for(ROUTER_WORK * T * N * E) if T > 1 else 1):
        # per thread: x widened [E], logits [N], then scores [N], sel [N], taken [N] bytes
        buf = <double *>malloc((E + N + N + 1) * sizeof(double) + N)
        sc = <float *>(buf + E + N)
        if buf == NULL:
            oom[0] = 1
        for t in prange(T, schedule="dynamic"):
            if buf == NULL:
                continue
            _router_scores_raw(wp, bf16, &X[t, 0], N, E, buf, buf + E, sc, nt1)
            _select_raw(sc, &bias[0], N, k, renorm, scale, sc + N, <uint8_t *>(sc + 2 * N),
                        &idx[t, 0], &weights[t, 0])
        free(buf)
    if oom[0]:
        raise MemoryError("route_tokens: no memory for its per-thread scores")


def moe_groups(const int32_t[:, ::1] idx, const int32_t[::1] count, Py_ssize_t n_experts,
               int32_t[::1] starts, int32_t[::1] token, int32_t[:, ::1] pos):
    """Group a chunk's (token, rank) selections by expert (a counting sort): the slots of
    expert e are starts[e] .. starts[e+1]-1, tokens ascending; token[s] is slot s's token
    and pos[t, j] the slot of token t's rank-j expert.  Only ranks j < count[t] are used (a
    draft router may pick fewer).  Returns the number of slots."""
    cdef Py_ssize_t T = idx.shape[0], k = idx.shape[1], t, j, e, s, n = 0
    if count.shape[0] != T or starts.shape[0] != n_experts + 1 or pos.shape[0] != T \
            or pos.shape[1] != k or token.shape[0] < T * k:
        raise ValueError("moe_groups shapes do not match")
    for t in range(T):
        if count[t] < 0 or count[t] > k:
            raise ValueError(f"moe_groups: token {t} has {count[t]} selections of {k}")
        for j in range(count[t]):
            if idx[t, j] < 0 or idx[t, j] >= n_experts:
                raise ValueError(f"moe_groups: expert {idx[t, j]} is outside 0..{n_experts - 1}")
    with nogil:
        for e in range(n_experts + 1):
            starts[e] = 0
        for t in range(T):
            for j in range(count[t]):
                starts[idx[t, j] + 1] += 1
                n += 1
        for e in range(n_experts):
            starts[e + 1] += starts[e]
        for t in range(T):               # tokens ascending within each expert's slots
            for j in range(count[t]):
                e = idx[t, j]
                s = starts[e]
                starts[e] += 1
                token[s] = <int32_t>t
                pos[t, j] = <int32_t>s
        for e in range(n_experts, 0, -1):  # undo the shift the placement made
            starts[e] = starts[e - 1]
        starts[0] = 0
    return n


cdef struct _Expert:              # one routed expert of a moe_experts batch
    const uint8_t *p[3]              # packed nibbles of w1 (gate) and w3 (up) [inter, L],
    const uint8_t *s[3]              # w2 (down) [Lout, inter]; and their scales
    long inter
    long slot0                       # its first slot (row of D)
    long ntok                        # its slots
    long zrow                        # its first row of the batch's widened inputs
    long hoff                        # its first element of the batch's hidden buffers
    k3_mxq **qz                      # ntok <= 2: each slot's input's integer-path form
    k3_mxq **qh                      # and its hidden's (k3mxint.h); else NULL


cdef struct _MoeTask:              # a moe_experts batch's two loops over (expert, chunk)
    const _Expert *xs
    const int32_t *items             # hidden items first, then output items from na on
    long na, hc, oc, L, Lout
    const double *zd
    float *g
    float *u
    double *hd
    float b1, b2
    float *D


cdef void _expert_hidden(void *ctx, long it) noexcept nogil:
    """Hidden rows of one item (an expert's row chunk) for all the expert's tokens: SiTU-GLU
    of the gate and up matvecs, widened (exactly) for the down matvec."""
    cdef _MoeTask *m = <_MoeTask *>ctx
    cdef const _Expert *x = &m.xs[m.items[2 * it]]
    cdef long t, i, r0 = m.items[2 * it + 1] * m.hc, r1 = min(x.inter, r0 + m.hc), L = m.L
    k3_mv_rows_mxfp4q(x.p[0], x.s[0], L, r0, r1, m.zd + x.zrow * L, x.ntok, m.g + x.hoff,
                      x.inter, x.qz)
    k3_mv_rows_mxfp4q(x.p[1], x.s[1], L, r0, r1, m.zd + x.zrow * L, x.ntok, m.u + x.hoff,
                      x.inter, x.qz)
    for t in range(x.ntok):
        i = x.hoff + t * x.inter + r0
        k3_situ_rows(m.g + i, m.u + i, r1 - r0, m.b1, m.b2, NULL, m.hd + i)


cdef void _expert_output(void *ctx, long it) noexcept nogil:
    """Output rows of one item (an expert's row chunk of w2) for all the expert's tokens."""
    cdef _MoeTask *m = <_MoeTask *>ctx
    it += m.na
    cdef const _Expert *x = &m.xs[m.items[2 * it]]
    cdef long o0 = m.items[2 * it + 1] * m.oc
    k3_mv_rows_mxfp4q(x.p[2], x.s[2], x.inter, o0, min(m.Lout, o0 + m.oc), m.hd + x.hoff,
                      x.ntok, m.D + x.slot0 * m.Lout, m.Lout, x.qh)


cdef void _expert_prepare(void *ctx, long gi) noexcept nogil:
    """An expert's hidden rows (ntok <= 2), prepared for the integer path of its output
    matvec."""
    cdef _MoeTask *m = <_MoeTask *>ctx
    cdef const _Expert *x = &m.xs[gi]
    cdef long t
    if x.qh != NULL:
        for t in range(x.ntok):
            x.qh[t] = k3_mxq_make(m.hd + x.hoff + t * x.inter, x.inter)


cdef _mxfp4_view(M, long rows, long cols, str what):
    """M's packed nibbles and scales as memoryviews, checked against [rows, cols]."""
    cdef const uint8_t[:, ::1] P = M.packed
    cdef const uint8_t[:, ::1] S = M.scales
    if P.shape[0] != rows or P.shape[1] * 2 != cols or S.shape[0] != rows \
            or S.shape[1] * 32 != cols:
        raise ValueError(f"moe_experts: {what} is packed [{P.shape[0]},{P.shape[1]}] scales "
                         f"[{S.shape[0]},{S.shape[1]}], expected [{rows},{cols}] in groups "
                         f"of 32")
    return P, S


def moe_experts(list group, const float[:, ::1] Z, const int32_t[::1] token,
                const int32_t[::1] starts, float b1, float b2, float[:, ::1] D):
    """One batch of routed MXFP4 experts: for each (e, ExpertWeights) of `group` and each of
    e's slots s (starts[e] .. starts[e+1]-1), D[s] = w2 @ SiTU-GLU(w1 @ Z[token[s]],
    w3 @ Z[token[s]]).  The per-token kernels, order and float32 roundings of the
    per-expert calls (gather_rows, mxfp4_matvec x 3, situ_glu); only the thread loops are
    merged, two for the whole batch: every expert's hidden rows, then every expert's output
    rows (between them a short one preparing the hiddens of experts of <= 2 tokens for
    k3mxint.h's integer path).  (A decode step otherwise opened 4 small OpenMP regions per
    expert, and with 2 threads the joins cost about as much as the matvecs.)"""
    cdef Py_ssize_t G = len(group), L = Z.shape[1], Lout = D.shape[1], nS = starts.shape[0]
    cdef Py_ssize_t gi, e, s, t, i, c, k, na = 0, nb = 0, nrows = 0, nh = 0, it, hrows = 0
    cdef Py_ssize_t hc = ROW_CHUNK, oc = ROW_CHUNK     # rows per item: hidden, output
    cdef long work = 0
    if G == 0:
        return
    cdef _Expert *xs = <_Expert *>calloc(G, sizeof(_Expert))     # qz, qh start NULL
    cdef k3_mxq **qtok = NULL        # each token's input plan (shared by its experts)
    cdef char *tried = NULL          # tokens whose plan was made (it may be NULL: no plan)
    cdef k3_mxq **qslot = NULL       # each slot's: pointers into qtok
    cdef k3_mxq **hslot = NULL       # each slot's hidden plan (owned)
    if xs == NULL:
        raise MemoryError("moe_experts: no memory for the batch")
    cdef double *zd = NULL
    cdef double *hd = NULL
    cdef float *g = NULL
    cdef float *u = NULL
    cdef int32_t *items = NULL
    cdef const uint8_t[:, ::1] P
    cdef const uint8_t[:, ::1] S
    cdef _MoeTask m
    try:
        for gi in range(G):
            e, ex = group[gi]
            if e < 0 or e + 1 >= nS or starts[e] > starts[e + 1] or starts[e + 1] > D.shape[0]:
                raise ValueError(f"moe_experts: expert {e} has no valid slots")
            inter = ex.w1.packed.shape[0]
            if inter <= 0 or inter % 32 or L == 0 or Lout == 0:
                raise ValueError(f"moe_experts: expert {e} is [{inter}, {L}] -> {Lout}: "
                                 f"hidden rows must be a positive multiple of 32")
            for k, (M, what) in enumerate(((ex.w1, "w1"), (ex.w3, "w3"), (ex.w2, "w2"))):
                P, S = _mxfp4_view(M, Lout if k == 2 else inter, inter if k == 2 else L,
                                   f"expert {e} {what}")
                xs[gi].p[k], xs[gi].s[k] = &P[0, 0], &S[0, 0]   # group keeps the arrays
            xs[gi].inter, xs[gi].slot0 = inter, starts[e]
            xs[gi].ntok, xs[gi].zrow, xs[gi].hoff = starts[e + 1] - starts[e], nrows, nh
            for s in range(starts[e], starts[e + 1]):
                if token[s] < 0 or token[s] >= Z.shape[0]:
                    raise ValueError(f"moe_experts: slot {s} names row {token[s]} of "
                                     f"{Z.shape[0]}")
            nrows += xs[gi].ntok
            nh += xs[gi].ntok * inter
            hrows += inter
            work += xs[gi].ntok * inter * (2 * L + Lout)
        if nrows == G:          # a decode step: longer items, for _row_chunk's reason
            hc, oc = _row_chunk(1, hrows), _row_chunk(1, G * Lout)
        for gi in range(G):
            na += (xs[gi].inter + hc - 1) // hc
            nb += (Lout + oc - 1) // oc
        zd = <double *>malloc(max(nrows * L, 1) * sizeof(double))
        hd = <double *>malloc(max(nh, 1) * sizeof(double))
        g = <float *>malloc(max(nh, 1) * sizeof(float))
        u = <float *>malloc(max(nh, 1) * sizeof(float))
        items = <int32_t *>malloc(2 * (na + nb) * sizeof(int32_t))
        if k3_mxq_active():
            qtok = <k3_mxq **>calloc(max(Z.shape[0], 1), sizeof(k3_mxq *))
            tried = <char *>calloc(max(Z.shape[0], 1), 1)
            qslot = <k3_mxq **>calloc(max(nrows, 1), sizeof(k3_mxq *))
            hslot = <k3_mxq **>calloc(max(nrows, 1), sizeof(k3_mxq *))
            if qtok == NULL or tried == NULL or qslot == NULL or hslot == NULL:
                raise MemoryError("moe_experts: no memory for the batch's plans")
        if zd == NULL or hd == NULL or g == NULL or u == NULL or items == NULL:
            raise MemoryError("moe_experts: no memory for the batch's inputs")
        it = 0                                  # (expert, row chunk): hidden, then output
        for gi in range(G):
            for c in range((xs[gi].inter + hc - 1) // hc):
                items[2 * it], items[2 * it + 1], it = gi, c, it + 1
        for gi in range(G):
            for c in range((Lout + oc - 1) // oc):
                items[2 * it], items[2 * it + 1], it = gi, c, it + 1
        with nogil:
            for gi in range(G):                 # each slot's input row, widened once
                for t in range(xs[gi].ntok):
                    for i in range(L):
                        zd[(xs[gi].zrow + t) * L + i] = Z[token[xs[gi].slot0 + t], i]
            m.xs, m.items, m.na, m.hc, m.oc, m.L, m.Lout = xs, items, na, hc, oc, L, Lout
            m.zd, m.g, m.u, m.hd, m.b1, m.b2, m.D = zd, g, u, hd, b1, b2, &D[0, 0]
            for gi in range(G):                 # experts of <= 2 tokens: each token once
                if qtok != NULL and xs[gi].ntok <= K3_MXQ_TOKENS_MAX:
                    xs[gi].qz, xs[gi].qh = qslot + xs[gi].zrow, hslot + xs[gi].zrow
                    for i in range(xs[gi].ntok):
                        t = token[xs[gi].slot0 + i]
                        if not tried[t]:
                            qtok[t] = k3_mxq_make(zd + (xs[gi].zrow + i) * L, L)
                            tried[t] = 1
                        qslot[xs[gi].zrow + i] = qtok[t]
            _run(_expert_hidden, &m, na, _threads_for(work))
            if qtok != NULL:
                _run(_expert_prepare, &m, G, _threads_for(work))
            _run(_expert_output, &m, nb, _threads_for(work))
    finally:
        if qtok != NULL:
            for t in range(Z.shape[0]):
                free(qtok[t])
        if hslot != NULL:
            for i in range(nrows):
                free(hslot[i])
        free(qtok)
        free(tried)
        free(qslot)
        free(hslot)
        free(xs)
        free(zd)
        free(hd)
        free(g)
        free(u)
        free(items)


def gather_rows(const float[:, ::1] X, const int32_t[::1] rows, float[:, ::1] Y):
    """Y[r] = X[rows[r]] (an expert's tokens, contiguous for its matvec)."""
    cdef Py_ssize_t r, i, n = rows.shape[0], w = X.shape[1]
    if Y.shape[0] < n or Y.shape[1] != w:
        raise ValueError("gather_rows shapes do not match")
    for r in range(n):
        if rows[r] < 0 or rows[r] >= X.shape[0]:
            raise ValueError(f"gather_rows: row {rows[r]} is outside 0..{X.shape[0] - 1}")
    with nogil:
        for r in range(n):
            for i in range(w):
                Y[r, i] = X[rows[r], i]


def moe_combine(const float[:, ::1] D, const int32_t[:, ::1] pos, const float[:, ::1] weights,
                const int32_t[::1] count, float[:, ::1] acc):
    """acc[t] = sum over j < count[t] of f32(weights[t, j] * D[pos[t, j]]), from 0.0 and in
    selection order (ARCHITECTURE §4.7.2, trap #41): `axpy` per rank, one call per chunk."""
    cdef Py_ssize_t T = acc.shape[0], L = acc.shape[1], k = pos.shape[1], t, j, i
    cdef float wj, p
    cdef const float *d
    cdef float *a
    if pos.shape[0] != T or weights.shape[0] != T or weights.shape[1] < k or count.shape[0] != T \
            or D.shape[1] != L:
        raise ValueError("moe_combine shapes do not match")
    for t in range(T):
        if count[t] < 0 or count[t] > k:
            raise ValueError(f"moe_combine: token {t} has {count[t]} selections of {k}")
        for j in range(count[t]):
            if pos[t, j] < 0 or pos[t, j] >= D.shape[0]:
                raise ValueError(f"moe_combine: slot {pos[t, j]} is outside the outputs")
    with nogil:
        for t in prange(T, num_threads=_threads_for(T * k * L), schedule="static"):
            a = &acc[t, 0]
            for i in range(L):
                a[i] = F0
            for j in range(count[t]):
                wj = weights[t, j]
                d = &D[pos[t, j], 0]
                for i in range(L):
                    p = wj * d[i]
                    a[i] = a[i] + p
