"""``refit.coding`` (``sender/coding_choice.py``): the chooser's model on synthetic rates,
each case with the change of input that flips it; every candidate's chunks decode bit for
bit; and ``auto`` end to end on two trainer ranks (``coding_auto_worker.py``)."""
import json
import os

import numpy as np
import pytest

from nemo_dcr.codec import Coding, DeltaOp, TensorDelta, bucket, decode_chunk, read_chunk_index
from nemo_dcr.errors import ValidationError
from nemo_dcr.sender.coding_choice import (
    AUTO_START,
    CODING_SETTINGS,
    CODINGS,
    CodingChooser,
    ProbeResult,
    VersionObservation,
    describe,
    encode_parallelism,
    encode_with,
    latency_share,
    probe,
)

MB = 1_000_000
RAW = 40 * MB  # raw record bytes of a version, over 2 ranks

# relative speeds and sizes as the probe would measure them (per core, raw bytes per second)
PROBE = {
    "context": ProbeResult(raw_bytes=4 * MB, wire_bytes=int(1.2 * MB), encode_cpu_s=4 / 100, decode_cpu_s=4 / 100),
    "plain": ProbeResult(raw_bytes=4 * MB, wire_bytes=int(1.7 * MB), encode_cpu_s=4 / 250, decode_cpu_s=4 / 300),
    "fast": ProbeResult(raw_bytes=4 * MB, wire_bytes=int(2.4 * MB), encode_cpu_s=4 / 150, decode_cpu_s=4 / 1000),
}


def _chooser(link_mbps: float, rx_decode_s: float | None, coding: str = "context",
             puts: tuple = ()) -> CodingChooser:
    """A chooser that has probed (PROBE) and seen one version coded ``coding`` at exactly the
    probe's rates over a link of ``link_mbps`` MB/s, the receiver decoding it in ``rx_decode_s``."""
    ch = CodingChooser(encode_parallel=2)
    ch.record_probe(PROBE)
    p = PROBE[coding]
    wire = int(RAW * p.ratio)
    ch.observe(VersionObservation(coding=coding, raw_bytes=RAW, raw_bytes_max_rank=RAW // 2, wire_bytes=wire,
                                  encode_cpu_s=RAW / p.encode_rate, upload_wall_s=wire / (link_mbps * MB), chunks=10,
                                  puts=puts, rx_decode_s=rx_decode_s, rx_download_s=wire / (link_mbps * MB)))
    return ch


def test_a_slow_link_picks_the_smallest_bytes_and_a_fast_one_does_not():
    choice, proj = _chooser(link_mbps=6.25, rx_decode_s=0.2).choose("context")  # 50 Mbit/s
    assert choice == "context", describe(choice, proj)
    assert proj["context"].upload_s == pytest.approx(12 / 6.25, rel=0.01)  # 12 MB at 6.25 MB/s
    assert proj["context"].wall_s < proj["plain"].wall_s < proj["fast"].wall_s
    # flip: the same rates over a 1000 MB/s link; the bytes no longer matter, the CPU stages do
    choice, proj = _chooser(link_mbps=1000, rx_decode_s=0.2).choose("context")
    assert choice != "context", describe(choice, proj)  # plain and fast are within 2% here
    assert proj["context"].upload_s < 0.02 < proj["context"].decode_s


def test_a_fast_link_with_slow_receiver_decode_picks_fast_and_fast_decode_flips_it():
    # the receiver decodes context at 10 MB/s (4 s for the version): fast's decode is 10x quicker
    choice, proj = _chooser(link_mbps=1000, rx_decode_s=4.0).choose("context")
    assert choice == "fast", describe(choice, proj)
    assert proj["fast"].decode_s == pytest.approx(proj["context"].decode_s / 10, rel=0.01)
    # flip: a receiver decoding 50x faster leaves encode as the bottleneck, where plain is quickest
    choice, proj = _chooser(link_mbps=1000, rx_decode_s=0.08).choose("context")
    assert choice == "plain", describe(choice, proj)


def test_the_slow_link_beats_slow_decode_when_bytes_dominate():
    # slow receivers favour fast, but at 1 MB/s fast's bytes take longer than context's decode
    choice, proj = _chooser(link_mbps=1, rx_decode_s=4.0).choose("context")
    assert choice == "context", describe(choice, proj)
    choice, _ = _chooser(link_mbps=20, rx_decode_s=4.0).choose("context")  # control: a faster link
    assert choice == "fast"


def test_the_coding_in_use_is_kept_within_the_margin():
    ch = _chooser(link_mbps=1000, rx_decode_s=0.08)
    ch.margin = 0.7  # keep the coding in use unless another is projected 1.7x as fast
    _, proj = ch.choose("context")
    assert 1 < proj["fast"].wall_s / proj["plain"].wall_s < 1.7 < proj["context"].wall_s / proj["plain"].wall_s
    assert ch.choose("fast")[0] == "fast"  # within the margin of the best (plain): kept
    assert ch.choose("context")[0] == "plain"  # control: context is outside it, so it switches
    ch.margin = 0.0
    assert ch.choose("fast")[0] == "plain"


def test_nothing_is_chosen_before_a_measurement():
    ch = CodingChooser(encode_parallel=1)
    assert ch.needs_probe and ch.choose(AUTO_START) == (AUTO_START, {})
    ch.record_probe(PROBE)
    assert ch.choose("plain") == ("plain", {})  # probed, but no version observed yet
    ch.observe(VersionObservation(coding="plain", raw_bytes=0, raw_bytes_max_rank=0, wire_bytes=0, encode_cpu_s=0,
                                  upload_wall_s=0, chunks=0))  # a version without changes says nothing
    assert ch.choose("plain") == ("plain", {})
    assert describe("plain", {}) == "coding plain (not measured yet)"
    line = describe(*_chooser(link_mbps=6.25, rx_decode_s=0.2).choose("context"))
    assert line.startswith("coding context: projected context 2.5") and "(receivers: download 1.920 + decode " in line


def test_real_versions_rescale_the_probe_for_every_coding():
    ch = _chooser(link_mbps=1000, rx_decode_s=0.08)
    before = {c: ch.project(c) for c in CODINGS}
    ch.alpha = 1.0  # the newest version only
    p = PROBE["context"]
    wire = int(RAW * p.ratio * 1.5)  # the real chunks are 1.5x the probe's size ratio, encode 2x slower
    ch.observe(VersionObservation(coding="context", raw_bytes=RAW, raw_bytes_max_rank=RAW // 2, wire_bytes=wire,
                                  encode_cpu_s=2 * RAW / p.encode_rate, upload_wall_s=wire / (1000 * MB), chunks=10,
                                  rx_decode_s=0.08, rx_download_s=wire / (1000 * MB)))
    for c in CODINGS:
        assert ch.project(c).encode_s == pytest.approx(2 * before[c].encode_s, rel=1e-6)
        assert ch.project(c).upload_s == pytest.approx(1.5 * before[c].upload_s, rel=1e-3)


def test_missing_receiver_times_leave_their_terms_out():
    ch = _chooser(link_mbps=6.25, rx_decode_s=None)
    assert ch.rx_scale is None and all(ch.project(c).decode_s == 0 for c in CODINGS)
    assert ch.choose("context")[0] == "context"


def test_bad_chooser_inputs_are_refused():
    with pytest.raises(ValidationError, match="candidates"):
        CodingChooser(encode_parallel=1, candidates=("context", "lz4"))
    with pytest.raises(ValidationError, match="encode_parallel"):
        CodingChooser(encode_parallel=0)
    with pytest.raises(ValidationError, match="probe lacks"):
        CodingChooser(encode_parallel=1).record_probe({"context": PROBE["context"]})
    assert encode_parallelism(upload_workers=8, local_ranks=10**6) == 1
    assert CODING_SETTINGS == ("auto", *CODINGS) and AUTO_START in CODINGS


def _sample(seed: int = 0):
    rng = np.random.default_rng(seed)
    n = 1 << 16
    base = (rng.standard_normal(n).astype(np.float32) * 0.02).view(np.uint32) >> 16
    base = base.astype(np.uint16)
    pos = np.sort(rng.choice(n, n // 30, replace=False)).astype(np.int64)
    xor = rng.integers(1, 8, pos.size).astype(np.uint16)
    d = TensorDelta(name="w", dtype="bfloat16", shape=(n,), op=DeltaOp.XOR, positions=pos, values=xor,
                    element_range=(int(pos[0]), int(pos[-1]) + 1))
    return d, base


@pytest.mark.parametrize("name", list(CODINGS))
def test_every_coding_decodes_to_the_same_bits(name):
    d, base = _sample()
    blob = encode_with(name, [d], meta={"k": "v"}, base={"w": base})
    infos = read_chunk_index(blob).records
    assert all(i.context == CODINGS[name].uses_base for i in infos)
    if CODINGS[name].codings is not None:
        assert {i.coding for i in infos} <= CODINGS[name].codings | {Coding.SPARSE_RAW, Coding.DENSE_RAW}
    got = base.copy()
    (out,) = decode_chunk(blob, base={"w": base}).deltas
    got[out.positions] ^= out.values
    want = base.copy()
    want[d.positions] ^= d.values
    assert got.dtype == want.dtype and np.array_equal(got, want)
    want[d.positions[0]] ^= 1  # negative control: one bit off is seen
    assert not np.array_equal(got, want)


def test_fast_is_zstd_and_plain_is_the_default_coder():
    d, base = _sample(1)
    fast = {i.coding for i in read_chunk_index(encode_with("fast", [d], meta=None, base={"w": base})).records}
    plain = {i.coding for i in read_chunk_index(encode_with("plain", [d], meta=None, base={"w": base})).records}
    assert fast == {Coding.SPARSE_ZSTD}
    if bucket.available():
        assert Coding.SPARSE_ZSTD not in plain


def test_the_probe_measures_every_candidate():
    d, base = _sample(2)
    got = probe([d], {"w": base})
    assert sorted(got) == sorted(CODINGS)
    assert all(r.raw_bytes == d.nnz * 10 and 0 < r.wire_bytes and r.encode_cpu_s >= 0 for r in got.values())
    assert got["fast"].wire_bytes != got["context"].wire_bytes  # control: they are different codings


@pytest.mark.spawns
def test_auto_on_two_ranks_is_bit_exact_and_the_ranks_agree(tmp_path):
    from ._launch import torchrun

    here = os.path.dirname(__file__)
    torchrun(os.path.join(here, "coding_auto_worker.py"), 2, str(tmp_path), str(tmp_path / "store"))
    r0, r1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1))
    want = ["context", "fast", "plain", "context", "fast", "plain"]  # the start, then the worker's cycle
    assert [s[2] for s in r0["settled"]] == want
    # every rank coded every version the same way and learnt the same next coding
    assert [s[:4] for s in r1["settled"]] == [s[:4] for s in r0["settled"]]
    assert [s[3] for s in r0["settled"][:-1]] == want[1:]
    assert all(s[1] for s in r0["settled"])  # all committed
    assert all(s[4] == sorted(CODINGS) for s in r0["settled"])  # rank 0 projected every candidate
    assert all(s[4] == [] for s in r1["settled"])  # (projections live on rank 0)
    assert r0["received"] == [1, 2, 3, 4, 5, 6]
    assert r0["bit_exact"] and r0["negative_control_detected"] and r0["changed_vs_v0"] > 0
    chunks = {int(v): c for v, c in r0["chunks"].items()}
    for v, coding in enumerate(want, 1):
        assert chunks[v]["context"] == (coding == "context"), (v, coding, chunks[v])
        if coding == "fast":
            assert "SPARSE_ZSTD" in chunks[v]["codings"] and not {"BUCKET", "MODEL"} & set(chunks[v]["codings"])
        elif bucket.available():
            assert "SPARSE_ZSTD" not in chunks[v]["codings"]


def test_put_time_splits_into_per_request_and_per_byte():
    sizes = np.random.default_rng(0).integers(100_000, 500_000, 40)
    puts = [(int(w), 0.02 + w / 100e6) for w in sizes]  # 20 ms per request, then 100 MB/s
    assert latency_share(puts) == pytest.approx(40 * 0.02 / sum(t for _, t in puts), rel=1e-6)
    assert latency_share(puts[:3]) == 0  # too few to fit
    assert latency_share([(300_000, 0.05)] * 10) == 0  # sizes alike: the parts cannot be told apart
    assert latency_share([(int(w), 0.05) for w in sizes]) == pytest.approx(1)  # size does not matter: per request


def test_a_latency_bound_store_does_not_charge_bigger_codings_as_bandwidth():
    sizes = np.linspace(0.5, 1.5, 10) * 1.2 * MB  # the context version's 10 chunks, about 12 MB
    per_request = tuple((int(w), 0.05) for w in sizes)  # every put 50 ms whatever its size
    _, proj = _chooser(link_mbps=24, rx_decode_s=0.2, puts=per_request).choose("context")
    assert proj["fast"].upload_s == pytest.approx(proj["context"].upload_s)
    assert proj["fast"].download_s == pytest.approx(proj["context"].download_s)
    # control: puts that take time per byte charge fast's 2x bytes 2x the time
    per_byte = tuple((int(w), w / (24 * MB)) for w in sizes)
    _, proj = _chooser(link_mbps=24, rx_decode_s=0.2, puts=per_byte).choose("context")
    assert proj["fast"].upload_s == pytest.approx(2 * proj["context"].upload_s, rel=0.01)


def _observe(ch: CodingChooser, coding: str, *, wall_s: float | None) -> None:
    """One more version coded ``coding`` at the probe's rates over a 1000 MB/s link, its refit
    having measured ``wall_s``."""
    p = PROBE[coding]
    wire = int(RAW * p.ratio)
    ch.observe(VersionObservation(coding=coding, raw_bytes=RAW, raw_bytes_max_rank=RAW // 2, wire_bytes=wire,
                                  encode_cpu_s=RAW / p.encode_rate, upload_wall_s=wire / (1000 * MB), chunks=10,
                                  rx_decode_s=RAW / p.decode_rate / 2, rx_download_s=wire / (1000 * MB),
                                  wall_s=wall_s))


def test_measured_walls_correct_the_model_per_coding():
    # a slow link makes context the model's pick; its measured walls then run 3x the model's
    # (stages sharing cores add): the untried codings, still at the model's word, get tried
    ch = _chooser(link_mbps=6.25, rx_decode_s=0.2)
    ch.alpha = 1.0
    modelled = ch.project("context").model_wall_s
    assert ch.choose("context")[0] == "context"
    ch.observe(VersionObservation(**{**ch.last.__dict__, "wall_s": 3 * modelled}))
    choice, proj = ch.choose("context")
    assert proj["context"].corr == pytest.approx(3.0) and proj["context"].wall_s == pytest.approx(3 * modelled)
    assert choice != "context" and proj[choice].corr == 1.0, describe(choice, proj)
    assert "measured x3.00" in describe(choice, proj)
    # once tried, a coding is compared at its own measured correction: the one tried measured
    # 4x its model, which puts it behind context's 3x, and it is left
    ch.observe(VersionObservation(**{**ch.last.__dict__, "coding": choice,
                                     "wall_s": 4 * ch.project(choice).model_wall_s}))
    assert ch.wall_corr[choice] == pytest.approx(4.0, rel=0.2)
    again, proj = ch.choose(choice)
    assert again != choice and proj[choice].wall_s > proj["context"].wall_s, describe(again, proj)
    # control: measured walls matching the model change nothing
    ch2 = _chooser(link_mbps=6.25, rx_decode_s=0.2)
    ch2.observe(VersionObservation(**{**ch2.last.__dict__, "wall_s": ch2.project("context").model_wall_s}))
    assert ch2.wall_corr["context"] == pytest.approx(1.0) and ch2.choose("context")[0] == "context"


def test_a_coding_the_receivers_decoded_is_projected_at_its_own_rate():
    """The probe's sample can rank decode speeds unlike the receivers: here it rates context's
    decode 8x slower than plain's, while the receiver decodes context as fast as plain.  Once
    context has been decoded, plain's slower receiver does not drag context's projection;
    a coding never decoded still follows the transfer from the codings in use (control: fast)."""
    probe = {**PROBE, "context": ProbeResult(raw_bytes=PROBE["context"].raw_bytes,
                                             wire_bytes=PROBE["context"].wire_bytes,
                                             encode_cpu_s=PROBE["context"].encode_cpu_s,
                                             decode_cpu_s=8 * PROBE["plain"].decode_cpu_s)}
    ch = CodingChooser(encode_parallel=2)
    ch.record_probe(probe)
    wire = int(RAW * probe["context"].ratio)
    rx_fast = RAW / probe["plain"].decode_rate  # the receiver: context as fast as the probe's plain
    ch.observe(VersionObservation(coding="context", raw_bytes=RAW, raw_bytes_max_rank=RAW // 2, wire_bytes=wire,
                                  encode_cpu_s=RAW / probe["context"].encode_rate, upload_wall_s=wire / (6.25 * MB),
                                  chunks=10, rx_decode_s=rx_fast, rx_download_s=wire / (6.25 * MB)))
    before = ch.project("context").decode_s
    assert before == pytest.approx(rx_fast, rel=1e-6)
    pw = int(RAW * probe["plain"].ratio)
    for _ in range(3):  # plain's receiver runs 3x slower than the probe's plain
        ch.observe(VersionObservation(coding="plain", raw_bytes=RAW, raw_bytes_max_rank=RAW // 2, wire_bytes=pw,
                                      encode_cpu_s=RAW / probe["plain"].encode_rate, upload_wall_s=pw / (6.25 * MB),
                                      chunks=10, rx_decode_s=3 * RAW / probe["plain"].decode_rate,
                                      rx_download_s=pw / (6.25 * MB)))
    assert ch.project("context").decode_s == pytest.approx(before, rel=1e-6)
    assert ch.project("fast").decode_s == pytest.approx(RAW / (probe["fast"].decode_rate * ch.rx_scale), rel=1e-6)
    assert ch.rx_scale < ch.rx_scale_of["context"] / 4  # the transfer moved; context's own rate did not


def test_the_first_version_observed_corrects_nothing():
    """Its wall carries one-off costs (a cold start): folded in, it would keep a coding that
    is fast later from ever being tried again.  Control: the second version corrects."""
    ch = CodingChooser(encode_parallel=2)
    ch.record_probe(PROBE)
    _observe(ch, "context", wall_s=1e6)
    assert ch.wall_corr == {} and ch.last is not None
    _observe(ch, "context", wall_s=1e6)
    assert ch.wall_corr["context"] == ch.corr_bounds[1]


def test_the_correction_is_clamped_and_ignores_versions_without_a_wall():
    ch = _chooser(link_mbps=1000, rx_decode_s=0.08)
    _observe(ch, "plain", wall_s=None)
    assert ch.wall_corr == {}
    _observe(ch, "plain", wall_s=1e6)
    assert ch.wall_corr["plain"] == ch.corr_bounds[1]
    _observe(ch, "fast", wall_s=1e-9)
    assert ch.wall_corr["fast"] == ch.corr_bounds[0]
