"""The refit hook in your own training loop (what `nemo-dcr demo` runs, without the
orchestration), one trainer process per rank:

    torchrun --standalone --nproc-per-node 2 examples/refit_with_hook.py --store /tmp/dcr --steps 3

and, in another shell, once ``/tmp/dcr/init/model.safetensors`` exists, a receiver:

    nemo-dcr receive --store /tmp/dcr --receiver-id r0 --model-id example \
        --init-dir /tmp/dcr/init --until-version 3

The trainer blocks after each step until the receiver acknowledged the version (joint
commit), so start the receiver within ``--ack-timeout-s``.
"""
from __future__ import annotations

import argparse
import warnings

warnings.filterwarnings("ignore", category=UserWarning, module=r"megatron\..*")

import torch.distributed as dist  # noqa: E402

from nemo_dcr.integrations.megatron_hook import MegatronRefitHook  # noqa: E402
from nemo_dcr.sender import RefitOptions  # noqa: E402
from nemo_dcr_testbed import ModelConfig, TrainConfig, Trainer  # noqa: E402
from nemo_dcr.transport.store import open_store  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--store", required=True, help="directory or fsspec URI")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--ack-timeout-s", type=float, default=600.0)
    args = ap.parse_args()

    trainer = Trainer(ModelConfig(), TrainConfig(lr=2e-6), tp=args.tp)
    hook = MegatronRefitHook.from_model(  # family, dims and sharding come from the model itself
        trainer.model, store=open_store(args.store), vocab_size=trainer.model_cfg.vocab_size,
        sender_cfg=RefitOptions(model_id="example", receivers=("r0",), ack_timeout_s=args.ack_timeout_s),
    )
    hook.export_initial()  # version 0: the HF checkpoint both sides start from
    trainer.add_post_step_hook(hook)  # runs on every rank after each optimizer step
    def report(s):  # the pipelined refit (the default) decides version v while step v+1 trains
        if s is not None and dist.get_rank() == 0:
            print(f"version {s.version}: {s.changed} changed, {s.wire_bytes} wire bytes vs {s.dense_bytes} dense, "
                  f"committed={s.committed}", flush=True)

    decided = 0
    for _ in range(args.steps):
        result = trainer.train_step()
        if dist.get_rank() == 0:
            print(f"step {result.step}: loss {result.loss:.4f}", flush=True)
        if hook.last_stats is not None and hook.last_stats.version > decided:
            decided = hook.last_stats.version
            report(hook.last_stats)
    report(hook.finish())  # the last version in flight, decided before the process ends
    trainer.close()


if __name__ == "__main__":
    main()
