"""Shared fixtures: a real S3-compatible server (moto) on loopback, started per session."""
import os
import socket
import subprocess
import sys
import time
import uuid

import pytest


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_moto_server() -> tuple[subprocess.Popen, str]:
    """A fresh ``moto_server`` on a free loopback port; returns (process, endpoint URL)."""
    port = _free_port()
    exe = os.path.join(os.path.dirname(sys.executable), "moto_server")
    proc = subprocess.Popen([exe, "-H", "127.0.0.1", "-p", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
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
