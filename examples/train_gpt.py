"""Train a small Llama-style megatron-core GPT on CPU for a few steps and print the losses.

    torchrun --standalone --nproc-per-node 2 examples/train_gpt.py --tp 2
    torchrun --standalone --nproc-per-node 2 examples/train_gpt.py --tp 1 --pp 2 --num-microbatches 2
    torchrun --standalone --nproc-per-node 4 examples/train_gpt.py --tp 2 --pp 2

A post-step hook (the seam the refit path uses) counts, on every rank, how many BF16 elements
of its shards the step changed; rank 0 prints the sum over all ranks.
"""
from __future__ import annotations

import argparse
import time
import warnings

warnings.filterwarnings("ignore", category=UserWarning, module=r"megatron\..*")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from nemo_dcr_testbed import ModelConfig, TrainConfig, Trainer  # noqa: E402


class ChangeCounter:
    """Post-step hook: BF16 elements whose bits differ from the previous step."""

    def __init__(self, trainer: Trainer):
        self.prev = {n: p.detach().view(torch.int16).clone() for n, p in trainer.bf16_params().items()}
        self.changed = 0
        self.numel = sum(t.numel() for t in self.prev.values())

    def __call__(self, trainer: Trainer, step: int) -> None:
        self.changed = 0
        for n, p in trainer.bf16_params().items():
            now = p.detach().view(torch.int16)
            self.changed += int((now != self.prev[n]).sum())
            self.prev[n].copy_(now)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--pp", type=int, default=1)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--lr", type=float, default=1e-5)
    ap.add_argument("--num-microbatches", type=int, default=1)
    ap.add_argument("--num-layers", type=int, default=2)
    ap.add_argument("--hidden-size", type=int, default=128)
    ap.add_argument("--num-attention-heads", type=int, default=4)
    ap.add_argument("--num-query-groups", type=int, default=2)
    ap.add_argument("--ffn-hidden-size", type=int, default=256)
    ap.add_argument("--vocab-size", type=int, default=1000)
    ap.add_argument("--seq-length", type=int, default=64)
    args = ap.parse_args()

    model_cfg = ModelConfig(
        num_layers=args.num_layers, hidden_size=args.hidden_size,
        num_attention_heads=args.num_attention_heads, num_query_groups=args.num_query_groups,
        ffn_hidden_size=args.ffn_hidden_size, vocab_size=args.vocab_size,
        seq_length=args.seq_length,
    )
    trainer = Trainer(model_cfg, TrainConfig(lr=args.lr, num_microbatches=args.num_microbatches),
                      tp=args.tp, pp=args.pp)
    counter = ChangeCounter(trainer)
    trainer.add_post_step_hook(counter)
    rank = dist.get_rank()
    if rank == 0:
        print(f"world={dist.get_world_size()} tp={args.tp} pp={args.pp} {model_cfg}")
    for _ in range(args.steps):
        t0 = time.perf_counter()
        res = trainer.train_step()
        dt = time.perf_counter() - t0
        counts = torch.tensor([counter.changed, counter.numel], dtype=torch.int64)
        dist.all_reduce(counts)
        if rank == 0:
            print(f"step {res.step}  loss {res.loss:.5f}  grad_norm {res.grad_norm:.4f}  "
                  f"bf16 changed {100 * counts[0].item() / counts[1].item():.2f}%  {dt * 1e3:.0f} ms")
    trainer.close()


if __name__ == "__main__":
    main()
