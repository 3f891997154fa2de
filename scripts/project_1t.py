"""Project the wall time of one refit of a 1T-parameter MoE model from stage rates measured here.

A model, not a measurement.  It takes per-core / per-GPU stage rates from the benchmark
results on disk (read at run time, so re-running after new measurements updates it), the
deployment's sizes and link bandwidths from the command line, and computes each stage's
time for two transports:

  s3     object storage: the trainer ranks upload chunks; every receiver replica downloads
         all of them (the store's egress is unlimited unless --s3-egress-gbps caps it)
  relay  a relay tree: the trainer uploads once to the root replica; every replica forwards
         what it receives to ``--fanout`` children (``nemo-dcr relay``, docs/relay.md).  The
         relay rows use the relay's per-hop rates measured by scripts/bench_relay_link.py
         (benchmarks/results/relay_link.json, "hops"): the link's goodput as a share of its
         nominal rate, a relay's forwarding goodput, and the fixed delay a relay hop adds.

Sizes (GB = 1e9 bytes): D = params x elem_bytes parameter bytes, N = changed x params
changed elements, W = b x N wire bytes (b: bytes per changed element of the format).

Stage times (each the time for the whole refit at that stage's aggregate rate):

  diff          D / (G x r_diff_gpu)                 G trainer GPUs (each diffs 1/G)
  d2h           N x (8 + elem_bytes) / (G x r_d2h)   the diff's positions + values to host
  encode        D / (C_t x r_enc)                    C_t trainer cores
  (diff on CPU: one stage "diff + encode" = D / C_t x (1/r_diff_cpu + 1/r_enc); no d2h)
  s3:    upload    W / (e x B_up)                    B_up: trainer uplink, aggregate
         download  W / (e x min(n_r x B_down, B_s3 / R))  per replica, all replicas at once
  relay: upload    W / (e x min(B_up, n_r x B_down)) trainer -> root replica
         hop i     W f / min(e x n_r x B_down,       a replica's uplink (n_r x B_down, full
                         n_r x r_relay)              duplex) or its n_r relays' forwarding
                                                     rate, split over its f children;
                                                     L - 1 hops for L tree levels
         relay latency  L x d_hop                    every level's relay adds its fixed delay
                                                     once (added to the wall, not pipelined)
  decode + apply  D / C_r x (1/r_dec + 1/r_apply)    C_r cores per replica do both, so
                                                     their times add

Stages on different resources overlap: chunks stream through them (the sender cuts
chunks of --chunk-bytes raw records, 10 bytes per changed BF16 element).  With m chunks
per emitting rank, one "wave" (one chunk per rank) takes T_s / m at stage s, and

  wall = max_s T_s + (sum_s T_s - max_s T_s) / m + latency,
  m = max(1, N (8 + w) / (G x chunk_bytes))

i.e. the slowest stage plus the time the first wave needs to reach it and the last wave
to leave the others (fill latency).  The slowest stage is named as dominating.

Rates and where they come from (each printed with its source; any can be overridden):

  b, r_enc, r_dec  benchmarks/results/codec.json, the row whose change rate is nearest
                   --changed, format --format (default nemo_dcr context mode)
  r_diff_cpu       benchmarks/results/bench_xor.json, "C xor_diff, 1 thr", nearest rate,
                   median
  r_diff_gpu, r_d2h  benchmarks/results/bench_xor_gpu.json if present (largest size,
                   nearest rate, best tile; d2h = diff output bytes / to_host_s); else
                   ASSUMPTIONS: H200 HBM 4.8 TB/s x 70% / 4 (two passes each read both
                   tensors) and PCIe Gen5 x16 at 50 GB/s
  r_apply          benchmarks/results/vllm_apply.json (TP=1: checkpoint bytes / median
                   apply, divided by the VM's cores), else refit.json (transformers
                   receiver), else an ASSUMPTION
  e, r_relay, d_hop  benchmarks/results/relay_link.json "hops" (the hop probe of
                   scripts/bench_relay_link.py): e = the shaped link's measured goodput /
                   its nominal rate (median over the rates; it scales every link stage,
                   the store's too: it was measured through the S3 client), r_relay = one relay hop's
                   goodput for a chunk-sized object on the unshaped far-side network (one
                   stream, one relay process on the VM), d_hop = the delay one relay hop
                   adds to a small object.  Without the file: e = 1, no relay cap, no delay
                   (link arithmetic only), each labelled an ASSUMPTION

Ignored: request latency and per-object limits of the store, TCP ramp-up, the commit
round trip (manifest, acks, decision), memory pressure, stragglers, and skew between
ranks (every rank is assumed to hold 1/G of the changed elements).

Published figures it compares with (not measured here): the NeMo-DCR paper's headline,
a 3% delta of a 1T model in ~150 s over a relay tree; NeMo-RL's 20.2 s for 247 GB at 3%
changed over S3 (read as a 247 GB BF16 checkpoint, i.e. 123.5 B parameters).

    .venv/bin/python scripts/project_1t.py                  # defaults below
    .venv/bin/python scripts/project_1t.py --trainer-uplink-gbps 0.381   # cross-region link

Writes benchmarks/results/project_1t.json and project_1t.png.
"""
from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import sys
from dataclasses import asdict, dataclass, field, fields, replace

RESULTS = pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / "results"
HBM_TBPS = 4.8  # H200 HBM3e peak
HBM_EFFICIENCY = 0.70  # the GPU diff kernel's target share of peak (docs/benchmarks.md)
GPU_DIFF_READS = 4  # bytes moved per parameter byte: count pass and fill pass each read both tensors
PCIE_GBPS = 50.0  # PCIe Gen5 x16 device-to-host, pinned, per GPU (64 GB/s theoretical)
APPLY_FALLBACK_GBPS = 0.5  # per core, when no apply measurement is on disk
PAPER_1T_S = 150.0  # NeMo-DCR paper: 3% delta of 1T over a relay tree
NEMORL_S, NEMORL_BYTES = 20.2, 247e9  # NeMo-RL: 247 GB at 3% over S3
DCR_KEYS = {"nemo_dcr": "dcr_free", "nemo_dcr context": "dcr_context"}  # codec.json flat-key prefixes


MODEL_FIXES = {
    "fixed": (
        "Terms added after the check against scale_tree.json (issue 33); the model once priced a refit by its "
        "bytes alone.  It now adds (1) the fixed cost of every version (manifest, polls, acks, decision: the "
        "intercept of scale_tensors.json's fitted line), (2) per-tensor costs on the trainer and on each replica "
        "(its slopes; --tensors), and (3) for a one-machine measurement, CPU stages that share the machine's "
        "cores (--shared-cores) instead of overlapping.  Without them (each process on cores of its own, "
        "no per-version or per-tensor cost) the model projected 0.11 / 0.08 of the measured wall for the relay "
        "cases at 50 / 200 Mbit/s and 0.60 / 0.28 for the store cases; with them 0.73 / 0.80 and 0.67 / 0.45."),
    "left_out": (
        "What the model still leaves out, from the measurement's own timeline (scale_tree.json, seconds after "
        "the step): the store's and the relays' own work per request.  With 16 receivers polling one "
        "single-process store (moto, on the same two cores), the decision came 1.19 s after the last receiver's "
        "ack at 200 Mbit/s, against 0.32 s through the relay tree, which absorbs the polls; the model has no "
        "per-request cost and treats the store as free.  At 1T the store is a scaled-out service and the "
        "relays have their own nodes, so this term is a property of the one-VM test bed more than of the "
        "projection; the 1T rows keep the three fixes above."),
}


class InputError(ValueError):
    """A result file the projection needs is missing or lacks what it needs."""


@dataclass(kw_only=True, frozen=True)
class Deployment:
    """The refit being projected (CLI: --<field-name-with-dashes>)."""
    params: float = 1e12
    """Parameters of the model (all experts)."""
    changed: float = 0.03
    """Fraction of parameters whose bits change in one refit."""
    elem_bytes: int = 2
    """Bytes per parameter (BF16)."""
    trainer_gpus: int = 256
    """GPUs that diff the unique parameters, 1/G each (e.g. 32 nodes x 8; if data-parallel
    replicas do not split the work, the model-parallel size)."""
    diff_on: str = "gpu"
    """Where the diff runs: "gpu" (Triton kernel, then device-to-host copy) or "cpu"."""
    trainer_cores: int = 2048
    """Trainer CPU cores given to encoding (and to the diff when diff_on=cpu): 32 nodes x 64."""
    receivers: int = 16
    """Receiver (rollout) replicas; each must end with every changed bit."""
    receiver_nodes: int = 4
    """Nodes per receiver replica (a 2 TB BF16 model needs more than 2 H200 nodes)."""
    receiver_cores: int = 256
    """CPU cores per replica that decode and apply (4 nodes x 64)."""
    trainer_uplink_gbps: float = 12.5
    """Trainer's aggregate outbound bandwidth, GB/s (12.5 = one 100 Gb/s path)."""
    receiver_downlink_gbps: float = 12.5
    """Per receiver node, GB/s (100 Gb/s NIC); links are full duplex, uplink the same."""
    s3_egress_gbps: float = 0.0
    """Object store's aggregate egress cap, GB/s; 0 = unlimited (the store scales out)."""
    fanout: int = 4
    """Children per relay-tree node."""
    chunk_bytes: int = 4 << 20
    """Raw record bytes per chunk (RefitOptions.chunk_bytes): sets the pipeline depth."""
    format: str = "nemo_dcr context"
    """Codec format whose bytes and speeds are used (a format name in codec.json)."""
    tensors: int = 70_000
    """Canonical (Hugging Face) tensors of the model: each costs the per-tensor times of
    scale_tensors.json on the trainer (split over its GPUs' ranks) and on every replica
    (split over its nodes).  Kimi-K2 (1T): about 70 k; Qwen3-235B-A22B: about 36 k."""
    fanouts: str = ""
    """Relay tree shape per level from the root, e.g. "2,2,4" (overrides --fanout): hop i
    sends to fanouts[i-1] children; the last level's children are the receivers."""
    shared_cores: int = 0
    """All processes on ONE machine with this many cores (the measured check of a one-VM
    benchmark): the CPU stages of the trainer, the relays and every replica compete for
    them, so their work adds up instead of running on separate cores.  0: separate machines."""

    def __post_init__(self) -> None:
        if not (self.params > 0 and 0 < self.changed <= 1 and self.elem_bytes > 0):
            raise ValueError("params > 0, 0 < changed <= 1 and elem_bytes > 0 are needed")
        if min(self.trainer_gpus, self.trainer_cores, self.receivers, self.receiver_nodes,
               self.receiver_cores, self.fanout, self.chunk_bytes) < 1:
            raise ValueError("counts (GPUs, cores, receivers, nodes, fanout, chunk_bytes) must be >= 1")
        if min(self.trainer_uplink_gbps, self.receiver_downlink_gbps) <= 0 or self.s3_egress_gbps < 0:
            raise ValueError("link bandwidths must be positive (s3_egress_gbps: 0 = unlimited)")
        if self.diff_on not in ("gpu", "cpu"):
            raise ValueError(f"diff_on must be gpu or cpu, not {self.diff_on!r}")
        if self.tensors < 0 or self.shared_cores < 0:
            raise ValueError("tensors and shared_cores must be >= 0")
        self.tree_fanouts()  # checked

    def tree_fanouts(self) -> tuple[int, ...] | None:
        """``fanouts`` parsed (None: a complete tree of ``fanout``)."""
        if not self.fanouts:
            return None
        try:
            out = tuple(int(x) for x in self.fanouts.split(","))
        except ValueError:
            raise ValueError(f"fanouts must be comma-separated ints, got {self.fanouts!r}") from None
        if not out or min(out) < 1:
            raise ValueError(f"fanouts must be >= 1 each, got {self.fanouts!r}")
        return out


@dataclass(frozen=True)
class Rate:
    value: float
    source: str
    assumed: bool = False


@dataclass(frozen=True)
class Rates:
    """Stage rates: GB/s of parameter bytes per core (encode, decode, diff_cpu, apply) or
    per GPU (diff_gpu, d2h: GB/s of the diff output), and the format's bytes per change."""
    bytes_per_changed: Rate
    encode: Rate
    decode: Rate
    diff_cpu: Rate
    diff_gpu: Rate
    d2h: Rate
    apply: Rate
    link_efficiency: Rate
    """Measured goodput / nominal rate of the inter-cluster link (relay rows)."""
    relay_hop: Rate
    """GB/s one relay process forwards (0: no cap, link arithmetic only)."""
    relay_latency: Rate
    """Seconds one relay hop adds to an object, whatever its size."""
    per_tensor_trainer: Rate
    """Seconds per canonical tensor per trainer rank and version (diff, projection, encode)."""
    per_tensor_receiver: Rate
    """Seconds per canonical tensor per receiver process and version (fetch, decode, apply)."""
    version_overhead: Rate
    """Seconds every version costs whatever its size: manifest, polls, acks, decision."""


@dataclass(frozen=True)
class Stage:
    name: str
    seconds: float
    equation: str
    parts: dict[str, float] = field(default_factory=dict)
    """Seconds of the pieces that share this stage's resource (their sum is ``seconds``)."""


@dataclass(frozen=True)
class Projection:
    transport: str
    stages: list[Stage]
    wall_s: float
    fill_s: float
    dominating: str
    wire_bytes: float
    waves: float
    tree_levels: int | None = None
    latency_s: float = 0.0
    """Fixed delays added to the pipelined wall (the relay levels' per-hop delay)."""


# ---- rates from the result files -----------------------------------------------------------------

def _load(path: pathlib.Path) -> dict | None:
    return json.loads(path.read_text()) if path.is_file() else None


def codec_rates(codec: dict, fmt: str, changed: float) -> tuple[Rate, Rate, Rate, list[str]]:
    rows = codec.get("rows") or []
    if not rows:
        raise InputError("codec.json has no rows: run scripts/bench_codec.py")
    row = min(rows, key=lambda r: abs(r["changed_pct"] - 100 * changed))
    where = f"codec.json {row['pair']} ({row['changed_pct']:.2f}% changed), {fmt}"
    if "formats" in row:
        if fmt not in row["formats"]:
            raise InputError(f"codec.json has no format {fmt!r} (has {sorted(row['formats'])})")
        f = row["formats"][fmt]
        b, enc, dec = f["bytes_per_changed"], f["encode_gbps"], f["decode_gbps"]
        names = list(row["formats"])
    else:  # the older layout: flat keys only, speeds only for nemo_dcr
        key = DCR_KEYS.get(fmt, fmt)
        try:
            b, enc, dec = row[f"{key}_bytes"] / row["changed"], row[f"{key}_encode_gbps"], row[f"{key}_decode_gbps"]
        except KeyError as e:
            raise InputError(f"codec.json lacks {e} for {fmt!r}: re-run scripts/bench_codec.py") from None
        names = [fmt]
    return (Rate(b, where), Rate(enc, where + ", encode, 1 core"), Rate(dec, where + ", decode, 1 core"), names)


def _nearest(rows: list[dict], changed: float) -> list[dict]:
    best = min(abs(r["rate"] - changed) for r in rows)
    return [r for r in rows if abs(r["rate"] - changed) == best]


def diff_cpu_rate(xor: dict | None, changed: float) -> Rate:
    rows = [r for r in (xor or {}).get("rows", []) if r.get("method") == "C xor_diff, 1 thr"]
    if not rows:
        raise InputError("bench_xor.json with 'C xor_diff, 1 thr' rows is needed: run scripts/bench_xor.py")
    r = _nearest(rows, changed)[0]
    return Rate(r["median_gbps"], f"bench_xor.json C xor_diff, 1 thr, {100 * r['rate']:g}% changed, median")


def gpu_rates(gpu: dict | None, changed: float) -> tuple[Rate, Rate]:
    """Diff: the fastest row (any tile or implementation) at the largest size and the nearest
    change rate.  Device to host: the diff output's bytes / to_host_s where a row has it."""
    rows = (gpu or {}).get("rows", [])
    device = (gpu or {}).get("meta", {}).get("device", "?")
    pcie = Rate(PCIE_GBPS, f"ASSUMPTION: PCIe Gen5 x16 device-to-host {PCIE_GBPS:g} GB/s per GPU", assumed=True)
    if not rows:
        hbm = HBM_TBPS * 1e3 * HBM_EFFICIENCY / GPU_DIFF_READS
        return (Rate(hbm, f"ASSUMPTION (no bench_xor_gpu.json): H200 HBM {HBM_TBPS} TB/s x {HBM_EFFICIENCY:.0%} / "
                          f"{GPU_DIFF_READS} bytes read per parameter byte (two-pass kernel), baseline on the GPU",
                     assumed=True), pcie)
    big = max(r["gib"] for r in rows)
    r = max(_nearest([r for r in rows if r["gib"] == big], changed), key=lambda r: r["param_gbps"])
    diff = Rate(r["param_gbps"], f"bench_xor_gpu.json {device}, {big:g} GiB, {100 * r['rate']:g}% changed, "
                                 f"tile {r['tile']}" + (f", {r['impl']}" if r.get("impl") else ""))
    timed = [r for r in rows if r.get("to_host_s") and r.get("changed")]
    if not timed:
        return diff, pcie
    h = max(_nearest(timed, changed), key=lambda r: r["changed"])
    return diff, Rate(h["changed"] * 10 / h["to_host_s"] / 1e9,
                      f"bench_xor_gpu.json {device}, to_host of {h['changed']} changed elements "
                      f"({h['gib']:g} GiB, {100 * h['rate']:g}%)")


def apply_rate(vllm: dict | None, refit: dict | None) -> Rate:
    runs = [r for r in (vllm or {}).get("runs", []) if r.get("tp") == 1 and r.get("apply_s_median")]
    if runs:
        cores = 2  # the VM these were measured on; the engine's threads could use both
        gbps = vllm["checkpoint_bytes"] / runs[0]["apply_s_median"] / 1e9 / cores
        return Rate(gbps, f"vllm_apply.json TP=1 (CPU vLLM, {vllm.get('changed_pct', '?')}% changed, repack "
                          f"included): checkpoint bytes / median apply / {cores} cores")
    samples = []
    for run in (refit or {}).get("runs", []):
        for st in run.get("steps", []):
            for ack in st.get("acks", []):
                a = ack.get("stats", {}).get("apply_s")
                if a:
                    samples.append(st["canonical_numel"] * 2 / a / 1e9)
    if samples:
        return Rate(statistics.median(samples) / 2, "refit.json transformers receiver: canonical bytes / apply_s, "
                                                    "median over refits / 2 cores")
    return Rate(APPLY_FALLBACK_GBPS, f"ASSUMPTION (no apply measurement): {APPLY_FALLBACK_GBPS} GB/s per core",
                assumed=True)


def relay_rates(relay: dict | None) -> tuple[Rate, Rate, Rate]:
    """Link efficiency, relay forwarding rate and per-hop delay from relay_link.json's
    ``hops`` (scripts/bench_relay_link.py), each an ASSUMPTION when not measured."""
    hops = (relay or {}).get("hops") or {}
    where = "relay_link.json hop probe"
    if hops.get("link_efficiency"):
        rates = ", ".join(f"{x['link_mbit']:g} Mbit/s: {x['goodput_mbit']:.1f}" for x in hops.get("link", []))
        eff = Rate(hops["link_efficiency"], f"{where}: S3 GET goodput / nominal link rate, median ({rates})")
    else:
        eff = Rate(1.0, "ASSUMPTION (no relay_link.json): links run at their nominal rate", assumed=True)
    n = hops.get("relay_hop_samples", "?")
    if hops.get("relay_hop_goodput_gbps"):
        size = hops.get("probe_chunk_bytes", 0) / 2 ** 20
        fwd = Rate(hops["relay_hop_goodput_gbps"],
                   f"{where}: one relay hop's goodput for a {size:g} MiB object (added time minus the fixed delay; "
                   f"one stream, one relay process, unshaped far-side network of the 2-core VM; median of {n})")
    else:
        fwd = Rate(0.0, "ASSUMPTION (no relay hop goodput measured): relays forward at link speed", assumed=True)
    if hops.get("relay_hop_fixed_s") is not None:
        lat = Rate(max(hops["relay_hop_fixed_s"], 0.0),
                   f"{where}: delay one relay hop adds to a {hops.get('probe_small_bytes', 0)} B object, median of {n}")
    else:
        lat = Rate(0.0, "ASSUMPTION (no relay hop measurement): a relay hop adds no delay", assumed=True)
    return eff, fwd, lat


def scale_rates(scale: dict | None, runtime: str = "hf") -> tuple[Rate, Rate, Rate]:
    """Per-tensor costs and the fixed per-version cost from scale_tensors.json
    (scripts/bench_scale_tensors.py): the tensor sweep's per-stage slopes and the fitted
    line's intercept; each an ASSUMPTION of 0 when not measured."""
    fits = ((scale or {}).get("stage_fits") or {}).get(runtime) or {}
    line = ((scale or {}).get("fits") or {}).get(runtime) or {}
    where = f"scale_tensors.json ({runtime} runtime, qwen3_moe sweep at fixed parameters)"
    if not fits or not line:
        zero = "ASSUMPTION (no scale_tensors.json): {} costs nothing"
        return (Rate(0.0, zero.format("a tensor"), assumed=True), Rate(0.0, zero.format("a tensor"), assumed=True),
                Rate(0.0, zero.format("a version's fixed work"), assumed=True))
    ranks = 2  # the sweep's trainer ranks: rank stage times are the slowest rank's, each held 1/2 the tensors
    trainer = sum(max(fits[k]["per_tensor_us"], 0.0) for k in ("diff_s", "project_s", "encode_s")) * 1e-6 * ranks
    receiver = sum(max(fits[k]["per_tensor_us"], 0.0) for k in ("download_s", "decode_s", "apply_s")) * 1e-6
    return (Rate(trainer, f"{where}: slopes of diff + project + encode x {ranks} ranks"),
            Rate(receiver, f"{where}: slopes of download + decode + apply"),
            Rate(max(line["a_s"], 0.0), f"{where}: intercept a of wall = a + b tensors + c changed"))


def load_rates(results: pathlib.Path, dep: Deployment, overrides: dict[str, float | None]) -> tuple[Rates, list[str]]:
    codec = _load(results / "codec.json")
    if codec is None:
        raise InputError(f"no {results / 'codec.json'}: run scripts/bench_codec.py")
    b, enc, dec, formats = codec_rates(codec, dep.format, dep.changed)
    diff_gpu, d2h = gpu_rates(_load(results / "bench_xor_gpu.json"), dep.changed)
    try:
        diff_cpu = diff_cpu_rate(_load(results / "bench_xor.json"), dep.changed)
    except InputError:
        if dep.diff_on == "cpu" and overrides.get("diff_cpu") is None:
            raise
        diff_cpu = Rate(0.0, "no bench_xor.json (unused: the diff runs on the GPU)", assumed=True)
    eff, fwd, lat = relay_rates(_load(results / "relay_link.json"))
    rates = Rates(bytes_per_changed=b, encode=enc, decode=dec, diff_cpu=diff_cpu, diff_gpu=diff_gpu, d2h=d2h,
                  apply=apply_rate(_load(results / "vllm_apply.json"), _load(results / "refit.json")),
                  link_efficiency=eff, relay_hop=fwd, relay_latency=lat,
                  **dict(zip(("per_tensor_trainer", "per_tensor_receiver", "version_overhead"),
                             scale_rates(_load(results / "scale_tensors.json")))))
    for name, v in overrides.items():
        if v is not None:
            flag = RATE_FLAGS[name]
            if v < 0 or (v == 0 and name not in ("relay_latency", "per_tensor_trainer", "per_tensor_receiver",
                                                 "version_overhead")):
                raise ValueError(f"{flag} must be positive")
            if name == "link_efficiency" and v > 1:
                raise ValueError(f"{flag} must be at most 1")
            rates = replace(rates, **{name: Rate(v, f"{flag} (command line)")})
    return rates, formats


# ---- the model -----------------------------------------------------------------------------------

def tree_levels(receivers: int, fanout: int) -> int:
    """Levels of a complete fanout-ary tree holding ``receivers`` nodes (root = level 1)."""
    levels, total, width = 1, 1, 1
    while total < receivers:
        width *= fanout
        total += width
        levels += 1
    return levels


def project(dep: Deployment, r: Rates, transport: str) -> Projection:
    gb = 1e9
    D = dep.params * dep.elem_bytes
    N = dep.changed * dep.params
    W = r.bytes_per_changed.value * N
    raw = N * (8 + dep.elem_bytes)  # the diff's positions (int64) + values
    G, Ct, Cr = dep.trainer_gpus, dep.trainer_cores, dep.receiver_cores
    node_bw = dep.receiver_nodes * dep.receiver_downlink_gbps * gb  # one replica's links
    stages = []
    if dep.diff_on == "gpu":
        stages.append(Stage("diff (GPU)", D / (G * r.diff_gpu.value * gb), "D / (G r_diff_gpu)"))
        stages.append(Stage("device to host", raw / (G * r.d2h.value * gb), "N (8 + w) / (G r_d2h)"))
        stages.append(Stage("encode", D / (Ct * r.encode.value * gb), "D / (C_t r_enc)"))
    else:
        parts = {"diff": D / (Ct * r.diff_cpu.value * gb), "encode": D / (Ct * r.encode.value * gb)}
        stages.append(Stage("diff + encode (CPU)", sum(parts.values()), "D / C_t (1/r_diff_cpu + 1/r_enc)", parts))
    levels = None
    latency = 0.0
    e = r.link_efficiency.value  # measured through the store's client: it applies to every link stage
    if transport == "s3":
        stages.append(Stage("upload", W / (e * dep.trainer_uplink_gbps * gb), "W / (e B_up)"))
        down = node_bw
        eq = "W / (e n_r B_down)"
        if dep.s3_egress_gbps:
            down = min(down, dep.s3_egress_gbps * gb / dep.receivers)
            eq = "W / (e min(n_r B_down, B_s3 / R))"
        stages.append(Stage("download", W / (e * down), eq))
    elif transport == "relay":
        shape = dep.tree_fanouts()
        levels = len(shape) if shape else tree_levels(dep.receivers, dep.fanout)
        # a complete tree of replicas: L - 1 hops of `fanout` children; a given shape: relays
        # above the receivers, one hop per level (the last one to the receivers)
        hops = list(shape) if shape else [dep.fanout] * (levels - 1)
        stages.append(Stage("upload to root", W / (e * min(dep.trainer_uplink_gbps * gb, node_bw)),
                            "W / (e min(B_up, n_r B_down))"))
        out_bw, eq = e * node_bw, "W f / (e n_r B_down)"
        if r.relay_hop.value and dep.receiver_nodes * r.relay_hop.value * gb < out_bw:
            out_bw, eq = dep.receiver_nodes * r.relay_hop.value * gb, "W f / (n_r r_relay)"
        for i, f in enumerate(hops, 1):
            stages.append(Stage(f"relay hop {i}", W * f / out_bw, eq))
        latency = levels * r.relay_latency.value
    else:
        raise ValueError(f"unknown transport {transport!r}")
    T = dep.tensors
    if dep.shared_cores:
        # one machine: every CPU stage draws on the same cores, so their work adds up
        trainer_work = D * (1 / r.diff_cpu.value + 1 / r.encode.value) if dep.diff_on == "cpu" else D / r.encode.value
        work = {
            "diff + encode (trainer)": trainer_work / gb,
            f"decode + apply (x{dep.receivers})": dep.receivers * D * (1 / r.decode.value + 1 / r.apply.value) / gb,
            "per-tensor (trainer)": T * r.per_tensor_trainer.value,
            f"per-tensor (x{dep.receivers})": dep.receivers * T * r.per_tensor_receiver.value,
        }
        stages = [st for st in stages if st.name in ("upload", "download", "upload to root")
                  or st.name.startswith("relay hop")]
        stages.append(Stage(f"CPU ({dep.shared_cores} shared cores)", sum(work.values()) / dep.shared_cores,
                            "sum of every process's CPU work / C", {k: v / dep.shared_cores for k, v in work.items()}))
    else:
        parts = {"decode": D / (Cr * r.decode.value * gb), "apply": D / (Cr * r.apply.value * gb)}
        stages.append(Stage("decode + apply", sum(parts.values()), "D / C_r (1/r_dec + 1/r_apply)", parts))
        if T:
            stages.append(Stage("per-tensor (trainer)", T * r.per_tensor_trainer.value / G, "T t_trainer / G"))
            stages.append(Stage("per-tensor (receiver)", T * r.per_tensor_receiver.value / dep.receiver_nodes,
                                "T t_receiver / n_r"))
    latency += r.version_overhead.value
    waves = max(1.0, raw / (G * dep.chunk_bytes))
    slow = max(stages, key=lambda s: s.seconds)
    fill = (sum(s.seconds for s in stages) - slow.seconds) / waves
    return Projection(transport=transport, stages=stages, wall_s=slow.seconds + fill + latency, fill_s=fill,
                      dominating=slow.name, wire_bytes=W, waves=waves, tree_levels=levels, latency_s=latency)


# ---- the model against a measurement --------------------------------------------------------------

def tree_deployment(meta: dict, case: dict) -> tuple[Deployment, str]:
    """The deployment of one case of scripts/bench_relay_link.py's tree benchmark
    (scale_tree.json), as this model sees it: every process on one machine
    (``shared_cores``), the shaped link at the cluster boundary, the relays' own network
    unshaped.  Store case: the trainer's puts stay on its side, every receiver's reads share
    the link (the store's egress cap is the link).  Relay case: only the root relay's reads
    cross it (the "upload to root")."""
    model = meta["model"]
    per_layer = 11 if model.get("family") in ("qwen3", "qwen3_moe") else 9  # + q/k norms
    link_gbps = case["link_mbit"] / 8 / 1000
    far_side = 10.0  # GB/s: the namespace's own addresses; the relays' measured hop rate is the cap
    common = dict(params=float(model["canonical_params"]), changed=case["changed_pct"] / 100, elem_bytes=2,
                  trainer_gpus=2, diff_on="cpu",  # the benchmark's trainer: 2 ranks (TP=2)
                  trainer_cores=meta["machine"]["cpus"], receivers=meta["receivers"], receiver_nodes=1,
                  receiver_cores=1, receiver_downlink_gbps=far_side, chunk_bytes=meta["chunk_bytes"],
                  tensors=per_layer * model["num_layers"] + 3, shared_cores=meta["machine"]["cpus"])
    if case["topology"] == "store":
        return Deployment(**common, trainer_uplink_gbps=far_side, s3_egress_gbps=link_gbps), "s3"
    fanouts = ",".join(str(f) for f in meta["fanouts"]) if meta.get("fanouts") else ""
    return Deployment(**common, trainer_uplink_gbps=link_gbps, fanout=meta.get("fanout") or 2,
                      fanouts=fanouts), "relay"


def measured_check(tree: dict, rates: Rates) -> dict:
    """Each case of the tree benchmark (the relay-kill case aside) projected with its own
    inputs and compared with its measured median wall.  The link and relay rates are the
    tree run's own hop probe where it has one."""
    if (tree.get("hops") or {}).get("link_efficiency"):
        eff, fwd, lat = relay_rates(tree)
        rates = replace(rates, link_efficiency=replace(eff, source=eff.source.replace("relay_link", "scale_tree")),
                        relay_hop=replace(fwd, source=fwd.source.replace("relay_link", "scale_tree")),
                        relay_latency=replace(lat, source=lat.source.replace("relay_link", "scale_tree")))
    rows = []
    for case in tree["cases"]:
        if case.get("relay_killed"):
            continue
        dep, transport = tree_deployment(tree["meta"], case)
        b = case["wire_bytes"] / (dep.changed * dep.params)  # the case's own coding and bytes
        p = project(dep, replace(rates, bytes_per_changed=Rate(b, "scale_tree.json: the case's wire bytes / "
                                                                  "changed elements")), transport)
        rows.append({"topology": case["topology"], "link_mbit": case["link_mbit"], "receivers": dep.receivers,
                     "fanouts": dep.fanouts, "measured_wall_s": case["wall_s"], "projected_wall_s": p.wall_s,
                     "projected_over_measured": p.wall_s / case["wall_s"], "dominating": p.dominating,
                     "stages": {st.name: st.seconds for st in p.stages}, "latency_s": p.latency_s,
                     "deployment": asdict(dep)})
    ratios = [r["projected_over_measured"] for r in rows]
    return {"source": "scale_tree.json (scripts/bench_relay_link.py --fanouts ... --out-name scale_tree)",
            "rates": {f.name: asdict(getattr(rates, f.name)) for f in fields(rates)},
            "cases": rows, "projected_over_measured": statistics.median(ratios) if ratios else None,
            "within_20pct": bool(ratios) and all(0.8 <= x <= 1.2 for x in ratios)}


# ---- report --------------------------------------------------------------------------------------

def _stage_names(projs: dict[str, Projection]) -> list[str]:
    """Every stage name once, in pipeline order (trainer, links, receiver)."""
    names = list(dict.fromkeys(s.name for pr in projs.values() for s in pr.stages))
    last = {s.name for pr in projs.values() for s in pr.stages[-1:]}
    return [n for n in names if n not in last] + [n for n in names if n in last]


def _fmt_s(s: float) -> str:
    return f"{s:9.3f}" if s < 100 else f"{s:9.1f}"


def print_report(dep: Deployment, rates: Rates, projs: dict[str, Projection], formats_cmp: list[dict],
                 published: dict) -> None:
    D, N = dep.params * dep.elem_bytes, dep.changed * dep.params
    print(f"refit of {dep.params:.3g} parameters x {dep.elem_bytes} B ({D / 1e12:.2f} TB), {dep.changed:.1%} changed "
          f"({N:.3g} elements), format {dep.format!r}")
    print(f"trainer: {dep.trainer_gpus} GPUs, diff on {dep.diff_on}, {dep.trainer_cores} cores encoding, uplink "
          f"{dep.trainer_uplink_gbps:g} GB/s; {dep.receivers} receiver replicas x {dep.receiver_nodes} nodes "
          f"({dep.receiver_downlink_gbps:g} GB/s each), {dep.receiver_cores} cores decode + apply per replica")
    print("\nrates (GB/s of parameter bytes per core, per GPU for diff_gpu and d2h; link_efficiency a fraction, "
          "relay_hop GB/s per relay process, relay_latency seconds per hop):")
    for f in fields(rates):
        r = getattr(rates, f.name)
        print(f"  {f.name:18s} {r.value:10.4g}   {r.source}")
    p = next(iter(projs.values()))
    print(f"\nwire bytes W = {p.wire_bytes / 1e9:.2f} GB ({dep.params * dep.elem_bytes / p.wire_bytes:.0f}x smaller "
          f"than the dense checkpoint); {p.waves:.0f} chunks per emitting rank (pipeline waves)\n")
    names = _stage_names(projs)
    heads = {"s3": "object storage (s)",
             "relay": f"relay tree f={dep.fanout}, {projs['relay'].tree_levels} lvl (s)" if "relay" in projs else ""}
    print(f"{'stage':22s}" + "".join(f" | {heads[t]:>26s}" for t in projs))
    print("-" * (22 + 29 * len(projs)))
    for n in names:
        cells = []
        for pr in projs.values():
            s = next((s for s in pr.stages if s.name == n), None)
            cells.append(f"{_fmt_s(s.seconds) if s else '-':>26s}")
        print(f"{n:22s}" + "".join(f" | {c}" for c in cells))
    print("-" * (22 + 29 * len(projs)))
    print(f"{'fill latency':22s}" + "".join(f" | {_fmt_s(pr.fill_s):>26s}" for pr in projs.values()))
    print(f"{'relay latency':22s}" + "".join(f" | {_fmt_s(pr.latency_s):>26s}" for pr in projs.values()))
    print(f"{'wall (pipelined)':22s}" + "".join(f" | {_fmt_s(pr.wall_s):>26s}" for pr in projs.values()))
    print(f"{'dominating stage':22s}" + "".join(f" | {pr.dominating:>26s}" for pr in projs.values()))
    for s in next(iter(projs.values())).stages:
        if s.parts:
            print(f"  {s.name} shares one set of cores: " + " + ".join(f"{k} {v:.3g} s" for k, v in s.parts.items()))
    print("\npublished figures (not measured here):")
    for v in published.values():
        print(f"  {v['what']}: {v['published_s']:.1f} s; this model: {v['projected_s']:.1f} s ({v['note']})")
    if formats_cmp:
        print("\nevery format in codec.json under the same model (bytes and codec speeds from its row):")
        print(f"  {'format':17s} {'B/changed':>9s} {'W GB':>8s} {'s3 wall s':>10s} {'relay wall s':>12s}  "
              "dominating (s3 | relay)")
        for f in formats_cmp:
            print(f"  {f['format']:17s} {f['bytes_per_changed']:9.3f} {f['wire_gb']:8.2f} {f['s3_wall_s']:10.2f} "
                  f"{f['relay_wall_s']:12.2f}  {f['s3_dominating']} | {f['relay_dominating']}")


def plot(projs: dict[str, Projection], dep: Deployment, path: pathlib.Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = _stage_names(projs)
    fig, ax = plt.subplots(figsize=(9, 4.5))
    h = 0.8 / len(projs)
    for i, (t, pr) in enumerate(projs.items()):
        sec = {s.name: s.seconds for s in pr.stages}
        ys = [j + i * h for j in range(len(names))]
        ax.barh(ys, [sec.get(n, 0) for n in names], h, label=f"{t}: wall {pr.wall_s:.1f} s ({pr.dominating})")
    ax.set_yticks([j + h * (len(projs) - 1) / 2 for j in range(len(names))], names)
    ax.invert_yaxis()
    ax.set_xscale("log")
    ax.set_xlabel("seconds for the whole refit at the stage's aggregate rate")
    ax.set_title(f"projected refit: {dep.params:.3g} params, {dep.changed:.0%} changed, {dep.format}", fontsize=10)
    ax.grid(True, axis="x", which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


RATE_FLAGS = {"bytes_per_changed": "--bytes-per-changed", "encode": "--encode-gbps", "decode": "--decode-gbps",
              "diff_cpu": "--diff-cpu-gbps", "diff_gpu": "--diff-gpu-gbps", "d2h": "--d2h-gbps",
              "apply": "--apply-gbps", "link_efficiency": "--link-efficiency", "relay_hop": "--relay-hop-gbps",
              "relay_latency": "--relay-latency-s"}


RATE_UNITS = {"bytes_per_changed": "bytes per changed element", "encode": "rate, GB/s per core",
              "decode": "rate, GB/s per core", "diff_cpu": "rate, GB/s per core", "diff_gpu": "rate, GB/s per GPU",
              "d2h": "rate, GB/s of diff output per GPU", "apply": "rate, GB/s per core",
              "link_efficiency": "share of the nominal link rate (0-1]", "relay_hop": "rate, GB/s per relay process",
              "relay_latency": "delay per relay hop, seconds (0: none)"}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    defaults = Deployment()
    for f in fields(Deployment):
        ap.add_argument("--" + f.name.replace("_", "-"), type=type(getattr(defaults, f.name)),
                        default=getattr(defaults, f.name), help=_field_doc(f.name).replace("%", "%%"))
    for name, flag in RATE_FLAGS.items():
        ap.add_argument(flag, dest=f"rate_{name}", type=float, default=None,
                        help=f"override the measured {name} " + RATE_UNITS[name])
    ap.add_argument("--results", type=pathlib.Path, default=RESULTS, help="where the measured JSON files are read")
    ap.add_argument("--out", type=pathlib.Path, default=RESULTS, help="where project_1t.{json,png} are written")
    args = ap.parse_args(argv)
    try:
        dep = Deployment(**{f.name: getattr(args, f.name) for f in fields(Deployment)})
        rates, formats = load_rates(args.results, dep, {n: getattr(args, f"rate_{n}") for n in RATE_FLAGS})
    except (InputError, ValueError) as e:
        print(f"project_1t: {e}", file=sys.stderr)
        return 2
    projs = {t: project(dep, rates, t) for t in ("s3", "relay")}

    # Published figures, and the same model at NeMo-RL's size.
    nemorl_dep = replace(dep, params=NEMORL_BYTES / dep.elem_bytes)
    nemorl = project(nemorl_dep, rates, "s3")
    published = {
        "paper_1t_relay": {"what": "NeMo-DCR paper, 1T params, 3% changed, relay tree", "published_s": PAPER_1T_S,
                           "projected_s": projs["relay"].wall_s,
                           "note": f"relay, the inputs above at {dep.changed:.0%} changed"},
        "nemorl_247gb_s3": {"what": "NeMo-RL, 247 GB at 3% changed, S3", "published_s": NEMORL_S,
                            "projected_s": nemorl.wall_s,
                            "note": f"s3, the inputs above at {nemorl_dep.params:.4g} params "
                                    f"(247 GB read as the BF16 checkpoint); its figure scaled linearly to "
                                    f"{dep.params * dep.elem_bytes / 1e12:.2f} TB: "
                                    f"{NEMORL_S * dep.params * dep.elem_bytes / NEMORL_BYTES:.1f} s"},
    }
    formats_cmp = []
    codec = _load(args.results / "codec.json")
    for fmt in formats:
        try:
            b, enc, dec, _ = codec_rates(codec, fmt, dep.changed)
        except InputError:
            continue
        rf = replace(rates, bytes_per_changed=b, encode=enc, decode=dec)
        s3, relay = project(dep, rf, "s3"), project(dep, rf, "relay")
        formats_cmp.append({"format": fmt, "bytes_per_changed": b.value, "wire_gb": s3.wire_bytes / 1e9,
                            "encode_gbps": enc.value, "decode_gbps": dec.value,
                            "s3_wall_s": s3.wall_s, "relay_wall_s": relay.wall_s,
                            "s3_dominating": s3.dominating, "relay_dominating": relay.dominating})
    print_report(dep, rates, projs, formats_cmp, published)
    check = None
    tree = _load(args.results / "scale_tree.json")
    if tree is not None:
        check = measured_check(tree, rates)
        check["explained"] = MODEL_FIXES
        print("\nthe model against a measurement (scale_tree.json: this VM, one process per node, 2 shared cores):")
        print(f"  {'case':16s} {'measured s':>10s} {'projected s':>11s} {'ratio':>6s}  dominating")
        for r in check["cases"]:
            print(f"  {r['topology'] + ' ' + format(r['link_mbit'], 'g') + ' Mbit/s':16s} {r['measured_wall_s']:10.2f} "
                  f"{r['projected_wall_s']:11.2f} {r['projected_over_measured']:6.2f}  {r['dominating']}")

    args.out.mkdir(parents=True, exist_ok=True)
    out = {"command": "scripts/project_1t.py " + " ".join(argv if argv is not None else sys.argv[1:]),
           "model": "wall = max_s T_s + (sum_s T_s - max_s T_s) / m + latency; see the script's docstring",
           "deployment": asdict(dep), "rates": {f.name: asdict(getattr(rates, f.name)) for f in fields(rates)},
           "projections": {t: asdict(p) for t, p in projs.items()}, "published": published,
           "formats": formats_cmp, "measured_check": check}
    (args.out / "project_1t.json").write_text(json.dumps(out, indent=2) + "\n")
    plot(projs, dep, args.out / "project_1t.png")
    print(f"\nwrote {args.out / 'project_1t.json'} and {args.out / 'project_1t.png'}")
    return 0


def _field_doc(name: str) -> str:
    """The field's docstring (the string literal after it in the class body)."""
    import ast
    import inspect

    body = ast.parse(inspect.getsource(Deployment)).body[0].body
    for a, b in zip(body, body[1:]):
        if isinstance(a, ast.AnnAssign) and a.target.id == name and isinstance(b, ast.Expr):
            return " ".join(b.value.value.split())
    return ""


if __name__ == "__main__":
    sys.exit(main())
