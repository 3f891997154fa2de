"""Pure-Python twin of ``codec/csrc/ans.c`` (the MODEL coder), for tests on small inputs.

It implements the same adaptive counters, range coder and context models, so it must
produce byte-identical streams and decode the native coder's streams; the tests check
both directions.  One binary decision per Python-level call: use it only on a few
thousand elements.  ``RefModelStates`` plays the role of ``model.ModelStates``.
"""
from __future__ import annotations

import numpy as np

from nemo_dcr.errors import FormatError

LIMIT_FLAG = 4095
LIMIT_VAL = 1023
NEXP, NPH = 32, 18
LOWTREE_BITS = 8
MAX_STRIP = 4
NGB, GAPTREE_BITS = 24, 3
ONE = 1 << 31
RECIP = [(65536 + (n + 2) // 2) // (n + 2) for n in range(max(LIMIT_FLAG, LIMIT_VAL) + 1)]


class RefModel:
    """Adaptive counters keyed by their context; every counter starts at p = 1/2, n = 0."""

    def __init__(self) -> None:
        self.bits: dict[tuple, list[int]] = {}

    def __call__(self, *key) -> list[int]:
        b = self.bits.get(key)
        if b is None:
            b = self.bits[key] = [1 << 30, 0]
        return b


class RefModelStates:
    def __init__(self) -> None:
        self._m: dict[tuple[str, bool], RefModel] = {}

    def get(self, dtype: str, context: bool) -> RefModel:
        return self._m.setdefault((dtype, context), RefModel())


def _p0(b: list[int]) -> int:
    return min(max(ONE - b[0], 1 << 8), ONE - (1 << 8))


def _update(b: list[int], bit: int, limit: int) -> None:
    r = RECIP[b[1]]
    if bit:
        b[0] += ((ONE - b[0]) * r) >> 16
    else:
        b[0] -= (b[0] * r) >> 16
    if b[1] < limit:
        b[1] += 1


class RefEncoder:
    def __init__(self) -> None:
        self.low, self.range, self.cache, self.cache_size = 0, 0xFFFFFFFF, 0, 1
        self.out = bytearray()

    def _shift(self) -> None:
        if (self.low & 0xFFFFFFFF) < 0xFF000000 or (self.low >> 32) != 0:
            carry = self.low >> 32
            temp = self.cache
            while True:
                self.out.append((temp + carry) & 0xFF)
                temp = 0xFF
                self.cache_size -= 1
                if self.cache_size == 0:
                    break
            self.cache = (self.low >> 24) & 0xFF
        self.cache_size += 1
        self.low = (self.low & 0x00FFFFFF) << 8

    def bit(self, b: list[int], bit: int, limit: int) -> None:
        bound = (self.range * _p0(b)) >> 31
        if bit:
            self.low += bound
            self.range -= bound
        else:
            self.range = bound
        _update(b, bit, limit)
        while self.range < 1 << 24:
            self.range <<= 8
            self._shift()

    def finish(self) -> bytes:
        for k in (32, 24, 16, 8):
            mask = (1 << k) - 1
            x = (self.low + mask) & ~mask
            if x < self.low + self.range:
                self.low = x
                break
        for _ in range(5):
            self._shift()
        for _ in range(MAX_STRIP):
            if len(self.out) > 1 and self.out[-1] == 0:
                self.out.pop()
        assert self.out[0] == 0
        return bytes(self.out[1:])


class RefDecoder:
    def __init__(self, data: bytes) -> None:
        self.data, self.pos, self.over = data, 0, 0
        self.range, self.code = 0xFFFFFFFF, 0
        for _ in range(4):
            self.code = (self.code << 8) | self._next()

    def _next(self) -> int:
        if self.pos < len(self.data):
            self.pos += 1
            return self.data[self.pos - 1]
        self.over += 1
        return 0

    def bit(self, b: list[int], limit: int) -> int:
        bound = (self.range * _p0(b)) >> 31
        if self.code < bound:
            self.range, bit = bound, 0
        else:
            self.code -= bound
            self.range -= bound
            bit = 1
        _update(b, bit, limit)
        while self.range < 1 << 24:
            self.range <<= 8
            self.code = ((self.code << 8) | self._next()) & 0xFFFFFFFF
        return bit


class _Params:
    def __init__(self, width, eshift, ebits, e_lo, op, lo, hi, base):
        self.width, self.W = width, 8 * width
        self.hbits = self.W.bit_length()
        self.eshift, self.ebits, self.e_lo = eshift, ebits, e_lo
        self.is_float = ebits > 0
        self.op, self.lo, self.hi = op, lo, hi
        self.mask = (1 << self.W) - 1
        self.signbit = 1 << (self.W - 1)
        self.base = None if base is None else [int(x) for x in np.asarray(base)[: hi]]

    def ord(self, b: int) -> int:
        if not self.is_float:
            return b
        return (~b & self.mask) if b & self.signbit else b | self.signbit

    def iord(self, o: int) -> int:
        if not self.is_float:
            return o
        return (o & ~self.signbit) if o & self.signbit else (~o & self.mask)

    def exp_bucket(self, b: int) -> int:
        e = ((b >> self.eshift) & ((1 << self.ebits) - 1)) - self.e_lo if self.ebits else b.bit_length()
        return min(max(e, 0), NEXP - 1)


class _State:
    def __init__(self, P: _Params) -> None:
        self.left = 0
        self.prev_h = 0
        self.last = P.lo - 1000

    def flag_key(self, P: _Params, i: int) -> tuple:
        return ("flag", 2 * P.exp_bucket(P.base[i]) + self.left)

    def h_key(self, P: _Params, i: int, basev: int) -> tuple:
        if P.base is not None:
            return ("h", P.exp_bucket(basev))
        gap = i - self.last
        gb = 0 if gap <= 1 else (1 if gap <= 4 else 2)
        return ("h", gb * NPH + min(self.prev_h, NPH - 1))


def _sign_key(P: _Params, basev: int, h: int) -> tuple:
    return ("sign", (1 if basev & P.signbit else 0) * 4 + min(h, 3))


def _gap_ctx(mean16: int) -> int:
    return min((mean16 >> 4).bit_length(), NGB - 1)


def _gap_mean(mean16: int, x: int) -> int:
    t = min(x, 1 << 40) << 4
    return mean16 + ((t - mean16) >> 4) if t >= mean16 else mean16 - ((mean16 - t) >> 4)


def _low_bits(h: int) -> tuple[int, int]:
    nb = h - 1
    return nb, min(nb, LOWTREE_BITS)


def encode(model: RefModel, positions, values, base, lo, hi, width, eshift, ebits, e_lo, op) -> bytes:
    """Same arguments and result as ``_cans.encode`` (the model is updated in place)."""
    P = _Params(width, eshift, ebits, e_lo, op, lo, hi, base)
    enc = RefEncoder()
    pos = [int(p) for p in positions]
    vals = [int(v) for v in values]
    nnz = len(pos)
    s = _State(P)
    j = 0

    def enc_mag(hkey, mag):
        h = mag.bit_length()
        node = 1
        for k in range(P.hbits - 1, -1, -1):
            bit = (h >> k) & 1
            enc.bit(model(*hkey, node), bit, LIMIT_VAL)
            node = (node << 1) | bit
        return h

    def enc_low(h, mag):
        if h < 2:
            return
        nb, t = _low_bits(h)
        node = 1
        for k in range(nb - 1, nb - t - 1, -1):
            bit = (mag >> k) & 1
            enc.bit(model("low", h, node), bit, LIMIT_VAL)
            node = (node << 1) | bit
        prev = node & 1
        for k in range(nb - t - 1, -1, -1):
            bit = (mag >> k) & 1
            enc.bit(model("tail", h, k, prev), bit, LIMIT_VAL)
            prev = bit

    def enc_value(i, v):
        basev = P.base[i] if P.base is not None else 0
        hkey = s.h_key(P, i, basev)
        if P.base is None:
            h = enc_mag(hkey, v)
            enc_low(h, v)
            return h
        newv = basev ^ v if op == 0 else v
        k = (P.ord(newv) - P.ord(basev)) & P.mask
        neg = 1 if k & P.signbit else 0
        mag = ((~k + 1) & P.mask) if neg else k
        if neg and mag == 0:
            mag = P.signbit
        h = enc_mag(hkey, mag)
        if h > 0:
            enc.bit(model(*_sign_key(P, basev, h)), neg, LIMIT_VAL)
        enc_low(h, mag)
        return h

    if P.base is None:  # context-free: positions as gaps
        prev, mean16 = lo - 1, 0
        for j in range(nnz):
            i = pos[j]
            if nnz - j < hi - (prev + 1):
                x = i - prev
                b = x.bit_length() - 1
                ctx = _gap_ctx(mean16)
                node = 1
                for k in range(5, -1, -1):
                    bit = (b >> k) & 1
                    enc.bit(model("gapb", ctx, node), bit, LIMIT_FLAG)
                    node = (node << 1) | bit
                t = min(b, GAPTREE_BITS)
                node = 1
                for k in range(b - 1, b - t - 1, -1):
                    bit = (x >> k) & 1
                    enc.bit(model("gapm", b, node), bit, LIMIT_FLAG)
                    node = (node << 1) | bit
                for k in range(b - t - 1, -1, -1):
                    enc.bit(model("gapt", b, k), (x >> k) & 1, LIMIT_FLAG)
                mean16 = _gap_mean(mean16, x)
            h = enc_value(i, vals[j])
            s.prev_h, s.last = h + 1, i
            prev = i
        return enc.finish()

    i = lo
    while i < hi and j < nnz:
        present = 1 if pos[j] == i else 0
        if nnz - j < hi - i:
            enc.bit(model(*s.flag_key(P, i)), present, LIMIT_FLAG)
        if present:
            h = enc_value(i, vals[j])
            s.prev_h, s.last = h + 1, i
            j += 1
        s.left = present
        i += 1
    return enc.finish()


def decode(model: RefModel, stream: bytes, nnz, base, lo, hi, width, eshift, ebits, e_lo,
           op) -> tuple[np.ndarray, list[int]]:
    """(positions, values as ints) like ``_cans.decode``; raises ValueError on invalid input."""
    P = _Params(width, eshift, ebits, e_lo, op, lo, hi, base)
    dec = RefDecoder(bytes(stream))
    s = _State(P)
    pos, vals = [], []

    def dec_h(hkey):
        node = 1
        for _ in range(P.hbits):
            node = (node << 1) | dec.bit(model(*hkey, node), LIMIT_VAL)
        return node - (1 << P.hbits)

    def dec_low(h):
        if h < 1:
            return 0
        if h == 1:
            return 1
        nb, t = _low_bits(h)
        node = 1
        for _ in range(t):
            node = (node << 1) | dec.bit(model("low", h, node), LIMIT_VAL)
        v, prev = node, node & 1
        for k in range(nb - t - 1, -1, -1):
            bit = dec.bit(model("tail", h, k, prev), LIMIT_VAL)
            v, prev = (v << 1) | bit, bit
        return v

    def dec_value(i):
        basev = P.base[i] if P.base is not None else 0
        h = dec_h(s.h_key(P, i, basev))
        if h > P.W:
            raise FormatError("impossible value")
        if P.base is None:
            v = dec_low(h)
        else:
            neg = dec.bit(model(*_sign_key(P, basev, h)), LIMIT_VAL) if h > 0 else 0
            mag = dec_low(h)
            k = ((~mag + 1) & P.mask) if neg else mag
            newv = P.iord((P.ord(basev) + k) & P.mask)
            v = basev ^ newv if op == 0 else newv
        if op == 0 and v == 0:
            raise FormatError("impossible value")
        return h, v

    if P.base is None:
        prev, mean16 = lo - 1, 0
        for j in range(nnz):
            i = prev + 1
            if nnz - j < hi - (prev + 1):
                ctx = _gap_ctx(mean16)
                node = 1
                for _ in range(6):
                    node = (node << 1) | dec.bit(model("gapb", ctx, node), LIMIT_FLAG)
                b = node - 64
                t = min(b, GAPTREE_BITS)
                node = 1
                for _ in range(t):
                    node = (node << 1) | dec.bit(model("gapm", b, node), LIMIT_FLAG)
                x = node
                for k in range(b - t - 1, -1, -1):
                    x = (x << 1) | dec.bit(model("gapt", b, k), LIMIT_FLAG)
                mean16 = _gap_mean(mean16, x)
                if x > hi - (nnz - j) - prev:
                    raise FormatError("gap beyond the range")
                i = prev + x
            h, v = dec_value(i)
            pos.append(i)
            vals.append(v)
            s.prev_h, s.last = h + 1, i
            prev = i
            if dec.over > MAX_STRIP:
                raise FormatError("stream ends before its content")
        if dec.pos != len(dec.data):
            raise FormatError("stream length does not match its content")
        return np.asarray(pos, dtype=np.int64), vals

    i = lo
    while i < hi and len(pos) < nnz:
        present = 1
        if nnz - len(pos) < hi - i:
            present = dec.bit(model(*s.flag_key(P, i)), LIMIT_FLAG)
        if present:
            h, v = dec_value(i)
            pos.append(i)
            vals.append(v)
            s.prev_h, s.last = h + 1, i
        s.left = present
        if dec.over > MAX_STRIP:
            raise FormatError("stream ends before its content")
        i += 1
    if len(pos) != nnz or dec.pos != len(dec.data):
        raise FormatError("stream length does not match its content")
    return np.asarray(pos, dtype=np.int64), vals
