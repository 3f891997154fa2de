"""Main-process facade over a running ``vllm.LLM`` whose workers are receivers.

``VLLMRuntime.start`` builds the engine with the ``nemo_dcr`` weight-transfer backend
(``weight_transfer_config``: the same engine object a ``vllm serve`` with the backend runs in
every worker), then has each worker's backend engine install its placement plan in local
mode (``DCRWeightTransferEngine.local_setup``; ``adapter.py``: staging of packed weights,
checked against the engine's own kernels); the protocol runs in this process (``nemo-dcr
receive``), the workers run the backend's worker steps (``extension.rpc_*``).  ``apply`` runs in two rounds over all workers: every
worker validates the batch (names, dtypes, shapes, ranges, positions, placement
unchanged), and only when all accepted does any worker write.  Each worker feeds the full
canonical tensors to its own loader, which selects its TP shard.

Engine settings (set here, before vLLM reads them): ``VLLM_CPU_KVCACHE_SPACE=1`` GiB,
``VLLM_ENABLE_V1_MULTIPROCESSING=0`` (the engine core runs in this process; at TP=1 so does
the worker), ``VLLM_CPU_OMP_THREADS_BIND`` one core per TP rank (``0|1`` at TP=2) unless
the caller set it.  ``enforce_eager``, prompts as token ids (no tokenizer), bfloat16.
Logs: vLLM's log lines go to stderr, or to ``engine_log`` (``logs.py``), never to stdout
(the receiver's JSON lines); no progress bars (``use_tqdm_on_load=False``; ``generate``
passes ``use_tqdm=False``).
"""
from __future__ import annotations

import gc
import os
import time
from collections.abc import Mapping, Sequence

import numpy as np
import torch

from nemo_dcr.codec.types import BITS_DTYPE, TensorDelta
from nemo_dcr.errors import ValidationError
from nemo_dcr.receiver.errors import IncompleteApplyError
from nemo_dcr.receiver.runtime import TensorSpec
from nemo_dcr.runtimes.hf import checkpoint_specs
from nemo_dcr.runtimes.vllm import extension as rpc
from nemo_dcr.runtimes.vllm.extension import _ERRORS  # the refusals workers return (extension._refusal)
from nemo_dcr.runtimes.vllm.logs import route_engine_logs

BACKEND = {"backend": "nemo_dcr"}
"""Every worker runs the weight-transfer backend's engine; this facade drives it in local mode."""


def _engine_env(tensor_parallel_size: int) -> dict[str, str]:
    env = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    if tensor_parallel_size > 1 and "VLLM_CPU_OMP_THREADS_BIND" not in os.environ:
        env["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(str(i) for i in range(tensor_parallel_size))
    return env


def _checked(results: list) -> list:
    """Raise the first worker refusal as its own error type."""
    for r in results:
        if isinstance(r, dict) and "error" in r:
            raise _ERRORS[r["error"]](r["message"])
    return results


class VLLMRuntime:
    """A ``vllm.LLM`` updated in place by deltas (see the module docstring)."""

    def __init__(self, llm, checkpoint_dir: str, tensor_parallel_size: int, setup: list[dict]) -> None:
        self._llm = llm
        self._checkpoint_dir = checkpoint_dir
        self._tp = tensor_parallel_size
        self._specs = checkpoint_specs(checkpoint_dir)
        self._setup = setup

    @classmethod
    def start(
        cls, checkpoint_dir: str, *, tensor_parallel_size: int = 1, max_model_len: int | None = None,
        engine_log: str | None = None,
    ) -> VLLMRuntime:
        """``engine_log``: a file for the engine's log lines (default ``$NEMO_DCR_ENGINE_LOG``,
        else stderr)."""
        if tensor_parallel_size < 1:
            raise ValidationError("tensor_parallel_size must be >= 1")
        os.environ.update(_engine_env(tensor_parallel_size))
        route_engine_logs(engine_log)  # before vLLM configures its logging, here and in its workers
        from vllm import LLM

        llm = LLM(
            str(checkpoint_dir),
            tensor_parallel_size=tensor_parallel_size,
            max_model_len=max_model_len,
            dtype="bfloat16",
            enforce_eager=True,
            skip_tokenizer_init=True,
            weight_transfer_config=BACKEND,
            use_tqdm_on_load=False,  # "Loading safetensors checkpoint shards" bars
        )
        try:
            setup = _checked(llm.collective_rpc(rpc.rpc_setup, args=(str(checkpoint_dir),)))
        except BaseException:
            _shutdown(llm)
            raise
        runtime = cls(llm, str(checkpoint_dir), tensor_parallel_size, setup)
        if tensor_parallel_size == 1:
            _IN_PROCESS_OPEN.add(id(runtime))
        return runtime

    @property
    def tensor_parallel_size(self) -> int:
        return self._tp

    def prewarm(self) -> dict:
        """Per worker: placement kinds (counts), canonical mirror bytes, staging bytes."""
        workers = _checked(self._llm.collective_rpc(rpc.rpc_prewarm))
        return {"workers": workers}

    def tensor_specs(self) -> Mapping[str, TensorSpec]:
        return self._specs

    def canonical_bits(self, name: str) -> np.ndarray:
        """The canonical bits held now (flat, ``BITS_DTYPE``), the context-mode decode base.

        Each worker returns its view, zero where its loader does not write (the other TP
        ranks' shards); shards are disjoint and replicas equal, so the OR over workers is
        the whole tensor.  Valid until the next ``apply``."""
        parts = _checked(self._llm.collective_rpc(rpc.rpc_canonical_bits, args=(name,)))
        out = np.array(parts[0], copy=True)
        for p in parts[1:]:
            np.bitwise_or(out, p, out=out)
        assert out.dtype == BITS_DTYPE[self._specs[name].dtype]
        return out

    def canonical_bits_at_many(self, requests: Sequence[tuple[str, np.ndarray]]) -> list[np.ndarray]:
        """``canonical_bits(name)[positions]`` for every request, in ONE round trip to the
        workers (a version of an MoE model changes tens of thousands of tensors: a call per
        tensor would cost a round trip each)."""
        requests = [(name, np.asarray(pos, dtype=np.int64)) for name, pos in requests]
        parts = _checked(self._llm.collective_rpc(rpc.rpc_canonical_bits_at, args=(requests,)))
        out = [np.array(a, copy=True) for a in parts[0]]
        for worker in parts[1:]:
            for o, a in zip(out, worker):
                np.bitwise_or(o, a, out=o)
        return out

    def validate(self, deltas: Sequence[TensorDelta]) -> None:
        """Every worker's pre-write checks, without writing."""
        _checked(self._llm.collective_rpc(rpc.rpc_validate, args=(list(deltas),)))

    def apply(self, deltas: Sequence[TensorDelta]) -> dict:
        """Validate ``deltas`` in every worker, then apply them in every worker."""
        deltas = list(deltas)
        t0 = time.perf_counter()
        _checked(self._llm.collective_rpc(rpc.rpc_validate, args=(deltas,)))
        workers = _checked(self._llm.collective_rpc(rpc.rpc_apply, args=(deltas,)))
        apply_s = time.perf_counter() - t0
        first = workers[0]
        for w in workers[1:]:
            if w["applied"] != first["applied"]:
                raise IncompleteApplyError(f"workers applied different tensor counts: {workers}")
        return {
            "applied": first["applied"],
            "xor_elements": first["xor_elements"],
            "overwrite_elements": first["overwrite_elements"],
            "apply_s": apply_s,
            "workers": workers,
        }

    def generate(self, prompts: list[list[int]], *, max_tokens: int = 16, logprobs: int = 5) -> list[dict]:
        """Greedy generation; per prompt the generated token ids and, per position, the
        top-``logprobs`` (token id, logprob) pairs in rank order."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, logprobs=logprobs, detokenize=False)
        outs = self._llm.generate([TokensPrompt(prompt_token_ids=list(p)) for p in prompts], params, use_tqdm=False)
        result = []
        for prompt, out in zip(prompts, outs):
            completion = out.outputs[0]
            tops = []
            for position in completion.logprobs or []:
                ranked = sorted(position.items(), key=lambda kv: kv[1].rank)
                tops.append([(int(tok), float(lp.logprob)) for tok, lp in ranked])
            result.append({"prompt": list(prompt), "token_ids": list(completion.token_ids), "logprobs": tops})
        return result

    def weight_digest(self) -> dict[str, str]:
        """``"<rank>/<name>"`` -> sha256 of every non-empty parameter and buffer of every
        worker (packed kernels are opaque; their staging weights are included)."""
        out = {}
        for rank, digests in enumerate(self._llm.collective_rpc(rpc.rpc_digest)):
            out.update({f"{rank}/{n}": d for n, d in digests.items()})
        return out

    def state_dicts(self) -> list[dict[str, torch.Tensor]]:
        """Per worker: every non-empty parameter and buffer (copies, for tests)."""
        return list(self._llm.collective_rpc(rpc.rpc_state))

    def dense_reload(self, checkpoint_dir: str) -> list[dict]:
        """Refit every worker densely from ``checkpoint_dir`` through the same loader and
        kernel rebuild ``apply`` uses (benchmark baseline); timings per worker."""
        return _checked(self._llm.collective_rpc(rpc.rpc_dense_reload, args=(str(checkpoint_dir),)))

    def close(self) -> None:
        """Shut the engine down.  A TP=1 engine runs its worker in this process, and
        shutting one down tears down the process-wide torch.distributed / vLLM parallel
        state every other in-process engine uses; so such an engine is only shut down
        when it is the last in-process engine open (earlier ones wait, holding memory)."""
        llm, self._llm = self._llm, None
        if llm is None:
            return
        if self._tp > 1:
            _shutdown(llm)
        else:
            _IN_PROCESS_OPEN.discard(id(self))
            _IN_PROCESS_CLOSED.append(llm)
            if not _IN_PROCESS_OPEN:
                while _IN_PROCESS_CLOSED:
                    _shutdown(_IN_PROCESS_CLOSED.pop())
        gc.collect()


# ids of open TP=1 runtimes, and closed ones whose shutdown waits for the last of them
_IN_PROCESS_OPEN: set[int] = set()
_IN_PROCESS_CLOSED: list = []


def _shutdown(llm) -> None:
    engine_core = getattr(llm.llm_engine, "engine_core", None)
    if engine_core is not None:
        engine_core.shutdown()
