"""The backend's tensor-parallel plumbing (``runtimes/vllm/tp.py``) over a real gloo group of
two processes, without vLLM: rank 0's ``ShardedModel`` reads and writes through rank 1's
``Serving`` thread.  The appliers are stand-ins (a flat int16 tensor each worker holds half
of, zeros elsewhere, like a vLLM worker's view of a row-sharded weight): what is tested is the
channel, the two-phase write and the gate, which are the same whatever the applier.  The
real engines are in ``tests/integration/test_vllm_serve_backend.py`` (TP=2 server).
"""
import os
import threading
import time

import numpy as np

N = 64  # elements of the one tensor; rank r holds [32 r, 32 r + 32)


class ShardApplier:
    """A worker's view of one tensor ``w``: its half, zeros outside; ``refuse``: a name
    this worker's validation refuses (as a vLLM loader refuses a shape it cannot place)."""

    def __init__(self, rank: int, full: np.ndarray, refuse: str) -> None:
        self.rank = rank
        self.lo, self.hi = 32 * rank, 32 * rank + 32
        self.view = np.zeros(N, np.int16)
        self.view[self.lo:self.hi] = full[self.lo:self.hi]
        self.refuse = refuse

    def canonical_bits(self, name):
        return self.view

    def canonical_bits_at(self, name, positions):
        return self.view[positions]

    def validate(self, deltas):
        from nemo_dcr.receiver.errors import DeltaValidationError

        for name, _, _ in deltas:
            if name == self.refuse:
                raise DeltaValidationError(f"rank {self.rank} cannot place {name}")

    def apply(self, deltas):
        self.validate(deltas)
        for _, positions, xor in deltas:
            mine = (positions >= self.lo) & (positions < self.hi)
            self.view[positions[mine]] ^= xor[mine]
        return type("Result", (), {"applied": [d[0] for d in deltas], "xor_elements": sum(len(d[1]) for d in deltas),
                                   "overwrite_elements": 0, "through_loader": []})()


def _worker(rank: int, init: str, out) -> None:
    import torch.distributed as dist

    from nemo_dcr.receiver.errors import DeltaValidationError
    from nemo_dcr.receiver.gated import UpdateRefused, WriteGate
    from nemo_dcr.runtimes.vllm.tp import ShardedModel, Serving, WorkerChannel

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    full = np.arange(N, dtype=np.int16) * 3 + 1
    positions = np.array([1, 40, 63], np.int64)
    xor = np.array([0x10, 0x20, 0x40], np.int16)
    want = full.copy()
    want[positions] ^= xor
    applier = ShardApplier(rank, full, refuse="w-rank1-refuses" if rank == 1 else "")
    channel = WorkerChannel.create()
    report = {}
    if rank == 0:
        model = ShardedModel(applier, channel)
        report["bits_whole"] = np.array_equal(model.canonical_bits("w"), full)
        report["local_alone_whole"] = np.array_equal(applier.view, full)  # control: a shard is not the tensor
        at = np.array([3, 31, 32, 60], np.int64)  # both shards, in one call to the workers
        report["bits_at_whole"] = np.array_equal(model.canonical_bits_at_many([("w", at), ("w", at[:1])])[0], full[at])
        report["local_at_whole"] = np.array_equal(applier.canonical_bits_at("w", at), full[at])  # control
        dist.barrier()  # 1: rank 1 has not opened its window
        done = {}
        writer = threading.Thread(target=lambda: done.setdefault("r", model.apply([("w", positions, xor)])))
        writer.start()
        time.sleep(0.5)
        report["rank0_wrote_alone"] = not np.array_equal(applier.view[:32], full[:32])
        dist.barrier()  # 2: rank 1 opens its window now
        writer.join(30)
        model.end_window(1, None)
        report["after_apply_whole"] = np.array_equal(model.canonical_bits("w"), want)
        try:
            model.apply([("w", positions, xor), ("w-rank1-refuses", positions[:0], xor[:0])])
            report["refused"] = None
        except DeltaValidationError as e:
            report["refused"] = str(e)
        report["after_refusal_whole"] = np.array_equal(model.canonical_bits("w"), want)
        model.end_window(2, "v3 was not committed (no acknowledgement); holding v2")
        model.stop()
    else:
        gate = WriteGate()
        serving = Serving(applier, channel, gate).start()
        dist.barrier()  # 1
        time.sleep(1.0)  # rank 0's apply is waiting here: the window is closed
        report["rank1_wrote_while_closed"] = not np.array_equal(applier.view[32:], full[32:])
        dist.barrier()  # 2
        serving.window(1, timeout_s=30)
        report["rank1_after_window"] = np.array_equal(applier.view[32:], want[32:])
        try:
            serving.window(2, timeout_s=30)
            report["window2"] = None
        except UpdateRefused as e:
            report["window2"] = str(e)
        serving.join(10)
        report["thread_ended"] = not serving._thread.is_alive()
    out.put((rank, report))
    dist.destroy_process_group()


def test_rank0_reads_and_writes_every_shard_through_the_channel_and_the_gate(tmp_path):
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    init = f"file://{os.path.join(tmp_path, 'rendezvous')}"
    procs = [ctx.Process(target=_worker, args=(r, init, out)) for r in (0, 1)]
    for p in procs:
        p.start()
    reports = {}
    for _ in procs:
        rank, report = out.get(timeout=120)
        reports[rank] = report
    for p in procs:
        p.join(30)
        assert p.exitcode == 0
    r0, r1 = reports[0], reports[1]
    assert r0["bits_whole"] and not r0["local_alone_whole"]
    assert r0["bits_at_whole"] and not r0["local_at_whole"]
    # a write waits for the worker's own window: rank 0 wrote its shard, rank 1 did not until it opened
    assert r0["rank0_wrote_alone"] and not r1["rank1_wrote_while_closed"]
    assert r1["rank1_after_window"] and r0["after_apply_whole"]
    # one worker's refusal stops every worker's write (two-phase)
    assert r0["refused"] == "rank 1 cannot place w-rank1-refuses"
    assert r0["after_refusal_whole"]
    # the update's outcome reaches the other worker, which raises it
    assert r1["window2"] == "v3 was not committed (no acknowledgement); holding v2"
    assert r1["thread_ended"]
