"""Relay tree over a rate-limited inter-cluster link: how many bytes cross the link, and how
long a refit takes, when R receivers on the far side read the origin store directly
(``store``) or through a relay tree (``relay``).

    sudo .venv/bin/python scripts/bench_relay_link.py [--rates 50,200] [--receivers 4] [--fanout 2]
        [--steps 2] [--lr 2.4e-6] [--model link|small] [--out-dir benchmarks/results] [hydra overrides ...]

Needs root (network namespace, veth pair, ``tc``); refuses to run otherwise.

Topology (one machine)::

    root namespace ("trainer cluster")                 namespace dcrrelay-<pid> ("rollout cluster")
    trainer ranks (torchrun, TP=2, gloo on lo)         relays (nemo-dcr relay) on <ns addr>:7000+i
    origin store: moto_server (S3) on <host addr>      receivers (nemo-dcr receive, transformers)
    this driver                                        the hop probe (below)
          <host addr>  veth dr<pid>a ===================== veth dr<pid>b  <ns addr>
                       htb egress at R Mbit/s  -->     <--  htb egress at R Mbit/s

The inter-cluster link is the veth pair, shaped with htb on both ends.  Inside the far
namespace everything talks over its own addresses, unshaped (the intra-cluster network).
The trainer's puts to the origin stay on the near side; everything a receiver or a relay
reads from the origin crosses the link.  ``cross_link_bytes`` is counted on the link: the
``tx_bytes`` of the near end's veth (the direction origin -> far side; IP and TCP headers
included), sampled every 20 ms, taken between the trainer's two timestamps of the refit
(end of the optimizer step, joint commit recorded).  The htb class counter of the same
interface is read around each step as a cross-check.

Cases, per link rate: ``store`` (every receiver's store URI is the origin) and ``relay``
(a relay tree of fanout ``--fanout`` on the far side; only the root relay reads the origin;
every node's upstream list ends with the origin, e.g. ``relay://r1,relay://r0,s3://...``).
The same trainer run and the same receiver processes' weights serve every case: the
receivers run with ``--persistent-weights``, and between the two topologies they are
stopped and started again over their own weights with the other store URI.  One warm-up
step after version 0 and one after the switch run at ``--setup-mbit`` and are not cases.

Bit-exactness: after each refit rank 0 of the trainer writes the canonical dense state it
gathered (outside the timed window) to a local file; the driver compares every receiver's
weights (the ``weights.bin`` file its parameters are mapped on) with it as integer views.
The first comparison is repeated with one bit flipped in a copy of a receiver tensor, which
must be reported (negative control).

The hop probe (after the cases, at each rate): from the far namespace, GETs of a small
object and of a chunk-sized object through the origin store directly (one link hop), the
root relay (link + one relay hop) and a leaf relay (link + two relay hops).  Probe keys are
not version chunks, so relays do not cache them: each GET travels the whole path.  From the
medians: the link's goodput, and each relay hop's added delay (fixed part from the small
object, and the store-and-forward time of one chunk).  ``scripts/project_1t.py`` reads
these as the relay's measured per-hop rates.

Writes ``<out-dir>/relay_link.{json,png}``; prints a table on stdout, progress on stderr.
"""
from __future__ import annotations

import argparse
import bisect
import json
import os
import re
import shlex
import socket
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
from dataclasses import dataclass, field

from nemo_dcr_testbed.linkbench import BenchError, check_prerequisites, execute_run, fresh_run_dir, git_state, progress, run_cli
from nemo_dcr_testbed.linkbench import CounterLog, Sampler, file_counter  # noqa: F401 - CounterLog: the tests use it from here
from nemo_dcr_testbed.linkbench import parse_floats as _parse_floats
from nemo_dcr_testbed.linkbench import read_rows as _read_rows
from nemo_dcr_testbed.linkbench import remove_stale_links as _remove_stale_links
from nemo_dcr_testbed.linkbench import sh as _sh
from nemo_dcr_testbed.linkbench import write_json_atomic as _write_json_atomic


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "benchmarks", "results")
MODELS = {
    # the model of scripts/bench_refit_link.py: 155.7 M canonical parameters, 311 MB BF16
    "link": ["model.num_layers=8", "model.hidden_size=1024", "model.num_attention_heads=16",
             "model.num_query_groups=4", "model.ffn_hidden_size=2816", "model.vocab_size=32000"],
    # a quick one for trying the script out
    "small": ["model.num_layers=4", "model.hidden_size=512", "model.num_attention_heads=8",
              "model.num_query_groups=4", "model.ffn_hidden_size=1408", "model.vocab_size=8000"],
}
NS_PREFIX = "dcrrelay-"
S3_PORT = 5100
RELAY_PORT0 = 7000
BUCKET = "relay-link"
RUN_PREFIX = "run"
PROBE_PREFIX = "bench/probe"
SAMPLE_S = 0.02


# ------------------------------------------------------------------------- arguments
def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The driver's arguments, checked (``BenchError`` with exit code 2 on bad input)."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rates", default="50,200", help="inter-cluster link rates in Mbit/s (each direction)")
    ap.add_argument("--receivers", type=int, default=4, help="receivers on the far side")
    ap.add_argument("--fanout", type=int, default=2, help="children per relay")
    ap.add_argument("--topologies", default="store,relay", help="cases per rate, in this order")
    ap.add_argument("--steps", type=int, default=2, help="optimizer steps (= refits) per case")
    ap.add_argument("--lr", type=float, default=2.4e-6,
                    help="learning rate (2.4e-6 changes ~3%% of BF16 elements per step on the link model)")
    ap.add_argument("--model", choices=sorted(MODELS), default="link",
                    help="link: the model of bench_refit_link.py (155.7 M parameters); small: a quicker one")
    ap.add_argument("--setup-mbit", type=float, default=10000.0,
                    help="link rate while version 0, the warm-up steps and the topology switch cross it")
    ap.add_argument("--probe-reps", type=int, default=5, help="GETs per path and size in the hop probe (0: none)")
    ap.add_argument("--step-timeout-s", type=float, default=900.0)
    ap.add_argument("--out-dir", default=RESULTS, help="where relay_link.json / .png go")
    ap.add_argument("--run-dir", default=None, help="logs and per-step rows (default runs/relay-link/<date-time>)")
    ap.add_argument("overrides", nargs="*", help="Hydra overrides for testbed/nemo_dcr_testbed/configs/demo.yaml")
    try:
        args = ap.parse_args(argv)
    except SystemExit as e:
        if e.code in (0, None):
            raise
        raise BenchError("bad arguments (see --help)", 2) from None
    args.rates = _parse_floats(args.rates, "rates")
    args.topologies = [t.strip() for t in args.topologies.split(",") if t.strip()]
    if not args.topologies or any(t not in ("store", "relay") for t in args.topologies) \
            or len(set(args.topologies)) != len(args.topologies):
        raise BenchError(f"--topologies must list store and/or relay once each, got {args.topologies}", 2)
    if args.receivers < 1 or args.fanout < 1 or args.steps < 1 or args.probe_reps < 0 or args.lr <= 0:
        raise BenchError("--receivers, --fanout and --steps must be >= 1, --probe-reps >= 0, --lr > 0", 2)
    if "relay" in args.topologies and args.fanout == 1 and args.receivers > 1:
        raise BenchError("--fanout 1 cannot join more than one receiver under one root relay", 2)
    return args


# --------------------------------------------------------------------------- the tree
@dataclass(frozen=True)
class RelayNode:
    name: str
    parent: str | None
    """The relay above this one (None: the root, which reads the origin)."""
    children: tuple[str, ...]
    """Relays or receivers below."""


@dataclass(frozen=True)
class Tree:
    relays: tuple[RelayNode, ...]
    """Root first, then level by level (start order: a parent before its children)."""
    receiver_parent: dict[str, str] = field(default_factory=dict)

    def ancestors(self, name: str) -> list[str]:
        """The relays above a relay or receiver, nearest first."""
        parents = {c: n.name for n in self.relays for c in n.children}
        out = []
        while name in parents:
            name = parents[name]
            out.append(name)
        return out

    def upstreams(self, name: str, addresses: dict[str, str], origin: str) -> str:
        """The node's ordered upstream list as a store URI: its ancestors nearest first, then
        the origin (``relay://a,relay://b,s3://...``)."""
        return ",".join([f"relay://{addresses[a]}" for a in self.ancestors(name)] + [origin])


def relay_tree(receivers: list[str], fanout: int) -> Tree:
    """The relays above ``receivers`` with ``fanout`` children each: receivers are grouped in
    runs of ``fanout`` under one relay each, those relays again, up to a single root relay
    (4 receivers, fanout 2: root r0 with r1 and r2, each with 2 receivers)."""
    if fanout < 1 or not receivers or (fanout == 1 and len(receivers) > 1):
        raise ValueError(f"no relay tree of fanout {fanout} over {len(receivers)} receivers")
    levels: list[list[tuple[str, ...]]] = []  # bottom-up: each level's groups of children
    below = list(receivers)
    while True:
        groups = [tuple(below[i:i + fanout]) for i in range(0, len(below), fanout)]
        levels.append(groups)
        if len(groups) == 1:
            break
        below = [f"_{len(levels)}_{i}" for i in range(len(groups))]
    # name top-down: r0 the root, then left to right per level
    names: dict[str, str] = {}
    ordered: list[tuple[str, tuple[str, ...]]] = []
    k = 0
    for depth, groups in enumerate(reversed(levels)):
        level_no = len(levels) - depth  # 1-based bottom-up index of this level
        for i, group in enumerate(groups):
            placeholder = f"_{level_no}_{i}"
            names[placeholder] = f"r{k}"
            ordered.append((placeholder, group))
            k += 1
    relays, receiver_parent = [], {}
    parent_of = {c: p for p, group in ordered for c in group}
    for placeholder, group in ordered:
        parent = parent_of.get(placeholder)
        kids = tuple(names.get(c, c) for c in group)
        relays.append(RelayNode(names[placeholder], names[parent] if parent else None, kids))
        for c in group:
            if c not in names:
                receiver_parent[c] = names[placeholder]
    return Tree(tuple(relays), receiver_parent)


# ------------------------------------------------------------------------ the counters
def tc_class_sent(text: str, classid: str = "1:10") -> int:
    """Bytes ``tc -s class show`` reports sent by class ``classid``."""
    m = re.search(rf"class htb {re.escape(classid)} .*?\n\s*Sent (\d+) bytes", text, re.S)
    if not m:
        raise BenchError(f"no htb class {classid} with a 'Sent N bytes' line in tc's output")
    return int(m.group(1))


# ------------------------------------------------------------------------- bit-exactness
def _int_view(t):
    from nemo_dcr.dtypes import int_view

    return int_view(t.contiguous())


def bit_differences(received: dict, reference: dict) -> list[str]:
    """Names whose bits differ or that exist on one side only: integer views (``torch.equal``
    on them), dtype and shape first; never a float comparison."""
    import torch

    out = sorted(set(received) ^ set(reference))
    for k in sorted(set(received) & set(reference)):
        a, b = received[k], reference[k]
        if a.dtype != b.dtype or a.shape != b.shape or not torch.equal(_int_view(a), _int_view(b)):
            out.append(k)
    return out


def read_persistent_weights(weights_dir: str) -> dict:
    """A receiver's parameters as stored by ``--persistent-weights`` (``weights.json``'s
    layout over ``weights.bin`` in ``<state dir>/weights``): copies of the bytes in the
    shared mapping (the page cache), which the receiver's model writes in place."""
    import torch

    with open(os.path.join(weights_dir, "weights.json")) as f:
        layout = json.load(f)["layout"]
    with open(os.path.join(weights_dir, "weights.bin"), "rb") as f:
        raw = f.read()
    out = {}
    for e in layout:
        blob = raw[e["offset"]: e["offset"] + e["nbytes"]]
        t = torch.frombuffer(bytearray(blob), dtype=torch.uint8) if e["nbytes"] else torch.empty(0, dtype=torch.uint8)
        out[e["name"]] = t.view(getattr(torch, e["dtype"])).view(e["shape"])
    return out


def verify(received: dict, reference: dict, *, negative_control: bool) -> dict:
    """One receiver against the dense reference.  With ``negative_control``, the same check
    on a copy with one bit flipped must report that tensor (``detected``), else ``MISSED``."""
    diff = bit_differences(received, reference)
    out = {"bit_exact": not diff and len(reference) > 0, "compared": len(set(received) & set(reference)),
           "differing": diff[:5], "differing_n": len(diff)}
    if negative_control:
        name = max(sorted(reference), key=lambda k: reference[k].numel())
        flipped = received[name].clone()
        _int_view(flipped).view(-1)[flipped.numel() // 2] ^= 1
        seen = bit_differences({**received, name: flipped}, reference)
        out["negative_control"] = "detected" if name in seen else "MISSED"
    return out


# ---------------------------------------------------------------------------- the link
def _progress(msg: str) -> None:
    progress("bench_relay_link", msg)


def remove_stale_links() -> list[str]:
    """Delete namespaces this script left behind when it was killed (``{NS_PREFIX}<pid>`` whose
    pid is gone) and whatever still runs in them; returns their names."""
    return _remove_stale_links(NS_PREFIX, "dr")


class Link:
    """A veth pair between the root namespace and a fresh namespace, with an htb class
    shaping the egress of each end at the same rate (as in bench_refit_link.py; its own
    namespace prefix and address block 10.232.0.0/16)."""

    def __init__(self) -> None:
        pid = os.getpid()
        self.ns = f"{NS_PREFIX}{pid}"
        self.host_if, self.ns_if = f"dr{pid}a", f"dr{pid}b"
        used = set(re.findall(r"inet (10\.232\.\d+\.\d+)/", _sh("ip", "-o", "-4", "addr", "show")))
        for k in range(16384):
            i = (pid + k) % 16384
            net, host = i >> 6, (i & 63) << 2
            a, b = f"10.232.{net}.{host + 1}", f"10.232.{net}.{host + 2}"
            if a not in used and b not in used:
                self.host_addr, self.ns_addr = a, b
                break
        else:
            raise BenchError("no free /30 left in 10.232.0.0/16 for the link")
        self.mbit: float | None = None
        self.created = False

    def _in_ns(self, *cmd: str) -> tuple[str, ...]:
        return ("ip", "netns", "exec", self.ns, *cmd)

    @staticmethod
    def _rate_args(mbit: float) -> tuple[str, ...]:
        rate = f"{int(round(mbit * 1000))}kbit"
        return ("rate", rate, "ceil", rate, "quantum", "60000")

    def up(self, mbit: float) -> None:
        self.created = True
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
            _sh(*pre, "tc", "class", "add", "dev", dev, "parent", "1:", "classid", "1:10", "htb",
                *self._rate_args(mbit))
        self.mbit = mbit

    def set_rate(self, mbit: float) -> None:
        if mbit == self.mbit:
            return
        for pre, dev in (((), self.host_if), (self._in_ns(), self.ns_if)):
            _sh(*pre, "tc", "class", "change", "dev", dev, "parent", "1:", "classid", "1:10", "htb",
                *self._rate_args(mbit))
        self.mbit = mbit

    def tc_sent(self) -> int:
        return tc_class_sent(_sh("tc", "-s", "class", "show", "dev", self.host_if))

    def exec_prefix(self) -> list[str]:
        return list(self._in_ns())

    def down(self) -> None:
        if not self.created:
            return
        self.created = False
        _sh("ip", "netns", "del", self.ns, check=False)
        _sh("ip", "link", "del", self.host_if, check=False)


def _wait_port(host: str, port: int, proc, what: str, timeout_s: float = 60.0, prefix: list[str] | None = None) -> None:
    deadline = time.monotonic() + timeout_s
    probe = None
    if prefix:  # the port is inside the far namespace: probe from there
        probe = [*prefix, sys.executable, "-c",
                 f"import socket; socket.create_connection(({host!r}, {port}), timeout=0.5)"]
    while True:
        if probe:
            ok = subprocess.run(probe, capture_output=True).returncode == 0
        else:
            try:
                with socket.create_connection((host, port), timeout=0.5):
                    ok = True
            except OSError:
                ok = False
        if ok:
            return
        if proc.poll() is not None:
            raise BenchError(f"{what} exited ({proc.returncode}) before listening on {host}:{port}")
        if time.monotonic() > deadline:
            raise BenchError(f"{what} not listening on {host}:{port} after {timeout_s:g}s")
        time.sleep(0.2)


# --------------------------------------------------------------------------- the results
def _med(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def _flat(d, prefix: str = "") -> dict[str, float]:
    """Numeric leaves of nested dicts as ``a.b.c``; list items that are dicts with a ``uri``
    (a relay's upstreams) as ``a.<uri>.c``; other lists are left out."""
    out = {}
    if isinstance(d, dict):
        for k, v in d.items():
            out.update(_flat(v, f"{prefix}{k}."))
    elif isinstance(d, list):
        for item in d:
            if isinstance(item, dict) and isinstance(item.get("uri"), str):
                out.update(_flat({k: v for k, v in item.items() if k != "uri"}, f"{prefix}{item['uri']}."))
    elif isinstance(d, (int, float)) and not isinstance(d, bool):
        out[prefix[:-1]] = d
    return out


def stats_delta(before: dict | None, after: dict | None) -> dict[str, float]:
    """Numeric leaves of two ``/v1/stats`` answers: after - before (nested keys joined by
    dots; leaves that did not change are left out)."""
    a, b = _flat(before or {}), _flat(after or {})
    return {k: b[k] - a.get(k, 0) for k in sorted(b) if b[k] - a.get(k, 0)}


def origin_chunk_bytes(delta: dict[str, float], origin: str) -> float | None:
    """From a root relay's stats delta: the chunk bytes it read from the origin upstream
    (keys naming the origin URI and chunk bytes), else its bytes read from it."""
    for want in ("chunk_bytes_read", "bytes_read"):
        hits = [v for k, v in delta.items() if origin in k and k.endswith(want)]
        if hits:
            return sum(hits)
    return None


def refit_record(row: dict, topology: str, cross: int, step_bytes: int, tc_bytes: int, busy, verdicts: list[dict],
                 relays: dict[str, dict[str, float]], origin: str) -> dict:
    st = row["stats"]
    acks = st.get("acks") or []
    rec = {
        "step": row["step"], "topology": topology, "link_mbit": row["plan"]["link_mbit"], "lr": row["plan"]["lr"],
        "changed_pct": 100 * st["changed"] / row["canonical_numel"], "canonical_numel": row["canonical_numel"],
        "chunks": st["chunks"],
        "wire_bytes": st["wire_bytes"], "committed": st["committed"], "wall_s": row["dcr"]["wall_s"],
        "cross_link_bytes": cross, "cross_link_ratio": cross / max(st["wire_bytes"], 1),
        "cross_link_bytes_step": step_bytes, "tc_class_bytes_step": tc_bytes,
        "upload_s": st.get("upload_s"), "commit_wait_s": st.get("commit_wait_s"),
        "rx_download_s": max((a["stats"].get("download_s", 0.0) for a in acks), default=None),
        "bit_exact": all(v["bit_exact"] for v in verdicts) and len(verdicts) > 0,
        "verify": verdicts,
    }
    if busy:
        rec["link_busy_s"], rec["link_busy_bytes"] = busy[0], busy[1]
        rec["link_goodput_mbit"] = busy[1] * 8 / max(busy[0], 1e-9) / 1e6
    if relays:
        rec["relays"] = relays
        root = relays.get("r0") or {}
        rec["origin_read_bytes"] = origin_chunk_bytes(root, origin)
    return rec


def case_entry(topology: str, mbit: float, receivers: int, refits: list[dict]) -> dict:
    """One case: medians over its refits (bytes, walls), all refits kept."""
    wire = _med([r["wire_bytes"] for r in refits])
    cross = _med([r["cross_link_bytes"] for r in refits])
    return {
        "topology": topology, "receivers": receivers, "link_mbit": mbit, "refits_n": len(refits),
        "changed_pct": _med([r["changed_pct"] for r in refits]),
        "wire_bytes": wire, "cross_link_bytes": cross, "cross_link_ratio": cross / max(wire, 1),
        "wall_s": _med([r["wall_s"] for r in refits]),
        "rx_download_s": _med([r["rx_download_s"] for r in refits]),
        "origin_read_bytes": _med([r.get("origin_read_bytes") for r in refits]),
        "link_goodput_mbit": _med([r.get("link_goodput_mbit") for r in refits]),
        "bit_exact": all(r["bit_exact"] for r in refits),
        "bit_exact_refits": f"{sum(r['bit_exact'] for r in refits)}/{len(refits)}",
        "committed": f"{sum(r['committed'] for r in refits)}/{len(refits)}",
        "refits": refits,
    }


def summarize_hops(probe: list[dict], chunk_bytes: int) -> dict:
    """Per-hop rates from the hop probe rows ({link_mbit, path, bytes, seconds: [...]}, the
    i-th seconds of every path and size measured in the same round): the link's goodput
    (chunk-sized minus small GET from the origin), and what each relay hop adds (the leaf
    relay's path has one more hop than the root relay's, which has one more than the
    origin's): its fixed delay (small object) and the time of a chunk.  Differences are
    paired by round, then the median is taken (over the rounds, and over the rates for the
    relay hops, which the link rate does not shape).  A hop whose chunk costs no more than
    its fixed delay has no measurable goodput (None)."""
    by = {(r["link_mbit"], r["path"], r["bytes"]): r["seconds"] for r in probe}
    rates = sorted({r["link_mbit"] for r in probe})
    sizes = sorted({r["bytes"] for r in probe})
    if len(sizes) < 2:
        raise ValueError("the hop probe needs a small and a chunk-sized object")
    small, big = sizes[0], sizes[-1]

    def paired(a: list[float] | None, b: list[float] | None) -> list[float]:
        return [y - x for x, y in zip(a, b)] if a and b else []

    links, hop_fixed, hop_chunk = [], [], []
    for m in rates:
        t = {(p, s): by.get((m, p, s)) for p in ("origin", "root", "leaf") for s in (small, big)}
        d = paired(t[("origin", small)], t[("origin", big)])
        if d:
            g = (big - small) * 8 / max(statistics.median(d), 1e-9) / 1e6
            links.append({"link_mbit": m, "goodput_mbit": g, "efficiency": g / m,
                          "get_small_s": statistics.median(t[("origin", small)]),
                          "get_chunk_s": statistics.median(t[("origin", big)])})
        for a, b in (("origin", "root"), ("root", "leaf")):
            hop_fixed += paired(t[(a, small)], t[(b, small)])
            hop_chunk += paired(t[(a, big)], t[(b, big)])
    out = {"probe_small_bytes": small, "probe_chunk_bytes": big, "chunk_bytes": chunk_bytes, "link": links}
    if links:
        out["link_efficiency"] = statistics.median(x["efficiency"] for x in links)
    if hop_fixed and hop_chunk:
        fixed, chunk = statistics.median(hop_fixed), statistics.median(hop_chunk)
        out["relay_hop_fixed_s"] = fixed
        out["relay_hop_chunk_s"] = chunk
        out["relay_hop_goodput_gbps"] = (big - small) / (chunk - fixed) / 1e9 if chunk > fixed else None
        out["relay_hop_samples"] = len(hop_chunk)
    return out


def print_table(cases: list[dict]) -> None:
    cols = [("topology", 8), ("receivers", 9), ("link Mbit/s", 11), ("changed %", 9), ("wire B", 10),
            ("cross-link B", 12), ("cross/wire", 10), ("origin read B", 13), ("wall s", 7), ("rx download s", 13),
            ("bit-exact", 9)]
    print(" ".join(n.rjust(w) for n, w in cols), flush=True)
    for c in cases:
        cells = [c["topology"], str(c["receivers"]), f"{c['link_mbit']:g}", f"{c['changed_pct']:.2f}",
                 f"{c['wire_bytes']:.0f}", f"{c['cross_link_bytes']:.0f}", f"{c['cross_link_ratio']:.2f}x",
                 "-" if c["origin_read_bytes"] is None else f"{c['origin_read_bytes']:.0f}",
                 f"{c['wall_s']:.2f}", "-" if c["rx_download_s"] is None else f"{c['rx_download_s']:.2f}",
                 c["bit_exact_refits"]]
        print(" ".join(v.rjust(w) for v, (_, w) in zip(cells, cols)), flush=True)


def plot(cases: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a1, a2) = plt.subplots(1, 2, figsize=(12, 4.5))
    rates = sorted({c["link_mbit"] for c in cases})
    tops = [t for t in ("store", "relay") if any(c["topology"] == t for c in cases)]
    w = 0.8 / max(len(tops), 1)
    for j, t in enumerate(tops):
        cs = {c["link_mbit"]: c for c in cases if c["topology"] == t}
        xs = [i + j * w for i in range(len(rates))]
        a1.bar(xs, [cs[m]["cross_link_ratio"] if m in cs else 0 for m in rates], w, color=f"C{j}", label=t)
        a2.bar(xs, [cs[m]["wall_s"] if m in cs else 0 for m in rates], w, color=f"C{j}", label=t)
    receivers = cases[0]["receivers"] if cases else 0
    a1.axhline(1.2, color="k", ls="--", lw=0.8, label="1.2 x wire bytes")
    a1.axhline(receivers, color="k", ls=":", lw=0.8, label=f"{receivers} x wire bytes")
    for ax in (a1, a2):
        ax.set_xticks([i + w * (len(tops) - 1) / 2 for i in range(len(rates))], [f"{m:g} Mbit/s" for m in rates])
        ax.grid(alpha=0.3, axis="y")
        ax.legend(fontsize=8)
    a1.set(ylabel="bytes on the link / wire bytes", title=f"inter-cluster bytes per refit ({receivers} receivers)")
    a2.set(ylabel="seconds (optimizer step end -> joint commit)", title="refit wall (medians)")
    fig.tight_layout()
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)


# ---------------------------------------------------------------- roles run by the driver
def trainer_main(argv: list[str]) -> int:
    """Every trainer rank (under torchrun): one optimizer step per ``go/<s>.json``, the
    product's refit hook after it, then (outside the timed window) the dense canonical state
    to ``<dir>/ref/v<s>.safetensors`` on rank 0 for the driver's bit-exact check."""
    ap = argparse.ArgumentParser(prog="bench_relay_link.py trainer")
    ap.add_argument("--config", required=True)
    ap.add_argument("--dir", required=True)
    ap.add_argument("--driver-pid", type=int, default=0)
    args = ap.parse_args(argv)

    from dataclasses import asdict

    import torch.distributed as dist
    from safetensors.torch import save_file

    from nemo_dcr_testbed.config import DemoConfig
    from nemo_dcr_testbed.link_refit import _wait_json
    from nemo_dcr_testbed.run_trainer import build_trainer

    with open(args.config) as f:
        cfg = DemoConfig.from_dict(json.load(f))
    trainer, hook = build_trainer(cfg)
    marks: dict[str, float] = {}
    trainer.add_post_step_hook(lambda tr, step: marks.__setitem__("step_end", time.monotonic()))
    trainer.add_post_step_hook(hook)
    trainer.add_post_step_hook(lambda tr, step: marks.__setitem__("committed", time.monotonic()))
    rank = dist.get_rank()
    os.makedirs(os.path.join(args.dir, "ref"), exist_ok=True)
    for step in range(1, cfg.steps + 1):
        plan = _wait_json(os.path.join(args.dir, "go", f"{step}.json"), args.driver_pid)
        if plan is None:
            print("bench_relay_link trainer: the driver is gone; stopping", file=sys.stderr, flush=True)
            return 1
        for group in trainer.optimizer.param_groups:
            group["lr"] = float(plan["lr"])
        result = trainer.train_step()
        stats = hook.last_stats
        dcr = {"wall_s": marks["committed"] - marks["step_end"], "t_start": marks["step_end"],
               "t_committed": marks["committed"]}
        state = hook.dense_state()  # collective; rank 0 gets the canonical tensors
        if rank == 0:
            path = os.path.join(args.dir, "ref", f"v{step}.safetensors")
            save_file({k: v.contiguous() for k, v in state.items()}, path + ".tmp")
            os.replace(path + ".tmp", path)
            row = {"step": step, "plan": plan, "loss": result.loss, "canonical_numel": hook.sender.canonical_numel,
                   "dcr": dcr, "stats": asdict(stats), "reference": path}
            with open(os.path.join(args.dir, "steps.jsonl"), "a") as f:
                f.write(json.dumps(row) + "\n")
        del state
    trainer.close()
    return 0


def probe_main(argv: list[str]) -> int:
    """In the far namespace: timed GETs of the probe objects through each path; one JSON
    line per (path, size) with the seconds of every repetition."""
    ap = argparse.ArgumentParser(prog="bench_relay_link.py probe")
    ap.add_argument("--path", action="append", required=True, help="NAME=STORE_URI")
    ap.add_argument("--sizes", required=True)
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args(argv)
    from nemo_dcr.transport.store import open_store

    paths = dict(p.split("=", 1) for p in args.path)
    stores = {n: open_store(u) for n, u in paths.items()}
    sizes = [int(s) for s in args.sizes.split(",")]
    times: dict[tuple[str, int], list[float]] = {(n, s): [] for n in stores for s in sizes}
    for n, st in stores.items():  # connections made, one untimed GET each
        st.get(f"{PROBE_PREFIX}/{sizes[0]}")
    for _ in range(args.reps):
        for s in sizes:
            for n, st in stores.items():
                time.sleep(0.15)  # past a relay's coalescing window: every GET goes the whole path
                t0 = time.perf_counter()
                blob = st.get(f"{PROBE_PREFIX}/{s}")
                times[(n, s)].append(time.perf_counter() - t0)
                if len(blob) != s:
                    raise SystemExit(f"probe {n}: {len(blob)} bytes, expected {s}")
    for (n, s), ts in times.items():
        print(json.dumps({"path": n, "bytes": s, "seconds": ts}), flush=True)
    return 0


# ------------------------------------------------------------------------------- the run
class Run:
    def __init__(self, args, cfg, run_dir: str):
        from nemo_dcr_testbed.demo import _Children

        self.args, self.cfg, self.run_dir = args, cfg, run_dir
        self.children = _Children()
        self.link = Link()
        self.procs: dict[str, tuple[object, str]] = {}
        self.relay_addr: dict[str, str] = {}
        self.sampler: Sampler | None = None
        self._cleaned = False

    def cleanup(self) -> None:
        if self._cleaned:
            return
        self._cleaned = True
        try:
            if self.sampler:
                self.sampler.stop()
            self.children.stop(grace_s=5.0)
        finally:
            self.link.down()

    def _start(self, name: str, cmd: list[str], env: dict):
        log_path = os.path.join(self.run_dir, f"{name}.log")
        log = open(log_path, "a")
        p = self.children.start(cmd, log, env)
        self.procs[name] = (p, log_path)
        return p

    def _check_alive(self, names=None) -> None:
        from nemo_dcr_testbed.demo import _last_error

        for name, (p, log) in self.procs.items():
            if (names is None or name in names) and p.poll() is not None and \
                    (p.returncode != 0 or name == "moto" or name.startswith("relay-")):
                raise BenchError(f"{name} exited ({p.returncode}): {_last_error(log)} -- log: {log}")

    def _stop(self, name: str) -> None:
        p, _ = self.procs.pop(name)
        if p.poll() is None:
            os.killpg(p.pid, 15)
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, 9)
                p.wait(timeout=10)

    def relay_stats(self) -> dict[str, dict]:
        out = {}
        for name, addr in self.relay_addr.items():
            try:
                with urllib.request.urlopen(f"http://{addr}/v1/stats", timeout=10) as r:
                    out[name] = json.loads(r.read())
            except (OSError, ValueError) as e:
                out[name] = {"error": f"{type(e).__name__}: {e}"}
        return out

    # -- the far side's processes
    def start_relays(self, tree: Tree, env: dict) -> None:
        for i, node in enumerate(tree.relays):
            self.relay_addr[node.name] = f"{self.link.ns_addr}:{RELAY_PORT0 + i}"
        for node in tree.relays:
            host, port = self.relay_addr[node.name].split(":")
            spool = os.path.join(self.run_dir, f"spool-{node.name}")
            cmd = [*self.link.exec_prefix(), sys.executable, "-m", "nemo_dcr.cli", "relay",
                   "--upstream", tree.upstreams(node.name, self.relay_addr, self.origin),
                   "--listen", f"{host}:{port}", "--spool", spool]
            p = self._start(f"relay-{node.name}", cmd, env)
            _wait_port(host, int(port), p, f"relay {node.name}", prefix=self.link.exec_prefix())
        _progress("relays up: " + ", ".join(
            f"{n.name} at {self.relay_addr[n.name]} <- {tree.upstreams(n.name, self.relay_addr, 'origin')}"
            for n in tree.relays))

    def start_receivers(self, store_uris: dict[str, str], env: dict) -> None:
        """One receiver after the other, each once the previous one is ready: loading the
        model peaks at several times its size, and four at once can exhaust the memory."""
        cfg = self.cfg
        for rid in cfg.refit.receivers:
            cmd = [*self.link.exec_prefix(), sys.executable, "-m", "nemo_dcr.cli", "receive",
                   "--store", store_uris[rid], "--receiver-id", rid, "--model-id", cfg.refit.model_id,
                   "--runtime", "hf", "--persistent-weights", "--state-dir", self.state_dirs[rid],
                   "--init-dir", self.init_dir, "--timeout-s", str(self.args.step_timeout_s)]
            self._start(f"receiver-{rid}", cmd, env)
            _, log = self.procs[f"receiver-{rid}"]
            deadline = time.monotonic() + self.args.step_timeout_s
            while True:  # ready = its stdout's "ready" line (the log is stdout + stderr)
                with open(log) as f:
                    if any('"ready": true' in line for line in f):
                        break
                self._check_alive()
                self.children.refresh()
                if time.monotonic() > deadline:
                    raise BenchError(f"receiver {rid} not ready after {self.args.step_timeout_s:g}s -- log: {log}")
                time.sleep(0.2)

    def stop_receivers(self) -> None:
        for rid in self.cfg.refit.receivers:
            self._stop(f"receiver-{rid}")

    # -- one step
    def step(self, n: int, plan: dict, topology: str, verify_all: bool, first_check: bool) -> dict:
        self.link.set_rate(plan["link_mbit"])
        time.sleep(0.3)  # let the shaper's queue drain at the new rate
        stats0 = self.relay_stats() if topology == "relay" else {}
        tc0, t_go = self.link.tc_sent(), time.monotonic()
        _write_json_atomic(os.path.join(self.go_dir, f"{n}.json"), plan)
        t0 = time.monotonic()
        while True:
            rows = _read_rows(self.steps_path)
            if len(rows) >= n:
                break
            self._check_alive()
            self.children.refresh()
            if time.monotonic() - t0 > self.args.step_timeout_s:
                raise BenchError(f"step {n} not finished after {self.args.step_timeout_s:g}s -- logs in {self.run_dir}")
            time.sleep(0.1)
        row = rows[n - 1]
        t_row = time.monotonic()
        time.sleep(2 * SAMPLE_S)
        tc1 = self.link.tc_sent()
        stats1 = self.relay_stats() if topology == "relay" else {}
        log = self.sampler.logs["tx"]
        t_a, t_b = row["dcr"]["t_start"], row["dcr"]["t_committed"]
        cross, step_bytes = log.delta(t_a, t_b), log.delta(t_go, t_row)
        busy = log.busy_span(t_a, t_b)
        verdicts = []
        if verify_all:
            from safetensors.torch import load_file

            reference = load_file(row["reference"])
            for i, rid in enumerate(self.cfg.refit.receivers):
                v = verify(read_persistent_weights(os.path.join(self.state_dirs[rid], "weights")), reference,
                           negative_control=first_check and i == 0)
                verdicts.append({"receiver": rid, **v})
            del reference
        os.unlink(row["reference"])
        relays = {k: stats_delta(stats0.get(k), stats1.get(k)) for k in stats1}
        return refit_record(row, topology, cross, step_bytes, tc1 - tc0, busy, verdicts, relays, self.origin)

    # -- the hop probe
    def hop_probe(self, env: dict, tree: Tree) -> list[dict]:
        from nemo_dcr.transport.store import open_store

        store = open_store(self.origin)
        sizes = [4096, int(self.cfg.refit.chunk_bytes)]
        for s in sizes:
            store.put(f"{PROBE_PREFIX}/{s}", os.urandom(s))
        leaf = tree.relays[-1].name
        paths = {"origin": self.origin, "root": f"relay://{self.relay_addr[tree.relays[0].name]}"}
        if leaf != tree.relays[0].name:
            paths["leaf"] = f"relay://{self.relay_addr[leaf]}"
        rows = []
        for mbit in self.args.rates:
            self.link.set_rate(mbit)
            time.sleep(0.3)
            cmd = [*self.link.exec_prefix(), sys.executable, os.path.abspath(__file__), "probe",
                   "--sizes", ",".join(map(str, sizes)), "--reps", str(self.args.probe_reps),
                   *[a for n, u in paths.items() for a in ("--path", f"{n}={u}")]]
            p = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900)
            if p.returncode != 0:
                raise BenchError(f"hop probe failed: {' '.join((p.stderr or p.stdout).split())[-400:]}")
            for line in p.stdout.splitlines():
                if line.startswith("{"):
                    rows.append({"link_mbit": mbit, **json.loads(line)})
            _progress(f"hop probe at {mbit:g} Mbit/s: " + ", ".join(
                f"{r['path']} {r['bytes']} B {statistics.median(r['seconds']) * 1e3:.1f} ms"
                for r in rows if r["link_mbit"] == mbit))
        for s in sizes:
            store.delete(f"{PROBE_PREFIX}/{s}")
        return rows

    def execute(self) -> dict:
        args, cfg = self.args, self.cfg
        from nemo_dcr.integrations.hf_export import WEIGHTS_KEY, download_checkpoint
        from nemo_dcr.protocol.signing import KEY_ENV, new_key_file
        from nemo_dcr.transport.store import open_store

        t_start = time.monotonic()
        self.link.up(args.setup_mbit)
        _progress(f"link: {self.link.host_if} {self.link.host_addr} (root, origin side) <-> {self.link.ns_if} "
                  f"{self.link.ns_addr} (namespace {self.link.ns}, receivers and relays), htb both directions")
        endpoint = f"http://{self.link.host_addr}:{S3_PORT}"
        s3_env = {"AWS_ENDPOINT_URL": endpoint, "AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
                  "AWS_DEFAULT_REGION": "us-east-1", "NO_PROXY": f"{self.link.host_addr},{self.link.ns_addr}",
                  "no_proxy": f"{self.link.host_addr},{self.link.ns_addr}"}
        os.environ.update(s3_env)
        moto_exe = os.path.join(os.path.dirname(sys.executable), "moto_server")
        moto = self._start("moto", [moto_exe, "-H", self.link.host_addr, "-p", str(S3_PORT)], dict(os.environ))
        _wait_port(self.link.host_addr, S3_PORT, moto, "moto_server")
        import s3fs

        s3fs.S3FileSystem(skip_instance_cache=True).mkdir(BUCKET)
        self.origin = cfg.store.uri
        self.sampler = Sampler({"tx": file_counter(f"/sys/class/net/{self.link.host_if}/statistics/tx_bytes")},
                               SAMPLE_S)
        self.sampler.start()

        cfg_path = os.path.join(self.run_dir, "config.json")
        with open(cfg_path, "w") as f:
            json.dump(cfg.to_dict(), f, indent=1)
        key_path = os.path.join(self.run_dir, "refit.key")
        new_key_file(key_path)
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", **{KEY_ENV: key_path})
        self.go_dir = os.path.join(self.run_dir, "go")
        os.makedirs(self.go_dir)
        self.steps_path = os.path.join(self.run_dir, "steps.jsonl")
        self._start("trainer", [sys.executable, "-m", "torch.distributed.run", "--standalone",
                                f"--nproc-per-node={cfg.parallel.world_size}", os.path.abspath(__file__), "trainer",
                                "--config", cfg_path, "--dir", self.run_dir, "--driver-pid", str(os.getpid())], env)
        store = open_store(self.origin)
        deadline = time.monotonic() + args.step_timeout_s
        while not store.exists(WEIGHTS_KEY):
            self._check_alive()
            self.children.refresh()
            if time.monotonic() > deadline:
                raise BenchError("the trainer wrote no version 0 in time")
            time.sleep(0.5)
        time.sleep(2.0)
        self.init_dir = download_checkpoint(store, os.path.join(self.run_dir, "init"))  # near side, not the link
        self.state_dirs = {rid: os.path.join(self.run_dir, f"receiver-{rid}") for rid in cfg.refit.receivers}
        tree = relay_tree(list(cfg.refit.receivers), args.fanout)
        _progress(f"version 0 written ({time.monotonic() - t_start:.0f}s); receivers starting")

        records, n = [], 0
        first_check = True
        for ti, topology in enumerate(args.topologies):
            if topology == "relay":
                self.start_relays(tree, env)
                uris = {rid: tree.upstreams(rid, self.relay_addr, self.origin) for rid in cfg.refit.receivers}
            else:
                uris = {rid: self.origin for rid in cfg.refit.receivers}
            if ti:
                self.stop_receivers()
            self.link.set_rate(args.setup_mbit)
            self.start_receivers(uris, env)
            first_check = True
            _progress(f"{topology}: {len(uris)} receivers ready ({time.monotonic() - t_start:.0f}s); store URIs: "
                      + "; ".join(f"{k}={v}" for k, v in uris.items()))
            plan = [{"lr": args.lr, "link_mbit": args.setup_mbit, "warmup": True}]
            plan += [{"lr": args.lr, "link_mbit": m, "warmup": False} for m in args.rates for _ in range(args.steps)]
            for p in plan:
                n += 1
                r = self.step(n, {**p, "topology": topology}, topology, verify_all=True, first_check=first_check)
                first_check = False  # one negative control per topology (set again at the next switch)
                r["warmup"] = p["warmup"]
                records.append(r)
                tag = "warm-up" if p["warmup"] else f"{p['link_mbit']:g} Mbit/s"
                _progress(f"step {n} ({topology}, {tag}): changed {r['changed_pct']:.2f}%, wire {r['wire_bytes']} B, "
                          f"on the link {r['cross_link_bytes']} B ({r['cross_link_ratio']:.2f}x), wall "
                          f"{r['wall_s']:.2f}s, bit-exact {'yes' if r['bit_exact'] else 'NO'}, "
                          f"{time.monotonic() - t_start:.0f}s elapsed")
                if not (r["committed"] and r["bit_exact"]):
                    raise BenchError(f"step {n}: committed={r['committed']} bit_exact={r['bit_exact']} "
                                     f"({r['verify']}) -- logs in {self.run_dir}")
        probe = []
        if "relay" in args.topologies and args.probe_reps:
            probe = self.hop_probe(env, tree)
        trainer, log = self.procs["trainer"]
        try:
            trainer.wait(timeout=120)
        except subprocess.TimeoutExpired:
            raise BenchError(f"trainer still running 120s after its last step -- log: {log}") from None
        self._check_alive(["trainer"])
        return {"records": records, "probe": probe, "tree": tree, "wall_s": time.monotonic() - t_start}


def _main(args) -> int:
    check_prerequisites()
    run_dir = fresh_run_dir(args.run_dir, os.path.join(ROOT, "runs", "relay-link", time.strftime("%Y%m%d-%H%M%S")))
    from nemo_dcr_testbed.config import describe_config_error, load_demo_config

    rids = [f"rx{i}" for i in range(args.receivers)]
    total = len(args.topologies) * (1 + args.steps * len(args.rates))
    try:
        cfg = load_demo_config([*MODELS[args.model], f"run_dir={run_dir}", f"store.uri=s3://{BUCKET}/{RUN_PREFIX}",
                                f"steps={total}", "refit.model_id=relay-link", "refit.verify_dense=false",
                                "refit.ack_timeout_s=900", "refit.pipeline=false", f"refit.receivers=[{','.join(rids)}]", *args.overrides])
    except Exception as e:  # noqa: BLE001 - a configuration error is the user's: one line
        raise BenchError(f"invalid configuration: {describe_config_error(e)}", 2) from None
    if cfg.receiver.runtime != "hf" or cfg.refit.verify_dense:
        raise BenchError("this benchmark runs transformers receivers (receiver.runtime=hf) and verifies by itself "
                         "(refit.verify_dense=false)", 2)
    os.makedirs(run_dir, exist_ok=True)
    stale = remove_stale_links()
    if stale:
        _progress(f"removed namespaces left by killed runs: {', '.join(stale)}")

    load0 = os.getloadavg()
    git = git_state(ROOT)
    run = Run(args, cfg, run_dir)
    out = execute_run(run)

    records = out["records"]
    cases = []
    for t in args.topologies:
        for m in args.rates:
            mine = [r for r in records if not r["warmup"] and r["topology"] == t and r["link_mbit"] == m]
            cases.append(case_entry(t, m, args.receivers, mine))
    hops = summarize_hops(out["probe"], int(cfg.refit.chunk_bytes)) if out["probe"] else None
    tree: Tree = out["tree"]
    m = cfg.model
    expected = {}
    for mbit in args.rates:
        s = next((c for c in cases if c["topology"] == "store" and c["link_mbit"] == mbit), None)
        r = next((c for c in cases if c["topology"] == "relay" and c["link_mbit"] == mbit), None)
        if s and r:
            expected[f"{mbit:g}"] = {
                "relay_cross_link_le_1.2x_wire": r["cross_link_bytes"] <= 1.2 * r["wire_bytes"],
                "store_cross_link_over_wire": s["cross_link_ratio"],
                "relay_wall_le_store_wall": r["wall_s"] <= s["wall_s"],
                "relay_over_store_wall": r["wall_s"] / s["wall_s"]}
    result = {
        "meta": {
            "command": shlex.join([sys.executable, *sys.argv]),
            "date": time.strftime("%Y-%m-%d %H:%M:%S %z"), "git": git,
            "machine": {"cpus": os.cpu_count(), "loadavg_start": [round(x, 2) for x in load0],
                        "loadavg_end": [round(x, 2) for x in os.getloadavg()]},
            "topology": ("trainer ranks (TP=%d, gloo on lo) and the origin store (moto_server, S3 API) in the root "
                         "namespace at %s; %d receivers (nemo-dcr receive, transformers, --persistent-weights) and "
                         "the relays (nemo-dcr relay) in namespace %s at %s, talking over its own addresses "
                         "(unshaped); one veth pair between them, htb egress shaping on both ends at the case's "
                         "rate" % (cfg.parallel.tensor_model_parallel_size, run.link.host_addr, args.receivers,
                                   run.link.ns, run.link.ns_addr)),
            "relay_tree": [{"name": n.name, "parent": n.parent, "children": list(n.children)} for n in tree.relays],
            "fanout": args.fanout,
            "model": {"preset": args.model, **cfg.to_dict()["model"],
                      "canonical_params": records[0]["canonical_numel"]},
            "lr": args.lr, "rates_mbit": args.rates, "steps_per_case": args.steps,
            "setup_mbit": args.setup_mbit, "chunk_bytes": cfg.refit.chunk_bytes, "overrides": args.overrides,
            "wall_s": round(out["wall_s"], 1), "run_dir": run_dir,
            "verification": {
                "bit_exact_refits": f"{sum(r['bit_exact'] for r in records)}/{len(records)}",
                "how": "after every refit (warm-ups included) each receiver's parameters, read from the weights.bin "
                       "its model is mapped on, against the trainer's gathered canonical state of that version: "
                       "names, dtypes, shapes, then torch.equal on integer views",
                "negative_control": [v["negative_control"] for r in records for v in r["verify"]
                                     if "negative_control" in v],
            },
            "definitions": {
                "cross_link_bytes": "tx_bytes of the near end's veth (origin -> far side, headers included) between "
                                    "the end of the optimizer step and the joint commit (20 ms samples, "
                                    "interpolated)",
                "cross_link_bytes_step": "the same from the driver's go to the trainer's row (training step, "
                                         "receivers' and relays' polling included)",
                "tc_class_bytes_step": "the htb class's Sent counter over the same window as cross_link_bytes_step",
                "wall_s": "end of optimizer.step() -> the trainer's joint commit decision recorded (rank 0)",
                "origin_read_bytes": "relay: the root relay's chunk bytes read from the origin upstream "
                                     "(its /v1/stats, delta over the step)",
                "link_goodput_mbit": "bytes over the span in which the link counter grew (>= 16 KiB per 20 ms)",
            },
        },
        "cases": cases,
        "expected": expected,
        "hops": hops,
        "hop_probe": out["probe"],
        "warmup": [r for r in records if r["warmup"]],
    }
    os.makedirs(args.out_dir, exist_ok=True)
    json_path = os.path.join(args.out_dir, "relay_link.json")
    with open(json_path, "w") as f:
        json.dump(result, f, indent=1)
    print_table(cases)
    if hops:
        print(json.dumps({k: v for k, v in hops.items() if k != "link"}), flush=True)
    plot(cases, os.path.join(args.out_dir, "relay_link.png"))
    _progress(f"wrote {json_path} and relay_link.png ({out['wall_s']:.0f}s)")
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "trainer":
        return trainer_main(argv[1:])
    if argv and argv[0] == "probe":
        return probe_main(argv[1:])
    return run_cli("bench_relay_link", lambda: _main(parse_args(argv)))


if __name__ == "__main__":
    sys.exit(main())
