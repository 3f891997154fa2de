"""Pure-Python twin of the LANES coding (coding 5), written from docs/wire-format.md
("LANES: static tables, 16 rANS lanes"), not from ``codec/csrc/lanes.c``.

Same call shape as ``_crans.lanes_encode`` / ``_crans.lanes_decode`` (the decoder returns its
arrays instead of filling output buffers); tests/codec/test_lanes_coding.py checks byte-identical
payloads and that each decodes the other's.  Everything that decides a bit is plain Python
integer arithmetic.  A few dozen interpreter operations per symbol: for records of a few
thousand changed elements.  The decoder makes the checks the spec lists.
"""
from __future__ import annotations

import numpy as np

from nemo_dcr.errors import FormatError, ValidationError

# Constants of the spec, by name (tests perturb them to prove the comparisons can fail).
PROB_BITS = 12                  # slots: 4096
MAX_FREQ = (1 << PROB_BITS) - 16  # no symbol above 4080 of 4096
RANS_L = 1 << 16
LANES = 16
NB = 32
QA = 32                         # quotient alphabet; 31 = escape
ESC_LEN_BITS, ESC_MAX_LEN = 6, 48
RICE_BITS, RICE_MAX_K = 6, 40
COUNT_LEN_BITS, COUNT_MAX_LEN = 6, 41
TOP_BITS = 5
PREC_BITS = 4
GAMMA_MAX_ZEROS = 13
ACTIVE_BITS = 32


class _Rec:
    def __init__(self, base, lo, hi, width, eshift, ebits, e_lo, op) -> None:
        if width not in (1, 2, 4, 8) or not (0 <= lo <= hi) or op not in (0, 1) or not 0 <= e_lo <= 255:
            raise ValidationError("bad record parameters")
        self.W = 8 * width
        self.mask, self.signbit = (1 << self.W) - 1, 1 << (self.W - 1)
        self.eshift, self.ebits, self.e_lo, self.is_float = eshift, ebits, e_lo, ebits > 0
        self.lo, self.hi, self.op = lo, hi, op
        self.context = base is not None
        self.base = None if base is None else [int(x) for x in np.asarray(base)[lo:hi]]

    def bucket(self, i: int) -> int:
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

    def ranks(self) -> tuple[list[int], list[int]]:
        """Bucket and rank of every element of the range (context mode)."""
        seen = [0] * NB
        bk, rk = [], []
        for i in range(self.lo, self.hi):
            b = self.bucket(i)
            bk.append(b)
            rk.append(seen[b])
            seen[b] += 1
        return bk, rk


def _top(h: int) -> int:
    return min(h - 1, TOP_BITS)


# ---------------------------------------------------------------- tables

def _normalise(cnt: list[int]) -> tuple[int, list[int]]:
    """(p, f) per the spec's "Encoder choices"."""
    A, n = len(cnt), sum(cnt)
    if n == 0:
        return 1, [1, 1] + [0] * (A - 2)
    u = sum(1 for c in cnt if c)
    p = min(PROB_BITS, max(u.bit_length(), (n.bit_length() + 1) // 2 + 2))
    T = 1 << p
    f = [1 + c * (T - u) // n if c else 0 for c in cnt]
    best = max(range(A), key=lambda s: (cnt[s], -s))
    f[best] += T - sum(f)
    cap = T - (T >> 8) if p >= 8 else T - 1
    if f[best] > cap:
        f[1 if best == 0 else 0] += f[best] - cap
        f[best] = cap
    return p, f


class _Table:
    def __init__(self, p: int, f: list[int]) -> None:
        self.freq = [x << (PROB_BITS - p) for x in f]
        self.cum, c = [], 0
        for x in self.freq:
            self.cum.append(c)
            c += x
        assert c == 1 << PROB_BITS

    def symbol_at(self, slot: int) -> int:
        for s, (c, f) in enumerate(zip(self.cum, self.freq)):
            if c <= slot < c + f:
                return s
        raise AssertionError("slots cover 4096")


class _Bits:
    def __init__(self) -> None:
        self.v, self.n = 0, 0

    def put(self, v: int, n: int) -> None:
        self.v |= (v & ((1 << n) - 1)) << self.n
        self.n += n

    def gamma(self, v: int) -> None:
        L = v.bit_length()
        self.put(1 << (L - 1), L)
        self.put(v, L - 1)

    def table(self, cnt: list[int]) -> _Table:
        p, f = _normalise(cnt)
        m = max(s for s, x in enumerate(f) if x)
        self.put(p, PREC_BITS)
        self.put(m, (len(cnt) - 1).bit_length())
        for s in range(m):
            self.gamma(f[s] + 1)
        return _Table(p, f)

    def tobytes(self) -> bytes:
        return self.v.to_bytes((self.n + 7) // 8, "little")


# ---------------------------------------------------------------- encoder

def encode(positions, values, base, lo: int, hi: int, width: int, eshift: int, ebits: int, e_lo: int,
           op: int) -> bytes:
    R = _Rec(base, lo, hi, width, eshift, ebits, e_lo, op)
    pos = [int(x) for x in np.asarray(positions)]
    vals = [int(x) for x in np.asarray(values)]
    n = len(pos)
    if R.context:
        bk_all, rk_all = R.ranks()
        bk = [bk_all[i - lo] for i in pos]
        rank = [rk_all[i - lo] for i in pos]
    else:
        bk, rank = [0] * n, [i - lo for i in pos]
    active = sorted(set(bk))
    members = {b: [j for j in range(n) if bk[j] == b] for b in active}  # position = rank order
    gaps = {b: [] for b in active}
    for b in active:
        prev = -1
        for j in members[b]:
            gaps[b].append(rank[j] - prev - 1)  # u
            prev = rank[j]
    kb = {}
    for b in active:
        s = sum(gaps[b])
        kb[b] = next((k for k in range(RICE_MAX_K + 1) if len(gaps[b]) << (k + 2) >= s), RICE_MAX_K)
    # values: h, raw field, top bits
    hs, raws, tops = [], [], []
    for j in range(n):
        v = vals[j]
        if R.context:
            old = R.base[pos[j] - lo]
            new = v ^ old if op == 0 else v
            k = (R.ord(new) - R.ord(old)) & R.mask
            neg = k & R.signbit
            mag = ((~k + 1) & R.mask) if neg else k
            h = mag.bit_length()
            hs.append(h)
            raws.append(((1 if neg else 0) | (mag << 1), h) if h else (0, 0))
            tops.append(None)
        else:
            h = v.bit_length()
            hs.append(h)
            if h >= 2:
                tb = _top(h)
                tops.append((v >> (h - 1 - tb)) & ((1 << tb) - 1))
                raws.append((v, h - 1 - tb))
            else:
                tops.append(None)
                raws.append((0, 0))
    bits = _Bits()
    if R.context:
        bits.put(sum(1 << b for b in active), ACTIVE_BITS)
    for b in active:
        if R.context:
            c = len(members[b])
            bits.put(c.bit_length(), COUNT_LEN_BITS)
            bits.put(c, c.bit_length() - 1)
        bits.put(kb[b], RICE_BITS)
    qt, ht, tt = {}, {}, {}
    for b in active:
        cnt = [0] * QA
        for u in gaps[b]:
            cnt[min(u >> kb[b], QA - 1)] += 1
        qt[b] = bits.table(cnt)
    for b in active:
        cnt = [0] * (R.W + 1)
        for j in members[b]:
            cnt[hs[j]] += 1
        ht[b] = bits.table(cnt)
    if not R.context and active:
        for h in range(2, R.W + 1):
            if ht[0].freq[h]:
                cnt = [0] * (1 << _top(h))
                for j in range(n):
                    if hs[j] == h:
                        cnt[tops[j]] += 1
                tt[h] = bits.table(cnt)
    syms: list[tuple[int, int]] = []  # (freq, cum) in symbol order
    for b in active:
        for u in gaps[b]:
            q = u >> kb[b]
            s = min(q, QA - 1)
            syms.append((qt[b].freq[s], qt[b].cum[s]))
            if s == QA - 1:
                e = q - (QA - 1)
                bits.put(e.bit_length(), ESC_LEN_BITS)
                bits.put(e, e.bit_length())
            bits.put(u, kb[b])
    for j in range(n):
        syms.append((ht[bk[j]].freq[hs[j]], ht[bk[j]].cum[hs[j]]))
        bits.put(*raws[j])
    for j in range(n):
        if tops[j] is not None:
            syms.append((tt[hs[j]].freq[tops[j]], tt[hs[j]].cum[tops[j]]))
    x = [RANS_L] * LANES
    out: list[int] = []  # words, in the order emitted (the reverse of reading order)
    for j in range(len(syms) - 1, -1, -1):
        f, c = syms[j]
        l = j % LANES
        if x[l] >= f << (32 - PROB_BITS):
            out.append(x[l] & 0xFFFF)
            x[l] >>= 16
        x[l] = ((x[l] // f) << PROB_BITS) + x[l] % f + c
    rans = b"".join(s.to_bytes(4, "little") for s in x) + b"".join(w.to_bytes(2, "little") for w in reversed(out))
    return len(rans).to_bytes(4, "little") + rans + bits.tobytes()


# ---------------------------------------------------------------- decoder

class _Reader:
    def __init__(self, payload: bytes) -> None:
        if len(payload) < 4 + 4 * LANES:
            raise FormatError("payload too short")
        rlen = int.from_bytes(payload[:4], "little")
        if rlen < 4 * LANES or rlen % 2 or rlen > len(payload) - 4:
            raise FormatError("bad rans_len")
        self.x = [int.from_bytes(payload[4 + 4 * l : 8 + 4 * l], "little") for l in range(LANES)]
        if min(self.x) < RANS_L:
            raise FormatError("initial state below 2^16")
        self.words = payload[4 + 4 * LANES : 4 + rlen]
        self.wp = 0
        self.j = 0
        raw = payload[4 + rlen :]
        self.raw, self.nraw, self.rp = int.from_bytes(raw, "little"), 8 * len(raw), 0

    def bits(self, n: int) -> int:
        if self.rp + n > self.nraw:
            raise FormatError("raw bits run out")
        v = (self.raw >> self.rp) & ((1 << n) - 1)
        self.rp += n
        return v

    def gamma(self) -> int:
        z = 0
        while not self.bits(1):
            z += 1
            if z > GAMMA_MAX_ZEROS:
                raise FormatError("gamma code too long")
        return (1 << z) | self.bits(z)

    def table(self, A: int) -> _Table:
        p = self.bits(PREC_BITS)
        m = self.bits((A - 1).bit_length())
        if not 1 <= p <= PROB_BITS or m >= A:
            raise FormatError("bad table header")
        f = [0] * A
        for s in range(m):
            f[s] = self.gamma() - 1
        f[m] = (1 << p) - sum(f)
        if f[m] < 1 or any(x << (PROB_BITS - p) > MAX_FREQ for x in f):
            raise FormatError("bad table")
        return _Table(p, f)

    def sym(self, t: _Table) -> int:
        l = self.j % LANES
        self.j += 1
        x = self.x[l]
        slot = x % (1 << PROB_BITS)
        s = t.symbol_at(slot)
        x = t.freq[s] * (x >> PROB_BITS) + slot - t.cum[s]
        if x < RANS_L:
            if self.wp + 2 > len(self.words):
                raise FormatError("rANS words run out")
            x = (x << 16) | int.from_bytes(self.words[self.wp : self.wp + 2], "little")
            self.wp += 2
        self.x[l] = x
        return s

    def finish(self) -> None:
        if self.wp != len(self.words) or any(x != RANS_L for x in self.x):
            raise FormatError("rANS stream not fully consumed")
        if (self.rp + 7) // 8 != self.nraw // 8 or self.raw >> self.rp:
            raise FormatError("raw bits not fully consumed or padding not zero")


def decode(payload, nnz: int, base, lo: int, hi: int, width: int, eshift: int, ebits: int, e_lo: int,
           op: int) -> tuple[np.ndarray, np.ndarray]:
    R = _Rec(base, lo, hi, width, eshift, ebits, e_lo, op)
    r = _Reader(bytes(payload))
    if R.context:
        mask = r.bits(ACTIVE_BITS)
        if (mask == 0) != (nnz == 0):
            raise FormatError("active mask inconsistent with nnz")
        active = [b for b in range(NB) if mask >> b & 1]
    else:
        active = [0] if nnz else []
    count, kb = {}, {}
    for b in active:
        if R.context:
            L = r.bits(COUNT_LEN_BITS)
            if not 1 <= L <= COUNT_MAX_LEN:
                raise FormatError("bad count length")
            count[b] = (1 << (L - 1)) | r.bits(L - 1)
        else:
            count[b] = nnz
        kb[b] = r.bits(RICE_BITS)
        if kb[b] > RICE_MAX_K:
            raise FormatError("bad Rice parameter")
    if sum(count.values()) != nnz:
        raise FormatError("counts do not sum to nnz")
    qt = {b: r.table(QA) for b in active}
    ht = {b: r.table(R.W + 1) for b in active}
    tt = {}
    if not R.context and active:
        for h in range(2, R.W + 1):
            if ht[0].freq[h]:
                tt[h] = r.table(1 << _top(h))
    qs = {b: [r.sym(qt[b]) for _ in range(count[b])] for b in active}
    ranks = {}
    for b in active:
        prev, out = -1, []
        for q in qs[b]:
            if q == QA - 1:
                L = r.bits(ESC_LEN_BITS)
                if L > ESC_MAX_LEN:
                    raise FormatError("escape too long")
                q += r.bits(L)
            if q >> (62 - kb[b]):
                raise FormatError("gap too large")
            u = (q << kb[b]) | r.bits(kb[b])
            prev += u + 1
            if prev >= hi - lo:
                raise FormatError("rank past the range")
            out.append(prev)
        ranks[b] = out
    if R.context:
        bk_all, rk_all = R.ranks()
        want = {(b, k) for b in active for k in ranks[b]}
        pos = [lo + t for t in range(hi - lo) if (bk_all[t], rk_all[t]) in want]
        if len(pos) != nnz:
            raise FormatError("a rank is past its bucket's end")
        bk = [bk_all[i - lo] for i in pos]
    else:
        pos = [lo + t for t in ranks[0]] if active else []
        bk = [0] * nnz
    hs = [r.sym(ht[bk[j]]) for j in range(nnz)]
    tops = [r.sym(tt[h]) if h >= 2 and not R.context else None for h in hs]
    vals = []
    for j in range(nnz):
        h = hs[j]
        if R.context:
            k = 0
            if h:
                f = r.bits(h)
                mag = (f >> 1) | (1 << (h - 1))
                k = ((~mag + 1) & R.mask) if f & 1 else mag
            old = R.base[pos[j] - lo]
            v = R.iord((R.ord(old) + k) & R.mask)
            if op == 0:
                v ^= old
        elif h < 2:
            v = h
        else:
            rest = h - 1 - _top(h)
            v = (1 << (h - 1)) | (tops[j] << rest) | r.bits(rest)
        if op == 0 and v == 0:
            raise FormatError("zero XOR value")
        vals.append(v)
    r.finish()
    return np.asarray(pos, dtype=np.int64), np.asarray(vals, dtype=f"<u{width}")
