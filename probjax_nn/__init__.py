"""probjax_nn: attention layers for Flax and Equinox over the probjax_kernels flash-attention core."""

from probjax_nn._attention import AttentionConfig as AttentionConfig
from probjax_nn._attention import attention as attention
from probjax_nn._decode import decode_attention as decode_attention
from probjax_nn._decode import pages_from_dense as pages_from_dense
from probjax_nn._decode import ragged_paged_attention as ragged_paged_attention

__all__ = ["AttentionConfig", "attention", "decode_attention", "pages_from_dense", "ragged_paged_attention"]
