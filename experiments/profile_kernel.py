"""Compiled paged-attention calls at the tuning sweep's shape (`bench_kernels.TUNE_SHAPE`: B 64 x
4k tokens, page 16, K 8 x G 4, E 128), one storage kind after another, for a profiler to read:

    ncu --clock-control none -k regex:paged_attention --section WarpStateStats ... \\
        python3 -m experiments.profile_kernel bf16 int8 int4

Each kind runs twice (compile + warm-up, then the call to read)."""

from __future__ import annotations

import sys

import jax

from experiments.bench_kernels import TUNE_SHAPE, make_inputs
from kvjax.kernels import paged_attention as pa


def main(kinds):
    attend = jax.jit(pa.paged_attention)
    for kind in kinds:
        B, ctx, page, K, G, E = TUNE_SHAPE
        args = make_inputs(1, kind, B, ctx, K, G, E, page)
        for _ in range(2):
            jax.block_until_ready(attend(*args))
        print(kind, "done", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:] or ["bf16", "int8", "int4"])
