"""torchrun worker for tests/megatron: trains a few steps and writes what it saw as JSON.

Run by the tests as ``torchrun --standalone --nproc-per-node N _worker.py OUT_DIR --tp T --pp P
--steps S [--ep E --family F --tie --dist-opt --first-stage-layers K ...]``; each rank writes
``OUT_DIR/rank{R}.json``.  It checks nothing itself: the tests compare what the ranks recorded.
Model-shape flags left out keep ``ModelConfig``'s defaults.
"""
from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import math
import os
import sys
import warnings

warnings.filterwarnings("ignore", message=".*Transformer Engine and Apex are not installed.*")

import torch  # noqa: E402

from nemo_dcr_testbed import cpu_shim  # noqa: E402
from nemo_dcr_testbed.model import ModelConfig  # noqa: E402
from nemo_dcr_testbed.train import TrainConfig, Trainer  # noqa: E402


def bits(t: torch.Tensor) -> torch.Tensor:
    assert t.dtype == torch.bfloat16
    return t.detach().contiguous().view(torch.int16)


def digest(t: torch.Tensor) -> str:
    return hashlib.sha256(bits(t).numpy().tobytes()).hexdigest()


def layout_records(gpt) -> list[dict]:
    """The ShardedTensor metadata of ``gpt.sharded_state_dict()``, factories built."""
    from megatron.core.dist_checkpointing.mapping import (
        ShardedObject,
        ShardedTensor,
        ShardedTensorFactory,
    )

    # Which parameter's memory a shard's data lies in.  By address range, not by storage: with
    # the distributed optimizer all params are views into one contiguous DDP param buffer.
    spans = sorted(
        (p.data_ptr(), p.data_ptr() + p.numel() * p.element_size(), n) for n, p in gpt.named_parameters()
    )

    def owner(t) -> str | None:
        lo = t.data_ptr()
        hits = [n for a, b, n in spans if a <= lo < b]
        return hits[0] if len(hits) == 1 else None

    def tensor_record(sd_name: str, st, factory: str | None) -> dict:
        return {
            "sd_name": sd_name,
            "factory": factory,
            "key": st.key,
            "dtype": str(st.dtype).removeprefix("torch."),
            "local_shape": list(st.local_shape),
            "global_shape": list(st.global_shape),
            "global_offset": list(st.global_offset),
            "axis_fragmentations": list(st.axis_fragmentations),
            "replica_id": list(st.replica_id) if isinstance(st.replica_id, tuple) else [st.replica_id],
            "prepend_axis_num": st.prepend_axis_num,
            "flattened_range": None if st.flattened_range is None else [
                st.flattened_range.start, st.flattened_range.stop
            ],
            # Which parameter's storage the shard's data lives in (None: not a parameter).
            "param_storage": owner(st.data),
        }

    out = []
    for sd_name, v in gpt.sharded_state_dict().items():
        if isinstance(v, ShardedTensor):
            out.append(tensor_record(sd_name, v, None))
        elif isinstance(v, ShardedTensorFactory):
            built = v.build_fn(v.key, v.data, v.replica_id, v.flattened_range)
            parts = built.values() if isinstance(built, dict) else built
            fname = v.build_fn.__qualname__.split(".")[0]
            for st in parts:
                out.append(tensor_record(sd_name, st, fname))
        elif isinstance(v, ShardedObject):
            out.append({"sd_name": sd_name, "object_key": v.key})
        else:
            out.append({"sd_name": sd_name, "other": type(v).__name__})
    return out


def shim_checks() -> dict:
    """What the shim changed, observed from outside (in a process that applied it)."""
    from megatron.core.optimizer import clip_grads, optimizer

    first = cpu_shim.apply()
    again = cpu_shim.apply()
    probe = torch.zeros(2, dtype=torch.bfloat16)
    with cpu_shim._cuda_type_names():
        inside = probe.type()
    try:
        probe.cuda()
        cuda_outside_raises = False
    except (AssertionError, RuntimeError):
        cuda_outside_raises = True
    stream = torch.cuda.current_stream()
    stream_context = torch.cuda.stream(stream)
    with stream_context:
        stream.wait_stream(stream)
        stream.wait_event(None)
    import megatron.core
    from megatron.core.models.common.language_module.language_module import LanguageModule
    from megatron.core.transformer.moe import moe_utils

    return {
        "megatron_core": megatron.core.__version__,
        "cuda_outside_scope_raises": cuda_outside_raises,
        "setup_embeddings_scoped": bool(getattr(
            LanguageModule.setup_embeddings_and_output_layer, "__nemo_dcr_cpu_shim__", False)),
        "te_general_gemm_is_none": moe_utils.te_general_gemm is None,
        "idempotent": first is again,
        "current_device": str(torch.cuda.current_device()),
        "current_stream_is_cpu": stream is cpu_shim.CPU_STREAM,
        "stream_context_is_null": isinstance(stream_context, contextlib.nullcontext),
        "type_outside_scope": probe.type(),
        "type_inside_scope": inside,
        "clip_scoped": bool(getattr(optimizer.clip_grad_by_total_norm_fp32, "__nemo_dcr_cpu_shim__", False))
        and optimizer.clip_grad_by_total_norm_fp32 is clip_grads.clip_grad_by_total_norm_fp32,
        "report": {
            "torch_cuda_functions": list(first.torch_cuda_functions),
            "factory_proxied_modules": list(first.factory_proxied_modules),
            "type_name_scoped": list(first.type_name_scoped),
            "cuda_noop_scoped": list(first.cuda_noop_scoped),
            "missing_globals_defined": list(first.missing_globals_defined),
        },
    }


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("out_dir")
    ap.add_argument("--tp", type=int, required=True)
    ap.add_argument("--pp", type=int, default=1)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--lr", type=float, default=1e-5)
    ap.add_argument("--vocab-size", type=int, default=1000)
    ap.add_argument("--num-microbatches", type=int, default=1)
    ap.add_argument("--ep", type=int, default=1)
    ap.add_argument("--first-stage-layers", type=int, default=0)
    ap.add_argument("--last-stage-layers", type=int, default=0)
    ap.add_argument("--dist-opt", action="store_true", help="megatron's distributed optimizer")
    ap.add_argument("--tie", action="store_true", help="share_embeddings_and_output_weights")
    ap.add_argument("--family")
    # ModelConfig shape overrides (omitted: ModelConfig's defaults).
    shape = ("num_layers", "hidden_size", "num_attention_heads", "num_query_groups",
             "ffn_hidden_size", "seq_length", "num_moe_experts", "moe_router_topk")
    for name in shape:
        ap.add_argument("--" + name.replace("_", "-"), type=int)
    args = ap.parse_args()

    model_kw = {n: getattr(args, n) for n in shape if getattr(args, n) is not None}
    if args.family:
        model_kw["family"] = args.family
    if args.tie:
        model_kw["share_embeddings_and_output_weights"] = True
    trainer = Trainer(
        ModelConfig(vocab_size=args.vocab_size, **model_kw),
        TrainConfig(lr=args.lr, num_microbatches=args.num_microbatches,
                    use_distributed_optimizer=args.dist_opt),
        tp=args.tp,
        pp=args.pp,
        ep=args.ep,
        first_stage_layers=args.first_stage_layers,
        last_stage_layers=args.last_stage_layers,
    )
    from megatron.core import parallel_state as ps

    rank = torch.distributed.get_rank()
    record: dict = {
        "rank": rank,
        "tp_rank": ps.get_tensor_model_parallel_rank(),
        "pp_rank": ps.get_pipeline_model_parallel_rank(),
        "dp_rank": ps.get_data_parallel_rank(),
        "ep_rank": ps.get_expert_model_parallel_rank(),
        "shim": shim_checks(),
        "layout": layout_records(trainer.gpt),
        "param_dtypes": sorted({str(p.dtype) for p in trainer.bf16_params().values()}),
        "master_dtypes": sorted({str(m.master.dtype) for m in trainer.master_shards().values()}),
        "initial_digests": {n: digest(p) for n, p in trainer.bf16_params().items()},
        "steps": [],
    }

    seen_in_hook: dict[int, dict[str, str]] = {}

    def hook(tr: Trainer, step: int) -> None:
        seen_in_hook[step] = {n: digest(p) for n, p in tr.bf16_params().items()}

    trainer.add_post_step_hook(hook)
    for _ in range(args.steps):
        before = {n: bits(p).clone() for n, p in trainer.bf16_params().items()}
        res = trainer.train_step()
        params = trainer.bf16_params()
        # Whole params (non-distributed optimizer) or this DP rank's slices (distributed).
        masters = trainer.master_shards()
        changed = {n: int((bits(p) != before[n]).sum()) for n, p in params.items()}
        record["steps"].append({
            "step": res.step,
            "loss": res.loss if math.isfinite(res.loss) else str(res.loss),
            "grad_norm": res.grad_norm,
            "update_successful": res.update_successful,
            "numel": {n: p.numel() for n, p in params.items()},
            "changed": changed,
            "digests": {n: digest(p) for n, p in params.items()},
            "hook_digests": seen_in_hook.get(res.step),
            "master_digests": {
                n: hashlib.sha256(m.master.detach().contiguous().view(torch.int32).numpy().tobytes()).hexdigest()
                for n, m in masters.items()
            },
            "master_ranges": {n: [m.start, m.stop] for n, m in masters.items()},
            # BF16 param (the slice a master covers) == that FP32 master rounded to BF16.
            "bf16_is_rounded_master": {
                n: bool(torch.equal(bits(m.master.to(torch.bfloat16)),
                                    bits(params[n].view(-1)[m.start:m.stop])))
                for n, m in masters.items()
            },
            # Master elements not representable in BF16 (the extra precision it carries).
            "master_finer_than_bf16": sum(
                int((m.master != params[n].view(-1)[m.start:m.stop].float()).sum())
                for n, m in masters.items()
            ),
        })
        if rank == 0:
            tot = sum(record["steps"][-1]["numel"].values())
            ch = sum(changed.values())
            print(f"step {res.step} loss {res.loss:.5f} grad_norm {res.grad_norm:.4f} "
                  f"changed {ch}/{tot} = {100 * ch / tot:.2f}% (rank 0)", flush=True)

    with open(os.path.join(args.out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(record, f)
    trainer.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
