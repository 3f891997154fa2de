"""An ``AsyncLLM`` in a Ray actor, as RL frameworks run their rollout engines (test bed).

``RolloutEngine`` forwards the ``AsyncLLM`` methods ``RayEngineClient`` (and vLLM's
``RayVLLMWeightSyncClient``) call, plus ``generate`` (greedy, token ids in, token ids, top-k
logprobs and weight-version spans out) and ``reload_weights`` (vLLM's own dense refit, for
the stock engine a test compares with).  ``start_engine`` starts one on this machine's local
Ray, one CPU and one OMP thread each (``VLLM_CPU_OMP_THREADS_BIND``).
"""
from __future__ import annotations

import ray

from nemo_dcr_testbed.vllm_serve import server_env


@ray.remote
class RolloutEngine:
    def __init__(self, model_dir: str, backend: bool, max_model_len: int) -> None:
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        kw = {"weight_transfer_config": {"backend": "nemo_dcr"}} if backend else {}
        self.llm = AsyncLLM.from_engine_args(AsyncEngineArgs(
            model=model_dir, dtype="bfloat16", enforce_eager=True, skip_tokenizer_init=True,
            max_model_len=max_model_len, **kw))
        self._n = 0
        self._progress: dict[str, int] = {}  # tag -> output tokens so far

    # what RayEngineClient / RayVLLMWeightSyncClient call: AsyncLLM's methods, forwarded
    async def init_weight_transfer_engine(self, request):
        await self.llm.init_weight_transfer_engine(request)

    async def start_weight_update(self):
        await self.llm.start_weight_update()

    async def update_weights(self, request):
        await self.llm.update_weights(request)

    async def finish_weight_update(self, weight_version=None):
        await self.llm.finish_weight_update(weight_version)

    async def update_weight_version(self, new_version):
        await self.llm.update_weight_version(new_version)

    async def get_weight_version(self):
        return await self.llm.get_weight_version()

    async def pause_generation(self, mode="keep"):
        await self.llm.pause_generation(mode=mode)

    async def resume_generation(self):
        await self.llm.resume_generation()

    async def compute_weight_checksums(self):
        return await self.llm.compute_weight_checksums()

    # test bed
    async def generate(self, prompt: list[int], max_tokens: int, logprobs: int | None = None,
                       tag: str | None = None) -> dict:
        """``tag``: ``progress(tag)`` then reports its output tokens so far."""
        from vllm import SamplingParams

        self._n += 1
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=logprobs)
        final = None
        async for out in self.llm.generate({"prompt_token_ids": prompt}, params, request_id=f"g{self._n}"):
            final = out
            if tag is not None:
                self._progress[tag] = len(out.outputs[0].token_ids)
        c = final.outputs[0]
        lps = None if logprobs is None else [
            sorted((tok, lp.logprob) for tok, lp in step.items()) for step in c.logprobs]
        spans = [{"version": s.version, "start": s.start, "end": s.end} for s in (c.weight_versions or [])]
        return {"token_ids": list(c.token_ids), "logprobs": lps, "weight_versions": spans}

    async def progress(self, tag: str) -> int:
        return self._progress.get(tag, 0)

    async def reload_weights(self, weights_dir: str) -> None:
        await self.llm.pause_generation(mode="keep")
        try:
            await self.llm.collective_rpc("reload_weights", kwargs={"weights_path": weights_dir})
        finally:
            await self.llm.resume_generation()

    def shutdown(self) -> None:
        self.llm.shutdown()


def start_engine(model_dir: str, *, backend: bool = True, cpu: str | None = None, max_model_len: int = 256):
    env = {k: v for k, v in server_env(cpu).items()
           if k.startswith(("VLLM_", "OMP_")) or k == "PYTHONUNBUFFERED"}
    return RolloutEngine.options(num_cpus=1, runtime_env={"env_vars": env}).remote(model_dir, backend, max_model_len)
