"""torchrun worker (2 ranks, TP=1 x DP=2) for test_hook_refusal.py: models the hook must
refuse at construction, with the parameter or setting named and nothing published.

Usage: torchrun --nproc-per-node 2 hook_refusal_worker.py OUT.json STORE_DIR
Each case builds a real megatron-core GPTModel (the test bed's builder, then a change a
user's model could have) and records ``MegatronRefitHook.from_model``'s error message.
"""
import dataclasses
import json
import os
import sys

import torch
import torch.distributed as dist


def main() -> None:
    out_path, store_dir = sys.argv[1], sys.argv[2]
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    from nemo_dcr.integrations.megatron_hook import MegatronRefitHook
    from nemo_dcr.sender import RefitOptions
    from nemo_dcr.layout.families import UnsupportedModelError
    from nemo_dcr_testbed.model import ModelConfig, build_gpt, init_parallel, transformer_config, unwrap_gpt
    from nemo_dcr.transport.store import LocalDirStore

    cfg = ModelConfig(num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2,
                      ffn_hidden_size=96, vocab_size=203, seq_length=16)
    init_parallel(1, 1)
    store = LocalDirStore(store_dir)
    sender = RefitOptions(model_id="refusal", receivers=("r0",))

    def attempt(model, **kw) -> str:
        try:
            MegatronRefitHook.from_model(model, store=store, sender_cfg=sender, vocab_size=cfg.vocab_size, **kw)
        except UnsupportedModelError as e:
            return f"{type(e).__name__}: {e}"
        return "accepted"

    def custom(**changes):
        tc = dataclasses.replace(transformer_config(cfg, tp=1, pp=1), **changes)
        return GPTModel(config=tc, transformer_layer_spec=get_gpt_layer_local_spec(normalization=tc.normalization),
                        vocab_size=256, max_sequence_length=16, position_embedding_type="rope")

    results = {}
    results["control"] = attempt(build_gpt(cfg, tp=1, pp=1))
    results["linear_bias"] = attempt(custom(add_bias_linear=True))
    results["layernorm"] = attempt(custom(normalization="LayerNorm"))
    results["family_mismatch"] = attempt(build_gpt(cfg, tp=1, pp=1), family="qwen3")

    def edited(edit, *, on_ranks=(0, 1)):
        """A fresh model whose sharded_state_dict() is changed by ``edit`` on ``on_ranks``."""
        gpt = unwrap_gpt(build_gpt(cfg, tp=1, pp=1))
        if dist.get_rank() in on_ranks:
            real = gpt.sharded_state_dict

            def patched(*a, **k):
                sd = real(*a, **k)
                edit(sd)
                return sd

            gpt.sharded_state_dict = patched
        return gpt

    def drop_final_norm(sd):
        sd.pop("decoder.final_layernorm.weight")

    def final_norm_main_everywhere(sd):
        sd["decoder.final_layernorm.weight"].replica_id = (0, 0, 0)

    # a parameter sharded_state_dict() leaves uncovered
    results["uncovered"] = attempt(edited(drop_final_norm))
    # both data-parallel replicas claim the main replica of the final norm (a wrong
    # replica_id): every element of it would be emitted twice
    results["twice"] = attempt(edited(final_norm_main_everywhere))
    # only rank 1's model is broken: rank 0 must not wait forever in a collective; every
    # rank raises the same message
    results["one_rank"] = attempt(edited(drop_final_norm, on_ranks=(1,)))
    results["published"] = sorted(os.listdir(store_dir)) if os.path.isdir(store_dir) else []
    if dist.get_rank() == 0:
        with open(out_path, "w") as f:
            json.dump(results, f)
    dist.barrier()


if __name__ == "__main__":
    torch.manual_seed(0)
    main()
