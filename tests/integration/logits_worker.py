"""torchrun worker for test_logits.py: Megatron-Core model (TP shards) vs the Hugging Face
model built from its canonical export, in fp32, on the same tokens.

Usage: torchrun --nproc-per-node N logits_worker.py OUT.json TP PP
Also reports the same comparison with layer 0's gate/up projections exchanged in the
export (``swapped_max_abs``, the negative control).
"""
import json
import sys

import torch
import torch.distributed as dist


def main() -> None:
    out_path, tp, pp = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    from nemo_dcr.integrations.dense import gather_canonical_state
    from nemo_dcr.integrations.hf_export import llama_config, model_dims
    from nemo_dcr.layout.llama import LLAMA_RULES
    from nemo_dcr.layout.mapping import CanonicalProjector
    from nemo_dcr.layout.shards import collect_param_views
    from nemo_dcr.testbed.model import ModelConfig, build_gpt, init_parallel, unwrap_gpt

    # odd vocab (padded by Megatron), GQA with 2 query heads per group
    cfg = ModelConfig(num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2,
                      ffn_hidden_size=96, vocab_size=203, seq_length=16, init_method_std=0.05)
    init_parallel(tp, pp)
    gpt = unwrap_gpt(build_gpt(cfg, tp=tp, pp=pp))
    params = dict(gpt.named_parameters())
    proj = CanonicalProjector(LLAMA_RULES, model_dims(cfg))
    state = gather_canonical_state(params, collect_param_views(gpt), proj)

    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

    tokens = torch.randint(0, cfg.vocab_size, (2, cfg.seq_length), generator=torch.Generator().manual_seed(7))
    pos = torch.arange(cfg.seq_length).unsqueeze(0).expand(2, -1)
    gpt.float()
    for m in gpt.modules():  # the softmax casts back to the configured bf16 unless told otherwise
        if hasattr(m, "input_in_bf16"):
            m.input_in_bf16 = m.input_in_float16 = m.input_in_fp16 = False
    with torch.no_grad():
        logits = gpt(tokens, pos, None)  # [b, s, v/tp] (vocab-parallel)
        logits = gather_from_tensor_model_parallel_region(logits)[..., : cfg.vocab_size]
    if dist.get_rank() != 0:
        dist.barrier()
        return
    from transformers import LlamaConfig, LlamaForCausalLM

    hf = LlamaForCausalLM(LlamaConfig(**{k: v for k, v in llama_config(cfg).items() if k != "dtype"}))
    hf = hf.to(torch.float32).eval()

    def hf_logits(sd):
        missing, unexpected = hf.load_state_dict({k: v.float() for k, v in sd.items()}, strict=False)
        assert not missing and not unexpected, (missing, unexpected)
        with torch.no_grad():
            return hf(input_ids=tokens).logits

    ref = hf_logits(state)
    g, u = "model.layers.0.mlp.gate_proj.weight", "model.layers.0.mlp.up_proj.weight"
    swapped = hf_logits({**state, g: state[u], u: state[g]})
    json.dump({"max_abs": float((ref - logits).abs().max()),
               "swapped_max_abs": float((swapped - logits).abs().max()),
               "logit_scale": float(ref.abs().max()), "shape": list(ref.shape)}, open(out_path, "w"))
    dist.barrier()


if __name__ == "__main__":
    main()
