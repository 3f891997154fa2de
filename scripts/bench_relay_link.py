"""Relay tree over a rate-limited inter-cluster link: how many bytes cross the link, and how
long a refit takes, when R receivers on the far side read the origin store directly
(``store``) or through a relay tree (``relay``).

    sudo .venv/bin/python scripts/bench_relay_link.py [--rates 50,200] [--receivers 4] [--fanout 2 | --fanouts 2,2,4]
        [--topologies store,relay] [--kill-relay r1] [--steps 2] [--lr 2.4e-6] [--model link|small]
        [--out-dir benchmarks/results] [--out-name relay_link] [hydra overrides ...]

The 16-receiver, three-level tree (``benchmarks/results/scale_tree.{json,png}``)::

    sudo .venv/bin/python scripts/bench_relay_link.py --fanouts 2,2,4 --model small --topologies store,relay \
        --rates 50,200 --steps 2 --kill-relay r1 --probe-reps 0 --out-name scale_tree

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
(end of the optimizer step on the first rank to end it, joint commit recorded).  The htb class counter of the same
interface is read around each step as a cross-check.

Cases, per link rate: ``store`` (every receiver's store URI is the origin) and ``relay``
(a relay tree on the far side; only the root relay reads the origin; every node's upstream
list ends with the origin, e.g. ``relay://r1,relay://r0,s3://...``).  The tree: ``--fanout
F`` groups the receivers F per relay, those relays F per relay, up to one root;
``--fanouts A,B,C`` shapes it per level instead: the root has A child relays, each of
those B, each of those C receivers (A*B*C receivers; ``meta.levels`` = 3, the number of
relay levels, the root being level 1).  Relays are named r0 (the root), then level by
level, left to right.

``--kill-relay NAME`` adds one refit after the relay cases, at the last rate, in which the
driver SIGKILLs relay NAME (a relay below the root) as soon as its log shows the version
(its first object of it): its children re-parent to the next upstream of their lists (the
grandparent), which serves them from what it holds.  That case (``relay_killed``: which,
when, what it held) is ``reparented`` when each child relay of the killed one read chunk
bytes of the version from a remaining upstream and every receiver below it is bit-exact.

Every case records ``origin_read_bytes``: the version's chunk bytes read from the origin
by anyone (moto_server's request log: each GET of a chunk key, counted as the whole
object; the relay cases must stay within 1.1x the version's wire bytes), and a
``timeline``: for each relay level when its first and last relay first held an object of
the version, and when the first and the last receiver acknowledged it applied (the ``ts``
of the relays' ``version`` and the receivers' ack log events), in seconds after the end of
the optimizer step, with each receiver's lag behind the first.  ``meta.memory``: the
receivers' summed RSS (sampled every 0.5 s) and each one's peak (VmHWM).
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
root relay (link + one relay hop) and a leaf relay (link + one more relay hop per level
below the root; the deepest relay not killed).  Probe keys are
not version chunks, so relays do not cache them: each GET travels the whole path.  From the
medians: the link's goodput, and each relay hop's added delay (fixed part from the small
object, and the store-and-forward time of one chunk).  ``scripts/project_1t.py`` reads
these as the relay's measured per-hop rates.

Writes ``<out-dir>/<out-name>.{json,png}`` (``relay_link`` by default); prints a table on
stdout, progress on stderr.
"""
from __future__ import annotations

import argparse
import bisect
import json
import math
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
    ap.add_argument("--receivers", type=int, default=None,
                    help="receivers on the far side (default 4; with --fanouts, the product of the fanouts)")
    ap.add_argument("--fanout", type=int, default=2, help="children per relay (a tree as deep as it needs)")
    ap.add_argument("--fanouts", default=None,
                    help="the tree per relay level instead, root first: 2,2,4 = a root with 2 relays, each with "
                         "2 relays, each with 4 receivers (7 relays in 3 levels, 16 receivers)")
    ap.add_argument("--kill-relay", default=None, metavar="NAME",
                    help="one more refit after the relay cases, at the last rate, in which relay NAME (not the "
                         "root; r1 is the root's first child) is SIGKILLed once its log shows the version")
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
    ap.add_argument("--out-dir", default=RESULTS, help="where the JSON and PNG go")
    ap.add_argument("--out-name", default="relay_link", help="their name: <out-dir>/<out-name>.{json,png}")
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
    if args.fanouts is not None:
        args.fanouts = parse_fanouts(args.fanouts)
        if args.receivers is None:
            args.receivers = math.prod(args.fanouts)
        elif args.receivers != math.prod(args.fanouts):
            raise BenchError(f"--fanouts {','.join(map(str, args.fanouts))} seats {math.prod(args.fanouts)} "
                             f"receivers, --receivers says {args.receivers}", 2)
    elif args.receivers is None:
        args.receivers = 4
    if args.receivers < 1 or args.fanout < 1 or args.steps < 1 or args.probe_reps < 0 or args.lr <= 0:
        raise BenchError("--receivers, --fanout and --steps must be >= 1, --probe-reps >= 0, --lr > 0", 2)
    if "relay" in args.topologies and args.fanouts is None and args.fanout == 1 and args.receivers > 1:
        raise BenchError("--fanout 1 cannot join more than one receiver under one root relay", 2)
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.-]*", args.out_name):
        raise BenchError(f"--out-name must be a plain file name (letters, digits, _ . -), got {args.out_name!r}", 2)
    if args.kill_relay is not None:
        if "relay" not in args.topologies:
            raise BenchError("--kill-relay needs the relay topology", 2)
        tree = build_tree(args)
        if args.kill_relay not in {n.name for n in tree.relays[1:]}:
            below = ", ".join(n.name for n in tree.relays[1:])
            raise BenchError(f"--kill-relay must name a relay below the root ({below}), got {args.kill_relay!r}"
                             if below else "--kill-relay needs a tree with relays below the root", 2)
    return args


def parse_fanouts(text: str) -> list[int]:
    """``2,2,4`` -> [2, 2, 4]: children per relay, level by level from the root."""
    try:
        vals = [int(x) for x in text.split(",")]
    except ValueError:
        raise BenchError(f"--fanouts must be comma-separated integers, got {text!r}", 2) from None
    if not vals or any(v < 1 for v in vals):
        raise BenchError(f"--fanouts must list integers >= 1, got {text!r}", 2)
    return vals


def build_tree(args) -> "Tree":
    """The relay tree of the arguments: ``--fanouts`` if given, else ``--fanout``."""
    rids = receiver_ids(args.receivers)
    return relay_tree_levels(rids, args.fanouts) if args.fanouts else relay_tree(rids, args.fanout)


def receiver_ids(n: int) -> list[str]:
    return [f"rx{i}" for i in range(n)]


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

    def levels(self) -> list[list[str]]:
        """Relay names per level: ``[[root], [its child relays], ...]``, left to right."""
        out: list[list[str]] = []
        for n in self.relays:
            depth = len(self.ancestors(n.name))
            while len(out) <= depth:
                out.append([])
            out[depth].append(n.name)
        return out

    def below(self, name: str) -> list[str]:
        """Every relay and receiver under relay ``name`` (depth first)."""
        kids = {n.name: n.children for n in self.relays}
        out = []
        for c in kids.get(name, ()):
            out.append(c)
            out += self.below(c)
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


def relay_tree_levels(receivers: list[str], fanouts: list[int]) -> Tree:
    """A tree shaped per level: the root has ``fanouts[0]`` child relays, each of those
    ``fanouts[1]``, ..., and each relay of the last level ``fanouts[-1]`` receivers, so
    ``len(fanouts)`` levels of relays (the root is level 1) over ``prod(fanouts)`` receivers,
    which fill the last level's relays in order.  Names as :func:`relay_tree`'s: r0 the
    root, then level by level, left to right (2,2,4: r1 r2; r3 r4 under r1, r5 r6 under r2;
    rx0-rx3 under r3)."""
    if not fanouts or any(f < 1 for f in fanouts):
        raise ValueError(f"fanouts must be integers >= 1, got {fanouts}")
    if len(receivers) != math.prod(fanouts):
        raise ValueError(f"fanouts {fanouts} seat {math.prod(fanouts)} receivers, not {len(receivers)}")
    level, k = ["r0"], 1
    children: dict[str, tuple[str, ...]] = {}
    for f in fanouts[:-1]:
        below = []
        for name in level:
            children[name] = tuple(f"r{k + i}" for i in range(f))
            below += children[name]
            k += f
        level = below
    f = fanouts[-1]
    for i, name in enumerate(level):
        children[name] = tuple(receivers[i * f:(i + 1) * f])
    parent = {c: p for p, cs in children.items() for c in cs}
    order = sorted(children, key=lambda n: int(n[1:]))
    relays = tuple(RelayNode(name, parent.get(name), children[name]) for name in order)
    return Tree(relays, {rx: parent[rx] for rx in receivers})


# ------------------------------------------------------------------------ the counters
def probe_leaf(tree: Tree, killed: set[str]) -> str:
    """The relay the hop probe reads through as "leaf": the deepest one (the last of the
    deepest level) that is neither killed nor below a killed relay."""
    gone = set(killed) | {x for k in killed for x in tree.below(k)}
    return next(n for level in reversed(tree.levels()) for n in reversed(level) if n not in gone)


def tc_class_sent(text: str, classid: str = "1:10") -> int:
    """Bytes ``tc -s class show`` reports sent by class ``classid``."""
    m = re.search(rf"class htb {re.escape(classid)} .*?\n\s*Sent (\d+) bytes", text, re.S)
    if not m:
        raise BenchError(f"no htb class {classid} with a 'Sent N bytes' line in tc's output")
    return int(m.group(1))


_ANSI = r"(?:\x1b\[[0-9;]*m)*"


def origin_chunk_gets(moto_log: str, bucket: str, prefix: str) -> dict[str, int]:
    """GETs answered 200/206 per chunk key (``v/<n>/chunks/...``, the run's prefix taken off)
    in moto_server's request log (werkzeug's lines, colour codes and all)."""
    pat = re.compile(rf'"{_ANSI}GET /{re.escape(bucket)}/{re.escape(prefix)}/(v/\d+/chunks/[^ ?]+) HTTP/[0-9.]+'
                     rf'{_ANSI}" (?:200|206) ')
    out: dict[str, int] = {}
    for m in pat.finditer(moto_log):
        out[m.group(1)] = out.get(m.group(1), 0) + 1
    return out


def origin_reads(gets: dict[str, int], sizes: dict[str, int]) -> dict:
    """One version's reads of the origin: ``sizes`` its chunk keys and their sizes, ``gets``
    the GETs per key (:func:`origin_chunk_gets`); each GET counts as the whole object (every
    reader of the tree fetches whole chunks)."""
    n = {k: gets.get(k, 0) for k in sizes}
    return {"origin_read_bytes": sum(n[k] * sizes[k] for k in sizes), "origin_chunk_gets": sum(n.values()),
            "origin_chunks": len(sizes), "origin_chunks_read_twice": sum(1 for v in n.values() if v > 1),
            "origin_chunks_never_read": sum(1 for v in n.values() if v == 0)}


def first_events(text: str, match) -> list[dict]:
    """The JSON event lines of a log (lines that open with ``{``) for which ``match(e)``."""
    out = []
    for line in text.splitlines():
        if line.startswith("{"):
            try:
                e = json.loads(line)
            except ValueError:
                continue
            if isinstance(e, dict) and match(e):
                out.append(e)
    return out


def level_times(levels: list[list[str]], relay_ts: dict[str, float | None], receiver_ts: dict[str, float | None],
                t0: float) -> dict:
    """When the first and the last node of each level had a version, in seconds after ``t0``:
    ``relay_ts[name]`` is when relay ``name`` first held an object of it, ``receiver_ts[rid]``
    when receiver ``rid`` answered it ok (applied); None: not seen (listed as missing).  Also
    each receiver's lag behind the first receiver."""
    def span(names, ts):
        got = {n: ts.get(n) for n in names}
        seen = [t for t in got.values() if t is not None]
        return {"nodes": len(names), "first_s": round(min(seen) - t0, 3) if seen else None,
                "last_s": round(max(seen) - t0, 3) if seen else None,
                "missing": sorted(n for n, t in got.items() if t is None)}

    out = [{"level": i + 1, **span(names, relay_ts)} for i, names in enumerate(levels)]
    out.append({"level": "receivers", **span(sorted(receiver_ts), receiver_ts)})
    seen = [t for t in receiver_ts.values() if t is not None]
    lag = {rid: (round(t - min(seen), 3) if t is not None else None) for rid, t in receiver_ts.items()}
    return {"levels": out, "receiver_lag_s": lag}


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
        "rank0_wall_s": row["dcr"].get("rank0_wall_s"),
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
        rec["root_relay_origin_bytes"] = origin_chunk_bytes(root, origin)
    return rec


def timeline_medians(refits: list[dict]) -> dict | None:
    """Medians over refits of each level's first / last arrival and each receiver's lag
    (:func:`level_times` per refit, its ``timeline``)."""
    tls = [r["timeline"] for r in refits if r.get("timeline")]
    if not tls:
        return None
    levels = [{"level": lv["level"], "nodes": lv["nodes"],
               "first_s": _med([t["levels"][i]["first_s"] for t in tls]),
               "last_s": _med([t["levels"][i]["last_s"] for t in tls]),
               "missing": sorted({n for t in tls for n in t["levels"][i]["missing"]})}
              for i, lv in enumerate(tls[0]["levels"])]
    lag = {rid: _med([t["receiver_lag_s"].get(rid) for t in tls]) for rid in tls[0]["receiver_lag_s"]}
    return {"levels": levels, "receiver_lag_s": lag}


def case_entry(topology: str, mbit: float, receivers: int, refits: list[dict]) -> dict:
    """One case: medians over its refits (bytes, walls, per-level arrivals), all refits kept."""
    wire = _med([r["wire_bytes"] for r in refits])
    cross = _med([r["cross_link_bytes"] for r in refits])
    origin = _med([r.get("origin_read_bytes") for r in refits])
    killed = next((r["relay_killed"] for r in refits if r.get("relay_killed")), None)
    out = {
        "topology": topology, "label": topology if killed is None else f"{topology}, {killed['name']} killed",
        "receivers": receivers, "link_mbit": mbit, "refits_n": len(refits),
        "changed_pct": _med([r["changed_pct"] for r in refits]),
        "wire_bytes": wire, "cross_link_bytes": cross, "cross_link_ratio": cross / max(wire, 1),
        "wall_s": _med([r["wall_s"] for r in refits]),
        "rx_download_s": _med([r["rx_download_s"] for r in refits]),
        "origin_read_bytes": origin, "origin_read_ratio": None if origin is None else origin / max(wire, 1),
        "origin_chunk_gets": _med([r.get("origin_chunk_gets") for r in refits]),
        "origin_chunks_read_twice": max((r.get("origin_chunks_read_twice") or 0 for r in refits), default=0),
        "root_relay_origin_bytes": _med([r.get("root_relay_origin_bytes") for r in refits]),
        "link_goodput_mbit": _med([r.get("link_goodput_mbit") for r in refits]),
        "bit_exact": all(r["bit_exact"] for r in refits) and len(refits) > 0,
        "bit_exact_refits": f"{sum(r['bit_exact'] for r in refits)}/{len(refits)}",
        "committed": f"{sum(r['committed'] for r in refits)}/{len(refits)}",
        "timeline": timeline_medians(refits),
    }
    if topology == "relay" and origin is not None:
        out["origin_read_le_1.1x_wire"] = origin <= 1.1 * wire
    if killed is not None:
        out["relay_killed"] = killed
        out["reparented"] = all(r.get("reparented") for r in refits if r.get("relay_killed"))
    out["refits"] = refits
    return out


def summarize_hops(probe: list[dict], chunk_bytes: int, leaf_hops: int = 1) -> dict:
    """Per-hop rates from the hop probe rows ({link_mbit, path, bytes, seconds: [...]}, the
    i-th seconds of every path and size measured in the same round): the link's goodput
    (chunk-sized minus small GET from the origin), and what each relay hop adds (the leaf
    relay's path has one more hop than the root relay's, which has one more than the
    origin's): its fixed delay (small object) and the time of a chunk.  Differences are
    paired by round, then the median is taken (over the rounds, and over the rates for the
    relay hops, which the link rate does not shape).  ``leaf_hops``: relay hops from the
    root relay down to the leaf probed (2 in a tree of three levels); the leaf's difference
    to the root is divided by it.  A hop whose chunk costs no more than its fixed delay has
    no measurable goodput (None)."""
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
        for a, b, hops in (("origin", "root", 1), ("root", "leaf", leaf_hops)):
            hop_fixed += [d / hops for d in paired(t[(a, small)], t[(b, small)])]
            hop_chunk += [d / hops for d in paired(t[(a, big)], t[(b, big)])]
    out = {"probe_small_bytes": small, "probe_chunk_bytes": big, "chunk_bytes": chunk_bytes, "leaf_hops": leaf_hops,
           "link": links}
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
    cols = [("case", 16), ("receivers", 9), ("link Mbit/s", 11), ("changed %", 9), ("wire B", 10),
            ("cross-link B", 12), ("cross/wire", 10), ("origin read B", 13), ("wall s", 7), ("rx download s", 13),
            ("bit-exact", 9)]
    print(" ".join(n.rjust(w) for n, w in cols), flush=True)
    for c in cases:
        cells = [c.get("label", c["topology"]), str(c["receivers"]), f"{c['link_mbit']:g}", f"{c['changed_pct']:.2f}",
                 f"{c['wire_bytes']:.0f}", f"{c['cross_link_bytes']:.0f}", f"{c['cross_link_ratio']:.2f}x",
                 "-" if c["origin_read_bytes"] is None else f"{c['origin_read_bytes']:.0f}",
                 f"{c['wall_s']:.2f}", "-" if c["rx_download_s"] is None else f"{c['rx_download_s']:.2f}",
                 c["bit_exact_refits"]]
        print(" ".join(v.rjust(w) for v, (_, w) in zip(cells, cols)), flush=True)


def plot(cases: list[dict], path: str) -> None:
    """Per case (a topology at a rate; the kill case apart): bytes on the link and read from
    the origin over wire bytes, the refit wall, and when each level first / last had the
    version (relay cases)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    timed = [c for c in cases if c.get("timeline") and len(c["timeline"]["levels"]) > 1]
    fig, axes = plt.subplots(1, 3 if timed else 2, figsize=(17 if timed else 12, 4.8))
    a1, a2 = axes[0], axes[1]
    labels = [f"{c.get('label', c['topology'])}\n{c['link_mbit']:g} Mbit/s" for c in cases]
    xs = range(len(cases))
    a1.bar([x - 0.2 for x in xs], [c["cross_link_ratio"] for c in cases], 0.4, color="C0", label="on the link")
    a1.bar([x + 0.2 for x in xs], [c.get("origin_read_ratio") or 0 for c in cases], 0.4, color="C1",
           label="read from the origin")
    a2.bar(list(xs), [c["wall_s"] for c in cases], 0.6, color=["C3" if c.get("relay_killed") else "C2" for c in cases])
    receivers = cases[0]["receivers"] if cases else 0
    a1.axhline(1.1, color="k", ls="--", lw=0.8, label="1.1 x wire bytes")
    a1.axhline(receivers, color="k", ls=":", lw=0.8, label=f"{receivers} x wire bytes")
    for ax in (a1, a2):
        ax.set_xticks(list(xs), labels, fontsize=8)
        ax.grid(alpha=0.3, axis="y")
    a1.legend(fontsize=8)
    a1.set(ylabel="bytes / wire bytes", yscale="log", title=f"bytes per refit ({receivers} receivers)")
    a2.set(ylabel="seconds (optimizer step end -> joint commit)", title="refit wall (medians)")
    if timed:
        a3 = axes[2]
        h = 0.8 / len(timed)
        for j, c in enumerate(timed):
            lv = c["timeline"]["levels"]
            ys = [i + j * h for i in range(len(lv))]
            lefts = [v["first_s"] or 0 for v in lv]
            widths = [max((v["last_s"] or 0) - (v["first_s"] or 0), 0.02) for v in lv]
            a3.barh(ys, widths, h, left=lefts, color=f"C{j}", label=labels[cases.index(c)].replace("\n", ", "))
            if c.get("relay_killed"):
                k = c["relay_killed"]
                a3.axvline(k["at_s"], color=f"C{j}", ls="--", lw=1, label=f"{k['name']} killed")
        n = len(timed[0]["timeline"]["levels"])
        a3.set_yticks([i + h * (len(timed) - 1) / 2 for i in range(n)],
                      [f"relay level {v['level']}" if v["level"] != "receivers" else "receivers (ack)"
                       for v in timed[0]["timeline"]["levels"]])
        a3.invert_yaxis()
        a3.set_xlim(left=min([0.0] + [v["first_s"] for c in timed for v in c["timeline"]["levels"]
                                      if v["first_s"] is not None]))
        a3.grid(alpha=0.3, axis="x")
        a3.legend(fontsize=7)
        a3.set(xlabel="seconds after the optimizer step's end (first rank)",
               title="first .. last node of each level with the version")
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

    import torch
    import torch.distributed as dist
    from safetensors.torch import save_file

    from nemo_dcr_testbed.config import DemoConfig
    from nemo_dcr_testbed.link_refit import _wait_json
    from nemo_dcr_testbed.run_trainer import build_trainer

    with open(args.config) as f:
        cfg = DemoConfig.from_dict(json.load(f))
    trainer, hook = build_trainer(cfg)
    marks: dict[str, float] = {}
    trainer.add_post_step_hook(lambda tr, step: marks.update(step_end=time.monotonic(), step_end_wall=time.time()))
    trainer.add_post_step_hook(hook)
    trainer.add_post_step_hook(lambda tr, step: marks.update(committed=time.monotonic(), committed_wall=time.time()))
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
        # the refit starts when the FIRST rank ends its step: a rank ahead of rank 0 (a loaded
        # machine) uploads its chunks before rank 0's mark; CLOCK_MONOTONIC is one clock per machine
        first = torch.tensor([marks["step_end"], marks["step_end_wall"]], dtype=torch.float64)
        dist.all_reduce(first, op=dist.ReduceOp.MIN)
        t_start, t_start_wall = first.tolist()
        dcr = {"wall_s": marks["committed"] - t_start, "t_start": t_start, "t_committed": marks["committed"],
               "t_start_wall": t_start_wall, "t_committed_wall": marks["committed_wall"],
               "rank0_wall_s": marks["committed"] - marks["step_end"]}
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
class LogTail:
    """The JSON event lines appended to a log since the last look."""

    def __init__(self, path: str) -> None:
        self.path, self.offset, self.rest = path, 0, ""

    def new_events(self, match) -> list[dict]:
        try:
            with open(self.path) as f:
                f.seek(self.offset)
                text = f.read()
                self.offset = f.tell()
        except OSError:
            return []
        text, self.rest = (self.rest + text).rsplit("\n", 1) if "\n" in self.rest + text else ("", self.rest + text)
        return first_events(text, match)


def proc_tree_status(pid: int, field: str) -> int:
    """The sum of ``field`` (``VmRSS``, ``VmHWM``: kB in ``/proc/<pid>/status``) over ``pid``
    and its descendants, in bytes; processes gone meanwhile count 0."""
    total, todo = 0, [pid]
    while todo:
        p = todo.pop()
        try:
            with open(f"/proc/{p}/status") as f:
                m = re.search(rf"^{field}:\s+(\d+) kB", f.read(), re.M)
            total += int(m.group(1)) * 1024 if m else 0
            for task in os.listdir(f"/proc/{p}/task"):
                with open(f"/proc/{p}/task/{task}/children") as f:
                    todo += [int(c) for c in f.read().split()]
        except (OSError, ValueError):
            continue
    return total


def mem_available() -> int:
    with open("/proc/meminfo") as f:
        return int(re.search(r"^MemAvailable:\s+(\d+) kB", f.read(), re.M).group(1)) * 1024


class Run:
    def __init__(self, args, cfg, run_dir: str):
        from nemo_dcr_testbed.demo import _Children

        self.args, self.cfg, self.run_dir = args, cfg, run_dir
        self.children = _Children()
        self.link = Link()
        self.procs: dict[str, tuple[object, str]] = {}
        self.relay_addr: dict[str, str] = {}
        self.killed: dict[str, str] = {}  # relay name -> the address it had
        self.tree: Tree = build_tree(args)
        self.sampler: Sampler | None = None
        self.memory: Sampler | None = None
        self.hwm: dict[str, int] = {}  # receiver -> its processes' peak RSS (VmHWM), bytes
        self._cleaned = False

    def cleanup(self) -> None:
        if self._cleaned:
            return
        self._cleaned = True
        try:
            for sampler in (self.sampler, self.memory):
                if sampler:
                    sampler.stop()
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
        self.note_receiver_peaks()
        for rid in self.cfg.refit.receivers:
            self._stop(f"receiver-{rid}")

    # -- memory
    def receivers_rss(self) -> int:
        """RSS of every receiver process (and its children) now, bytes."""
        return sum(proc_tree_status(p.pid, "VmRSS") for name, (p, _) in list(self.procs.items())
                   if name.startswith("receiver-"))

    def note_receiver_peaks(self) -> None:
        for name, (p, _) in list(self.procs.items()):
            if name.startswith("receiver-"):
                rid = name[len("receiver-"):]
                self.hwm[rid] = max(self.hwm.get(rid, 0), proc_tree_status(p.pid, "VmHWM"))

    # -- the relay killed during a version
    def kill_relay(self, name: str, stats0: dict) -> dict:
        """SIGKILL relay ``name`` now; what it had read of the version (its stats just before)."""
        addr = self.relay_addr[name]
        held = None
        try:
            with urllib.request.urlopen(f"http://{addr}/v1/stats", timeout=2) as r:
                now = json.loads(r.read())
            held = now["upstream_chunk_bytes"] - (stats0.get(name) or {}).get("upstream_chunk_bytes", 0)
        except (OSError, ValueError, KeyError):
            pass
        p, _ = self.procs.pop(f"relay-{name}")
        t = time.time()
        os.killpg(p.pid, 9)
        p.wait(timeout=30)
        self.killed[name] = self.relay_addr.pop(name)
        _progress(f"killed relay {name} (SIGKILL) holding {held} chunk bytes of the version")
        return {"name": name, "level": len(self.tree.ancestors(name)) + 1, "signal": "SIGKILL", "t_wall": t,
                "held_chunk_bytes": held,
                "trigger": "its log's first 'version' event of the version (the first object it held)"}

    def reparenting(self, name: str, relays: dict[str, dict[str, float]], verdicts: list[dict],
                    committed: bool) -> tuple[bool, dict]:
        """Whether the subtree of the killed relay ``name`` got the version through the
        remaining upstreams: each child relay read chunk bytes of it from an upstream that is
        not ``name``, and every receiver below ``name`` is bit-exact (for a killed leaf relay,
        whose children are receivers, the latter alone)."""
        gone = f"relay://{self.killed[name]}"
        node = next(n for n in self.tree.relays if n.name == name)
        detail = {}
        for c in node.children:
            if c not in relays:
                continue
            d = relays[c]
            rest = sum(v for k, v in d.items() if k.startswith("upstreams.") and k.endswith(".chunk_bytes_read")
                       and not k.startswith(f"upstreams.{gone}."))
            detail[c] = {"chunk_bytes_from_remaining": rest,
                         "chunk_bytes_from_killed": d.get(f"upstreams.{gone}.chunk_bytes_read", 0),
                         "failures_on_killed": d.get(f"upstreams.{gone}.failures", 0)}
        below = set(self.tree.below(name))
        rx = [v for v in verdicts if v["receiver"] in below]
        ok = committed and bool(rx) and all(v["bit_exact"] for v in rx) and all(
            d["chunk_bytes_from_remaining"] > 0 for d in detail.values())
        return ok, {"child_relays": detail, "receivers_below": len(rx),
                    "receivers_below_bit_exact": sum(v["bit_exact"] for v in rx)}

    def timeline(self, n: int, topology: str, t0: float) -> dict:
        """Per level, when its first / last node had version ``n`` (seconds after ``t0``):
        relays from their logs' ``version`` events, receivers from their ok acks."""
        def first_ts(log: str, match) -> float | None:
            try:
                with open(log) as f:
                    hits = first_events(f.read(), match)
            except OSError:
                return None
            return hits[0]["ts"] if hits and "ts" in hits[0] else None

        relay_ts = {}
        if topology == "relay":
            for node in self.tree.relays:
                relay_ts[node.name] = first_ts(os.path.join(self.run_dir, f"relay-{node.name}.log"),
                                               lambda e: e.get("relay") == "version" and e.get("version") == n)
        rx_ts = {rid: first_ts(os.path.join(self.run_dir, f"receiver-{rid}.log"),
                               lambda e: e.get("version") == n and e.get("ok") is True and "receiver" in e)
                 for rid in self.cfg.refit.receivers}
        return level_times(self.tree.levels() if topology == "relay" else [], relay_ts, rx_ts, t0)

    # -- one step
    def step(self, n: int, plan: dict, topology: str, verify_all: bool, first_check: bool) -> dict:
        self.link.set_rate(plan["link_mbit"])
        time.sleep(0.3)  # let the shaper's queue drain at the new rate
        stats0 = self.relay_stats() if topology == "relay" else {}
        victim, killed = plan.get("kill"), None
        watch = LogTail(self.procs[f"relay-{victim}"][1]) if victim else None
        tc0, t_go = self.link.tc_sent(), time.monotonic()
        _write_json_atomic(os.path.join(self.go_dir, f"{n}.json"), plan)
        t0 = time.monotonic()
        while True:
            rows = _read_rows(self.steps_path)
            if len(rows) >= n:
                break
            if watch is not None and killed is None and watch.new_events(
                    lambda e: e.get("relay") == "version" and e.get("version") == n):
                killed = self.kill_relay(victim, stats0)
            self._check_alive()
            self.children.refresh()
            if time.monotonic() - t0 > self.args.step_timeout_s:
                raise BenchError(f"step {n} not finished after {self.args.step_timeout_s:g}s -- logs in {self.run_dir}")
            time.sleep(0.02 if watch is not None and killed is None else 0.1)
        if victim and killed is None:
            raise BenchError(f"step {n}: relay {victim} never held an object of version {n} before the commit, so it "
                             f"was not killed during the version -- log: {self.procs[f'relay-{victim}'][1]}")
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
        rec = refit_record(row, topology, cross, step_bytes, tc1 - tc0, busy, verdicts, relays, self.origin)
        from nemo_dcr.protocol.keys import version_prefix
        from nemo_dcr.transport.store.base import list_sizes

        rec["version"] = row["stats"]["version"]
        rec["timeline"] = self.timeline(rec["version"], topology, row["dcr"]["t_start_wall"])
        rec["_chunk_sizes"] = dict(list_sizes(self.store, f"{version_prefix(rec['version'])}/chunks/"))
        if killed:
            killed["at_s"] = round(killed.pop("t_wall") - row["dcr"]["t_start_wall"], 3)
            rec["relay_killed"] = killed
            rec["reparented"], rec["reparent_detail"] = self.reparenting(victim, relays, verdicts, rec["committed"])
        return rec

    # -- the hop probe
    def hop_probe(self, env: dict, tree: Tree) -> list[dict]:
        from nemo_dcr.transport.store import open_store

        store = open_store(self.origin)
        sizes = [4096, int(self.cfg.refit.chunk_bytes)]
        for s in sizes:
            store.put(f"{PROBE_PREFIX}/{s}", os.urandom(s))
        leaf = probe_leaf(tree, set(self.killed))
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
        self.memory = Sampler({"receivers_rss": self.receivers_rss, "mem_available": mem_available}, 0.5)
        self.memory.start()

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
        store = self.store = open_store(self.origin)
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
        tree = self.tree
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
            if topology == "relay" and args.kill_relay:  # last: the tree is one relay short afterwards
                plan.append({"lr": args.lr, "link_mbit": args.rates[-1], "warmup": False, "kill": args.kill_relay})
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
        self.note_receiver_peaks()
        with open(os.path.join(self.run_dir, "moto.log"), errors="replace") as f:
            gets = origin_chunk_gets(f.read(), BUCKET, RUN_PREFIX)
        for r in records:
            r.update(origin_reads(gets, r.pop("_chunk_sizes")))
        rss, avail = self.memory.logs["receivers_rss"], self.memory.logs["mem_available"]
        memory = {"receivers_rss_peak_bytes": max(rss.v, default=None),
                  "receivers_hwm_sum_bytes": sum(self.hwm.values()),
                  "receiver_hwm_max_bytes": max(self.hwm.values(), default=None),
                  "receiver_hwm_bytes": self.hwm, "mem_available_min_bytes": min(avail.v, default=None),
                  "mem_total_bytes": os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")}
        _progress(f"memory: receivers' RSS peaked at {(memory['receivers_rss_peak_bytes'] or 0) / 2**30:.2f} GiB "
                  f"together (sampled every 0.5 s), the largest receiver at "
                  f"{(memory['receiver_hwm_max_bytes'] or 0) / 2**30:.2f} GiB; MemAvailable fell to "
                  f"{(memory['mem_available_min_bytes'] or 0) / 2**30:.2f} GiB")
        return {"records": records, "probe": probe, "tree": tree, "memory": memory,
                "wall_s": time.monotonic() - t_start}


def _main(args) -> int:
    check_prerequisites()
    run_dir = fresh_run_dir(args.run_dir, os.path.join(ROOT, "runs", "relay-link", time.strftime("%Y%m%d-%H%M%S")))
    from nemo_dcr_testbed.config import describe_config_error, load_demo_config

    rids = receiver_ids(args.receivers)
    total = len(args.topologies) * (1 + args.steps * len(args.rates)) + (1 if args.kill_relay else 0)
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
            mine = [r for r in records if not r["warmup"] and r["topology"] == t and r["link_mbit"] == m
                    and not r.get("relay_killed")]
            cases.append(case_entry(t, m, args.receivers, mine))
    killed = [r for r in records if r.get("relay_killed")]
    if killed:
        cases.append(case_entry("relay", killed[0]["link_mbit"], args.receivers, killed))
    tree: Tree = out["tree"]
    leaf = probe_leaf(tree, {args.kill_relay} if args.kill_relay else set())
    hops = summarize_hops(out["probe"], int(cfg.refit.chunk_bytes), leaf_hops=max(len(tree.ancestors(leaf)), 1)) \
        if out["probe"] else None
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
    for c in cases:
        if c["topology"] == "relay":
            key = f"{c['link_mbit']:g}" + (" killed" if c.get("relay_killed") else "")
            expected.setdefault(key, {})["relay_origin_read_le_1.1x_wire"] = c.get("origin_read_le_1.1x_wire")
            if c.get("relay_killed"):
                expected[key].update(bit_exact=c["bit_exact"], reparented=c["reparented"])
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
            "receivers": args.receivers,
            "levels": len(tree.levels()),
            "relay_levels": tree.levels(),
            "relay_tree": [{"name": n.name, "parent": n.parent, "children": list(n.children)} for n in tree.relays],
            "fanout": None if args.fanouts else args.fanout, "fanouts": args.fanouts,
            "kill_relay": args.kill_relay,
            "memory": out["memory"],
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
                                    "the end of the optimizer step (first rank) and the joint commit (20 ms samples, "
                                    "interpolated)",
                "cross_link_bytes_step": "the same from the driver's go to the trainer's row (training step, "
                                         "receivers' and relays' polling included)",
                "tc_class_bytes_step": "the htb class's Sent counter over the same window as cross_link_bytes_step",
                "wall_s": "end of optimizer.step() on the first rank to end it -> the trainer's joint commit "
                          "decision recorded (rank 0); rank0_wall_s from rank 0's own end of step",
                "origin_read_bytes": "bytes of the version's chunk objects read from the origin store by anyone "
                                     "(relays, receivers): moto_server's request log, each GET of a chunk key "
                                     "(200/206) counted as the whole object; origin_chunk_gets the GETs, "
                                     "origin_chunks_read_twice the chunks fetched more than once",
                "root_relay_origin_bytes": "relay: the root relay's chunk bytes read from the origin upstream "
                                           "(its /v1/stats, delta over the step), a cross-check",
                "levels": "meta.levels: the number of relay levels (the root relay is level 1, its child relays "
                          "level 2, ...); the receivers sit below the last level",
                "timeline": "per refit (medians per case): for each relay level, when its first and its last "
                            "relay first held an object of the version (the relay's 'version' log event, its "
                            "'ts'), and for the receivers when the first and the last answered it ok (the ack "
                            "event's 'ts': fetched, applied, acknowledged); seconds after the END OF THE "
                            "OPTIMIZER STEP on the first rank to end it (the trainer's wall clock, same "
                            "machine). receiver_lag_s: each receiver's ack after the first receiver's",
                "relay_killed": "the kill case: the relay SIGKILLed once its log showed the version (at_s: "
                                "seconds after the end of the optimizer step; held_chunk_bytes: chunk bytes of the "
                                "version it had read, from its stats just before)",
                "reparented": "every child relay of the killed one read chunk bytes of the version from a "
                              "remaining upstream (its grandparent or the origin: reparent_detail), and every "
                              "receiver below it is bit-exact; for a killed leaf relay the receivers alone",
                "memory": "receivers_rss_peak_bytes: the receivers' RSS summed, sampled every 0.5 s, its peak; "
                          "receiver_hwm_bytes: each receiver's VmHWM (its own peak)",
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
    json_path = os.path.join(args.out_dir, f"{args.out_name}.json")
    with open(json_path, "w") as f:
        json.dump(result, f, indent=1)
    print_table(cases)
    if hops:
        print(json.dumps({k: v for k, v in hops.items() if k != "link"}), flush=True)
    plot(cases, os.path.join(args.out_dir, f"{args.out_name}.png"))
    _progress(f"wrote {json_path} and {args.out_name}.png ({out['wall_s']:.0f}s)")
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
