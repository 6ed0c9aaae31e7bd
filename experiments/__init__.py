"""Paper reproductions, benchmarks and the report builder (`python -m experiments.report`)."""
