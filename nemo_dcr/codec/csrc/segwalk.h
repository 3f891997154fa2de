/*
 * The context-mode walks over segcount.h's segment pass, for 2-byte float bases: rans.c
 * includes this file twice, with SW(name) naming the instance (name_512, name_256), SW_T its
 * target and SW_ISA the primitives' suffix.  Each instance gives the same arrays as the generic
 * walks it replaces (tests/codec/test_simd_paths.py, test_lanes_coding.py).
 */
#define SW_CAT2(a, b) a##b
#define SW_CAT(a, b) SW_CAT2(a, b)
#define SW(name) SW_CAT(name, SW_ISA)

/* Elements of bucket b (below the window) in the blocks of `blocks` before block g. */
SW_T static inline int64_t SW(below_count)(const uint8_t *ids_s, uint64_t blocks, int g, int b) {
    int64_t c = 0;
    for (uint64_t lw = blocks & ((1ull << g) - 1); lw; lw &= lw - 1) c += __builtin_popcountll(SW(seg_mask)(ids_s, __builtin_ctzll(lw), b));
    return c;
}

/* rank_scan for 2-byte float bases (rans.c dispatches here; same outputs): each changed
 * element's bucket and base bits first (O(changed)), then per segment the counts above, and
 * each changed element's rank is its bucket's count before the segment, plus the running
 * count before its block, plus one masked popcount in its block: one loop over the segment's
 * changed elements, no branch per element.  Segments up to the last changed element, or the
 * whole range with `full` (then cnt[b] is active bucket b's size in the range, 0 for the
 * others); `order` (if given) gets each segment's changed elements bucket by bucket (a
 * counting sort), BUCKET's consumption order. */
SW_T static void SW(seg_ranks_w2)(const Params *P, const int64_t *pos, int64_t nnz, uint8_t *bk, int64_t *rank,
                                  uint64_t *basev, int64_t *cnt_out, uint32_t *active_out, int64_t *order, int full) {
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
            uint64_t lowblk = SW(seg_counts)(P, &w, s0, nblk, ids_s, pre, run);
            int64_t j0 = j;
            for (; j < nnz && pos[j] < s0 + SEG; j++) {
                int b = bk[j], off = (int)(pos[j] - s0), g = off >> 6, k = b - w.wlo;
                int64_t in = __builtin_popcountll(_bzhi_u64(SW(seg_mask)(ids_s, g, b), (unsigned)(off & 63)));
                rank[j] = cnt[b] + in + (k >= 0 ? (g ? pre[k][g - 1] : 0) : SW(below_count)(ids_s, lowblk, g, b));
            }
            for (int k = 0; k < w.wn; k++) cnt[w.wlo + k] += run[k];
            for (uint32_t pr = w.below; pr && lowblk; pr &= pr - 1)
                cnt[__builtin_ctz(pr)] += SW(below_count)(ids_s, lowblk, SEGB, __builtin_ctz(pr));
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

/* decode_body's context-mode positions (BUCKET): the segment pass instead of every bucket's
 * bitmaps (seg_masks), and each target's block by vector compares over its bucket's running
 * counts.  The gaps are decoded in the same order (segment by segment, bucket by bucket
 * ascending, each in rank order), so the adaptive state runs the same.  rem[b]: the rank of
 * b's next target past the elements walked.  0, or -1 malformed. */
SW_T static int SW(bucket_positions_w2)(Model *m, const Params *P, RDec *d, BitR *br, uint32_t active, int64_t *rem,
                                        int64_t nnz, int64_t *pos, uint64_t *basev) {
    Win w;
    win_init(&w, active);
    _Alignas(64) uint8_t ids_s[SEG];
    _Alignas(64) uint16_t pre[WIN][SEGB];
    uint32_t run[WIN];
    uint64_t segev[SEGB];
    memset(segev, 0, sizeof(segev));
    const uint16_t *base = (const uint16_t *)P->base;
    int64_t found = 0;
    for (int64_t s0 = P->lo; s0 < P->hi && found < nnz; s0 += SEG) {
        int nblk = (int)((P->hi - s0 + BLK - 1) / BLK < SEGB ? (P->hi - s0 + BLK - 1) / BLK : SEGB);
        uint64_t lowblk = SW(seg_counts)(P, &w, s0, nblk, ids_s, pre, run), evw = 0;
        for (int k = 0; k < WIN; k++)
            for (int g = nblk; g < SEGB; g++) pre[k][g] = PRE_END;
        int64_t nev = 0;
        for (uint32_t pr = active; pr; pr &= pr - 1) { /* ascending: the gaps' order */
            int b = __builtin_ctz(pr), k = b - w.wlo;
            int64_t r = rem[b];
            if (k >= 0) {
                int64_t T = run[k], rr;
                while (r < T) {
                    int g = SW(seg_locate)(pre, k, r, &rr);
                    segev[g] |= 1ull << sel_bit(SW(seg_mask)(ids_s, g, b), rr);
                    evw |= 1ull << g;
                    nev++;
                    r += (int64_t)dec_gap(m, d, br, b);
                    if (d->bad || br->bad || found + nev > nnz) return -1;
                }
                rem[b] = r - T;
            } else { /* below the window: only the blocks with an id below it hold b */
                for (uint64_t lw = lowblk; lw; lw &= lw - 1) {
                    int g = __builtin_ctzll(lw);
                    uint64_t mb = SW(seg_mask)(ids_s, g, b);
                    int64_t c = __builtin_popcountll(mb);
                    while (r < c) {
                        segev[g] |= 1ull << sel_bit(mb, r);
                        evw |= 1ull << g;
                        nev++;
                        r += (int64_t)dec_gap(m, d, br, b);
                        if (d->bad || br->bad || found + nev > nnz) return -1;
                    }
                    r -= c;
                }
                rem[b] = r;
            }
        }
        for (; evw; evw &= evw - 1) {
            int g = __builtin_ctzll(evw);
            for (uint64_t ev = segev[g]; ev; ev &= ev - 1) {
                int64_t at = s0 + ((int64_t)g << 6) + __builtin_ctzll(ev);
                basev[found] = base[at];
                pos[found++] = at;
            }
            segev[g] = 0;
        }
    }
    return found == nnz ? 0 : -1;
}

/* lanes_positions (LANES) for 2-byte float bases, a segment (64 blocks of 64) at a time and
 * branch-light:
 *   1. the segment pass (SW(seg_counts));
 *   2. per window bucket with a target rank inside the segment, each such target's block is
 *      the number of running counts not above it (vector compares), and its element one bit
 *      select in that block's mask;
 *   3. active buckets below the window (the smallest magnitudes: rare) walk only the blocks
 *      that hold an id below it;
 *   4. the targets, marked in a bitmap of the segment, come out in range order (`emit`:
 *      emit_vbmi2 where the CPU has AVX-512 VBMI2, Ice Lake and Zen 4, else emit_scalar).
 *      The base bits go out as 16-bit words (bv16), not lanes_positions' u64.
 * 0, or -1 when a rank is past its bucket's end. */
SW_T static int SW(lanes_positions_w2)(const Params *P, uint32_t active, const int64_t *rk, const int64_t *first,
                                       const int64_t *nbk, int64_t nnz, int64_t *pos, uint8_t *bko, uint16_t *bv16,
                                       EmitFn emit) {
    const int64_t INF = INT64_MAX / 2; /* a bucket with no rank left */
    if (!active) return nnz ? -1 : 0;
    int64_t dist[NB], idx[NB]; /* rank of b's next target minus b's elements passed; b's next target */
    for (int b = 0; b < NB; b++) {
        dist[b] = (active >> b & 1) ? rk[first[b]] : INF;
        idx[b] = 0;
    }
    Win w;
    win_init(&w, active);
    const int wlo = w.wlo, wn = w.wn;
    const uint32_t below = w.below;
    _Alignas(64) uint8_t ids_s[SEG];
    _Alignas(64) uint16_t pre[WIN][SEGB]; /* running count at each block's end */
    uint64_t segev[SEGB];
    memset(segev, 0, sizeof(segev));
    int64_t found = 0;
    for (int64_t s0 = P->lo; s0 < P->hi && found < nnz; s0 += SEG) {
        int nblk = (int)((P->hi - s0 + BLK - 1) / BLK < SEGB ? (P->hi - s0 + BLK - 1) / BLK : SEGB);
        uint32_t run[WIN];
        uint64_t evblk = 0, lowblk = SW(seg_counts)(P, &w, s0, nblk, ids_s, pre, run); /* 1 */
        for (int k = 0; k < wn; k++) { /* 2 */
            int b = wlo + k;
            int64_t d = dist[b], T = run[k];
            if (d >= T) { dist[b] = d - T; continue; }
            for (int g = nblk; g < SEGB; g++) pre[k][g] = PRE_END; /* never at or below a target */
            const int64_t *rb = rk + first[b];
            int64_t i = idx[b], r;
            do {
                int g = SW(seg_locate)(pre, k, d, &r);
                segev[g] |= 1ull << sel_bit(SW(seg_mask)(ids_s, g, b), r);
                evblk |= 1ull << g;
                if (++i == nbk[b]) { d = INF; break; }
                d += rb[i] - rb[i - 1];
            } while (d < T);
            idx[b] = i;
            dist[b] = d - T;
        }
        if (below) /* 3 */
            for (uint64_t lw = lowblk; lw; lw &= lw - 1) {
                int g = __builtin_ctzll(lw);
                for (uint32_t pr = below; pr; pr &= pr - 1) {
                    int b = __builtin_ctz(pr);
                    uint64_t m = SW(seg_mask)(ids_s, g, b);
                    int64_t c = __builtin_popcountll(m), d = dist[b];
                    if (d >= c) { dist[b] = d - c; continue; }
                    const int64_t *rb = rk + first[b];
                    int64_t i = idx[b];
                    do {
                        segev[g] |= 1ull << sel_bit(m, d);
                        if (++i == nbk[b]) { d = INF; break; }
                        d += rb[i] - rb[i - 1];
                    } while (d < c);
                    evblk |= 1ull << g;
                    idx[b] = i;
                    dist[b] = d - c;
                }
            }
        found = emit(P, s0, evblk, segev, ids_s, found, nnz, pos, bko, bv16); /* 4 */
        if (found < 0) return -1;
    }
    return found == nnz ? 0 : -1;
}

#undef SW
#undef SW_CAT
#undef SW_CAT2
