"""nemo_dcr: bit-exact delta-compressed refit of BF16 weights (trainer -> rollout engines)."""

__version__ = "0.1.0"
