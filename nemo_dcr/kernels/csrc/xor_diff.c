/* XOR diff of two equally sized bit buffers: the CPU path of nemo_dcr.kernels.
 *
 * Work is split by blocks of `block_size` elements over POSIX threads that own contiguous
 * runs of blocks (no atomics; output order = block order), with the GIL released.  For n
 * elements of w bytes, k of them changed:
 *
 *   diff(cur, base, width, block_size, nthreads, counts_out, alloc) -> alloc(total)
 *       One pass while the changes fit.  Each thread compacts its blocks into a private
 *       scratch (kept between calls, at most scratch_keep_bytes per thread, huge-page
 *       advised); then alloc(total) gives the output buffers and each thread copies its
 *       piece to its offset.  Reads 2nw; writes k(8 + w) twice.  A thread whose scratch is
 *       full only counts its remaining blocks and fills them in place after alloc (the
 *       two-pass form below), so dense diffs never double their output traffic.
 *   count(cur, base, width, block_size, nthreads, counts_out) -> total
 *       counts_out[b] = number of changed elements of block b.  Reads 2nw, writes 8/block.
 *   fill(cur, base, width, block_size, nthreads, counts, pos_out, val_out) -> total
 *       Second pass of the two-pass form: block b is written at the exclusive prefix sum
 *       of `counts`.  Blocks whose count is zero are not read at all; a block whose rescan
 *       disagrees with its count raises LookupError, never storing outside its own slots.
 *       Reads 2w per element of non-empty blocks, writes k(8 + w).
 *
 * Hot loops, per element width w in {1, 2, 4, 8}:
 *   - portable: 64-bit words (8/w elements), four at a time so an unchanged 32-byte stretch
 *     costs one test; a changed word becomes a lane mask (SWAR "non-zero lane") that is
 *     popcounted (count) or stored branch-free (fill: every lane written at slot n, n
 *     advancing only on a changed lane).
 *   - x86-64 with AVX2 (runtime check, default build flags): vector compare + movemask for
 *     count at every width; for w == 2 (bf16/fp16, the hot case) fill takes 64 elements per
 *     step and picks, from the step's changed-lane mask, skip / four unconditional ctz
 *     extractions / table-driven shuffle compaction, so branches stay predictable at a
 *     steady change rate.
 * Both are O(n) with no O(n) temporaries; the portable and AVX2 loops give identical
 * output (tests run both).  Assumes a little-endian host (lane k of a word is element k).
 */
#include "../../codec/csrc/pybind.h" /* Python.h and the binding helpers */

#include <pthread.h>
#include <stdint.h>
#ifdef __linux__
#include <sys/mman.h>
#endif
#include <stdlib.h>
#include <string.h>

#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "xor_diff.c assumes a little-endian host"
#endif

#define MAX_THREADS 64

enum mode { MODE_COUNT = 0, MODE_FILL = 1, MODE_SCRATCH = 2, MODE_GATHER = 3 };

static inline uint64_t load64(const unsigned char *p) {
    uint64_t v;
    memcpy(&v, p, 8);
    return v;
}

static inline uint64_t load_elem(const unsigned char *p, int w) {
    uint64_t v = 0;
    memcpy(&v, p, (size_t)w);
    return v;
}

static inline void store_elem(unsigned char *p, uint64_t v, int w) {
    switch (w) {
    case 1: { uint8_t t = (uint8_t)v; memcpy(p, &t, 1); break; }
    case 2: { uint16_t t = (uint16_t)v; memcpy(p, &t, 2); break; }
    case 4: { uint32_t t = (uint32_t)v; memcpy(p, &t, 4); break; }
    default: memcpy(p, &v, 8); break;
    }
}

/* High bit of every w-byte lane of a 64-bit word. */
static inline uint64_t lane_high_bits(int w) {
    switch (w) {
    case 1: return 0x8080808080808080ull;
    case 2: return 0x8000800080008000ull;
    case 4: return 0x8000000080000000ull;
    default: return 0x8000000000000000ull;
    }
}

static inline int lane_shift(int w) { /* log2(8 * w) */
    return w == 1 ? 3 : w == 2 ? 4 : w == 4 ? 5 : 6;
}

/* Count (MODE_COUNT) or store (MODE_FILL) the changed lanes of one XOR word whose first
 * element is `first`; returns the new n.  Fill never stores at or past slot `limit` but
 * keeps counting, so a stale count is detected instead of overrunning: with at least 8/w
 * free slots it stores every lane unconditionally, otherwise only changed lanes. */
static inline __attribute__((always_inline)) int64_t
emit_word(uint64_t x, int64_t first, int w, int mode, int64_t n, int64_t *pos,
          unsigned char *val, int64_t limit) {
    const uint64_t hb = lane_high_bits(w);
    const int sh = lane_shift(w);
    const uint64_t lane_mask = w == 8 ? ~0ull : (1ull << (8 * w)) - 1;
    if (mode == MODE_COUNT)
        return n + __builtin_popcountll((x | ((x & ~hb) + ~hb)) & hb);
    if (limit - n >= 8 / w) {
        for (int k = 0; k < 8 / w; k++) {
            uint64_t lane = (x >> ((k << sh) & 63)) & lane_mask;
            pos[n] = first + k;
            store_elem(val + n * w, lane, w);
            n += lane != 0;
        }
        return n;
    }
    for (int k = 0; k < 8 / w; k++) {
        uint64_t lane = (x >> ((k << sh) & 63)) & lane_mask;
        if (lane) {
            if (n < limit) {
                pos[n] = first + k;
                store_elem(val + n * w, lane, w);
            }
            n++;
        }
    }
    return n;
}

/* Elements [lo, hi): returns the number changed; in fill mode stores them at pos[0..),
 * val[0..) (never at or past `limit`). */
static inline __attribute__((always_inline)) int64_t
scan_range(const unsigned char *a, const unsigned char *b, int64_t lo, int64_t hi, int w,
           int mode, int64_t *pos, unsigned char *val, int64_t limit) {
    const int epw = 8 / w; /* elements per word */
    int64_t n = 0, i = lo;
    for (; i + 4 * epw <= hi; i += 4 * epw) {
        const unsigned char *pa = a + i * w, *pb = b + i * w;
        uint64_t x0 = load64(pa) ^ load64(pb);
        uint64_t x1 = load64(pa + 8) ^ load64(pb + 8);
        uint64_t x2 = load64(pa + 16) ^ load64(pb + 16);
        uint64_t x3 = load64(pa + 24) ^ load64(pb + 24);
        if (!(x0 | x1 | x2 | x3))
            continue;
        if (x0) n = emit_word(x0, i, w, mode, n, pos, val, limit);
        if (x1) n = emit_word(x1, i + epw, w, mode, n, pos, val, limit);
        if (x2) n = emit_word(x2, i + 2 * epw, w, mode, n, pos, val, limit);
        if (x3) n = emit_word(x3, i + 3 * epw, w, mode, n, pos, val, limit);
    }
    for (; i + epw <= hi; i += epw) {
        uint64_t x = load64(a + i * w) ^ load64(b + i * w);
        if (x) n = emit_word(x, i, w, mode, n, pos, val, limit);
    }
    for (; i < hi; i++) {
        uint64_t x = load_elem(a + i * w, w) ^ load_elem(b + i * w, w);
        if (x) {
            if (mode == MODE_FILL && n < limit) {
                pos[n] = i;
                store_elem(val + n * w, x, w);
            }
            n++;
        }
    }
    return n;
}

/* One instantiation per (width, mode) so the compiler folds the lane constants. */
#define DEFINE_PORTABLE(W)                                                                    \
    static int64_t count_##W(const unsigned char *a, const unsigned char *b, int64_t lo,      \
                             int64_t hi) {                                                    \
        return scan_range(a, b, lo, hi, W, MODE_COUNT, NULL, NULL, 0);                        \
    }                                                                                         \
    static int64_t fill_##W(const unsigned char *a, const unsigned char *b, int64_t lo,       \
                            int64_t hi, int64_t *pos, unsigned char *val, int64_t limit) {    \
        return scan_range(a, b, lo, hi, W, MODE_FILL, pos, val, limit);                       \
    }
DEFINE_PORTABLE(1)
DEFINE_PORTABLE(2)
DEFINE_PORTABLE(4)
DEFINE_PORTABLE(8)

/* ------------------------------------------------------ x86-64 AVX2 (runtime-checked) --- */
/* Only these functions carry a target attribute; the module keeps the default -O3 flags
 * (no -march) and still loads on CPUs without AVX2. */
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define HAVE_AVX2_PATH 1
#include <immintrin.h>

static int use_avx2 = 0;
static unsigned char shuf_tab[256][16]; /* pshufb control packing the set 16-bit lanes of m */
static uint64_t lane_tab[256];          /* byte j = index of the j-th set lane of m */

static void init_tables(void) {
    for (int m = 0; m < 256; m++) {
        int j = 0;
        memset(shuf_tab[m], 0x80, 16);
        lane_tab[m] = 0;
        for (int k = 0; k < 8; k++) {
            if (m >> k & 1) {
                shuf_tab[m][2 * j] = (unsigned char)(2 * k);
                shuf_tab[m][2 * j + 1] = (unsigned char)(2 * k + 1);
                lane_tab[m] |= (uint64_t)k << (8 * j);
                j++;
            }
        }
    }
}

static int cpu_has_avx2(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("popcnt") &&
           __builtin_cpu_supports("bmi");
}

/* Changed lanes of 32 XOR bytes, counted in bytes (w per changed lane). */
static inline __attribute__((always_inline, target("avx2,popcnt"))) int
avx2_changed_bytes(__m256i x, int w) {
    const __m256i z = _mm256_setzero_si256();
    __m256i eq = w == 1   ? _mm256_cmpeq_epi8(x, z)
                 : w == 2 ? _mm256_cmpeq_epi16(x, z)
                 : w == 4 ? _mm256_cmpeq_epi32(x, z)
                          : _mm256_cmpeq_epi64(x, z);
    return 32 - __builtin_popcount((unsigned)_mm256_movemask_epi8(eq));
}

static inline __attribute__((always_inline, target("avx2,popcnt"))) int64_t
avx2_count_w(const unsigned char *a, const unsigned char *b, int64_t lo, int64_t hi, int w) {
    const int ev = 32 / w; /* elements per vector */
    int64_t i = lo, bytes = 0;
    for (; i + 4 * ev <= hi; i += 4 * ev) {
        const unsigned char *pa = a + i * w, *pb = b + i * w;
        for (int k = 0; k < 4; k++)
            bytes += avx2_changed_bytes(
                _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)(pa + 32 * k)),
                                 _mm256_loadu_si256((const __m256i *)(pb + 32 * k))),
                w);
    }
    return bytes / w + scan_range(a, b, i, hi, w, MODE_COUNT, NULL, NULL, 0);
}

#define DEFINE_AVX2_COUNT(W)                                                                  \
    __attribute__((target("avx2,popcnt"))) static int64_t avx2_count_##W(                    \
        const unsigned char *a, const unsigned char *b, int64_t lo, int64_t hi) {             \
        return avx2_count_w(a, b, lo, hi, W);                                                 \
    }
DEFINE_AVX2_COUNT(1)
DEFINE_AVX2_COUNT(2)
DEFINE_AVX2_COUNT(4)
DEFINE_AVX2_COUNT(8)

/* Branch-free compaction of 8 two-byte XOR lanes: stores 8 values and 8 positions at slot
 * n (table-driven shuffle), then advances n by the number changed. */
static inline __attribute__((always_inline, target("avx2,popcnt"))) int64_t
avx2_compact8_w2(__m128i x, int64_t first, int64_t n, int64_t *pos, unsigned char *val) {
    __m128i eq = _mm_cmpeq_epi16(x, _mm_setzero_si128());
    unsigned m = ~(unsigned)_mm_movemask_epi8(_mm_packs_epi16(eq, eq)) & 0xFFu;
    _mm_storeu_si128((__m128i *)(val + 2 * n),
                     _mm_shuffle_epi8(x, _mm_loadu_si128((const __m128i *)shuf_tab[m])));
    __m128i idx = _mm_cvtsi64_si128((long long)lane_tab[m]);
    __m256i base = _mm256_set1_epi64x(first);
    _mm256_storeu_si256((__m256i *)(pos + n), _mm256_add_epi64(base, _mm256_cvtepu8_epi64(idx)));
    _mm256_storeu_si256((__m256i *)(pos + n + 4),
                        _mm256_add_epi64(base, _mm256_cvtepu8_epi64(_mm_srli_si128(idx, 4))));
    return n + __builtin_popcount(m);
}

/* Fill for 2-byte elements, 64 per step (128 bytes of each input).  The step's changed-lane
 * mask m selects: m == 0 -> skip; popcount(m) <= 4 -> four unconditional ctz extractions
 * (the common step at 1-3% changed); denser -> eight table compactions.  The unconditional
 * routes run only while 64 free slots remain before `limit`; otherwise the step goes
 * through the portable bounded loop. */
__attribute__((target("avx2,popcnt,bmi"))) static int64_t
avx2_fill_2(const unsigned char *a, const unsigned char *b, int64_t lo, int64_t hi,
            int64_t *pos, unsigned char *val, int64_t limit) {
    const __m256i z = _mm256_setzero_si256();
    int64_t n = 0, i = lo;
    for (; i + 64 <= hi; i += 64) {
        const unsigned char *pa = a + 2 * i, *pb = b + 2 * i;
        __m256i x[4];
        for (int k = 0; k < 4; k++)
            x[k] = _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)(pa + 32 * k)),
                                    _mm256_loadu_si256((const __m256i *)(pb + 32 * k)));
        /* packs interleaves 128-bit halves; permute 0xD8 restores lane order 0..31 */
        __m256i e01 = _mm256_permute4x64_epi64(
            _mm256_packs_epi16(_mm256_cmpeq_epi16(x[0], z), _mm256_cmpeq_epi16(x[1], z)), 0xD8);
        __m256i e23 = _mm256_permute4x64_epi64(
            _mm256_packs_epi16(_mm256_cmpeq_epi16(x[2], z), _mm256_cmpeq_epi16(x[3], z)), 0xD8);
        uint64_t m = ~((uint64_t)(uint32_t)_mm256_movemask_epi8(e23) << 32 |
                       (uint64_t)(uint32_t)_mm256_movemask_epi8(e01));
        if (!m)
            continue;
        if (limit - n < 64) {
            n += fill_2(a, b, i, i + 64, pos + n, val + 2 * n, limit - n);
            continue;
        }
        if (__builtin_popcountll(m) <= 4) {
            for (int r = 0; r < 4; r++) {
                int k = (int)(__builtin_ctzll(m | (1ull << 63)) & 63);
                uint16_t va, vb, v;
                memcpy(&va, pa + 2 * k, 2);
                memcpy(&vb, pb + 2 * k, 2);
                v = (uint16_t)(va ^ vb);
                pos[n] = i + k;
                memcpy(val + 2 * n, &v, 2);
                n += m != 0;
                m &= m - 1;
            }
            continue;
        }
        for (int k = 0; k < 4; k++) {
            n = avx2_compact8_w2(_mm256_castsi256_si128(x[k]), i + 16 * k, n, pos, val);
            n = avx2_compact8_w2(_mm256_extracti128_si256(x[k], 1), i + 16 * k + 8, n, pos, val);
        }
    }
    return n + fill_2(a, b, i, hi, pos + n, val + 2 * n, limit - n);
}
#endif /* x86-64 AVX2 */

/* ---------------------------------------------------------------- dispatch ----------- */

static int64_t scan_count(const unsigned char *a, const unsigned char *b, int64_t lo,
                          int64_t hi, int w) {
#ifdef HAVE_AVX2_PATH
    if (use_avx2) {
        switch (w) {
        case 1: return avx2_count_1(a, b, lo, hi);
        case 2: return avx2_count_2(a, b, lo, hi);
        case 4: return avx2_count_4(a, b, lo, hi);
        default: return avx2_count_8(a, b, lo, hi);
        }
    }
#endif
    switch (w) {
    case 1: return count_1(a, b, lo, hi);
    case 2: return count_2(a, b, lo, hi);
    case 4: return count_4(a, b, lo, hi);
    default: return count_8(a, b, lo, hi);
    }
}

static int64_t scan_fill(const unsigned char *a, const unsigned char *b, int64_t lo,
                         int64_t hi, int w, int64_t *pos, unsigned char *val, int64_t limit) {
#ifdef HAVE_AVX2_PATH
    if (use_avx2 && w == 2)
        return avx2_fill_2(a, b, lo, hi, pos, val, limit);
#endif
    switch (w) {
    case 1: return fill_1(a, b, lo, hi, pos, val, limit);
    case 2: return fill_2(a, b, lo, hi, pos, val, limit);
    case 4: return fill_4(a, b, lo, hi, pos, val, limit);
    default: return fill_8(a, b, lo, hi, pos, val, limit);
    }
}

/* ---------------------------------------------------------------- threads ------------ */

/* A thread's private output of the one-pass `diff`: kept between calls (up to
 * scratch_keep_bytes each) so that repeated diffs do not pay page faults on it. */
typedef struct {
    int64_t *pos;
    unsigned char *val;
    int64_t cap;        /* elements that fit in pos (and in val at width <= val_width) */
    int val_width;
} scratch_t;

static int64_t scratch_keep_bytes = (int64_t)128 << 20; /* per thread */

static scratch_t scratch_pool[MAX_THREADS];
static int scratch_pool_busy = 0; /* guarded by the GIL */

/* Ask for transparent huge pages on a large buffer: first-touch page faults are a large
 * share of the cost of fresh output memory (numpy does the same for its arrays). */
static void advise_huge(void *p, size_t bytes) {
#if defined(__linux__) && defined(MADV_HUGEPAGE)
    const uintptr_t page = 4096;
    if (bytes < ((size_t)4 << 20))
        return;
    uintptr_t lo = ((uintptr_t)p + page - 1) & ~(page - 1);
    uintptr_t hi = ((uintptr_t)p + bytes) & ~(page - 1);
    if (hi > lo)
        madvise((void *)lo, hi - lo, MADV_HUGEPAGE);
#else
    (void)p;
    (void)bytes;
#endif
}

/* Room for `need` elements of width w: capacity doubles, but not past max(need, ceiling). */
static int scratch_reserve(scratch_t *s, int64_t need, int64_t ceiling, int w) {
    if (need <= s->cap && w <= s->val_width)
        return 1;
    int64_t cap = s->cap > 4096 ? s->cap : 4096;
    while (cap < need)
        cap *= 2;
    if (cap > ceiling)
        cap = need > ceiling ? need : ceiling;
    int64_t *p = realloc(s->pos, (size_t)cap * sizeof(int64_t));
    if (!p)
        return 0;
    s->pos = p;
    if (cap < s->cap) /* keep `cap` true for both buffers if the next realloc fails */
        s->cap = cap;
    unsigned char *v = realloc(s->val, (size_t)cap * (size_t)w);
    if (!v)
        return 0;
    s->val = v;
    s->cap = cap;
    s->val_width = w;
    advise_huge(s->pos, (size_t)cap * sizeof(int64_t));
    advise_huge(s->val, (size_t)cap * (size_t)w);
    return 1;
}

static int64_t scratch_ceiling(int w) { return scratch_keep_bytes / (8 + w); }

static void scratch_release(scratch_t *s, int keep) {
    if (!keep || s->cap * (int64_t)(8 + s->val_width) > scratch_keep_bytes) {
        free(s->pos);
        free(s->val);
        memset(s, 0, sizeof(*s));
    }
}

typedef struct {
    const unsigned char *a, *b;
    int w, mode;
    int64_t numel, block_size;
    int64_t block_lo, block_hi; /* this job's blocks */
    int64_t *counts;            /* count, scratch: written; fill: read */
    const int64_t *offsets;     /* fill: exclusive prefix sum of counts */
    int64_t *pos;               /* fill: caller's buffers */
    unsigned char *val;
    scratch_t *scratch;         /* scratch: this thread's output */
    int64_t n;                  /* scratch: elements written */
    int64_t spill_from;         /* scratch: first block that did not fit (only counted) */
    int64_t mismatch_block;     /* fill: first block whose scan disagreed, or -1 */
    int nomem;                  /* scratch: could not grow */
} job_t;

static void *run_job(void *arg) {
    job_t *j = (job_t *)arg;
    if (j->mode == MODE_GATHER) {
        /* this thread's scratch to its offset, then its spilled blocks filled in place */
        if (j->n) {
            int64_t off = j->offsets[j->block_lo];
            memcpy(j->pos + off, j->scratch->pos, (size_t)j->n * sizeof(int64_t));
            memcpy(j->val + off * j->w, j->scratch->val, (size_t)j->n * (size_t)j->w);
        }
        j->mode = MODE_FILL;
        j->block_lo = j->spill_from;
    }
    if (j->mode == MODE_SCRATCH) {
        /* values of this width must fit the kept capacity; a new scratch gets room for ~6%
         * of the range changed (its pages are touched only when used) */
        int64_t span = (j->block_hi - j->block_lo) * j->block_size, cap = j->scratch->cap;
        int64_t ceiling = scratch_ceiling(j->w);
        int64_t need = cap ? cap : span / 16 + 4096 < ceiling ? span / 16 + 4096 : ceiling;
        if (!scratch_reserve(j->scratch, need, ceiling, j->w)) {
            j->nomem = 1;
            return NULL;
        }
        j->spill_from = j->block_hi;
    }
    for (int64_t blk = j->block_lo; blk < j->block_hi; blk++) {
        int64_t lo = blk * j->block_size;
        int64_t hi = j->numel - lo < j->block_size ? j->numel : lo + j->block_size;
        if (j->mode == MODE_COUNT || (j->mode == MODE_SCRATCH && blk >= j->spill_from)) {
            j->counts[blk] = scan_count(j->a, j->b, lo, hi, j->w);
            continue;
        }
        if (j->mode == MODE_SCRATCH) {
            /* bounded by the free scratch (the count stays exact when it overflows); a block
             * that does not fit grows the scratch up to its ceiling and is rescanned, or else
             * it and the rest of the range are only counted here and filled in place later */
            scratch_t *s = j->scratch;
            int64_t k = scan_fill(j->a, j->b, lo, hi, j->w, s->pos + j->n, s->val + j->n * j->w,
                                  s->cap - j->n);
            j->counts[blk] = k;
            if (k > s->cap - j->n) {
                int64_t ceiling = scratch_ceiling(j->w);
                if (j->n + k > ceiling || !scratch_reserve(s, j->n + k, ceiling, j->w)) {
                    j->spill_from = blk;
                    continue;
                }
                scan_fill(j->a, j->b, lo, hi, j->w, s->pos + j->n, s->val + j->n * j->w, k);
            }
            j->n += k;
            continue;
        }
        int64_t want = j->counts[blk];
        if (want == 0)
            continue; /* block skipping: nothing changed here */
        int64_t off = j->offsets[blk];
        int64_t got = scan_fill(j->a, j->b, lo, hi, j->w, j->pos + off, j->val + off * j->w, want);
        if (got != want) {
            j->mismatch_block = blk;
            return NULL;
        }
    }
    return NULL;
}

/* Jobs 1.. on new threads, job 0 on the caller; a job whose thread cannot be created runs
 * on the caller afterwards. */
static void run_jobs(job_t *jobs, int nt) {
    pthread_t tid[MAX_THREADS];
    int started[MAX_THREADS] = {0};
    for (int t = 1; t < nt; t++)
        started[t] = pthread_create(&tid[t], NULL, run_job, &jobs[t]) == 0;
    run_job(&jobs[0]);
    for (int t = 1; t < nt; t++) {
        if (started[t])
            pthread_join(tid[t], NULL);
        else
            run_job(&jobs[t]);
    }
}

/* ---------------------------------------------------------------- arguments ---------- */

typedef struct {
    Py_buffer cur, base, counts; /* zero until acquired: release_args on every path */
    int w, nthreads;
    int64_t numel, block_size, nblocks;
} args_t;

static void release_args(args_t *c) { PYB_RELEASE(&c->cur, &c->base, &c->counts); }

static int parse_args(args_t *c, PyObject *cur, PyObject *base, int w, long long block_size,
                      int nthreads, PyObject *counts, int counts_flags) {
    memset(c, 0, sizeof(*c));
    if (w != 1 && w != 2 && w != 4 && w != 8)
        return pyb_raise(PyExc_ValueError, "element width must be 1, 2, 4 or 8 bytes, got %d", w);
    if (block_size < 1)
        return pyb_raise(PyExc_ValueError, "block_size must be >= 1");
    if (PyObject_GetBuffer(cur, &c->cur, PyBUF_C_CONTIGUOUS) < 0 ||
        PyObject_GetBuffer(base, &c->base, PyBUF_C_CONTIGUOUS) < 0 ||
        PyObject_GetBuffer(counts, &c->counts, PyBUF_C_CONTIGUOUS | counts_flags) < 0)
        return -1;
    if (c->cur.len != c->base.len)
        return pyb_raise(PyExc_ValueError, "current has %zd bytes, baseline %zd", c->cur.len,
                         c->base.len);
    if (c->cur.len % w)
        return pyb_raise(PyExc_ValueError, "%zd bytes is not a whole number of %d-byte elements",
                         c->cur.len, w);
    c->w = w;
    c->numel = c->cur.len / w;
    c->block_size = block_size;
    c->nblocks = c->numel / block_size + (c->numel % block_size != 0);
    if (c->counts.len != c->nblocks * (Py_ssize_t)sizeof(int64_t))
        return pyb_raise(PyExc_ValueError, "counts buffer has %zd bytes, need %lld int64s",
                         c->counts.len, (long long)c->nblocks);
    if (nthreads > MAX_THREADS) nthreads = MAX_THREADS;
    if (nthreads > c->nblocks) nthreads = (int)c->nblocks;
    c->nthreads = nthreads < 1 ? 1 : nthreads;
    return 0;
}

static void split_blocks(const args_t *c, job_t *jobs, int mode) {
    for (int t = 0; t < c->nthreads; t++) {
        job_t *j = &jobs[t];
        memset(j, 0, sizeof(*j));
        j->a = c->cur.buf;
        j->b = c->base.buf;
        j->w = c->w;
        j->mode = mode;
        j->numel = c->numel;
        j->block_size = c->block_size;
        j->block_lo = c->nblocks * t / c->nthreads;
        j->block_hi = c->nblocks * (t + 1) / c->nthreads;
        j->counts = c->counts.buf;
        j->mismatch_block = -1;
    }
}

/* ---------------------------------------------------------------- Python entry points - */

static PyObject *py_count(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *cur, *base, *counts;
    int w, nthreads;
    long long block_size;
    if (!PyArg_ParseTuple(args, "OOiLiO", &cur, &base, &w, &block_size, &nthreads, &counts))
        return NULL;
    args_t c;
    PyObject *result = NULL;
    if (parse_args(&c, cur, base, w, block_size, nthreads, counts, PyBUF_WRITABLE) < 0)
        goto done;
    job_t jobs[MAX_THREADS];
    split_blocks(&c, jobs, MODE_COUNT);
    Py_BEGIN_ALLOW_THREADS
    run_jobs(jobs, c.nthreads);
    Py_END_ALLOW_THREADS
    int64_t total = 0;
    for (int64_t b = 0; b < c.nblocks; b++)
        total += ((int64_t *)c.counts.buf)[b];
    result = PyLong_FromLongLong(total);
done:
    release_args(&c);
    return result;
}

static PyObject *py_fill(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *cur, *base, *counts, *pos_obj, *val_obj;
    int w, nthreads;
    long long block_size;
    if (!PyArg_ParseTuple(args, "OOiLiOOO", &cur, &base, &w, &block_size, &nthreads, &counts,
                          &pos_obj, &val_obj))
        return NULL;
    args_t c;
    Py_buffer pos = {0}, val = {0};
    int64_t *offsets = NULL;
    PyObject *result = NULL;
    job_t jobs[MAX_THREADS];
    if (parse_args(&c, cur, base, w, block_size, nthreads, counts, 0) < 0 ||
        PyObject_GetBuffer(pos_obj, &pos, PyBUF_C_CONTIGUOUS | PyBUF_WRITABLE) < 0 ||
        PyObject_GetBuffer(val_obj, &val, PyBUF_C_CONTIGUOUS | PyBUF_WRITABLE) < 0)
        goto done;
    offsets = malloc((size_t)(c.nblocks + 1) * sizeof(int64_t));
    if (!offsets)
        PYB_NOMEM();
    const int64_t *cnt = c.counts.buf;
    int64_t total = 0;
    for (int64_t b = 0; b < c.nblocks; b++) {
        int64_t len = c.numel - b * c.block_size < c.block_size ? c.numel - b * c.block_size
                                                                 : c.block_size;
        if (cnt[b] < 0 || cnt[b] > len)
            PYB_FAIL(PyExc_ValueError, "block %lld: count %lld outside [0, %lld]", (long long)b,
                     (long long)cnt[b], (long long)len);
        offsets[b] = total;
        total += cnt[b];
    }
    if (pos.len / 8 < total || val.len / w < total)
        PYB_FAIL(PyExc_ValueError,
                 "output buffers hold %zd positions / %zd values, the counts need %lld",
                 pos.len / 8, val.len / w, (long long)total);
    split_blocks(&c, jobs, MODE_FILL);
    for (int t = 0; t < c.nthreads; t++) {
        jobs[t].offsets = offsets;
        jobs[t].pos = pos.buf;
        jobs[t].val = val.buf;
    }
    Py_BEGIN_ALLOW_THREADS
    run_jobs(jobs, c.nthreads);
    Py_END_ALLOW_THREADS
    for (int t = 0; t < c.nthreads; t++)
        if (jobs[t].mismatch_block >= 0)
            PYB_FAIL(PyExc_LookupError, "block %lld: its count does not match current ^ baseline",
                     (long long)jobs[t].mismatch_block);
    result = PyLong_FromLongLong(total);
done:
    free(offsets);
    PYB_RELEASE(&pos, &val);
    release_args(&c);
    return result;
}

/* One pass: every thread compacts its blocks into its scratch; then, with the GIL,
 * alloc(total) returns (positions, values) writable buffers (numpy arrays: fresh, or views of
 * a caller's; it may raise), into which the threads copy their pieces in block order. */
static PyObject *py_diff(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *cur, *base, *counts, *alloc;
    int w, nthreads;
    long long block_size;
    if (!PyArg_ParseTuple(args, "OOiLiOO", &cur, &base, &w, &block_size, &nthreads, &counts,
                          &alloc))
        return NULL;
    args_t c;
    Py_buffer pos = {0}, val = {0};
    int own_pool = 0;
    int64_t *offsets = NULL;
    PyObject *result = NULL, *outs = NULL;
    job_t jobs[MAX_THREADS];
    scratch_t fresh[MAX_THREADS];
    scratch_t *scratch = fresh;
    memset(fresh, 0, sizeof(fresh));
    if (parse_args(&c, cur, base, w, block_size, nthreads, counts, PyBUF_WRITABLE) < 0)
        goto done;
    if (!scratch_pool_busy) { /* the GIL is held: no race on the flag */
        scratch_pool_busy = own_pool = 1;
        scratch = scratch_pool;
    }
    split_blocks(&c, jobs, MODE_SCRATCH);
    for (int t = 0; t < c.nthreads; t++)
        jobs[t].scratch = &scratch[t];
    Py_BEGIN_ALLOW_THREADS
    run_jobs(jobs, c.nthreads);
    Py_END_ALLOW_THREADS
    for (int t = 0; t < c.nthreads; t++)
        if (jobs[t].nomem)
            PYB_NOMEM();
    /* output offset of every block; spilled blocks are in the counts, not in a scratch */
    offsets = malloc((size_t)(c.nblocks + 1) * sizeof(int64_t));
    if (!offsets)
        PYB_NOMEM();
    int64_t total = 0;
    for (int64_t blk = 0; blk < c.nblocks; blk++) {
        offsets[blk] = total;
        total += ((const int64_t *)c.counts.buf)[blk];
    }
    offsets[c.nblocks] = total;
    outs = PyObject_CallFunction(alloc, "L", (long long)total);
    if (!outs)
        goto done;
    if (!PyTuple_Check(outs) || PyTuple_GET_SIZE(outs) != 2)
        PYB_FAIL(PyExc_TypeError, "alloc must return (positions, values)");
    if (PyObject_GetBuffer(PyTuple_GET_ITEM(outs, 0), &pos, PyBUF_C_CONTIGUOUS | PyBUF_WRITABLE) < 0 ||
        PyObject_GetBuffer(PyTuple_GET_ITEM(outs, 1), &val, PyBUF_C_CONTIGUOUS | PyBUF_WRITABLE) < 0)
        goto done;
    if (pos.len / 8 < total || val.len / w < total)
        PYB_FAIL(PyExc_ValueError, "alloc(%lld) returned buffers for %zd positions / %zd values",
                 (long long)total, pos.len / 8, val.len / w);
    for (int t = 0; t < c.nthreads; t++) {
        jobs[t].mode = MODE_GATHER;
        jobs[t].offsets = offsets;
        jobs[t].pos = pos.buf;
        jobs[t].val = val.buf;
    }
    Py_BEGIN_ALLOW_THREADS
    run_jobs(jobs, c.nthreads);
    Py_END_ALLOW_THREADS
    for (int t = 0; t < c.nthreads; t++)
        if (jobs[t].mismatch_block >= 0)
            PYB_FAIL(PyExc_LookupError, "block %lld changed while it was being diffed",
                     (long long)jobs[t].mismatch_block);
    result = Py_NewRef(outs);
done:
    free(offsets);
    PYB_RELEASE(&pos, &val);
    Py_XDECREF(outs);
    for (int t = 0; t < MAX_THREADS; t++)
        scratch_release(&scratch[t], own_pool);
    if (own_pool)
        scratch_pool_busy = 0;
    release_args(&c);
    return result;
}

static PyObject *py_release_scratch(PyObject *self, PyObject *args) {
    (void)self;
    (void)args;
    if (!scratch_pool_busy)
        for (int t = 0; t < MAX_THREADS; t++)
            scratch_release(&scratch_pool[t], 0);
    Py_RETURN_NONE;
}

static PyObject *py_set_scratch_keep(PyObject *self, PyObject *args) {
    (void)self;
    long long bytes;
    if (!PyArg_ParseTuple(args, "L", &bytes))
        return NULL;
    if (bytes < 1024 || scratch_pool_busy) {
        PyErr_SetString(PyExc_ValueError, "scratch limit must be >= 1024 bytes, set while idle");
        return NULL;
    }
    long long old = (long long)scratch_keep_bytes;
    scratch_keep_bytes = bytes;
    for (int t = 0; t < MAX_THREADS; t++)
        scratch_release(&scratch_pool[t], 0);
    return PyLong_FromLongLong(old);
}

static PyObject *py_simd(PyObject *self, PyObject *args) {
    (void)self;
    (void)args;
#ifdef HAVE_AVX2_PATH
    return PyUnicode_FromString(use_avx2 ? "avx2" : "portable");
#else
    return PyUnicode_FromString("portable");
#endif
}

static PyObject *py_set_simd(PyObject *self, PyObject *args) {
    (void)self;
    int on;
    if (!PyArg_ParseTuple(args, "p", &on))
        return NULL;
#ifdef HAVE_AVX2_PATH
    use_avx2 = on && cpu_has_avx2();
#else
    (void)on;
#endif
    return py_simd(NULL, NULL);
}

static PyMethodDef methods[] = {
    {"diff", py_diff, METH_VARARGS,
     "diff(cur, base, width, block_size, nthreads, counts_out, alloc) -> alloc(total)"},
    {"count", py_count, METH_VARARGS,
     "count(cur, base, width, block_size, nthreads, counts_out) -> total changed"},
    {"fill", py_fill, METH_VARARGS,
     "fill(cur, base, width, block_size, nthreads, counts, pos_out, val_out) -> total"},
    {"release_scratch", py_release_scratch, METH_NOARGS,
     "release_scratch(): free the per-thread scratch that diff keeps between calls"},
    {"set_scratch_keep", py_set_scratch_keep, METH_VARARGS,
     "set_scratch_keep(bytes) -> old: per-thread scratch limit of diff (tests use a tiny one)"},
    {"simd", py_simd, METH_NOARGS, "simd() -> 'avx2' or 'portable': the loops in use"},
    {"set_simd", py_set_simd, METH_VARARGS,
     "set_simd(on) -> str: use the AVX2 loops if on and the CPU has them (not thread-safe; "
     "for tests and benchmarks)"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef mod = {
    PyModuleDef_HEAD_INIT, "_cxor", "XOR diff count/fill passes (see csrc/xor_diff.c).", -1,
    methods, NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__cxor(void) {
#ifdef HAVE_AVX2_PATH
    init_tables();
    use_avx2 = cpu_has_avx2();
#endif
    return PyModule_Create(&mod);
}
