"""torchrun worker (DP=2, distributed optimizer with overlap_param_gather=True) for
test_param_gather.py.  After ``optimizer.step()`` each rank has updated only its own
optimizer shard of the BF16 params; megatron would all-gather the rest in the next
forward.  Records, per step, whether the two ranks' BF16 params are bit-identical
(digest of integer views) right after step() and after ``hook.sync_params()``, and that
training continues normally after the forced gather (loss finite, next step's
pre-forward gather not doubled: params still identical after the next step's sync).

Usage: torchrun --nproc-per-node 2 param_gather_worker.py OUT.json STORE_DIR
"""
import hashlib
import json
import sys

import torch
import torch.distributed as dist


def _digest(params) -> str:
    h = hashlib.sha256()
    for name, p in params.items():
        h.update(name.encode())
        h.update(p.detach().contiguous().view(torch.int16).numpy().tobytes())
    return h.hexdigest()


def main() -> None:
    out_path, store_dir = sys.argv[1], sys.argv[2]
    from nemo_dcr.integrations.megatron_hook import MegatronRefitHook
    from nemo_dcr.sender import RefitOptions
    from nemo_dcr_testbed import ModelConfig, TrainConfig, Trainer
    from nemo_dcr.transport.store import LocalDirStore

    cfg = ModelConfig(num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2,
                      ffn_hidden_size=96, vocab_size=203, seq_length=16)
    trainer = Trainer(cfg, TrainConfig(lr=1e-3, use_distributed_optimizer=True, overlap_param_gather=True), tp=1)
    hook = MegatronRefitHook.from_model(trainer.model, store=LocalDirStore(store_dir), vocab_size=cfg.vocab_size,
                                        sender_cfg=RefitOptions(model_id="pg", receivers=("r0",)))
    params = dict(trainer.gpt.named_parameters())
    rows = []
    for _ in range(3):
        result = trainer.train_step()
        before = [None, None]
        dist.all_gather_object(before, _digest(params))
        hook.sync_params()
        after = [None, None]
        dist.all_gather_object(after, _digest(params))
        rows.append({"loss": result.loss, "identical_before_sync": before[0] == before[1],
                     "identical_after_sync": after[0] == after[1], "digest": after[0]})
    if dist.get_rank() == 0:
        with open(out_path, "w") as f:
            json.dump({"deferred": len(hook._param_gathers), "steps": rows}, f)
    dist.barrier()
    trainer.close()


if __name__ == "__main__":
    main()
