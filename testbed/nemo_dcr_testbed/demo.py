"""``nemo-dcr demo``: end-to-end refit on the embedded default store.

Launches the trainer ranks with torchrun (Megatron-Core, gloo on CPU) and the receiver
processes (a transformers model or a vLLM engine each, ``receiver.runtime``), prints one table row per refit as it lands, and
ends with ONE JSON summary line on stdout.  Logs go to ``<run_dir>/*.log``.  On stderr: the
key the run is signed with (``refit.key_file``, else one generated into ``run_dir``), and a
progress line every ``PROGRESS_EVERY_S`` while it waits for the initial checkpoint and for the
first committed version (where the trainer and each receiver stand).  With
``refit.transport=relay`` the receivers read the store through a tree of ``nemo-dcr relay``
processes (``relay_tree``; docs/relay.md), started before them and stopped after them.

Failing safely: a ``run_dir`` that holds files and a store that holds a previous run are
refused before anything is written (``force=true`` / ``store.reset=true`` to reuse them);
every process the demo starts (the torchrun trainer and its ranks, the relays, the receivers
and their engine processes) runs in its own session and is tracked with its descendants, so
any failure, Ctrl-C or SIGTERM stops them all; errors are one line on stderr (exit 2 for
bad input, 1 for a failed run).
"""
from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass

from nemo_dcr_testbed.config import SERVE_RUNTIME, ConfigError, DemoConfig, load_demo_config

STORE_MARKER = ".nemo-dcr-store"
COLUMNS = [
    ("step", 4), ("loss", 7), ("changed%", 8), ("wire_B", 9), ("dense_B", 10), ("ratio", 7),
    ("B/chg", 6), ("coding", 7), ("diff_ms", 7), ("proj_ms", 7), ("enc_ms", 7), ("up_ms", 6), ("rx_ms", 7),
    ("commit_ms", 9), ("pause_ms", 8), ("bit_exact", 9),
]


def _err(msg: str) -> None:
    print(f"[nemo-dcr demo] {msg}", file=sys.stderr, flush=True)


class DemoError(Exception):
    """A demo failure with its one-line message; ``exit_code`` 2 = bad input (nothing was
    started), 1 = the run failed."""

    def __init__(self, message: str, exit_code: int = 1):
        super().__init__(message)
        self.exit_code = exit_code


class _Children:
    """Every process the demo starts, and their descendants.

    Each child gets its own session (process group), and the tree below it is sampled
    while the demo polls, so processes that leave their parent's group (torchrun starts
    each rank in a new session) or outlive their parent are still known.  ``stop``
    sends SIGTERM to all of them, then SIGKILL to what is left after ``grace_s``.
    """

    def __init__(self) -> None:
        self.popens: list[subprocess.Popen] = []
        self.seen: dict[int, object] = {}  # pid -> psutil.Process (identity-checked by create time)

    def start(self, cmd: list[str], log, env: dict) -> subprocess.Popen:
        p = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        self.popens.append(p)
        self.refresh()
        return p

    def refresh(self) -> None:
        import psutil

        for p in self.popens:
            try:
                root = psutil.Process(p.pid)
                for q in [root, *root.children(recursive=True)]:
                    self.seen.setdefault(q.pid, q)
            except psutil.Error:
                pass

    def _running(self) -> list:
        import psutil

        out = []
        for q in self.seen.values():
            try:
                if q.is_running() and q.status() != psutil.STATUS_ZOMBIE:
                    out.append(q)
            except psutil.Error:
                pass
        return out

    def stop(self, grace_s: float = 10.0) -> int:
        """Stop everything still running; returns how many processes had to be stopped."""
        import psutil

        self.refresh()
        live = self._running()
        for p in self.popens:  # the whole group, including members not sampled yet
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGTERM)
                except OSError:
                    pass
        for q in live:
            try:
                q.terminate()
            except psutil.Error:
                pass
        deadline = time.monotonic() + grace_s
        while self._running() and time.monotonic() < deadline:
            time.sleep(0.1)
        for q in self._running():
            try:
                q.kill()
            except psutil.Error:
                pass
        for p in self.popens:
            if p.poll() is None:  # not reaped yet, so its group id cannot have been reused
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except OSError:
                    pass
                try:
                    p.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    pass
        return len(live)


_ERROR_LINE = re.compile(r"(?:^|\s)(?:[\w.]+\.)?\w*(?:Error|Exception|Refused|Interrupt)\b.*")


def _last_error(path: str) -> str:
    """The log's last line that names an exception (else its last line), shortened."""
    try:
        with open(path, errors="replace") as f:
            lines = [ln.strip() for ln in f.read().splitlines() if ln.strip()]
    except OSError:
        return "(no log)"
    if not lines:
        return "(empty log)"
    hit = next((ln for ln in reversed(lines) if _ERROR_LINE.search(ln) and not ln.startswith("raise ")), lines[-1])
    return hit if len(hit) <= 300 else hit[:297] + "..."


PROGRESS_EVERY_S = 3.0
"""While the demo waits for the initial checkpoint and for the first committed version, a
line on stderr this often: what it waits for, for how long, where each process stands."""


class _Progress:
    """A line on stderr every ``PROGRESS_EVERY_S`` while a wait lasts."""

    def __init__(self, what: str) -> None:
        self.what = what
        self.t0 = self.last = time.monotonic()

    def tick(self, status) -> None:
        """``status()``: where things stand, evaluated only when a line is due."""
        now = time.monotonic()
        if now - self.last >= PROGRESS_EVERY_S:
            self.last = now
            _err(f"{self.what} ({now - self.t0:.0f} s): {status()}")


def _first_commit_status(store, receivers: list, engines: int) -> str:
    """The trainer's and each receiver's stage on the way to version 1's decision."""
    from nemo_dcr.protocol.keys import decision_key, manifest_key

    if store.exists(decision_key(1)):
        parts = ["trainer decided v1"]
    elif store.exists(manifest_key(1)):
        parts = ["trainer published v1, waiting for the acks"]
    else:
        parts = ["trainer on step 1"]
    for rid, _, log in receivers:
        events = _events(log.name)
        v1 = [e for e in events if e.get("version") == 1]
        if any(e.get("event") == "committed" for e in v1):
            stage = "holds v1"
        elif any(e.get("ok") is True for e in v1):
            stage = "acked v1"
        elif any(e.get("ok") is False for e in v1):
            stage = f"refused v1 ({next(e.get('error') for e in v1 if e.get('ok') is False)})"
        elif any(e.get("ready") for e in events):
            stage = "ready (holds v0)"
        else:
            stage = "starting (loading the model)"
        parts.append(f"{rid} {stage}")
    if engines:
        parts.append(f"{engines} vllm serve engine(s) following the run")
    return "; ".join(parts)


TRAINER_GRACE_S = 15.0
"""How long a failed receiver's report waits for the trainer to fail too (its error is the
cause more often than not)."""

def _failed(what: str, code: int | None, log_path: str) -> DemoError:
    return DemoError(f"{what} failed (exit {code}): {_last_error(log_path)} -- log: {log_path}")


def _check_fresh(cfg: DemoConfig) -> None:
    """Refuse, before anything is written, a run that would overwrite a previous one."""
    run_dir = cfg.run_dir
    if os.path.exists(run_dir):
        if not os.path.isdir(run_dir):
            raise DemoError(f"run_dir {run_dir} exists and is not a directory", 2)
        if os.listdir(run_dir) and not cfg.force:
            raise DemoError(f"run_dir {run_dir} is not empty (a previous run?); choose a new run_dir=... "
                            f"or pass force=true to reuse it", 2)
    else:
        parent = os.path.dirname(os.path.abspath(run_dir))
        while not os.path.exists(parent):
            parent = os.path.dirname(parent)
        if not os.path.isdir(parent) or not os.access(parent, os.W_OK):
            raise DemoError(f"run_dir {run_dir} cannot be created ({parent} is not a writable directory)", 2)


def _check_key(cfg: DemoConfig) -> None:
    """A ``refit.key_file`` must load (exists, private, hex) before anything is written."""
    if not cfg.refit.key_file:
        return
    from nemo_dcr.errors import DcrError
    from nemo_dcr.protocol.signing import load_key

    try:
        load_key(cfg.refit.key_file)
    except DcrError as e:
        raise DemoError(f"refit.key_file: {' '.join(str(e).split())}", 2) from None


def _prepare_store(cfg: DemoConfig) -> str | None:
    """Returns the local store root (None for a remote URI)."""
    uri = cfg.store.uri
    if "://" in uri and not uri.startswith("file://"):
        return None
    root = os.path.abspath(uri.removeprefix("file://"))
    if os.path.isdir(root) and os.listdir(root):
        if not os.path.exists(os.path.join(root, STORE_MARKER)):
            raise DemoError(f"store {root} is a non-empty directory that is not a nemo_dcr demo store; "
                            f"refusing to touch it (choose another store.uri)", 2)
        if not (cfg.store.reset or cfg.force):
            raise DemoError(f"store {root} holds a previous run; choose a new store.uri=... or pass "
                            f"store.reset=true to empty it", 2)
        shutil.rmtree(root)
    try:
        os.makedirs(root, exist_ok=True)
    except OSError as e:
        raise DemoError(f"store.uri {uri}: cannot create {root}: {e.strerror}", 2) from None
    open(os.path.join(root, STORE_MARKER), "w").close()
    return root


def _row(r: dict) -> dict[str, str]:
    acks = r.get("acks", [])
    rx_ms = max((sum(a["stats"].get(k, 0.0) for k in ("download_s", "decode_s", "apply_s")) for a in acks),
                default=0.0) * 1e3
    exact = [a["stats"].get("bit_exact") for a in acks]
    bit = "yes" if exact and all(e is True for e in exact) else ("n/a" if all(e is None for e in exact) else "NO")
    changed = r["changed"]
    return {
        "step": str(r["step"]), "loss": f"{r['loss']:.4f}",
        "changed%": f"{100 * changed / r['canonical_numel']:.3f}",
        "wire_B": str(r["wire_bytes"]), "dense_B": str(r["dense_bytes"]),
        "ratio": f"{r['dense_bytes'] / max(r['wire_bytes'], 1):.1f}x",
        "B/chg": f"{r['wire_bytes'] / max(changed, 1):.2f}",
        "coding": r.get("coding") or "-",  # refit.coding (under auto, the version's choice)
        "diff_ms": f"{r['diff_s'] * 1e3:.1f}", "proj_ms": f"{r['project_s'] * 1e3:.1f}",
        "enc_ms": f"{r['encode_s'] * 1e3:.1f}", "up_ms": f"{r['upload_s'] * 1e3:.1f}",
        "rx_ms": f"{rx_ms:.1f}", "commit_ms": f"{r['commit_wait_s'] * 1e3:.1f}",
        "pause_ms": f"{r['pause_s'] * 1e3:.1f}", "bit_exact": bit,
    }


def _receiver_cmd(cfg: DemoConfig, rid: str, store_uri: str, init_dir: str | None) -> list[str]:
    """``init_dir`` None: the receiver bootstraps from the store (the newest committed-version
    snapshot it can verify, else a download of version 0), as a replica added to a running
    job would."""
    from nemo_dcr.receiver.registry import supported_options

    cmd = [sys.executable, "-m", "nemo_dcr.receiver.cli", "--store", store_uri,
           "--receiver-id", rid, "--model-id", cfg.refit.model_id, "--until-version", str(cfg.steps),
           "--timeout-s", str(cfg.refit.ack_timeout_s)]
    if init_dir is not None:
        cmd += ["--init-dir", init_dir]
    if cfg.refit.membership == "elastic":
        cmd.append("--join")  # (re)join: after the initial catch-up, and whenever evicted
    if cfg.refit.verify_dense:
        cmd.append("--verify-dense")
    if cfg.refit.receiver_dump_dir:
        cmd += ["--dump-dir", os.path.join(cfg.refit.receiver_dump_dir, rid)]
    cmd += ["--runtime", cfg.receiver.runtime]
    supported = supported_options(cfg.receiver.runtime)  # the registry row's options
    for option, flag, value in (
            ("tensor_parallel_size", "--tensor-parallel-size", cfg.receiver.tensor_parallel_size),
            ("max_model_len", "--max-model-len", cfg.model.seq_length),
            ("sample_tokens", "--sample-tokens", cfg.receiver.sample_tokens)):
        if option in supported:
            cmd += [flag, str(value)]
    return cmd


def _print_rows(rows: list[dict], cells: list[dict[str, str]], printed: int, fleet) -> int:
    """Print the rows from ``printed`` on; returns how many are printed now.  Under
    ``receiver.runtime=vllm_serve`` (``fleet``) a row waits for its version's check by the
    fleet, which fills its ``bit_exact`` cell (the engines' acks carry no oracle)."""
    while printed < len(rows):
        row, cell = rows[printed], cells[printed]
        if fleet is not None:
            check = next((c for c in fleet.checks if c.version == row["step"]), None)
            if check is None:
                break
            if check.checksums_equal is not None:
                cell["bit_exact"] = "yes" if check.checksums_equal else "NO"
        if printed == 0:  # the header with the first row: the progress lines (stderr) come before both
            _print_row({name: name for name, _ in COLUMNS})
        _print_row(cell)
        for a in row.get("acks", []):
            if a["stats"].get("sample") is not None:
                print(f"     {a['receiver']} greedy after v{row['step']}: {a['stats']['sample']}", flush=True)
        printed += 1
    return printed


def _print_row(cells: dict[str, str]) -> None:
    print(" ".join(cells[name].rjust(w) for name, w in COLUMNS), flush=True)


@dataclass(frozen=True)
class RelayTree:
    """The demo's relay tree (``refit.transport=relay``): ``parents[i]`` is relay ``i``'s
    parent (``None`` for the root, relay 0); relays are numbered top-down, level by level, so
    a parent comes before its children.  ``receiver_parents[j]`` is the relay above the
    ``j``-th receiver."""

    parents: tuple[int | None, ...]
    receiver_parents: tuple[int, ...]

    def __post_init__(self) -> None:
        assert self.parents and self.parents[0] is None
        assert all(p is not None and p < i for i, p in enumerate(self.parents) if i)
        assert all(0 <= p < len(self.parents) for p in self.receiver_parents)

    def ancestors(self, relay: int | None) -> list[int]:
        """``relay``, its parent, ..., the root: the relays a child of ``relay`` falls back on."""
        out = []
        while relay is not None:
            out.append(relay)
            relay = self.parents[relay]
        return out


def relay_tree(receivers: int, fanout: int) -> RelayTree:
    """The balanced tree for ``receivers`` leaves: bottom-up, each level puts the level below
    (the receivers first) in consecutive groups of ``fanout`` under one relay each, until a
    level has one relay, the root.  Every receiver is at the same depth; there are
    ``ceil(R/f) + ceil(ceil(R/f)/f) + ... + 1`` relays (R <= f: 1; 4 receivers, fanout 2: 3;
    8 receivers, fanout 2: 7)."""
    if receivers < 1 or fanout < 1 or (fanout == 1 and receivers > 1):
        raise ValueError(f"no relay tree for {receivers} receivers with fanout {fanout}")
    sizes = []  # relays per level, bottom-up
    n = receivers
    while not sizes or sizes[-1] > 1:
        n = -(-n // fanout)
        sizes.append(n)
    sizes.reverse()  # top-down: sizes[0] == 1, the root
    first = [sum(sizes[:k]) for k in range(len(sizes))]  # index of each level's first relay
    parents: list[int | None] = [None]
    for k in range(1, len(sizes)):
        parents += [first[k - 1] + j // fanout for j in range(sizes[k])]
    return RelayTree(tuple(parents), tuple(first[-1] + j // fanout for j in range(receivers)))


RELAY_START_TIMEOUT_S = 120.0
"""How long the demo waits for a relay to print the address it listens on."""


@dataclass
class _Relay:
    name: str
    popen: subprocess.Popen
    log: str
    uri: str  # relay://127.0.0.1:PORT


def _upstreams(tree: RelayTree, parent: int, relays: list[_Relay], origin: str) -> str:
    """A child of relay ``parent``'s ordered upstream list: its parent, the grandparent, ...,
    the root, then the origin store (so a child re-parents up the tree)."""
    return ",".join([relays[i].uri for i in tree.ancestors(parent)] + [origin])


def _events(log_path: str) -> list[dict]:
    """The JSON objects a process printed a line each (its other lines skipped)."""
    out = []
    with open(log_path, errors="replace") as f:
        for line in f:
            if line.startswith("{"):
                try:
                    event = json.loads(line)
                except ValueError:
                    continue  # a line cut short: still being written
                if isinstance(event, dict):
                    out.append(event)
    return out


def _relay_address(log_path: str) -> str | None:
    """``HOST:PORT`` from the line a relay prints on stdout once it listens
    (``{"relay": "listening", "address": ...}``), once it has."""
    return next((e["address"] for e in _events(log_path) if e.get("relay") == "listening"), None)


def _relay_stats(relay: _Relay) -> dict:
    """The relay's ``GET /v1/stats`` (docs/relay.md)."""
    import urllib.request

    with urllib.request.urlopen(f"http://{relay.uri.removeprefix('relay://')}/v1/stats", timeout=30) as r:
        return json.loads(r.read())


def _origin_read_bytes(receiver_logs: list[str], relays: list[_Relay]) -> int | None:
    """Chunk bytes the origin store served over the run, counted by every node that read it:
    each relay's reads from its non-relay upstreams (``GET /v1/stats``; normally only the
    root's) and each receiver's (its final event's ``origin_chunk_bytes``: all it read
    without relays, what it read after falling back to the origin with them).  ``None``
    (and a line on stderr) when a node did not say."""
    total = 0
    for r in relays:
        try:
            ups = _relay_stats(r)["upstreams"]
        except (OSError, ValueError, KeyError) as e:
            _err(f"origin_read_bytes unknown: relay {r.name}'s /v1/stats: {type(e).__name__}: {e}")
            return None
        total += sum(u["chunk_bytes_read"] for u in ups if not u["is_relay"])
    for path in receiver_logs:
        said = [e["origin_chunk_bytes"] for e in _events(path) if e.get("done") and "origin_chunk_bytes" in e]
        if not said or not isinstance(said[-1], int):
            _err(f"origin_read_bytes unknown: {path} reports no origin_chunk_bytes")
            return None
        total += said[-1]
    return total


def _start_relays(cfg: DemoConfig, tree: RelayTree, children: _Children, env: dict) -> list[_Relay]:
    """``nemo-dcr relay`` per node of ``tree``, top-down: each waits for its parent's address
    (its first upstream)."""
    relays: list[_Relay] = []
    for i, parent in enumerate(tree.parents):
        name = f"relay{i}"
        upstream = cfg.store.uri if parent is None else _upstreams(tree, parent, relays, cfg.store.uri)
        log = open(os.path.join(cfg.run_dir, f"{name}.log"), "w")
        cmd = [sys.executable, "-m", "nemo_dcr.cli", "relay", "--upstream", upstream,
               "--listen", "127.0.0.1:0", "--spool", os.path.join(cfg.run_dir, f"{name}-spool")]
        p = children.start(cmd, log, env)
        deadline = time.monotonic() + RELAY_START_TIMEOUT_S
        while (address := _relay_address(log.name)) is None:
            if p.poll() is not None:
                raise _failed(f"relay {name} (before listening)", p.returncode, log.name)
            if time.monotonic() > deadline:
                raise DemoError(f"relay {name} printed no address in {RELAY_START_TIMEOUT_S:g}s -- log: {log.name}")
            children.refresh()
            time.sleep(0.1)
        relays.append(_Relay(name, p, log.name, f"relay://{address}"))
        _err(f"relay {name} on {address}, upstream {upstream}")
    return relays


def _check_relays(relays: list[_Relay]) -> None:
    for r in relays:
        if r.popen.poll() is not None:
            raise _failed(f"relay {r.name}", r.popen.returncode, r.log)


def _stop_relays(relays: list[_Relay], grace_s: float = 30.0) -> None:
    """SIGTERM every relay, leaves first; one that does not exit within ``grace_s`` is a
    failed run (``run``'s cleanup then kills it)."""
    for r in reversed(relays):
        r.popen.terminate()
    for r in reversed(relays):
        try:
            r.popen.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            raise DemoError(f"relay {r.name} still running {grace_s:g}s after SIGTERM -- log: {r.log}") from None


def run(cfg: DemoConfig) -> dict:
    """Run the demo; whatever happens, no process it started outlives this call."""
    children = _Children()
    try:
        return _run(cfg, children)
    except BaseException as e:
        stopped = children.stop()
        if isinstance(e, DemoError) and stopped:
            e.args = (f"{e.args[0]} (stopped {stopped} processes the demo started)",)
        raise
    finally:
        children.stop()


def _run(cfg: DemoConfig, children: _Children) -> dict:
    from nemo_dcr.configs.check import check_store_uri
    from nemo_dcr.errors import DcrError
    from nemo_dcr.receiver.registry import check_installed
    from nemo_dcr.transport.store import open_store

    _check_fresh(cfg)
    _check_key(cfg)
    if "://" in cfg.store.uri and not cfg.store.uri.startswith("file://"):
        # an object store is checked before anything starts or is written (endpoint,
        # credentials, region, bucket: docs/object-stores.md): unusable is bad input, exit 2
        try:
            check_store_uri("store.uri", cfg.store.uri)
        except DcrError as e:
            raise DemoError(str(e), 2) from None
    try:  # receiver.runtime=vllm (or vllm_serve: `vllm serve` engines) without vllm: one line, exit 2
        check_installed("vllm" if cfg.receiver.runtime == SERVE_RUNTIME else cfg.receiver.runtime)
    except DcrError as e:
        raise DemoError(f"receiver.runtime: {' '.join(str(e).split())}", 2) from None
    local_root = _prepare_store(cfg)
    os.makedirs(cfg.run_dir, exist_ok=True)
    cfg_path = os.path.join(cfg.run_dir, "config.json")
    with open(cfg_path, "w") as f:
        json.dump(cfg.to_dict(), f, indent=1)
    steps_path = os.path.join(cfg.run_dir, "steps.jsonl")
    if os.path.exists(steps_path):
        os.unlink(steps_path)

    # one signing key per run, shared by the trainer ranks and the receivers (docs/protocol.md):
    # refit.key_file's (checked before anything was written), else a new one in run_dir
    from nemo_dcr.protocol.signing import KEY_ENV, new_key_file

    if cfg.refit.key_file:
        key_path = os.path.abspath(cfg.refit.key_file)
        _err(f"run signed with refit.key_file {key_path}")
    else:
        key_path = os.path.join(cfg.run_dir, "refit.key")
        if os.path.exists(key_path):
            os.unlink(key_path)
        new_key_file(key_path)
        _err(f"run signed with a generated key {key_path} (a receiver started by hand needs it: "
             f"nemo-dcr receive --key-file {key_path})")
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", **{KEY_ENV: key_path})
    world = cfg.parallel.world_size
    t_start = time.perf_counter()
    trainer_log = open(os.path.join(cfg.run_dir, "trainer.log"), "w")
    trainer = children.start(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world}",
         "-m", "nemo_dcr_testbed.run_trainer", "--config", cfg_path], trainer_log, env)
    _err(f"trainer: {cfg.model.family}, {world} ranks (TP={cfg.parallel.tensor_model_parallel_size}, "
         f"PP={cfg.parallel.pipeline_model_parallel_size}, DP={cfg.parallel.data_parallel_size}, "
         f"EP={cfg.parallel.expert_model_parallel_size}), log {trainer_log.name}")

    from nemo_dcr.integrations.hf_export import WEIGHTS_KEY, download_checkpoint

    store = open_store(cfg.store.uri)
    progress = _Progress("waiting for the initial checkpoint (version 0)")
    while not store.exists(WEIGHTS_KEY):
        if trainer.poll() is not None:
            raise _failed("trainer (before writing the initial checkpoint)", trainer.returncode, trainer_log.name)
        progress.tick(lambda: f"{world} trainer rank(s) starting, building the model")
        children.refresh()
        time.sleep(0.2)
    init_dir = os.path.join(local_root, "init") if local_root else download_checkpoint(
        store, os.path.join(cfg.run_dir, "init"))
    _err(f"initial checkpoint written ({time.perf_counter() - t_start:.1f}s); starting "
         f"{len(cfg.refit.receivers)} receiver(s)" + (" under a relay tree" if cfg.refit.transport == "relay" else ""))

    relays: list[_Relay] = []
    reads_from = [cfg.store.uri] * len(cfg.refit.receivers)  # each receiver's --store
    if cfg.refit.transport == "relay":
        tree = relay_tree(len(cfg.refit.receivers), cfg.refit.relay_fanout)
        relays = _start_relays(cfg, tree, children, env)
        reads_from = [_upstreams(tree, p, relays, cfg.store.uri) for p in tree.receiver_parents]

    def start_receiver(rid: str, store_uri: str, *, local_init: bool = True) -> None:
        log = open(os.path.join(cfg.run_dir, f"receiver-{rid}.log"), "w")
        cmd = _receiver_cmd(cfg, rid, store_uri, init_dir if local_init else None)
        receivers.append((rid, children.start(cmd, log, env), log))

    receivers: list = []
    fleet = None
    if cfg.receiver.runtime == SERVE_RUNTIME:  # vllm serve engines with the backend (demo_serve.py)
        from nemo_dcr_testbed.demo_serve import ServeFleet

        fleet = ServeFleet(cfg, init_dir=init_dir, reads_from=reads_from, key_path=key_path, run_dir=cfg.run_dir,
                           popen=children.start, store=store, say=_err)
        try:
            fleet.start()
        except Exception as e:
            raise DemoError(f"vllm_serve engines: {' '.join(str(e).split())[:400]} -- logs: "
                            f"{cfg.run_dir}/vllm-serve-*.log") from None
        fleet.follow(lambda: trainer.poll() is None)
    else:
        for rid, store_uri in zip(cfg.refit.receivers, reads_from):
            start_receiver(rid, store_uri)
    late = cfg.refit.late_receiver_ids()
    # late receivers start once version late_after is decided and, with snapshots on, once the
    # newest snapshot at or below it is complete (or 60 s later: a skipped or failed snapshot
    # upload only means they start from version 0), so the demo shows a join from a snapshot
    every = cfg.refit.snapshot_interval
    late_snapshot = (every * (cfg.refit.late_after // every)) if every else 0
    late_decided_at: float | None = None

    rows: list[dict] = []
    cells: list[dict[str, str]] = []
    seen = printed = 0
    from nemo_dcr.protocol.manifest import SNAPSHOT_RECORD, decision_key, snapshot_key

    progress = _Progress("waiting for the first commit")
    engines = len(cfg.refit.receivers) if fleet is not None else 0

    while True:
        done = trainer.poll() is not None
        if late and late_decided_at is None and store.exists(decision_key(cfg.refit.late_after)):
            late_decided_at = time.monotonic()
        if late and late_decided_at is not None and (
                not late_snapshot or store.exists(snapshot_key(late_snapshot, SNAPSHOT_RECORD))
                or time.monotonic() - late_decided_at > 60):
            snap = f", snapshot v{late_snapshot} complete" if late_snapshot else ""
            _err(f"version {cfg.refit.late_after} decided{snap}: starting late receiver(s) {', '.join(late)} "
                 f"(--join, bootstrapping from the store)")
            for rid in late:
                start_receiver(rid, cfg.store.uri, local_init=False)
            late = []
        if os.path.exists(steps_path):
            with open(steps_path) as f:
                lines = f.read().splitlines()
            for line in lines[seen:]:
                rows.append(json.loads(line))
                cells.append(_row(rows[-1]))
            seen = len(lines)
        printed = _print_rows(rows, cells, printed, fleet)
        if done:
            break
        if not printed:
            progress.tick(lambda: _first_commit_status(store, receivers, engines))
        _check_relays(relays)
        for rid, p, log in receivers:
            if p.poll() not in (None, 0):
                # the trainer's refusal is usually the cause (e.g. a store prefix another run
                # holds: the receivers then cannot open its records either): give it a moment
                # to exit and report it first
                try:
                    code = trainer.wait(timeout=TRAINER_GRACE_S)
                except subprocess.TimeoutExpired:
                    code = None
                if code not in (None, 0):
                    raise _failed("trainer", code, trainer_log.name)
                raise _failed(f"receiver {rid}", p.returncode, log.name)
        children.refresh()
        time.sleep(0.2)
    if trainer.returncode != 0:
        raise _failed("trainer", trainer.returncode, trainer_log.name)
    serve: dict = {}
    if fleet is not None:
        fleet.join(cfg.refit.ack_timeout_s + 600)
        serve = fleet.summary()
        fleet.stop()
        printed = _print_rows(rows, cells, printed, fleet)
        _print_rows(rows, cells, printed, None)  # what is left: versions the engines never took
        if fleet.failure:
            raise DemoError(f"vllm_serve: {fleet.failure}")
    for rid, p, log in receivers:
        try:
            code = p.wait(timeout=cfg.refit.ack_timeout_s)
        except subprocess.TimeoutExpired:
            raise DemoError(f"receiver {rid} still running {cfg.refit.ack_timeout_s:g}s after the trainer "
                            f"finished -- log: {log.name}") from None
        if code != 0:
            raise _failed(f"receiver {rid}", code, log.name)
    _check_relays(relays)
    origin_read = _origin_read_bytes([log.name for _, _, log in receivers], relays)
    _stop_relays(relays)

    # vllm_serve: a version is bit-exact when every engine's checksums and generations equal the
    # stock engine's, refit densely from the trainer's export (the backend's acks carry no oracle)
    bit_exact = serve["checksums_equal"] if serve else sum(1 for c in cells if c["bit_exact"] == "yes")
    wire = sum(r["wire_bytes"] for r in rows)
    dense = sum(r["dense_bytes"] for r in rows)
    changed = sum(r["changed"] for r in rows)
    return {
        "refits": len(rows),
        "committed": sum(1 for r in rows if r["committed"]),
        "bit_exact": bit_exact,
        "verified": cfg.refit.verify_dense,
        "wire_bytes": wire,
        "transport": cfg.refit.transport,
        "membership": cfg.refit.membership,
        "joined": sorted({r for row in rows for r in row.get("joined", [])}),
        "evicted": sorted({r for row in rows for r in row.get("evicted", [])}),
        "pipeline": cfg.refit.pipeline,
        "pause_s_max": round(max((r["pause_s"] for r in rows), default=0.0), 4),
        "relays": len(relays),
        "origin_read_bytes": origin_read,
        "dense_bytes": dense,
        "compression": round(dense / max(wire, 1), 2),
        "bytes_per_changed": round(wire / max(changed, 1), 3),
        "changed_pct_mean": round(100 * changed / max(sum(r["canonical_numel"] for r in rows), 1), 4),
        "family": rows[0]["family"] if rows else cfg.model.family,
        "num_moe_experts": cfg.model.num_moe_experts,
        "tied_embeddings": cfg.model.share_embeddings_and_output_weights,
        "distributed_optimizer": cfg.train.use_distributed_optimizer,
        "tp": cfg.parallel.tensor_model_parallel_size,
        "pp": cfg.parallel.pipeline_model_parallel_size,
        "dp": cfg.parallel.data_parallel_size,
        "ep": cfg.parallel.expert_model_parallel_size,
        "receivers": cfg.refit.receivers,
        "runtime": cfg.receiver.runtime,
        "receiver_tp": cfg.receiver.tensor_parallel_size,
        **serve,
        "wall_s": round(time.perf_counter() - t_start, 1),
        "store": cfg.store.uri,
    }


def _interrupt_on_sigterm():
    """While the demo runs, SIGTERM raises KeyboardInterrupt (as Ctrl-C does), so that
    ``run``'s cleanup stops the children; returns the function restoring the old handler."""
    if threading.current_thread() is not threading.main_thread():
        return lambda: None

    def handler(signum, frame):
        raise KeyboardInterrupt(f"signal {signum}")

    old = signal.signal(signal.SIGTERM, handler)
    return lambda: signal.signal(signal.SIGTERM, old)


def main(argv: list[str]) -> int:
    if "-h" in argv or "--help" in argv:  # Hydra's override parser would take them for a key
        from nemo_dcr_testbed.config import config_help

        print(config_help(), end="", flush=True)
        return 0
    try:
        cfg = load_demo_config(argv)
    except ConfigError as e:  # a config error is the user's: one line, no traceback
        _err(f"invalid configuration: {e}")
        return 2
    from nemo_dcr.errors import DcrError

    restore = _interrupt_on_sigterm()
    try:
        summary = run(cfg)
    except DemoError as e:
        _err(str(e))
        return e.exit_code
    except KeyboardInterrupt:
        _err("interrupted; stopped every process the demo started")
        return 130
    except (DcrError, OSError) as e:  # e.g. a store that failed after its retries
        _err(f"failed: {type(e).__name__}: {' '.join(str(e).split())}")
        return 1
    finally:
        restore()
    print(json.dumps(summary), flush=True)
    ok = summary["refits"] == cfg.steps and summary["committed"] == cfg.steps
    if cfg.refit.verify_dense:
        ok = ok and summary["bit_exact"] == cfg.steps
    return 0 if ok else 1
