"""Starting a real S3-compatible server (moto) on loopback, for the fixtures that need one."""
import os
import socket
import subprocess
import sys
import time


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_moto_server(env: dict | None = None) -> tuple[subprocess.Popen, str]:
    """A fresh ``moto_server`` on a free loopback port; returns (process, endpoint URL).
    ``env``: variables added to its environment (``INITIAL_NO_AUTH_ACTION_COUNT=0``: it checks
    credentials)."""
    port = _free_port()
    exe = os.path.join(os.path.dirname(sys.executable), "moto_server")
    proc = subprocess.Popen([exe, "-H", "127.0.0.1", "-p", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env={**os.environ, **(env or {})})
    deadline = time.monotonic() + 30
    while True:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                break
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                raise RuntimeError("moto_server did not start")
            time.sleep(0.1)
    return proc, f"http://127.0.0.1:{port}"
