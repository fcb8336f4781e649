"""probjax_nn: attention layers for Flax and Equinox over the probjax_kernels flash-attention core."""

from probjax_nn._attention import AttentionConfig as AttentionConfig
from probjax_nn._attention import attention as attention

__all__ = ["AttentionConfig", "attention"]
