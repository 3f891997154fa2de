#if defined(__x86_64__)
/*
 * Segment counts for 2-byte float bases (included by rans.c after its block scans): the
 * primitives of the context-mode walks in segwalk.h, once for AVX-512BW (`_512`) and once for
 * AVX2 (`_256`); both give the same arrays.
 *
 * The context-mode block walks of the LANES encoder (each changed element's rank in its
 * bucket) and of the LANES and BUCKET decoders (each target rank's element) share one pass
 * per segment (SEGB blocks of 64): each block's bucket ids (64 bytes, kept for the segment),
 * and for each of the top WIN active buckets (a window fixed per record, from the highest
 * active bucket down; `Win`) its running count at every block's end, from four bit planes of
 * the ids and a popcount each, no branch.  Active buckets below the window (the smallest
 * magnitudes: rare) are only counted in the blocks that hold an id below it (the returned
 * mask).  Buckets without a changed element are never counted. */
#define PF_AHEAD 1024 /* elements the segment pass prefetches ahead (2 KiB) */
#define WIN 12 /* at most 12: the bit planes below make 3 x 4 masks */
#define PRE_END 0x7FFF /* pre[k][g] past a segment's last block: above every rank in a segment */
#define AVX2B __attribute__((target("avx2,popcnt,bmi,bmi2")))

typedef struct {
    int wlo, wn;      /* window: buckets wlo .. wlo + wn - 1 */
    uint32_t below;   /* active buckets below it */
} Win;

static inline void win_init(Win *w, uint32_t active) {
    int tb = 31 - __builtin_clz(active), lb = __builtin_ctz(active);
    w->wlo = tb - WIN + 1 > lb ? tb - WIN + 1 : lb;
    w->wn = tb - w->wlo + 1;
    w->below = active & ((1u << w->wlo) - 1);
}

/* Block g's window counts from the bit planes of id - wlo (ids outside the window wrap past
 * it; inw: the elements inside it): 20 scalar ANDs and 12 popcounts instead of 12 compares. */
static inline __attribute__((always_inline)) void win_add(uint64_t inw, uint64_t p0, uint64_t p1, uint64_t p2,
                                                          uint64_t p3, int g, uint16_t (*pre)[SEGB], uint32_t *run) {
    uint64_t a = inw & ~p3, c = inw & p3;
    uint64_t hh[3] = {a & ~p2, a & p2, c & ~p2}; /* bits 3, 2 of id - wlo: 00, 01, 10 */
    uint64_t ll[4] = {~(p1 | p0), p0 & ~p1, p1 & ~p0, p1 & p0};
    for (int k = 0; k < WIN; k++) {
        run[k] += (uint32_t)__builtin_popcountll(hh[k >> 2] & ll[k & 3]);
        pre[k][g] = (uint16_t)run[k];
    }
}

/* A partial last block's ids, element by element (255 past the end: no bucket's). */
static inline void ids_tail(const Params *P, int64_t s, int64_t n, uint8_t *ids) {
    for (int j = 0; j < BLK; j++) ids[j] = j < n ? (uint8_t)bucket_of(P, ((const uint16_t *)P->base)[s + j]) : 255;
}

/* ---- AVX-512BW ---------------------------------------------------------------------------- */

/* One segment from s0 (nblk blocks): ids into ids_s, window bucket k's running count at the
 * end of block g into pre[k][g] (its total into run[k]); returns the blocks with an id below
 * the window. */
AVX512 static inline uint64_t seg_counts_512(const Params *P, const Win *w, int64_t s0, int nblk, uint8_t *ids_s,
                                             uint16_t (*pre)[SEGB], uint32_t *run) {
    const __m128i sh = _mm_cvtsi32_si128(P->eshift);
    const __m512i emask = _mm512_set1_epi16((short)((1u << P->ebits) - 1));
    const __m512i elo = _mm512_set1_epi16((short)P->e_lo);
    const __m512i top = _mm512_set1_epi16(NB - 1);
    const __m512i pad = _mm512_set1_epi8((char)255);
    const __m512i wlov = _mm512_set1_epi8((char)w->wlo);
    const uint16_t *base = (const uint16_t *)P->base;
    uint64_t lowblk = 0;
    for (int k = 0; k < WIN; k++) run[k] = 0;
    for (int g = 0; g < nblk; g++) {
        int64_t s = s0 + (int64_t)g * BLK, n = P->hi - s < BLK ? P->hi - s : BLK;
        uint64_t valid = n == BLK ? ~0ull : (1ull << n) - 1;
        __m512i v0, v1;
        _mm_prefetch((const char *)(base + s + PF_AHEAD), _MM_HINT_T0); /* the pass reads the base once */
        _mm_prefetch((const char *)(base + s + PF_AHEAD + 32), _MM_HINT_T0);
        if (n == BLK) {
            v0 = _mm512_loadu_si512((const void *)(base + s));
            v1 = _mm512_loadu_si512((const void *)(base + s + 32));
        } else {
            v0 = _mm512_maskz_loadu_epi16((__mmask32)valid, base + s);
            v1 = _mm512_maskz_loadu_epi16((__mmask32)(valid >> 32), base + s + 32);
        }
        __m512i q0 = _mm512_min_epu16(_mm512_subs_epu16(_mm512_and_si512(_mm512_srl_epi16(v0, sh), emask), elo), top);
        __m512i q1 = _mm512_min_epu16(_mm512_subs_epu16(_mm512_and_si512(_mm512_srl_epi16(v1, sh), emask), elo), top);
        __m512i ids = _mm512_inserti64x4(_mm512_castsi256_si512(_mm512_cvtepi16_epi8(q0)), _mm512_cvtepi16_epi8(q1), 1);
        ids = _mm512_mask_mov_epi8(pad, valid, ids); /* 255 past the end: no bucket's */
        _mm512_store_si512((__m512i *)(ids_s + (size_t)g * BLK), ids);
        __m512i idr = _mm512_sub_epi8(ids, wlov);
        win_add(_mm512_cmplt_epu8_mask(idr, _mm512_set1_epi8(WIN)), _mm512_movepi8_mask(_mm512_slli_epi16(idr, 7)),
                _mm512_movepi8_mask(_mm512_slli_epi16(idr, 6)), _mm512_movepi8_mask(_mm512_slli_epi16(idr, 5)),
                _mm512_movepi8_mask(_mm512_slli_epi16(idr, 4)), g, pre, run);
        lowblk |= (uint64_t)(_mm512_cmplt_epu8_mask(ids, wlov) != 0) << g;
    }
    return lowblk;
}

/* Bucket b's mask in block g of the segment's ids. */
AVX512 static inline uint64_t seg_mask_512(const uint8_t *ids_s, int g, int b) {
    return _mm512_cmpeq_epi8_mask(_mm512_load_si512((const __m512i *)(ids_s + (size_t)g * BLK)), _mm512_set1_epi8((char)b));
}

/* The block g (< nblk) holding window bucket k's element of segment rank r (r < run[k]), and
 * r's rank within the block (*rr): g is the number of running counts at or below r, two
 * vector compares over pre[k] (whose entries from nblk on must be PRE_END). */
AVX512 static inline int seg_locate_512(const uint16_t (*pre)[SEGB], int k, int64_t r, int64_t *rr) {
    __m512i dv = _mm512_set1_epi16((short)r);
    int g = __builtin_popcount(_mm512_cmple_epu16_mask(_mm512_load_si512((const __m512i *)pre[k]), dv)) +
            __builtin_popcount(_mm512_cmple_epu16_mask(_mm512_load_si512((const __m512i *)(pre[k] + 32)), dv));
    *rr = r - (g ? pre[k][g - 1] : 0);
    return g;
}

/* ---- AVX2 --------------------------------------------------------------------------------- */

AVX2B static inline uint64_t mask64_256(__m256i a, __m256i b) {
    return (uint64_t)(uint32_t)_mm256_movemask_epi8(a) | (uint64_t)(uint32_t)_mm256_movemask_epi8(b) << 32;
}

/* seg_counts_512's outputs with two 32-byte vectors per block (no unsigned byte compare:
 * x < WIN is min(x, WIN - 1) == x, x < wlo is a nonzero saturating wlo - x). */
AVX2B static inline uint64_t seg_counts_256(const Params *P, const Win *w, int64_t s0, int nblk, uint8_t *ids_s,
                                            uint16_t (*pre)[SEGB], uint32_t *run) {
    const __m128i sh = _mm_cvtsi32_si128(P->eshift);
    const __m256i emask = _mm256_set1_epi16((short)((1u << P->ebits) - 1));
    const __m256i elo = _mm256_set1_epi16((short)P->e_lo);
    const __m256i top = _mm256_set1_epi16(NB - 1);
    const __m256i wlov = _mm256_set1_epi8((char)w->wlo), wmax = _mm256_set1_epi8(WIN - 1);
    const uint16_t *base = (const uint16_t *)P->base;
    uint64_t lowblk = 0;
    for (int k = 0; k < WIN; k++) run[k] = 0;
    for (int g = 0; g < nblk; g++) {
        int64_t s = s0 + (int64_t)g * BLK, n = P->hi - s < BLK ? P->hi - s : BLK;
        uint8_t *ids = ids_s + (size_t)g * BLK;
        __m256i i0, i1;
        _mm_prefetch((const char *)(base + s + PF_AHEAD), _MM_HINT_T0);
        _mm_prefetch((const char *)(base + s + PF_AHEAD + 32), _MM_HINT_T0);
        if (n == BLK) {
            __m256i q[4];
            for (int h = 0; h < 4; h++) {
                __m256i v = _mm256_loadu_si256((const __m256i *)(base + s + 16 * h));
                q[h] = _mm256_min_epu16(_mm256_subs_epu16(_mm256_and_si256(_mm256_srl_epi16(v, sh), emask), elo), top);
            }
            i0 = pack16_8(q[0], q[1]);
            i1 = pack16_8(q[2], q[3]);
            _mm256_store_si256((__m256i *)ids, i0);
            _mm256_store_si256((__m256i *)(ids + 32), i1);
        } else {
            ids_tail(P, s, n, ids);
            i0 = _mm256_load_si256((const __m256i *)ids);
            i1 = _mm256_load_si256((const __m256i *)(ids + 32));
        }
        __m256i r0 = _mm256_sub_epi8(i0, wlov), r1 = _mm256_sub_epi8(i1, wlov);
        win_add(mask64_256(_mm256_cmpeq_epi8(_mm256_min_epu8(r0, wmax), r0), _mm256_cmpeq_epi8(_mm256_min_epu8(r1, wmax), r1)),
                mask64_256(_mm256_slli_epi16(r0, 7), _mm256_slli_epi16(r1, 7)),
                mask64_256(_mm256_slli_epi16(r0, 6), _mm256_slli_epi16(r1, 6)),
                mask64_256(_mm256_slli_epi16(r0, 5), _mm256_slli_epi16(r1, 5)),
                mask64_256(_mm256_slli_epi16(r0, 4), _mm256_slli_epi16(r1, 4)), g, pre, run);
        __m256i lo = _mm256_or_si256(_mm256_subs_epu8(wlov, i0), _mm256_subs_epu8(wlov, i1));
        lowblk |= (uint64_t)!_mm256_testz_si256(lo, lo) << g;
    }
    return lowblk;
}

AVX2B static inline uint64_t seg_mask_256(const uint8_t *ids_s, int g, int b) {
    const __m256i bv = _mm256_set1_epi8((char)b);
    const uint8_t *ids = ids_s + (size_t)g * BLK;
    return mask64_256(_mm256_cmpeq_epi8(_mm256_load_si256((const __m256i *)ids), bv),
                      _mm256_cmpeq_epi8(_mm256_load_si256((const __m256i *)(ids + 32)), bv));
}

/* seg_locate_512 by signed compares (counts and ranks are below PRE_END): g = 64 - the
 * running counts above r. */
AVX2B static inline int seg_locate_256(const uint16_t (*pre)[SEGB], int k, int64_t r, int64_t *rr) {
    const __m256i dv = _mm256_set1_epi16((short)r);
    const __m256i *p = (const __m256i *)pre[k];
    __m256i a = _mm256_packs_epi16(_mm256_cmpgt_epi16(_mm256_load_si256(p), dv), _mm256_cmpgt_epi16(_mm256_load_si256(p + 1), dv));
    __m256i b = _mm256_packs_epi16(_mm256_cmpgt_epi16(_mm256_load_si256(p + 2), dv), _mm256_cmpgt_epi16(_mm256_load_si256(p + 3), dv));
    int g = SEGB - __builtin_popcount((uint32_t)_mm256_movemask_epi8(a)) - __builtin_popcount((uint32_t)_mm256_movemask_epi8(b));
    *rr = r - (g ? pre[k][g - 1] : 0);
    return g;
}

/* ---- both --------------------------------------------------------------------------------- */

/* The position of the j-th set bit of m (m has more than j): pdep where it is one
 * instruction (FAST_PDEP), else the portable select. */
__attribute__((target("bmi,bmi2"))) static inline int sel_bit(uint64_t m, int64_t j) {
    return FAST_PDEP ? __builtin_ctzll(_pdep_u64(1ull << j, m)) : select_bit_portable(m, j);
}

/* Step 4 of the LANES positions walk: a segment's targets (bit j of segev[g]: element
 * s0 + 64 g + j; evblk: the blocks with any) in range order into pos, bko (their buckets, from
 * ids_s) and bv16 (their base bits), from `found`, clearing segev; returns the new count, or
 * -1 past nnz.  With VBMI2 each block's outputs are compressed out of its vectors in a few
 * whole-vector stores (bko, bv16 have 64 bytes of slack; pos gets a masked store at its end);
 * without it, element by element. */
typedef int64_t (*EmitFn)(const Params *, int64_t, uint64_t, uint64_t *, const uint8_t *, int64_t, int64_t, int64_t *,
                          uint8_t *, uint16_t *);

static int64_t emit_scalar(const Params *P, int64_t s0, uint64_t evblk, uint64_t *segev, const uint8_t *ids_s,
                           int64_t found, int64_t nnz, int64_t *pos, uint8_t *bko, uint16_t *bv16) {
    const uint16_t *base = (const uint16_t *)P->base;
    for (; evblk; evblk &= evblk - 1) {
        int g = __builtin_ctzll(evblk);
        uint64_t ev = segev[g];
        segev[g] = 0;
        if (__builtin_popcountll(ev) > nnz - found) return -1;
        int64_t s = s0 + (int64_t)g * BLK;
        for (; ev; ev &= ev - 1) {
            int j = __builtin_ctzll(ev);
            pos[found] = s + j;
            bv16[found] = base[s + j];
            bko[found++] = ids_s[(size_t)g * BLK + (size_t)j];
        }
    }
    return found;
}

AVX512 __attribute__((target("bmi2,avx512vbmi,avx512vbmi2"))) static int64_t emit_vbmi2(
    const Params *P, int64_t s0, uint64_t evblk, uint64_t *segev, const uint8_t *ids_s, int64_t found, int64_t nnz,
    int64_t *pos, uint8_t *bko, uint16_t *bv16) {
    const __m512i iota = _mm512_set_epi8(63, 62, 61, 60, 59, 58, 57, 56, 55, 54, 53, 52, 51, 50, 49, 48, 47, 46, 45, 44,
                                         43, 42, 41, 40, 39, 38, 37, 36, 35, 34, 33, 32, 31, 30, 29, 28, 27, 26, 25,
                                         24, 23, 22, 21, 20, 19, 18, 17, 16, 15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4,
                                         3, 2, 1, 0);
    const uint16_t *base = (const uint16_t *)P->base;
    for (; evblk; evblk &= evblk - 1) {
        int g = __builtin_ctzll(evblk);
        uint64_t ev = segev[g];
        segev[g] = 0;
        int c = __builtin_popcountll(ev), c0 = __builtin_popcount((uint32_t)ev);
        if (c > nnz - found) return -1;
        int64_t s = s0 + (int64_t)g * BLK;
        __m512i ids = _mm512_load_si512((const __m512i *)(ids_s + (size_t)g * BLK));
        _mm512_storeu_si512((void *)(bko + found), _mm512_maskz_compress_epi8(ev, ids));
        __m512i offs = _mm512_maskz_compress_epi8(ev, iota);
        const __m512i sv = _mm512_set1_epi64(s);
        for (int t = 0; t < c; t += 8) { /* 8 positions per store; more than 8 is rare below 12% changed */
            __m512i o = t ? _mm512_permutexvar_epi8(_mm512_add_epi8(iota, _mm512_set1_epi8((char)t)), offs) : offs;
            __m512i p = _mm512_add_epi64(_mm512_cvtepu8_epi64(_mm512_castsi512_si128(o)), sv);
            if (found + t + 8 <= nnz)
                _mm512_storeu_si512((void *)(pos + found + t), p);
            else
                _mm512_mask_storeu_epi64(pos + found + t, (__mmask8)_bzhi_u32(0xFF, (unsigned)(c - t)), p);
        }
        __m512i w0 = _mm512_maskz_loadu_epi16((__mmask32)ev, base + s);
        __m512i w1 = _mm512_maskz_loadu_epi16((__mmask32)(ev >> 32), base + s + 32);
        _mm512_storeu_si512((void *)(bv16 + found), _mm512_maskz_compress_epi16((__mmask32)ev, w0));
        _mm512_storeu_si512((void *)(bv16 + found + c0), _mm512_maskz_compress_epi16((__mmask32)(ev >> 32), w1));
        found += c;
    }
    return found;
}
#endif
