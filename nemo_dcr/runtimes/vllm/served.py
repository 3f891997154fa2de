"""A vLLM engine as the receiver loop's ``ServedModel`` (``receiver/served.py``).

``VLLMRuntime`` (``runtimes/vllm/runtime.py``) applies deltas inside every TP worker;
this wrapper adds what the receiver process needs around it: the dense-refit oracle and a
sample completion for the logs.

The oracle (``verify_dense``), per version: a SECOND engine of the same tensor-parallel
size and thread settings, started with the first from the initial checkpoint, is refit
densely from the trainer's dense export of that version (written to a temporary directory
with the initial ``config.json``) through vLLM's own ``load_weights`` and kernel rebuild
(``VLLMRuntime.dense_reload``): what a full-checkpoint refit of a running engine does.
Both engines then greedily generate ``VERIFY_TOKENS`` tokens on three prompts with top-k
logprobs, which must be identical (token ids and logprob floats), and every non-empty
parameter and buffer of every worker must be identical (sha256 of the raw bytes).  The
stronger oracle -- an engine freshly *started* from each dense checkpoint -- is what
``tests/receiver/test_vllm_runtime.py`` uses; per demo step it would cost an engine start
and, at TP=1, memory until the last in-process engine closes (``VLLMRuntime.close``).
"""
from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Mapping, Sequence

import numpy as np
import torch

from nemo_dcr.codec.types import TensorDelta
from nemo_dcr.errors import ValidationError
from nemo_dcr.receiver.runtime import TensorSpec

VERIFY_TOKENS = 16
VERIFY_LOGPROBS = 5


def verify_prompts(vocab_size: int) -> list[list[int]]:
    """Three fixed token-id prompts inside the vocabulary."""
    v = vocab_size
    return [[1 % v, 2 % v, 3 % v, 4 % v, 5 % v], [(v - 1), 7 % v, 42 % v], [(10 + 3 * i) % v for i in range(8)]]


class VLLMServedModel:
    def __init__(self, runtime, checkpoint_dir: str, *, reference=None, sample_tokens: int = 0):
        """``runtime``: a prewarmed ``VLLMRuntime``; ``reference``: a second one (same TP)
        for ``verify_dense``, or ``None``."""
        import json

        self.runtime = runtime
        self.checkpoint_dir = checkpoint_dir
        self.reference = reference
        self.sample_tokens = sample_tokens

        with open(os.path.join(checkpoint_dir, "config.json")) as f:
            self.vocab_size = int(json.load(f)["vocab_size"])

    @classmethod
    def start(cls, checkpoint_dir: str, *, tensor_parallel_size: int = 1, max_model_len: int | None = None,
              reference: bool = False, sample_tokens: int = 0, engine_log: str | None = None) -> VLLMServedModel:
        """``engine_log``: a file for both engines' log lines (default ``$NEMO_DCR_ENGINE_LOG``,
        else stderr; ``logs.py``)."""
        from nemo_dcr.runtimes.vllm import VLLMRuntime

        runtime = VLLMRuntime.start(checkpoint_dir, tensor_parallel_size=tensor_parallel_size,
                                    max_model_len=max_model_len, engine_log=engine_log)
        runtime.prewarm()
        ref = None
        if reference:
            ref = VLLMRuntime.start(checkpoint_dir, tensor_parallel_size=tensor_parallel_size,
                                    max_model_len=max_model_len, engine_log=engine_log)
        return cls(runtime, checkpoint_dir, reference=ref, sample_tokens=sample_tokens)

    # ServedModel
    def tensor_specs(self) -> Mapping[str, TensorSpec]:
        return self.runtime.tensor_specs()

    def canonical_bits(self, name: str) -> np.ndarray:
        return self.runtime.canonical_bits(name)

    def canonical_bits_at_many(self, requests) -> list[np.ndarray]:
        return self.runtime.canonical_bits_at_many(requests)

    def validate(self, deltas: Sequence[TensorDelta]) -> None:
        self.runtime.validate(deltas)

    def apply(self, deltas: Sequence[TensorDelta]) -> object:
        return self.runtime.apply(deltas)

    def sample(self) -> dict | None:
        if not self.sample_tokens:
            return None
        out = self.runtime.generate([verify_prompts(self.vocab_size)[0]], max_tokens=self.sample_tokens, logprobs=1)
        return out[0]["token_ids"]

    def verify_dense(self, dense: Mapping[str, torch.Tensor]) -> dict:
        if self.reference is None:
            raise ValidationError("verify_dense needs a reference engine (start(..., reference=True))")
        from safetensors.torch import save_file

        prompts = verify_prompts(self.vocab_size)
        with tempfile.TemporaryDirectory(prefix="dcr-dense-") as d:
            shutil.copy(os.path.join(self.checkpoint_dir, "config.json"), os.path.join(d, "config.json"))
            save_file({k: v.contiguous() for k, v in dense.items()}, os.path.join(d, "model.safetensors"))
            self.reference.dense_reload(d)
        want = self.reference.generate(prompts, max_tokens=VERIFY_TOKENS, logprobs=VERIFY_LOGPROBS)
        got = self.runtime.generate(prompts, max_tokens=VERIFY_TOKENS, logprobs=VERIFY_LOGPROBS)
        want_digest, got_digest = self.reference.weight_digest(), self.runtime.weight_digest()
        mismatches = [f"generation {i}" for i, (a, b) in enumerate(zip(got, want)) if a != b]
        mismatches += [n for n in sorted(set(got_digest) | set(want_digest)) if got_digest.get(n) != want_digest.get(n)]
        return {"bit_exact": not mismatches, "mismatches": mismatches[:10],
                "generated": [g["token_ids"] for g in got]}

    def dump(self, path: str) -> None:
        """Testing aid: every worker's plain parameters and buffers, ``w<rank>.<name>``, to
        the safetensors file ``path``."""
        from safetensors.torch import save_file

        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        state = {f"w{r}.{k}": v.contiguous().clone() for r, sd in enumerate(self.runtime.state_dicts())
                 for k, v in sd.items()}
        save_file(state, path)

    def close(self) -> None:
        if self.reference is not None:
            self.reference.close()
        self.runtime.close()


def serve(request):
    """Registry factory ``vllm`` (``receiver/registry.py``): a ``vllm.LLM`` engine started
    from the checkpoint, its workers updated in place; with ``options.reference`` a second
    engine for ``verify_dense``."""
    from nemo_dcr.receiver.registry import ServedRuntime

    o = request.options
    served = VLLMServedModel.start(request.init_dir, tensor_parallel_size=o.tensor_parallel_size,
                                   max_model_len=o.max_model_len, reference=o.reference,
                                   sample_tokens=o.sample_tokens, engine_log=o.engine_log)
    return ServedRuntime(served=served, dump=served.dump, close=served.close)
