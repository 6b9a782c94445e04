/* K3Z: the lossless block codec of the compressed trunk (docs/trunk-compress.md).
 *
 * A BF16 value is sign(1) exponent(8) mantissa(7).  The exponent byte of trained (and
 * Gaussian) weights takes a handful of values, so it is Huffman-coded; the sign and
 * mantissa byte is close to uniform and stored raw.  An "hx8" block of n BF16 values:
 *
 *   u32 n | u8 len[256] | u32 seglen[K3Z_STREAMS] | u8 sm[n] | stream 0 | ... | stream 3
 *
 * sm[i] = sign << 7 | mantissa; stream s holds the exponent codes of elements
 * [s q, (s + 1) q), q = ceil(n / 4) (four independent bit streams decoded in one loop, for
 * instruction-level parallelism).  Codes are canonical Huffman codes of at most
 * K3Z_MAXLEN bits, written LSB first.  The decoder's table maps K3Z_MAXLEN bits to up to
 * four whole codes at once (weight exponents average under 3 bits).
 *
 * Hostile input: every length is checked, the decoder never reads outside [src, src +
 * srclen), a code the table does not define and a stream that consumes more bits than its
 * declared length are errors, and the caller compares k3z_check of the output with the
 * manifest's.  Same bits by construction: decode(encode(x)) == x for every 16-bit
 * pattern (inf, NaN payloads, denormals, every exponent), tested exhaustively.
 */
#ifndef K3Z_H
#define K3Z_H

#include <stdint.h>
#include <stddef.h>
#include <string.h>
#include <stdlib.h>

#define K3Z_MAXLEN 11
#define K3Z_LUT (1u << K3Z_MAXLEN)
#define K3Z_STREAMS 4
#define K3Z_HDR (4 + 256 + 4 * K3Z_STREAMS)

#define K3Z_OK 0
#define K3Z_E_HEADER (-2)   /* lengths, counts or sizes inconsistent */
#define K3Z_E_STREAM (-3)   /* a code not in the table, or a stream overran its length */
#define K3Z_E_NOMEM (-5)

static inline uint32_t k3z_rd32(const uint8_t *p) {
    uint32_t v; memcpy(&v, p, 4); return v;          /* x86/ARM little-endian hosts */
}
static inline uint64_t k3z_rd64(const uint8_t *p) {
    uint64_t v; memcpy(&v, p, 8); return v;
}
static inline void k3z_wr32(uint8_t *p, uint32_t v) { memcpy(p, &v, 4); }

/* Damage check of a decoded block: four multiply-rotate lanes over 8-byte words, the
 * tail folded in, the length mixed last.  Not a cryptographic digest (the manifest's
 * per-layer SHA-256 is, for k3 doctor --verify); it catches a flipped or shifted byte. */
static inline uint64_t k3z_rotl(uint64_t x, int r) { return (x << r) | (x >> (64 - r)); }

static uint64_t k3z_check(const uint8_t *p, size_t n) {
    const uint64_t P1 = 0x9E3779B97F4A7C15ull, P2 = 0xC2B2AE3D27D4EB4Full;
    uint64_t h0 = P1, h1 = P2, h2 = P1 ^ P2, h3 = ~P1;
    size_t i = 0;
    for (; i + 32 <= n; i += 32) {
        h0 = k3z_rotl((h0 ^ k3z_rd64(p + i)) * P1, 31);
        h1 = k3z_rotl((h1 ^ k3z_rd64(p + i + 8)) * P1, 31);
        h2 = k3z_rotl((h2 ^ k3z_rd64(p + i + 16)) * P1, 31);
        h3 = k3z_rotl((h3 ^ k3z_rd64(p + i + 24)) * P1, 31);
    }
    uint64_t t = 0;
    int sh = 0;
    for (; i < n; i++) {
        t |= (uint64_t)p[i] << sh;
        sh += 8;
        if (sh == 64) { h0 = k3z_rotl((h0 ^ t) * P1, 31); t = 0; sh = 0; }
    }
    h1 = k3z_rotl((h1 ^ t) * P1, 31);
    uint64_t h = k3z_rotl(h0, 1) + k3z_rotl(h1, 7) + k3z_rotl(h2, 12) + k3z_rotl(h3, 18);
    h = (h ^ (uint64_t)n) * P2;
    return h ^ (h >> 29);
}

/* Exponent histogram of n BF16 values (the encoder's input for the code lengths). */
static void k3z_hist(const uint16_t *src, size_t n, uint64_t hist[256]) {
    memset(hist, 0, 256 * sizeof(uint64_t));
    for (size_t i = 0; i < n; i++) hist[(src[i] >> 7) & 0xFF]++;
}

/* Canonical codes, bit-reversed for LSB-first streams.  Returns 0, or -1 when a length
 * exceeds K3Z_MAXLEN, no symbol has a code, or the lengths over-fill the code space. */
static int k3z_codes(const uint8_t len[256], uint16_t rcode[256]) {
    unsigned count[K3Z_MAXLEN + 1] = {0}, next[K3Z_MAXLEN + 1];
    unsigned used = 0;
    for (int s = 0; s < 256; s++) {
        if (len[s] > K3Z_MAXLEN) return -1;
        if (len[s]) { count[len[s]]++; used++; }
    }
    if (!used) return -1;
    uint32_t kraft = 0;
    for (int l = 1; l <= K3Z_MAXLEN; l++) kraft += count[l] << (K3Z_MAXLEN - l);
    if (kraft > K3Z_LUT) return -1;
    unsigned code = 0;                          /* RFC 1951 §3.2.2 canonical order */
    for (int l = 1; l <= K3Z_MAXLEN; l++) { code = (code + count[l - 1]) << 1; next[l] = code; }
    for (int s = 0; s < 256; s++) {
        unsigned l = len[s];
        rcode[s] = 0;
        if (!l) continue;
        unsigned c = next[l]++, r = 0;
        for (unsigned b = 0; b < l; b++) r |= ((c >> b) & 1u) << (l - 1 - b);
        rcode[s] = (uint16_t)r;
    }
    return 0;
}

/* Bytes an hx8 block of n values can take at most (every code K3Z_MAXLEN bits, plus each
 * stream's final partial byte). */
static inline size_t k3z_hx8_bound(size_t n) {
    return K3Z_HDR + n + (n * K3Z_MAXLEN + 7) / 8 + K3Z_STREAMS;
}

/* Encode n BF16 values with the given code lengths into out (cap bytes).  Returns the
 * block size, or -1 (bad lengths, a value whose exponent has no code, or cap too small). */
static long k3z_encode_hx8(const uint16_t *src, size_t n, const uint8_t len[256],
                           uint8_t *out, size_t cap) {
    uint16_t rcode[256];
    if (n > 0xFFFFFFFFu || k3z_codes(len, rcode) || cap < K3Z_HDR + n) return -1;
    k3z_wr32(out, (uint32_t)n);
    memcpy(out + 4, len, 256);
    uint8_t *sm = out + K3Z_HDR;
    for (size_t i = 0; i < n; i++)
        sm[i] = (uint8_t)(((src[i] >> 8) & 0x80) | (src[i] & 0x7F));
    size_t pos = K3Z_HDR + n, q = (n + K3Z_STREAMS - 1) / K3Z_STREAMS;
    for (int s = 0; s < K3Z_STREAMS; s++) {
        size_t start = pos, hi = (s + 1) * q < n ? (s + 1) * q : n;
        uint64_t acc = 0;
        unsigned nb = 0;
        for (size_t i = s * q; i < hi; i++) {
            unsigned e = (src[i] >> 7) & 0xFF, l = len[e];
            if (!l) return -1;
            acc |= (uint64_t)rcode[e] << nb;
            nb += l;
            while (nb >= 8) {
                if (pos >= cap) return -1;
                out[pos++] = (uint8_t)acc;
                acc >>= 8;
                nb -= 8;
            }
        }
        if (nb) {
            if (pos >= cap) return -1;
            out[pos++] = (uint8_t)acc;
        }
        k3z_wr32(out + 4 + 256 + 4 * s, (uint32_t)(pos - start));
    }
    return (long)pos;
}

/* One LSB-first bit reader per stream (refill as in F. Giesen's "variant 4": after a
 * refill at least 56 bits are buffered, room for five table lookups of <= 11 bits). */
typedef struct { const uint8_t *p; uint64_t buf; unsigned cnt; } k3z_br;

/* Near the end of the buffer: byte by byte, zeros past the end (never dereferenced). */
static inline void k3z_refill_safe(k3z_br *b, const uint8_t *end) {
    while (b->cnt <= 56) {
        uint64_t v = b->p < end ? *b->p : 0;
        b->buf |= v << b->cnt;
        b->p++;
        b->cnt += 8;
    }
}

/* Table entry for K3Z_MAXLEN bits: byte 0 the total bits of the whole codes it holds
 * (first, so the shift takes it unmasked), byte 1 how many (up to four), byte 2 the first
 * code's length (the tail decodes one symbol at a time), bytes 4-7 the symbols.  Bits
 * that start with a code the table lacks: K3Z_E_BAD set, one bit consumed (so the fast
 * loop still advances and ends), no symbol. */
#define K3Z_E_BITS(t) ((unsigned)(t) & 0xFF)
#define K3Z_E_K(t) ((unsigned)((t) >> 8) & 0xFF)
#define K3Z_E_LEN1(t) ((unsigned)((t) >> 16) & 0xFF)
#define K3Z_E_SYMS(t) ((uint32_t)((t) >> 32))
#define K3Z_E_BAD (1ull << 24)

static void k3z_table(const uint8_t len[256], const uint16_t rcode[256], uint64_t *lut) {
    uint16_t one[K3Z_LUT];                      /* symbol | length << 8; 0 = undefined */
    memset(one, 0, sizeof one);
    for (int s = 0; s < 256; s++) {
        unsigned l = len[s];
        if (!l) continue;
        for (unsigned k = rcode[s]; k < K3Z_LUT; k += 1u << l) one[k] = (uint16_t)(s | (l << 8));
    }
    for (unsigned idx = 0; idx < K3Z_LUT; idx++) {
        uint64_t syms = 0;
        unsigned k = 0, used = 0;
        while (k < 4) {
            uint16_t t = one[(idx >> used) & (K3Z_LUT - 1)];
            unsigned l = t >> 8;
            if (!l || used + l > K3Z_MAXLEN) break;   /* undefined, or not all bits known */
            syms |= (uint64_t)(t & 0xFF) << (8 * k);
            used += l;
            k++;
        }
        lut[idx] = k ? (syms << 32 | (uint64_t)(one[idx] >> 8) << 16 | (uint64_t)k << 8 | used)
                     : (K3Z_E_BAD | 1);
    }
}

/* Decode an hx8 block of srclen bytes into n BF16 values at dst (2n bytes, any
 * alignment); `ework` holds n + 64 bytes of scratch (the exponents).  Returns K3Z_OK or a
 * K3Z_E_* code; on error dst holds garbage. */
static int k3z_decode_hx8_work(const uint8_t *src, size_t srclen, uint8_t *dst, size_t n,
                               uint8_t *ework) {
    uint16_t rcode[256];
    uint64_t lut[K3Z_LUT];
    if (srclen < K3Z_HDR || k3z_rd32(src) != n) return K3Z_E_HEADER;
    const uint8_t *len = src + 4;
    if (k3z_codes(len, rcode)) return K3Z_E_HEADER;
    k3z_table(len, rcode, lut);
    size_t total = K3Z_HDR + n;
    if (total > srclen) return K3Z_E_HEADER;
    const uint8_t *sm = src + K3Z_HDR, *end = src + srclen;
    const size_t q = (n + K3Z_STREAMS - 1) / K3Z_STREAMS;
    k3z_br br[K3Z_STREAMS];
    const uint8_t *start[K3Z_STREAMS];
    size_t seglen[K3Z_STREAMS], pos[K3Z_STREAMS], hi[K3Z_STREAMS];
    for (int s = 0; s < K3Z_STREAMS; s++) {
        seglen[s] = k3z_rd32(src + 4 + 256 + 4 * s);
        if (seglen[s] > srclen - total) return K3Z_E_HEADER;
        start[s] = src + total;
        br[s].p = start[s]; br[s].buf = 0; br[s].cnt = 0;
        total += seglen[s];
        pos[s] = s * q < n ? s * q : n;
        hi[s] = (s + 1) * q < n ? (s + 1) * q : n;
    }
    uint64_t bad = 0;
    /* Fast loop: per stream one refill, then five lookups of up to four symbols each
     * (<= 20 symbols, written as 4-byte stores that stay inside the stream's range).  The
     * readers live in locals so the four dependency chains overlap. */
    {
        const uint8_t *p0 = br[0].p, *p1 = br[1].p, *p2 = br[2].p, *p3 = br[3].p;
        uint64_t b0 = 0, b1 = 0, b2 = 0, b3 = 0;
        unsigned c0 = 0, c1 = 0, c2 = 0, c3 = 0;
        size_t o0 = pos[0], o1 = pos[1], o2 = pos[2], o3 = pos[3];
        while (o0 + 20 <= hi[0] && o1 + 20 <= hi[1] && o2 + 20 <= hi[2] && o3 + 20 <= hi[3]
               && p0 + 8 <= end && p1 + 8 <= end && p2 + 8 <= end && p3 + 8 <= end) {
#define K3Z_REFILL(b, c, p) do { (b) |= k3z_rd64(p) << (c); (p) += (63 - (c)) >> 3; (c) |= 56; } while (0)
#define K3Z_DEC(b, c, o) do { uint64_t t_ = lut[(b) & (K3Z_LUT - 1)]; uint32_t s_ = K3Z_E_SYMS(t_); \
        unsigned l_ = K3Z_E_BITS(t_); bad |= t_;                                                \
        memcpy(ework + (o), &s_, 4); (o) += K3Z_E_K(t_); (b) >>= l_; (c) -= l_; } while (0)
            K3Z_REFILL(b0, c0, p0); K3Z_REFILL(b1, c1, p1);
            K3Z_REFILL(b2, c2, p2); K3Z_REFILL(b3, c3, p3);
            for (int r = 0; r < 5; r++) {
                K3Z_DEC(b0, c0, o0); K3Z_DEC(b1, c1, o1);
                K3Z_DEC(b2, c2, o2); K3Z_DEC(b3, c3, o3);
            }
#undef K3Z_REFILL
#undef K3Z_DEC
            if (bad & K3Z_E_BAD) return K3Z_E_STREAM;
        }
        br[0].p = p0; br[0].buf = b0; br[0].cnt = c0; pos[0] = o0;
        br[1].p = p1; br[1].buf = b1; br[1].cnt = c1; pos[1] = o1;
        br[2].p = p2; br[2].buf = b2; br[2].cnt = c2; pos[2] = o2;
        br[3].p = p3; br[3].buf = b3; br[3].cnt = c3; pos[3] = o3;
    }
    /* Tail of each stream: one symbol at a time with the bounded refill. */
    for (int s = 0; s < K3Z_STREAMS; s++) {
        k3z_br *b = &br[s];
        for (size_t i = pos[s]; i < hi[s]; i++) {
            k3z_refill_safe(b, end);
            uint64_t t = lut[b->buf & (K3Z_LUT - 1)];
            unsigned l = K3Z_E_LEN1(t);
            if (t & K3Z_E_BAD) return K3Z_E_STREAM;
            ework[i] = (uint8_t)(t >> 32);
            b->buf >>= l;
            b->cnt -= l;
        }
        size_t used = (size_t)(b->p - start[s]) * 8 - b->cnt;
        if (used > seglen[s] * 8) return K3Z_E_STREAM;   /* read past its declared length */
    }
    /* Rebuild BF16 from sign+mantissa and exponent (vectorised by the compiler); a
     * 2-aligned dst directly, an odd one (a tensor at an odd offset) through a buffer. */
    if (((uintptr_t)dst & 1) == 0) {
        uint16_t *d16 = (uint16_t *)(void *)dst;
        for (size_t i = 0; i < n; i++) {
            unsigned sv = sm[i];
            d16[i] = (uint16_t)(((sv & 0x80u) << 8) | ((unsigned)ework[i] << 7) | (sv & 0x7Fu));
        }
        return K3Z_OK;
    }
    for (size_t i0 = 0; i0 < n; i0 += 4096) {
        uint16_t v[4096];
        size_t m = n - i0 < 4096 ? n - i0 : 4096;
        for (size_t k = 0; k < m; k++) {
            unsigned sv = sm[i0 + k];
            v[k] = (uint16_t)(((sv & 0x80u) << 8) | ((unsigned)ework[i0 + k] << 7) | (sv & 0x7Fu));
        }
        memcpy(dst + 2 * i0, v, 2 * m);         /* dst may be odd: a tensor at any offset */
    }
    return K3Z_OK;
}

static int k3z_decode_hx8(const uint8_t *src, size_t srclen, uint8_t *dst, size_t n) {
    uint8_t *w = (uint8_t *)malloc(n + 64);
    if (!w) return K3Z_E_NOMEM;
    int r = k3z_decode_hx8_work(src, srclen, dst, n, w);
    free(w);
    return r;
}

#endif
