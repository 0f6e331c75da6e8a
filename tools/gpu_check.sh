#!/usr/bin/env bash
# One GPU session's worth of checks: the environment, then the tests with real shapes (the gpu profile).
# Usage: [KERNEL_CACHE_IN=DIR] bash tools/gpu_check.sh OUT_DIR [pytest args...]
# The kernel cache travels between device calls (cuda_kernels/kernel_cache.py: an entry's key hashes the sources
# its kernel imports, so the entries of unchanged files stay valid): the parts kc.tgz.* found in KERNEL_CACHE_IN
# are unpacked first, and the cache is packed into OUT_DIR/kc.tgz.* (15 MB parts) at the end.
set -u
out=${1:?usage: gpu_check.sh OUT_DIR [pytest args]}; shift
mkdir -p "$out"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 TINYVLLM_TEST_PROFILE=gpu
export TINYVLLM_KERNEL_CACHE=${TINYVLLM_KERNEL_CACHE:-/tmp/tinyvllm-kernels}
mkdir -p "$TINYVLLM_KERNEL_CACHE"
if [ -n "${KERNEL_CACHE_IN:-}" ] && ls "$KERNEL_CACHE_IN"/kc.tgz.* >/dev/null 2>&1; then
  cat "$KERNEL_CACHE_IN"/kc.tgz.* | tar xzf - -C "$TINYVLLM_KERNEL_CACHE"
  echo "kernel cache: $(ls "$TINYVLLM_KERNEL_CACHE" | wc -l) entries carried in" | tee "$out/kernel_cache.txt"
fi
python3 -c "from cuda_kernels import compat; import numba, numba.cuda as c, numpy; print('numba', numba.__version__, 'numpy', numpy.__version__, 'cuda available', c.is_available()); c.detect()" 2>&1 | tee "$out/env.txt"
nvidia-smi --query-gpu=name,memory.used,memory.total,clocks.sm,clocks.mem --format=csv | tee -a "$out/env.txt"
# The server's tests need its extra and the openai client, which the image lacks: from .wheelhouse/ where carried.
. tools/install_wheelhouse.sh "$out/setup.txt"
# The GPU image has no network: tests that fetch a wheel from PyPI are left out (a later -m in "$@" wins).
python3 -m pytest -q -p no:cacheprovider --durations=25 -m "not downloads" "$@" 2>&1 | tee "$out/tests.txt" | tail -40
echo "pytest exit: ${PIPESTATUS[0]}" | tee -a "$out/tests.txt"
tar czf - -C "$TINYVLLM_KERNEL_CACHE" . | split -b 15m -d - "$out/kc.tgz."
echo "kernel cache: $(ls "$TINYVLLM_KERNEL_CACHE" | wc -l) entries packed into $out/kc.tgz.*" | tee -a "$out/kernel_cache.txt"
