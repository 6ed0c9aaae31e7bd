"""Pallas kernels, each beside its pure-jnp `*_reference` (installed as kvjax.kernels)."""
