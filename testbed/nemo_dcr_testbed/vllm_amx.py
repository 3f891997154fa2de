"""vLLM general plugin of the test bed (entry point ``vllm.general_plugins``,
``nemo_dcr_testbed_amx``): asks the kernel for the AMX tile state in every vLLM process.

On a CPU with AMX, vLLM 0.32's CPU attention picks its ``amx`` kernel for bfloat16
(``v1/attention/backends/cpu_attn.py::_get_attn_isa``) without asking Linux for the tile
state first (``arch_prctl(ARCH_REQ_XCOMP_PERM)``, which torch exposes as
``torch._C._cpu._init_amx``).  A worker in which nothing else asked first dies of SIGILL at
its first forward pass (seen here: a stock ``vllm serve`` at TP=1, ``cpu_attention_with_kv_cache``
in the faulthandler trace).  The test bed, not the product, carries this: it is vLLM's
bug, hit by any engine on such a CPU, with or without nemo_dcr.
"""
from __future__ import annotations


def register() -> None:
    import torch

    if torch.cpu._is_amx_tile_supported():
        torch._C._cpu._init_amx()
