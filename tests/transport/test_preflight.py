"""``transport/preflight.check_store``: a store that cannot be used is refused before anything
starts, in one line naming what is wrong and the fix, writing nothing (issue 35, scope 6).

S3 cases run against a real S3 server (moto) on loopback: a bucket that does not exist, an
endpoint nobody listens on (a closed loopback port), no credentials at all, and credentials
the server does not know.  moto accepts any credentials by default; started with
``INITIAL_NO_AUTH_ACTION_COUNT=0`` it checks them (its IAM emulation: an access key it never
issued is ``InvalidAccessKeyId``), which is how the wrong-credentials case is made here.
Not made here: a bucket in another region (moto on one endpoint serves every region and
answers no redirect), so the region message is not exercised against a server."""
import os
import socket
import subprocess
import sys
import time
import uuid

import pytest

from nemo_dcr.configs.check import ConfigError, check_store_uri
from nemo_dcr.transport.preflight import StoreUnusable, check_store


# --- local directories (no process) ------------------------------------------------------------

def test_a_reader_needs_the_directory_and_never_creates_it(tmp_path):
    missing = tmp_path / "typo"
    with pytest.raises(StoreUnusable, match=r"no such directory .* a receiver never creates its store"):
        check_store(str(missing), reader=True)
    with pytest.raises(StoreUnusable, match="no such directory"):
        check_store(f"file://{missing}", reader=True)
    assert not missing.exists()
    (tmp_path / "f").write_text("x")
    with pytest.raises(StoreUnusable, match="is not a directory"):
        check_store(str(tmp_path / "f"), reader=True)
    with pytest.raises(StoreUnusable, match="is not a directory"):
        check_store(str(tmp_path / "f"), reader=False)  # the trainer cannot use a file either
    # controls: an existing directory passes for both; a missing one passes for the trainer
    # (which creates it), and the check itself creates nothing
    check_store(str(tmp_path), reader=True)
    check_store(str(missing), reader=False)
    assert not missing.exists()


def test_open_store_for_a_reader_creates_nothing(tmp_path):
    from nemo_dcr.transport.store import StoreError, open_store

    missing = tmp_path / "typo"
    store = open_store(str(missing), create=False)
    assert store.stat("RUN.json") is None and store.list("v/") == [] and not store.exists("HEAD.json")
    with pytest.raises(StoreError):
        store.put("acks/r0/00000001.json", b"{}")
    assert not missing.exists()
    open_store(str(missing))  # control: the default (the trainer) creates it
    assert missing.is_dir()


def test_an_upstream_list_checks_each_store_but_not_relays(tmp_path):
    check_store(f"relay://127.0.0.1:1,{tmp_path}", reader=True)  # a relay may start after its reader
    with pytest.raises(StoreUnusable, match="no such directory"):
        check_store(f"relay://127.0.0.1:1,{tmp_path / 'typo'}", reader=True)


def test_the_config_check_names_the_setting(tmp_path):
    with pytest.raises(ConfigError, match=r"^refit\.store_uri: store .*: no such directory"):
        check_store_uri("refit.store_uri", str(tmp_path / "typo"), reader=True)
    assert check_store_uri("store.uri", str(tmp_path / "new")) == str(tmp_path / "new")
    with pytest.raises(ConfigError, match=r"^store\.uri: store nosuchproto://x: cannot open store"):
        check_store_uri("store.uri", "nosuchproto://x")


# --- S3 (moto on loopback) ---------------------------------------------------------------------

def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # closed again when the socket is: nobody listens there


@pytest.fixture
def s3_env(s3_server, monkeypatch):
    """The moto server's env, with no credential file or instance metadata to fall back on."""
    for k, v in s3_server.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", "/nonexistent")
    monkeypatch.setenv("AWS_CONFIG_FILE", "/nonexistent")
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    for k in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL_S3"):
        monkeypatch.delenv(k, raising=False)
    return dict(s3_server)


def _buckets(endpoint: str) -> list[str]:
    import s3fs

    fs = s3fs.S3FileSystem(client_kwargs={"endpoint_url": endpoint}, skip_instance_cache=True)
    return sorted(fs.ls(""))


def test_s3_a_usable_bucket_passes(s3_env, s3_bucket):
    check_store(s3_bucket + "/run", reader=True)
    check_store(s3_bucket, reader=False)


def test_s3_a_missing_bucket_is_one_line_and_is_not_created(s3_env):
    before = _buckets(s3_env["AWS_ENDPOINT_URL"])
    name = f"dcr-missing-{uuid.uuid4().hex[:8]}"
    with pytest.raises(StoreUnusable) as e:
        check_store(f"s3://{name}/run", reader=False)
    msg = str(e.value)
    assert "\n" not in msg
    assert msg == (f"store s3://{name}/run: bucket '{name}' does not exist at the S3 endpoint "
                   f"{s3_env['AWS_ENDPOINT_URL']} (from $AWS_ENDPOINT_URL): create it (aws s3 mb s3://{name}) or fix "
                   "the bucket name / the endpoint")
    assert _buckets(s3_env["AWS_ENDPOINT_URL"]) == before


def test_s3_a_closed_endpoint_is_one_line(s3_env, monkeypatch):
    endpoint = f"http://127.0.0.1:{_closed_port()}"
    monkeypatch.setenv("AWS_ENDPOINT_URL", endpoint)
    t0 = time.monotonic()
    with pytest.raises(StoreUnusable, match=rf"^store s3://b/run: cannot reach the S3 endpoint {endpoint} \(from "
                                            r"\$AWS_ENDPOINT_URL\): .*check that the server is up and the URL \(set "
                                            r"AWS_ENDPOINT_URL, or the storage option endpoint_url\)$"):
        check_store("s3://b/run", reader=True)
    assert time.monotonic() - t0 < 10  # a refused connection is not retried
    # the storage option endpoint_url wins over the environment
    with pytest.raises(StoreUnusable, match=r"endpoint http://127\.0\.0\.1:\d+ \(from storage option endpoint_url\)"):
        check_store("s3://b/run", reader=True, endpoint_url=endpoint)


def test_s3_no_credentials_is_one_line(s3_env, s3_bucket, monkeypatch):
    monkeypatch.delenv("AWS_ACCESS_KEY_ID")
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
    with pytest.raises(StoreUnusable, match=r"no S3 credentials found: set AWS_ACCESS_KEY_ID and "
                                            r"AWS_SECRET_ACCESS_KEY"):
        check_store(s3_bucket + "/run", reader=True)
    check_store(s3_bucket + "/run", reader=True, key="testing", secret="testing")  # control: given as options


@pytest.fixture(scope="module")
def checking_moto():
    """A moto server that checks credentials (``INITIAL_NO_AUTH_ACTION_COUNT=0``)."""
    from moto_helpers import start_moto_server

    proc, endpoint = start_moto_server({"INITIAL_NO_AUTH_ACTION_COUNT": "0"})
    yield endpoint
    proc.terminate()
    proc.wait(timeout=10)


def test_s3_credentials_the_server_refuses_are_one_line(s3_env, checking_moto, monkeypatch):
    monkeypatch.setenv("AWS_ENDPOINT_URL", checking_moto)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIAWRONGWRONG12")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "not-the-secret")
    with pytest.raises(StoreUnusable) as e:
        check_store("s3://any-bucket/run", reader=True)
    assert str(e.value) == (f"store s3://any-bucket/run: the S3 endpoint {checking_moto} (from $AWS_ENDPOINT_URL) "
                            "refused the credentials (access key AKIA...12) (InvalidAccessKeyId): set the right "
                            "AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY (or AWS_PROFILE)")


# --- the receiver's command line: exit 2, one line, before anything starts ----------------------

def test_receive_refuses_an_unusable_s3_store_exit_2(s3_env, s3_bucket):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("NEMO_DCR_KEY_FILE", None)
    name = f"dcr-missing-{uuid.uuid4().hex[:8]}"
    for uri, needle in ((f"s3://{name}/run", f"bucket '{name}' does not exist"),):
        proc = subprocess.run([sys.executable, "-m", "nemo_dcr.receiver.cli", "--store", uri, "--receiver-id", "r0",
                               "--model-id", "m", "--timeout-s", "5"], capture_output=True, text=True, env=env,
                              timeout=120)
        ours = [x for x in proc.stderr.splitlines() if x.startswith("nemo-dcr receive: ")]
        assert proc.returncode == 2 and len(ours) == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
        assert ours[0].startswith(f"nemo-dcr receive: --store: store {uri}: ") and needle in ours[0], ours
    proc = subprocess.run([sys.executable, "-m", "nemo_dcr.receiver.cli", "--store", s3_bucket + "/run",
                           "--receiver-id", "r0", "--model-id", "m", "--timeout-s", "1"], capture_output=True,
                          text=True, env=env, timeout=120)
    # control: a usable bucket passes the check; no run there: exit 1 at the timeout
    assert proc.returncode == 1 and "no run record" in proc.stderr, proc.stderr[-3000:]
    assert _buckets(s3_env["AWS_ENDPOINT_URL"]).count(s3_bucket.removeprefix("s3://")) == 1
