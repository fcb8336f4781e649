"""probjax_kernels: the Pallas flash-attention core and its FlexAttention front-end. Depends on jax alone.

Layer libraries (probjax_nn) build on these names and on `probjax_kernels.layer_api`, never on the private
modules.
"""

from probjax_kernels._config import FlashConfig as FlashConfig
from probjax_kernels._decode_inputs import DecodeConfig as DecodeConfig
from probjax_kernels._dispatch import default_config as default_config
from probjax_kernels._dropout import keep_mask as dropout_keep_mask
from probjax_kernels._flash_attention import flash_attention as flash_attention
from probjax_kernels._ragged_inputs import RaggedConfig as RaggedConfig
from probjax_kernels._reference import flash_attention_reference as flash_attention_reference
from probjax_kernels.decode.attention import decode_attention as decode_attention
from probjax_kernels.decode.reference import decode_attention_reference as decode_attention_reference
from probjax_kernels.flex.attention import flex_attention as flex_attention
from probjax_kernels.flex.block_mask import DEFAULT_BLOCK_SIZE as _DEFAULT_SPARSE_BLOCK_SIZE  # noqa: F401 (PyTorch's)
from probjax_kernels.flex.block_mask import BlockMask as BlockMask
from probjax_kernels.flex.block_mask import create_block_mask as create_block_mask
from probjax_kernels.flex.block_mask import create_mask as create_mask
from probjax_kernels.flex.mods import MaskMod as _mask_mod_signature  # noqa: F401 (PyTorch's private names,
from probjax_kernels.flex.mods import ScoreMod as _score_mod_signature  # noqa: F401  imported by attention-gym)
from probjax_kernels.flex.mods import alibi as alibi
from probjax_kernels.flex.mods import alibi_slopes as alibi_slopes
from probjax_kernels.flex.mods import and_masks as and_masks
from probjax_kernels.flex.mods import causal_mask as causal_mask
from probjax_kernels.flex.mods import document_mask as document_mask
from probjax_kernels.flex.mods import noop_mask as noop_mask
from probjax_kernels.flex.mods import or_masks as or_masks
from probjax_kernels.flex.mods import padding_mask as padding_mask
from probjax_kernels.flex.mods import prefix_lm as prefix_lm
from probjax_kernels.flex.mods import relative_bias as relative_bias
from probjax_kernels.flex.mods import sliding_window as sliding_window
from probjax_kernels.flex.mods import softcap as softcap
from probjax_kernels.flex.options import AuxOutput as AuxOutput
from probjax_kernels.flex.options import AuxRequest as AuxRequest
from probjax_kernels.flex.options import FlexKernelOptions as FlexKernelOptions
from probjax_kernels.flex.reference import flex_attention_reference as flex_attention_reference
from probjax_kernels.parallel.ring import ring_attention as ring_attention
from probjax_kernels.ragged.attention import ragged_paged_attention as ragged_paged_attention
from probjax_kernels.ragged.reference import ragged_paged_attention_reference as ragged_paged_attention_reference
from probjax_kernels.parallel.ring import zigzag_permutation as zigzag_permutation

__all__ = [
    "AuxOutput", "AuxRequest", "BlockMask", "DecodeConfig", "FlashConfig", "FlexKernelOptions", "RaggedConfig",
    "alibi", "alibi_slopes", "and_masks", "causal_mask", "create_block_mask", "create_mask", "decode_attention",
    "decode_attention_reference", "default_config", "document_mask", "dropout_keep_mask", "flash_attention",
    "flash_attention_reference", "flex_attention", "flex_attention_reference", "noop_mask", "or_masks",
    "padding_mask", "prefix_lm", "ragged_paged_attention", "ragged_paged_attention_reference", "relative_bias",
    "ring_attention", "sliding_window", "softcap", "zigzag_permutation",
]
