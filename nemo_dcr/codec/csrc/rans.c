/*
 * nemo_dcr.codec._crans: the BUCKET record coding (wire format v1, coding 4,
 * docs/wire-format.md "BUCKET: bucketed gaps, adaptive rANS").
 *
 * Why it is fast: it does work per *changed* element, plus (context mode) one vectorised
 * pass over the base bits that needs no per-element decision.
 *
 *   buckets    context mode: bucket(i) = clamp(exponent(base[i]) - e_lo, 0, 31) for float
 *              dtypes, clamp(bitlen(base[i]), 0, 31) for integers; context-free: one bucket.
 *              Whether an element changes is, in AdamW deltas, close to i.i.d. given its
 *              bucket, so each bucket's changed elements are coded as gaps between their
 *              ranks *within the bucket* (the k-th element of bucket b): a gap costs about
 *              log2(1/p_b) bits, which sums to the flags' entropy given the exponent.
 *   gaps       u = gap - 1 is split by an adaptive Rice parameter k_b (from the bucket's
 *              running mean, so that u >> k averages 2-4) into q = u >> k, an adaptive
 *              rANS symbol (alphabet 32, 31 = escape followed by a raw length-prefixed
 *              integer), and the k raw low bits.
 *   order      the range is cut into segments of 4096 elements from lo; within a segment the
 *              events are consumed bucket by bucket (ascending), each bucket's in rank order.
 *              The decoder knows every active bucket's next target rank ahead of time: it
 *              reads each active bucket's first gap up front and, after each event of b, the
 *              next gap of b; after b's last event the encoder writes the smallest gap that
 *              runs past the end of b (a terminal gap).  The active buckets (those with at
 *              least one change) are a 32-bit mask at the start of the raw bits.
 *              Context-free: gaps in index order, no scan, no terminal gap.
 *   values     in position order, after all positions.  Context mode: k = ord(new) -
 *              ord(old) (signed, counts ulps for floats), h = bitlen(|k|) as an adaptive
 *              symbol in the context of the element's bucket, the sign and the h-1 bits below
 *              the leading one raw.  Context-free: v = the XOR value (or the new value of an
 *              overwrite), h = bitlen(v) as a symbol, then the top min(h-1, 5) bits below the
 *              leading one as a symbol in the context of h, the rest raw.
 *
 * Adaptive models: each context keeps symbol counts; after every `next` symbols (16, 32,
 * ..., 1024) its frequencies are rebuilt from the counts (each symbol at least 1 of 4096,
 * integer arithmetic only, so encoder and decoder agree bit for bit everywhere) and counts
 * are halved once they pass 2^16.  State carries from record to record of one chunk (same
 * dtype and mode), like the MODEL coding's, so small records pay no learning cost.
 *
 * rANS: two interleaved 32-bit states in [2^16, 2^32) (symbol i uses state i & 1, one shared
 * word stream), 16-bit renormalisation, 12-bit probabilities; the encoder collects (freq,
 * cum) of every symbol forwards, then codes them backwards; division by freq is an exact
 * multiply-shift (Granlund-Montgomery round-up reciprocal, 32-bit dividends).  Payload =
 * u32 rans_len | state 0, state 1 (u32 each) and the 16-bit words | raw bits (LSB first, zero
 * padded to a byte), all little-endian.  The decoder checks both final states are the
 * encoder's initial 2^16, that every rANS and raw byte is consumed and that padding is zero.
 *
 * Both entry points release the GIL; a scan over base bits uses AVX-512BW or else AVX2 where
 * the CPU has it (2- and 4-byte float dtypes; for 2-byte ones with BMI2, segcount.h's segment
 * pass and segwalk.h's walks), a scalar loop otherwise: all produce the same bytes (set_simd
 * picks one, for tests and benchmarks).
 */
#include "record.h"
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__x86_64__)
/* POPCNT is x86-64-v2 (every x86-64 CPU since 2009); without it __builtin_popcount is a
 * library call and the block scan runs ~3x slower. */
#pragma GCC target("popcnt")
#include <immintrin.h>
#endif

#include "crc32.h"

#define PB 12
#define PTOT (1u << PB)
#define RANS_L (1u << 16)
#define NB 32
#define MAXW 64
#define MAXA (MAXW + 1)
#define QA 32               /* gap quotient alphabet; QA - 1 is the escape */
#define TOPB 5              /* free mode: bits below the leading one coded as a symbol */
#define BLK 64
#define GAP_HALVE 64        /* gap statistics halve when their count reaches this */
#define MODEL_MAGIC 0x42544B31u /* "1KTB" */

typedef struct {
    uint16_t freq[MAXA];
    uint16_t cum[MAXA + 1];
    uint32_t cnt[MAXA];
    uint32_t A, seen, next, lut_ok;
    int64_t lut_rel; /* the decode table, at (uint8_t *)ctx + lut_rel in the same state buffer */
} Ctx;

#define CLUT(c) ((uint8_t *)(c) + (c)->lut_rel)

typedef struct {
    uint32_t magic, width_mode;
    uint64_t gsum[NB];
    uint32_t gcnt[NB];
    Ctx q[NB];
    Ctx h[NB];
    Ctx t[MAXW + 1];
    /* decode tables, one per context: only a decoder's state has them (ENC_BYTES stops
     * here), so an encoder's trial copy of its state is ~70 KB, not ~600 KB */
    uint8_t lut[2 * NB + MAXW + 1][PTOT];
} Model;

#define ENC_BYTES offsetof(Model, lut)

static uint64_t RCP_M[PTOT + 1];
static uint8_t RCP_S[PTOT + 1];
static int HAVE_AVX512 = 0, HAVE_AVX2 = 0, HAVE_VBMI2 = 0, HAVE_BMI2 = 0; /* VBMI2: AVX-512 byte/word compress (Ice Lake, Zen 4) */
static int FAST_PDEP = 0; /* pdep is one instruction: BMI2, and not AMD before Zen 3 (microcoded there, hundreds of cycles) */

/* j-th (0-based) set bit of m; m has more than j set bits.  Branch-free: an event's
 * place in its mask is as good as random, so a branchy search mispredicts. */
static int select_bit_portable(uint64_t m, int64_t j) {
    int p = 0;
    for (int w = 32; w; w >>= 1) {
        uint64_t lo = m & ((1ull << w) - 1);
        int64_t c = __builtin_popcountll(lo);
        uint64_t t = -(uint64_t)(j >= c);
        j -= c & (int64_t)t;
        m = (t & (m >> w)) | (~t & lo);
        p += w & (int)t;
    }
    return p;
}

#if defined(__x86_64__)
__attribute__((target("bmi2"))) static int select_bit_bmi2(uint64_t m, int64_t j) {
    return __builtin_ctzll(_pdep_u64(1ull << j, m));
}
#endif

static int (*select_bit)(uint64_t, int64_t) = select_bit_portable;

/* The CPU paths: level 0 scalar everywhere (and the portable bit select), 1 at most AVX2,
 * 2 the best this CPU has.  Every path produces the same bytes and arrays (tests/codec/
 * test_simd_paths.py); NEMO_DCR_NO_SIMD=1 (or the older NEMO_DCR_NO_AVX512=1) at import
 * starts at level 0. */
#if defined(__x86_64__)
/* The AVX-512 VBMI2 paths can run: AVX-512 on (HAVE_AVX512), VBMI, VBMI2 and BMI2 present. */
static int cpu_vbmi2(void) {
    return HAVE_AVX512 && HAVE_BMI2 && __builtin_cpu_supports("avx512vbmi") && __builtin_cpu_supports("avx512vbmi2");
}
#endif

static void set_paths(int level) {
    HAVE_AVX512 = HAVE_AVX2 = HAVE_CLMUL = HAVE_VBMI2 = HAVE_BMI2 = FAST_PDEP = 0;
    select_bit = select_bit_portable;
#if defined(__x86_64__)
    __builtin_cpu_init();
    if (level <= 0) return;
    HAVE_AVX512 = level >= 2 && __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512f");
    HAVE_AVX2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("popcnt");
    HAVE_BMI2 = __builtin_cpu_supports("bmi2");
    HAVE_VBMI2 = cpu_vbmi2();
    FAST_PDEP = HAVE_BMI2 && !__builtin_cpu_is("amdfam15h") && !__builtin_cpu_is("amdfam17h");
    if (FAST_PDEP) select_bit = select_bit_bmi2;
    HAVE_CLMUL = __builtin_cpu_supports("pclmul") && __builtin_cpu_supports("sse4.1");
#else
    (void)level;
#endif
}

static void lanes_init_tables(void); /* lanes.c */

static void init_tables(void) {
    crc32_init_table();
    for (uint32_t f = 1; f <= PTOT; f++) {
        uint32_t l = 0;
        while ((1u << l) < f) l++;
        /* m = floor(2^(32+l) / f) + 1 < 2^33: floor(x / f) = (x * m) >> (32 + l) for x < 2^32 */
        RCP_M[f] = (uint64_t)((((__uint128_t)1) << (32 + l)) / f) + 1;
        RCP_S[f] = (uint8_t)(32 + l);
    }
    lanes_init_tables();
    set_paths(getenv("NEMO_DCR_NO_SIMD") || getenv("NEMO_DCR_NO_AVX512") ? 0 : 2);
}

/* ------------------------------------------------------------------ adaptive contexts */

static void ctx_init(Ctx *c, uint32_t A) {
    memset(c, 0, sizeof(*c));
    c->A = A;
    c->next = 16;
    uint32_t each = PTOT / A, extra = PTOT - each * A;
    for (uint32_t s = 0; s < A; s++) c->freq[s] = (uint16_t)(each + (s < extra));
    c->cum[0] = 0;
    for (uint32_t s = 0; s < A; s++) c->cum[s + 1] = (uint16_t)(c->cum[s] + c->freq[s]);
    c->lut_ok = 0;
}

static void ctx_lut(Ctx *c) {
    for (uint32_t s = 0; s < c->A; s++) memset(CLUT(c) + c->cum[s], (int)s, c->freq[s]);
    c->lut_ok = 1;
}

static void ctx_rebuild(Ctx *c, int want_lut) {
    uint64_t total = 0;
    uint32_t best = 0;
    for (uint32_t s = 0; s < c->A; s++) {
        total += c->cnt[s];
        if (c->cnt[s] > c->cnt[best]) best = s;
    }
    if (total) {
        uint32_t sum = 0;
        for (uint32_t s = 0; s < c->A; s++) {
            c->freq[s] = (uint16_t)(1 + (uint64_t)c->cnt[s] * (PTOT - c->A) / total);
            sum += c->freq[s];
        }
        c->freq[best] = (uint16_t)(c->freq[best] + (PTOT - sum));
        for (uint32_t s = 0; s < c->A; s++) c->cum[s + 1] = (uint16_t)(c->cum[s] + c->freq[s]);
        if (total >= (1u << 16))
            for (uint32_t s = 0; s < c->A; s++) c->cnt[s] >>= 1;
    }
    c->seen = 0;
    if (c->next < 1024) c->next *= 2;
    c->lut_ok = 0;
    if (want_lut) ctx_lut(c);
}

static inline void ctx_update(Ctx *c, uint32_t s, int want_lut) {
    c->cnt[s]++;
    if (++c->seen >= c->next) ctx_rebuild(c, want_lut);
}

static void model_init(Model *m, int width, int context) {
    m->magic = MODEL_MAGIC;
    m->width_mode = (uint32_t)(width * 2 + (context ? 1 : 0));
    int W = 8 * width;
    for (int b = 0; b < NB; b++) {
        m->gsum[b] = 16;
        m->gcnt[b] = 1;
        ctx_init(&m->q[b], QA);
        ctx_init(&m->h[b], (uint32_t)W + 1);
        m->q[b].lut_rel = (int64_t)((uint8_t *)m->lut[b] - (uint8_t *)&m->q[b]);
        m->h[b].lut_rel = (int64_t)((uint8_t *)m->lut[NB + b] - (uint8_t *)&m->h[b]);
    }
    for (int h = 0; h <= MAXW; h++) {
        int tb = h - 1 < TOPB ? h - 1 : TOPB;
        ctx_init(&m->t[h], tb > 0 ? (1u << tb) : 1);
        m->t[h].lut_rel = (int64_t)((uint8_t *)m->lut[2 * NB + h] - (uint8_t *)&m->t[h]);
    }
}

/* ------------------------------------------------------------------ element helpers */

/* Params, load, store, bitlen, ord_of, iord_of: record.h */

static inline int bucket_of(const Params *P, uint64_t b) {
    int e = P->ebits ? (int)((b >> P->eshift) & ((1u << P->ebits) - 1)) - P->e_lo : bitlen(b);
    return e < 0 ? 0 : (e > NB - 1 ? NB - 1 : e);
}

/* Bucket bitmaps of one segment (up to SEGB blocks of 64 elements from `start`): for each
 * bucket b of the bitmask `active`, words[b] has bit k set when block k holds an element of
 * b, and then bm[b * SEGB + k] has bit j set when element start + 64 k + j (< hi) is in b
 * (words of blocks that do not hold b may be left unwritten); tot[b] counts b's elements.  Only the buckets a block holds
 * cost work: a block of 64 typically holds 6-9 of the 20-30 active buckets. */
#define SEGB 64 /* blocks per segment */

/* Block k of a segment (n <= 64 elements from s), element by element. */
static inline void blk_scalar(const Params *P, int64_t s, int n, int k, uint32_t active, uint64_t *bm,
                              uint64_t *words, int64_t *tot) {
    uint64_t m[NB];
    uint32_t present = 0;
    for (int j = 0; j < n; j++) {
        int b = bucket_of(P, load(P->base, P->width, s + j));
        uint64_t bit = 1ull << j;
        m[b] = (present >> b & 1) ? (m[b] | bit) : bit;
        present |= 1u << b;
    }
    present &= active;
    while (present) {
        int b = __builtin_ctz(present);
        bm[b * SEGB + k] = m[b];
        words[b] |= 1ull << k;
        tot[b] += __builtin_popcountll(m[b]);
        present &= present - 1;
    }
}

static void seg_scalar(const Params *P, int64_t start, int nblk, uint32_t active, uint64_t *bm, uint64_t *words, int64_t *tot) {
    memset(words, 0, NB * sizeof(uint64_t));
    memset(tot, 0, NB * sizeof(int64_t));
    for (int k = 0; k < nblk; k++) {
        int64_t s = start + (int64_t)k * BLK;
        blk_scalar(P, s, (int)(P->hi - s < BLK ? P->hi - s : BLK), k, active, bm, words, tot);
    }
}

#if defined(__x86_64__)
#define AVX512 __attribute__((target("avx512f,avx512bw")))

AVX512 static inline __m512i bucket16(__m512i v, int eshift, __m512i emask, __m512i elo, __m512i top) {
    __m512i e = _mm512_and_si512(_mm512_srli_epi16(v, (unsigned)eshift), emask);
    return _mm512_min_epu16(_mm512_subs_epu16(e, elo), top);
}

AVX512 static inline __m512i onehot16(__m512i b, __mmask32 valid, __m512i one) {
    __m512i b0 = _mm512_cvtepu16_epi32(_mm512_castsi512_si256(b));
    __m512i b1 = _mm512_cvtepu16_epi32(_mm512_extracti64x4_epi64(b, 1));
    return _mm512_or_si512(_mm512_maskz_sllv_epi32((__mmask16)valid, one, b0),
                           _mm512_maskz_sllv_epi32((__mmask16)(valid >> 16), one, b1));
}

AVX512 static void seg_avx512_w2(const Params *P, int64_t start, int nblk, uint32_t active, uint64_t *bm,
                                 uint64_t *words, int64_t *tot) {
    const __m512i emask = _mm512_set1_epi16((short)((1u << P->ebits) - 1));
    const __m512i elo = _mm512_set1_epi16((short)P->e_lo);
    const __m512i top = _mm512_set1_epi16(NB - 1);
    const __m512i one = _mm512_set1_epi32(1);
    const uint16_t *base = (const uint16_t *)P->base;
    memset(words, 0, NB * sizeof(uint64_t));
    memset(tot, 0, NB * sizeof(int64_t));
    for (int k = 0; k < nblk; k++) {
        int64_t s = start + (int64_t)k * BLK;
        int64_t n = P->hi - s < BLK ? P->hi - s : BLK;
        uint64_t valid = n >= 64 ? ~0ull : ((1ull << n) - 1);
        __mmask32 va = (__mmask32)valid, vb = (__mmask32)(valid >> 32);
        __m512i ba = bucket16(_mm512_maskz_loadu_epi16(va, base + s), P->eshift, emask, elo, top);
        __m512i bb = bucket16(_mm512_maskz_loadu_epi16(vb, base + s + 32), P->eshift, emask, elo, top);
        uint32_t present = (uint32_t)_mm512_reduce_or_epi32(_mm512_or_si512(onehot16(ba, va, one),
                                                                          onehot16(bb, vb, one))) & active;
        /* bucket ids as 64 bytes: one compare per bucket gives the block's 64-bit mask */
        __m512i b8 = _mm512_inserti64x4(_mm512_castsi256_si512(_mm512_cvtepi16_epi8(ba)), _mm512_cvtepi16_epi8(bb), 1);
        while (present) {
            int b = __builtin_ctz(present);
            uint64_t mb = (uint64_t)_mm512_cmpeq_epi8_mask(b8, _mm512_set1_epi8((char)b)) & valid;
            bm[b * SEGB + k] = mb;
            words[b] |= 1ull << k;
            tot[b] += __builtin_popcountll(mb);
            present &= present - 1;
        }
    }
}

AVX512 static inline __m512i bucket32(__m512i v, int eshift, __m512i emask, __m512i elo, __m512i top) {
    __m512i e = _mm512_sub_epi32(_mm512_and_si512(_mm512_srli_epi32(v, (unsigned)eshift), emask), elo);
    return _mm512_min_epi32(_mm512_max_epi32(e, _mm512_setzero_si512()), top);
}

AVX512 static void seg_avx512_w4(const Params *P, int64_t start, int nblk, uint32_t active, uint64_t *bm,
                                 uint64_t *words, int64_t *tot) {
    const __m512i emask = _mm512_set1_epi32((int)((1u << P->ebits) - 1));
    const __m512i elo = _mm512_set1_epi32(P->e_lo);
    const __m512i top = _mm512_set1_epi32(NB - 1);
    const __m512i one = _mm512_set1_epi32(1);
    const uint32_t *base = (const uint32_t *)P->base;
    memset(words, 0, NB * sizeof(uint64_t));
    memset(tot, 0, NB * sizeof(int64_t));
    for (int k = 0; k < nblk; k++) {
        int64_t s = start + (int64_t)k * BLK;
        int64_t n = P->hi - s < BLK ? P->hi - s : BLK;
        uint64_t valid = n >= 64 ? ~0ull : ((1ull << n) - 1);
        __m512i b[4];
        __m512i bits = _mm512_setzero_si512();
        for (int q = 0; q < 4; q++) {
            __mmask16 vm = (__mmask16)(valid >> (16 * q));
            b[q] = bucket32(_mm512_maskz_loadu_epi32(vm, base + s + 16 * q), P->eshift, emask, elo, top);
            bits = _mm512_or_si512(bits, _mm512_maskz_sllv_epi32(vm, one, b[q]));
        }
        uint32_t present = (uint32_t)_mm512_reduce_or_epi32(bits) & active;
        while (present) {
            int bb = __builtin_ctz(present);
            __m512i bv = _mm512_set1_epi32(bb);
            uint64_t m = 0;
            for (int q = 0; q < 4; q++) m |= (uint64_t)_mm512_cmpeq_epi32_mask(b[q], bv) << (16 * q);
            bm[bb * SEGB + k] = m & valid;
            words[bb] |= 1ull << k;
            tot[bb] += __builtin_popcountll(m & valid);
            present &= present - 1;
        }
    }
}

/* AVX2 (no AVX-512): a full block's 64 bucket ids become two vectors of 32 bytes; the
 * buckets between the block's least and greatest id are each one byte compare, and every
 * bucket in that range gets its word written (0 where the block does not hold it: only
 * words named by words[] are ever read, so the result is the scalar scan's).  A partial
 * last block goes through blk_scalar. */
#define AVX2 __attribute__((target("avx2,popcnt")))

/* 32 -> bytes: packus interleaves the 128-bit lanes, permute4x64 restores element order */
AVX2 static inline __m256i pack16_8(__m256i a, __m256i b) {
    return _mm256_permute4x64_epi64(_mm256_packus_epi16(a, b), 0xD8);
}

AVX2 static inline void blk_ids_avx2(__m256i b0, __m256i b1, int k, uint32_t active, uint64_t *bm,
                                     uint64_t *words, int64_t *tot) {
    /* least id in the low lane, 255 - greatest in the high lane, then reduce both lanes */
    __m256i mn = _mm256_min_epu8(b0, b1);
    __m256i nx = _mm256_xor_si256(_mm256_max_epu8(b0, b1), _mm256_set1_epi8(-1));
    __m128i l = _mm_min_epu8(_mm256_castsi256_si128(mn), _mm256_extracti128_si256(mn, 1));
    __m128i h = _mm_min_epu8(_mm256_castsi256_si128(nx), _mm256_extracti128_si256(nx, 1));
    __m256i r = _mm256_inserti128_si256(_mm256_castsi128_si256(l), h, 1);
    r = _mm256_min_epu8(r, _mm256_srli_si256(r, 8));
    r = _mm256_min_epu8(r, _mm256_srli_si256(r, 4));
    r = _mm256_min_epu8(r, _mm256_srli_si256(r, 2));
    r = _mm256_min_epu8(r, _mm256_srli_si256(r, 1));
    int lo = _mm256_extract_epi8(r, 0) & 0xFF, hi = 255 - (_mm256_extract_epi8(r, 16) & 0xFF);
    __m256i bv = _mm256_set1_epi8((char)lo);
    const __m256i one = _mm256_set1_epi8(1);
    for (int b = lo; b <= hi; b++, bv = _mm256_add_epi8(bv, one)) {
        uint64_t m = (uint64_t)(uint32_t)_mm256_movemask_epi8(_mm256_cmpeq_epi8(b0, bv)) |
                     (uint64_t)(uint32_t)_mm256_movemask_epi8(_mm256_cmpeq_epi8(b1, bv)) << 32;
        bm[b * SEGB + k] = m;
        words[b] |= (uint64_t)((m != 0) & (active >> b)) << k;
        tot[b] += __builtin_popcountll(m);
    }
}

AVX2 static void seg_avx2_w2(const Params *P, int64_t start, int nblk, uint32_t active, uint64_t *bm,
                             uint64_t *words, int64_t *tot) {
    const __m128i sh = _mm_cvtsi32_si128(P->eshift);
    const __m256i emask = _mm256_set1_epi16((short)((1u << P->ebits) - 1));
    const __m256i elo = _mm256_set1_epi16((short)P->e_lo);
    const __m256i top = _mm256_set1_epi16(NB - 1);
    const uint16_t *base = (const uint16_t *)P->base;
    memset(words, 0, NB * sizeof(uint64_t));
    memset(tot, 0, NB * sizeof(int64_t));
    for (int k = 0; k < nblk; k++) {
        int64_t s = start + (int64_t)k * BLK;
        if (P->hi - s < BLK) { blk_scalar(P, s, (int)(P->hi - s), k, active, bm, words, tot); continue; }
        __m256i b[4];
        for (int q = 0; q < 4; q++) {
            __m256i v = _mm256_loadu_si256((const __m256i *)(base + s + 16 * q));
            __m256i e = _mm256_and_si256(_mm256_srl_epi16(v, sh), emask);
            b[q] = _mm256_min_epu16(_mm256_subs_epu16(e, elo), top);
        }
        blk_ids_avx2(pack16_8(b[0], b[1]), pack16_8(b[2], b[3]), k, active, bm, words, tot);
    }
}

AVX2 static void seg_avx2_w4(const Params *P, int64_t start, int nblk, uint32_t active, uint64_t *bm,
                             uint64_t *words, int64_t *tot) {
    const __m128i sh = _mm_cvtsi32_si128(P->eshift);
    const __m256i emask = _mm256_set1_epi32((int)((1u << P->ebits) - 1));
    const __m256i elo = _mm256_set1_epi32(P->e_lo);
    const __m256i top = _mm256_set1_epi32(NB - 1);
    const __m256i zero = _mm256_setzero_si256();
    /* packus_epi32 then packus_epi16 leave dwords in the order 0 2 4 6 1 3 5 7 */
    const __m256i perm = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    const uint32_t *base = (const uint32_t *)P->base;
    memset(words, 0, NB * sizeof(uint64_t));
    memset(tot, 0, NB * sizeof(int64_t));
    for (int k = 0; k < nblk; k++) {
        int64_t s = start + (int64_t)k * BLK;
        if (P->hi - s < BLK) { blk_scalar(P, s, (int)(P->hi - s), k, active, bm, words, tot); continue; }
        __m256i b[8];
        for (int q = 0; q < 8; q++) {
            __m256i v = _mm256_loadu_si256((const __m256i *)(base + s + 8 * q));
            __m256i e = _mm256_sub_epi32(_mm256_and_si256(_mm256_srl_epi32(v, sh), emask), elo);
            b[q] = _mm256_min_epi32(_mm256_max_epi32(e, zero), top);
        }
        __m256i x[2];
        for (int h = 0; h < 2; h++) {
            __m256i w = _mm256_packus_epi16(_mm256_packus_epi32(b[4 * h], b[4 * h + 1]),
                                            _mm256_packus_epi32(b[4 * h + 2], b[4 * h + 3]));
            x[h] = _mm256_permutevar8x32_epi32(w, perm);
        }
        blk_ids_avx2(x[0], x[1], k, active, bm, words, tot);
    }
}
#endif

static void seg_masks(const Params *P, int64_t start, int nblk, uint32_t active, uint64_t *bm, uint64_t *words, int64_t *tot) {
#if defined(__x86_64__)
    if (HAVE_AVX512 && P->ebits) {
        if (P->width == 2) { seg_avx512_w2(P, start, nblk, active, bm, words, tot); return; }
        if (P->width == 4) { seg_avx512_w4(P, start, nblk, active, bm, words, tot); return; }
    }
    if (HAVE_AVX2 && P->ebits) {
        if (P->width == 2) { seg_avx2_w2(P, start, nblk, active, bm, words, tot); return; }
        if (P->width == 4) { seg_avx2_w4(P, start, nblk, active, bm, words, tot); return; }
    }
#endif
    seg_scalar(P, start, nblk, active, bm, words, tot);
}

#define SEG (SEGB * BLK) /* elements per segment */

#include "segcount.h"

/* ------------------------------------------------------------------ raw bits */

typedef struct {
    uint8_t *buf;
    size_t len, cap;
    uint64_t acc;
    int n;
    int oom;
} BitW;

static void bw_byte(BitW *w, uint8_t b) {
    if (w->len == w->cap) {
        size_t nc = w->cap ? 2 * w->cap : 4096;
        uint8_t *nb = (uint8_t *)realloc(w->buf, nc);
        if (!nb) { w->oom = 1; return; }
        w->buf = nb;
        w->cap = nc;
    }
    w->buf[w->len++] = b;
}

/* 32 bits at once, little-endian: the accumulator holds fewer than 32 bits between puts, so
 * a put of up to 32 bits emits at most one such word (no per-byte loop) */
static void bw_word32(BitW *w, uint32_t v) {
    if (w->cap - w->len < 4) {
        size_t nc = w->cap ? 2 * w->cap : 4096;
        uint8_t *nb = (uint8_t *)realloc(w->buf, nc);
        if (!nb) { w->oom = 1; return; }
        w->buf = nb;
        w->cap = nc;
    }
    uint8_t *o = w->buf + w->len;
    o[0] = (uint8_t)v;
    o[1] = (uint8_t)(v >> 8);
    o[2] = (uint8_t)(v >> 16);
    o[3] = (uint8_t)(v >> 24);
    w->len += 4;
}

static inline void bw_put(BitW *w, uint64_t v, int n) { /* n <= 32 */
    w->acc |= (v & ((1ull << n) - 1)) << w->n;
    w->n += n;
    if (w->n >= 32) {
        bw_word32(w, (uint32_t)w->acc);
        w->acc >>= 32;
        w->n -= 32;
    }
}

static inline void bw_put64(BitW *w, uint64_t v, int n) {
    if (n > 32) { bw_put(w, v, 32); bw_put(w, v >> 32, n - 32); }
    else bw_put(w, v, n);
}

static void bw_flush(BitW *w) {
    for (; w->n > 0; w->n -= 8) { /* the last byte zero padded */
        bw_byte(w, (uint8_t)w->acc);
        w->acc >>= 8;
    }
    w->acc = 0;
    w->n = 0;
}

/* Raw-bit reader over a copy of the raw section padded with 16 zero bytes: a read is one
 * unaligned 64-bit load and a shift, with no refill branch.  A read past the end (only a
 * corrupt stream does that) clamps the position and marks the reader bad. */
typedef struct {
    const uint8_t *buf;
    uint64_t pos, nbits;
    int bad;
} BitR;

static inline uint64_t br_get(BitR *r, int n) { /* n <= 32 */
    uint64_t w;
    memcpy(&w, r->buf + (r->pos >> 3), 8); /* little-endian host (x86-64, aarch64) */
    uint64_t v = (w >> (r->pos & 7)) & ((1ull << n) - 1);
    r->pos += (uint64_t)n;
    if (__builtin_expect(r->pos > r->nbits, 0)) {
        r->bad = 1;
        r->pos = r->nbits;
    }
    return v;
}

static inline uint64_t br_get64(BitR *r, int n) {
    if (n > 32) { uint64_t lo = br_get(r, 32); return lo | (br_get(r, n - 32) << 32); }
    return br_get(r, n);
}

/* every bit read, and the rest of the last byte zero */
static int br_done(const BitR *r) {
    if (r->bad || (r->pos + 7) >> 3 != r->nbits >> 3) return 0;
    return (r->pos & 7) == 0 || (r->buf[r->pos >> 3] >> (r->pos & 7)) == 0;
}

/* ------------------------------------------------------------------ rANS */

typedef struct {
    uint32_t *sym; /* freq << 16 | cum, in decode order */
    size_t n, cap;
    int oom;
} SymBuf;

static inline void sb_push(SymBuf *s, const Ctx *c, uint32_t sym) {
    if (s->n == s->cap) {
        size_t nc = s->cap ? 2 * s->cap : 1024;
        uint32_t *nb = (uint32_t *)realloc(s->sym, nc * sizeof(uint32_t));
        if (!nb) { s->oom = 1; s->n = 0; return; }
        s->sym = nb;
        s->cap = nc;
    }
    s->sym[s->n++] = ((uint32_t)c->freq[sym] << 16) | c->cum[sym];
}

/* Code the collected symbols backwards; returns a malloc'd buffer of *len bytes. */
/* Code the collected symbols backwards, alternating two rANS states (symbol i uses state
 * i & 1) that share one word stream: the decoder's two dependency chains then overlap.
 * Returns a malloc'd buffer of *len bytes: state 0, state 1 (u32 LE each), then the words. */
static uint8_t *rans_encode(const SymBuf *s, size_t *len) {
    size_t cap = s->n + 8;
    uint16_t *buf = (uint16_t *)malloc(cap * sizeof(uint16_t));
    if (!buf) return NULL;
    uint16_t *p = buf + cap;
    uint32_t x0 = RANS_L, x1 = RANS_L; /* the states in registers: symbol i uses x(i & 1) */
#define RANS_PUT(xs, i)                                                                             \
    do {                                                                                            \
        uint32_t f = s->sym[i] >> 16, c = s->sym[i] & 0xFFFF;                                       \
        if ((uint64_t)xs >= ((uint64_t)f << (32 - PB))) { /* x_max = f * 2^(32 - PB) */             \
            *--p = (uint16_t)xs;                                                                    \
            xs >>= 16;                                                                              \
        }                                                                                           \
        uint32_t q = (uint32_t)(((__uint128_t)xs * RCP_M[f]) >> RCP_S[f]);                          \
        xs = (q << PB) + (xs - q * f) + c;                                                          \
    } while (0)
    size_t i = s->n;
    if (i & 1) { i--; RANS_PUT(x0, i); }
    while (i) {
        i--; RANS_PUT(x1, i);
        i--; RANS_PUT(x0, i);
    }
#undef RANS_PUT
    *--p = (uint16_t)(x1 >> 16);
    *--p = (uint16_t)x1;
    *--p = (uint16_t)(x0 >> 16);
    *--p = (uint16_t)x0;
    size_t words = (size_t)(buf + cap - p);
    uint8_t *out = (uint8_t *)malloc(words * 2 + 1);
    if (out) {
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
        memcpy(out, p, words * 2);
#else
        for (size_t w = 0; w < words; w++) {
            out[2 * w] = (uint8_t)p[w];
            out[2 * w + 1] = (uint8_t)(p[w] >> 8);
        }
#endif
        *len = words * 2;
    }
    free(buf);
    return out;
}

typedef struct {
    uint32_t x, y; /* x codes the next symbol, y the one after: they swap after each */
    const uint8_t *p, *end;
    int bad;
} RDec;

static inline uint32_t rd_sym(RDec *d, Ctx *c) {
    uint32_t slot = d->x & (PTOT - 1);
    uint32_t s = CLUT(c)[slot];
    uint32_t x = c->freq[s] * (d->x >> PB) + slot - c->cum[s];
    uint32_t need = x < RANS_L; /* renormalise without a branch: it is as good as random */
    if (__builtin_expect(d->end - d->p < 2, 0)) {
        d->bad |= (int)need;
        need = 0;
    } else {
        uint32_t w = (uint32_t)d->p[0] | ((uint32_t)d->p[1] << 8);
        x = need ? (x << 16) | w : x;
        d->p += 2 * need;
    }
    d->x = d->y;
    d->y = x;
    return s;
}

/* ------------------------------------------------------------------ gaps */

/* Smallest k in [0, 40] with gcnt * 2^(k+2) >= gsum: u >> k then averages 2-4.
 * k0 = bitlen(gsum) - bitlen(gcnt) - 2 is a lower bound and k0 + 1 an upper one
 * (gcnt * 2^(k0+3) >= 2^bitlen(gsum) > gsum), so one comparison decides. */
static inline int rice_k(const Model *m, int b) {
    uint64_t c = m->gcnt[b], sum = m->gsum[b];
    int k = bitlen(sum) - bitlen(c) - 2;
    k = k < 0 ? 0 : k;
    k += (c << (k + 2)) < sum;
    return k > 40 ? 40 : k;
}

static inline void gap_stats(Model *m, int b, uint64_t u) {
    m->gsum[b] += u;
    if (++m->gcnt[b] >= GAP_HALVE) {
        m->gsum[b] = (m->gsum[b] + 1) >> 1;
        m->gcnt[b] >>= 1;
    }
}

static inline void enc_gap(Model *m, SymBuf *sb, BitW *bw, int b, uint64_t gap) {
    uint64_t u = gap - 1;
    int k = rice_k(m, b);
    uint64_t q = u >> k;
    Ctx *c = &m->q[b];
    if (q < QA - 1) {
        sb_push(sb, c, (uint32_t)q);
        ctx_update(c, (uint32_t)q, 0);
    } else {
        sb_push(sb, c, QA - 1);
        ctx_update(c, QA - 1, 0);
        uint64_t e = q - (QA - 1);
        int L = bitlen(e);
        bw_put(bw, (uint64_t)L, 6);
        bw_put64(bw, e, L);
    }
    bw_put64(bw, u, k);
    gap_stats(m, b, u);
}

static inline uint64_t dec_gap(Model *m, RDec *d, BitR *br, int b) {
    int k = rice_k(m, b);
    Ctx *c = &m->q[b];
    uint64_t q = rd_sym(d, c);
    ctx_update(c, (uint32_t)q, 1);
    if (q == QA - 1) {
        int L = (int)br_get(br, 6);
        if (L > 48) { br->bad = 1; return 1; }
        q += br_get64(br, L);
    }
    if (q >> (62 - k)) { br->bad = 1; return 1; }
    uint64_t u = (q << k) | br_get64(br, k);
    gap_stats(m, b, u);
    return u + 1;
}

/* ------------------------------------------------------------------ values */

static inline void enc_value(Model *m, const Params *P, SymBuf *sb, BitW *bw, int b, uint64_t v, uint64_t basev) {
    if (P->context) {
        uint64_t k = (ord_of(P, v) - ord_of(P, basev)) & P->mask;
        int neg = (k & P->signbit) != 0;
        uint64_t mag = neg ? ((~k + 1) & P->mask) : k;
        int h = bitlen(mag);
        Ctx *c = &m->h[b];
        sb_push(sb, c, (uint32_t)h);
        ctx_update(c, (uint32_t)h, 0);
        if (h) {
            bw_put64(bw, (uint64_t)neg | (mag << 1), h); /* the sign, then the h - 1 bits below the leading one */
        }
    } else {
        int h = bitlen(v);
        Ctx *c = &m->h[0];
        sb_push(sb, c, (uint32_t)h);
        ctx_update(c, (uint32_t)h, 0);
        if (h >= 2) {
            int tb = h - 1 < TOPB ? h - 1 : TOPB;
            uint32_t t = (uint32_t)((v >> (h - 1 - tb)) & ((1u << tb) - 1));
            Ctx *ct = &m->t[h];
            sb_push(sb, ct, t);
            ctx_update(ct, t, 0);
            bw_put64(bw, v, h - 1 - tb);
        }
    }
}

static inline uint64_t dec_value(Model *m, const Params *P, RDec *d, BitR *br, int b, uint64_t basev) {
    if (P->context) {
        Ctx *c = &m->h[b];
        uint32_t h = rd_sym(d, c);
        ctx_update(c, h, 1);
        uint64_t k = 0;
        if (h) {
            uint64_t bits = br_get64(br, (int)h); /* the sign, then the h - 1 bits below the leading one */
            uint64_t neg = bits & 1;
            uint64_t mag = (bits >> 1) | (1ull << (h - 1));
            k = neg ? ((~mag + 1) & P->mask) : mag;
        }
        return iord_of(P, (ord_of(P, basev) + k) & P->mask);
    }
    Ctx *c = &m->h[0];
    uint32_t h = rd_sym(d, c);
    ctx_update(c, h, 1);
    if (h < 2) return h;
    int tb = (int)h - 1 < TOPB ? (int)h - 1 : TOPB;
    Ctx *ct = &m->t[h];
    uint32_t t = rd_sym(d, ct);
    ctx_update(ct, t, 1);
    int rest = (int)h - 1 - tb;
    return (1ull << (h - 1)) | ((uint64_t)t << rest) | br_get64(br, rest);
}

/* ------------------------------------------------------------------ records */

typedef struct {
    uint8_t *out;
    size_t len;
} Coded;

#if defined(__x86_64__)
/* The segment walks of segwalk.h, for AVX-512BW and for AVX2 (both with BMI2), and which one
 * a record takes: 2, 1, or 0 for the generic walks (other widths, integer dtypes, no SIMD). */
#define SW_ISA _512
#define SW_T AVX512 __attribute__((target("bmi,bmi2")))
#include "segwalk.h"
#undef SW_ISA
#undef SW_T
#define SW_ISA _256
#define SW_T AVX2B
#include "segwalk.h"
#undef SW_ISA
#undef SW_T

static inline int seg_isa(const Params *P) {
    if (P->width != 2 || !P->ebits || !HAVE_BMI2) return 0;
    return HAVE_AVX512 ? 2 : HAVE_AVX2 ? 1 : 0;
}
#endif

/* Rank of each changed element within its bucket (context mode), with its bucket and base
 * bits, from one scan of the range in segments; cnt[b] gets bucket b's size in the range when
 * `full` (else only up to the segment of the last changed element) and *active the buckets
 * with a changed element.  With `order`, also the BUCKET consumption order: per segment,
 * bucket by bucket, each in rank order.  Returns 0, or -1 on allocation failure. */
static int rank_scan(const Params *P, const int64_t *pos, int64_t nnz, uint8_t *bk, int64_t *rank, uint64_t *basev,
                     int64_t *cnt, uint32_t *active_out, int64_t *order, int full) {
#if defined(__x86_64__)
    if (seg_isa(P)) {
        (seg_isa(P) == 2 ? seg_ranks_w2_512 : seg_ranks_w2_256)(P, pos, nnz, bk, rank, basev, cnt, active_out, order, full);
        return 0;
    }
#endif
    uint64_t *bm = (uint64_t *)malloc(NB * SEGB * sizeof(uint64_t));
    int64_t *pre = (int64_t *)malloc(NB * SEGB * sizeof(int64_t));
    if (!bm || !pre) { free(bm); free(pre); return -1; }
    uint32_t active = 0;
    uint64_t words[NB];
    int64_t segn[NB];
    int64_t n = P->hi - P->lo;
    int64_t nseg = (n + SEG - 1) / SEG;
    int64_t j = 0, oi = 0;
    for (int b = 0; b < NB; b++) cnt[b] = 0;
    for (int64_t g = 0; g < nseg && nnz && (full || j < nnz); g++) {
        int64_t s0 = P->lo + g * SEG;
        int nb = (int)((P->hi - s0 + BLK - 1) / BLK < SEGB ? (P->hi - s0 + BLK - 1) / BLK : SEGB);
        seg_masks(P, s0, nb, ~0u, bm, words, segn);
        int64_t j0 = j;
        uint32_t segb = 0;
        while (j < nnz && pos[j] < s0 + SEG) {
            basev[j] = load(P->base, P->width, pos[j]); /* the segment is in L1 now */
            bk[j] = (uint8_t)bucket_of(P, basev[j]);
            segb |= 1u << bk[j];
            j++;
        }
        active |= segb;
        /* each bucket's count before every block it occurs in (only the buckets with an
         * event here need it); then its total */
        for (uint32_t pr = segb; pr; pr &= pr - 1) {
            int b = __builtin_ctz(pr);
            int64_t running = cnt[b];
            for (uint64_t wm = words[b]; wm; wm &= wm - 1) {
                int k = __builtin_ctzll(wm);
                pre[b * SEGB + k] = running;
                running += __builtin_popcountll(bm[b * SEGB + k]);
            }
        }
        for (int b = 0; b < NB; b++) cnt[b] += segn[b];
        /* ranks, and the consumption order: bucket by bucket, each in rank (= position)
         * order, by a counting sort of the segment's events on their bucket */
        int64_t at[NB + 1] = {0};
        for (int64_t t = j0; t < j; t++) {
            int b = bk[t], off = (int)(pos[t] - s0), k = off >> 6, bit = off & 63;
            rank[t] = pre[b * SEGB + k] + __builtin_popcountll(bm[b * SEGB + k] & ((1ull << bit) - 1));
            at[b + 1]++;
        }
        if (order) {
            for (int b = 0; b < NB; b++) at[b + 1] += at[b];
            for (int64_t t = j0; t < j; t++) order[oi + at[bk[t]]++] = t;
            oi += j - j0;
        }
    }
    free(bm);
    free(pre);
    *active_out = active;
    return 0;
}

/* Context mode positions: rank of each changed element within its bucket, and the
 * consumption order.  Returns 0, or -1 on allocation failure. */
static int context_positions(Model *m, const Params *P, const int64_t *pos, int64_t nnz, SymBuf *sb, BitW *bw,
                             uint64_t *basev) {
    int rc = -1;
    uint8_t *bk = (uint8_t *)malloc((size_t)(nnz ? nnz : 1));
    int64_t *rank = (int64_t *)malloc((size_t)(nnz ? nnz : 1) * sizeof(int64_t));
    int64_t *order = (int64_t *)malloc((size_t)(nnz ? nnz : 1) * sizeof(int64_t));
    uint32_t active = 0;
    int64_t cnt[NB];
    if (!bk || !rank || !order) goto out;
    if (rank_scan(P, pos, nnz, bk, rank, basev, cnt, &active, order, 1) < 0) goto out;
    /* next event of the same bucket, in position order */
    int64_t *nxt = (int64_t *)malloc((size_t)(nnz ? nnz : 1) * sizeof(int64_t));
    if (!nxt) goto out;
    int64_t last[NB], first[NB];
    for (int b = 0; b < NB; b++) last[b] = first[b] = -1;
    for (int64_t t = 0; t < nnz; t++) {
        int b = bk[t];
        if (last[b] >= 0) nxt[last[b]] = t; else first[b] = t;
        last[b] = t;
        nxt[t] = -1;
    }
    bw_put(bw, active, 32);
    for (uint32_t pr = active; pr; pr &= pr - 1) enc_gap(m, sb, bw, __builtin_ctz(pr), (uint64_t)rank[first[__builtin_ctz(pr)]] + 1);
    for (int64_t t = 0; t < nnz; t++) {
        int64_t e = order[t];
        int b = bk[e];
        uint64_t g = nxt[e] >= 0 ? (uint64_t)(rank[nxt[e]] - rank[e]) : (uint64_t)(cnt[b] - rank[e]);
        enc_gap(m, sb, bw, b, g);
    }
    free(nxt);
    rc = 0;
out:
    free(bk);
    free(rank);
    free(order);
    return rc;
}

static int encode_record(Model *m, const Params *P, const int64_t *pos, const uint8_t *vals, int64_t nnz,
                         Coded *res) {
    SymBuf sb = {0};
    BitW bw = {0};
    int rc = -1;
    uint64_t *basev = NULL;
    if (P->context) {
        basev = (uint64_t *)malloc((size_t)(nnz ? nnz : 1) * sizeof(uint64_t));
        if (!basev || context_positions(m, P, pos, nnz, &sb, &bw, basev) < 0) goto out;
    } else {
        int64_t prev = P->lo - 1;
        for (int64_t j = 0; j < nnz; j++) {
            enc_gap(m, &sb, &bw, 0, (uint64_t)(pos[j] - prev));
            prev = pos[j];
        }
    }
    for (int64_t j = 0; j < nnz; j++) {
        uint64_t v = load(vals, P->width, j), bv = 0;
        int b = 0;
        if (P->context) {
            bv = basev[j];
            b = bucket_of(P, bv);
            if (P->op == 0) v ^= bv;
        }
        enc_value(m, P, &sb, &bw, b, v, bv);
    }
    bw_flush(&bw);
    if (sb.oom || bw.oom) goto out;
    size_t rlen = 0;
    uint8_t *r = rans_encode(&sb, &rlen);
    if (!r) goto out;
    res->len = 4 + rlen + bw.len;
    res->out = (uint8_t *)malloc(res->len);
    if (!res->out) { free(r); goto out; }
    res->out[0] = (uint8_t)rlen;
    res->out[1] = (uint8_t)(rlen >> 8);
    res->out[2] = (uint8_t)(rlen >> 16);
    res->out[3] = (uint8_t)(rlen >> 24);
    memcpy(res->out + 4, r, rlen);
    if (bw.len) memcpy(res->out + 4 + rlen, bw.buf, bw.len);
    free(r);
    rc = 0;
out:
    free(basev);
    free(sb.sym);
    free(bw.buf);
    return rc;
}

static int decode_body(Model *m, const Params *P, RDec *d, BitR *br, int64_t *pos, uint8_t *vals, int64_t nnz) {
    int64_t found = 0;
    uint64_t *basev = NULL;
    if (P->context) {
        uint32_t active = (uint32_t)br_get(br, 32);
        int64_t rem[NB];
        if ((active == 0) != (nnz == 0)) return -1;
        for (uint32_t pr = active; pr; pr &= pr - 1) rem[__builtin_ctz(pr)] = (int64_t)dec_gap(m, d, br, __builtin_ctz(pr)) - 1;
        if (d->bad || br->bad) return -1;
#if defined(__x86_64__)
        if (seg_isa(P)) {
            basev = (uint64_t *)malloc((size_t)(nnz ? nnz : 1) * sizeof(uint64_t));
            if (!basev) return -2;
            int rc = seg_isa(P) == 2 ? bucket_positions_w2_512(m, P, d, br, active, rem, nnz, pos, basev)
                                     : bucket_positions_w2_256(m, P, d, br, active, rem, nnz, pos, basev);
            if (rc < 0) { free(basev); return rc; }
            found = nnz;
        } else {
#endif
        uint64_t *bm = (uint64_t *)malloc(NB * SEGB * sizeof(uint64_t));
        basev = (uint64_t *)malloc((size_t)(nnz ? nnz : 1) * sizeof(uint64_t));
        if (!bm || !basev) { free(bm); free(basev); return -2; }
        uint64_t words[NB], segev[SEGB];
        int64_t segn[NB];
        memset(segev, 0, sizeof(segev));
        int64_t n = P->hi - P->lo;
        int64_t nseg = (n + SEG - 1) / SEG;
        for (int64_t g = 0; g < nseg && found < nnz; g++) {
            int64_t s0 = P->lo + g * SEG;
            int nb = (int)((P->hi - s0 + BLK - 1) / BLK < SEGB ? (P->hi - s0 + BLK - 1) / BLK : SEGB);
            seg_masks(P, s0, nb, active, bm, words, segn);
            uint64_t evw = 0;
            int64_t nev = 0;
            for (uint32_t pr = active; pr; pr &= pr - 1) {
                int b = __builtin_ctz(pr);
                /* left: b's elements in the blocks not walked yet; once the target rank is
                 * past them, b has no more events in this segment and the walk stops */
                int64_t r = rem[b], left = segn[b];
                for (uint64_t wm = words[b]; wm && r < left; wm &= wm - 1) {
                    int k = __builtin_ctzll(wm);
                    uint64_t mb = bm[b * SEGB + k];
                    int64_t c = __builtin_popcountll(mb);
                    while (r < c) {
                        segev[k] |= 1ull << select_bit(mb, r);
                        evw |= 1ull << k;
                        nev++;
                        r += (int64_t)dec_gap(m, d, br, b);
                        if (d->bad || br->bad || found + nev > nnz) { free(bm); free(basev); return -1; }
                    }
                    r -= c;
                    left -= c;
                }
                rem[b] = r - left;
            }
            for (; evw; evw &= evw - 1) {
                int k = __builtin_ctzll(evw);
                for (uint64_t ev = segev[k]; ev; ev &= ev - 1) {
                    int64_t at = s0 + ((int64_t)k << 6) + __builtin_ctzll(ev);
                    basev[found] = load(P->base, P->width, at); /* the segment is in L1 now */
                    pos[found++] = at;
                }
                segev[k] = 0;
            }
        }
        free(bm);
        if (found != nnz) { free(basev); return -1; }
#if defined(__x86_64__)
        }
#endif
    } else {
        int64_t prev = P->lo - 1;
        for (int64_t j = 0; j < nnz; j++) {
            uint64_t g = dec_gap(m, d, br, 0);
            if (d->bad || br->bad || g > (uint64_t)(P->hi - 1 - prev)) return -1;
            prev += (int64_t)g;
            pos[j] = prev;
        }
    }
    for (int64_t j = 0; j < nnz; j++) {
        uint64_t bv = 0;
        int b = 0;
        if (P->context) {
            bv = basev[j];
            b = bucket_of(P, bv);
        }
        uint64_t v = dec_value(m, P, d, br, b, bv);
        if (P->context && P->op == 0) v ^= bv;
        if (P->op == 0 && v == 0) { free(basev); return -1; } /* v1 carries no zero XOR value */
        store(vals, P->width, j, v);
    }
    free(basev);
    if (d->bad || br->bad) return -1;
    /* everything consumed, final state is the encoder's initial one, zero padding */
    if (d->x != RANS_L || d->y != RANS_L || d->p != d->end) return -1;
    if (!br_done(br)) return -1;
    return 0;
}

/* Returns 0, or a negative error: -1 malformed stream, -2 allocation failure. */
static int decode_record(Model *m, const Params *P, const uint8_t *buf, size_t len, int64_t *pos, uint8_t *vals,
                         int64_t nnz) {
    if (len < 12) return -1;
    uint32_t rlen = (uint32_t)buf[0] | ((uint32_t)buf[1] << 8) | ((uint32_t)buf[2] << 16) | ((uint32_t)buf[3] << 24);
    if (rlen < 8 || (rlen & 1) || rlen > len - 4) return -1;
    RDec d = {0, 0, buf + 12, buf + 4 + rlen, 0};
    d.x = (uint32_t)buf[4] | ((uint32_t)buf[5] << 8) | ((uint32_t)buf[6] << 16) | ((uint32_t)buf[7] << 24);
    d.y = (uint32_t)buf[8] | ((uint32_t)buf[9] << 8) | ((uint32_t)buf[10] << 16) | ((uint32_t)buf[11] << 24);
    if (d.x < RANS_L || d.y < RANS_L) return -1;
    size_t rawlen = len - 4 - rlen;
    uint8_t *raw = (uint8_t *)calloc(rawlen + 16, 1);
    if (!raw) return -2;
    memcpy(raw, buf + 4 + rlen, rawlen);
    BitR br = {raw, 0, 8 * (uint64_t)rawlen, 0};
    for (int i = 0; i < NB; i++) {
        if (!m->q[i].lut_ok) ctx_lut(&m->q[i]);
        if (!m->h[i].lut_ok) ctx_lut(&m->h[i]);
    }
    for (int i = 0; i <= MAXW; i++)
        if (!m->t[i].lut_ok) ctx_lut(&m->t[i]);

    int rc = decode_body(m, P, &d, &br, pos, vals, nnz);
    free(raw);
    return rc;
}

/* ------------------------------------------------------------------ LANES (coding 5) */

#include "lanes.c"

/* ------------------------------------------------------------------ Python bindings */

/* Rec, rec_parse and the rec_* checks: record.h; PYB_*, pyb_*: pybind.h */

static int get_model(Py_buffer *mb, Model **m, const Params *P, int decoding) {
    if (mb->len != (Py_ssize_t)sizeof(Model) && (decoding || mb->len != (Py_ssize_t)ENC_BYTES))
        return pyb_raise(PyExc_ValueError, "model state buffer has the wrong size (decoding needs MODEL_BYTES)");
    *m = (Model *)mb->buf;
    if ((*m)->magic != MODEL_MAGIC || (P && (*m)->width_mode != (uint32_t)(P->width * 2 + P->context)))
        return pyb_raise(PyExc_ValueError, "model state was not initialised for this dtype and mode");
    return 0;
}

static PyObject *py_model_init(PyObject *self, PyObject *args) {
    (void)self;
    Py_buffer mb = {0};
    PyObject *res = NULL;
    int width, context;
    if (!PyArg_ParseTuple(args, "w*ii", &mb, &width, &context)) return NULL;
    if ((mb.len != (Py_ssize_t)sizeof(Model) && mb.len != (Py_ssize_t)ENC_BYTES) ||
        (width != 1 && width != 2 && width != 4 && width != 8))
        PYB_FAIL(PyExc_ValueError, "bad model state buffer or width");
    model_init((Model *)mb.buf, width, context);
    res = pyb_none();
done:
    PYB_RELEASE(&mb);
    return res;
}

/* rec_inputs, then what v1 carries: no XOR value of 0, ranges of at most 2^40 elements */
static int v1_inputs(Rec *r) {
    if (rec_inputs(r) < 0) return -1;
    for (Py_ssize_t j = 0; j < r->nnz; j++)
        if (r->op == 0 && load((const uint8_t *)r->vals.buf, r->width, j) == 0)
            return pyb_raise(PyExc_ValueError, "an XOR value of 0 is a no-op that v1 does not carry");
    if (r->hi - r->lo > ((Py_ssize_t)1 << 40)) return pyb_raise(PyExc_ValueError, "ranges are at most 2^40 elements");
    return 0;
}

/* encode (BUCKET, with a state) and lanes_encode (LANES, no state): the same checks.  Inlined
 * into each binding, so that each inlines only its own coder, as a binding of its own did. */
static inline __attribute__((always_inline)) PyObject *encode_v1(PyObject *args, int lanes) {
    Rec r;
    Model *m = NULL;
    PyObject *res = NULL;
    Coded c = {0};
    int rc;
    if (!rec_parse(&r, args, !lanes, 0)) return NULL;
    if (rec_params(&r) < 0 || rec_base(&r) < 0 || (!lanes && get_model(&r.state, &m, &r.P, 0) < 0) ||
        v1_inputs(&r) < 0)
        goto done;
    const Params P = r.P; /* REC_LOCAL_P (record.h) */
    Py_BEGIN_ALLOW_THREADS
    rc = lanes ? lanes_encode_record(&P, r.pos.buf, r.vals.buf, r.nnz, &c)
               : encode_record(m, &P, r.pos.buf, r.vals.buf, r.nnz, &c);
    Py_END_ALLOW_THREADS
    if (rc < 0) PYB_NOMEM();
    res = pyb_bytes_free(c.out, 0, c.len);
done:
    rec_release(&r);
    return res;
}

/* decode (BUCKET, with a state) and lanes_decode (LANES, no state); inlined like encode_v1 */
static inline __attribute__((always_inline)) PyObject *decode_v1(PyObject *args, int lanes) {
    Rec r;
    Model *m = NULL;
    PyObject *res = NULL;
    int rc;
    if (!rec_parse(&r, args, !lanes, 1)) return NULL;
    if (rec_params(&r) < 0 || rec_base(&r) < 0 || (!lanes && get_model(&r.state, &m, &r.P, 1) < 0) ||
        rec_outputs(&r) < 0)
        goto done;
    const Params P = r.P; /* REC_LOCAL_P (record.h) */
    const uint8_t *buf = r.stream.buf;
    size_t len = (size_t)r.stream.len;
    Py_BEGIN_ALLOW_THREADS
    rc = lanes ? lanes_decode_record(&P, buf, len, r.pos.buf, r.vals.buf, r.nnz)
               : decode_record(m, &P, buf, len, r.pos.buf, r.vals.buf, r.nnz);
    Py_END_ALLOW_THREADS
    if (rc == -2) PYB_NOMEM();
    if (rc < 0)
        PYB_FAIL(PyExc_ValueError, lanes ? "coded stream is not a valid LANES payload for this record"
                                         : "coded stream is not a valid BUCKET payload for this record");
    res = pyb_none();
done:
    rec_release(&r);
    return res;
}

static PyObject *py_encode(PyObject *self, PyObject *args) { (void)self; return encode_v1(args, 0); }
static PyObject *py_decode(PyObject *self, PyObject *args) { (void)self; return decode_v1(args, 0); }
static PyObject *py_lanes_encode(PyObject *self, PyObject *args) { (void)self; return encode_v1(args, 1); }
static PyObject *py_lanes_decode(PyObject *self, PyObject *args) { (void)self; return decode_v1(args, 1); }

/* Largest exponent field below emax in q[lo, hi) (2-byte floats): one branch-free pass.
 * The compiler does not vectorise it, so the AVX2 copy is explicit. */
static uint32_t emax_w2(const uint16_t *q, Py_ssize_t lo, Py_ssize_t hi, int eshift, uint32_t emax) {
    uint16_t m = 0;
    for (Py_ssize_t i = lo; i < hi; i++) {
        uint16_t e = (uint16_t)((q[i] >> eshift) & emax);
        e = e == emax ? 0 : e;
        m = e > m ? e : m;
    }
    return m;
}

#if defined(__x86_64__)
AVX2 static uint32_t emax_w2_avx2(const uint16_t *q, Py_ssize_t lo, Py_ssize_t hi, int eshift, uint32_t emax) {
    const __m128i sh = _mm_cvtsi32_si128(eshift);
    const __m256i em = _mm256_set1_epi16((short)emax);
    __m256i acc = _mm256_setzero_si256();
    Py_ssize_t i = lo;
    for (; i + 16 <= hi; i += 16) {
        __m256i e = _mm256_and_si256(_mm256_srl_epi16(_mm256_loadu_si256((const __m256i *)(q + i)), sh), em);
        acc = _mm256_max_epu16(acc, _mm256_andnot_si256(_mm256_cmpeq_epi16(e, em), e));
    }
    /* max of 16 u16 = ~min(~x); minpos finds the min of 8 */
    __m128i m8 = _mm_max_epu16(_mm256_castsi256_si128(acc), _mm256_extracti128_si256(acc, 1));
    uint32_t m = 0xFFFFu & ~(uint32_t)_mm_cvtsi128_si32(_mm_minpos_epu16(_mm_xor_si128(m8, _mm_set1_epi16(-1))));
    uint32_t t = emax_w2(q, i, hi, eshift, emax);
    return t > m ? t : m;
}
#endif

#if defined(__x86_64__)
/* emax_w2_avx2 with 64 elements a step and two accumulators (the pass is bound by reading the
 * base: ~2x the AVX2 loop's speed from L3) */
AVX512 static uint32_t emax_w2_avx512(const uint16_t *q, Py_ssize_t lo, Py_ssize_t hi, int eshift, uint32_t emax) {
    const __m128i sh = _mm_cvtsi32_si128(eshift);
    const __m512i em = _mm512_set1_epi16((short)emax);
    __m512i a0 = _mm512_setzero_si512(), a1 = _mm512_setzero_si512();
    Py_ssize_t i = lo;
    for (; i + 64 <= hi; i += 64) {
        _mm_prefetch((const char *)(q + i + PF_AHEAD), _MM_HINT_T0);
        _mm_prefetch((const char *)(q + i + PF_AHEAD + 32), _MM_HINT_T0);
        __m512i e0 = _mm512_and_si512(_mm512_srl_epi16(_mm512_loadu_si512((const void *)(q + i)), sh), em);
        __m512i e1 = _mm512_and_si512(_mm512_srl_epi16(_mm512_loadu_si512((const void *)(q + i + 32)), sh), em);
        a0 = _mm512_mask_max_epu16(a0, _mm512_cmpneq_epu16_mask(e0, em), a0, e0); /* all ones: Inf/NaN */
        a1 = _mm512_mask_max_epu16(a1, _mm512_cmpneq_epu16_mask(e1, em), a1, e1);
    }
    __m512i a = _mm512_max_epu16(a0, a1);
    __m256i a8 = _mm256_max_epu16(_mm512_castsi512_si256(a), _mm512_extracti64x4_epi64(a, 1));
    __m128i m8 = _mm_max_epu16(_mm256_castsi256_si128(a8), _mm256_extracti128_si256(a8, 1));
    uint32_t m = 0xFFFFu & ~(uint32_t)_mm_cvtsi128_si32(_mm_minpos_epu16(_mm_xor_si128(m8, _mm_set1_epi16(-1))));
    uint32_t t = emax_w2(q, i, hi, eshift, emax);
    return t > m ? t : m;
}
#endif

/* e_lo of a context-mode record: the largest finite exponent in base[lo, hi) minus NB - 1,
 * at least 0 (an all-ones exponent is Inf/NaN and does not count); 0 for integers.  One
 * branch-free pass, which the compiler vectorises; the numpy version made two. */
static PyObject *py_choose_e_lo(PyObject *self, PyObject *args) {
    (void)self;
    Py_buffer bb = {0};
    PyObject *res = NULL;
    Py_ssize_t lo, hi;
    int width, eshift, ebits;
    if (!PyArg_ParseTuple(args, "y*nniii", &bb, &lo, &hi, &width, &eshift, &ebits)) return NULL;
    if ((width != 1 && width != 2 && width != 4 && width != 8) || lo < 0 || hi < lo || bb.len < hi * width ||
        ebits < 0 || ebits > 16 || eshift < 0 || eshift + ebits > 8 * width)
        PYB_FAIL(PyExc_ValueError, "bad base buffer or parameters");
    uint32_t top = 0;
    if (ebits) {
        const uint32_t emax = (1u << ebits) - 1;
        const uint8_t *p = (const uint8_t *)bb.buf;
        Py_BEGIN_ALLOW_THREADS
        if (width == 2) {
#if defined(__x86_64__)
            if (HAVE_AVX512) top = emax_w2_avx512((const uint16_t *)p, lo, hi, eshift, emax); else
            if (HAVE_AVX2) top = emax_w2_avx2((const uint16_t *)p, lo, hi, eshift, emax); else
#endif
            top = emax_w2((const uint16_t *)p, lo, hi, eshift, emax);
        } else {
            for (Py_ssize_t i = lo; i < hi; i++) {
                uint32_t e = (uint32_t)((load(p, width, i) >> eshift) & emax);
                e = e == emax ? 0 : e;
                top = e > top ? e : top;
            }
        }
        Py_END_ALLOW_THREADS
    }
    res = PyLong_FromLong(top > NB - 1 ? (long)(top - (NB - 1)) : 0);
done:
    PYB_RELEASE(&bb);
    return res;
}

static PyObject *py_simd(PyObject *self, PyObject *args) {
    (void)self;
    (void)args;
    return PyUnicode_FromString(HAVE_AVX512 ? "avx512bw" : HAVE_AVX2 ? "avx2" : "scalar");
}

static PyObject *py_set_simd(PyObject *self, PyObject *args) {
    (void)self;
    int level;
    if (!PyArg_ParseTuple(args, "i", &level)) return NULL;
    set_paths(level);
    return py_simd(NULL, NULL);
}

static PyObject *py_crc32(PyObject *self, PyObject *args) {
    (void)self;
    Py_buffer b;
    unsigned int crc = 0;
    if (!PyArg_ParseTuple(args, "y*|I", &b, &crc)) return NULL;
    uint32_t out;
    if (b.len >= (1 << 14)) { /* worth releasing the GIL */
        Py_BEGIN_ALLOW_THREADS
        out = crc32_update((uint32_t)crc, (const uint8_t *)b.buf, (size_t)b.len);
        Py_END_ALLOW_THREADS
    } else {
        out = crc32_update((uint32_t)crc, (const uint8_t *)b.buf, (size_t)b.len);
    }
    PyBuffer_Release(&b);
    return PyLong_FromUnsignedLong(out);
}

static PyObject *py_crc32_clmul(PyObject *self, PyObject *args) {
    (void)self;
    (void)args;
    return PyBool_FromLong(HAVE_CLMUL);
}

static PyObject *py_set_vbmi2(PyObject *self, PyObject *args) {
    (void)self;
    int on;
    if (!PyArg_ParseTuple(args, "p", &on)) return NULL;
#if defined(__x86_64__)
    HAVE_VBMI2 = on && cpu_vbmi2();
#endif
    return PyBool_FromLong(HAVE_VBMI2);
}

static PyObject *py_set_pdep(PyObject *self, PyObject *args) {
    (void)self;
    int on;
    if (!PyArg_ParseTuple(args, "p", &on)) return NULL;
    FAST_PDEP = on && HAVE_BMI2;
    select_bit = select_bit_portable;
#if defined(__x86_64__)
    if (FAST_PDEP) select_bit = select_bit_bmi2;
#endif
    return PyBool_FromLong(FAST_PDEP);
}

static PyMethodDef methods[] = {
    {"set_pdep", py_set_pdep, METH_VARARGS,
     "set_pdep(on) -> whether bit selects use BMI2 pdep now; off: the portable select, as on AMD before Zen 3 "
     "(where pdep is microcoded); for tests"},
    {"set_vbmi2", py_set_vbmi2, METH_VARARGS,
     "set_vbmi2(on) -> whether the AVX-512 VBMI2 paths (LANES: the decoder's compressed outputs, the encoder's "
     "vector rANS) are used now; off: as on an AVX-512BW CPU without VBMI2 (Skylake-SP); for tests"},
    {"crc32", py_crc32, METH_VARARGS,
     "crc32(data, value=0) -> zlib.crc32(data, value); data: any C-contiguous buffer"},
    {"crc32_clmul", py_crc32_clmul, METH_NOARGS, "crc32_clmul() -> whether crc32 folds with PCLMULQDQ here"},
    {"lanes_encode", py_lanes_encode, METH_VARARGS,
     "lanes_encode(positions_i64, values, base_or_None, lo, hi, width, eshift, ebits, e_lo, op) -> bytes (coding 5)"},
    {"lanes_decode", py_lanes_decode, METH_VARARGS,
     "lanes_decode(payload, nnz, base_or_None, lo, hi, width, eshift, ebits, e_lo, op, positions_out, values_out)"
     " -> None; ValueError if the payload is not a valid LANES coding"},
    {"model_init", py_model_init, METH_VARARGS,
     "model_init(state, width, context) -> None; state: MODEL_BYTES (decoder) or ENC_BYTES (encoder only)"},
    {"encode", py_encode, METH_VARARGS,
     "encode(state, positions_i64, values, base_or_None, lo, hi, width, eshift, ebits, e_lo, op) -> bytes;"
     " updates state"},
    {"decode", py_decode, METH_VARARGS,
     "decode(state, payload, nnz, base_or_None, lo, hi, width, eshift, ebits, e_lo, op, positions_out, "
     "values_out) -> None; updates state; ValueError if the payload is not a valid coding"},
    {"simd", py_simd, METH_NOARGS, "simd() -> the block-scan path in use: avx512bw, avx2 or scalar"},
    {"set_simd", py_set_simd, METH_VARARGS,
     "set_simd(level) -> simd(): 0 scalar (and the portable bit select), 1 at most AVX2, 2 the best the "
     "CPU has; every path gives the same bytes (not thread-safe: for tests and benchmarks)"},
    {"choose_e_lo", py_choose_e_lo, METH_VARARGS, "choose_e_lo(base, lo, hi, width, eshift, ebits) -> e_lo"},
    {NULL, NULL, 0, NULL}};

static struct PyModuleDef mod = {PyModuleDef_HEAD_INIT, "_crans", "BUCKET record coder (see rans.c)", -1, methods,
                                 NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__crans(void) {
    init_tables();
    PyObject *m = PyModule_Create(&mod);
    if (m && (PyModule_AddIntConstant(m, "MODEL_BYTES", (long)sizeof(Model)) < 0 ||
              PyModule_AddIntConstant(m, "ENC_BYTES", (long)ENC_BYTES) < 0 ||
              PyModule_AddIntConstant(m, "NB", NB) < 0)) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
