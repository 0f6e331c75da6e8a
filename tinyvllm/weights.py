"""Loading a Llama checkpoint in Hugging Face layout (safetensors, one file or sharded).

Every tensor the config implies is checked for presence and shape before anything is computed; the result
maps Hugging Face tensor names to bf16 bit patterns (uint16 arrays, zero-copy for bf16 files; fp16 and fp32
checkpoints are rounded to bf16, nearest even, following the project's numerics policy).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from reference.bf16 import f32_to_bf16
from tinyvllm.config import ModelConfig
from tinyvllm.safetensors_io import SafetensorsError, SafetensorsFile


class WeightsError(ValueError):
    """A checkpoint is missing, corrupt or does not match its config."""


def expected_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor a Llama checkpoint must hold, with its (out_features, in_features) shape."""
    h, q, kv, ffn = config.hidden_size, config.q_size, config.kv_size, config.intermediate_size
    shapes = {"model.embed_tokens.weight": (config.vocab_size, h), "model.norm.weight": (h,)}
    for i in range(config.num_layers):
        p = f"model.layers.{i}."
        shapes.update({
            p + "input_layernorm.weight": (h,),
            p + "self_attn.q_proj.weight": (q, h),
            p + "self_attn.k_proj.weight": (kv, h),
            p + "self_attn.v_proj.weight": (kv, h),
            p + "self_attn.o_proj.weight": (h, q),
            p + "post_attention_layernorm.weight": (h,),
            p + "mlp.gate_proj.weight": (ffn, h),
            p + "mlp.up_proj.weight": (ffn, h),
            p + "mlp.down_proj.weight": (h, ffn),
        })
    if not config.tie_word_embeddings:
        shapes["lm_head.weight"] = (config.vocab_size, h)
    return shapes


def checkpoint_files(model_dir: Path) -> dict[str, Path]:
    """Tensor name -> the safetensors file that holds it (from the shard index when there is one)."""
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise WeightsError(f"{index}: not a valid shard index ({exc!r})") from None
        return {name: model_dir / shard for name, shard in weight_map.items()}
    single = model_dir / "model.safetensors"
    if single.is_file():
        return {name: single for name in _open(single).keys()}
    raise WeightsError(f"{model_dir}: no model.safetensors or model.safetensors.index.json")


def load_weights(model_dir: str | Path, config: ModelConfig) -> dict[str, np.ndarray]:
    """All tensors of the model as bf16 bit patterns, checked against the config."""
    model_dir = Path(model_dir)
    locations = checkpoint_files(model_dir)
    opened: dict[Path, SafetensorsFile] = {}
    weights = {}
    for name, shape in expected_shapes(config).items():
        if name not in locations:
            raise WeightsError(f"{model_dir}: tensor {name!r} is missing from the checkpoint")
        path = locations[name]
        if path not in opened:
            if not path.is_file():
                raise WeightsError(f"{path}: shard named by the index for {name!r} does not exist")
            opened[path] = _open(path)
        f = opened[path]
        if name not in f.keys():
            raise WeightsError(f"{path}: tensor {name!r} is listed in the index but not in the file")
        if f.shape(name) != shape:
            raise WeightsError(f"{path}: tensor {name!r} has shape {list(f.shape(name))}, "
                               f"expected {list(shape)} from config.json")
        weights[name] = _as_bf16(f, name)
    if config.tie_word_embeddings:
        weights["lm_head.weight"] = weights["model.embed_tokens.weight"]
    return weights


def _open(path: Path) -> SafetensorsFile:
    try:
        return SafetensorsFile(path)
    except SafetensorsError as exc:
        raise WeightsError(str(exc)) from None
    except OSError as exc:
        raise WeightsError(f"{path}: cannot read ({exc})") from None


def _as_bf16(f: SafetensorsFile, name: str) -> np.ndarray:
    dtype = f.dtype(name)
    if dtype not in ("BF16", "F16", "F32"):
        raise WeightsError(f"{f.path}: tensor {name!r} has dtype {dtype}; expected BF16, F16 or F32")
    array = f.array(name)
    return array if dtype == "BF16" else f32_to_bf16(array.astype(np.float32))
