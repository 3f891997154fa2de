/*
 * What the two record coders (ans.c: MODEL, rans.c: BUCKET) share: a record's parameters,
 * element access by width, the value-order map of float bits, and the Python-side parsing
 * of a record's arguments.  Header-only (static inline), included once per extension.
 */
#ifndef NEMO_DCR_RECORD_H
#define NEMO_DCR_RECORD_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

typedef struct {
    int width;         /* bytes per element: 1, 2, 4, 8 */
    int W;             /* bits per element */
    int hbits;         /* bits of a bit tree over 0..W: bit length of W (MODEL) */
    int eshift, ebits; /* exponent field (ebits == 0: integer dtype) */
    int e_lo;
    int is_float;
    int op;            /* 0 xor, 1 overwrite */
    int context;       /* base given */
    uint64_t mask, signbit;
    int64_t lo, hi;
    const uint8_t *base; /* NULL: context-free */
} Params;

static inline uint64_t load(const uint8_t *p, int width, int64_t i) {
    switch (width) {
    case 1: return p[i];
    case 2: { uint16_t v; memcpy(&v, p + 2 * i, 2); return v; }
    case 4: { uint32_t v; memcpy(&v, p + 4 * i, 4); return v; }
    default: { uint64_t v; memcpy(&v, p + 8 * i, 8); return v; }
    }
}

static inline void store(uint8_t *p, int width, int64_t i, uint64_t v) {
    switch (width) {
    case 1: p[i] = (uint8_t)v; break;
    case 2: { uint16_t x = (uint16_t)v; memcpy(p + 2 * i, &x, 2); break; }
    case 4: { uint32_t x = (uint32_t)v; memcpy(p + 4 * i, &x, 4); break; }
    default: memcpy(p + 8 * i, &v, 8); break;
    }
}

static inline int bitlen(uint64_t v) { return v ? 64 - __builtin_clzll(v) : 0; }

/* float bits -> integers in value order (so differences count ulps); integers unchanged */
static inline uint64_t ord_of(const Params *P, uint64_t b) {
    if (!P->is_float) return b;
    return (b & P->signbit) ? (~b & P->mask) : (b | P->signbit);
}

static inline uint64_t iord_of(const Params *P, uint64_t o) {
    if (!P->is_float) return o;
    return (o & P->signbit) ? (o & ~P->signbit) : (~o & P->mask);
}

static int parse_params(Params *P, int width, int eshift, int ebits, int e_lo, int op, Py_ssize_t lo,
                        Py_ssize_t hi) {
    if (width != 1 && width != 2 && width != 4 && width != 8) {
        PyErr_SetString(PyExc_ValueError, "width must be 1, 2, 4 or 8");
        return -1;
    }
    if (lo < 0 || hi < lo || op < 0 || op > 1 || ebits < 0 || ebits > 16 || eshift < 0 ||
        eshift + ebits > 8 * width || e_lo < 0 || e_lo > 255) {
        PyErr_SetString(PyExc_ValueError, "bad record parameters");
        return -1;
    }
    memset(P, 0, sizeof(*P));
    P->width = width;
    P->W = 8 * width;
    P->hbits = bitlen((uint64_t)P->W);
    P->eshift = eshift;
    P->ebits = ebits;
    P->e_lo = e_lo;
    P->is_float = ebits > 0;
    P->op = op;
    P->mask = P->W == 64 ? ~0ull : ((1ull << P->W) - 1);
    P->signbit = 1ull << (P->W - 1);
    P->lo = lo;
    P->hi = hi;
    return 0;
}

/* 0: no base (context-free); 1: base buffer acquired (release it); -1: error set */
static int get_base(PyObject *base_obj, Py_buffer *bb, Params *P) {
    if (base_obj == Py_None) return 0;
    if (PyObject_GetBuffer(base_obj, bb, PyBUF_CONTIG_RO) < 0) return -1;
    if (bb->len < P->hi * P->width) {
        PyBuffer_Release(bb);
        PyErr_SetString(PyExc_ValueError, "base buffer shorter than the record's range");
        return -1;
    }
    P->base = (const uint8_t *)bb->buf;
    P->context = 1;
    return 1;
}

/* 0 when the encoder's positions are strictly increasing inside [lo, hi); else -1, error set */
static int check_positions(const int64_t *pos, Py_ssize_t nnz, Py_ssize_t lo, Py_ssize_t hi) {
    for (Py_ssize_t j = 0; j < nnz; j++) {
        if (pos[j] < lo || pos[j] >= hi || (j && pos[j] <= pos[j - 1])) {
            PyErr_SetString(PyExc_ValueError, "positions must be strictly increasing inside [lo, hi)");
            return -1;
        }
    }
    return 0;
}

#endif
