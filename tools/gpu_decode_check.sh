#!/usr/bin/env bash
# gemm_tma for decode batches (matmul_policy.TMA_DECODE_IN_ENGINE, on by default) against gemm_wgmma's split K
# (TINYVLLM_TMA_DECODE=0), in one GPU call (about 7 minutes with a carried kernel cache).
#   1. gemm_tma's tests on the GPU (split K, the decode entry points) - the rest is skipped if they fail;
#   2. the kernel benchmark: the engine's matmul against gemm_tma's decode tiles at 16-128 rows, weights cold;
#   3. the decode step kernel by kernel (tools/profile_step.py at batch 1, 16, 64, 128, 256: the plain graph's
#      time and each kernel's) with TINYVLLM_TMA_DECODE=0 and =1, one process each (the switch is read at import);
#   4. with it on, the engine's greedy tokens, its graphs and nothing compiled or captured after the warm-up
#      (so every tensor map was made before the graphs were captured): tests/test_cuda_engine.py.
# Usage: [KERNEL_CACHE_IN=DIR] [DECODE_CHECK_KERNELS=0] [DECODE_CHECK_BATCHES=64,128,256] bash tools/gpu_decode_check.sh OUT
# (for a short call: DECODE_CHECK_KERNELS=0 skips step 2, DECODE_CHECK_BATCHES replaces step 3's batches)
# Every phase has a time limit (DECODE_CHECK_BUDGET seconds in all, default 560); results are written as they come.
set -u
out=${1:?usage: gpu_decode_check.sh OUT_DIR}
mkdir -p "$out" && out=$(cd "$out" && pwd)
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 TINYVLLM_TEST_PROFILE=gpu TINYVLLM_TEST_EXAMPLES=${TINYVLLM_TEST_EXAMPLES:-2}
export TINYVLLM_KERNEL_CACHE=${TINYVLLM_KERNEL_CACHE:-/tmp/tinyvllm-kernels}
mkdir -p "$TINYVLLM_KERNEL_CACHE"
if [ -n "${KERNEL_CACHE_IN:-}" ] && ls "$KERNEL_CACHE_IN"/kc.tgz.* >/dev/null 2>&1; then
  cat "$KERNEL_CACHE_IN"/kc.tgz.* | tar xzf - -C "$TINYVLLM_KERNEL_CACHE"
fi
budget=${DECODE_CHECK_BUDGET:-560}
# seconds for a phase: $1 percent of what the budget still holds (the later phases share the rest), at most $2
share() { local l=$(((budget - SECONDS) * $1 / 100)); [ "$l" -lt 10 ] && l=10; [ "$l" -gt "$2" ] && l=$2; echo "$l"; }
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv | tee "$out/env.txt"

# 1. the kernel's tests (a hang is interrupted, so pytest says where)
timeout -s INT "$(share 30 150)" python3 -m pytest -q -x -p no:cacheprovider -o faulthandler_timeout=60 \
  tests/kernels/test_gemm_tma.py -k "split or entry or plans" > "$out/tests.txt" 2>&1
rc=$?; echo "gemm_tma tests: exit $rc at ${SECONDS} s" | tee -a "$out/env.txt"
if [ "$rc" -eq 0 ]; then
  # 2. the kernels alone
  if [ "${DECODE_CHECK_KERNELS:-1}" != 0 ]; then
    timeout "$(share 25 120)" python3 -m tools.kernel_benchmarks.matmul --tma --m 16 32 64 128 \
      --weights gate_up down qkv o > "$out/tma_decode_kernels.md" 2>&1
    echo "kernel benchmark: exit $? at ${SECONDS} s" | tee -a "$out/env.txt"
  fi
  # 3. the decode step, off then on
  for flag in 0 1; do
    TINYVLLM_TMA_DECODE=$flag timeout "$(share $((33 + 17 * flag)) 150)" python3 tools/profile_step.py --batch ${DECODE_CHECK_BATCHES:-1,16,64,128,256} \
      --matmul-precision bf16 --json "$out/profile_tma_decode_$flag.json" > "$out/profile_tma_decode_$flag.txt" 2>&1
    echo "profile_step, TINYVLLM_TMA_DECODE=$flag: exit $? at ${SECONDS} s" | tee -a "$out/env.txt"
  done
  # 4. the engine with it on
  TINYVLLM_TMA_DECODE=1 timeout "$(share 100 150)" python3 -m pytest -q -p no:cacheprovider \
    tests/test_cuda_engine.py -k "greedy or graph or warm_up" > "$out/engine_tests.txt" 2>&1
  echo "engine tests with TINYVLLM_TMA_DECODE=1: exit $? at ${SECONDS} s" | tee -a "$out/env.txt"
fi
tar czf - -C "$TINYVLLM_KERNEL_CACHE" . | split -b 15m -d - "$out/kc.tgz."
tail -5 "$out/tests.txt"; cat "$out/tma_decode_kernels.md" 2>/dev/null
grep -H "plain graph" "$out"/profile_tma_decode_*.txt 2>/dev/null
tail -3 "$out/engine_tests.txt" 2>/dev/null
