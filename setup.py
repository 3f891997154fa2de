"""Native helpers (C, no third-party headers) built at `pip install -e .`.

The three extensions (codec ``_cans`` and ``_crans``, kernels ``_cxor``) release the GIL, so
callers can split work across threads.  Every native function has a pure numpy/torch
reference path in the package that gives identical output; the tests check them against each
other.
"""
import os

from setuptools import Extension, setup

_PYBIND_H = ["nemo_dcr/codec/csrc/pybind.h"]  # the CPython glue of every extension
_RECORD_H = ["nemo_dcr/codec/csrc/record.h"] + _PYBIND_H
_COMMON = dict(extra_compile_args=["-O3", "-std=c11", "-fno-strict-aliasing"])

# NEMO_DCR_INPLACE_EXT=1: install without building the extensions, for a second virtualenv of
# the same interpreter beside a checkout whose in-place builds (`setup.py build_ext --inplace`,
# `make setup`) it imports.  `make test` installs .venv-nemo so while .venv's suite runs: an
# editable build copies fresh .so files over the in-place ones, under processes that map them.
_EXT = os.environ.get("NEMO_DCR_INPLACE_EXT") != "1"

setup(
    ext_modules=[] if not _EXT else [
        Extension("nemo_dcr.kernels._cxor", ["nemo_dcr/kernels/csrc/xor_diff.c"], depends=_PYBIND_H, **_COMMON),
        # the MODEL and BUCKET record coders share record.h
        Extension("nemo_dcr.codec._cans", ["nemo_dcr/codec/csrc/ans.c"], depends=_RECORD_H, **_COMMON),
        # rans.c includes lanes.c (coding 5, LANES), which shares its scan and bit I/O
        Extension("nemo_dcr.codec._crans", ["nemo_dcr/codec/csrc/rans.c"],
                  depends=_RECORD_H + ["nemo_dcr/codec/csrc/lanes.c", "nemo_dcr/codec/csrc/crc32.h",
                                       "nemo_dcr/codec/csrc/segcount.h", "nemo_dcr/codec/csrc/segwalk.h"], **_COMMON),
    ]
)
