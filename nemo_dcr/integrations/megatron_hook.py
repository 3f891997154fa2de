"""The refit hook for Megatron-Core training: runs on every rank after each optimizer step.

It is the single object a training loop needs: ``Trainer.add_post_step_hook(hook)`` in our
examples, a Lightning/NeMo callback's ``on_train_batch_end`` in a NeMo recipe.  Everything
it needs is derived from the model itself: the shard -> canonical map from
``sharded_state_dict()`` and the declarative Llama table.
"""
from __future__ import annotations

import time

import torch
import torch.distributed as dist
from safetensors.torch import save as save_safetensors

from nemo_dcr.integrations.dense import gather_canonical_state
from nemo_dcr.integrations.hf_export import model_dims, write_checkpoint
from nemo_dcr.integrations.sender import PublishStats, RefitSender, SenderConfig
from nemo_dcr.layout.llama import LLAMA_RULES
from nemo_dcr.layout.mapping import CanonicalProjector
from nemo_dcr.layout.shards import collect_param_views
from nemo_dcr.testbed.model import ModelConfig
from nemo_dcr.protocol.manifest import dense_key
from nemo_dcr.transport.store import ObjectStore


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


class MegatronRefitHook:
    def __init__(self, gpt: torch.nn.Module, model_cfg: ModelConfig, store: ObjectStore,
                 sender_cfg: SenderConfig, *, verify_dense: bool = False):
        """``gpt``: the inner megatron ``GPTModel`` of this rank (BF16 params)."""
        self.model_cfg = model_cfg
        self.store = store
        self.verify_dense = verify_dense
        self.params = dict(gpt.named_parameters())
        self.views = collect_param_views(gpt)
        self.projector = CanonicalProjector(LLAMA_RULES, model_dims(model_cfg))
        self.sender = RefitSender(self.params, self.views, self.projector, store, sender_cfg)
        self.last_stats: PublishStats | None = None

    def dense_state(self) -> dict[str, torch.Tensor] | None:
        """Collective: the full canonical state on rank 0 (None elsewhere)."""
        return gather_canonical_state(self.params, self.views, self.projector)

    def export_initial(self) -> None:
        """Collective: write version 0 (the initial HF checkpoint) to the store."""
        state = self.dense_state()
        if _rank() == 0:
            write_checkpoint(self.store, self.model_cfg, state)

    def __call__(self, trainer, step: int) -> None:
        before = None
        dense_s = 0.0
        if self.verify_dense:
            t0 = time.perf_counter()
            state = self.dense_state()
            dense_s = time.perf_counter() - t0
            if _rank() == 0:
                def before(manifest, state=state):
                    self.store.put(dense_key(manifest.version), save_safetensors(state))
        stats = self.sender.refit(step, before_manifest=before)
        stats.reference_s = dense_s
        self.last_stats = stats
