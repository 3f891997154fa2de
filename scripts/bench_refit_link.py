"""End-to-end refit over a rate-limited link: nemo_dcr's delta refit vs a dense refit,
through the same S3 store, the same shaped link and the same receiver process.

    sudo .venv/bin/python scripts/bench_refit_link.py [--rates 50,200] [--lrs 4.5e-7,2.4e-6,4.5e-6]
        [--steps 3] [--dense-steps 3] [--variants stream,nostream,stream+small-first] [--pin]
        [--warmup 1] [--out-dir benchmarks/results] [--name refit_link]
        [hydra overrides for testbed/nemo_dcr_testbed/configs/demo.yaml ...]
    .venv/bin/python scripts/bench_refit_link.py --regroup benchmarks/results/refit_link.json

Needs root (network namespaces, ``tc``); refuses to run otherwise.

Topology (one machine)::

    root namespace                                   namespace dcrlink-<pid>
    trainer ranks (torchrun, TP=2, gloo on lo)        moto_server (S3), <subnet>.2:5000
    receiver (transformers), this driver
          <subnet>.1  veth dl<pid>a ===================== veth dl<pid>b  <subnet>.2
                      htb egress at R Mbit/s  -->     <--  htb egress at R Mbit/s

The store sits behind the link, so the trainer's puts (root -> namespace, shaped on the
root end) and the receiver's gets (namespace -> root, shaped on the namespace end) both
cross it, each direction at R.  Gloo traffic between trainer ranks stays on loopback.

One trainer run (Megatron-Core GPT, TP=2 under torchrun; by default 8 layers, hidden 1024,
FFN 2816, 16 heads / 4 KV groups, vocabulary 32000: 155.7 M parameters, 311 MB BF16) and one
receiver run through every refit (``testbed/nemo_dcr_testbed/link_refit.py``), each its own
optimizer step (``make_plan``): first ``--dense-steps`` steps per rate whose nemo_dcr refit is
followed by a dense one, then for each learning rate, rate and repeat one step per variant,
in turn.  A variant says whether the receiver streams (``receiver/stream.py``) and how the
link queues (``Link.set_qdisc``: one FIFO, or small packets first); the link and the
receiver are changed between steps only, while nothing is in flight.  Training is
deterministic, so two runs of the same plan refit the same steps with the same bytes: a
product change is compared across runs on identical versions.  Every refit is checked bit
for bit (on a dense step against the densely loaded model, otherwise against the trainer's
gathered state written to a local file, off the link).  Version 0 and the ``--warmup``
steps run with the link at ``--setup-mbit`` and are not cases.

Per refit it records the stages, the critical path (``timeline``), the store calls of each
side by kind (``transport/store/meter.py``), the bytes on the link per direction and the
CPU seconds of the trainer ranks, the receiver and the store (``Run._counters``).

Writes ``<out-dir>/<name>.{json,png}``; prints a table on stdout, progress on stderr.
Timings are wall clock on whatever else the machine is doing.  On the project's 2-core VM
the defaults take about 15 min (a dense refit of the default model takes ~110 s at
50 Mbit/s: 311 MB put, then got, each way at the link rate).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import socket
import statistics
import subprocess
import sys
import time

from nemo_dcr_testbed.linkbench import BenchError, check_prerequisites, execute_run, fresh_run_dir, git_state, progress, run_cli
from nemo_dcr_testbed.linkbench import Sampler, file_counter
from nemo_dcr_testbed.linkbench import parse_floats as _parse_floats
from nemo_dcr_testbed.linkbench import read_rows as _read_rows
from nemo_dcr_testbed.linkbench import remove_stale_links as _remove_stale_links
from nemo_dcr_testbed.linkbench import sh as _sh
from nemo_dcr_testbed.linkbench import write_json_atomic as _write_json_atomic


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "benchmarks", "results")
MODEL = ["model.num_layers=8", "model.hidden_size=1024", "model.num_attention_heads=16",
         "model.num_query_groups=4", "model.ffn_hidden_size=2816", "model.vocab_size=32000"]
"""Default model: 155.7 M canonical parameters (llama family, untied embeddings)."""
NS_PREFIX = "dcrlink-"
S3_PORT = 5000
BUCKET = "refit-link"
DCR_STAGES = ("diff_s", "project_s", "encode_s", "publish_s", "rx_download_s", "rx_decode_s", "rx_apply_s")
DCR_CPU = ("diff_s", "project_s", "encode_s", "rx_decode_s", "rx_apply_s")
DENSE_STAGES = ("gather_s", "serialize_s", "put_s", "rx_get_s", "rx_deserialize_s", "rx_load_s")
DENSE_CPU = ("gather_s", "serialize_s", "rx_deserialize_s", "rx_load_s")
COUNTER_FIELDS = ("up_mb", "down_mb", "trainer_cpu_s", "receiver_cpu_s", "store_cpu_s")
"""Per refit, from the driver's counters between the step's end and the decision: MB sent
on the link towards the store (up) and from it (down), headers included, and CPU seconds of
the trainer ranks, the receiver and the store (moto)."""
VARIANTS = {"stream": (True, "fifo"), "nostream": (False, "fifo"), "stream+small-first": (True, "small-first"),
            "nostream+small-first": (False, "small-first")}
"""Variant -> (streaming receive, how the link queues: ``Link.set_qdisc``)."""


# ------------------------------------------------------------------------------ the link
def _progress(msg: str) -> None:
    progress("bench_refit_link", msg)


def remove_stale_links() -> list[str]:
    """Delete namespaces this script left behind when it was killed (``{NS_PREFIX}<pid>`` whose
    pid is gone) and whatever still runs in them; returns their names."""
    return _remove_stale_links(NS_PREFIX, "dl")


class Link:
    """A veth pair between the root namespace and a fresh namespace, with an htb class
    shaping the egress of each end at the same rate (one rate per direction)."""

    def __init__(self) -> None:
        pid = os.getpid()
        self.ns = f"{NS_PREFIX}{pid}"
        self.host_if, self.ns_if = f"dl{pid}a", f"dl{pid}b"
        used = set(re.findall(r"inet (10\.231\.\d+\.\d+)/", _sh("ip", "-o", "-4", "addr", "show")))
        for k in range(16384):  # a /30 in 10.231.0.0/16 no interface uses yet
            i = (pid + k) % 16384
            net, host = i >> 6, (i & 63) << 2
            a, b = f"10.231.{net}.{host + 1}", f"10.231.{net}.{host + 2}"
            if a not in used and b not in used:
                self.host_addr, self.ns_addr = a, b
                break
        else:
            raise BenchError("no free /30 left in 10.231.0.0/16 for the link")
        self.mbit: float | None = None
        self.created = False

    def _in_ns(self, *cmd: str) -> tuple[str, ...]:
        return ("ip", "netns", "exec", self.ns, *cmd)

    def up(self, mbit: float) -> None:
        self.created = True  # from here on, down() has something to remove
        _sh("ip", "netns", "add", self.ns)
        _sh("ip", "link", "add", self.host_if, "type", "veth", "peer", "name", self.ns_if)
        _sh("ip", "link", "set", self.ns_if, "netns", self.ns)
        _sh("ip", "addr", "add", f"{self.host_addr}/30", "dev", self.host_if)
        _sh("ip", "link", "set", self.host_if, "up")
        _sh(*self._in_ns("ip", "addr", "add", f"{self.ns_addr}/30", "dev", self.ns_if))
        _sh(*self._in_ns("ip", "link", "set", self.ns_if, "up"))
        _sh(*self._in_ns("ip", "link", "set", "lo", "up"))
        for pre, dev in (((), self.host_if), (self._in_ns(), self.ns_if)):
            _sh(*pre, "tc", "qdisc", "add", "dev", dev, "root", "handle", "1:", "htb", "default", "10")
            for parent, classid, prio in (("1:", "1:1", None), ("1:1", "1:10", "1"), ("1:1", "1:20", "0")):
                _sh(*pre, "tc", "class", "add", "dev", dev, "parent", parent, "classid", classid, "htb",
                    *self._rate_args(mbit, prio))
        self.mbit = mbit
        self.qdisc = "fifo"

    @staticmethod
    def _rate_args(mbit: float, prio: str | None = None) -> tuple[str, ...]:
        """Class 1:1 holds the link's rate; its leaves 1:10 (bulk, where everything goes under
        ``fifo``) and 1:20 (small packets under ``small-first``) each guarantee half and may
        borrow all of it."""
        ceil = f"{int(round(mbit * 1000))}kbit"
        rate = ceil if prio is None else f"{int(round(mbit * 500))}kbit"
        return ("rate", rate, "ceil", ceil, "quantum", "60000", *(() if prio is None else ("prio", prio)))

    def set_rate(self, mbit: float) -> None:
        if mbit == self.mbit:
            return
        for pre, dev in (((), self.host_if), (self._in_ns(), self.ns_if)):
            for parent, classid, prio in (("1:", "1:1", None), ("1:1", "1:10", "1"), ("1:1", "1:20", "0")):
                _sh(*pre, "tc", "class", "change", "dev", dev, "parent", parent, "classid", classid, "htb",
                    *self._rate_args(mbit, prio))
        self.mbit = mbit

    def set_qdisc(self, kind: str) -> None:
        """How each end queues: ``fifo`` (every packet in class 1:10, one FIFO of the veth's
        1000 packets at the link's rate: a flow's S3 requests and TCP acks wait behind the
        other flow's bulk) or ``small-first`` (a u32 filter sends IP packets under 1024 bytes,
        requests and acks, to class 1:20, served before the bulk at the same total rate).
        The fair leaf queues (fq_codel, sfq, fq) are not in this kernel (``tc`` answers
        "Specified qdisc kind is unknown"), so this is the test bed's fair queue."""
        if kind == self.qdisc:
            return
        for pre, dev in (((), self.host_if), (self._in_ns(), self.ns_if)):
            if kind == "small-first":
                _sh(*pre, "tc", "filter", "add", "dev", dev, "parent", "1:", "protocol", "ip", "prio", "1", "u32",
                    "match", "u16", "0x0000", "0xfc00", "at", "2", "flowid", "1:20")
            else:
                _sh(*pre, "tc", "filter", "del", "dev", dev, "parent", "1:", "prio", "1")
        self.qdisc = kind

    def exec_prefix(self) -> list[str]:
        return list(self._in_ns())

    def down(self) -> None:
        if not self.created:
            return
        self.created = False
        _sh("ip", "netns", "del", self.ns, check=False)  # takes the veth pair with it
        _sh("ip", "link", "del", self.host_if, check=False)


def _wait_port(host: str, port: int, proc, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with socket.create_connection((host, port), timeout=0.5):
                return
        except OSError:
            if proc.poll() is not None:
                raise BenchError(f"moto_server exited ({proc.returncode}) before listening on {host}:{port}")
            if time.monotonic() > deadline:
                raise BenchError(f"moto_server not listening on {host}:{port} after {timeout_s:g}s")
            time.sleep(0.1)


def measure_link(store, mbit: float, nbytes: int) -> dict:
    """Goodput of one put and one get of ``nbytes`` through the store client, over the link."""
    data = os.urandom(nbytes)
    t0 = time.perf_counter()
    store.put("probe", data)
    t1 = time.perf_counter()
    back = store.get("probe")
    t2 = time.perf_counter()
    store.delete("probe")
    if back != data:
        raise BenchError("link probe: the store returned other bytes than were put")
    return {"link_mbit": mbit, "probe_bytes": nbytes, "put_mbit": round(nbytes * 8 / (t1 - t0) / 1e6, 1),
            "get_mbit": round(nbytes * 8 / (t2 - t1) / 1e6, 1)}


# --------------------------------------------------------------------------- the results
def _med(xs):
    return statistics.median(xs) if xs else None


def _requests(calls: dict) -> dict:
    """``op:kind`` -> calls, and their seconds summed (``transport/store/meter.py``)."""
    return {k: {"n": v["n"], "s": round(v["s"], 4)} for k, v in sorted(calls.items())}


def timeline(row: dict) -> dict:
    """The refit's critical path: consecutive segments from the end of the optimizer step to
    the recorded decision (each a wait or a stage of one side; together they are the wall)."""
    st, acks = row["stats"], row["stats"].get("acks") or []
    t0, t_end = row["dcr"]["t_start"], row["dcr"]["t_committed"]
    a = max(acks, key=lambda x: x["stats"].get("answered_at", 0.0))["stats"] if acks else {}
    uploaded = t0 + st["publish_s"]  # rank 0's diff start ~ the step's end; its last chunk put
    marks = [("trainer: diff, encode, upload", uploaded),
             ("manifest put + receiver poll", a.get("manifest_read_at", uploaded)),
             ("receiver: chunks left after the manifest", a.get("last_chunk_arrived_at", uploaded)),
             ("receiver: decode tail, apply, ack", a.get("answered_at", uploaded)),
             ("trainer: ack poll, decision", t_end)]
    out, prev = {}, t0
    for name, t in marks:
        t = min(max(t, prev), t_end)
        out[name] = round(t - prev, 4)
        prev = t
    first = a.get("first_chunk_listed_at")
    out["_first_chunk_listed_s"] = None if first is None else round(first - t0, 4)
    out["_last_chunk_listed_s"] = None if a.get("last_chunk_listed_at") is None else \
        round(a["last_chunk_listed_at"] - t0, 4)
    return out


def refit_record(row: dict) -> dict:
    """One refit's numbers from the trainer's row (and the driver's counters, ``row["counters"]``)."""
    st, dense = row["stats"], row["dense"]
    if dense is not None and dense.get("local"):  # the bit-exact check only, off the link
        verify, dense = dense["verify"], None
    else:
        verify = dense["verify"] if dense is not None else []
    acks = st.get("acks") or []
    rx = lambda k: max((a["stats"].get(k, 0.0) for a in acks), default=0.0)  # noqa: E731
    # the receiver decodes chunks on its fetch pool while later ones download: download_s is the
    # time during which at least one of the version's chunks was downloading, before the manifest
    # (streaming receive) or after it; decode_cpu_s is the decoding summed over threads (decode_s,
    # the tail after the last arrival, where a receiver without the pool reports all of it)
    decode = rx("decode_cpu_s") if any("decode_cpu_s" in a["stats"] for a in acks) else rx("decode_s")
    stages = {"diff_s": st["diff_s"], "project_s": st["project_s"], "encode_s": st["encode_s"],
              "publish_s": st["publish_s"], "rx_download_s": rx("download_s"), "rx_decode_s": decode,
              "rx_apply_s": rx("apply_s")}
    slowest = max(stages, key=stages.get)
    rec = {
        "step": row["step"], "lr": row["plan"]["lr"], "link_mbit": row["plan"]["link_mbit"],
        "loss": row["loss"], "changed": st["changed"], "canonical_numel": row["canonical_numel"],
        "changed_pct": 100 * st["changed"] / row["canonical_numel"], "chunks": st["chunks"],
        "wire_bytes": st["wire_bytes"], "committed": st["committed"],
        "dcr_s": row["dcr"]["wall_s"], "stages": stages, "slowest_stage": slowest,
        "overlap": row["dcr"]["wall_s"] / max(stages[slowest], 1e-9),
        "publish_s": st["publish_s"], "commit_wait_s": st["commit_wait_s"],
        "rx_decode_tail_s": rx("decode_s"), "rx_fetch_threads": rx("fetch_threads"),
        "rx_fetch_s": rx("fetch_s"), "rx_stream": all(a["stats"].get("stream", False) for a in acks),
        "rx_prefetch_used_chunks": min((a["stats"].get("prefetch_used_chunks", 0) for a in acks), default=0),
        "rx_prefetch_used_bytes": min((a["stats"].get("prefetch_used_bytes", 0) for a in acks), default=0),
        "variant": row["plan"].get("variant", "stream"), "qdisc": row["plan"].get("qdisc", "fifo"),
        "dense_step": bool(row["plan"]["dense"]),
        "coding": st.get("coding", ""),
        "timeline": timeline(row),
        "requests": {"trainer": _requests(st.get("requests", {}).get("calls", {})),
                     "receiver": _requests(acks[0]["stats"].get("requests", {}).get("calls", {})) if acks else {}},
        **row.get("counters", {}),
        "bit_exact": all(v["bit_exact"] for v in verify) and bool(verify),
        "negative_control": [v["negative_control"] for v in verify if "negative_control" in v],
        "verify": [{k: v[k] for k in ("receiver", "bit_exact", "compared", "summary")} for v in verify],
    }
    rec["critical"] = max((k for k in rec["timeline"] if not k.startswith("_")), key=rec["timeline"].get)
    if dense is not None:
        da = dense["acks"]
        dstages = {"gather_s": dense["gather_s"], "serialize_s": dense["serialize_s"], "put_s": dense["put_s"],
                   "rx_get_s": max(a["get_s"] for a in da),
                   "rx_deserialize_s": max(a["deserialize_s"] for a in da),
                   "rx_load_s": max(a["load_s"] for a in da)}
        rec.update({
            "dense_bytes": dense["bytes"], "dense_s": dense["wall_s"], "dense_stages": dstages,
            "dense_loaded_s": max(a["t_loaded"] for a in da) - dense["t_start"],
            "wire_ratio": dense["bytes"] / max(st["wire_bytes"], 1),
            "speedup": dense["wall_s"] / row["dcr"]["wall_s"],
        })
        mbit = row["plan"]["link_mbit"]
        rec["dense_link_s"] = dense["bytes"] * 8 / (mbit * 1e6)
        rec["wire_link_s"] = st["wire_bytes"] * 8 / (mbit * 1e6)
        cpu = [stages[k] for k in DCR_CPU] + [dstages[k] for k in DENSE_CPU]
        rec["link_bound"] = rec["dense_link_s"] > max(cpu)
        rec["dcr_link_bound"] = rec["wire_link_s"] > max(stages[k] for k in DCR_CPU)
    return rec


def case_entry(mbit: float, lr: float, refits: list[dict], dense: list[dict], variant: str = "stream") -> dict:
    """One case (link rate, lr, variant): medians over its refits, the dense side from
    ``dense`` (the dense refits at this rate: their bytes and wall do not depend on the lr);
    per-refit details kept."""
    changed = sum(r["changed"] for r in refits)
    numel = sum(r["canonical_numel"] for r in refits)
    stages = {k: _med([r["stages"][k] for r in refits]) for k in DCR_STAGES}
    dstages = {k: _med([r["dense_stages"][k] for r in dense]) for k in DENSE_STAGES}
    slowest = max(stages, key=stages.get)
    dcr_s = _med([r["dcr_s"] for r in refits])
    dense_s = _med([r["dense_s"] for r in dense])
    wire = _med([r["wire_bytes"] for r in refits])
    dense_b = _med([r["dense_bytes"] for r in dense])
    dense_link_s = dense_b * 8 / (mbit * 1e6)
    wire_link_s = wire * 8 / (mbit * 1e6)
    cpu_max = max([stages[k] for k in DCR_CPU] + [dstages[k] for k in DENSE_CPU])
    return {
        "link_mbit": mbit, "lr": lr, "refits_n": len(refits),
        "changed_pct": 100 * changed / numel,
        "wire_bytes": wire, "dense_bytes": dense_b, "wire_ratio": dense_b / wire,
        "dcr_s": dcr_s, "dense_s": dense_s, "speedup": dense_s / dcr_s,
        "speedup_over_ratio": (dense_s / dcr_s) / (dense_b / wire),
        "dense_link_s": dense_link_s, "wire_link_s": wire_link_s,
        "link_bound": dense_link_s > cpu_max,
        "dcr_link_bound": wire_link_s > max(stages[k] for k in DCR_CPU),
        "stages": stages, "dense_stages": dstages, "slowest_stage": slowest,
        "overlap": dcr_s / stages[slowest],
        "rx_fetch_s": _med([r["rx_fetch_s"] for r in refits]),
        "prefetched_share": _med([r["rx_prefetch_used_bytes"] / max(r["wire_bytes"], 1) for r in refits]),
        "variant": variant, "dense_n": len(dense),
        "timeline": {k: _med([r["timeline"][k] for r in refits if r["timeline"].get(k) is not None])
                     for k in refits[0]["timeline"]},
        "critical": max((k for k in refits[0]["timeline"] if not k.startswith("_")),
                        key=lambda k: _med([r["timeline"][k] for r in refits])),
        "requests": {side: {k: _med([r["requests"][side].get(k, {}).get("n", 0) for r in refits])
                            for k in sorted({k for r in refits for k in r["requests"][side]})}
                     for side in ("trainer", "receiver")},
        "request_s": {side: _med([sum(v["s"] for v in r["requests"][side].values()) for r in refits])
                      for side in ("trainer", "receiver")},
        **{k: _med([r[k] for r in refits if r.get(k) is not None])
           for k in COUNTER_FIELDS if any(r.get(k) is not None for r in refits)},
        "bit_exact": f"{sum(r['bit_exact'] for r in refits)}/{len(refits)}",
        "committed": f"{sum(r['committed'] for r in refits)}/{len(refits)}",
        "refits": refits,
    }


def build_cases(records: list[dict], variants: list[str]) -> list[dict]:
    """Cases (rate, lr, variant) from the refits of the measured steps.  The nemo_dcr refits of
    the dense steps (the first steps at each rate, where the change is larger) are a case of
    their own, ``<variant> (dense steps)``, so that the variants compare refits of the same
    stretch of the run; every case's dense side is the dense refits at its rate."""
    cases = []
    for mbit in sorted({r["link_mbit"] for r in records}):
        dense = [r for r in records if r["link_mbit"] == mbit and "dense_s" in r]
        groups: dict[tuple, list[dict]] = {}
        for r in records:
            if r["link_mbit"] == mbit:
                name = f"{r['variant']} (dense steps)" if r.get("dense_step", "dense_s" in r) else r["variant"]
                groups.setdefault((r["lr"], name), []).append(r)
        order = {v: i for i, v in enumerate(variants)}
        for (lr, name), mine in sorted(groups.items(), key=lambda kv: (kv[0][0], "(dense" in kv[0][1],
                                                                       order.get(kv[0][1], 99))):
            cases.append(case_entry(mbit, lr, mine, dense, name))
    return cases


def regroup(path: str) -> int:
    """``--regroup``: rebuild the cases of a result JSON from its refits (what ``build_cases``
    and ``case_entry`` make now), rewrite it and its plot, print the table."""
    with open(path) as f:
        result = json.load(f)
    seen, records = set(), []
    for c in result["cases"]:
        for r in c["refits"]:
            if r["step"] not in seen:
                seen.add(r["step"])
                if "publish_s" not in r["stages"]:  # written before the stage was the trainer's wall
                    r["stages"].pop("upload_s", None)
                    r["stages"]["publish_s"] = r["publish_s"]
                records.append(r)
    records.sort(key=lambda r: r["step"])
    variants = list(result["meta"].get("variants") or ["stream"])
    result["cases"] = build_cases(records, variants)
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
    print_table(result["cases"])
    plot(result["cases"], path.removesuffix(".json") + ".png")
    return 0


def compare(paths: list[str]) -> int:
    """``--compare``: one line per case of the first result, its nemo_dcr wall, speedup and
    speedup / wire ratio in each result side by side (runs of the same plan refit the same
    steps with the same bytes: the changed % is checked equal)."""
    runs = []
    for path in paths:
        with open(path) as f:
            d = json.load(f)
        runs.append((os.path.basename(path).removesuffix(".json"), d["meta"].get("git") or {},
                     {(c["link_mbit"], c["lr"], c["variant"]): c for c in d["cases"]}))
    print("runs: " + "; ".join(f"{name} (git {g.get('head', '?')}{' +' if g.get('modified') else ''})"
                               for name, g, _ in runs))
    print("(*: other bytes than the first run's step: its changed % differs)")
    print(f"{'Mbit/s':>6} {'lr':>8} {'variant':>32} {'chg %':>6}  " + "  ".join(f"{n:>24}" for n, _, _ in runs))
    for key, first in runs[0][2].items():
        cells = []
        for _, _, cases in runs:
            c = cases.get(key)
            if c is None:
                cells.append(f"{'-':>24}")
                continue
            other = abs(c["changed_pct"] - first["changed_pct"]) > 1e-6  # not the same step's bytes
            cells.append(f"{c['dcr_s']:6.2f}s {c['speedup']:6.1f}x {c['speedup_over_ratio']:5.2f}"
                         f"{'*' if other else ' '}".rjust(24))
        print(f"{key[0]:>6g} {key[1]:>8g} {key[2]:>32} {first['changed_pct']:6.2f}  " + "  ".join(cells))
    return 0


def print_table(cases: list[dict]) -> None:
    cols = [("link Mbit/s", 11), ("variant", 32), ("lr", 8), ("changed %", 9), ("wire B", 10), ("dense B", 11), ("wire ratio", 10),
            ("nemo_dcr s", 10), ("dense s", 8), ("speedup", 8), ("spd/ratio", 9), ("link-bound", 10),
            ("overlap", 7), ("slowest stage", 13), ("prefetched", 10), ("bit-exact", 9)]
    print(" ".join(n.rjust(w) for n, w in cols), flush=True)
    for c in cases:
        cells = [f"{c['link_mbit']:g}", c["variant"], f"{c['lr']:g}", f"{c['changed_pct']:.2f}", f"{c['wire_bytes']:.0f}",
                 f"{c['dense_bytes']:.0f}", f"{c['wire_ratio']:.1f}x", f"{c['dcr_s']:.2f}", f"{c['dense_s']:.1f}",
                 f"{c['speedup']:.1f}x", f"{c['speedup_over_ratio']:.2f}", "yes" if c["link_bound"] else "no",
                 f"{c['overlap']:.2f}", c["slowest_stage"].removesuffix("_s"), f"{100 * c['prefetched_share']:.0f}%",
                 c["bit_exact"]]
        print(" ".join(v.rjust(w) for v, (_, w) in zip(cells, cols)), flush=True)
    print("\ncritical path (medians, s): " + " | ".join(k for k in cases[0]["timeline"] if not k.startswith("_")))
    for c in cases:
        t = c["timeline"]
        reqs = {side: sum(c["requests"][side].values()) for side in ("trainer", "receiver")}
        print(f"{c['link_mbit']:>6g} {c['variant']:>32} {c['changed_pct']:5.2f}%  "
              + "  ".join(f"{t[k]:.3f}" for k in t if not k.startswith("_"))
              + f"  | requests trainer {reqs['trainer']:.0f} ({c['request_s']['trainer']:.2f}s) receiver "
              f"{reqs['receiver']:.0f} ({c['request_s']['receiver']:.2f}s)"
              + "".join(f" {k} {c[k]:.2f}" for k in ("up_mb", "down_mb", "trainer_cpu_s", "receiver_cpu_s",
                                                    "store_cpu_s") if c.get(k) is not None), flush=True)


def plot(cases: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a1, a2, a3) = plt.subplots(1, 3, figsize=(17, 5), gridspec_kw={"width_ratios": [1, 1.2, 1.2]})
    rates = sorted({c["link_mbit"] for c in cases})
    for i, mbit in enumerate(rates):
        cs = [c for c in cases if c["link_mbit"] == mbit]
        a1.plot([c["wire_ratio"] for c in cs], [c["speedup"] for c in cs], "o", color=f"C{i}", label=f"{mbit:g} Mbit/s")
        for c in cs:
            a1.annotate(f"{c['changed_pct']:.1f}%", (c["wire_ratio"], c["speedup"]), fontsize=7,
                        textcoords="offset points", xytext=(4, 2))
    lo = min(min(c["speedup"] for c in cases), min(c["wire_ratio"] for c in cases)) / 1.5
    hi = max(c["wire_ratio"] for c in cases) * 1.5
    a1.plot([lo, hi], [lo, hi], "k-", lw=0.8, label="speedup = wire ratio")
    a1.plot([lo, hi], [0.8 * lo, 0.8 * hi], "k--", lw=0.8, label="0.8 x wire ratio")
    a1.set(xscale="log", yscale="log", xlabel="wire ratio (dense bytes / nemo_dcr wire bytes)",
           ylabel="speedup (dense wall / nemo_dcr wall)", title="end-to-end speedup vs byte ratio")
    a1.grid(alpha=0.3, which="both")

    labels = [f"{c['link_mbit']:g} Mbit/s {c['variant']}\n{c['changed_pct']:.1f}% chg" for c in cases]
    for ax, key, names, wall, title in (
        (a2, "stages", DCR_STAGES, "dcr_s", "nemo_dcr refit: stage times (medians) and e2e wall"),
        (a3, "dense_stages", DENSE_STAGES, "dense_s", "dense refit: stage times (medians) and e2e wall"),
    ):
        left = [0.0] * len(cases)
        for j, name in enumerate(names):
            vals = [c[key][name] for c in cases]
            ax.barh(range(len(cases)), vals, left=left, color=f"C{j}", label=name.removesuffix("_s"))
            left = [a + b for a, b in zip(left, vals)]
        ax.plot([c[wall] for c in cases], range(len(cases)), "kD", ms=6, label="end-to-end wall")
        ax.set_yticks(range(len(cases)), labels, fontsize=7)
        ax.invert_yaxis()
        ax.set(xlabel="seconds (stages stacked; they overlap where the wall is shorter)", title=title)
        ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.13), ncol=4)
        ax.grid(alpha=0.3, axis="x")
    a1.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.13), ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)


# ------------------------------------------------------------------------------- the run
class Run:
    def __init__(self, args, cfg, run_dir: str):
        from nemo_dcr_testbed.demo import _Children

        self.args, self.cfg, self.run_dir = args, cfg, run_dir
        self.children = _Children()
        self.link = Link()
        self.moto = None
        self.procs: dict[str, tuple[object, str]] = {}  # name -> (Popen, log path)
        self._cleaned = False

    def cleanup(self) -> None:
        """Stop every process this run started, then remove the namespace; idempotent."""
        if self._cleaned:
            return
        self._cleaned = True
        try:
            self.children.stop(grace_s=5.0)
        finally:
            self.link.down()

    def _start(self, name: str, cmd: list[str], env: dict):
        log_path = os.path.join(self.run_dir, f"{name}.log")
        log = open(log_path, "w")
        p = self.children.start(cmd, log, env)
        self.procs[name] = (p, log_path)
        return p

    def _check_alive(self, names=None) -> None:
        from nemo_dcr_testbed.demo import _last_error

        for name, (p, log) in self.procs.items():
            if (names is None or name in names) and p.poll() is not None and (p.returncode != 0 or name == "moto"):
                raise BenchError(f"{name} exited ({p.returncode}): {_last_error(log)} -- log: {log}")

    def _stop_all(self, rdirs: dict[str, str], last: str) -> None:
        """After the trainer's ``last`` step (or phase): wait for it to exit, then stop every
        receiver (``rdirs``: receiver id -> its directory)."""
        trainer, log = self.procs["trainer"]
        try:
            trainer.wait(timeout=120)
        except subprocess.TimeoutExpired:
            raise BenchError(f"trainer still running 120s after its last {last} -- log: {log}") from None
        self._check_alive(["trainer"])
        for d in rdirs.values():
            open(os.path.join(d, "stop"), "w").close()
        for rid in rdirs:
            p, log = self.procs[f"receiver-{rid}"]
            try:
                p.wait(timeout=60)
            except subprocess.TimeoutExpired:
                raise BenchError(f"receiver {rid} did not stop -- log: {log}") from None
            self._check_alive([f"receiver-{rid}"])

    def _counters(self, trainer):
        """The driver's counters (``COUNTER_FIELDS``): the root end's veth byte counters (tx:
        towards the store, rx: from it) and the CPU seconds of the trainer's ranks, the
        receiver(s) and moto (psutil, the processes' user + system time)."""
        import psutil

        def net(which):
            return file_counter(f"/sys/class/net/{self.link.host_if}/statistics/{which}_bytes")

        def cpu(pids):
            procs = {}

            def read():
                total = 0.0
                for pid in pids():
                    try:
                        p = procs.get(pid) or procs.setdefault(pid, psutil.Process(pid))
                        t = p.cpu_times()
                    except psutil.Error:  # a short-lived child, gone
                        continue
                    total += t.user + t.system
                return total
            return read

        tp = psutil.Process(trainer.pid)
        ranks = lambda: [c.pid for c in tp.children(recursive=True)] + [tp.pid]  # noqa: E731
        rx = lambda: [p.pid for name, (p, _) in self.procs.items() if name.startswith("receiver-")]  # noqa: E731
        return Sampler({"up_mb": net("tx"), "down_mb": net("rx"), "trainer_cpu_s": cpu(ranks),
                        "receiver_cpu_s": cpu(rx), "store_cpu_s": cpu(lambda: [self.moto.pid])}, period_s=0.05)

    def make_plan(self) -> list[dict]:
        """The steps the driver asks for, in order (``go/<step>.json``): the warm-up, then per
        rate ``--dense-steps`` steps with a dense refit after the nemo_dcr one (at the middle
        lr, the first variant: their nemo_dcr refits count in that case), then per lr, rate
        and repeat one step per variant, in turn (so each variant's refits are spread over
        the same stretch of the run).  Steps without a dense refit are checked bit for bit
        off the link (``verify``)."""
        args = self.args
        mid = args.lrs[len(args.lrs) // 2]

        def step(lr, mbit, variant, dense, warmup=False):
            stream, qdisc = VARIANTS[variant]
            return {"lr": lr, "link_mbit": mbit, "variant": variant, "stream": stream, "qdisc": qdisc,
                    "dense": dense, "verify": True, "warmup": warmup}

        plan = [step(mid, args.setup_mbit, args.variants[0], True, True) for _ in range(args.warmup)]
        plan += [step(mid, mbit, args.variants[0], True) for mbit in args.rates for _ in range(args.dense_steps)]
        plan += [step(lr, mbit, v, False) for lr in args.lrs for mbit in args.rates for _ in range(args.steps)
                 for v in args.variants]
        return plan

    def report_step(self, step: int, n: int, p: dict, row: dict, t_start: float) -> None:
        """Progress after a step; raises if its refit did not commit bit-exactly."""
        r = refit_record(row)
        tag = "warm-up" if p["warmup"] else f"{p['link_mbit']:g} Mbit/s {p['variant']}"
        dense = (f", dense {r['dense_s']:.1f}s ({r['speedup']:.1f}x; wire ratio {r['wire_ratio']:.0f}x)"
                 if "dense_s" in r else "")
        _progress(f"step {step}/{n} ({tag}, lr {p['lr']:g}): changed {r['changed_pct']:.2f}%, "
                  f"wire {r['wire_bytes']} B, nemo_dcr {r['dcr_s']:.2f}s (critical: {r['critical']}){dense}, "
                  f"bit-exact {'yes' if r['bit_exact'] else 'NO'}, {time.monotonic() - t_start:.0f}s elapsed")
        if not (r["committed"] and r["bit_exact"]):
            raise BenchError(f"step {step}: refit committed={r['committed']} bit_exact={r['bit_exact']} "
                             f"({r['verify']}) -- logs in {self.run_dir}")

    def execute(self) -> dict:
        args, cfg = self.args, self.cfg
        from nemo_dcr.protocol.signing import KEY_ENV, new_key_file

        t_start = time.monotonic()
        self.link.up(args.setup_mbit)
        _progress(f"link: {self.link.host_if} {self.link.host_addr} (root) <-> {self.link.ns_if} "
                  f"{self.link.ns_addr} (namespace {self.link.ns}), htb both directions")
        endpoint = f"http://{self.link.ns_addr}:{S3_PORT}"
        s3_env = {"AWS_ENDPOINT_URL": endpoint, "AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
                  "AWS_DEFAULT_REGION": "us-east-1", "NO_PROXY": self.link.ns_addr, "no_proxy": self.link.ns_addr}
        os.environ.update(s3_env)  # this driver's own store client (bucket, link probe)
        moto_exe = os.path.join(os.path.dirname(sys.executable), "moto_server")
        pin_trainer, pin_rest = (["taskset", "-c", "0"], ["taskset", "-c", "1"]) if args.pin else ([], [])
        self.moto = self._start("moto", [*self.link.exec_prefix(), *pin_rest, moto_exe, "-H", self.link.ns_addr,
                                         "-p", str(S3_PORT)], dict(os.environ))
        _wait_port(self.link.ns_addr, S3_PORT, self.moto)
        import s3fs

        s3fs.S3FileSystem(skip_instance_cache=True).mkdir(BUCKET)
        from nemo_dcr.transport.store import open_store

        probe_store = open_store(f"s3://{BUCKET}/linkprobe")
        link_checks = []
        for mbit in args.rates:
            self.link.set_rate(mbit)
            link_checks.append(measure_link(probe_store, mbit, args.probe_mib << 20))
            _progress(f"link probe at {mbit:g} Mbit/s: put {link_checks[-1]['put_mbit']} Mbit/s, "
                      f"get {link_checks[-1]['get_mbit']} Mbit/s through S3")
        self.link.set_rate(args.setup_mbit)

        cfg_path = os.path.join(self.run_dir, "config.json")
        with open(cfg_path, "w") as f:
            json.dump(cfg.to_dict(), f, indent=1)
        key_path = os.path.join(self.run_dir, "refit.key")
        new_key_file(key_path)
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", **{KEY_ENV: key_path})
        go_dir = os.path.join(self.run_dir, "go")
        os.makedirs(go_dir)
        plan_dir = os.path.join(self.run_dir, "rxplan")
        os.makedirs(plan_dir)
        trainer = self._start("trainer", [*pin_trainer, sys.executable, "-m", "torch.distributed.run", "--standalone",
                                f"--nproc-per-node={cfg.parallel.world_size}", "-m", "nemo_dcr_testbed.link_refit",
                                "trainer", "--config", cfg_path, "--dir", self.run_dir,
                                "--driver-pid", str(os.getpid())], env)
        rdirs = {}
        for rid in cfg.refit.receivers:
            rdirs[rid] = os.path.join(self.run_dir, f"receiver-{rid}")
            os.makedirs(rdirs[rid])
            self._start(f"receiver-{rid}", [*pin_rest, sys.executable, "-m", "nemo_dcr_testbed.link_refit", "receiver",
                                            "--store", cfg.store.uri, "--receiver-id", rid, "--model-id", cfg.refit.model_id,
                                            "--dir", rdirs[rid], "--timeout-s", str(args.step_timeout_s),
                                            "--driver-pid", str(os.getpid()), "--plans", plan_dir,
                                            "--local-dir", self.run_dir], env)
        _progress(f"trainer ({cfg.parallel.world_size} ranks, TP={cfg.parallel.tensor_model_parallel_size}) and "
                  f"{len(rdirs)} receiver(s) starting; logs in {self.run_dir}")
        deadline = time.monotonic() + args.step_timeout_s
        while not all(os.path.exists(os.path.join(d, "ready")) for d in rdirs.values()):
            self._check_alive()
            self.children.refresh()
            if time.monotonic() > deadline:
                raise BenchError(f"receivers not ready after {args.step_timeout_s:g}s (version 0 not loaded)")
            time.sleep(0.2)
        _progress(f"version 0 written and loaded ({time.monotonic() - t_start:.0f}s)")
        counters = self._counters(trainer)
        counters.start()
        _progress(f"counters sampling: {', '.join(k for k, log in counters.logs.items() if log.t)}")

        plan = self.make_plan()
        steps_path = os.path.join(self.run_dir, "steps.jsonl")
        rows: list[dict] = []
        sampled: dict[int, dict] = {}  # step -> its counters (rows are read again from the file each step)
        for step, p in enumerate(plan, 1):
            self.link.set_rate(p["link_mbit"])
            self.link.set_qdisc(p["qdisc"])
            _write_json_atomic(os.path.join(plan_dir, f"{step}.json"), {"stream": p["stream"]})
            t0 = time.monotonic()
            while not all(os.path.exists(os.path.join(plan_dir, f"{step}.ok")) for _ in rdirs):
                self._check_alive()
                if time.monotonic() - t0 > args.step_timeout_s:
                    raise BenchError(f"step {step}: the receiver did not take its plan -- logs in {self.run_dir}")
                time.sleep(0.05)
            _write_json_atomic(os.path.join(go_dir, f"{step}.json"), p)
            t0 = time.monotonic()
            while len(rows) < step:
                rows = _read_rows(steps_path)
                if len(rows) >= step:
                    break
                self._check_alive()
                self.children.refresh()
                if time.monotonic() - t0 > args.step_timeout_s:
                    raise BenchError(f"step {step} not finished after {args.step_timeout_s:g}s -- "
                                     f"logs in {self.run_dir}")
                time.sleep(0.2)
            row = rows[step - 1]
            t_a, t_b = row["dcr"]["t_start"], row["dcr"]["t_committed"]
            time.sleep(2 * counters.period_s)  # a sample after the decision
            sampled[step] = {k: round((log.at(t_b) - log.at(t_a)) / (1e6 if k.endswith("_mb") else 1), 4)
                             if log.t else None for k, log in counters.logs.items()}
            row["counters"] = sampled[step]
            self.report_step(step, len(plan), p, row, t_start)
        counters.stop()
        self._stop_all(rdirs, "step")
        for step, row in enumerate(rows, 1):
            row["counters"] = sampled[step]
        return {"records": [refit_record(row) for row in rows], "plan": plan, "link_checks": link_checks,
                "wall_s": time.monotonic() - t_start}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rates", default="50,200", help="link rates in Mbit/s (each direction)")
    ap.add_argument("--lrs", default="4.5e-7,2.4e-6,4.5e-6",
                    help="learning rates, one case each (the defaults change ~1%%, ~3%%, ~5%% of BF16 elements "
                         "per step on the default model; the measured changed_pct is reported)")
    ap.add_argument("--steps", type=int, default=3, help="refits per case (lr, rate, variant), each its own step")
    ap.add_argument("--dense-steps", type=int, default=3,
                    help="dense refits per rate (each after a nemo_dcr refit of the first variant, middle lr)")
    ap.add_argument("--variants", default="stream,nostream,stream+small-first",
                    help=f"what changes between refits of one trainer run: {', '.join(VARIANTS)} (streaming "
                         "receive on/off; the link's queueing, one FIFO or small packets first)")
    ap.add_argument("--pin", action="store_true",
                    help="pin the trainer ranks to CPU 0 and the receiver and the store to CPU 1 (taskset)")
    ap.add_argument("--warmup", type=int, default=1, help="steps at --setup-mbit before the cases (not reported "
                    "as cases: the first refits pay one-time costs)")
    ap.add_argument("--setup-mbit", type=float, default=10000.0,
                    help="link rate while version 0 and the warm-up steps cross it")
    ap.add_argument("--probe-mib", type=int, default=16, help="size of the link probe at each rate (MiB)")
    ap.add_argument("--step-timeout-s", type=float, default=1800.0)
    ap.add_argument("--out-dir", default=RESULTS, help="where <name>.json / .png go")
    ap.add_argument("--name", default="refit_link", help="file name of the JSON and the plot (default refit_link)")
    ap.add_argument("--run-dir", default=None, help="logs and per-step rows (default runs/link/<date-time>)")
    ap.add_argument("overrides", nargs="*", help="Hydra overrides for testbed/nemo_dcr_testbed/configs/demo.yaml (after the defaults: "
                    + " ".join(MODEL) + ")")
    ap.add_argument("--regroup", metavar="JSON", default=None,
                    help="rebuild the cases of an existing result JSON from its refits and rewrite it (no run)")
    ap.add_argument("--compare", metavar="JSON", nargs="+", default=None,
                    help="print the cases of result JSONs side by side (nemo_dcr s, speedup, speedup / ratio); no run")
    args = ap.parse_args(argv)
    if args.compare:
        return compare(args.compare)
    if args.regroup:
        return regroup(args.regroup)
    return run_cli("bench_refit_link", lambda: _main(args))


def _main(args) -> int:
    check_prerequisites()
    args.rates = _parse_floats(args.rates, "rates")
    args.lrs = _parse_floats(args.lrs, "lrs")
    args.variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    if not args.variants or any(v not in VARIANTS for v in args.variants):
        raise BenchError(f"--variants: a comma-separated list of {', '.join(VARIANTS)}", 2)
    if args.steps < 0 or args.warmup < 0 or args.dense_steps < 1:
        raise BenchError("--steps and --warmup must be >= 0 and --dense-steps >= 1", 2)
    run_dir = fresh_run_dir(args.run_dir, os.path.join(ROOT, "runs", "link", time.strftime("%Y%m%d-%H%M%S")))

    from nemo_dcr_testbed.config import describe_config_error, load_demo_config

    total = args.warmup + len(args.rates) * (args.dense_steps + args.steps * len(args.lrs) * len(args.variants))
    try:
        cfg = load_demo_config([*MODEL, f"run_dir={run_dir}", f"store.uri=s3://{BUCKET}/run", f"steps={total}",
                                "refit.model_id=refit-link", "refit.verify_dense=false", "refit.ack_timeout_s=900", "refit.pipeline=false",
                                *args.overrides])
    except Exception as e:  # noqa: BLE001 - a configuration error is the user's: one line
        raise BenchError(f"invalid configuration: {describe_config_error(e)}", 2) from None
    if cfg.receiver.runtime != "hf" or cfg.refit.verify_dense:
        raise BenchError("this benchmark runs the transformers receiver (receiver.runtime=hf) and does its own "
                         "dense verification (refit.verify_dense=false)", 2)
    os.makedirs(run_dir, exist_ok=True)

    stale = remove_stale_links()
    if stale:
        _progress(f"removed namespaces left by killed runs: {', '.join(stale)}")

    load0 = os.getloadavg()
    git = git_state(ROOT)
    run = Run(args, cfg, run_dir)
    out = execute_run(run)

    records = out["records"]
    for r, p in zip(records, out["plan"]):
        r["warmup"] = p["warmup"]
    cases = build_cases([r for r in records if not r["warmup"]], args.variants)
    m = cfg.model
    result = {
        "meta": {
            "command": shlex.join([sys.executable, *sys.argv]),
            "date": time.strftime("%Y-%m-%d %H:%M:%S %z"),
            "git": git,
            "machine": {"cpus": os.cpu_count(), "loadavg_start": [round(x, 2) for x in load0],
                        "loadavg_end": [round(x, 2) for x in os.getloadavg()]},
            "topology": ("store (moto_server, S3 API) in network namespace "
                         f"{run.link.ns} at {run.link.ns_addr}; trainer ranks, receiver and driver in the root "
                         f"namespace at {run.link.host_addr}; one veth pair, htb egress shaping on both ends at "
                         "the case's rate (trainer puts and receiver gets both cross it); gloo on loopback"),
            "link": {"namespace": run.link.ns, "host_if": run.link.host_if, "ns_if": run.link.ns_if,
                     "host_addr": run.link.host_addr, "ns_addr": run.link.ns_addr, "shaping": "htb, both ends"},
            "link_probe": out["link_checks"],
            "model": {**cfg.to_dict()["model"], "canonical_params": records[0]["canonical_numel"]},
            "tp": cfg.parallel.tensor_model_parallel_size,
            "receivers": cfg.refit.receivers,
            "coding": cfg.refit.coding,
            "chunk_bytes": cfg.refit.chunk_bytes,
            "variants": {v: {"stream": VARIANTS[v][0], "qdisc": VARIANTS[v][1]} for v in args.variants},
            "pinned": "trainer ranks on CPU 0, receiver and store on CPU 1 (taskset)" if args.pin else None,
            "rates_mbit": args.rates, "lrs": args.lrs, "steps_per_case": args.steps, "warmup_steps": args.warmup,
            "dense_steps_per_rate": args.dense_steps,
            "setup_mbit": args.setup_mbit, "overrides": args.overrides,
            "wall_s": round(out["wall_s"], 1), "run_dir": run_dir,
            "verification": {
                "bit_exact_refits": f"{sum(r['bit_exact'] for r in records)}/{len(records)}",
                "how": "after every refit the receiver compares its delta-refit model with the trainer's gathered "
                       "canonical state loaded into a second model (through the store on dense steps, from a "
                       "local file on the others), every parameter and buffer as integer views (compare_modules)",
                "negative_control": [c for r in records for c in r["negative_control"]],
            },
            "definitions": {
                "dcr_s": "end of optimizer.step() -> the trainer's joint commit decision recorded (rank 0)",
                "dense_s": "start of the trainer's gather of the canonical state -> the trainer has read every "
                           "receiver's ack that it loaded the dense checkpoint (gather, safetensors serialise, "
                           "put; receiver get, deserialise, load_state_dict into a second transformers model)",
                "stages": "nemo_dcr: slowest trainer rank's diff/project/encode/upload (encode and upload summed "
                          "over chunks, which run on the upload threads); the receiver's download (seconds during "
                          "which at least one chunk of the version was downloading, before the manifest when "
                          "streaming, or after it), decode (CPU seconds summed over its fetch threads, which decode while "
                          "later chunks download) and apply",
                "overlap": "dcr_s / slowest nemo_dcr stage",
                "rx_fetch_s": "the receiver's manifest -> last chunk arrival (what streaming leaves after the manifest)",
                "prefetched_share": "chunk bytes the receiver used as fetched and decoded before the manifest / "
                                    "wire bytes",
                "link_bound": "dense_bytes at the link rate (one crossing) takes longer than every CPU stage of "
                              "both refits (nemo_dcr diff/project/encode/decode/apply, dense "
                              "gather/serialize/deserialize/load)",
                "dcr_link_bound": "nemo_dcr wire bytes at the link rate take longer than every nemo_dcr CPU stage",
                "speedup_over_ratio": "speedup / wire_ratio",
                "dense_s (case)": "median of the dense refits at the case's rate (dense bytes and wall do not "
                                  "depend on the lr or the variant)",
                "timeline": "the critical path, consecutive segments from the step's end to the decision: the "
                            "trainer's diff+encode+upload (rank 0 until its last chunk put), the manifest put "
                            "and the receiver's poll until it read it, the chunks still arriving after it, the "
                            "receiver's decode tail + apply + ack, the trainer's ack poll + decision; "
                            "_first/_last_chunk_listed_s: when a receiver listing first / last showed a new "
                            "chunk of the version (streaming only)",
                "requests": "store calls by op:kind (transport/store/meter.py): the trainer's (all ranks) "
                            "for the version; the receiver's since its previous answer (idle polls included)",
                "up_mb / down_mb": "bytes on the link (root end veth tx / rx counters, headers included) "
                                   "between the step's end and the decision",
                "*_cpu_s": "CPU seconds (user + system) of the trainer ranks, the receiver, moto over the refit",
            },
        },
        "cases": cases,
        "warmup": [r for r in records if r["warmup"]],
    }
    os.makedirs(args.out_dir, exist_ok=True)
    json_path = os.path.join(args.out_dir, args.name + ".json")
    with open(json_path, "w") as f:
        json.dump(result, f, indent=1)
    print_table(cases)
    plot(cases, os.path.join(args.out_dir, args.name + ".png"))
    _progress(f"wrote {json_path} and {args.name}.png ({out['wall_s']:.0f}s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
