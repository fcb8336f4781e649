"""PyTorch FlexAttention's front-end: `flex_attention`, `BlockMask` and its tables, the ready-made mods, the
call options (`AuxRequest`, `kernel_options`) and the plain-jnp reference. It reaches the kernels through the
core (`_autodiff`, `_dispatch`)."""
