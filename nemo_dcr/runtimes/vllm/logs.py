"""Where a receiver's vLLM engine logs: never on stdout, which carries the receiver's JSON
lines only (``nemo_dcr/events.py``).

vLLM 0.32 configures its own ``vllm`` logger (``vllm/logger.py``) in every process it runs
(the receiver's, and each TP worker's, which inherit the environment): a ``StreamHandler``
on ``VLLM_LOGGING_STREAM`` -- ``ext://sys.stdout`` by default -- or the ``dictConfig``
JSON file ``VLLM_LOGGING_CONFIG_PATH`` names.  :func:`route_engine_logs` sets them before
vLLM reads them (the values are read at each configuration, so before ``LLM(...)`` is
enough):

* by default ``VLLM_LOGGING_STREAM=ext://sys.stderr``: vLLM's lines, in vLLM's format, on
  stderr (the engine's multi-line warnings too: "Chat template warmup failed" and its
  traceback);
* with ``engine_log`` (or ``$NEMO_DCR_ENGINE_LOG``): every process of the engine appends
  them to that file instead, in the same format;
* a ``VLLM_LOGGING_CONFIG_PATH`` the caller set is left alone (an explicit logging setup).

Progress bars are switched off where the engine is built (``use_tqdm_on_load=False``,
``runtime.py``).  A ``vllm`` logger configured before (vLLM imported earlier in this
process) has its stdout handlers moved to stderr.
"""
from __future__ import annotations

import atexit
import json
import logging
import os
import sys
import tempfile

ENGINE_LOG_ENV = "NEMO_DCR_ENGINE_LOG"
"""A file the engine's log lines go to instead of stderr (``route_engine_logs``'s default)."""

_configs: dict[str, str] = {}  # engine log path -> the dictConfig file written for it (this process)


def route_engine_logs(engine_log: str | None = None) -> str | None:
    """Point vLLM's logging (this process and the engine processes it starts) away from
    stdout; returns the file the lines go to (``None``: stderr, or the caller's own
    ``VLLM_LOGGING_CONFIG_PATH``)."""
    engine_log = engine_log or os.environ.get(ENGINE_LOG_ENV) or None
    os.environ["VLLM_LOGGING_STREAM"] = "ext://sys.stderr"
    if engine_log and os.environ.get("VLLM_LOGGING_CONFIG_PATH") not in (None, "", _configs.get(engine_log)):
        engine_log = None  # the caller's own logging configuration wins
    if engine_log:
        engine_log = os.path.abspath(engine_log)
        os.environ["VLLM_LOGGING_CONFIG_PATH"] = _file_config(engine_log)
    _off_stdout()
    return engine_log


def _file_config(path: str) -> str:
    """vLLM's own default configuration with a ``FileHandler`` (append) on ``path``, as a
    JSON file for ``VLLM_LOGGING_CONFIG_PATH`` (kept until this process exits: every
    engine started here reads it again)."""
    if path in _configs:
        return _configs[path]
    from vllm.logger import DEFAULT_LOGGING_CONFIG  # vllm.envs reads the environment lazily

    os.makedirs(os.path.dirname(path), exist_ok=True)
    open(path, "a").close()  # a path that cannot be written fails here, with its name
    config = json.loads(json.dumps(DEFAULT_LOGGING_CONFIG))
    handler = config["handlers"]["vllm"]
    handler.pop("stream", None)
    handler.update({"class": "logging.FileHandler", "filename": path, "mode": "a", "formatter": "vllm"})
    config["formatters"].pop("vllm_color", None)
    fd, config_path = tempfile.mkstemp(prefix="nemo-dcr-vllm-logging-", suffix=".json")
    with os.fdopen(fd, "w") as f:
        json.dump(config, f)
    atexit.register(_remove, config_path)
    _configs[path] = config_path
    return config_path


def _remove(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


def _off_stdout() -> None:
    """Handlers of an already configured ``vllm`` logger that write to stdout: to stderr."""
    for handler in logging.getLogger("vllm").handlers:
        if isinstance(handler, logging.StreamHandler) and handler.stream in (sys.stdout, sys.__stdout__):
            handler.setStream(sys.stderr)
