/*
 * What the two record coders (ans.c: MODEL, rans.c: BUCKET) share: a record's parameters,
 * element access by width, the value-order map of float bits, and the Python-side parsing
 * and checks of a record's arguments (the generic glue: pybind.h).  Header-only (static
 * inline), included once per extension.
 */
#ifndef NEMO_DCR_RECORD_H
#define NEMO_DCR_RECORD_H

#include "pybind.h"
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

/* A record's Python arguments, in the order of the bindings' signatures (encode: [state],
 * positions, values, base, lo, hi, width, eshift, ebits, e_lo, op; decode: [state], stream,
 * nnz, base, lo, hi, width, eshift, ebits, e_lo, op, positions_out, values_out).  A binding
 * rec_parse()s one, runs the rec_* checks in its own order (each: 0, or -1 with the error set)
 * and rec_release()s it on every path after a successful parse.
 * REC_LOCAL_P: a coder inlined into its binding gets a local copy of r->P, not r->P itself:
 * r escaped to PyArg_ParseTuple, so the compiler would have to assume the coder's stores
 * alias it. */
typedef struct {
    Py_buffer state, stream, pos, vals, base; /* decode: pos, vals are the outputs */
    PyObject *base_obj;
    Py_ssize_t lo, hi, nnz;
    int width, eshift, ebits, e_lo, op;
    Params P;
} Rec;

#define REC_ARGS(r) &(r)->base_obj, &(r)->lo, &(r)->hi, &(r)->width, &(r)->eshift, &(r)->ebits, &(r)->e_lo, &(r)->op

/* PyArg_ParseTuple's result; stateful: a writable state buffer comes first.  Only the
 * buffers are initialised (not acquired yet: rec_release skips them), not the whole struct:
 * a small record's call is dominated by this glue. */
static inline int rec_parse(Rec *r, PyObject *args, int stateful, int decoding) {
    r->state.obj = r->stream.obj = r->pos.obj = r->vals.obj = r->base.obj = NULL;
    if (decoding)
        return stateful ? PyArg_ParseTuple(args, "w*y*nOnniiiiiw*w*", &r->state, &r->stream, &r->nnz, REC_ARGS(r),
                                           &r->pos, &r->vals)
                        : PyArg_ParseTuple(args, "y*nOnniiiiiw*w*", &r->stream, &r->nnz, REC_ARGS(r), &r->pos,
                                           &r->vals);
    return stateful ? PyArg_ParseTuple(args, "w*y*y*Onniiiii", &r->state, &r->pos, &r->vals, REC_ARGS(r))
                    : PyArg_ParseTuple(args, "y*y*Onniiiii", &r->pos, &r->vals, REC_ARGS(r));
}

static inline void rec_release(Rec *r) { PYB_RELEASE(&r->base, &r->state, &r->stream, &r->pos, &r->vals); }

/* r->P from the parameters */
static inline int rec_params(Rec *r) {
    Params *P = &r->P;
    int width = r->width, eshift = r->eshift, ebits = r->ebits, e_lo = r->e_lo, op = r->op;
    if (width != 1 && width != 2 && width != 4 && width != 8)
        return pyb_raise(PyExc_ValueError, "width must be 1, 2, 4 or 8");
    if (r->lo < 0 || r->hi < r->lo || op < 0 || op > 1 || ebits < 0 || ebits > 16 || eshift < 0 ||
        eshift + ebits > 8 * width || e_lo < 0 || e_lo > 255)
        return pyb_raise(PyExc_ValueError, "bad record parameters");
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
    P->lo = r->lo;
    P->hi = r->hi;
    return 0;
}

/* The base buffer, if one is given (context mode); after rec_params */
static inline int rec_base(Rec *r) {
    if (r->base_obj == Py_None) return 0;
    if (pyb_get(r->base_obj, &r->base, PyBUF_CONTIG_RO, r->P.hi * r->P.width,
                "base buffer shorter than the record's range") < 0)
        return -1;
    r->P.base = (const uint8_t *)r->base.buf;
    r->P.context = 1;
    return 0;
}

/* Encoder: r->nnz from the positions; positions strictly increasing inside [lo, hi) */
static inline int rec_inputs(Rec *r) {
    Py_ssize_t nnz = r->nnz = r->pos.len / 8;
    if (r->pos.len != nnz * 8 || r->vals.len != nnz * r->width || nnz > r->hi - r->lo)
        return pyb_raise(PyExc_ValueError, "positions/values buffers inconsistent");
    const int64_t *pos = (const int64_t *)r->pos.buf;
    for (Py_ssize_t j = 0; j < nnz; j++)
        if (pos[j] < r->lo || pos[j] >= r->hi || (j && pos[j] <= pos[j - 1]))
            return pyb_raise(PyExc_ValueError, "positions must be strictly increasing inside [lo, hi)");
    return 0;
}

/* Decoder: the output buffers hold exactly nnz entries */
static inline int rec_outputs(Rec *r) {
    if (r->nnz < 0 || r->nnz > r->hi - r->lo || r->pos.len != r->nnz * 8 || r->vals.len != r->nnz * r->width)
        return pyb_raise(PyExc_ValueError, "output buffers inconsistent with nnz");
    return 0;
}

#endif
