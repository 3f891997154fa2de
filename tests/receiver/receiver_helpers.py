"""Shared builders for the receiver tests: a real tiny Llama and synthetic BF16 deltas."""
from __future__ import annotations

import numpy as np
import torch

from nemo_dcr.codec.types import BITS_DTYPE, DeltaOp, TensorDelta

_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}

#: bf16 bit patterns a float path could disturb: +/-Inf, quiet and signalling NaNs with
#: payloads, the smallest subnormal, negative zero.
SPECIAL_BF16 = np.array([0x7F80, 0xFF80, 0x7FC1, 0xFFC3, 0x7F81, 0xFF85, 0x0001, 0x8000], dtype=np.uint16)


def llama(*, tie: bool = False, seed: int = 0, dtype: torch.dtype = torch.bfloat16):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        num_hidden_layers=2,
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=128,
        vocab_size=101,
        tie_word_embeddings=tie,
    )
    torch.manual_seed(seed)
    return LlamaForCausalLM(cfg).to(dtype).eval()


def bits(t: torch.Tensor) -> np.ndarray:
    """Flat unsigned bit patterns of ``t`` (a copy)."""
    t = t.detach().contiguous().reshape(-1)
    return t.view(_INT[t.element_size()]).numpy().view(BITS_DTYPE[str(t.dtype).removeprefix("torch.")]).copy()


def from_bits(b: np.ndarray, like: torch.Tensor) -> torch.Tensor:
    signed = b.view({1: np.uint8, 2: np.int16, 4: np.int32, 8: np.int64}[b.itemsize])
    return torch.from_numpy(signed.copy()).view(like.dtype).reshape(like.shape)


def canonical_state(module: torch.nn.Module, names) -> dict[str, torch.Tensor]:
    sd = module.state_dict()
    return {n: sd[n].detach().clone() for n in names}


def perturb(
    state: dict[str, torch.Tensor], rng: np.random.Generator, *, frac: float = 0.03, special: bool = False
) -> dict[str, torch.Tensor]:
    """A target state with ``frac`` of each tensor's elements set to random bit patterns
    (and, with ``special``, some of them to NaN / Inf / subnormal patterns)."""
    out = {}
    for name, t in state.items():
        b = bits(t)
        k = max(1, int(frac * b.size))
        pos = rng.choice(b.size, size=k, replace=False)
        b[pos] = rng.integers(0, 1 << (8 * b.itemsize), size=k, dtype=np.uint64).astype(b.dtype)
        if special:
            b[pos[: len(SPECIAL_BF16)]] = SPECIAL_BF16[: min(k, len(SPECIAL_BF16))]
        out[name] = from_bits(b, t)
    return out


def deltas(
    base: dict[str, torch.Tensor],
    target: dict[str, torch.Tensor],
    *,
    op: DeltaOp = DeltaOp.XOR,
    split_every: int = 2,
) -> list[TensorDelta]:
    """Delta records taking ``base`` to ``target``; every ``split_every``-th tensor is sent
    as two records, alternately over disjoint element ranges (column-parallel ranks) and
    over interleaved positions with overlapping ranges (row-parallel ranks)."""
    out = []
    for i, name in enumerate(sorted(base)):
        a, b = bits(base[name]), bits(target[name])
        x = a ^ b
        pos = np.flatnonzero(x).astype(np.int64)
        vals = x[pos] if op is DeltaOp.XOR else b[pos]
        dtype = str(base[name].dtype).removeprefix("torch.")
        shape = tuple(base[name].shape)
        if split_every and i % (2 * split_every) == split_every and pos.size > 1:
            for parity in (0, 1):
                sel = (pos // 7) % 2 == parity
                span = (int(pos[sel][0]), int(pos[sel][-1]) + 1) if sel.any() else (0, 0)
                out.append(TensorDelta(name, dtype, shape, op, pos[sel], vals[sel], element_range=span))
            continue
        cuts = [0, a.size // 3, a.size] if split_every and i % split_every == 0 else [0, a.size]
        for lo, hi in zip(cuts, cuts[1:]):
            sel = (pos >= lo) & (pos < hi)
            out.append(TensorDelta(name, dtype, shape, op, pos[sel], vals[sel], element_range=(lo, hi)))
    return out


def flip_one_bit(t: torch.Tensor, flat_index: int, bit: int = 0) -> None:
    with torch.no_grad():
        v = t.detach().view(-1).view(_INT[t.element_size()])
        v[flat_index] ^= 1 << bit


ONE_TENSOR = "model.layers.0.mlp.down_proj.weight"
"""The receiver tensor :func:`one_tensor_trainer` maps its one trainer parameter onto."""


def one_tensor_trainer(tmp_path, model, *, target: str = ONE_TENSOR, **options):
    """The real sender in this process (no torch.distributed) over a fresh directory store
    ``tmp_path/store``, signed with a new key ``tmp_path/key``: one trainer parameter ``w`` (a
    copy of ``model``'s ``ONE_TENSOR``) mapped onto ``target``, version 0 ``model``'s HF
    checkpoint.  ``options``: ``RefitOptions`` fields over ``model_id="m"``,
    ``receivers=("r0",)``, ``ack_poll_s=0.02``.  Returns ``(sender, w, key, store)``."""
    from nemo_dcr.integrations.hf_export import write_checkpoint
    from nemo_dcr.layout.mapping import CanonicalProjector, ModelDims, Rule
    from nemo_dcr.layout.shards import ParamView, ShardSpec
    from nemo_dcr.protocol.signing import new_key_file
    from nemo_dcr.sender import RefitOptions, RefitSender
    from nemo_dcr.transport.store import LocalDirStore

    key = new_key_file(str(tmp_path / "key"))
    state = {k: v.detach().clone().contiguous() for k, v in model.state_dict().items()}
    w = state[ONE_TENSOR].clone()
    spec = ShardSpec(key="w", local_shape=tuple(w.shape), global_shape=tuple(w.shape), global_offset=(0, 0),
                     prepend_axis_num=0, replica_id=(0,), dtype="bfloat16")
    dims = ModelDims(num_layers=1, hidden_size=8, num_attention_heads=1, num_query_groups=1, head_dim=8,
                     ffn_hidden_size=8, vocab_size=8)
    store = LocalDirStore(str(tmp_path / "store"))
    sender = RefitSender({"w": w}, {"w": [ParamView("w", 0, spec)]},
                         CanonicalProjector((Rule("w", {"": target}),), dims), store,
                         RefitOptions(**{"model_id": "m", "receivers": ("r0",), "ack_poll_s": 0.02,
                                         "key_file": key, **options}))
    sender.set_root(write_checkpoint(store, model.config.to_dict(), state, sealer=sender.sealer,
                                     run_id=sender.claim()))
    return sender, w, key, store


def flip_refits(sender, w, versions, out: dict):
    """Publish ``versions`` on a daemon thread (returned, started), 64 random bits of ``w``
    flipped before each: ``out[v]`` = the version's stats, or ``out["error"]`` = what the
    sender raised."""
    import threading

    def run():
        g = torch.Generator().manual_seed(1)
        try:
            for v in versions:
                b = w.view(torch.int16).view(-1)
                b[torch.randperm(b.numel(), generator=g)[:64]] ^= 1 << 2
                out[v] = sender.refit(v)
        except Exception as e:  # noqa: BLE001 - the test reads it
            out["error"] = e

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t
