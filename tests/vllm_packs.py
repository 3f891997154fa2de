"""Whether this machine's vLLM CPU build packs bf16 linear weights (shared by the vLLM tests)."""


def vllm_packs_bf16_linears() -> bool:
    """Whether vLLM's CPU build replaces bf16 linear weights by packed oneDNN handles on
    this machine: its own test (``dispatch_cpu_unquantized_gemm``) is whether a oneDNN
    matmul can be created; on a CPU without AVX-512 it cannot, and the weights stay plain
    tensors (nothing to stage)."""
    import torch
    from vllm import _custom_ops as ops

    if not ops._supports_onednn:
        return False
    try:
        ops.create_onednn_mm(torch.zeros(64, 64, dtype=torch.bfloat16).t(), 32)
    except RuntimeError:
        return False
    return True
