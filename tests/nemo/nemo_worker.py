"""torchrun worker (runs in ``.venv-nemo``) for test_nemo_recipe.py: the example's NeMo recipe
(``examples/nemo_llama3_refit.py``: ``llm.llama3_8b.pretrain_recipe``, tiny, the refit callback
appended as a user would) plus one test-only callback, :class:`Oracle`, appended after it.

Usage: torchrun --nproc-per-node N nemo_worker.py OUT_DIR [example arguments ...]

After every optimizer step (after the refit callback published the version) the oracle
  * checks that every BF16 parameter is bit-identical on all data-parallel ranks (with the
    recipe's distributed optimizer and ``overlap_param_gather`` each rank would otherwise hold
    stale bits outside its optimizer shard: this shows the refit read synced parameters);
  * writes the dense reference of the version: the NeMo model's full tensors gathered to
    rank 0 and converted by the dense transforms (OUT_DIR/v<step>.safetensors).
and records the version the refit callback decided in that call (``last_metrics``: pipelined,
the previous step's; the last one is decided in the callback's ``on_train_end``, which Lightning
calls before the oracle's).  When training ends (PP=1 only) it gives every norm weight distinct
values (so a norm mix-up would show), writes those weights (OUT_DIR/logits_weights.safetensors),
runs the megatron model in fp32 on fixed tokens and writes the gathered logits
(OUT_DIR/logits.safetensors).  OUT_DIR/meta.json says what ran (``decided``: [version,
committed] in the order decided).
"""
import importlib.util
import json
import os
import sys

import torch
import torch.distributed as dist

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))


def _example():
    spec = importlib.util.spec_from_file_location("nemo_llama3_refit", os.path.join(ROOT, "examples", "nemo_llama3_refit.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


from nemo.lightning.base_callback import BaseCallback  # noqa: E402 - after the docstring's setup


class Oracle(BaseCallback):
    def __init__(self, out_dir: str):
        super().__init__()
        self.out_dir = out_dir
        self.versions: list[int] = []
        self.decided: list[list] = []

    def _refit(self, trainer):
        from nemo_dcr.integrations.nemo import RefitCallback

        (refit,) = [cb for cb in trainer.callbacks if isinstance(cb, RefitCallback)]
        return refit

    def _hook(self, trainer):
        return self._refit(trainer).refit.hook

    def _note_decided(self, trainer) -> None:
        m = self._refit(trainer).last_metrics
        if m is not None and (not self.decided or self.decided[-1][0] != m.version):
            self.decided.append([m.version, m.committed])

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        from megatron.core import parallel_state
        from safetensors.torch import save_file

        hook = self._hook(trainer)
        group = parallel_state.get_data_parallel_group()
        dp = dist.get_world_size(group)
        for name, p in hook.params.items():
            bits = p.detach().contiguous().view(torch.int16).to(torch.int32)  # gloo has no int16
            copies = [torch.empty_like(bits) for _ in range(dp)]
            dist.all_gather(copies, bits, group=group)
            assert all(torch.equal(c, bits) for c in copies), f"{name} differs across DP ranks after the refit"
        step = int(trainer.global_step)
        self._note_decided(trainer)
        state = hook.dense_state()
        if dist.get_rank() == 0:
            save_file(state, os.path.join(self.out_dir, f"v{step}.safetensors"))
            self.versions.append(step)

    def on_train_end(self, trainer, pl_module):
        from megatron.core import parallel_state

        from nemo_dcr.integrations.megatron_model import unwrap_gpt

        hook = self._hook(trainer)
        self._note_decided(trainer)  # the last version, drained by the refit callback's on_train_end
        pp = parallel_state.get_pipeline_model_parallel_world_size()
        if pp == 1:  # the forward below is not pipelined
            self._logits(hook, unwrap_gpt(pl_module))
        if dist.get_rank() == 0:
            meta = {"versions": self.versions, "decided": self.decided,
                    "tp": parallel_state.get_tensor_model_parallel_world_size(), "pp": pp,
                    "dp": parallel_state.get_data_parallel_world_size(),
                    "deferred_param_gathers": len(hook._param_gathers),
                    "family": hook.family.name, "vocab_size": hook.dims.vocab_size}
            with open(os.path.join(self.out_dir, "meta.json"), "w") as f:
                json.dump(meta, f)

    def _logits(self, hook, gpt):
        from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region
        from safetensors.torch import save_file

        with torch.no_grad():
            for name, p in hook.params.items():
                if "norm" in name:  # seeded by name: TP / DP replicas stay identical
                    gen = torch.Generator().manual_seed(sum(map(ord, name)) * 7919 + len(name))
                    p.copy_(1 + 0.2 * torch.randn(p.shape, generator=gen))
        state = hook.dense_state()
        tokens = torch.randint(0, hook.dims.vocab_size, (2, 16), generator=torch.Generator().manual_seed(7))
        pos = torch.arange(tokens.shape[1]).unsqueeze(0).expand(tokens.shape[0], -1)
        gpt.float()
        for m in gpt.modules():  # the softmax casts back to the configured bf16 unless told otherwise
            if hasattr(m, "input_in_bf16"):
                m.input_in_bf16 = m.input_in_float16 = m.input_in_fp16 = False
        gpt.eval()
        with torch.no_grad():
            logits = gpt(tokens, pos, None)  # [b, s, padded_vocab / tp]
            logits = gather_from_tensor_model_parallel_region(logits)[..., : hook.dims.vocab_size]
        if dist.get_rank() == 0:
            save_file(state, os.path.join(self.out_dir, "logits_weights.safetensors"))
            save_file({"tokens": tokens, "logits": logits.float().contiguous()},
                      os.path.join(self.out_dir, "logits.safetensors"))


def main() -> None:
    import nemo_run as run

    from nemo_dcr_testbed import nemo_cpu

    out_dir, argv = sys.argv[1], sys.argv[2:]
    nemo_cpu.apply()
    recipe = _example().build(argv)
    recipe.trainer.callbacks.append(run.Config(Oracle, out_dir=out_dir))
    run.run(recipe, direct=True)


if __name__ == "__main__":
    main()
