/*
 * nemo_dcr.codec._cans: adaptive binary range coder and the context models of the
 * MODEL record coding (wire format v1, docs/wire-format.md, "MODEL: adaptive binary range coding").
 *
 * A record's positions and values are interleaved in one range-coded stream:
 *
 *   positions  context-free: the gap x = i - previous position (>= 1) of each present
 *              element, as b = bitlen(x) - 1 (bit tree, context: bit length of a running
 *              mean of the gaps) and the b bits below the leading one.  Work per present
 *              element only.
 *              context mode: one pass over the elements of [lo, hi) with a binary
 *              "present" flag per element, context = (previous flag, bucket of the base
 *              element's exponent): whether an element changes depends on its Adam step
 *              relative to its ulp, which the exponent sets.
 *              Either way nothing is coded once the remaining count equals the remaining
 *              elements (all present), and nothing after the last present element.
 *   value      context-free: the XOR value (or the new value, for overwrites) v;
 *              context mode: k = ord(new) - ord(old) mod 2^W, signed, where ord() maps
 *              float bit patterns to integers in value order, so k counts ulps.
 *              Coded as h = bit length of |.| (bit tree, context: previous value's h and
 *              the gap bucket, or the base exponent bucket), then in context mode the sign
 *              (context: base sign, h), then the h-1 bits below the leading one (a bit tree
 *              over the first 8, context h; then one context per (h, bit, previous bit)).
 *
 * Probabilities are adaptive counters: p(1) in units of 2^-31 with an occurrence count n,
 * updated p += (bit - p) / (n + 2) (the Krichevsky-Trofimov estimate while n is small),
 * n capped so the model keeps adapting.  All arithmetic is integer, so the encoder and the
 * decoder agree bit for bit on every platform.  The range coder is the carry-propagating
 * byte-oriented kind (32-bit range, 31-bit coding probabilities); its first output byte is
 * always zero and is not stored, nor are up to MAX_STRIP trailing zero bytes.
 *
 * The context tables (a Model, ~300 KB) live in a caller-owned buffer so that the records of
 * one chunk continue one adaptive state (model.ModelStates); the coder keeps no other state
 * per element.
 *
 * Hot path (each binary decision: two 64-bit multiplies, no division): context-free,
 * ~2 log2(gap) + h + 5 decisions per present element; context mode, one decision per
 * element up to the last present one plus ~h + 6 per present element.  Memory traffic is
 * one read of the positions/values (and of the base range in context mode) and one write
 * of the output.  Both entry points release the GIL.  A pure-Python twin
 * (nemo_dcr/codec/model_ref.py) produces the same bytes; the tests compare them.
 */
#include "record.h"
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#ifndef LIMIT_FLAG
#define LIMIT_FLAG 4095u
#endif
#ifndef LIMIT_VAL
#define LIMIT_VAL 1023u
#endif
#define LIMIT_MAX (LIMIT_FLAG > LIMIT_VAL ? LIMIT_FLAG : LIMIT_VAL)
#define NEXP 32          /* exponent buckets (context mode) */
#define NGAP 3           /* gap buckets (context-free) */
#define NPH 18           /* previous-h buckets (context-free): 0 = none, 1..17 */
#define MAXW 64
#define HNODES 128       /* bit tree over h in 0..64 (7 bits) */
#define LOWTREE_BITS 8
#define MAX_STRIP 4      /* trailing zero bytes the encoder may drop */
#define NGB 24           /* gap-rate buckets (context-free): bit length of the running mean gap */
#define GAPTREE_BITS 3

typedef struct {
    uint32_t p; /* P(bit = 1) * 2^31 */
    uint32_t n;
} Bit;

typedef struct {
    Bit flag[2 * NEXP];
    Bit h[(NGAP * NPH > NEXP ? NGAP * NPH : NEXP)][HNODES];
    Bit sign[2 * 4];
    Bit low[MAXW + 1][1 << LOWTREE_BITS];
    Bit tail[MAXW + 1][MAXW][2];
    Bit gapb[NGB][64];            /* context-free: bit length - 1 of the gap, context prev */
    Bit gapm[64][1 << GAPTREE_BITS]; /* first bits below the gap's leading one, per length */
    Bit gapt[64][64];             /* remaining bits, per (length, bit) */
} Model;

static uint32_t RECIP[LIMIT_MAX + 1];

static void init_recip(void) {
    for (uint32_t n = 0; n <= LIMIT_MAX; n++) RECIP[n] = (65536u + (n + 2) / 2) / (n + 2);
}

static void model_init(Model *m) {
    Bit *b = (Bit *)m;
    size_t count = sizeof(Model) / sizeof(Bit);
    for (size_t i = 0; i < count; i++) {
        b[i].p = 1u << 30;
        b[i].n = 0;
    }
}

/* P(bit = 0) as a fraction of 2^31, clamped so that both sub-ranges are non-empty for any
 * normalised range (>= 2^24). */
static inline uint32_t p0_31(const Bit *b) {
    uint32_t q = (1u << 31) - b->p;
    if (q < (1u << 8)) q = 1u << 8;
    if (q > (1u << 31) - (1u << 8)) q = (1u << 31) - (1u << 8);
    return q;
}

static inline void upd(Bit *b, int bit, uint32_t limit) {
    uint32_t r = RECIP[b->n];
    if (bit)
        b->p += (uint32_t)(((uint64_t)((1u << 31) - b->p) * r) >> 16);
    else
        b->p -= (uint32_t)(((uint64_t)b->p * r) >> 16);
    if (b->n < limit) b->n++;
}

/* ------------------------------------------------------------------ range encoder */

typedef struct {
    uint64_t low;
    uint32_t range;
    uint8_t cache;
    uint64_t cache_size;
    uint8_t *buf;
    size_t len, cap;
    int oom;
} Enc;

static void put(Enc *e, uint8_t byte) {
    if (e->len == e->cap) {
        size_t nc = e->cap ? 2 * e->cap : 4096;
        uint8_t *nb = (uint8_t *)realloc(e->buf, nc);
        if (!nb) {
            e->oom = 1;
            return;
        }
        e->buf = nb;
        e->cap = nc;
    }
    if (!e->oom) e->buf[e->len++] = byte;
}

static void enc_shift(Enc *e) {
    if ((uint32_t)e->low < 0xFF000000u || (e->low >> 32) != 0) {
        uint8_t carry = (uint8_t)(e->low >> 32);
        uint8_t temp = e->cache;
        do {
            put(e, (uint8_t)(temp + carry));
            temp = 0xFF;
        } while (--e->cache_size != 0);
        e->cache = (uint8_t)(e->low >> 24);
    }
    e->cache_size++;
    e->low = (e->low & 0x00FFFFFFu) << 8;
}

static inline void enc_bit(Enc *e, Bit *b, int bit, uint32_t limit) {
    uint32_t bound = (uint32_t)(((uint64_t)e->range * p0_31(b)) >> 31);
    if (!bit) {
        e->range = bound;
    } else {
        e->low += bound;
        e->range -= bound;
    }
    upd(b, bit, limit);
    while (e->range < (1u << 24)) {
        e->range <<= 8;
        enc_shift(e);
    }
}

/* Any value in [low, low + range) identifies the stream: pick the one with the most
 * trailing zero bits, push everything out, and drop up to MAX_STRIP trailing zero bytes
 * (the decoder reads bytes past the end as zeros, and rejects a stream that needs more than
 * MAX_STRIP of them, which stops garbage early).  Saves ~3 bytes per record. */
static void enc_flush(Enc *e) {
    for (int k = 32; k > 0; k -= 8) {
        uint64_t mask = (1ull << k) - 1;
        uint64_t x = (e->low + mask) & ~mask;
        if (x < e->low + e->range) {
            e->low = x;
            break;
        }
    }
    for (int i = 0; i < 5; i++) enc_shift(e);
    for (int k = 0; k < MAX_STRIP && e->len > 1 && e->buf[e->len - 1] == 0; k++) e->len--;
}

/* ------------------------------------------------------------------ range decoder */

typedef struct {
    uint32_t range, code;
    const uint8_t *p, *end;
    size_t over; /* bytes read past the end (zeros: the encoder drops trailing zeros) */
} Dec;

static inline uint8_t next_byte(Dec *d) {
    if (d->p < d->end) return *d->p++;
    d->over++;
    return 0;
}

static void dec_init(Dec *d, const uint8_t *p, size_t n) {
    d->p = p;
    d->end = p + n;
    d->over = 0;
    d->range = 0xFFFFFFFFu;
    d->code = 0;
    for (int i = 0; i < 4; i++) d->code = (d->code << 8) | next_byte(d);
}

static inline int dec_bit(Dec *d, Bit *b, uint32_t limit) {
    uint32_t bound = (uint32_t)(((uint64_t)d->range * p0_31(b)) >> 31);
    int bit;
    if (d->code < bound) {
        d->range = bound;
        bit = 0;
    } else {
        d->code -= bound;
        d->range -= bound;
        bit = 1;
    }
    upd(b, bit, limit);
    while (d->range < (1u << 24)) {
        d->range <<= 8;
        d->code = (d->code << 8) | next_byte(d);
    }
    return bit;
}

/* ------------------------------------------------------------------ shared model logic */

/* Params, load, store, bitlen, ord_of, iord_of: record.h */

static inline int exp_bucket(const Params *P, uint64_t b) {
    int e;
    if (P->ebits) {
        e = (int)((b >> P->eshift) & ((1u << P->ebits) - 1)) - P->e_lo;
    } else {
        e = bitlen(b);
    }
    if (e < 0) e = 0;
    if (e > NEXP - 1) e = NEXP - 1;
    return e;
}

static inline int gap_bucket(int64_t gap) { return gap <= 1 ? 0 : (gap <= 4 ? 1 : 2); }

/* Per-record running state shared by encoder and decoder. */
typedef struct {
    int left;          /* previous element present (context mode) */
    int prev_h;        /* h of the previous present element + 1; 0 = none */
    int64_t last;      /* index of the previous present element */
} State;

static void state_init(State *s, const Params *P) {
    s->left = 0;
    s->prev_h = 0;
    s->last = P->lo - 1000;
}

/* Context mode only: the base element's exponent bucket and the previous flag. */
static inline Bit *flag_ctx(Model *m, const Params *P, const State *s, int64_t i, const int width) {
    return &m->flag[2 * exp_bucket(P, load(P->base, width, i)) + s->left];
}

static inline Bit *h_ctx(Model *m, const Params *P, const State *s, int64_t i, uint64_t basev) {
    if (P->base) return m->h[exp_bucket(P, basev)];
    int ph = s->prev_h > NPH - 1 ? NPH - 1 : s->prev_h;
    return m->h[gap_bucket(i - s->last) * NPH + ph];
}

/* ------------------------------------------------------------------ value coding */

static void enc_mag(Enc *e, Bit *hnodes, const Params *P, uint64_t mag, int *h_out) {
    int h = bitlen(mag);
    unsigned node = 1;
    for (int k = P->hbits - 1; k >= 0; k--) {
        int bit = (h >> k) & 1;
        enc_bit(e, &hnodes[node], bit, LIMIT_VAL);
        node = (node << 1) | (unsigned)bit;
    }
    *h_out = h;
}

static void enc_low(Enc *e, Model *m, int h, uint64_t mag) {
    if (h < 2) return;
    int nb = h - 1;
    int t = nb < LOWTREE_BITS ? nb : LOWTREE_BITS;
    unsigned node = 1;
    for (int k = nb - 1; k >= nb - t; k--) {
        int bit = (int)((mag >> k) & 1);
        enc_bit(e, &m->low[h][node], bit, LIMIT_VAL);
        node = (node << 1) | (unsigned)bit;
    }
    int prev = (int)(node & 1);
    for (int k = nb - t - 1; k >= 0; k--) {
        int bit = (int)((mag >> k) & 1);
        enc_bit(e, &m->tail[h][k][prev], bit, LIMIT_VAL);
        prev = bit;
    }
}

static int dec_h(Dec *d, Bit *hnodes, const Params *P) {
    unsigned node = 1;
    for (int k = 0; k < P->hbits; k++) node = (node << 1) | (unsigned)dec_bit(d, &hnodes[node], LIMIT_VAL);
    return (int)(node - (1u << P->hbits));
}

static uint64_t dec_low(Dec *d, Model *m, int h) {
    if (h < 1) return 0;
    if (h == 1) return 1;
    int nb = h - 1;
    int t = nb < LOWTREE_BITS ? nb : LOWTREE_BITS;
    unsigned node = 1;
    for (int k = 0; k < t; k++) node = (node << 1) | (unsigned)dec_bit(d, &m->low[h][node], LIMIT_VAL);
    uint64_t v = node; /* leading one followed by t bits */
    int prev = (int)(node & 1);
    for (int k = nb - t - 1; k >= 0; k--) {
        int bit = dec_bit(d, &m->tail[h][k][prev], LIMIT_VAL);
        v = (v << 1) | (uint64_t)bit;
        prev = bit;
    }
    return v;
}

static inline Bit *sign_ctx(Model *m, const Params *P, uint64_t basev, int h) {
    int bs = (int)((basev & P->signbit) != 0);
    return &m->sign[bs * 4 + (h > 3 ? 3 : h)];
}

/* Code the value of present element i; returns h for the context state. */
static int enc_value(Enc *e, Model *m, const Params *P, const State *s, int64_t i, uint64_t v) {
    uint64_t basev = P->base ? load(P->base, P->width, i) : 0;
    Bit *hn = h_ctx(m, P, s, i, basev);
    int h;
    if (!P->base) {
        enc_mag(e, hn, P, v, &h);
        enc_low(e, m, h, v);
        return h;
    }
    uint64_t newv = P->op == 0 ? (basev ^ v) : v;
    uint64_t k = (ord_of(P, newv) - ord_of(P, basev)) & P->mask;
    int neg = (k & P->signbit) != 0;
    uint64_t mag = neg ? ((~k + 1) & P->mask) : k;
    if (neg && mag == 0) mag = P->signbit; /* unreachable for W < 64; k == 2^(W-1) */
    enc_mag(e, hn, P, mag, &h);
    if (h > 0) enc_bit(e, sign_ctx(m, P, basev, h), neg, LIMIT_VAL);
    enc_low(e, m, h, mag);
    return h;
}

/* Decode the value of present element i into *out; returns h, or -1 if impossible. */
static int dec_value(Dec *d, Model *m, const Params *P, const State *s, int64_t i, uint64_t *out) {
    uint64_t basev = P->base ? load(P->base, P->width, i) : 0;
    Bit *hn = h_ctx(m, P, s, i, basev);
    int h = dec_h(d, hn, P);
    if (h > P->W) return -1;
    if (!P->base) {
        uint64_t v = dec_low(d, m, h);
        if (P->op == 0 && v == 0) return -1;
        *out = v;
        return h;
    }
    int neg = 0;
    if (h > 0) neg = dec_bit(d, sign_ctx(m, P, basev, h), LIMIT_VAL);
    uint64_t mag = dec_low(d, m, h);
    uint64_t k = neg ? ((~mag + 1) & P->mask) : mag;
    uint64_t newv = iord_of(P, (ord_of(P, basev) + k) & P->mask);
    uint64_t v = P->op == 0 ? (basev ^ newv) : newv;
    if (P->op == 0 && v == 0) return -1;
    *out = v;
    return h;
}

/* ------------------------------------------------------------------ gaps (context-free) */

/* x = distance to the previous present element (>= 1), coded as b = bitlen(x) - 1 with a
 * 6-level bit tree, then the b bits below the leading one: the first GAPTREE_BITS with a bit
 * tree per b, the rest with one context per (b, bit).  The b tree's context is the bit
 * length of a running mean of the gaps (x16, updated by 1/16 per gap), so each context
 * learns the gap distribution of one change rate, shared by every tensor at that rate. */
static inline int gap_ctx(uint64_t mean16) {
    int c = bitlen(mean16 >> 4);
    return c > NGB - 1 ? NGB - 1 : c;
}

static inline uint64_t gap_mean(uint64_t mean16, uint64_t x) {
    uint64_t t = (x > (1ull << 40) ? (1ull << 40) : x) << 4;
    return t >= mean16 ? mean16 + ((t - mean16) >> 4) : mean16 - ((mean16 - t) >> 4);
}

static inline __attribute__((always_inline)) void enc_gap(Enc *e, Model *m, uint64_t x, uint64_t *mean16) {
    int b = bitlen(x) - 1;
    int pb = gap_ctx(*mean16);
    unsigned node = 1;
    for (int k = 5; k >= 0; k--) {
        int bit = (b >> k) & 1;
        enc_bit(e, &m->gapb[pb][node], bit, LIMIT_FLAG);
        node = (node << 1) | (unsigned)bit;
    }
    int t = b < GAPTREE_BITS ? b : GAPTREE_BITS;
    node = 1;
    for (int k = b - 1; k >= b - t; k--) {
        int bit = (int)((x >> k) & 1);
        enc_bit(e, &m->gapm[b][node], bit, LIMIT_FLAG);
        node = (node << 1) | (unsigned)bit;
    }
    for (int k = b - t - 1; k >= 0; k--) enc_bit(e, &m->gapt[b][k], (int)((x >> k) & 1), LIMIT_FLAG);
    *mean16 = gap_mean(*mean16, x);
}

static inline __attribute__((always_inline)) uint64_t dec_gap(Dec *d, Model *m, uint64_t *mean16) {
    unsigned node = 1;
    int pb = gap_ctx(*mean16);
    for (int k = 0; k < 6; k++) node = (node << 1) | (unsigned)dec_bit(d, &m->gapb[pb][node], LIMIT_FLAG);
    int b = (int)(node - 64);
    int t = b < GAPTREE_BITS ? b : GAPTREE_BITS;
    node = 1;
    for (int k = 0; k < t; k++) node = (node << 1) | (unsigned)dec_bit(d, &m->gapm[b][node], LIMIT_FLAG);
    uint64_t x = node;
    for (int k = b - t - 1; k >= 0; k--) x = (x << 1) | (uint64_t)dec_bit(d, &m->gapt[b][k], LIMIT_FLAG);
    *mean16 = gap_mean(*mean16, x);
    return x;
}

/* ------------------------------------------------------------------ record loops */

/* The per-element loops are specialised on the element width (a compile-time constant
 * after inlining), so the flag path has no width dispatch.
 * positions must be strictly increasing inside [lo, hi) (checked by the caller). */
static inline __attribute__((always_inline)) int encode_record_w(Enc *e, Model *m, const Params *P,
                                                                 const int64_t *pos, const uint8_t *vals,
                                                                 int64_t nnz, const int width) {
    State s;
    state_init(&s, P);
    int64_t j = 0;
    if (!P->base) {
        /* Context-free: positions as gaps, so the work is per present element. */
        int64_t prev = P->lo - 1;
        uint64_t mean16 = 0;
        for (; j < nnz; j++) {
            int64_t i = pos[j];
            if (nnz - j < P->hi - (prev + 1)) /* otherwise every remaining element is present */
                enc_gap(e, m, (uint64_t)(i - prev), &mean16);
            int h = enc_value(e, m, P, &s, i, load(vals, width, j));
            s.prev_h = h + 1;
            s.last = prev = i;
        }
        enc_flush(e);
        return e->oom ? -1 : 0;
    }
    for (int64_t i = P->lo; i < P->hi && j < nnz; i++) {
        int present = pos[j] == i;
        if (nnz - j < P->hi - i) /* otherwise every remaining element is present */
            enc_bit(e, flag_ctx(m, P, &s, i, width), present, LIMIT_FLAG);
        if (present) {
            int h = enc_value(e, m, P, &s, i, load(vals, width, j));
            s.prev_h = h + 1;
            s.last = i;
            j++;
        }
        s.left = present;
    }
    enc_flush(e);
    return e->oom ? -1 : 0;
}

static inline __attribute__((always_inline)) int decode_record_w(Dec *d, Model *m, const Params *P, int64_t *pos,
                                                                 uint8_t *vals, int64_t nnz, const int width) {
    State s;
    state_init(&s, P);
    int64_t j = 0;
    if (!P->base) {
        int64_t prev = P->lo - 1;
        uint64_t mean16 = 0;
        for (; j < nnz; j++) {
            int64_t i = prev + 1;
            if (nnz - j < P->hi - (prev + 1)) {
                uint64_t x = dec_gap(d, m, &mean16);
                /* leave room for the entries still to come: i <= hi - (nnz - j) */
                if (x > (uint64_t)(P->hi - (nnz - j) - prev)) return -1;
                i = prev + (int64_t)x;
            }
            uint64_t v;
            int h = dec_value(d, m, P, &s, i, &v);
            if (h < 0) return -1;
            pos[j] = i;
            store(vals, width, j, v);
            s.prev_h = h + 1;
            s.last = prev = i;
            if (d->over > MAX_STRIP) return -2;
        }
        if (d->p != d->end) return -2;
        return 0;
    }
    for (int64_t i = P->lo; i < P->hi && j < nnz; i++) {
        int present = 1;
        if (nnz - j < P->hi - i) present = dec_bit(d, flag_ctx(m, P, &s, i, width), LIMIT_FLAG);
        if (present) {
            uint64_t v;
            int h = dec_value(d, m, P, &s, i, &v);
            if (h < 0) return -1;
            pos[j] = i;
            store(vals, width, j, v);
            s.prev_h = h + 1;
            s.last = i;
            j++;
        }
        s.left = present;
        if (d->over > MAX_STRIP) return -2; /* read past what the encoder can have dropped */
    }
    if (j != nnz) return -1;
    if (d->p != d->end) return -2; /* bytes the encoder never wrote */
    return 0;
}

/* The encoder is not inlined into its binding: there its loops ran 3-4% slower (2^21 bf16
 * elements at 3%); the decoder is (out of line, context mode ran 1.6x slower). */
static __attribute__((noinline)) int encode_record(Enc *e, Model *m, const Params *P, const int64_t *pos,
                                                   const uint8_t *vals, int64_t nnz) {
    switch (P->width) {
    case 1: return encode_record_w(e, m, P, pos, vals, nnz, 1);
    case 2: return encode_record_w(e, m, P, pos, vals, nnz, 2);
    case 4: return encode_record_w(e, m, P, pos, vals, nnz, 4);
    default: return encode_record_w(e, m, P, pos, vals, nnz, 8);
    }
}

static int decode_record(Dec *d, Model *m, const Params *P, int64_t *pos, uint8_t *vals, int64_t nnz) {
    switch (P->width) {
    case 1: return decode_record_w(d, m, P, pos, vals, nnz, 1);
    case 2: return decode_record_w(d, m, P, pos, vals, nnz, 2);
    case 4: return decode_record_w(d, m, P, pos, vals, nnz, 4);
    default: return decode_record_w(d, m, P, pos, vals, nnz, 8);
    }
}

/* ------------------------------------------------------------------ Python glue */

/* Rec, rec_parse and the rec_* checks: record.h; PYB_*, pyb_*: pybind.h */

static int get_model(Py_buffer *mb, Model **m) {
    if (mb->len != (Py_ssize_t)sizeof(Model))
        return pyb_raise(PyExc_ValueError, "model state buffer has the wrong size");
    *m = (Model *)mb->buf;
    return 0;
}

static PyObject *py_model_init(PyObject *self, PyObject *args) {
    (void)self;
    Py_buffer mb = {0};
    PyObject *res = NULL;
    Model *m = NULL;
    if (!PyArg_ParseTuple(args, "w*", &mb)) return NULL;
    if (get_model(&mb, &m) < 0) goto done;
    model_init(m);
    res = pyb_none();
done:
    PYB_RELEASE(&mb);
    return res;
}

static PyObject *py_encode(PyObject *self, PyObject *args) {
    (void)self;
    Rec r;
    Model *m = NULL;
    PyObject *res = NULL;
    if (!rec_parse(&r, args, 1, 0)) return NULL;
    if (get_model(&r.state, &m) < 0 || rec_params(&r) < 0 || rec_inputs(&r) < 0 || rec_base(&r) < 0) goto done;
    Enc e = {0, 0xFFFFFFFFu, 0, 1, NULL, 0, 0, 0};
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = encode_record(&e, m, &r.P, r.pos.buf, r.vals.buf, r.nnz);
    Py_END_ALLOW_THREADS
    if (rc < 0) {
        free(e.buf);
        PYB_NOMEM();
    }
    /* The first byte of the stream is always zero: not stored. */
    if (e.len < 1 || e.buf[0] != 0) {
        free(e.buf);
        PYB_FAIL(PyExc_RuntimeError, "range coder invariant broken (first byte)");
    }
    res = pyb_bytes_free(e.buf, 1, e.len - 1);
done:
    rec_release(&r);
    return res;
}

static PyObject *py_decode(PyObject *self, PyObject *args) {
    (void)self;
    Rec r;
    Model *m = NULL;
    PyObject *res = NULL;
    if (!rec_parse(&r, args, 1, 1)) return NULL;
    if (get_model(&r.state, &m) < 0 || rec_params(&r) < 0 || rec_outputs(&r) < 0 || rec_base(&r) < 0) goto done;
    const Params P = r.P; /* REC_LOCAL_P (record.h) */
    Dec d;
    int rc;
    Py_BEGIN_ALLOW_THREADS
    dec_init(&d, r.stream.buf, (size_t)r.stream.len);
    rc = decode_record(&d, m, &P, r.pos.buf, r.vals.buf, r.nnz);
    Py_END_ALLOW_THREADS
    if (rc < 0)
        PYB_FAIL(PyExc_ValueError, rc == -1 ? "coded stream decodes to an impossible value"
                                            : "coded stream length does not match its content");
    res = pyb_none();
done:
    rec_release(&r);
    return res;
}

static PyMethodDef methods[] = {
    {"model_init", py_model_init, METH_VARARGS, "model_init(state) -> None: reset a MODEL_BYTES state buffer"},
    {"encode", py_encode, METH_VARARGS,
     "encode(state, positions_i64, values, base_or_None, lo, hi, width, eshift, ebits, e_lo, op) -> bytes;"
     " updates state"},
    {"decode", py_decode, METH_VARARGS,
     "decode(state, stream, nnz, base_or_None, lo, hi, width, eshift, ebits, e_lo, op, positions_out, "
     "values_out) -> None; updates state; ValueError if the stream is not a valid coding"},
    {NULL, NULL, 0, NULL}};

static struct PyModuleDef mod = {PyModuleDef_HEAD_INIT, "_cans", "MODEL record coder (see ans.c)", -1, methods,
                                 NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__cans(void) {
    init_recip();
    PyObject *m = PyModule_Create(&mod);
    if (m && PyModule_AddIntConstant(m, "MODEL_BYTES", (long)sizeof(Model)) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
