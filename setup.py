"""Native helpers (C, no third-party headers) built at `pip install -e .`.

Both extensions release the GIL, so callers can split work across threads.  Every native
function has a pure numpy/torch reference path in the package that gives identical output;
the tests check them against each other.
"""
from setuptools import Extension, setup

_COMMON = dict(extra_compile_args=["-O3", "-std=c11", "-fno-strict-aliasing"])

setup(
    ext_modules=[
        Extension("nemo_dcr.kernels._cxor", ["nemo_dcr/kernels/csrc/xor_diff.c"], **_COMMON),
        Extension("nemo_dcr.codec._cans", ["nemo_dcr/codec/csrc/ans.c"], **_COMMON),
        Extension("nemo_dcr.codec._crans", ["nemo_dcr/codec/csrc/rans.c"], **_COMMON),
    ]
)
