"""Pure-Python twin of the BUCKET coding (coding 4), written from docs/wire-format.md
("BUCKET: bucketed gaps, adaptive rANS"), not from ``codec/csrc/rans.c``.

It exists to check the native coder against the spec: same call shape as
``_crans.encode``/``_crans.decode`` (the decoder returns its arrays instead of filling
output buffers), byte-identical payloads, and it decodes the native coder's payloads.
Everything that decides a bit is plain Python integer arithmetic; numpy only converts the
inputs.  Where the spec leaves a choice open this module picks what rans.c does (marked
"spec gap" below):

* the Rice parameter when no ``k`` in [0, 40] satisfies the bound: 40;
* which symbol gets a rebuild's remainder: the largest *count* (lowest such ``s``), not the
  largest frequency (they differ when two counts round to one frequency).

The decoder makes the checks the spec lists and no others (see ``decode``), so it accepts
some non-canonical payloads rans.c rejects (tests/codec/test_bucket_ref.py,
``test_native_decoder_is_stricter_than_the_spec``).

The Python coder does a few dozen interpreter operations per symbol: use it on records of
a few thousand changed elements.  ``RefState`` plays the role of the native state buffer;
the encoder and decoder update it in place, so records of one chunk share it in order.
"""
from __future__ import annotations

import copy
from bisect import bisect_right

import numpy as np

from nemo_dcr.errors import FormatError, ValidationError

# Constants of the spec, by name (tests perturb them to prove the comparisons can fail).
PROB_BITS = 12                  # frequencies sum to 2^12 = 4096
RANS_L = 1 << 16                # rANS states start and end at 2^16; 16-bit words
NB = 32                         # buckets: clamp(..., 0, 31)
QA = 32                         # gap quotient alphabet; the last symbol is the escape
ESC_LEN_BITS = 6                # the escape's length field
ESC_MAX_LEN = 48                # L <= 48
RICE_MAX_K = 40                 # k in [0, 40]
GAP_SUM0, GAP_CNT0 = 16, 1      # gap statistics start
GAP_HALVE = 64                  # both halve when gcnt reaches this
TOP_BITS = 5                    # context-free: bits below the leading one coded as a symbol
SEG = 4096                      # segment length (context mode)
REBUILD0, REBUILD_MAX = 16, 1024
COUNT_HALVE = 1 << 16           # counts halve when their total reaches this
ACTIVE_BITS = 32                # the active mask


class RefContext:
    """An adaptive context over ``A`` symbols (spec: "Adaptive contexts")."""

    def __init__(self, A: int) -> None:
        tot = 1 << PROB_BITS
        self.A = A
        self.cnt = [0] * A
        self.freq = [tot // A + (1 if s < tot % A else 0) for s in range(A)]
        self.next = REBUILD0
        self.since = 0  # symbols coded since the last rebuild
        self._cum()

    def _cum(self) -> None:
        c, self.cum = 0, []
        for f in self.freq:
            self.cum.append(c)
            c += f
        assert c == 1 << PROB_BITS

    def update(self, s: int) -> None:
        self.cnt[s] += 1
        self.since += 1
        if self.since == self.next:
            self._rebuild()

    def _rebuild(self) -> None:
        tot = 1 << PROB_BITS
        total = sum(self.cnt)
        self.freq = [1 + c * (tot - self.A) // total for c in self.cnt]
        # spec gap: "the most frequent symbol (the lowest such s)"; rans.c takes the largest
        # count, which is the reading used here (the largest freq can tie between counts).
        best = max(range(self.A), key=lambda s: (self.cnt[s], -s))
        self.freq[best] += tot - sum(self.freq)
        self._cum()
        if total >= COUNT_HALVE:
            self.cnt = [c >> 1 for c in self.cnt]
        self.next = min(2 * self.next, REBUILD_MAX)
        self.since = 0

    def symbol_at(self, slot: int) -> int:
        return bisect_right(self.cum, slot) - 1


class RefState:
    """The adaptive state of one (dtype width, mode) in a chunk: every context and every
    bucket's gap statistics (spec: "State sharing").  Fresh per chunk."""

    def __init__(self, width: int, context: bool) -> None:
        if width not in (1, 2, 4, 8):
            raise ValidationError("width must be 1, 2, 4 or 8")
        W = 8 * width
        self.width, self.context = width, bool(context)
        self.gsum = [GAP_SUM0] * NB
        self.gcnt = [GAP_CNT0] * NB
        self.q = [RefContext(QA) for _ in range(NB)]
        # Context mode: one value context per bucket; context-free: the one of bucket 0.
        self.h = [RefContext(W + 1) for _ in range(NB)]
        # Context-free: the top-bits context of each h >= 2 (alphabet 2^min(h - 1, TOP_BITS)).
        self.t = {h: RefContext(1 << min(h - 1, TOP_BITS)) for h in range(2, W + 1)}

    def copy(self) -> "RefState":
        return copy.deepcopy(self)

    def rice_k(self, b: int) -> int:
        # spec gap: "the least k in [0, 40] with ..."; when none qualifies, 40 (as rans.c).
        for k in range(RICE_MAX_K + 1):
            if self.gcnt[b] << (k + 2) >= self.gsum[b]:
                return k
        return RICE_MAX_K

    def gap_seen(self, b: int, u: int) -> None:
        self.gsum[b] += u
        self.gcnt[b] += 1
        if self.gcnt[b] >= GAP_HALVE:
            self.gsum[b] = (self.gsum[b] + 1) >> 1
            self.gcnt[b] >>= 1


class _Params:
    def __init__(self, state, base, lo, hi, width, eshift, ebits, e_lo, op) -> None:
        if not isinstance(state, RefState) or state.width != width or state.context != (base is not None):
            raise ValidationError("state was not initialised for this dtype and mode")
        if not (0 <= lo <= hi) or op not in (0, 1) or not (0 <= e_lo <= 255):
            raise ValidationError("bad record parameters")
        self.W = 8 * width
        self.mask, self.signbit = (1 << self.W) - 1, 1 << (self.W - 1)
        self.eshift, self.ebits, self.e_lo = eshift, ebits, e_lo
        self.is_float = ebits > 0
        self.lo, self.hi, self.op = lo, hi, op
        self.context = base is not None
        self.base: list[int] | None = None
        if base is not None:
            b = np.asarray(base)
            if b.size < hi:
                raise ValidationError("base shorter than the record's range")
            self.base = [int(x) for x in b[lo:hi]]  # base[i - lo] is element i's base bits

    def bucket(self, i: int) -> int:
        """Spec "Buckets": exponent field minus e_lo for floats, bit length for integers."""
        x = self.base[i - self.lo]
        e = ((x >> self.eshift) & ((1 << self.ebits) - 1)) - self.e_lo if self.is_float else x.bit_length()
        return min(max(e, 0), NB - 1)

    def ord(self, x: int) -> int:
        if not self.is_float:
            return x
        return (~x & self.mask) if x & self.signbit else x | self.signbit

    def iord(self, o: int) -> int:
        if not self.is_float:
            return o
        return (o & ~self.signbit) if o & self.signbit else (~o & self.mask)


# ---------------------------------------------------------------- encoder

class _Writer:
    """Collects the record's symbols (as their (freq, cum) when coded) and its raw bits."""

    def __init__(self) -> None:
        self.syms: list[tuple[int, int]] = []
        self.raw, self.nraw = 0, 0  # raw bits as one integer, LSB first

    def sym(self, ctx: RefContext, s: int) -> None:
        assert 0 <= s < ctx.A
        self.syms.append((ctx.freq[s], ctx.cum[s]))
        ctx.update(s)

    def bits(self, v: int, n: int) -> None:
        # "Raw fields wider than 32 bits are written as their low 32 bits, then the rest":
        # with LSB-first packing that is the same as writing all n bits at once.
        self.raw |= (v & ((1 << n) - 1)) << self.nraw
        self.nraw += n

    def payload(self) -> bytes:
        x = [RANS_L, RANS_L]
        words: list[int] = []
        for j in range(len(self.syms) - 1, -1, -1):  # backwards
            f, c = self.syms[j]
            s = x[j % 2]
            if s >= f << (32 - PROB_BITS):
                words.append(s & 0xFFFF)
                s >>= 16
            x[j % 2] = ((s // f) << PROB_BITS) + s % f + c
        words.reverse()  # the order the decoder reads them
        rans = x[0].to_bytes(4, "little") + x[1].to_bytes(4, "little") + b"".join(
            w.to_bytes(2, "little") for w in words)
        raw = self.raw.to_bytes((self.nraw + 7) // 8, "little")
        return len(rans).to_bytes(4, "little") + rans + raw


def _enc_gap(st: RefState, w: _Writer, b: int, g: int) -> None:
    u = g - 1
    assert u >= 0
    k = st.rice_k(b)
    q = u >> k
    if q < QA - 1:
        w.sym(st.q[b], q)
    else:
        w.sym(st.q[b], QA - 1)
        e = q - (QA - 1)
        L = e.bit_length()
        w.bits(L, ESC_LEN_BITS)
        w.bits(e, L)
    w.bits(u, k)
    st.gap_seen(b, u)


def _enc_value(st: RefState, P: _Params, w: _Writer, i: int, v: int) -> None:
    if P.context:
        old = P.base[i - P.lo]
        new = old ^ v if P.op == 0 else v
        k = (P.ord(new) - P.ord(old)) & P.mask
        neg = 1 if k & P.signbit else 0
        mag = (-k) & P.mask if neg else k  # |k|; k = -2^(W-1) gives 2^(W-1)
        h = mag.bit_length()
        w.sym(st.h[P.bucket(i)], h)
        if h:
            w.bits(neg, 1)
            w.bits(mag, h - 1)
    else:
        h = v.bit_length()
        w.sym(st.h[0], h)
        if h >= 2:
            t = min(h - 1, TOP_BITS)
            rest = h - 1 - t
            w.sym(st.t[h], (v >> rest) & ((1 << t) - 1))
            w.bits(v, rest)


def encode(state: RefState, positions, values, base, lo: int, hi: int, width: int, eshift: int,
           ebits: int, e_lo: int, op: int) -> bytes:
    """Same arguments and result as ``_crans.encode``; ``state`` is updated in place."""
    P = _Params(state, base, lo, hi, width, eshift, ebits, e_lo, op)
    pos = [int(p) for p in np.asarray(positions, dtype=np.int64)]
    vals = [int(v) for v in np.asarray(values)]
    if len(pos) != len(vals) or any(not (lo <= p < hi) for p in pos) or any(
            a >= b for a, b in zip(pos, pos[1:])):
        raise ValidationError("positions must be strictly increasing inside [lo, hi)")
    if any(not (0 <= v <= P.mask) for v in vals):
        raise ValidationError("value wider than the dtype")
    w = _Writer()
    if not P.context:
        prev = lo - 1
        for p in pos:
            _enc_gap(state, w, 0, p - prev)
            prev = p
    else:
        # Ranks within buckets, and each bucket's size n_b, in one walk over the range.
        seen = [0] * NB
        rank, bk = {}, {}
        changed = set(pos)
        for i in range(lo, hi):
            b = P.bucket(i)
            if i in changed:
                rank[i], bk[i] = seen[b], b
            seen[b] += 1
        n_b = seen
        per_bucket: dict[int, list[int]] = {}
        for p in pos:
            per_bucket.setdefault(bk[p], []).append(p)
        nxt = {}
        for lst in per_bucket.values():
            for a, c in zip(lst, lst[1:]):
                nxt[a] = c
        active = sum(1 << b for b in per_bucket)
        w.bits(active, ACTIVE_BITS)
        for b in sorted(per_bucket):
            _enc_gap(state, w, b, rank[per_bucket[b][0]] + 1)
        for s0 in range(lo, hi, SEG):
            seg = [p for p in pos if s0 <= p < s0 + SEG]
            for p in sorted(seg, key=lambda p: (bk[p], p)):
                b = bk[p]
                g = rank[nxt[p]] - rank[p] if p in nxt else n_b[b] - rank[p]  # else terminal
                _enc_gap(state, w, b, g)
    for p, v in zip(pos, vals):
        _enc_value(state, P, w, p, v)
    return w.payload()


# ---------------------------------------------------------------- decoder

class _Reader:
    def __init__(self, payload: bytes) -> None:
        if len(payload) < 4:
            raise FormatError("payload shorter than rans_len")
        rlen = int.from_bytes(payload[:4], "little")
        # Implied by the layout: two u32 states, then whole 16-bit words, inside the payload.
        if rlen < 8 or rlen % 2 or 4 + rlen > len(payload):
            raise FormatError("bad rans_len")
        self.x = [int.from_bytes(payload[4:8], "little"), int.from_bytes(payload[8:12], "little")]
        self.words = [int.from_bytes(payload[i:i + 2], "little") for i in range(12, 4 + rlen, 2)]
        self.wi = 0
        self.j = 0  # symbols decoded so far
        raw = payload[4 + rlen:]
        self.raw, self.rawbits, self.ri = int.from_bytes(raw, "little"), 8 * len(raw), 0

    def sym(self, ctx: RefContext) -> int:
        x = self.x[self.j % 2]
        slot = x % (1 << PROB_BITS)
        s = ctx.symbol_at(slot)
        x = ctx.freq[s] * (x >> PROB_BITS) + slot - ctx.cum[s]
        if x < RANS_L:
            if self.wi == len(self.words):
                raise FormatError("rANS words run out")
            x = (x << 16) | self.words[self.wi]
            self.wi += 1
        self.x[self.j % 2] = x
        self.j += 1
        ctx.update(s)
        return s

    def bits(self, n: int) -> int:
        if self.ri + n > self.rawbits:
            raise FormatError("raw bits run out")
        v = (self.raw >> self.ri) & ((1 << n) - 1)
        self.ri += n
        return v

    def finish(self) -> None:
        if self.x != [RANS_L, RANS_L]:
            raise FormatError("final rANS states are not 2^16")
        if self.wi != len(self.words):
            raise FormatError("rANS words left unread")
        if self.rawbits - self.ri >= 8:
            raise FormatError("raw bytes left unread")
        if self.raw >> self.ri:
            raise FormatError("raw padding is not zero")


def _dec_gap(st: RefState, r: _Reader, b: int) -> int:
    k = st.rice_k(b)
    q = r.sym(st.q[b])
    if q == QA - 1:
        L = r.bits(ESC_LEN_BITS)
        if L > ESC_MAX_LEN:
            raise FormatError("escape length over 48")
        q += r.bits(L)
    u = (q << k) | r.bits(k)
    st.gap_seen(b, u)
    return u + 1


def _dec_value(st: RefState, P: _Params, r: _Reader, i: int) -> int:
    if P.context:
        h = r.sym(st.h[P.bucket(i)])
        k = 0
        if h:
            neg = r.bits(1)
            mag = (1 << (h - 1)) | r.bits(h - 1)
            k = (-mag) & P.mask if neg else mag
        old = P.base[i - P.lo]
        new = P.iord((P.ord(old) + k) & P.mask)
        return old ^ new if P.op == 0 else new
    h = r.sym(st.h[0])
    if h < 2:
        return h
    t_bits = min(h - 1, TOP_BITS)
    rest = h - 1 - t_bits
    t = r.sym(st.t[h])
    return (1 << (h - 1)) | (t << rest) | r.bits(rest)


def decode(state: RefState, payload, nnz: int, base, lo: int, hi: int, width: int, eshift: int,
           ebits: int, e_lo: int, op: int) -> tuple[np.ndarray, np.ndarray]:
    """(positions int64, values uint of ``width`` bytes), like ``_crans.decode`` fills its
    output buffers; ``state`` is updated in place.  ValueError on an invalid payload: the
    spec's checks (final states, unread words or bytes, padding, gap past ``range_hi - 1``,
    L > 48, more than ``nnz`` elements, range exhausted first) and what the layout implies
    (``rans_len`` even, >= 8, inside the payload; reading past either stream's end)."""
    P = _Params(state, base, lo, hi, width, eshift, ebits, e_lo, op)
    if not (0 <= nnz <= hi - lo):
        raise FormatError("nnz outside [0, range_len]")
    r = _Reader(bytes(payload))
    pos: list[int] = []
    if not P.context:
        prev = lo - 1
        for _ in range(nnz):
            g = _dec_gap(state, r, 0)
            if prev + g > hi - 1:
                raise FormatError("gap past range_hi - 1")
            prev += g
            pos.append(prev)
    else:
        active = r.bits(ACTIVE_BITS)
        buckets = [b for b in range(NB) if active >> b & 1]
        target = {b: _dec_gap(state, r, b) - 1 for b in buckets}  # next changed rank of b
        seen = [0] * NB  # elements of each bucket before the current segment
        for s0 in range(lo, hi, SEG):
            if len(pos) >= nnz:
                break
            members: dict[int, list[int]] = {}
            for i in range(s0, min(s0 + SEG, hi)):
                members.setdefault(P.bucket(i), []).append(i)
            found = []
            for b in buckets:
                lst = members.get(b, [])
                while target[b] < seen[b] + len(lst):
                    found.append(lst[target[b] - seen[b]])
                    target[b] += _dec_gap(state, r, b)
                    if len(pos) + len(found) > nnz:
                        raise FormatError("more changed elements than nnz")
                seen[b] += len(lst)
            pos.extend(sorted(found))
        if len(pos) != nnz:
            raise FormatError("range ends before nnz changed elements")
    vals = [_dec_value(state, P, r, i) for i in pos]
    if P.op == 0 and 0 in vals:
        raise FormatError("a zero XOR value (v1 carries none)")
    r.finish()
    return np.asarray(pos, dtype=np.int64), np.asarray(vals, dtype=np.dtype(f"<u{width}"))
