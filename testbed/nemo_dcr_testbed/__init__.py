"""megatron-core training substrate: the CPU shim, the model builder and the training step.

Importing this package does not import megatron-core and patches nothing; megatron is
imported (and the CPU shim applied) by :func:`init_parallel`.
"""
from nemo_dcr_testbed import cpu_shim
from nemo_dcr_testbed.model import (
    FAMILIES,
    ModelConfig,
    ParallelError,
    build_gpt,
    destroy_parallel,
    init_parallel,
    padded_vocab_size,
    stage_layer_counts,
    unwrap_gpt,
)
from nemo_dcr_testbed.train import PostStepHook, StepResult, TrainConfig, Trainer, token_batch

__all__ = [
    "FAMILIES",
    "ModelConfig",
    "ParallelError",
    "PostStepHook",
    "StepResult",
    "TrainConfig",
    "Trainer",
    "build_gpt",
    "cpu_shim",
    "destroy_parallel",
    "init_parallel",
    "padded_vocab_size",
    "stage_layer_counts",
    "token_batch",
    "unwrap_gpt",
]
