/*
 * The LANES record coding (wire format v1, coding 5, docs/wire-format.md "LANES: static
 * tables, 16 rANS lanes").  Included by rans.c (it shares BUCKET's bucket scan, raw-bit
 * reader and writer and reciprocal table); the Python bindings are at the end of rans.c.
 *
 * BUCKET's modelling (exponent buckets against e_lo, rank gaps per bucket, h = bitlen(|k|)
 * per bucket, raw sign and low bits) with every model STATIC per record: the encoder counts
 * the symbols first and writes each used context's normalised frequencies into the raw bits,
 * and a Rice parameter per bucket.  No adaptive state, nothing shared between records.
 *
 * Symbols are ordered so that every symbol's context is known before a batch is decoded:
 *   G  the gap quotients, bucket by bucket (ascending), each bucket's in rank order
 *   H  the value bit lengths h, in position order (context: the position's bucket)
 *   T  context-free only: the top bits below h's leading one, in position order, for h >= 2
 * Symbol j of the record uses rANS lane j mod 16 (32-bit states, 16-bit words, 12-bit
 * probabilities), so the decoder runs 8 lanes per AVX2 vector: one gather of a per-context
 * slot table (sym | bias | freq per slot), one multiply, a shuffled word load.  The scalar
 * decoder gives the same arrays; the encoder is scalar (16 independent chains).
 *
 * Decoding, the hot path (n = range elements, m = changed elements):
 *   tables        at most 66 slot tables of 4096 u32 (1 MiB, per-thread buffer)
 *   G             m symbols, 8 lanes per AVX2 step (gather from the bucket's table)
 *   gaps          m raw reads -> each bucket's ranks (8 bytes each)
 *   positions     context mode: the segmented block scan of base[lo, hi) up to the last
 *                 changed element (reads 2n bytes of bf16 base, builds each 64-element
 *                 block's bucket bitmaps: the dominant cost at 0.5-10% changed) and a walk
 *                 of each bucket's blocks from rank to position; context-free: ranks + lo
 *   H, T          m (+ up to m) symbols, tables from the positions' buckets resp. h
 *   values        m branch-free raw reads and reconstructions, written once to the output
 * Work memory: 2 bytes per changed element context-free, 19 in context mode (see
 * lanes_decode_record), reused between calls per thread up to ARENA_KEEP.
 */

#include <pthread.h>

#define LN 16                  /* rANS lanes */
#define LANES_MAXF (PTOT - 16) /* largest frequency a table may give (admission bound) */

/* ------------------------------------------------------------------ work memory */

/* Each call's work arrays come from one per-thread buffer that is kept between calls (up to
 * ARENA_KEEP bytes; a larger need is malloc'd and freed): a chunk's records then reuse
 * memory whose pages are already mapped, instead of faulting in fresh pages every call
 * (which cost ~15% of a context-mode decode).  The GIL is released, so it is per thread. */
#define ARENA_KEEP ((size_t)16 << 20)
#define OFFB 8192 /* symbols decoded per lanes_syms call */
/* A symbol's table word off[i]: where its slot table starts in tabs (below 2^24), and 12 - p
 * (its precision's shift) from bit OFF_SH. */
#define OFF_SH 24
#define OFF_MASK ((1u << OFF_SH) - 1)
static _Thread_local uint8_t *ARENA_BUF = NULL;
static _Thread_local size_t ARENA_CAP = 0;
static pthread_key_t ARENA_KEY; /* its destructor frees a thread's buffer when the thread exits */

static void lanes_init_arena(void) { pthread_key_create(&ARENA_KEY, free); }

typedef struct {
    uint8_t *base;
    size_t used, cap;
    int owned;
} Work;

static int work_open(Work *w, size_t need) {
    need += 64 * 16; /* alignment slack for up to 16 arrays */
    w->used = 0;
    w->cap = need;
    w->owned = need > ARENA_KEEP;
    if (w->owned) {
        w->base = (uint8_t *)malloc(need);
        return w->base ? 0 : -1;
    }
    if (ARENA_CAP < need) {
        free(ARENA_BUF);
        ARENA_CAP = 0;
        ARENA_BUF = (uint8_t *)malloc(need);
        pthread_setspecific(ARENA_KEY, ARENA_BUF);
        if (!ARENA_BUF) return -1;
        ARENA_CAP = need;
    }
    w->base = ARENA_BUF;
    return 0;
}

static void *work_take(Work *w, size_t n) {
    size_t at = (w->used + 63) & ~(size_t)63;
    w->used = at + n;
    return w->base + at; /* work_open's `need` counted every take */
}

static void work_close(Work *w) {
    if (w->owned) free(w->base);
}

/* ------------------------------------------------------------------ tables */

/* gamma code of v >= 1: bitlen(v) - 1 zero bits, a one bit, then the bits below v's leading one */
static inline void bw_gamma(BitW *w, uint32_t v) {
    int L = bitlen(v);
    bw_put(w, 1ull << (L - 1), L);
    bw_put(w, v, L - 1);
}

/* n <= 64 raw bits; one unaligned load for n <= 56 (the reader's buffer has 16 zero bytes past the end) */
__attribute__((always_inline)) static inline uint64_t br_getn(BitR *r, int n) {
    if (__builtin_expect(n > 56, 0)) return br_get64(r, n);
    uint64_t w;
    memcpy(&w, r->buf + (r->pos >> 3), 8);
    uint64_t v = (w >> (r->pos & 7)) & ((1ull << n) - 1);
    r->pos += (uint64_t)n;
    if (__builtin_expect(r->pos > r->nbits, 0)) {
        r->bad = 1;
        r->pos = r->nbits;
    }
    return v;
}

static inline uint32_t br_gamma(BitR *r) { /* v <= 2^13; a longer code marks the reader bad */
    uint64_t w;
    memcpy(&w, r->buf + (r->pos >> 3), 8);
    w >>= (r->pos & 7);
    int z = w ? __builtin_ctzll(w) : 64;
    if (z > 13) { r->bad = 1; return 1; }
    br_get(r, z + 1);
    return (1u << z) | (uint32_t)br_get(r, z);
}

/* Precision of a context's table from its symbol count n and used symbols u: about half
 * the bits of n (the table's cost and its rounding loss balance there), at least bitlen(u)
 * (so every used symbol gets a unit), at most 12. */
static int lanes_prec(uint64_t n, int u) {
    int p = (bitlen(n) + 1) / 2 + 2;
    if (p < bitlen((uint64_t)u)) p = bitlen((uint64_t)u);
    return p > PB ? PB : p;
}

/* Normalise counts cnt[0..A) (n = their sum) to frequencies qf summing to 2^prec (returned). */
static int lanes_norm(const uint64_t *cnt, int A, uint32_t *qf) {
    uint64_t n = 0;
    int u = 0, best = 0;
    for (int s = 0; s < A; s++) {
        n += cnt[s];
        u += cnt[s] != 0;
        if (cnt[s] > cnt[best]) best = s;
    }
    if (!n) { /* a table nothing is coded with: 1, 1 */
        for (int s = 0; s < A; s++) qf[s] = s < 2;
        return 1;
    }
    int p = lanes_prec(n, u);
    uint32_t T = 1u << p, sum = 0;
    for (int s = 0; s < A; s++) {
        qf[s] = cnt[s] ? (uint32_t)(1 + (unsigned __int128)cnt[s] * (T - (uint32_t)u) / n) : 0;
        sum += qf[s];
    }
    qf[best] += T - sum;
    uint32_t cap = p >= 8 ? T - (T >> 8) : T - 1;
    if (qf[best] > cap) {
        qf[best == 0 ? 1 : 0] += qf[best] - cap;
        qf[best] = cap;
    }
    return p;
}

static void lanes_put_table(BitW *w, const uint64_t *cnt, int A, uint32_t *freq) {
    uint32_t qf[MAXA];
    int p = lanes_norm(cnt, A, qf);
    int maxs = 0;
    for (int s = 0; s < A; s++)
        if (qf[s]) maxs = s;
    bw_put(w, (uint64_t)p, 4);
    bw_put(w, (uint64_t)maxs, bitlen((uint64_t)(A - 1)));
    for (int s = 0; s < maxs; s++) bw_gamma(w, qf[s] + 1);
    for (int s = 0; s < A; s++) freq[s] = qf[s] << (PB - p);
}

/* Read one table into freq[0..A) (scaled to 2^12) and its decode slots: 2^p entries at tab
 * (slot x mod 4096 maps to entry (x mod 4096) >> (12 - p)), each sym | cum << 7 | freq << 19.
 * Returns the table's offset word for lanes_syms (*at: where it starts in tabs, advanced
 * past it), or -1 for an invalid table.  A table of precision p costs 2^p writes, not 4096:
 * small records' tables are built in a few hundred stores. */
static int64_t lanes_get_table(BitR *r, int A, uint32_t *freq, uint32_t *tabs, uint32_t *at) {
    int p = (int)br_get(r, 4);
    int maxs = (int)br_get(r, bitlen((uint64_t)(A - 1)));
    if (p < 1 || p > PB || maxs >= A || r->bad) return -1;
    uint32_t T = 1u << p, sum = 0;
    for (int s = 0; s < A; s++) freq[s] = 0;
    for (int s = 0; s < maxs; s++) {
        uint32_t v = br_gamma(r) - 1;
        if (r->bad || v >= T - sum) return -1;
        freq[s] = v;
        sum += v;
    }
    freq[maxs] = T - sum;
    uint32_t *tab = tabs + *at, cum = 0;
    for (int s = 0; s <= maxs; s++) {
        uint32_t q = freq[s], f = q << (PB - p);
        if (f > LANES_MAXF) return -1;
        freq[s] = f;
        uint32_t e = (uint32_t)s | (cum << (7 + PB - p)) | (f << 19);
        for (uint32_t k = 0; k < q; k++) tab[cum + k] = e;
        cum += q;
    }
    int64_t off = (int64_t)*at | ((int64_t)(PB - p) << OFF_SH);
    *at += T;
    return off;
}

/* ------------------------------------------------------------------ rANS lanes */

typedef struct {
    uint32_t x[LN];
    const uint8_t *p, *end;
    uint64_t j; /* symbols decoded so far: the next uses lane j mod LN */
    int bad;
} LDec;

static uint32_t LANES_PERM[256][8]; /* AVX2 renormalisation: lane i takes word popcount(mask & (2^i - 1)) */
/* AVX2 encoder: the lanes of mask m, ascending, into the top popcount(m) of 8 lanes */
static uint32_t LANES_PACK[256][8];

static void lanes_init_tables(void) {
    lanes_init_arena();
    for (int m = 0; m < 256; m++) {
        int c = 0, t = 8 - __builtin_popcount((unsigned)m);
        for (int i = 0; i < 8; i++) {
            LANES_PERM[m][i] = (uint32_t)c;
            c += (m >> i) & 1;
        }
        for (int i = 0; i < 8; i++) LANES_PACK[m][i] = 0;
        for (int i = 0; i < 8; i++)
            if ((m >> i) & 1) LANES_PACK[m][t++] = (uint32_t)i;
    }
}

/* Decode n symbols, symbol i from the slot table at tabs + off[i], into out[i]. */
static void lanes_syms_scalar(LDec *d, const uint32_t *tabs, const uint32_t *off, int64_t n, uint8_t *out, int64_t i0) {
    for (int64_t i = i0; i < n; i++) {
        int l = (int)(d->j++ & (LN - 1));
        uint32_t x = d->x[l];
        uint32_t o = off[i], slot = x & (PTOT - 1);
        uint32_t e = tabs[(o & OFF_MASK) + (slot >> (o >> OFF_SH))];
        x = (e >> 19) * (x >> PB) + slot - ((e >> 7) & (PTOT - 1));
        if (x < RANS_L) {
            if (d->end - d->p < 2) { d->bad = 1; return; }
            x = (x << 16) | (uint32_t)d->p[0] | ((uint32_t)d->p[1] << 8);
            d->p += 2;
        }
        d->x[l] = x;
        out[i] = (uint8_t)(e & 127);
    }
}

#if defined(__x86_64__)
AVX2 static inline __m256i lanes_step8(__m256i x, __m256i slot, __m256i e) {
    const __m256i m12 = _mm256_set1_epi32(PTOT - 1);
    __m256i f = _mm256_srli_epi32(e, 19);
    __m256i cum = _mm256_and_si256(_mm256_srli_epi32(e, 7), m12);
    return _mm256_add_epi32(_mm256_mullo_epi32(f, _mm256_srli_epi32(x, PB)), _mm256_sub_epi32(slot, cum));
}

/* gather indices of 8 lanes: off & OFF_MASK plus the slot shifted by the table's 12 - p */
AVX2 static inline __m256i lanes_idx8(const uint32_t *off, __m256i slot) {
    const __m256i om = _mm256_set1_epi32(OFF_MASK);
    __m256i o = _mm256_loadu_si256((const __m256i *)off);
    return _mm256_add_epi32(_mm256_and_si256(o, om), _mm256_srlv_epi32(slot, _mm256_srli_epi32(o, OFF_SH)));
}

AVX2 static inline __m256i lanes_renorm8(__m256i x, const uint8_t **pp) {
    const __m256i lim = _mm256_set1_epi32(0xFFFF);
    __m256i need = _mm256_cmpeq_epi32(_mm256_min_epu32(x, lim), x);
    int m = _mm256_movemask_ps(_mm256_castsi256_ps(need));
    __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)*pp));
    w = _mm256_permutevar8x32_epi32(w, _mm256_loadu_si256((const __m256i *)LANES_PERM[m]));
    *pp += 2 * __builtin_popcount((unsigned)m);
    return _mm256_blendv_epi8(x, _mm256_or_si256(_mm256_slli_epi32(x, 16), w), need);
}

AVX2 static void lanes_syms_avx2(LDec *d, const uint32_t *tabs, const uint32_t *off, int64_t n, uint8_t *out) {
    int64_t i = 0;
    for (; i < n && (d->j & (LN - 1)); i++) {
        lanes_syms_scalar(d, tabs, off, i + 1, out, i);
        if (d->bad) return;
    }
    int64_t i_simd = i;
    __m256i x0 = _mm256_loadu_si256((const __m256i *)d->x), x1 = _mm256_loadu_si256((const __m256i *)(d->x + 8));
    const __m256i m12 = _mm256_set1_epi32(PTOT - 1);
    const __m256i m7 = _mm256_set1_epi32(127);
    const uint8_t *p = d->p;
    for (; i + LN <= n && d->end - p >= 2 * LN; i += LN) {
        __m256i s0 = _mm256_and_si256(x0, m12), s1 = _mm256_and_si256(x1, m12);
        __m256i e0 = _mm256_i32gather_epi32((const int *)tabs, lanes_idx8(off + i, s0), 4);
        __m256i e1 = _mm256_i32gather_epi32((const int *)tabs, lanes_idx8(off + i + 8, s1), 4);
        x0 = lanes_renorm8(lanes_step8(x0, s0, e0), &p);
        x1 = lanes_renorm8(lanes_step8(x1, s1, e1), &p);
        __m256i s = _mm256_permute4x64_epi64(_mm256_packus_epi32(_mm256_and_si256(e0, m7), _mm256_and_si256(e1, m7)), 0xD8);
        _mm_storeu_si128((__m128i *)(out + i), _mm_packus_epi16(_mm256_castsi256_si128(s), _mm256_extracti128_si256(s, 1)));
    }
    _mm256_storeu_si256((__m256i *)d->x, x0);
    _mm256_storeu_si256((__m256i *)(d->x + 8), x1);
    d->j += (uint64_t)(i - i_simd);
    d->p = p;
    lanes_syms_scalar(d, tabs, off, n, out, i);
}
#endif

static void lanes_syms(LDec *d, const uint32_t *tabs, const uint32_t *off, int64_t n, uint8_t *out) {
#if defined(__x86_64__)
    if (HAVE_AVX2) { lanes_syms_avx2(d, tabs, off, n, out); return; }
#endif
    lanes_syms_scalar(d, tabs, off, n, out, 0);
}

/* ------------------------------------------------------------------ encoder */

static inline int lanes_tb(int h) { return h - 1 < TOPB ? h - 1 : TOPB; }

#if defined(__x86_64__)
/* The encoder's whole 16-symbol groups, i = 15 mod 16 down to 15, all 16 lanes in one vector
 * (LANES_PUT's arithmetic lane for lane): the words of the renormalising lanes are compressed
 * out in lane order below p (the scalar loop writes lane 15's highest), and x / f is a double
 * division, exact: x < f 2^20 after renormalising, so a quotient's fractional part, at least
 * 1/f >= 2^-12, is far above the double's rounding (2^-32 at 2^20).  Returns the new p. */
AVX512 __attribute__((target("avx512vl,avx512vbmi2"))) static uint16_t *lanes_put_avx512(const uint32_t *fc, int64_t i,
                                                                                       uint32_t *x, uint16_t *p) {
    const __m512i lo16 = _mm512_set1_epi32(0xFFFF);
    __m512i X = _mm512_loadu_si512((const void *)x);
    for (; i >= 0; i -= LN) {
        __m512i fcv = _mm512_loadu_si512((const void *)(fc + i - (LN - 1)));
        __m512i f = _mm512_srli_epi32(fcv, 16), c = _mm512_and_si512(fcv, lo16);
        __mmask16 e = _mm512_cmpge_epu32_mask(X, _mm512_slli_epi32(f, 32 - PB));
        int cnt = __builtin_popcount((unsigned)e);
        _mm256_mask_compressstoreu_epi16(p - cnt, e, _mm512_cvtepi32_epi16(X));
        p -= cnt;
        __m512i xs = _mm512_mask_srli_epi32(X, e, X, 16);
        __m512d q0 = _mm512_div_pd(_mm512_cvtepu32_pd(_mm512_castsi512_si256(xs)), _mm512_cvtepu32_pd(_mm512_castsi512_si256(f)));
        __m512d q1 = _mm512_div_pd(_mm512_cvtepu32_pd(_mm512_extracti64x4_epi64(xs, 1)),
                                   _mm512_cvtepu32_pd(_mm512_extracti64x4_epi64(f, 1)));
        __m512i q = _mm512_inserti64x4(_mm512_castsi256_si512(_mm512_cvttpd_epu32(q0)), _mm512_cvttpd_epu32(q1), 1);
        X = _mm512_add_epi32(_mm512_add_epi32(_mm512_slli_epi32(q, PB), _mm512_sub_epi32(xs, _mm512_mullo_epi32(q, f))), c);
    }
    _mm512_storeu_si512((void *)x, X);
    return p;
}
#endif

#if defined(__x86_64__)
/* 8 lanes of lanes_put_avx512 (h: which 8), on AVX2: the words of the renormalising lanes are
 * packed into the top of a vector (LANES_PACK) and stored as 8 words ending at p, so the words
 * below the packed ones are written but not kept (the next store, or the final states, writes
 * over them; the buffer has 8 words of slack); x / f in double after a signed conversion of
 * x - 2^31 (AVX2 converts no unsigned 32-bit integer).  Returns the new p. */
AVX2B static inline uint16_t *lanes_put8_avx2(const uint32_t *fc, __m256i *X, uint16_t *p) {
    const __m256i lo16 = _mm256_set1_epi32(0xFFFF), h31 = _mm256_set1_epi32((int)0x80000000u);
    const __m256d two31 = _mm256_set1_pd(2147483648.0);
    __m256i x = *X, fcv = _mm256_loadu_si256((const __m256i *)fc);
    __m256i f = _mm256_srli_epi32(fcv, 16), c = _mm256_and_si256(fcv, lo16);
    __m256i lim = _mm256_slli_epi32(f, 32 - PB);
    __m256i e = _mm256_cmpeq_epi32(_mm256_max_epu32(x, lim), x); /* x >= f 2^20, unsigned */
    int m = _mm256_movemask_ps(_mm256_castsi256_ps(e)), cnt = __builtin_popcount((unsigned)m);
    __m256i w = _mm256_permutevar8x32_epi32(_mm256_and_si256(x, lo16), _mm256_loadu_si256((const __m256i *)LANES_PACK[m]));
    w = _mm256_permute4x64_epi64(_mm256_packus_epi32(w, w), 0x08);
    _mm_storeu_si128((__m128i *)(p - 8), _mm256_castsi256_si128(w));
    p -= cnt;
    __m256i xs = _mm256_blendv_epi8(x, _mm256_srli_epi32(x, 16), e);
    __m256i xb = _mm256_xor_si256(xs, h31); /* xs - 2^31 as a signed integer */
    __m256d q0 = _mm256_div_pd(_mm256_add_pd(_mm256_cvtepi32_pd(_mm256_castsi256_si128(xb)), two31),
                               _mm256_cvtepi32_pd(_mm256_castsi256_si128(f)));
    __m256d q1 = _mm256_div_pd(_mm256_add_pd(_mm256_cvtepi32_pd(_mm256_extracti128_si256(xb, 1)), two31),
                               _mm256_cvtepi32_pd(_mm256_extracti128_si256(f, 1)));
    __m256i q = _mm256_inserti128_si256(_mm256_castsi128_si256(_mm256_cvttpd_epi32(q0)), _mm256_cvttpd_epi32(q1), 1);
    *X = _mm256_add_epi32(_mm256_add_epi32(_mm256_slli_epi32(q, PB), _mm256_sub_epi32(xs, _mm256_mullo_epi32(q, f))), c);
    return p;
}

/* lanes_put_avx512's whole groups on AVX2: lanes 8-15 (their words go above lanes 0-7's). */
AVX2B static uint16_t *lanes_put_avx2(const uint32_t *fc, int64_t i, uint32_t *x, uint16_t *p) {
    __m256i X0 = _mm256_loadu_si256((const __m256i *)x), X1 = _mm256_loadu_si256((const __m256i *)(x + 8));
    for (; i >= 0; i -= LN) {
        p = lanes_put8_avx2(fc + i - 7, &X1, p);
        p = lanes_put8_avx2(fc + i - 15, &X0, p);
    }
    _mm256_storeu_si256((__m256i *)x, X0);
    _mm256_storeu_si256((__m256i *)(x + 8), X1);
    return p;
}
#endif

/* Encode; returns 0 (res filled) or -1 on allocation failure. */
static int lanes_encode_record(const Params *P, const int64_t *pos, const uint8_t *vals, int64_t nnz, Coded *res) {
    int rc = -1;
    size_t nz = (size_t)(nnz ? nnz : 1);
    size_t wcap = (size_t)3 * nz + 2 * LN + 8; /* rANS words: at most one per symbol, plus the states */
    Work wk;
    BitW bw = {0};
    if (work_open(&wk, nz * (1 + 8 + 8 + 8 + 1 + 1 + 12 + 4) + wcap * 2) < 0) return -1;
    uint8_t *bk = (uint8_t *)work_take(&wk, nz);
    int64_t *rank = (int64_t *)work_take(&wk, nz * sizeof(int64_t));
    uint64_t *basev = (uint64_t *)work_take(&wk, nz * sizeof(uint64_t));
    int64_t *rko = (int64_t *)work_take(&wk, nz * sizeof(int64_t)); /* the ranks in bucket order */
    uint8_t *hs = (uint8_t *)work_take(&wk, nz);
    uint8_t *ts = (uint8_t *)work_take(&wk, nz);
    uint32_t *fc = (uint32_t *)work_take(&wk, 3 * nz * sizeof(uint32_t)); /* freq << 16 | cum, symbol order */
    uint16_t *words = (uint16_t *)work_take(&wk, wcap * sizeof(uint16_t));
    memset(bk, 0, nz);
    uint32_t active = 0;
    int64_t cnt[NB];
    if (P->context) {
        if (rank_scan(P, pos, nnz, bk, rank, basev, cnt, &active, NULL, 0) < 0) goto out;
    } else {
        (void)rank; /* context-free: the rank is pos - lo, read through RK below */
        active = nnz ? 1u : 0u;
    }
    /* bucket order: a counting sort on the bucket, stable (rank order within a bucket), of the
     * ranks themselves (scattered once, then read in order by the passes below) */
    int64_t nb[NB] = {0}, at[NB];
    if (P->context) {
        for (int64_t j = 0; j < nnz; j++) nb[bk[j]]++;
        at[0] = 0;
        for (int b = 1; b < NB; b++) at[b] = at[b - 1] + nb[b - 1];
        for (int64_t j = 0; j < nnz; j++) rko[at[bk[j]]++] = rank[j];
    } else {
        nb[0] = nnz; /* one bucket, in position order */
    }
    /* rank of the e-th element in bucket order */
#define RK(e) (P->context ? rko[e] : pos[e] - P->lo)
    /* Rice parameter per bucket: the least k with n_b 2^(k+2) >= sum of u */
    int kb[NB];
    uint64_t cq[NB][QA], ch[NB][MAXA], ct[MAXW + 1][1 << TOPB];
    memset(cq, 0, sizeof(cq));
    memset(ch, 0, sizeof(ch));
    memset(ct, 0, sizeof(ct));
    {
        int64_t e0 = 0;
        for (int b = 0; b < NB; b++) {
            /* the u of a bucket telescope: their sum is its last rank + 1 - n_b */
            unsigned __int128 sum = nb[b] ? (unsigned __int128)(uint64_t)(RK(e0 + nb[b] - 1) + 1 - nb[b]) : 0;
            int k = 0;
            while (k < 40 && ((unsigned __int128)nb[b] << (k + 2)) < sum) k++;
            kb[b] = k;
            e0 += nb[b];
        }
    }
    /* symbols: G (bucket order), then H and T (position order) */
    int W = P->W;
    int64_t t = 0;
    {
        int64_t e = 0;
        for (int b = 0; b < NB; b++) {
            int64_t prev = -1;
            for (int64_t end = e + nb[b]; e < end; e++) {
                int64_t r = RK(e);
                uint64_t q = (uint64_t)(r - prev - 1) >> kb[b];
                prev = r;
                cq[b][q < QA - 1 ? q : QA - 1]++;
            }
        }
    }
    int64_t nt = 0;
    /* 16-bit floats in context mode (the common record): 16-bit arithmetic, and each value's
     * raw field kept for the raw bits below instead of computed twice */
    uint32_t *kf = NULL;
    if (P->context && P->width == 2 && P->is_float) {
        kf = (uint32_t *)work_take(&wk, nz * sizeof(uint32_t));
        const uint16_t *v16 = (const uint16_t *)vals;
        const uint32_t xo = P->op == 0 ? 0xFFFFu : 0; /* xor: the new bits are v ^ b */
        for (int64_t j = 0; j < nnz; j++) {
            uint32_t b = (uint32_t)basev[j], v = v16[j] ^ (b & xo);
            uint32_t ob = b ^ ((b & 0x8000) ? 0xFFFFu : 0x8000u), ov = v ^ ((v & 0x8000) ? 0xFFFFu : 0x8000u);
            uint32_t k = (ov - ob) & 0xFFFF, neg = k >> 15, mag = neg ? (0x10000u - k) & 0xFFFF : k;
            int h = 31 - __builtin_clz((mag << 1) | 1);
            kf[j] = neg | (mag << 1);
            hs[j] = (uint8_t)h;
            ch[bk[j]][h]++;
        }
    } else
    for (int64_t j = 0; j < nnz; j++) {
        uint64_t v = load(vals, P->width, j);
        int h;
        if (P->context) {
            if (P->op == 0) v ^= basev[j];
            uint64_t k = (ord_of(P, v) - ord_of(P, basev[j])) & P->mask;
            uint64_t mag = (k & P->signbit) ? ((~k + 1) & P->mask) : k;
            h = bitlen(mag);
        } else {
            h = bitlen(v);
            int tb = h >= 2 ? lanes_tb(h) : 0; /* h < 2: t = 0, counted in row h (never written out) */
            ts[j] = (uint8_t)((v >> ((h - 1 - tb) & 63)) & ((1u << tb) - 1));
            ct[h][ts[j]]++;
            nt += h >= 2;
        }
        hs[j] = (uint8_t)h;
        ch[bk[j]][h]++;
    }
    /* header and tables (raw bits) */
    uint32_t fq[NB][QA], fh[NB][MAXA], ft[MAXW + 1][1 << TOPB];
    if (P->context) bw_put(&bw, active, 32);
    for (uint32_t pr = active; pr; pr &= pr - 1) {
        int b = __builtin_ctz(pr);
        if (P->context) {
            int L = bitlen((uint64_t)nb[b]);
            bw_put(&bw, (uint64_t)L, 6);
            bw_put64(&bw, (uint64_t)nb[b], L - 1);
        }
        bw_put(&bw, (uint64_t)kb[b], 6);
    }
    for (uint32_t pr = active; pr; pr &= pr - 1) lanes_put_table(&bw, cq[__builtin_ctz(pr)], QA, fq[__builtin_ctz(pr)]);
    for (uint32_t pr = active; pr; pr &= pr - 1) lanes_put_table(&bw, ch[__builtin_ctz(pr)], W + 1, fh[__builtin_ctz(pr)]);
    if (!P->context && active)
        for (int h = 2; h <= W; h++)
            if (fh[0][h]) lanes_put_table(&bw, ct[h], 1 << lanes_tb(h), ft[h]);
    /* G symbols and the gaps' raw bits */
    {
        int64_t e = 0;
        for (int b = 0; b < NB; b++) {
            int64_t prev = -1;
            uint32_t cum[QA + 1];
            cum[0] = 0;
            if (nb[b])
                for (int s = 0; s < QA; s++) cum[s + 1] = cum[s] + fq[b][s];
            for (int64_t end = e + nb[b]; e < end; e++) {
                int64_t r = RK(e);
                uint64_t u = (uint64_t)(r - prev - 1), q = u >> kb[b];
                prev = r;
                uint32_t s = q < QA - 1 ? (uint32_t)q : QA - 1;
                fc[t++] = (fq[b][s] << 16) | cum[s];
                if (s == QA - 1) {
                    uint64_t x = q - (QA - 1);
                    int L = bitlen(x);
                    bw_put(&bw, (uint64_t)L, 6);
                    bw_put64(&bw, x, L);
                }
                bw_put64(&bw, u, kb[b]);
            }
        }
    }
    /* H symbols, T symbols, values' raw bits */
    {
        uint32_t cumh[NB][MAXA + 1], cumt[MAXW + 1][(1 << TOPB) + 1];
        for (uint32_t pr = active; pr; pr &= pr - 1) {
            int b = __builtin_ctz(pr);
            cumh[b][0] = 0;
            for (int s = 0; s <= W; s++) cumh[b][s + 1] = cumh[b][s] + fh[b][s];
        }
        if (!P->context && active)
            for (int h = 2; h <= W; h++)
                if (fh[0][h]) {
                    cumt[h][0] = 0;
                    for (int s = 0; s < (1 << lanes_tb(h)); s++) cumt[h][s + 1] = cumt[h][s] + ft[h][s];
                }
        if (kf)
            for (int64_t j = 0; j < nnz; j++) {
                int b = bk[j], h = hs[j];
                fc[t++] = (fh[b][h] << 16) | cumh[b][h];
                bw_put64(&bw, kf[j], h); /* nothing when h == 0 */
            }
        else
        for (int64_t j = 0; j < nnz; j++) { /* no branch on the value: h and signs are as good as random */
            int b = bk[j], h = hs[j];
            fc[t++] = (fh[b][h] << 16) | cumh[b][h];
            uint64_t v = load(vals, P->width, j);
            if (P->context) {
                if (P->op == 0) v ^= basev[j];
                uint64_t k = (ord_of(P, v) - ord_of(P, basev[j])) & P->mask;
                uint64_t neg = (k & P->signbit) != 0;
                uint64_t mag = neg ? ((~k + 1) & P->mask) : k;
                bw_put64(&bw, neg | (mag << 1), h); /* nothing when h == 0 */
            } else {
                int n = h >= 2 ? h - 1 - lanes_tb(h) : 0;
                bw_put64(&bw, v, n);
            }
        }
        if (!P->context) {
            memset(ft[0], 0, sizeof(ft[0]) * 2); /* rows of h < 2: read below, never kept */
            memset(cumt[0], 0, sizeof(cumt[0]) * 2);
            for (int64_t j = 0; j < nnz; j++) {
                int h = hs[j];
                fc[t] = (ft[h][ts[j]] << 16) | cumt[h][ts[j]];
                t += h >= 2;
            }
        }
    }
#undef RK
    bw_flush(&bw);
    if (bw.oom) goto out;
    /* rANS, backwards: symbol i uses lane i mod LN; words are stored in decoding order */
    {
        uint16_t *p = words + wcap;
        uint32_t x[LN];
        for (int l = 0; l < LN; l++) x[l] = RANS_L;
#define LANES_PUT(i, l)                                                                             \
    do {                                                                                            \
        uint32_t f = fc[i] >> 16, c = fc[i] & 0xFFFF, xs = x[l];                                    \
        /* renormalise without a branch (it is as good as random): the word is always written  \
         * below p, and kept by moving p only when it is emitted */                              \
        int e = (uint64_t)xs >= ((uint64_t)f << (32 - PB));                                         \
        p[-1] = (uint16_t)xs;                                                                       \
        p -= e;                                                                                     \
        xs = e ? xs >> 16 : xs;                                                                     \
        uint32_t q = (uint32_t)(((__uint128_t)xs * RCP_M[f]) >> RCP_S[f]);                          \
        x[l] = (q << PB) + (xs - q * f) + c;                                                        \
    } while (0)
        int64_t i = t - 1;
        for (; i >= 0 && ((i + 1) & (LN - 1)); i--) LANES_PUT(i, (int)(i & (LN - 1))); /* the last, partial group */
#if defined(__x86_64__)
        if (HAVE_VBMI2) {
            p = lanes_put_avx512(fc, i, x, p);
            i = -1;
        } else if (HAVE_AVX2) {
            p = lanes_put_avx2(fc, i, x, p);
            i = -1;
        }
#endif
        for (; i >= 0; i -= LN) { /* whole groups, lanes 15 .. 0, unrolled: lane indices are constants */
            LANES_PUT(i, 15); LANES_PUT(i - 1, 14); LANES_PUT(i - 2, 13); LANES_PUT(i - 3, 12);
            LANES_PUT(i - 4, 11); LANES_PUT(i - 5, 10); LANES_PUT(i - 6, 9); LANES_PUT(i - 7, 8);
            LANES_PUT(i - 8, 7); LANES_PUT(i - 9, 6); LANES_PUT(i - 10, 5); LANES_PUT(i - 11, 4);
            LANES_PUT(i - 12, 3); LANES_PUT(i - 13, 2); LANES_PUT(i - 14, 1); LANES_PUT(i - 15, 0);
        }
#undef LANES_PUT
        for (int l = LN - 1; l >= 0; l--) {
            *--p = (uint16_t)(x[l] >> 16);
            *--p = (uint16_t)x[l];
        }
        size_t nw = (size_t)(words + wcap - p);
        size_t rlen = 2 * nw;
        res->len = 4 + rlen + bw.len;
        res->out = (uint8_t *)malloc(res->len);
        if (!res->out) goto out;
        res->out[0] = (uint8_t)rlen;
        res->out[1] = (uint8_t)(rlen >> 8);
        res->out[2] = (uint8_t)(rlen >> 16);
        res->out[3] = (uint8_t)(rlen >> 24);
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
        memcpy(res->out + 4, p, 2 * nw);
#else
        for (size_t w = 0; w < nw; w++) {
            res->out[4 + 2 * w] = (uint8_t)p[w];
            res->out[5 + 2 * w] = (uint8_t)(p[w] >> 8);
        }
#endif
        if (bw.len) memcpy(res->out + 4 + rlen, bw.buf, bw.len);
    }
    rc = 0;
out:
    work_close(&wk);
    free(bw.buf);
    return rc;
}

/* ------------------------------------------------------------------ decoder */

/* Turn each active bucket's ranks (rk[first[b] ..], ascending) into positions in range
 * order, with the bucket and base bits of each: one walk over the segments up to the last
 * changed element.  0, or -1 when a rank is past its bucket's end. */
__attribute__((noinline)) static int lanes_positions(const Params *P, uint32_t active, const int64_t *rk, const int64_t *first,
                           const int64_t *nbk, int64_t nnz, int64_t *pos, uint8_t *bko, uint64_t *basev,
                           uint64_t *bm) {
    uint64_t words[NB], segev[SEGB];
    int64_t segn[NB], idx[NB], seen[NB];
    memset(segev, 0, sizeof(segev));
    for (int b = 0; b < NB; b++) idx[b] = seen[b] = 0;
    int64_t found = 0, n = P->hi - P->lo, nseg = (n + SEG - 1) / SEG;
    uint32_t left = active; /* buckets with ranks still to place */
    for (int64_t g = 0; g < nseg && left; g++) {
        int64_t s0 = P->lo + g * SEG;
        int nbl = (int)((P->hi - s0 + BLK - 1) / BLK < SEGB ? (P->hi - s0 + BLK - 1) / BLK : SEGB);
        seg_masks(P, s0, nbl, left, bm, words, segn);
        uint64_t evw = 0;
        for (uint32_t pr = left; pr; pr &= pr - 1) {
            int b = __builtin_ctz(pr);
            const int64_t *rb = rk + first[b];
            int64_t i = idx[b];
            int64_t r = rb[i] - seen[b], rest = segn[b]; /* r: the target's rank past the blocks walked */
            for (uint64_t wm = words[b]; wm && r < rest; wm &= wm - 1) {
                int k = __builtin_ctzll(wm);
                uint64_t mb = bm[b * SEGB + k];
                int64_t c = __builtin_popcountll(mb);
                while (r < c) {
                    segev[k] |= 1ull << select_bit(mb, r);
                    evw |= 1ull << k;
                    if (++i == nbk[b]) { r = INT64_MAX; break; }
                    r += rb[i] - rb[i - 1];
                }
                r -= c;
                rest -= c;
            }
            idx[b] = i;
            seen[b] += segn[b];
            if (i == nbk[b]) left &= ~(1u << b);
        }
        for (; evw; evw &= evw - 1) {
            int k = __builtin_ctzll(evw);
            for (uint64_t ev = segev[k]; ev; ev &= ev - 1) {
                int64_t at = s0 + ((int64_t)k << 6) + __builtin_ctzll(ev);
                if (found >= nnz) return -1;
                basev[found] = load(P->base, P->width, at); /* the segment is in L1 now */
                bko[found] = (uint8_t)bucket_of(P, basev[found]);
                pos[found++] = at;
            }
            segev[k] = 0;
        }
    }
    return (left || found != nnz) ? -1 : 0;
}


#if defined(__x86_64__)
/* The values of a context-mode record of 16-bit floats, 16 at a time (n a multiple of 16):
 * each field's bit offset is a prefix sum of the bit lengths, its bits one 32-bit gather (a
 * field is at most 16 bits, at most 7 past a byte), and the value arithmetic of the scalar loop
 * lane for lane.  Reads at most 4 bytes past the last field (the raw bits have 16 of
 * padding, and the fields' total was checked).  Returns the bit position after the fields;
 * *zx |= 1 if any value is 0. */
AVX512 static uint64_t values16_avx512(const uint8_t *hs, const uint16_t *bv16, int64_t n, const uint8_t *rb, uint64_t bp,
                                       uint16_t *out, uint32_t xo, uint32_t *zx) {
    const __m512i one = _mm512_set1_epi32(1), m16 = _mm512_set1_epi32(0xFFFF), top = _mm512_set1_epi32(0x8000);
    const __m512i zero = _mm512_setzero_si512(), xov = _mm512_set1_epi32((int)xo), seven = _mm512_set1_epi32(7);
    __mmask16 z = 0;
    for (int64_t j = 0; j < n; j += 16) {
        __m512i h = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(hs + j)));
        __m512i ps = _mm512_add_epi32(h, _mm512_alignr_epi32(h, zero, 15)); /* inclusive prefix sum */
        ps = _mm512_add_epi32(ps, _mm512_alignr_epi32(ps, zero, 14));
        ps = _mm512_add_epi32(ps, _mm512_alignr_epi32(ps, zero, 12));
        ps = _mm512_add_epi32(ps, _mm512_alignr_epi32(ps, zero, 8));
        __m512i st = _mm512_add_epi32(_mm512_sub_epi32(ps, h), _mm512_set1_epi32((int)(bp & 7)));
        __m512i g = _mm512_i32gather_epi32(_mm512_srli_epi32(st, 3), (const void *)(rb + (bp >> 3)), 1);
        __m512i bits = _mm512_and_si512(_mm512_srlv_epi32(g, _mm512_and_si512(st, seven)),
                                        _mm512_sub_epi32(_mm512_sllv_epi32(one, h), one));
        /* |k| = the bits above the sign, under its leading one (a shift by h - 1 = -1 is 0) */
        __m512i mag = _mm512_or_si512(_mm512_srli_epi32(bits, 1), _mm512_sllv_epi32(one, _mm512_sub_epi32(h, one)));
        __m512i neg = _mm512_sub_epi32(zero, _mm512_and_si512(bits, one));
        __m512i k = _mm512_sub_epi32(_mm512_xor_si512(mag, neg), neg);
        __m512i b = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(bv16 + j)));
        __m512i ob = _mm512_mask_xor_epi32(_mm512_xor_si512(b, top), _mm512_test_epi32_mask(b, top), b, m16);
        __m512i o = _mm512_and_si512(_mm512_add_epi32(ob, k), m16);
        __m512i v = _mm512_mask_xor_epi32(_mm512_xor_si512(o, m16), _mm512_test_epi32_mask(o, top), o, top);
        v = _mm512_xor_si512(v, _mm512_and_si512(b, xov));
        z |= _mm512_cmpeq_epi32_mask(v, zero);
        _mm256_storeu_si256((__m256i *)(out + j), _mm512_cvtepi32_epi16(v));
        bp += (uint32_t)_mm_extract_epi32(_mm512_extracti32x4_epi32(ps, 3), 3);
    }
    *zx |= z != 0;
    return bp;
}
#endif

#if defined(__x86_64__)
/* values16_avx512 with 8 lanes per AVX2 vector (n a multiple of 8): the same arithmetic, the
 * prefix sum across the two 128-bit halves by a broadcast of the low half's last sum, the
 * float-order flips by blends. */
AVX2B static uint64_t values16_avx2(const uint8_t *hs, const uint16_t *bv16, int64_t n, const uint8_t *rb, uint64_t bp,
                                    uint16_t *out, uint32_t xo, uint32_t *zx) {
    const __m256i one = _mm256_set1_epi32(1), m16 = _mm256_set1_epi32(0xFFFF), top = _mm256_set1_epi32(0x8000);
    const __m256i zero = _mm256_setzero_si256(), xov = _mm256_set1_epi32((int)xo), seven = _mm256_set1_epi32(7);
    __m256i z = zero;
    for (int64_t j = 0; j < n; j += 8) {
        __m256i h = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(hs + j)));
        __m256i ps = _mm256_add_epi32(h, _mm256_slli_si256(h, 4)); /* inclusive prefix sum in each half */
        ps = _mm256_add_epi32(ps, _mm256_slli_si256(ps, 8));
        __m256i lo3 = _mm256_shuffle_epi32(ps, 0xFF); /* each half's last sum, in all its lanes */
        ps = _mm256_add_epi32(ps, _mm256_permute2x128_si256(lo3, lo3, 0x08)); /* high half += low half's */
        __m256i st = _mm256_add_epi32(_mm256_sub_epi32(ps, h), _mm256_set1_epi32((int)(bp & 7)));
        __m256i g = _mm256_i32gather_epi32((const int *)(rb + (bp >> 3)), _mm256_srli_epi32(st, 3), 1);
        __m256i bits = _mm256_and_si256(_mm256_srlv_epi32(g, _mm256_and_si256(st, seven)),
                                        _mm256_sub_epi32(_mm256_sllv_epi32(one, h), one));
        __m256i mag = _mm256_or_si256(_mm256_srli_epi32(bits, 1), _mm256_sllv_epi32(one, _mm256_sub_epi32(h, one)));
        __m256i neg = _mm256_sub_epi32(zero, _mm256_and_si256(bits, one));
        __m256i k = _mm256_sub_epi32(_mm256_xor_si256(mag, neg), neg);
        __m256i b = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(bv16 + j)));
        __m256i bneg = _mm256_cmpeq_epi32(_mm256_and_si256(b, top), top);
        __m256i o = _mm256_and_si256(_mm256_add_epi32(_mm256_xor_si256(b, _mm256_blendv_epi8(top, m16, bneg)), k), m16);
        __m256i oneg = _mm256_cmpeq_epi32(_mm256_and_si256(o, top), top);
        __m256i v = _mm256_xor_si256(_mm256_xor_si256(o, _mm256_blendv_epi8(m16, top, oneg)), _mm256_and_si256(b, xov));
        z = _mm256_or_si256(z, _mm256_cmpeq_epi32(v, zero));
        __m256i p = _mm256_permute4x64_epi64(_mm256_packus_epi32(v, v), 0x08);
        _mm_storeu_si128((__m128i *)(out + j), _mm256_castsi256_si128(p));
        bp += (uint32_t)_mm256_extract_epi32(ps, 7);
    }
    *zx |= !_mm256_testz_si256(z, z);
    return bp;
}
#endif

#if defined(__x86_64__)
AVX2 static uint64_t sum_u8_avx2(const uint8_t *p, int64_t n) {
    __m256i acc = _mm256_setzero_si256();
    int64_t i = 0;
    for (; i + 32 <= n; i += 32) acc = _mm256_add_epi64(acc, _mm256_sad_epu8(_mm256_loadu_si256((const __m256i *)(p + i)), _mm256_setzero_si256()));
    uint64_t t = (uint64_t)_mm256_extract_epi64(acc, 0) + (uint64_t)_mm256_extract_epi64(acc, 1) +
                 (uint64_t)_mm256_extract_epi64(acc, 2) + (uint64_t)_mm256_extract_epi64(acc, 3);
    for (; i < n; i++) t += p[i];
    return t;
}
#endif

/* p[0] + ... + p[n - 1] */
static uint64_t sum_u8(const uint8_t *p, int64_t n) {
#if defined(__x86_64__)
    if (HAVE_AVX2) return sum_u8_avx2(p, n);
#endif
    uint64_t t = 0;
    for (int64_t i = 0; i < n; i++) t += p[i];
    return t;
}

/* 0, -1 malformed, -2 allocation failure */
static int lanes_decode_record(const Params *P, const uint8_t *buf, size_t len, int64_t *pos, uint8_t *vals,
                               int64_t nnz) {
    if (len < 4 + 4 * LN) return -1;
    uint32_t rlen = (uint32_t)buf[0] | ((uint32_t)buf[1] << 8) | ((uint32_t)buf[2] << 16) | ((uint32_t)buf[3] << 24);
    if (rlen < 4 * LN || (rlen & 1) || rlen > len - 4) return -1;
    LDec d;
    memset(&d, 0, sizeof(d));
    for (int l = 0; l < LN; l++) {
        const uint8_t *q = buf + 4 + 4 * l;
        d.x[l] = (uint32_t)q[0] | ((uint32_t)q[1] << 8) | ((uint32_t)q[2] << 16) | ((uint32_t)q[3] << 24);
        if (d.x[l] < RANS_L) return -1;
    }
    d.p = buf + 4 + 4 * LN;
    d.end = buf + 4 + rlen;
    size_t rawlen = len - 4 - rlen;
    int rc = -1;
    int W = P->W;
    size_t nz = (size_t)(nnz ? nnz : 1);
    size_t tabs_bytes = (size_t)(2 * NB + 2) * PTOT * sizeof(uint32_t); /* the most tables a record reads */
    /* work beyond the output: 2 bytes per entry context-free (symbols, h; the ranks go straight
     * into the positions array), 19 in context mode (also buckets, ranks, base bits) */
    size_t per = P->context ? 1 + 1 + 1 + 8 + 8 : 1 + 1;
    Work wk;
    if (work_open(&wk, rawlen + 16 + nz * per + OFFB * sizeof(uint32_t) + tabs_bytes +
                           (P->context ? NB * SEGB * sizeof(uint64_t) + 128 : 0)) < 0)
        return -2;
    uint8_t *raw = (uint8_t *)work_take(&wk, rawlen + 16);
    uint32_t *off = (uint32_t *)work_take(&wk, OFFB * sizeof(uint32_t));
    uint8_t *sym = (uint8_t *)work_take(&wk, nz), *hs = (uint8_t *)work_take(&wk, nz);
    uint8_t *bko = P->context ? (uint8_t *)work_take(&wk, nz + 64) : NULL; /* + 64: whole-vector stores */
    int64_t *rk = P->context ? (int64_t *)work_take(&wk, nz * sizeof(int64_t)) : pos;
    uint64_t *basev = P->context ? (uint64_t *)work_take(&wk, nz * sizeof(uint64_t) + 64) : NULL;
    uint32_t *tabs = (uint32_t *)work_take(&wk, tabs_bytes);
    uint64_t *bm = P->context ? (uint64_t *)work_take(&wk, NB * SEGB * sizeof(uint64_t)) : NULL;
    memcpy(raw, buf + 4 + rlen, rawlen);
    memset(raw + rawlen, 0, 16);
    BitR br = {raw, 0, 8 * (uint64_t)rawlen, 0};
    /* header */
    uint32_t active;
    int64_t nbk[NB] = {0}, first[NB] = {0};
    int kb[NB] = {0};
    if (P->context) {
        active = (uint32_t)br_get(&br, 32);
        if ((active == 0) != (nnz == 0)) goto out;
    } else {
        active = nnz ? 1u : 0u;
    }
    {
        int64_t tot = 0;
        for (uint32_t pr = active; pr; pr &= pr - 1) {
            int b = __builtin_ctz(pr);
            if (P->context) {
                int L = (int)br_get(&br, 6);
                if (L < 1 || L > 41) goto out;
                nbk[b] = (int64_t)((1ull << (L - 1)) | br_get64(&br, L - 1));
            } else {
                nbk[b] = nnz;
            }
            kb[b] = (int)br_get(&br, 6);
            if (kb[b] > 40 || br.bad || nbk[b] > nnz - tot) goto out;
            first[b] = tot;
            tot += nbk[b];
        }
        if (tot != nnz) goto out;
    }
    /* tables: q of the active buckets, h of the active buckets, then (context-free) t of every h >= 2
     * the h table gives a frequency */
    uint32_t tq[NB], th[NB], tt[MAXW + 1], at = 0; /* the tables' offset words (lanes_get_table) */
    int64_t ow;
    uint32_t freq[MAXA];
    uint32_t fh0[MAXA];
    memset(fh0, 0, sizeof(fh0));
    for (uint32_t pr = active; pr; pr &= pr - 1) {
        int b = __builtin_ctz(pr);
        if ((ow = lanes_get_table(&br, QA, freq, tabs, &at)) < 0) goto out;
        tq[b] = (uint32_t)ow;
    }
    for (uint32_t pr = active; pr; pr &= pr - 1) {
        int b = __builtin_ctz(pr);
        if ((ow = lanes_get_table(&br, W + 1, freq, tabs, &at)) < 0) goto out;
        th[b] = (uint32_t)ow;
        if (!P->context) memcpy(fh0, freq, sizeof(freq));
    }
    for (int h = 0; h <= MAXW; h++) tt[h] = 0;
    if (!P->context && active)
        for (int h = 2; h <= W; h++)
            if (fh0[h]) {
                if ((ow = lanes_get_table(&br, 1 << lanes_tb(h), freq, tabs, &at)) < 0) goto out;
                tt[h] = (uint32_t)ow;
            }
    if (br.bad) goto out;
    /* G; symbols are decoded OFFB at a time, with their tables' offsets in off[] */
    for (uint32_t pr = active; pr; pr &= pr - 1) {
        int b = __builtin_ctz(pr);
        for (int64_t i = 0; i < OFFB && i < nbk[b]; i++) off[i] = tq[b];
        for (int64_t e = first[b]; e < first[b] + nbk[b]; e += OFFB) {
            int64_t m = first[b] + nbk[b] - e < OFFB ? first[b] + nbk[b] - e : OFFB;
            lanes_syms(&d, tabs, off, m, sym + e);
            if (d.bad) goto out;
        }
    }
    /* gaps -> ranks */
    int64_t range = P->hi - P->lo;
    for (uint32_t pr = active; pr; pr &= pr - 1) {
        int b = __builtin_ctz(pr);
        int k = kb[b];
        int64_t prev = -1;
        for (int64_t e = first[b]; e < first[b] + nbk[b]; e++) {
            uint64_t q = sym[e];
            if (q == QA - 1) {
                int L = (int)br_get(&br, 6);
                if (L > 48) goto out;
                q += br_getn(&br, L);
            }
            if (q >> (62 - k)) goto out;
            uint64_t u = (q << k) | br_getn(&br, k);
            if (br.bad || u >= (uint64_t)(range - 1 - prev)) goto out; /* rank past the range */
            prev += (int64_t)u + 1;
            rk[e] = prev;
        }
    }
    const uint16_t *bv16 = NULL; /* the base bits as 16-bit words, where the positions walk wrote them so */
    if (P->context) {
        int rp;
#if defined(__x86_64__)
        if (seg_isa(P) == 2) {
            rp = lanes_positions_w2_512(P, active, rk, first, nbk, nnz, pos, bko, (uint16_t *)basev,
                                        HAVE_VBMI2 ? emit_vbmi2 : emit_scalar);
            bv16 = (const uint16_t *)basev;
        } else if (seg_isa(P) == 1) {
            rp = lanes_positions_w2_256(P, active, rk, first, nbk, nnz, pos, bko, (uint16_t *)basev, emit_scalar);
            bv16 = (const uint16_t *)basev;
        } else
#endif
            rp = lanes_positions(P, active, rk, first, nbk, nnz, pos, bko, basev, bm);
        if (rp < 0) goto out;
    } else {
        for (int64_t j = 0; j < nnz; j++) pos[j] += P->lo; /* rk is pos */
    }
    /* H */
    if (!P->context)
        for (int64_t i = 0; i < OFFB && i < nnz; i++) off[i] = th[0];
    for (int64_t j = 0; j < nnz; j += OFFB) {
        int64_t m = nnz - j < OFFB ? nnz - j : OFFB;
        if (P->context)
            for (int64_t i = 0; i < m; i++) off[i] = th[bko[j + i]];
        lanes_syms(&d, tabs, off, m, hs + j);
        if (d.bad) goto out;
    }
    /* T (context-free) */
    if (!P->context) {
        int64_t nt = 0, m = 0;
        tt[0] = tt[1] = 0; /* written below but not kept (h < 2 has no T symbol) */
        for (int64_t j = 0; j < nnz; j++) {
            off[m] = tt[hs[j]]; /* the h table gave hs[j] a frequency, so its T table was read */
            m += hs[j] >= 2;
            if (m == OFFB || j == nnz - 1) {
                lanes_syms(&d, tabs, off, m, sym + nt);
                if (d.bad) goto out;
                nt += m;
                m = 0;
            }
        }
    }
    /* values: branch-free (signs and bit lengths are as good as random) */
    int64_t ti = 0;
    uint64_t zero_xor = 0;
    const uint64_t fl = P->is_float ? ~0ull : 0, sb = P->signbit, mk = P->mask;
    const int W1 = P->W - 1;
    if (P->context && P->width == 2 && P->is_float) {
        /* 16-bit floats in context mode (bf16, fp16: the common record), in 16-bit arithmetic,
         * the bit position in a register: every field read is in bounds, as the fields' total
         * is checked against the raw bits first */
        uint64_t need = sum_u8(hs, nnz);
        if (br.pos + need > br.nbits) goto out;
        uint64_t bp = br.pos;
        const uint8_t *rb = br.buf;
        uint16_t *out16 = (uint16_t *)vals;
        uint32_t zx = 0;
        const uint32_t xo = P->op == 0 ? 0xFFFFu : 0; /* xor: v ^= b */
        int64_t j = 0;
#if defined(__x86_64__)
        if (HAVE_AVX512 && bv16) {
            j = nnz & ~(int64_t)15;
            bp = values16_avx512(hs, bv16, j, rb, bp, out16, xo, &zx);
        } else if (HAVE_AVX2 && bv16) {
            j = nnz & ~(int64_t)7;
            bp = values16_avx2(hs, bv16, j, rb, bp, out16, xo, &zx);
        }
#endif
        for (; j < nnz; j++) {
            uint32_t h = hs[j];
            uint64_t w;
            memcpy(&w, rb + (bp >> 3), 8);
            uint32_t bits = (uint32_t)(w >> (bp & 7)) & ((1u << h) - 1);
            bp += h;
            uint32_t mag = (bits >> 1) | ((uint32_t)(h != 0) << ((h - 1) & 31));
            uint32_t neg = -(bits & 1);
            uint32_t k = (mag ^ neg) - neg;
            uint32_t b = bv16 ? bv16[j] : (uint32_t)basev[j];
            uint32_t o = ((b ^ ((b & 0x8000) ? 0xFFFFu : 0x8000u)) + k) & 0xFFFF;
            uint32_t v = (o ^ ((o & 0x8000) ? 0x8000u : 0xFFFFu)) ^ (b & xo);
            zx |= v == 0;
            out16[j] = (uint16_t)v;
        }
        br.pos = bp;
        zero_xor = zx;
    } else
    for (int64_t j = 0; j < nnz; j++) {
        uint32_t h = hs[j];
        uint64_t v;
        if (P->context) {
            uint64_t bits = br_getn(&br, (int)h);
            uint64_t mag = (bits >> 1) | ((uint64_t)(h != 0) << ((h - 1) & 63));
            uint64_t neg = -(bits & 1);
            uint64_t k = (mag ^ neg) - neg;
            uint64_t b = bv16 ? bv16[j] : basev[j]; /* context mode: basev is allocated */
            /* ord(b) = b ^ (b negative ? mask : signbit); iord(o) = o ^ (o's top bit ? signbit : mask) */
            uint64_t sgn = -((b >> W1) & 1);
            uint64_t o = (b ^ (fl & ((sgn & mk) | (~sgn & sb)))) + k;
            o &= mk;
            uint64_t so = -((o >> W1) & 1);
            v = o ^ (fl & ((so & sb) | (~so & mk)));
            if (P->op == 0) v ^= b;
        } else {
            int big = h >= 2;
            int tb = big ? lanes_tb((int)h) : 0, rest = big ? (int)h - 1 - tb : 0;
            uint64_t t = sym[ti];
            ti += big;
            uint64_t vb = (1ull << ((h - 1) & 63)) | (t << rest) | br_getn(&br, rest);
            v = big ? vb : h;
        }
        zero_xor |= (uint64_t)(v == 0);
        store(vals, P->width, j, v);
    }
    if (P->op == 0 && zero_xor) goto out; /* v1 carries no zero XOR value */
    if (br.bad || d.p != d.end || !br_done(&br)) goto out;
    for (int l = 0; l < LN; l++)
        if (d.x[l] != RANS_L) goto out;
    rc = 0;
out:
    work_close(&wk);
    return rc;
}
