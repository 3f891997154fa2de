"""A plain training loop that never calls ``finish()`` (one process, no torch.distributed),
for test_exit_settle.py: the pipelined refit publishes versions 1..3 of one BF16 parameter,
and the process ends with version 3 in flight.

Usage: python exit_loop_worker.py STORE KEY_FILE END [--no-exit-settle]

END ``return``: ``main`` returns (interpreter exit, atexit); ``sigterm``: the loop then waits
and the test sends SIGTERM (the default action); ``sigterm_chained``: the same, with a Python
SIGTERM handler of the loop's own installed before the refit (it prints a line and exits 7:
the refit must settle, then run it).  ``--no-exit-settle`` switches the exit settle off
(``sender._SETTLE_ON_EXIT``, private): the control, the behaviour before it existed.
Every line the worker prints starts with ``worker:``; the test acknowledges versions as
receiver r0 itself.
"""
import faulthandler
import os
import signal
import sys
import time

import numpy as np
import torch

from nemo_dcr.sender import inflight as sender_mod
from nemo_dcr.sender import RefitOptions, RefitSender
from nemo_dcr.layout.mapping import CanonicalProjector, ModelDims, Rule
from nemo_dcr.layout.shards import ParamView, ShardSpec
from nemo_dcr.protocol.manifest import manifest_key
from nemo_dcr.protocol.version0 import write_init_record
from nemo_dcr.transport.store import LocalDirStore

DIMS = ModelDims(num_layers=1, hidden_size=8, num_attention_heads=1, num_query_groups=1, head_dim=8,
                 ffn_hidden_size=8, vocab_size=8)
ACK_TIMEOUT_S = 120.0


def main() -> int:
    store_dir, key, end = sys.argv[1:4]
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # the test's stack dump of a worker that overran
    if "--no-exit-settle" in sys.argv:
        sender_mod._SETTLE_ON_EXIT = False
    if end == "sigterm_chained":
        def own(signum, frame):
            print("worker: own SIGTERM handler", flush=True)
            os._exit(7)
        signal.signal(signal.SIGTERM, own)
    w = torch.randn(32, 32).to(torch.bfloat16)
    spec = ShardSpec(key="w", local_shape=tuple(w.shape), global_shape=tuple(w.shape), global_offset=(0, 0),
                     prepend_axis_num=0, replica_id=(0,), dtype="bfloat16")
    store = LocalDirStore(store_dir)
    sender = RefitSender({"w": w}, {"w": [ParamView("w", 0, spec)]},
                         CanonicalProjector((Rule("w", {"": "canon.w"}),), DIMS), store,
                         RefitOptions(model_id="m", receivers=("r0",), key_file=key, ack_timeout_s=ACK_TIMEOUT_S,
                                      ack_poll_s=0.02, pipeline=True))
    sender.claim()
    sender.set_root(write_init_record(store, sender.sealer, sender.run_id, {}))
    rng = np.random.default_rng(0)
    for v in (1, 2, 3):
        b = w.view(torch.int16).view(-1)
        idx = torch.from_numpy(rng.choice(b.numel(), 50, replace=False))
        b[idx] ^= 1 << 3
        settled = sender.submit(v)
        assert settled is None or settled.committed, settled
    for _ in range(6000):  # its manifest is published (the control's process then ends with it undecided)
        if store.exists(manifest_key(3)):
            break
        time.sleep(0.01)
    print(f"worker: v3 in flight (committed v{sender.baseline.version}), ending by {end}", flush=True)
    if end != "return":  # the test sends SIGTERM; wait for it in short sleeps, as a training loop
        # returns to Python between steps: a process-directed signal may be taken by another
        # thread, and then Python runs its handler only when the main thread next runs Python
        # code -- after one time.sleep(600), 600 s later (seen once under two pytest workers)
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            time.sleep(0.05)
    return 0  # no finish(): interpreter exit


if __name__ == "__main__":
    sys.exit(main())
