"""nemo_dcr as vLLM's weight-transfer backend, through a real ``vllm serve`` (CPU, loopback):
the backend registered by the package's ``vllm.general_plugins`` entry point (the server is
started with ``--weight-transfer-config '{"backend": "nemo_dcr"}'`` and nothing else), driven
over vLLM's RL routes by the product's controller, versions published by a signed run of a
small Llama (``nemo_dcr_testbed.vllm_serve.TinyRun``: a RefitSender over the model's own
tensors, no Megatron trainer).

Bit-exactness: after the last version a second, stock server (no backend) is started from that
version's dense checkpoint; ``/weight_checker`` checksums (sha256 of each parameter's bytes,
i.e. integer-view equality) must be equal for every parameter the stock engine keeps in plain
form, and greedy generations with top-5 logprobs on three prompts must be identical (the
packed oneDNN kernels are opaque to checksums on both sides: the stock engine reports their
emptied parameters, the backend its staging weights; the generations cover them).  Negative
control: the checksums the backend reported one version earlier differ from the dense
server's.  Marked by hand (``vllm``): the auto-marker does not follow calls into the test bed.
"""
from types import SimpleNamespace

import pytest
import requests

from nemo_dcr.runtimes.vllm.controller import Controller, RefitFailed, ServerClient
from nemo_dcr_testbed import vllm_serve
from nemo_dcr_testbed.vllm_serve import EMPTY, InFlight, TinyRun, generate, start_server
from vllm_packs import vllm_packs_bf16_linears

pytestmark = pytest.mark.vllm
PROMPTS = [[1, 2, 3], [5, 6, 7, 8], [100, 200, 300, 400, 500]]
LONG = 150  # tokens of the completion kept in flight across a refit


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    work = tmp_path_factory.mktemp("vllm-serve")
    run = TinyRun(str(work / "run"), ack_timeout_s=20.0, snapshot_every=2)
    srv = start_server(run.init_dir, str(work / "server.log"), max_model_len=256)
    status = str(work / "status.json")
    ctl = Controller([ServerClient(srv.url, status_path=status)], run_id=run.run_id)
    try:
        ctl.init([run.init_info("e0", status)])
        yield SimpleNamespace(run=run, srv=srv, ctl=ctl, client=ctl.servers[0], work=work, checksums={})
    finally:
        srv.stop()


def differing(ours: dict, dense: dict) -> list[str]:
    """Keys whose checksums differ, but for parameters the stock engine packed away."""
    assert ours.keys() == dense.keys()
    return vllm_serve.differing(ours, dense)


PACKED = ("qkv_proj.weight", "o_proj.weight", "gate_up_proj.weight", "down_proj.weight")


def _refit_with_a_completion_in_flight(s, version, staged_check=None):  # s: run, srv, ctl
    s.run.step(0.03)
    flight = InFlight(s.srv.url, PROMPTS[0], LONG)
    assert flight.started.wait(60)
    publish = s.run.publish()
    if staged_check is not None:
        s.client.wait_staged(version, 60)
        staged_check(s.client.checksums())
    results = s.ctl.refit(version)
    publish.join(60)
    return results, publish.stats, flight.join()


def test_three_versions_bit_exact_and_tagged(served, tmp_path):
    s = served
    label = "default"  # vLLM's weight version before the first finish_weight_update
    before = s.client.checksums()
    kept = [k for k in before if not k.endswith(PACKED)]  # what a stock engine keeps: embeddings, norms, lm_head
    seen = {}

    def staged_check(staged):  # staged, not applied: phase one wrote only the packed layers' staging
        seen["staged"] = staged
        assert [k for k in kept if staged[k] != before[k]] == []

    for v in (1, 2, 3):
        (result,), stats, completion = _refit_with_a_completion_in_flight(s, v, staged_check if v == 1 else None)
        if v == 1:  # controls: phase one did write the staging weights (where vLLM packs the linears:
            # on a CPU without AVX-512 they stay plain, nothing is staged); the window wrote the rest
            if vllm_packs_bf16_linears():
                assert any(seen["staged"][k] != before[k] for k in before if k.endswith(PACKED))
            after = s.client.checksums()
            assert {k.rsplit(".", 2)[-2].split(":")[-1] for k in kept if after[k] != before[k]} >= {"embed_tokens", "lm_head"}
        assert stats.committed and result.ok, (stats, result)
        assert result.weight_version == f"{s.run.run_id}:{v}" and result.staged_s is not None
        assert requests.get(f"{s.srv.url}/weight_info").json()["weight_version"] == result.weight_version
        # the completion crossed the refit: its tokens are split in two spans, old then new
        spans = completion["weight_versions"]
        assert [x["version"] for x in spans] == [label, result.weight_version], spans
        assert spans[0]["start"] == 0 and spans[0]["end"] == spans[1]["start"] > 0
        assert spans[1]["end"] == len(completion["token_ids"]) == LONG
        label = result.weight_version
        s.checksums[v] = s.client.checksums()
    dense = start_server(s.run.dense_dir("dense-v3"), str(tmp_path / "dense.log"), backend=False, max_model_len=256)
    try:
        want = ServerClient(dense.url).checksums()
        assert differing(s.checksums[3], want) == []
        assert sum(d != EMPTY for d in want.values()) >= 5  # embeddings, norms, lm_head: compared
        assert differing(s.checksums[2], want)  # control: one version earlier is not this one
        for p in PROMPTS:
            a, b = generate(s.srv.url, p, 16, logprobs=5), generate(dense.url, p, 16, logprobs=5)
            assert (a["token_ids"], a["logprobs"]) == (b["token_ids"], b["logprobs"])
    finally:
        dense.stop()


def test_an_aborted_version_is_rolled_back_and_the_server_keeps_serving(served):
    """v4 is aborted by the trainer (the update comes after its ack timeout): the update then
    writes v4, acks too late, reads the abort and rolls back in place -- one failed call, the
    server at v3's bits, still generating; v5 then commits."""
    s = served
    v3 = s.client.checksums()
    before = generate(s.srv.url, PROMPTS[1], 8)["token_ids"]
    s.run.step(0.03)
    publish = s.run.publish()
    publish.join(120)
    assert not publish.stats.committed  # nobody asked the engine for v4 within the ack timeout
    assert s.client.wait_staged(4, 60) is not None
    with pytest.raises(RefitFailed) as e:
        s.ctl.refit(4)
    line = str(e.value)
    assert "\n" not in line and "500 Server Error" in line and "no acknowledgement" in line, line
    assert s.client.status()["last"]["event"].startswith("rolled back"), s.client.status()
    assert s.client.checksums() == v3
    assert requests.get(f"{s.srv.url}/weight_info").json()["weight_version"] == f"{s.run.run_id}:3"
    assert generate(s.srv.url, PROMPTS[1], 8)["token_ids"] == before
    # a malformed update is one refusal too, and changes nothing
    s.client.sync.start_weight_update()
    with pytest.raises(requests.HTTPError):
        s.client.sync.update_weights({"version": "v5", "pickle": True})
    assert s.client.checksums() == v3
    (result,), stats, _ = _refit_with_a_completion_in_flight(s, 5)
    assert stats.committed and result.ok and stats.base_version == 3
    assert s.client.checksums() != v3


def test_a_malformed_or_second_init_is_refused_in_one_line(served):
    s = served
    for info, line in (({"store": "x", "receiver_id": "e1"}, "init_info: 'model_id' is required"),
                       ({**s.run.init_info("e1"), "pickle": "x"}, "init_info: unknown key 'pickle'"),
                       (s.run.init_info("e1"), "the weight-transfer engine is already initialised")):
        r = requests.post(f"{s.srv.url}/init_weight_transfer_engine", json={"init_info": info}, timeout=60)
        assert r.status_code == 500
        assert line in open(s.srv.log_path).read()
    assert generate(s.srv.url, PROMPTS[0], 4)["token_ids"]  # still serving, still following
    assert s.client.status()["receiver"] == "e0"


def test_an_engine_started_from_a_snapshot_catches_up_and_follows(served, tmp_path, capsys):
    """A replacement engine mid-run: ``nemo-dcr checkpoint`` writes the newest snapshot (v2;
    v4 was aborted), a new server starts from it with ``start_version`` 2 (a wrong one is
    refused in one line), its first update catches up through v3 and v5, after which its
    checksums and generations equal the engine it replaces (v5); then v6 commits."""
    import json

    from nemo_dcr.cli import main as cli

    s = served
    assert s.run.version == 5
    v5 = s.client.checksums()
    v5_gen = generate(s.srv.url, PROMPTS[2], 12, logprobs=5)
    v5_gen = (v5_gen["token_ids"], v5_gen["logprobs"])
    s.srv.stop()  # the engine it replaces
    capsys.readouterr()
    assert cli(["checkpoint", "--store", s.run.store_dir, "--out", str(tmp_path / "ckpt"),
                "--key-file", s.run.key]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["version"] == 2 and out["run_id"] == s.run.run_id
    srv = start_server(out["directory"], str(tmp_path / "server.log"), max_model_len=256)
    status = str(tmp_path / "status.json")
    client = ServerClient(srv.url, status_path=status)
    ctl = Controller([client], run_id=s.run.run_id)
    try:
        for start, line in ((3, "no usable snapshot of v3 in this run"), (0, "is not this run's version 0")):
            with pytest.raises(requests.HTTPError):
                client.sync.init_weight_transfer_engine(s.run.init_info("e0", status, start_version=start))
            assert line in open(srv.log_path).read(), line
        ctl.init([s.run.init_info("e0", status, start_version=2)])
        assert client.status()["committed"] == 2
        (result,) = ctl.refit(5)  # nothing new is published: the update catches up to the committed v5
        assert result.ok and client.status()["committed"] == 5, result
        assert client.checksums() == v5
        gen = generate(srv.url, PROMPTS[2], 12, logprobs=5)
        assert (gen["token_ids"], gen["logprobs"]) == v5_gen
        (result,), stats, _ = _refit_with_a_completion_in_flight(SimpleNamespace(run=s.run, srv=srv, ctl=ctl), 6)
        assert stats.committed and result.ok and client.checksums() != v5
    finally:
        srv.stop()


def test_a_tp2_engine_commits_rolls_back_and_matches_a_dense_tp2_server(tmp_path):
    """TP=2: rank 0 is the run's member and reads/writes rank 1's shards through the backend's
    own channel (``runtimes/vllm/tp.py``).  A malformed init refused, two versions committed
    with a completion in flight, a third aborted and rolled back on both workers, a fourth
    committed after it (the failed update left no worker with a session open or a reply
    queued); then the engine equals a stock TP=2 server started from version 4's dense
    checkpoint, worker by worker (control: version 2 differs)."""
    run = TinyRun(str(tmp_path / "run"), ack_timeout_s=10.0)
    tp2 = ["--tensor-parallel-size", "2"]
    srv = start_server(run.init_dir, str(tmp_path / "server.log"), max_model_len=256, cpu="0|1", extra=tp2)
    status = str(tmp_path / "status.json")
    ctl = Controller([ServerClient(srv.url, status_path=status)], run_id=run.run_id)
    s = SimpleNamespace(run=run, srv=srv, ctl=ctl)
    try:
        r = requests.post(f"{srv.url}/init_weight_transfer_engine", timeout=60,
                          json={"init_info": {**run.init_info("e0"), "pickle": "x"}})
        assert r.status_code == 500 and "init_info: unknown key 'pickle'" in r.text
        ctl.init([run.init_info("e0", status)])
        sums = {}
        for v in (1, 2):
            (result,), stats, completion = _refit_with_a_completion_in_flight(s, v)
            assert stats.committed and result.ok, (stats, result)
            assert [x["version"] for x in completion["weight_versions"]][-1] == f"{run.run_id}:{v}"
            sums[v] = ctl.servers[0].checksums()
        assert {k.split(":")[3] for k in sums[2]} == {"tp0", "tp1"}  # both workers report
        run.step(0.03)
        publish = run.publish()
        publish.join(60)
        assert not publish.stats.committed  # v3: nobody asked within the ack timeout
        with pytest.raises(RefitFailed, match="no acknowledgement"):
            ctl.refit(3)
        assert ctl.servers[0].checksums() == sums[2]  # rolled back on both workers
        (result,), stats, _ = _refit_with_a_completion_in_flight(s, 4)
        assert stats.committed and result.ok and stats.base_version == 2, (stats, result)
        dense = start_server(run.dense_dir("dense-v4"), str(tmp_path / "dense.log"), backend=False,
                             max_model_len=256, cpu="0|1", extra=tp2)
        try:
            want = ServerClient(dense.url).checksums()
            assert differing(ctl.servers[0].checksums(), want) == []
            assert differing(sums[2], want)  # control
            for p in PROMPTS[:2]:
                a, b = generate(srv.url, p, 16, logprobs=5), generate(dense.url, p, 16, logprobs=5)
                assert (a["token_ids"], a["logprobs"]) == (b["token_ids"], b["logprobs"])
        finally:
            dense.stop()
    finally:
        srv.stop()
