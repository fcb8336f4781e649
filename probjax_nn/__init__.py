"""probjax_nn: attention layers for Flax and Equinox over the probjax_kernels flash-attention core."""
