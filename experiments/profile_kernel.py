"""Compiled paged-attention calls at the tuning sweep's shape (`bench_kernels.TUNE_SHAPE`: B 64 x
4k tokens, page 16, K 8 x G 4, E 128), one storage kind after another, for a profiler to read:

    ncu --clock-control none -k regex:paged_attention --section WarpStateStats ... \\
        python3 -m experiments.profile_kernel bf16 int8 int4

Each kind runs twice (compile + warm-up, then the call to read)."""

from __future__ import annotations

import argparse

KINDS = ("bf16", "int8", "int4")  # the tuning sweep's kinds (bench_kernels --tune-kinds)


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m experiments.profile_kernel", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("kinds", nargs="*", metavar="KIND",
                    help=f"storage kinds to run, in order: {', '.join(KINDS)} (default: all)")
    a = ap.parse_args(argv)
    bad = [k for k in a.kinds if k not in KINDS]
    if bad:  # checked here: argparse's choices reject an empty nargs="*" list on Python 3.11
        ap.error(f"unknown kind(s) {', '.join(bad)}; choose from {', '.join(KINDS)}")

    import jax  # after the checks, so --help and a bad kind answer at once

    from experiments.bench_kernels import TUNE_SHAPE, make_inputs
    from kvjax.kernels import paged_attention as pa

    attend = jax.jit(pa.paged_attention)
    for kind in a.kinds or KINDS:
        B, ctx, page, K, G, E = TUNE_SHAPE
        args = make_inputs(1, kind, B, ctx, K, G, E, page)
        for _ in range(2):
            jax.block_until_ready(attend(*args))
        print(kind, "done", flush=True)


if __name__ == "__main__":
    main()
