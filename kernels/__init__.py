"""probjax_kernels: the Pallas flash-attention core. Depends on jax alone."""

from probjax_kernels._config import FlashConfig as FlashConfig
from probjax_kernels._config import default_config as default_config
from probjax_kernels._flash_attention import flash_attention as flash_attention
from probjax_kernels._reference import flash_attention_reference as flash_attention_reference

__all__ = ["FlashConfig", "default_config", "flash_attention", "flash_attention_reference"]
