import jax

# Strict promotion catches silent rank broadcasting and dtype upcasts in kernels, wrappers and tests alike.
jax.config.update("jax_numpy_rank_promotion", "raise")
jax.config.update("jax_numpy_dtype_promotion", "strict")
