"""Evaluation tasks; each runs through `forward`, so the cache policy is live."""
