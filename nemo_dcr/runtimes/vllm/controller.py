"""The RL loop's side of the ``nemo_dcr`` backend: drive vLLM engines through a refit.

Per version, for every engine at once (each on a thread: an update returns only once the
joint commit decided, which needs every member's acknowledgement):

  wait until staged -> ``/pause?mode=keep`` -> ``/start_weight_update`` ->
  ``/update_weights {"version": N}`` -> ``/finish_weight_update {"weight_version": "<run>:<N>"}``
  -> ``/resume``

An engine is a ``vllm serve`` reached over HTTP (:class:`ServerClient`) or an ``AsyncLLM`` in
a Ray actor (:class:`RayEngineClient`: the same steps as actor calls); one controller may
drive both kinds together.

"Staged" is read from the engine's status file (``init_info.status_path``): the version is
downloaded, verified, decoded and validated, so the pause holds only the in-place apply and
the commit round trip.  ``/resume`` is sent whatever the update's outcome (a refused version
leaves the engine serving the version it held).  Timings come back as data
(:class:`RefitResult`).  Weight-transfer calls go through vLLM's own clients
(``HTTPVLLMWeightSyncClient``, ``RayVLLMWeightSyncClient``); over HTTP, pause, resume, weight
info and checksums are vLLM's RL routes (``VLLM_SERVER_DEV_MODE=1``).  Nothing here imports vLLM's engine; no process is started.
"""
from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass, field

from nemo_dcr.errors import ProtocolError


class RefitFailed(ProtocolError):
    """An engine did not take a version (the engine keeps serving the version it held)."""


@dataclass
class RefitResult:
    """One engine's refit of one version; times in seconds."""

    url: str
    """The engine's name (``EngineClient.name``: a server's base URL)."""
    version: int
    ok: bool
    weight_version: str
    staged_s: float | None
    """From the call to the version being staged (None: no status file)."""
    pause_s: float
    """``/pause`` sent to ``/resume`` answered: the time generation was held."""
    update_s: float
    """``/start_weight_update`` to ``/finish_weight_update`` answered."""
    error: str = ""
    status: dict = field(default_factory=dict)
    """The engine's status file after the refit (``{}`` without one)."""


def _one_line(text) -> str:
    return " ".join(str(text).split())


class EngineClient:
    """One engine as the controller drives it: vLLM's weight-sync client for it (``sync``:
    ``init_weight_transfer_engine``, ``start_weight_update``, ``update_weights``,
    ``finish_weight_update``), pause and resume, and, when the engine runs on this machine,
    the status file its backend writes (``status_path``).  ``name`` names it in results and
    errors.  :class:`ServerClient` reaches a ``vllm serve`` over HTTP, :class:`RayEngineClient`
    an ``AsyncLLM`` in a Ray actor."""

    name: str
    sync: object

    def __init__(self, *, status_path: str | None = None) -> None:
        self.status_path = status_path

    @property
    def url(self) -> str:  # (the name results carried before the Ray client)
        return self.name

    def pause(self, mode: str = "keep") -> None:
        raise NotImplementedError

    def resume(self) -> None:
        raise NotImplementedError

    def weight_version(self) -> str | None:
        raise NotImplementedError

    def checksums(self) -> dict[str, str]:
        """Every worker's weight checksums (sha256 of each parameter's bytes), as one map."""
        raise NotImplementedError

    def end_session(self) -> None:
        """After a failed update: ``finish_weight_update`` without a weight version, its error
        ignored.  In a TP>1 engine only the last worker raised the update's error (the
        backend's ``_fail``: vLLM 0.32's multiprocess executor leaves the other workers' replies
        queued otherwise), so the other workers still hold the session open and would refuse
        the next ``start_weight_update``; the last worker refuses this call, which vLLM
        reports without disturbing the others."""
        try:
            self.sync.finish_weight_update()
        except Exception:  # noqa: BLE001 - expected from the worker that ended its session
            pass

    def status(self) -> dict:
        if not self.status_path:
            return {}
        try:
            with open(self.status_path) as f:
                return json.load(f)
        except (OSError, ValueError):  # not written yet, or mid-replace on a filesystem without atomic rename
            return {}

    def staged_for(self, version: int, status: dict | None = None) -> bool:
        """The engine holds ``version``, or staged its next write toward it (see ``wait_staged``);
        ``status``: a status already read (default: read it now)."""
        st = self.status() if status is None else status
        staged = st.get("staged")
        return st.get("committed", -1) >= version or (isinstance(staged, int) and staged <= version)

    def wait_staged(self, version: int, timeout_s: float) -> float | None:
        """Seconds until the engine's next write toward ``version`` is staged, or ``version`` is
        held (None without a status file).  Staged is usually ``version`` itself; an engine
        behind (started from a snapshot, or holding a version nobody asked it for) stages the
        first version of its way there, and the update's window writes the rest."""
        if not self.status_path:
            return None
        t0 = time.monotonic()
        while True:
            st = self.status()
            if self.staged_for(version, st):
                return time.monotonic() - t0
            if time.monotonic() - t0 > timeout_s:
                raise RefitFailed(f"{self.name}: v{version} not staged within {timeout_s:g}s (status: {st})")
            time.sleep(0.01)


class ServerClient(EngineClient):
    """One ``vllm serve`` engine: its base URL (``http://host:port``), through vLLM's
    ``HTTPVLLMWeightSyncClient`` and RL routes (``VLLM_SERVER_DEV_MODE=1``)."""

    def __init__(self, url: str, *, status_path: str | None = None, timeout_s: float = 600.0) -> None:
        from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient

        super().__init__(status_path=status_path)
        self.name = url.rstrip("/")
        self.timeout_s = timeout_s
        self.sync = HTTPVLLMWeightSyncClient(self.name, timeout=timeout_s)

    def _request(self, method: str, path: str, **kw):
        import requests

        r = requests.request(method, f"{self.name}/{path}", timeout=self.timeout_s, **kw)
        if r.status_code >= 400:
            raise RefitFailed(f"{self.name}/{path}: HTTP {r.status_code}: {_one_line(r.text)[:300]}")
        return r.json()

    def pause(self, mode: str = "keep") -> None:
        self._request("POST", "pause", params={"mode": mode})

    def resume(self) -> None:
        self._request("POST", "resume")

    def weight_version(self) -> str | None:
        return self._request("GET", "weight_info").get("weight_version")

    def checksums(self) -> dict[str, str]:
        return self._request("POST", "weight_checker", json={"action": "checksum"})["checksums"]


class RayEngineClient(EngineClient):
    """One ``AsyncLLM`` engine in a Ray actor, through vLLM's ``RayVLLMWeightSyncClient``.

    ``handle``: the actor; it must expose these ``AsyncLLM`` methods under their names (an
    actor subclassing ``AsyncLLM``, or forwarding to one): ``init_weight_transfer_engine``,
    ``start_weight_update``, ``update_weights``, ``finish_weight_update``,
    ``update_weight_version`` (what vLLM's client calls), ``pause_generation``,
    ``resume_generation``, ``get_weight_version`` and ``compute_weight_checksums``.  Ray is
    imported only here (``pip install ray``; nemo_dcr does not depend on it)."""

    def __init__(self, handle, *, name: str | None = None, status_path: str | None = None,
                 timeout_s: float = 600.0) -> None:
        from vllm.distributed.weight_transfer.clients import RayVLLMWeightSyncClient

        super().__init__(status_path=status_path)
        self.handle = handle
        self.name = name or f"ray:{handle._actor_id.hex()[:12]}"
        self.timeout_s = timeout_s
        self.sync = RayVLLMWeightSyncClient(handle)

    def _get(self, ref):
        import ray

        return ray.get(ref, timeout=self.timeout_s)

    def pause(self, mode: str = "keep") -> None:
        self._get(self.handle.pause_generation.remote(mode=mode))

    def resume(self) -> None:
        self._get(self.handle.resume_generation.remote())

    def weight_version(self) -> str | None:
        return self._get(self.handle.get_weight_version.remote())

    def checksums(self) -> dict[str, str]:
        out: dict[str, str] = {}
        for worker in self._get(self.handle.compute_weight_checksums.remote()):
            out.update(worker)
        return out


class Controller:
    """Refits a set of engines together (see the module docstring)."""

    def __init__(self, servers: list[EngineClient], *, run_id: str) -> None:
        self.servers = servers
        self.run_id = run_id

    def init(self, init_infos: list[dict]) -> None:
        """``/init_weight_transfer_engine`` on each engine with its own init info (JSON)."""
        for s, info in zip(self.servers, init_infos, strict=True):
            s.sync.init_weight_transfer_engine(info)

    def weight_version(self, version: int) -> str:
        return f"{self.run_id}:{version}"

    def refit(self, version: int, *, pause_mode: str = "keep", staged_timeout_s: float = 600.0,
              update_timeout_s: float | None = None) -> list[RefitResult]:
        """Take every engine to ``version``; one result per engine, in order.  Raises
        :class:`RefitFailed` (one line per engine) when any engine did not take it."""
        results: list[RefitResult | None] = [None] * len(self.servers)

        def one(i: int, s: EngineClient) -> None:
            results[i] = self._refit_one(s, version, pause_mode, staged_timeout_s, update_timeout_s)

        threads = [threading.Thread(target=one, args=(i, s), daemon=True) for i, s in enumerate(self.servers)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        failed = [r for r in results if r is None or not r.ok]
        if failed:
            raise RefitFailed("; ".join(f"{r.url}: {r.error}" for r in failed if r is not None))
        return results

    def _refit_one(self, s: EngineClient, version: int, pause_mode: str, staged_timeout_s: float,
                   update_timeout_s: float | None) -> RefitResult:
        wv = self.weight_version(version)
        staged_s = None
        error = ""
        paused = t_pause = t_update = None
        session = False
        update_s = pause_s = 0.0
        try:
            staged_s = s.wait_staged(version, staged_timeout_s)
            t_pause = time.perf_counter()
            s.pause(pause_mode)
            paused = True
            t_update = time.perf_counter()
            s.sync.start_weight_update()
            session = True
            info = {"version": version}
            if update_timeout_s is not None:
                info["timeout_s"] = update_timeout_s
            # a failed update raises here: vLLM's worker has ended the session, and the weight
            # version is not set (outputs keep the version the engine still serves)
            s.sync.update_weights(info)
            s.sync.finish_weight_update(wv)
            session = False
            update_s = time.perf_counter() - t_update
        except Exception as e:  # noqa: BLE001 - reported per engine; the engine keeps serving
            error = _one_line(f"{type(e).__name__}: {e}")
            if session:
                s.end_session()
            last = s.status().get("last", {})
            if last.get("version") == version and (last.get("reason") or last.get("error")):
                error += f" (engine: {_one_line(last.get('reason') or last.get('error'))})"
        finally:
            if paused:
                s.resume()
                pause_s = time.perf_counter() - t_pause
        return RefitResult(url=s.name, version=version, ok=not error, weight_version=wv if not error else "",
                           staged_s=staged_s, pause_s=pause_s, update_s=update_s, error=error, status=s.status())
