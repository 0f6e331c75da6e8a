"""cuda_kernels/kernel_cache.py: kernels kept on disk between processes. The keys must be the same in every
process for the same kernel and configuration and differ between configurations (else a new process would
compile everything again, or load the wrong code); entries must round-trip and a damaged one be ignored.
On a GPU, a second process loads every kernel of a generate run from the cache and gives the same tokens."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from cuda_kernels import kernel_cache
from tinyvllm import pypi_assets

REPO = Path(__file__).resolve().parents[2]
GPU = os.environ.get("TINYVLLM_TEST_PROFILE", "sim") == "gpu"

# Kernel factories of several families and configurations, built with Numba's real CUDA target (no GPU is
# needed to build a dispatcher); each value is the text its cache key hashes.
KEY_TEXTS = r"""
import json, os
os.environ.pop("NUMBA_ENABLE_CUDASIM", None)
from cuda_kernels import kernel_cache, gemm_pipelined as gp, gemv, rmsnorm, paged_attention_gqa as pa
kernels = {
    "pipelined 16 split": gp._gemm_kernel(16, 128, 64, 16, 32, 4, 0, 1, False, False, True),
    "pipelined 16 split 3 stages": gp._gemm_kernel(16, 128, 64, 16, 32, 3, 0, 1, False, False, True),
    "pipelined 16 no split": gp._gemm_kernel(16, 128, 64, 16, 32, 4, 0, 1, False, False, False),
    "pipelined gated planes": gp._gemm_kernel(64, 128, 64, 32, 32, 4, 0, 3, True, True, True),
    "rmsnorm": rmsnorm._rmsnorm_kernel(True, 2048, 1024),
    "rmsnorm planes": rmsnorm._rmsnorm_kernel(True, 2048, 1024, 1),
    "rmsnorm 576": rmsnorm._rmsnorm_kernel(True, 576, 1024),
    "planes": gp._planes_kernel(True),
    "gemv": gemv._gemv_kernel(1, 4, 4, 4, 2, True, False),
    "gemv rope": gemv._gemv_kernel(1, 4, 4, 4, 2, True, True, "rope", 64),
    "gemv rope fp8": gemv._gemv_kernel(1, 4, 4, 4, 2, True, True, "rope", 64, "fp8"),
    "gemv rope fp32": gemv._gemv_kernel(1, 4, 4, 4, 2, True, True, "rope", 64, "fp32"),
    "decode attention": pa._gqa_kernels(64, 16, 8, 4, 8, 4)[0],
    "decode attention fp8": pa._gqa_kernels(64, 16, 8, 4, 8, 4, "fp8")[0],
    "decode attention planes": pa._gqa_kernels(64, 16, 8, 4, 8, 4, "bf16", 1)[0],
    "decode attention planes x3": pa._gqa_kernels(64, 16, 8, 4, 8, 4, "bf16", 3)[0],
}
print(json.dumps({name: kernel_cache._stable(k) for name, k in kernels.items()}))
"""


def key_texts() -> dict:
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_ENABLE_CUDASIM"}
    env["PYTHONPATH"] = str(REPO)
    done = subprocess.run([sys.executable, "-c", KEY_TEXTS], capture_output=True, text=True, env=env, cwd=REPO,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_keys_are_stable_across_processes_and_tell_configurations_apart():
    first, second = key_texts(), key_texts()
    assert first == second
    assert None not in first.values(), [name for name, text in first.items() if text is None]
    assert len(set(first.values())) == len(first)   # every configuration its own key
    assert "0x" not in "".join(first.values())       # no object addresses


def test_entries_round_trip_and_damage_is_ignored(tmp_path, monkeypatch):
    monkeypatch.setenv("TINYVLLM_KERNEL_CACHE", str(tmp_path))
    cubin = bytes(range(256)) * 3
    kernel_cache.store("abc", "_Z6kernelPf", cubin)
    assert kernel_cache.load("abc") == ("_Z6kernelPf", cubin)

    class ObjectCode:   # what Numba's code library returns: the bytes in .code
        code = cubin[::-1]

    kernel_cache.store("def", "k", ObjectCode())
    assert kernel_cache.load("def") == ("k", cubin[::-1])
    ObjectCode.code = "/a/path.cubin"   # code that is not bytes is not stored
    kernel_cache.store("ghi", "k", ObjectCode())
    assert kernel_cache.load("ghi") is None
    assert kernel_cache.load("other") is None
    (tmp_path / "abc.cubin").write_bytes(b"TVKC1")   # truncated
    assert kernel_cache.load("abc") is None
    (tmp_path / "abc.cubin").write_bytes(b"garbage" * 10)
    assert kernel_cache.load("abc") is None
    assert not list(tmp_path.glob("*.tmp"))          # writes leave no temporary files
    monkeypatch.setenv("TINYVLLM_KERNEL_CACHE", "0")
    assert kernel_cache.directory() is None
    kernel_cache.store("abc", "x", cubin)              # off: nothing written, nothing read
    assert kernel_cache.load("abc") is None


@pytest.mark.parametrize("cache_dir, xdg", [(True, True), (False, True), (False, False)])
def test_the_default_directory_is_in_tinyvllms_cache(tmp_path, monkeypatch, cache_dir, xdg):
    """kernels/ under the directory tinyvllm keeps its downloads in, whichever variable sets it (the kernel
    cache repeats pypi_assets.cache_dir's rule: cuda_kernels does not import the engine)."""
    monkeypatch.delenv("TINYVLLM_KERNEL_CACHE", raising=False)
    monkeypatch.delenv("TINYVLLM_CACHE_DIR", raising=False)
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    if cache_dir:
        monkeypatch.setenv("TINYVLLM_CACHE_DIR", str(tmp_path / "cache"))
    if xdg:
        monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert kernel_cache.directory() == pypi_assets.cache_dir() / "kernels"
    assert kernel_cache.directory().is_relative_to(tmp_path)


GENERATE = r"""
import json, sys
from cuda_kernels import launch
from tinyvllm import LLM, SamplingParams
llm = LLM(sys.argv[1], backend="cuda", num_kv_blocks=64, max_num_seqs=4)
out = llm.generate([[256, 1, 2, 3], [256, 9]], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True),
                   use_tqdm=False)
print(json.dumps({"tokens": [o.outputs[0].token_ids for o in out], "compiled": launch.compiled(),
                  "prepared": launch.prepared()}))
"""


@pytest.mark.skipif(not GPU, reason="needs a GPU (TINYVLLM_TEST_PROFILE=gpu)")
def test_a_second_process_loads_every_kernel_from_the_cache(tiny_model_dir, tmp_path):
    env = {**os.environ, "TINYVLLM_KERNEL_CACHE": str(tmp_path / "kernels"), "PYTHONPATH": str(REPO)}

    def run():
        done = subprocess.run([sys.executable, "-c", GENERATE, str(tiny_model_dir)], capture_output=True, text=True,
                              env=env, cwd=REPO, timeout=600)
        assert done.returncode == 0, done.stderr[-2000:]
        return json.loads(done.stdout.strip().splitlines()[-1])

    first, second = run(), run()
    assert first["compiled"] > 10 and first["compiled"] == first["prepared"]
    assert second["compiled"] == 0 and second["prepared"] == first["prepared"]
    assert second["tokens"] == first["tokens"]


def test_a_key_covers_the_files_its_kernel_imports_and_no_others(tmp_path, monkeypatch):
    """Keys hash the sources of the kernel's module and of every package file it imports, transitively: an
    edit to a file the kernel reaches (here mma.py, which gemm_pipelined imports) changes the digest, an edit
    to one it never imports (attention_tc.py) does not, so changing one kernel file keeps the others cached."""
    import shutil

    package = tmp_path / "cuda_kernels"
    shutil.copytree(kernel_cache.PACKAGE, package, ignore=shutil.ignore_patterns("__pycache__"))
    monkeypatch.setattr(kernel_cache, "PACKAGE", package)

    def digest():
        kernel_cache._imports.cache_clear()
        kernel_cache._sources.cache_clear()
        return kernel_cache._sources(frozenset({"gemm_pipelined"}))

    reached = set()
    todo = ["gemm_pipelined"]
    while todo:
        module = todo.pop()
        if module not in reached:
            reached.add(module)
            todo.extend(kernel_cache._imports(module))
    assert {"gemm_pipelined", "mma", "async_copy", "pdl", "compat"} <= reached
    assert "attention_tc" not in reached and "matmul" not in reached

    before = digest()
    with open(package / "attention_tc.py", "a") as f:
        f.write("\n# an edit the GEMM never sees\n")
    assert digest() == before
    with open(package / "mma.py", "a") as f:
        f.write("\n# an edit to a file the GEMM imports\n")
    assert digest() != before
    kernel_cache._imports.cache_clear()
    kernel_cache._sources.cache_clear()
