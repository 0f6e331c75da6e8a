#!/usr/bin/env bash
# One GPU session's worth of checks: the environment, then the tests with real shapes (the gpu profile).
# Usage: bash tools/gpu_check.sh OUT_DIR [pytest args...]
set -u
out=${1:?usage: gpu_check.sh OUT_DIR [pytest args]}; shift
mkdir -p "$out"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 TINYVLLM_TEST_PROFILE=gpu
python3 -c "from cuda_kernels import compat; import numba, numba.cuda as c, numpy; print('numba', numba.__version__, 'numpy', numpy.__version__, 'cuda available', c.is_available()); c.detect()" 2>&1 | tee "$out/env.txt"
nvidia-smi --query-gpu=name,memory.used,memory.total,clocks.sm,clocks.mem --format=csv | tee -a "$out/env.txt"
# The server's tests need its extra and the openai client, which the image lacks: from .wheelhouse/ where carried.
. tools/install_wheelhouse.sh "$out/setup.txt"
# The GPU image has no network: tests that fetch a wheel from PyPI are left out (a later -m in "$@" wins).
python3 -m pytest -q -p no:cacheprovider --durations=25 -m "not downloads" "$@" 2>&1 | tee "$out/tests.txt" | tail -40
echo "pytest exit: ${PIPESTATUS[0]}" | tee -a "$out/tests.txt"
