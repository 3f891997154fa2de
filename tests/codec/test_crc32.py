"""The native CRC-32 (``_crans.crc32``: PCLMULQDQ folding where the CPU has it, a byte table
elsewhere) is zlib's, for every length around the fold's 16- and 64-byte steps, any initial
value, any buffer (numpy arrays included), on each CPU path; ``format.crc32`` (the chunk
checksums) uses it only where it folds.  Negative control: one flipped bit changes it."""
from __future__ import annotations

import zlib

import numpy as np
import pytest

from nemo_dcr.codec import bucket, format as fmt

pytestmark = pytest.mark.skipif(not bucket.available(), reason="native rANS coder (_crans) not built")

if bucket.available():
    from nemo_dcr.codec.bucket import _crans

LENGTHS = [*range(0, 200), 255, 256, 257, 1023, 4096, 4099, 65535, 1 << 17]


@pytest.fixture(params=[0, 2], ids=["scalar", "best"])
def level(request):
    prev = _crans.simd()
    _crans.set_simd(request.param)
    yield request.param
    _crans.set_simd({"scalar": 0, "avx2": 1}.get(prev, 2))


def test_equals_zlib(level):
    rng = np.random.default_rng(7)
    for n in LENGTHS:
        data = rng.integers(0, 256, n, dtype=np.uint8).tobytes()
        for init in (0, 1, 0xDEADBEEF, 0xFFFFFFFF):
            assert _crans.crc32(data, init) == zlib.crc32(data, init), (n, init)
    assert _crans.crc32(b"") == 0


def test_buffers_and_chaining():
    rng = np.random.default_rng(8)
    pos = np.sort(rng.choice(1 << 30, 5000, replace=False)).astype("<i8")
    vals = rng.integers(0, 1 << 16, 5000).astype("<u2")
    want = zlib.crc32(vals, zlib.crc32(pos))
    assert _crans.crc32(vals, _crans.crc32(pos)) == want
    assert fmt.crc32(pos, vals) == want
    assert fmt.content_crc(pos, vals) == want
    assert _crans.crc32(memoryview(pos.tobytes())[3:-5]) == zlib.crc32(pos.tobytes()[3:-5])


def test_a_flipped_bit_changes_it():
    data = bytearray(np.random.default_rng(9).integers(0, 256, 1000, dtype=np.uint8).tobytes())
    before = _crans.crc32(bytes(data))
    data[517] ^= 0x10
    assert _crans.crc32(bytes(data)) != before


def test_format_uses_the_folding_one_only_where_it_folds():
    assert fmt._crc is (_crans.crc32 if _crans.crc32_clmul() else zlib.crc32)
