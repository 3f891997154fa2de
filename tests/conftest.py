"""Shared fixtures: a real S3-compatible server (moto) on loopback, started per session."""
import uuid

import pytest
from moto_helpers import start_moto_server


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
