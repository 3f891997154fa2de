"""Test launcher: ``nemo-dcr receive`` that SIGKILLs itself in the middle of an apply.

``python killing_worker.py --kill-at-apply N -- <receiver args>``: the N-th call of
``DeltaApplier.apply`` writes the first half of the first DIRECT tensor's changed
elements into the weights and then kills the process (no exception handler, no cleanup:
the partial write stays in the shared weights file).  Fault injection for tests only.
"""
import os
import signal
import sys

import nemo_dcr.receiver.apply as apply_mod
from nemo_dcr.receiver import cli


def main() -> int:
    argv = sys.argv[1:]
    sep = argv.index("--")
    kill_at = int(argv[argv.index("--kill-at-apply") + 1])
    calls = {"n": 0}
    real_apply, real_write = apply_mod.DeltaApplier.apply, apply_mod._write_direct

    def counting_apply(self, deltas, *args, **kwargs):
        calls["n"] += 1
        return real_apply(self, deltas, *args, **kwargs)

    def half_then_die(flat, p):
        if calls["n"] != kill_at or p.xor_idx is None:
            return real_write(flat, p)
        half = p.xor_idx.size // 2
        bits = flat.numpy()
        idx = p.xor_idx[:half]
        bits.put(idx, bits.take(idx) ^ p.xor_val[:half])
        print(f"KILLING after {half} of {p.xor_idx.size} elements of {p.name}", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)

    apply_mod.DeltaApplier.apply = counting_apply
    apply_mod._write_direct = half_then_die
    return cli.main(argv[sep + 1:])


if __name__ == "__main__":
    sys.exit(main())
