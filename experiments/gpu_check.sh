#!/usr/bin/env bash
# On a lent GPU, in one short run: the kernel tests compiled (their INTERPRET is False on a GPU)
# beside the benchmark's compile check of every variant, then the bandwidth benchmark alone.
#
#     bash experiments/gpu_check.sh OUTDIR [BENCH_BUDGET_S]
#
# The tests run without conftest.py (it sets CPU-only XLA flags and loads the real model, which
# these files do not use) and with f32 matmuls at full precision, so the dense XLA path they
# compare against is not TF32. test_serve.py's host offload moves pages to `pinned_host` there;
# its plan test is left out (it needs the gguf package, not on the device image). Needs jax
# with CUDA, flax and hypothesis (the device image's own).
set -uo pipefail
out=${1:?usage: bash experiments/gpu_check.sh OUTDIR [BENCH_BUDGET_S]}
budget=${2:-220}
mkdir -p "$out"
python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . || exit 1  # kvjax.policies/.kernels
export PYTHONUNBUFFERED=1
export XLA_PYTHON_CLIENT_PREALLOCATE=false  # test workers and the check share one GPU
{
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
  python3 -c "import jax, sys; print('python', sys.version.split()[0], 'jax', jax.__version__, jax.devices())"
} 2>&1 | tee "$out/gpu.txt"
JAX_DEFAULT_MATMUL_PRECISION=highest timeout 200 python3 -m pytest --noconftest -p no:cacheprovider \
  -q -n 6 tests/test_paged_attention.py tests/test_paged_model.py tests/test_paged.py \
  tests/test_serve.py -k "not smollm and not plan_errors" >"$out/pytest_gpu.log" 2>&1 &
tests=$!
timeout 200 python3 experiments/bench_kernels.py --out "$out/kernel_check.md" --budget-s 0 \
  >"$out/kernel_check.log" 2>&1
check=$?
wait $tests
tested=$?
tail -n 25 "$out/pytest_gpu.log"
timeout $((budget + 110)) python3 experiments/bench_kernels.py --skip-check \
  --out "$out/bench_kernels.md" --budget-s "$budget" >"$out/bench_kernels.log" 2>&1
bench=$?
echo "tests rc=$tested  compile check rc=$check  benchmark rc=$bench"
cat "$out/kernel_check.md"
