"""kvjax: KV-cache policy experiments in JAX."""

__version__ = "0.1.0"
