#if defined(__x86_64__)
/*
 * AVX-512 segment counts (included by rans.c after its block scans).
 *
 * The context-mode block walks of the LANES encoder (each changed element's rank in its
 * bucket) and of the LANES and BUCKET decoders (each target rank's element), for 2-byte
 * float bases with AVX-512BW, share one pass per segment (SEGB blocks of 64): each block's
 * bucket ids (a 64-byte vector, kept for the segment), and for each of the top WIN active buckets (a window fixed per record,
 * from the highest active bucket down; `Win`) its running count at every block's end, one
 * compare into a mask register and a popcount each, unrolled, no branch.  Active buckets
 * below the window (the smallest magnitudes: rare) are only counted in the blocks that hold
 * an id below it (the returned mask).  Buckets without a changed element are never counted. */
#define PF_AHEAD 1024 /* elements the segment pass prefetches ahead (2 KiB) */
#define WIN 12 /* at most 12: the bit planes below make 3 x 4 masks */

typedef struct {
    int wlo, wn;      /* window: buckets wlo .. wlo + wn - 1 */
    uint32_t below;   /* active buckets below it */
    __m512i bv[WIN];  /* each window bucket's id in every byte (254 past wn: no bucket's) */
    __m512i wlov;     /* wlo in every byte */
} Win;

AVX512 static inline void win_init(Win *w, uint32_t active) {
    int tb = 31 - __builtin_clz(active), lb = __builtin_ctz(active);
    w->wlo = tb - WIN + 1 > lb ? tb - WIN + 1 : lb;
    w->wn = tb - w->wlo + 1;
    for (int k = 0; k < WIN; k++) w->bv[k] = _mm512_set1_epi8((char)(k < w->wn ? w->wlo + k : 254));
    w->below = active & ((1u << w->wlo) - 1);
    w->wlov = _mm512_set1_epi8((char)w->wlo);
}

/* One segment from s0 (nblk blocks): ids into ids_s, window bucket k's running count at the
 * end of block g into pre[k][g] (its total into run[k]); returns the blocks with an id below
 * the window. */
AVX512 static inline uint64_t seg_counts_w2(const Params *P, const Win *w, int64_t s0, int nblk, uint8_t *ids_s,
                                            uint16_t (*pre)[SEGB], uint32_t *run) {
    const __m128i sh = _mm_cvtsi32_si128(P->eshift);
    const __m512i emask = _mm512_set1_epi16((short)((1u << P->ebits) - 1));
    const __m512i elo = _mm512_set1_epi16((short)P->e_lo);
    const __m512i top = _mm512_set1_epi16(NB - 1);
    const __m512i pad = _mm512_set1_epi8((char)255);
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
        /* the window buckets' masks from bit planes of id - wlo (ids below the window wrap
         * past it): 6 mask extractions and 20 scalar ANDs instead of 12 compares */
        __m512i idr = _mm512_sub_epi8(ids, w->wlov);
        uint64_t inw = _mm512_cmplt_epu8_mask(idr, _mm512_set1_epi8(WIN));
        uint64_t p0 = _mm512_movepi8_mask(_mm512_slli_epi16(idr, 7)), p1 = _mm512_movepi8_mask(_mm512_slli_epi16(idr, 6));
        uint64_t p2 = _mm512_movepi8_mask(_mm512_slli_epi16(idr, 5)), p3 = _mm512_movepi8_mask(_mm512_slli_epi16(idr, 4));
        uint64_t a = inw & ~p3, c = inw & p3;
        uint64_t hh[3] = {a & ~p2, a & p2, c & ~p2}; /* bits 3, 2 of id - wlo: 00, 01, 10 */
        uint64_t ll[4] = {~(p1 | p0), p0 & ~p1, p1 & ~p0, p1 & p0};
        for (int k = 0; k < WIN; k++) {
            run[k] += (uint32_t)__builtin_popcountll(hh[k >> 2] & ll[k & 3]);
            pre[k][g] = (uint16_t)run[k];
        }
        lowblk |= (uint64_t)(_mm512_cmplt_epu8_mask(ids, w->wlov) != 0) << g;
    }
    return lowblk;
}

/* Elements of bucket b (below the window) in the blocks of `blocks` before block g. */
AVX512 static inline int64_t below_count(const uint8_t *ids_s, uint64_t blocks, int g, int b) {
    int64_t c = 0;
    for (uint64_t lw = blocks & ((1ull << g) - 1); lw; lw &= lw - 1)
        c += __builtin_popcountll(_mm512_cmpeq_epi8_mask(_mm512_load_si512((const __m512i *)(ids_s + (size_t)__builtin_ctzll(lw) * BLK)),
                                                         _mm512_set1_epi8((char)b)));
    return c;
}

/* The block g (< nblk) holding window bucket k's element of segment rank r (r < run[k]), and
 * r's rank within the block (*rr): g is the number of running counts at or below r, two
 * vector compares over pre[k] (whose entries from nblk on must be 0xFFFF). */
AVX512 static inline int seg_locate(const uint16_t (*pre)[SEGB], int k, int64_t r, int64_t *rr) {
    __m512i dv = _mm512_set1_epi16((short)r);
    int g = __builtin_popcount(_mm512_cmple_epu16_mask(_mm512_load_si512((const __m512i *)pre[k]), dv)) +
            __builtin_popcount(_mm512_cmple_epu16_mask(_mm512_load_si512((const __m512i *)(pre[k] + 32)), dv));
    *rr = r - (g ? pre[k][g - 1] : 0);
    return g;
}

/* Bucket b's mask in block g of the segment's ids. */
AVX512 static inline uint64_t seg_mask(const uint8_t *ids_s, int g, int b) {
    return _mm512_cmpeq_epi8_mask(_mm512_load_si512((const __m512i *)(ids_s + (size_t)g * BLK)), _mm512_set1_epi8((char)b));
}
/* rank_scan for 2-byte float bases (rans.c dispatches here; same outputs): each changed
 * element's bucket and base bits first (O(changed)), then per segment the counts above, and
 * each changed element's rank is its bucket's count before the segment, plus the running
 * count before its block, plus one masked popcount in its block: one loop over the segment's
 * changed elements, no branch per element.  Segments up to the last changed element, or the
 * whole range with `full` (then cnt[b] is active bucket b's size in the range, 0 for the
 * others); `order` (if given) gets each segment's changed elements bucket by bucket (a
 * counting sort), BUCKET's consumption order.  Buckets without a changed element are never
 * counted. */
AVX512 __attribute__((target("bmi2"))) static void seg_ranks_w2(const Params *P, const int64_t *pos, int64_t nnz,
                                                              uint8_t *bk, int64_t *rank, uint64_t *basev,
                                                              int64_t *cnt_out, uint32_t *active_out, int64_t *order,
                                                              int full) {
    const uint16_t *base = (const uint16_t *)P->base;
    uint32_t active = 0;
    for (int64_t j = 0; j < nnz; j++) {
        basev[j] = base[pos[j]];
        bk[j] = (uint8_t)bucket_of(P, basev[j]);
        active |= 1u << bk[j];
    }
    *active_out = active;
    int64_t cnt[NB] = {0}; /* each active bucket's elements before the segment */
    if (nnz) {
        Win w;
        win_init(&w, active);
        _Alignas(64) uint8_t ids_s[SEG];
        _Alignas(64) uint16_t pre[WIN][SEGB];
        uint32_t run[WIN];
        int64_t j = 0, oi = 0;
        for (int64_t s0 = P->lo; full ? s0 < P->hi : j < nnz; s0 += SEG) {
            int nblk = (int)((P->hi - s0 + BLK - 1) / BLK < SEGB ? (P->hi - s0 + BLK - 1) / BLK : SEGB);
            uint64_t lowblk = seg_counts_w2(P, &w, s0, nblk, ids_s, pre, run);
            int64_t j0 = j;
            for (; j < nnz && pos[j] < s0 + SEG; j++) {
                int b = bk[j], off = (int)(pos[j] - s0), g = off >> 6, k = b - w.wlo;
                int64_t in = __builtin_popcountll(_bzhi_u64(seg_mask(ids_s, g, b), (unsigned)(off & 63)));
                rank[j] = cnt[b] + in + (k >= 0 ? (g ? pre[k][g - 1] : 0) : below_count(ids_s, lowblk, g, b));
            }
            for (int k = 0; k < w.wn; k++) cnt[w.wlo + k] += run[k];
            for (uint32_t pr = w.below; pr && lowblk; pr &= pr - 1)
                cnt[__builtin_ctz(pr)] += below_count(ids_s, lowblk, SEGB, __builtin_ctz(pr));
            if (order && j > j0) {
                int64_t at[NB + 1] = {0};
                for (int64_t t = j0; t < j; t++) at[bk[t] + 1]++;
                for (int b = 0; b < NB; b++) at[b + 1] += at[b];
                for (int64_t t = j0; t < j; t++) order[oi + at[bk[t]]++] = t;
                oi += j - j0;
            }
        }
    }
    if (cnt_out)
        for (int b = 0; b < NB; b++) cnt_out[b] = (active >> b & 1) ? cnt[b] : 0;
}
#endif
