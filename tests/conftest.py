"""Shared fixtures (a real S3-compatible server on loopback) and the test lanes.

Lanes (docs/testing.md): a test that starts a process (torchrun ranks, a receiver process,
a vLLM engine, moto_server, a ``python -c`` probe) is marked ``spawns`` automatically at
collection; ``make test-fast`` runs everything else (``-m "not spawns and not gpu"``).

The marking is checked, not trusted: while a test that is *not* marked ``spawns`` is set
up, run and torn down, every way to start a process (``subprocess.Popen``,
``multiprocessing`` ``Process.start``, ``os.fork``/``forkpty``/``posix_spawn``/``system``)
raises, and the test fails with "spawns a process: mark it / fix the auto-marker".  The
check is on in every lane, so the full ``make test`` (CI) proves the marker as well.

How a test is found to spawn (``_Spawns``): the AST of the test function and of every
fixture it uses (its closure, plus fixtures it asks for by ``request.getfixturevalue``)
is searched for references to process-starting code (``SPAWNING`` below); a reference to
a helper defined under tests/ (``_launch.torchrun``, ``moto_helpers.start_moto_server``, a
module's own ``_run_probe``...) is followed into that helper.  In a parametrized fixture,
what lies under ``if request.param == "s3":`` counts only for that parameter, so
``store[dir]``/``store[memory]`` stay in the fast lane and ``store[s3]`` does not.
"""
from __future__ import annotations

import ast
import functools
import inspect
import json
import multiprocessing.process
import os
import resource
import subprocess
import sys
import time
import types
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from moto_helpers import start_moto_server

TESTS = Path(__file__).resolve().parent

# Dotted names whose use starts a process.  A prefix matches itself and everything below
# it ("subprocess" matches subprocess.run).  Helpers under tests/ are not listed: they are
# followed into.  Product entry points that launch children are listed by name.
SPAWNING = (
    "subprocess",
    "multiprocessing",
    "torch.multiprocessing",
    "concurrent.futures.process",
    "concurrent.futures.ProcessPoolExecutor",
    "pty",
    "os.fork", "os.forkpty", "os.posix_spawn", "os.posix_spawnp", "os.system", "os.popen",
    "os.spawnl", "os.spawnle", "os.spawnlp", "os.spawnlpe", "os.spawnv", "os.spawnve",
    "os.spawnvp", "os.spawnvpe",
    "vllm",
    "triton.compile",  # runs ptxas
    "nemo_dcr.runtimes.vllm",  # VLLMRuntime.start / VLLMServedModel.start: vLLM engines
    "nemo_dcr_testbed.demo.run",  # the demo: torchrun trainer ranks + receiver processes
    "nemo_dcr_testbed.demo._Children.start",
)
# Existing markers that mean "starts processes" by their definition (pyproject.toml).
SPAWNING_MARKERS = ("slow", "vllm")
GUARD_MESSAGE = "spawns a process: mark it / fix the auto-marker"


def pytest_addoption(parser):
    parser.addoption("--timelog", metavar="PATH", default=None,
                     help="append one JSON line per test (wall and CPU seconds, CPU counting waited-for "
                          "child processes) to PATH as each test ends; summary: tests/timelog_report.py")


def pytest_sessionstart(session):
    # matplotlib builds its font cache on first use by running ``fc-list``; on a fresh machine
    # that first use is inside whichever plotting test runs first, where the guard below
    # refuses the spawn.  Build it here, before any test, outside the guard.
    try:
        import matplotlib.font_manager  # noqa: F401
    except ImportError:
        pass


def pytest_configure(config):
    path = config.getoption("timelog", None)
    if path and (hasattr(config, "workerinput") or not getattr(config.option, "numprocesses", None)):
        # under xdist the workers write the rows (the controller would repeat them)
        config.pluginmanager.register(_TimeLog(path), "nemo_dcr_timelog")
    config.addinivalue_line(
        "markers", "spawns: starts a process (torchrun, vLLM, moto_server, a subprocess); set "
        "automatically by tests/conftest.py, excluded by `make test-fast`")


# --- the auto-marker ------------------------------------------------------------------------

def _matches(qualname: str) -> bool:
    return any(qualname == p or qualname.startswith(p + ".") for p in SPAWNING)


@dataclass
class _Evidence:
    """Why a function spawns: ``always`` reasons, and reasons that hold only for one value of
    ``request.param`` (a branch ``if request.param == <value>:`` in a parametrized fixture)."""
    always: list[str] = field(default_factory=list)
    by_param: dict[object, list[str]] = field(default_factory=dict)
    fixtures: list[tuple[str, object]] = field(default_factory=list)  # getfixturevalue(name), param


def _param_literal(test: ast.expr) -> tuple[bool, object]:
    """``request.param == <constant>`` -> (True, constant)."""
    if (isinstance(test, ast.Compare) and len(test.ops) == 1 and isinstance(test.ops[0], ast.Eq)
            and isinstance(test.left, ast.Attribute) and test.left.attr == "param"
            and isinstance(test.comparators[0], ast.Constant)):
        return True, test.comparators[0].value
    return False, None


def _dotted(node: ast.expr) -> list[str] | None:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        return [node.id, *reversed(parts)]
    return None


class _Spawns:
    """Finds, per function, whether it (transitively, through helpers under tests/) starts a
    process.  One instance per session; results are cached per code object."""

    def __init__(self) -> None:
        self._cache: dict[types.CodeType, _Evidence] = {}
        self._defs: dict[str, dict[tuple[str, int], ast.AST]] = {}

    def _node(self, fn: types.FunctionType) -> ast.AST | None:
        """The ``def`` of ``fn`` in its file's AST (files parsed once, defs indexed by line)."""
        code = fn.__code__
        index = self._defs.get(code.co_filename)
        if index is None:
            index = self._defs[code.co_filename] = {}
            try:
                tree = ast.parse(Path(code.co_filename).read_text())
            except (OSError, SyntaxError):
                tree = None
            for node in ast.walk(tree) if tree else ():
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    first = node.decorator_list[0].lineno if node.decorator_list else node.lineno
                    for line in {node.lineno, first}:
                        index[(node.name, line)] = node
        return index.get((code.co_name, code.co_firstlineno))

    def function(self, fn) -> _Evidence:
        fn = inspect.unwrap(getattr(fn, "__func__", fn))
        if not isinstance(fn, types.FunctionType):
            return _Evidence()
        code = fn.__code__
        if code in self._cache:
            return self._cache[code]
        ev = self._cache[code] = _Evidence()  # a cycle sees "nothing yet"
        node = self._node(fn)
        if node is None:
            return ev
        module = sys.modules.get(fn.__module__)
        scope = dict(vars(module)) if module else {}
        scope.update(fn.__globals__)
        package = (module.__package__ if module else None) or ""
        self._walk(node.body, scope, _local_imports(node, package), ev, cond=None)
        return ev

    def _walk(self, body, scope, local_imports, ev: _Evidence, cond) -> None:
        for stmt in body:
            if isinstance(stmt, ast.If):
                is_param, value = _param_literal(stmt.test)
                if is_param:
                    self._walk(stmt.body, scope, local_imports, ev, value if cond is None else cond)
                    self._walk(stmt.orelse, scope, local_imports, ev, cond)
                    continue
            self._expr(stmt, scope, local_imports, ev, cond)

    def _add(self, ev: _Evidence, cond, reason: str) -> None:
        (ev.always if cond is None else ev.by_param.setdefault(cond, [])).append(reason)

    def _expr(self, root, scope, local_imports, ev: _Evidence, cond) -> None:
        for node in ast.walk(root):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                for a in node.names:
                    full = a.name if isinstance(node, ast.Import) else local_imports.get(a.asname or a.name, "")
                    if _matches(full):
                        self._add(ev, cond, f"imports {full}")
                continue
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and node.func.attr == "getfixturevalue" and node.args
                    and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)):
                ev.fixtures.append((node.args[0].value, cond))
                continue
            if not isinstance(node, (ast.Attribute, ast.Name)):
                continue
            parts = _dotted(node)
            if parts is None:
                continue
            self._reference(parts, scope, local_imports, ev, cond)

    def _reference(self, parts: list[str], scope, local_imports, ev: _Evidence, cond) -> None:
        head, rest = parts[0], parts[1:]
        if head in local_imports:
            qual = ".".join([local_imports[head], *rest])
            if _matches(qual):
                self._add(ev, cond, qual)
                return
            obj = _resolve_dotted(local_imports[head])
        elif head in scope:
            obj = scope[head]
        else:
            return
        # walk the attribute chain on live objects; stop at the first that is not there
        for i in range(len(rest) + 1):
            qual = _qualname(obj, rest[i:])
            if qual and _matches(qual):
                self._add(ev, cond, qual)
                return
            if i == len(rest):
                break
            try:
                obj = inspect.getattr_static(obj, rest[i])
            except AttributeError:
                return
            obj = getattr(obj, "__func__", obj)
        if isinstance(obj, types.FunctionType) and _under_tests(obj):
            sub = self.function(obj)
            for r in sub.always:
                self._add(ev, cond, f"{obj.__name__} -> {r}")
            ev.fixtures.extend((name, cond) for name, _ in sub.fixtures)

    def item(self, item) -> list[str]:
        """Reasons the item spawns (empty: it does not)."""
        reasons = [f"@{m}" for m in SPAWNING_MARKERS if item.get_closest_marker(m)]
        fn = getattr(item, "function", None)
        if fn is not None:
            ev = self.function(fn)
            reasons += ev.always + [r for rs in ev.by_param.values() for r in rs]
            for name, _ in ev.fixtures:
                reasons += self._fixture(item, name, None)
        info = getattr(item, "_fixtureinfo", None)
        params = getattr(getattr(item, "callspec", None), "params", {})
        for name in (info.names_closure if info else ()):
            reasons += self._fixture(item, name, params.get(name, _NOPARAM))
        return reasons

    def _fixture(self, item, name: str, param, _depth: int = 0) -> list[str]:
        info = item._fixtureinfo
        defs = info.name2fixturedefs.get(name)
        if defs is None:
            try:
                defs = item.session._fixturemanager.getfixturedefs(name, item)
            except Exception:  # noqa: BLE001 -- an unknown name is pytest's error to report, not ours
                defs = None
        if not defs or _depth > 8:
            return []
        fn = defs[-1].func
        if not _under_tests(inspect.unwrap(fn)):
            return []
        ev = self.function(fn)
        out = [f"fixture {name}: {r}" for r in ev.always]
        if param is _NOPARAM:
            out += [f"fixture {name}: {r}" for rs in ev.by_param.values() for r in rs]
        else:
            out += [f"fixture {name}[{param}]: {r}" for r in ev.by_param.get(param, [])]
        for sub, cond in ev.fixtures:
            if cond is None or param is _NOPARAM or cond == param:
                out += self._fixture(item, sub, _NOPARAM, _depth + 1)
        for arg in defs[-1].argnames:  # fixtures it requests by argument (closure covers the item's)
            if arg != "request" and arg not in info.names_closure:
                out += self._fixture(item, arg, _NOPARAM, _depth + 1)
        return out


_NOPARAM = object()


def _local_imports(fn_node: ast.AST, package: str) -> dict[str, str]:
    """Names a function binds by its own ``import``/``from ... import`` -> dotted names."""
    out: dict[str, str] = {}
    for node in ast.walk(fn_node):
        if isinstance(node, ast.Import):
            for a in node.names:
                out[a.asname or a.name.split(".")[0]] = a.name if a.asname else a.name.split(".")[0]
        elif isinstance(node, ast.ImportFrom):
            mod = node.module or ""
            if node.level:
                base = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                mod = f"{base}.{mod}".strip(".") if mod else base
            for a in node.names:
                out[a.asname or a.name] = f"{mod}.{a.name}"
    return out


def _under_tests(fn) -> bool:
    code = getattr(fn, "__code__", None)
    return code is not None and _file_under_tests(code.co_filename)


@functools.lru_cache(maxsize=None)
def _file_under_tests(filename: str) -> bool:
    return Path(filename).resolve().is_relative_to(TESTS)


def _qualname(obj, rest: list[str]) -> str | None:
    if isinstance(obj, types.ModuleType):
        base = obj.__name__
    elif getattr(obj, "__module__", None) and getattr(obj, "__qualname__", None):
        base = f"{obj.__module__}.{obj.__qualname__}"
    else:
        return None
    return ".".join([base, *rest])


def _resolve_dotted(name: str):
    parts = name.split(".")
    for i in range(len(parts), 0, -1):
        mod = sys.modules.get(".".join(parts[:i]))
        if mod is not None:
            obj = mod
            for p in parts[i:]:
                obj = getattr(obj, p, None)
                if obj is None:
                    return None
            return obj
    return None


def pytest_collection_modifyitems(config, items):
    finder = _Spawns()
    for item in items:
        if item.get_closest_marker("spawns"):
            continue
        reasons = finder.item(item)
        if reasons:
            item.add_marker(pytest.mark.spawns(reason=reasons[0]))
    if hasattr(config, "workerinput"):  # a pytest-xdist worker: its order is what is handed out
        _spawning_files_first(items)


def _spawning_files_first(items) -> None:
    """``--dist loadfile`` hands whole files to the workers in collection order.  Files that
    start processes (a torchrun launch, an engine: tens of seconds to minutes each) go first,
    the in-process rest (seconds) after, so the short files fill the workers' gaps at the end
    instead of one worker finishing a long launch alone.  Stable: each group keeps its order."""
    spawning = {item.path for item in items if item.get_closest_marker("spawns")}
    items.sort(key=lambda item: item.path not in spawning)


# --- the guard: an unmarked test that starts a process fails ---------------------------------

class SpawnRefused(RuntimeError):
    pass


def _install_guard(nodeid: str, attempts: list[str]):
    """Replace every process-starting entry point by one that records and raises; returns undo."""
    saved = []

    def refuse(what):
        def refused(*args, **kwargs):
            attempts.append(what)
            raise SpawnRefused(f"{nodeid} {GUARD_MESSAGE} ({what})")
        return refused

    def patch(owner, attr, what):
        if hasattr(owner, attr):
            saved.append((owner, attr, owner.__dict__[attr] if isinstance(owner, type) else getattr(owner, attr)))
            setattr(owner, attr, refuse(what))

    patch(subprocess.Popen, "_execute_child", "subprocess.Popen")
    patch(multiprocessing.process.BaseProcess, "start", "multiprocessing Process.start")
    for name in ("fork", "forkpty", "posix_spawn", "posix_spawnp", "system"):
        patch(os, name, f"os.{name}")

    def undo():
        for owner, attr, value in reversed(saved):
            setattr(owner, attr, value)
    return undo


def _guarded(item):
    if item.get_closest_marker("spawns") or item.get_closest_marker("gpu"):
        return (yield)
    attempts: list[str] = []
    undo = _install_guard(item.nodeid, attempts)
    try:
        result = yield
    except BaseException as exc:
        if attempts and not isinstance(exc, SpawnRefused):
            raise pytest.fail.Exception(f"{item.nodeid} {GUARD_MESSAGE} ({attempts[0]})", pytrace=False) from exc
        raise
    finally:
        undo()
    if attempts:  # the refusal was swallowed somewhere; the test still fails
        pytest.fail(f"{item.nodeid} {GUARD_MESSAGE} ({attempts[0]})", pytrace=False)
    return result


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item):
    return (yield from _guarded(item))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    return (yield from _guarded(item))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item, nextitem):
    return (yield from _guarded(item))


# --- --timelog: per-test wall and CPU seconds, written as each test ends --------------------

class _TimeLog:
    def __init__(self, path: str) -> None:
        self.path = path
        self.started: dict[str, tuple[float, float, list[str]]] = {}

    @staticmethod
    def _cpu() -> float:
        own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
        return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime

    def pytest_runtest_logstart(self, nodeid, location):
        self.started[nodeid] = (time.monotonic(), self._cpu(), [])

    def pytest_runtest_logreport(self, report):
        if report.nodeid in self.started and report.outcome != "passed":
            self.started[report.nodeid][2].append(f"{report.when}:{report.outcome}")

    def pytest_runtest_logfinish(self, nodeid, location):
        t0, c0, bad = self.started.pop(nodeid)
        row = {"id": nodeid, "wall": round(time.monotonic() - t0, 2), "cpu": round(self._cpu() - c0, 2),
               "bad": bad, "worker": os.environ.get("PYTEST_XDIST_WORKER", "-"), "end": round(time.time(), 1)}
        with open(self.path, "a") as f:
            f.write(json.dumps(row) + "\n")


# --- fixtures ---------------------------------------------------------------------------------

@pytest.fixture(scope="session")
def s3_server():
    """``moto_server`` on 127.0.0.1; yields the env a client needs (endpoint + dummy keys)."""
    proc, endpoint = start_moto_server()
    env = {"AWS_ENDPOINT_URL": endpoint, "AWS_ACCESS_KEY_ID": "testing",
           "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}
    yield env
    proc.terminate()
    proc.wait(timeout=10)


@pytest.fixture
def s3_bucket(s3_server, monkeypatch):
    """A fresh bucket; returns its ``s3://`` URI (clients find the server through the env)."""
    import s3fs

    for k, v in s3_server.items():
        monkeypatch.setenv(k, v)
    name = f"dcr-{uuid.uuid4().hex[:12]}"
    fs = s3fs.S3FileSystem(client_kwargs={"endpoint_url": s3_server["AWS_ENDPOINT_URL"]})
    fs.mkdir(name)
    s3fs.S3FileSystem.clear_instance_cache()
    return f"s3://{name}"
