"""A trainer-side ``RefitSender`` over a flat dict of BF16 tensors, each its own canonical
tensor under its own name (one rank, no model parallelism): the benchmarks that need genuine
signed versions of a Hugging Face model without a Megatron trainer (``scripts/bench_join.py``,
``scripts/bench_catchup.py``).  Test bed, not product."""
from __future__ import annotations

import torch

from nemo_dcr.sender import RefitOptions, RefitSender
from nemo_dcr.layout.mapping import CanonicalProjector, ModelDims, Rule
from nemo_dcr.layout.shards import ParamView, ShardSpec
from nemo_dcr.transport.store import ObjectStore

# the identity rules never read the model's dimensions
_DIMS = ModelDims(num_layers=1, hidden_size=8, num_attention_heads=1, num_query_groups=1, head_dim=8,
                  ffn_hidden_size=8, vocab_size=8)


def flat_sender(params: dict[str, torch.Tensor], store: ObjectStore, cfg: RefitOptions) -> RefitSender:
    """``params`` (BF16, updated in place by the caller between versions) refitted as they are;
    committed-version snapshots (``cfg.snapshot_every``) are the committed baseline itself."""
    views, rules = {}, []
    for n, t in params.items():
        shape = tuple(t.shape)
        spec = ShardSpec(key=n, local_shape=shape, global_shape=shape, global_offset=(0,) * len(shape),
                         prepend_axis_num=0, replica_id=(0,), dtype="bfloat16")
        views[n] = [ParamView(n, 0, spec)]
        rules.append(Rule(n, {"": n}))
    sender = RefitSender(params, views, CanonicalProjector(tuple(rules), _DIMS), store, cfg)
    # each tensor is its own canonical tensor: the canonical committed state is the baseline
    sender.snapshot_state = sender.committed_bits
    return sender
