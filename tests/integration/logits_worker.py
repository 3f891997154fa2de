"""torchrun worker for test_logits.py: a Megatron-Core model (TP/PP/EP shards) vs the
Hugging Face model of its family built from its canonical export, in fp32, same tokens.

Usage: torchrun --nproc-per-node N logits_worker.py OUT.json FAMILY TP PP EP [tied]

Everything the export needs comes from the model (``describe_gpt`` + the family registry),
as in ``MegatronRefitHook.from_model``.  Also reports the same comparison with a layout
swap in the export (``swapped_max_abs``, the negative control): layer 0's gate/up halves
(for MoE: those of expert 0).
"""
import json
import sys

import torch
import torch.distributed as dist


def main() -> None:
    out_path, family, tp, pp, ep = sys.argv[1], sys.argv[2], *map(int, sys.argv[3:6])
    tied = "tied" in sys.argv[6:]
    from nemo_dcr.integrations.dense import gather_canonical_state
    from nemo_dcr.integrations.hf_export import hf_config
    from nemo_dcr.integrations.megatron_model import describe_gpt, unwrap_gpt
    from nemo_dcr.layout.families import select_family
    from nemo_dcr.layout.mapping import CanonicalProjector
    from nemo_dcr.layout.shards import collect_param_views
    from nemo_dcr_testbed.model import ModelConfig, build_gpt, init_parallel

    moe = family == "qwen3_moe"
    # odd vocab (padded by Megatron), GQA with 2 query heads per group
    cfg = ModelConfig(num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2,
                      ffn_hidden_size=96, vocab_size=203, seq_length=16, init_method_std=0.05,
                      family=family, num_moe_experts=4 if moe else 0, moe_router_topk=2,
                      moe_ffn_hidden_size=48 if moe else 0, share_embeddings_and_output_weights=tied)
    init_parallel(tp, pp, ep=ep)
    gpt = unwrap_gpt(build_gpt(cfg, tp=tp, pp=pp, ep=ep))
    # norms start at 1.0, where a wrong mapping (q_norm <-> k_norm, input <-> post-attention)
    # would be invisible: give every norm weight distinct values (seeded by name, so the
    # TP replicas of a norm stay identical)
    with torch.no_grad():
        for name, p in gpt.named_parameters():
            if "norm" in name:
                gen = torch.Generator().manual_seed(sum(map(ord, name)) * 7919 + len(name))
                p.copy_(1 + 0.2 * torch.randn(p.shape, generator=gen))
    dims = describe_gpt(gpt, vocab_size=cfg.vocab_size)
    fam = select_family(dims)
    assert fam.name == family, (fam.name, family)
    proj = CanonicalProjector(fam.rules, dims)
    state = gather_canonical_state(dict(gpt.named_parameters()), collect_param_views(gpt), proj)

    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

    tokens = torch.randint(0, cfg.vocab_size, (2, cfg.seq_length), generator=torch.Generator().manual_seed(7))
    pos = torch.arange(cfg.seq_length).unsqueeze(0).expand(2, -1)
    gpt.float()
    for m in gpt.modules():  # the softmax casts back to the configured bf16 unless told otherwise
        if hasattr(m, "input_in_bf16"):
            m.input_in_bf16 = m.input_in_float16 = m.input_in_fp16 = False
    if pp > 1:
        raise SystemExit("logits_worker runs PP=1 (the forward above is not pipelined)")
    with torch.no_grad():
        logits = gpt(tokens, pos, None)  # [b, s, v/tp] (vocab-parallel)
        logits = gather_from_tensor_model_parallel_region(logits)[..., : cfg.vocab_size]
    if dist.get_rank() != 0:
        dist.barrier()
        return
    from transformers import AutoConfig, AutoModelForCausalLM

    config = {k: v for k, v in hf_config(fam, dims).items() if k not in ("dtype", "architectures")}
    hf = AutoModelForCausalLM.from_config(AutoConfig.for_model(**config)).to(torch.float32).eval()
    assert type(hf).__name__ == fam.hf_architecture, type(hf).__name__

    def hf_logits(sd):
        # transformers' own loader (with its checkpoint-layout conversions, e.g. fused
        # experts) from a canonical checkpoint written to disk
        import tempfile

        from safetensors.torch import save_file

        with tempfile.TemporaryDirectory() as d:
            hf.config.save_pretrained(d)
            save_file({k: v.float().contiguous() for k, v in sd.items()}, f"{d}/model.safetensors")
            model = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
        with torch.no_grad():
            return model(input_ids=tokens).logits

    ref = hf_logits(state)
    mlp = "model.layers.0.mlp." + ("experts.0." if moe else "")
    g, u = mlp + "gate_proj.weight", mlp + "up_proj.weight"
    swapped = hf_logits({**state, g: state[u], u: state[g]})
    json.dump({"max_abs": float((ref - logits).abs().max()),
               "swapped_max_abs": float((swapped - logits).abs().max()),
               "logit_scale": float(ref.abs().max()), "shape": list(ref.shape),
               "hf_class": type(hf).__name__, "canonical": sorted(state)}, open(out_path, "w"))
    dist.barrier()


if __name__ == "__main__":
    main()
