"""Checkpoint and tokenizer loading: GGUF, local HF safetensors directories, the model hub."""
