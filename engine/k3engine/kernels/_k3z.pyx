# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True, initializedcheck=False
"""The compressed trunk's block codec (k3z.h), nogil: the encoder pack-trunk --compress
runs, and the read + decode + check a trunk reader thread runs per block, so no Python
code sits between the disk and the decoded layer.  Layout and checks: k3z.h."""
from libc.stdint cimport uint8_t, uint16_t, uint64_t
from libc.string cimport memcpy
from libc.errno cimport errno, EINTR
from posix.unistd cimport pread

import numpy as np

cdef extern from "k3z.h" nogil:
    int K3Z_MAXLEN_ "K3Z_MAXLEN"
    int K3Z_HDR_ "K3Z_HDR"
    int K3Z_STREAMS_ "K3Z_STREAMS"
    uint64_t k3z_check(const uint8_t *p, size_t n)
    void k3z_hist(const uint16_t *src, size_t n, uint64_t *hist)
    size_t k3z_hx8_bound(size_t n)
    long k3z_encode_hx8(const uint16_t *src, size_t n, const uint8_t *len, uint8_t *out,
                        size_t cap)
    int k3z_decode_hx8(const uint8_t *src, size_t srclen, uint8_t *dst, size_t n)
    int k3z_decode_hx8_work(const uint8_t *src, size_t srclen, uint8_t *dst, size_t n,
                            uint8_t *ework)

MAXLEN = K3Z_MAXLEN_
HEADER_BYTES = K3Z_HDR_
STREAMS = K3Z_STREAMS_
cdef enum:
    C_RAW = 0
    C_HX8 = 1
    S_READ = -1
    S_HEADER = -2
    S_CHECK = -4
CODEC_RAW, CODEC_HX8 = C_RAW, C_HX8
# read_block / decode_hx8 status codes
OK, E_READ, E_HEADER, E_STREAM, E_CHECK, E_NOMEM = 0, S_READ, S_HEADER, -3, S_CHECK, -5
PROBLEM = {E_READ: "short read", E_HEADER: "malformed block header",
           E_STREAM: "corrupt code stream", E_CHECK: "decoded bytes fail their check",
           E_NOMEM: "out of memory"}


def scratch_bytes(size_t stored, size_t raw):
    """Scratch read_block needs for a block: its aligned read window (the stored bytes
    plus up to 4095 on either side), then the exponents."""
    return stored + 2 * 4096 + raw // 2 + 64


def read_window(size_t off, size_t stored):
    """(offset, length, pad) of the 4096-aligned read that holds [off, off + stored)."""
    cdef size_t lo = off - off % 4096
    cdef size_t hi = (off + stored + 4095) // 4096 * 4096
    return lo, hi - lo, off - lo


def check(const uint8_t[::1] data):
    """The damage check of a decoded block (k3z_check)."""
    cdef uint64_t h
    with nogil:
        h = k3z_check(&data[0] if data.shape[0] else NULL, data.shape[0])
    return h


def hist(const uint16_t[::1] src):
    """Exponent histogram (256 counts) of BF16 values."""
    out = np.zeros(256, np.uint64)
    cdef uint64_t[::1] h = out
    with nogil:
        k3z_hist(&src[0] if src.shape[0] else NULL, src.shape[0], &h[0])
    return out


def hx8_bound(size_t n):
    return k3z_hx8_bound(n)


def encode_hx8(const uint16_t[::1] src, const uint8_t[::1] lengths, uint8_t[::1] out):
    """Encode BF16 values with these 256 code lengths; the block's size, or -1."""
    if lengths.shape[0] != 256 or src.shape[0] == 0:
        raise ValueError("encode_hx8 needs 256 code lengths and at least one value")
    cdef long r
    with nogil:
        r = k3z_encode_hx8(&src[0], src.shape[0], &lengths[0], &out[0], out.shape[0])
    return r


def decode_hx8(const uint8_t[::1] src, uint8_t[::1] dst):
    """Decode one hx8 block into dst (2 bytes per value); a status code (OK = 0)."""
    cdef int r
    if dst.shape[0] % 2 or src.shape[0] == 0 or dst.shape[0] == 0:
        return S_HEADER
    with nogil:
        r = k3z_decode_hx8(&src[0], src.shape[0], &dst[0], dst.shape[0] // 2)
    return r


cdef int _pread_full(int fd, uint8_t *buf, size_t n, long long off) noexcept nogil:
    cdef size_t got = 0
    cdef long r
    while got < n:
        r = pread(fd, buf + got, n - got, off + got)
        if r < 0 and errno == EINTR:
            continue
        if r <= 0:
            return -1
        got += r
    return 0


def read_block(int fd, size_t off, size_t stored, uint8_t[::1] scratch, uint8_t[::1] dst,
               int codec, uint64_t expect):
    """Read one stored block (`stored` bytes at `off`, through its 4096-aligned window into
    the aligned `scratch`, so O_DIRECT works for blocks packed back to back), decode it
    into dst and check it, all without the GIL.  A status code (OK = 0); dst is only valid
    on OK.  scratch holds scratch_bytes(stored, len(dst)); the file must extend to the
    window's end (each layer's blocks are padded to 4096)."""
    cdef int r = 0
    cdef size_t n = dst.shape[0]
    cdef size_t lo = off - off % 4096
    cdef size_t win = (off + stored + 4095) // 4096 * 4096 - lo
    cdef size_t pad = off - lo
    if codec != C_RAW and codec != C_HX8:
        return S_HEADER
    if win + n // 2 + 64 > <size_t>scratch.shape[0] or n == 0 or stored == 0:
        return S_HEADER
    if codec == C_RAW and n != stored:
        return S_HEADER
    if codec == C_HX8 and n % 2:
        return S_HEADER
    with nogil:
        if _pread_full(fd, &scratch[0], win, lo):
            r = S_READ
        elif codec == C_RAW:
            memcpy(&dst[0], &scratch[pad], n)
        else:
            r = k3z_decode_hx8_work(&scratch[pad], stored, &dst[0], n // 2, &scratch[win])
        if r == 0 and k3z_check(&dst[0], n) != expect:
            r = S_CHECK
    return r
