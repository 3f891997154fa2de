/*
 * The CPython glue every native coder shares (ans.c, rans.c, kernels/csrc/xor_diff.c):
 * a binding is its own checks and its call, between PyArg_ParseTuple and one exit path.
 *
 *   PyObject *res = NULL;
 *   Py_buffer a = {0}, b = {0};      obj NULL: not acquired, so PYB_RELEASE skips it
 *   ...
 *   if (bad) PYB_FAIL(PyExc_ValueError, "format %d", x);   error set, goto done
 *   res = pyb_bytes_free(out, 0, len);
 *   done:
 *   PYB_RELEASE(&a, &b);
 *   return res;
 *
 * Header-only (static inline), included once per extension.
 */
#ifndef NEMO_DCR_PYBIND_H
#define NEMO_DCR_PYBIND_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdarg.h>
#include <stdlib.h>

/* Set exc with a PyErr_Format message (a format: '%' as "%%"); returns -1 (for int-returning
 * checks). */
static inline int pyb_raise(PyObject *exc, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    PyErr_FormatV(exc, fmt, ap);
    va_end(ap);
    return -1;
}

/* Raise and leave the binding through its `done:` label. */
#define PYB_FAIL(...) do { pyb_raise(__VA_ARGS__); goto done; } while (0)
#define PYB_NOMEM() do { PyErr_NoMemory(); goto done; } while (0)

/* Release every buffer given; one that was never acquired (obj NULL: zero-initialised, or
 * released already) is skipped. */
#define PYB_RELEASE(...)                                                                      \
    do {                                                                                      \
        Py_buffer *pyb_bufs_[] = {__VA_ARGS__};                                               \
        for (size_t pyb_i_ = 0; pyb_i_ < sizeof(pyb_bufs_) / sizeof(pyb_bufs_[0]); pyb_i_++) \
            if (pyb_bufs_[pyb_i_]->obj) PyBuffer_Release(pyb_bufs_[pyb_i_]);                  \
    } while (0)

/* Acquire obj's buffer (flags: PyBUF_C_CONTIGUOUS, | PyBUF_WRITABLE, ...) of at least min_len
 * bytes: 0, or -1 with the error set (too_short: a ValueError) and nothing held. */
static inline int pyb_get(PyObject *obj, Py_buffer *b, int flags, Py_ssize_t min_len, const char *too_short) {
    if (PyObject_GetBuffer(obj, b, flags) < 0) return -1;
    if (b->len < min_len) {
        PyBuffer_Release(b);
        return pyb_raise(PyExc_ValueError, too_short);
    }
    return 0;
}

/* bytes of buf[off, off + len), then free(buf) (a coder's malloc'd output); NULL with the
 * error set if the bytes object cannot be made. */
static inline PyObject *pyb_bytes_free(void *buf, size_t off, size_t len) {
    PyObject *r = PyBytes_FromStringAndSize((const char *)buf + off, (Py_ssize_t)len);
    free(buf);
    return r;
}

static inline PyObject *pyb_none(void) { return Py_NewRef(Py_None); }

#endif
