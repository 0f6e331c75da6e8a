"""Converting a Llama-architecture GGUF file into a Hugging Face-layout model directory.

GGUF (llama.cpp's format) keeps the whole model in one file: key/value metadata (hyperparameters, the BPE
vocabulary and merges, token types, bos/eos ids, the chat template) and the tensors, often quantized in
blocks (Q4_1, Q8_0, ...). The engine loads the Hugging Face layout, so this module writes one:

    config.json              hyperparameters under the names of transformers' LlamaConfig
    model.safetensors        every tensor dequantized (`gguf.quants.dequantize`) and rounded to bf16
    tokenizer.json           a byte-level BPE tokenizer (tinyvllm.bpe) rebuilt from the vocabulary and merges
    tokenizer_config.json    chat template, bos/eos tokens, add_bos_token, model_max_length
    generation_config.json   bos/eos ids

Two facts about the GGUF side matter:
- GGUF lists a tensor's dimensions fastest-first, so a matrix of shape (out_features, in_features) in Hugging
  Face order is `[in_features, out_features]` in the GGUF header; the row-major data is the same. The reader
  already hands the data over as (rows, row bytes), and dequantizing gives (out_features, in_features).
- llama.cpp's converter permuted the rows of Q and K inside each head so that the two elements RoPE rotates
  together are adjacent (its kernels rotate pairs (2i, 2i+1); Hugging Face rotates (i, i + head_dim/2)).
  It viewed a head's rows as (2, head_dim/2) and stored them transposed, as (head_dim/2, 2). `unpermute_rows`
  undoes that; K has only the KV heads.

The output is written into a temporary sibling directory and renamed into place at the end, so an
interrupted conversion never leaves a half-written model where a complete one is expected.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import sys
import tempfile
import uuid
from pathlib import Path

import numpy as np

from reference.bf16 import f32_to_bf16
from tinyvllm.bpe import byte_level_bpe
from tinyvllm.safetensors_io import write_safetensors

# Bump when the output of the converter changes, so cached conversions are redone.
CONVERTER_VERSION = 1
# Written last into a finished conversion: what it was made from and by which converter version.
MARKER_FILE = "tinyvllm_conversion.json"
OUTPUT_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
                "generation_config.json", MARKER_FILE)

# GGUF token types (llama.cpp's llama_token_type)
TOKEN_NORMAL, TOKEN_UNKNOWN, TOKEN_CONTROL, TOKEN_USER_DEFINED, TOKEN_UNUSED, TOKEN_BYTE = 1, 2, 3, 4, 5, 6

# llama.cpp pre-tokenizer names whose split rules tinyvllm.bpe reproduces: GPT-2's regex, with or without
# a first pass that splits every digit on its own.
_PRE_GPT2 = {"default", "gpt2", "gpt-2"}
_PRE_DIGITS = {"smollm"}

# GGUF per-layer tensor name -> Hugging Face name (without the "model.layers.{i}." prefix)
_LAYER_TENSORS = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_GLOBAL_TENSORS = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


class GGUFError(ValueError):
    """A GGUF file that this converter cannot turn into a Llama checkpoint (and why)."""


# ----------------------------------------------------------------------------------------------------------
# the Q/K row permutation


def unpermute_rows(weight: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's per-head row permutation of a Q or K projection (or its bias).

    `weight` has n_heads * head_dim rows. Within each head, row 2*i + j of the GGUF tensor is row
    j * head_dim/2 + i of the original: the rows are seen as (head_dim/2, 2) and become (2, head_dim/2).
    """
    rows = weight.shape[0]
    if rows % (2 * n_heads):
        raise GGUFError(f"cannot un-permute {rows} rows over {n_heads} heads: need an even head_dim")
    half = rows // n_heads // 2
    return (weight.reshape(n_heads, half, 2, *weight.shape[1:])
            .swapaxes(1, 2)
            .reshape(weight.shape))


# ----------------------------------------------------------------------------------------------------------
# metadata


def _field_value(field):
    """The Python value of one GGUF key/value field: a scalar, a string or a list of them."""
    from gguf import GGUFValueType

    def one(part, vtype):
        if vtype == GGUFValueType.STRING:
            return bytes(part).decode("utf-8")
        value = part[0].item()
        if vtype == GGUFValueType.BOOL:
            return bool(value)
        if vtype == GGUFValueType.FLOAT32:
            # the shortest decimal that is the same float32 (1e-05, not 9.999999747378752e-06)
            return float(np.format_float_positional(np.float32(value), unique=True, trim="0"))
        return value

    if field.types[0] == GGUFValueType.ARRAY:
        return [one(field.parts[i], field.types[-1]) for i in field.data]
    return one(field.parts[field.data[0]], field.types[0])


def read_metadata(reader) -> dict:
    """All key/value fields of a GGUFReader as a plain dict (the GGUF.* header fields excluded)."""
    return {name: _field_value(field) for name, field in reader.fields.items() if not name.startswith("GGUF.")}


def _require(meta: dict, key: str):
    if key not in meta:
        raise GGUFError(f"the GGUF metadata has no {key!r}")
    return meta[key]


def _llama3_rope_scaling(factors: np.ndarray, head_dim: int, theta: float) -> dict:
    """rope_scaling of type "llama3" reproducing llama.cpp's rope_freqs tensor, or a GGUFError.

    llama.cpp stores Llama 3.1-style RoPE scaling as one divisor per frequency. For Llama 3 models the
    pre-scaling context is 8192 tokens; factor, low_freq_factor and high_freq_factor then follow from the
    divisors (the ramp between them is linear in 1/wavelength). The result is checked by recomputing them.
    """
    original = 8192
    freqs = theta ** (-np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    wavelen = 2 * math.pi / freqs
    factors = np.asarray(factors, dtype=np.float64).reshape(-1)
    factor = float(factors.max())
    params = None
    if factors.shape == freqs.shape and factor > 1:
        ramp = (factors > 1 + 1e-6) & (factors < factor * (1 - 1e-6))
        if ramp.sum() >= 2:
            # smooth = (1/f - 1/factor) / (1 - 1/factor) = (original/wavelen - low) / (high - low)
            smooth = (1 / factors[ramp] - 1 / factor) / (1 - 1 / factor)
            slope, intercept = np.polyfit(original / wavelen[ramp], smooth, 1)
            high_minus_low = 1 / slope
            low = -intercept * high_minus_low
            params = {"rope_type": "llama3", "factor": factor, "low_freq_factor": round(float(low), 4),
                      "high_freq_factor": round(float(low + high_minus_low), 4),
                      "original_max_position_embeddings": original}
    if params is None or not np.allclose(_llama3_factors(params, wavelen), factors, rtol=1e-4):
        raise GGUFError("the GGUF's rope_freqs.weight does not match Llama 3 RoPE scaling; "
                        "cannot express it as a Hugging Face rope_scaling")
    return params


def _llama3_factors(params: dict, wavelen: np.ndarray) -> np.ndarray:
    factor, low, high = params["factor"], params["low_freq_factor"], params["high_freq_factor"]
    original = params["original_max_position_embeddings"]
    smooth = (original / wavelen - low) / (high - low)
    ramp = 1 / ((1 - smooth) / factor + smooth)
    return np.where(wavelen < original / high, 1.0, np.where(wavelen > original / low, factor, ramp))


def _rope_scaling(meta: dict, arch: str) -> dict | None:
    kind = meta.get(f"{arch}.rope.scaling.type")
    if kind is None or kind == "none":
        return None
    factor = float(_require(meta, f"{arch}.rope.scaling.factor"))
    if kind == "linear":
        return {"rope_type": "linear", "factor": factor}
    if kind == "yarn":
        scaling = {"rope_type": "yarn", "factor": factor}
        if f"{arch}.rope.scaling.original_context_length" in meta:
            scaling["original_max_position_embeddings"] = int(meta[f"{arch}.rope.scaling.original_context_length"])
        return scaling
    raise GGUFError(f"unsupported RoPE scaling type {kind!r} in the GGUF metadata")


def build_config(meta: dict, has_output: bool, rope_freqs: np.ndarray | None = None) -> dict:
    """config.json for transformers' LlamaForCausalLM from the GGUF metadata."""
    arch = _require(meta, "general.architecture")
    hidden = int(_require(meta, f"{arch}.embedding_length"))
    heads = int(_require(meta, f"{arch}.attention.head_count"))
    kv_heads = int(meta.get(f"{arch}.attention.head_count_kv", heads))
    head_dim = int(meta.get(f"{arch}.attention.key_length", hidden // heads))
    if int(meta.get(f"{arch}.attention.value_length", head_dim)) != head_dim:
        raise GGUFError("keys and values of different head sizes are not a Llama model")
    rope_dims = int(meta.get(f"{arch}.rope.dimension_count", head_dim))
    if rope_dims != head_dim:
        raise GGUFError(f"RoPE over {rope_dims} of {head_dim} head dimensions (partial rotary) is not supported")
    theta = float(meta.get(f"{arch}.rope.freq_base", 10000.0))
    context = int(_require(meta, f"{arch}.context_length"))
    tokens = _require(meta, "tokenizer.ggml.tokens")
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": hidden,
        "intermediate_size": int(_require(meta, f"{arch}.feed_forward_length")),
        "num_hidden_layers": int(_require(meta, f"{arch}.block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "rms_norm_eps": float(meta.get(f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)),
        "rope_theta": theta,
        "max_position_embeddings": context,
        "vocab_size": int(meta.get(f"{arch}.vocab_size", len(tokens))),
        "tie_word_embeddings": not has_output,
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "torch_dtype": "bfloat16",
    }
    for key in ("bos", "eos", "padding"):
        if f"tokenizer.ggml.{key}_token_id" in meta:
            config[f"{'pad' if key == 'padding' else key}_token_id"] = int(meta[f"tokenizer.ggml.{key}_token_id"])
    scaling = _rope_scaling(meta, arch)
    if scaling is None and rope_freqs is not None:
        scaling = _llama3_rope_scaling(rope_freqs, head_dim, theta)
    if scaling is not None:
        config["rope_scaling"] = scaling
    return config


# ----------------------------------------------------------------------------------------------------------
# tokenizer


def _add_bos_default(meta: dict) -> bool:
    # llama.cpp's default when the key is absent: BPE vocabularies add no BOS, except Llama 3's.
    return bool(meta.get("tokenizer.ggml.add_bos_token", meta.get("tokenizer.ggml.pre") == "llama-bpe"))


def build_tokenizer(meta: dict):
    """A `tokenizers.Tokenizer` equal to the GGUF's BPE vocabulary, merges and special tokens."""
    from tokenizers import AddedToken, processors

    model = meta.get("tokenizer.ggml.model")
    if model != "gpt2":
        raise GGUFError(f"tokenizer model {model!r} is not supported: only byte-level BPE (\"gpt2\") is")
    pre = meta.get("tokenizer.ggml.pre", "default")
    if pre not in _PRE_GPT2 | _PRE_DIGITS:
        raise GGUFError(f"pre-tokenizer {pre!r} is not supported: known are {sorted(_PRE_GPT2 | _PRE_DIGITS)}")
    tokens = _require(meta, "tokenizer.ggml.tokens")
    types = meta.get("tokenizer.ggml.token_type", [TOKEN_NORMAL] * len(tokens))
    merges = []
    for merge in meta.get("tokenizer.ggml.merges", []):
        parts = merge.split(" ")
        if len(parts) != 2:
            raise GGUFError(f"malformed BPE merge {merge!r}: expected two tokens separated by one space")
        merges.append((parts[0], parts[1]))
    vocab = {token: i for i, token in enumerate(tokens)}
    if len(vocab) != len(tokens):
        raise GGUFError("the GGUF vocabulary has duplicate tokens")
    special = [t for t, kind in zip(tokens, types) if kind == TOKEN_CONTROL]
    tokenizer = byte_level_bpe(vocab, merges, special, split_digits=pre in _PRE_DIGITS)
    user_defined = [t for t, kind in zip(tokens, types) if kind == TOKEN_USER_DEFINED]
    if user_defined:  # added tokens that are never split but are ordinary text when decoding
        tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in user_defined])
    if _add_bos_default(meta):
        bos_id = int(_require(meta, "tokenizer.ggml.bos_token_id"))
        bos = tokens[bos_id]
        tokenizer.post_processor = processors.Sequence([
            processors.ByteLevel(trim_offsets=False),
            processors.TemplateProcessing(single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, bos_id)]),
        ])
    return tokenizer


def build_tokenizer_config(meta: dict, config: dict) -> dict:
    tokens = meta["tokenizer.ggml.tokens"]
    out = {
        # the tokenizer is tokenizer.json exactly as written; a model-specific class could rebuild it
        "tokenizer_class": "PreTrainedTokenizerFast",
        "add_bos_token": _add_bos_default(meta),
        "add_eos_token": bool(meta.get("tokenizer.ggml.add_eos_token", False)),
        "clean_up_tokenization_spaces": False,
        "model_max_length": config["max_position_embeddings"],
    }
    for key, name in (("bos", "bos_token"), ("eos", "eos_token"), ("padding", "pad_token"), ("unknown", "unk_token")):
        token_id = meta.get(f"tokenizer.ggml.{key}_token_id")
        if token_id is not None and 0 <= token_id < len(tokens):
            out[name] = tokens[token_id]
    if "tokenizer.chat_template" in meta:
        out["chat_template"] = meta["tokenizer.chat_template"]
    return out


def build_generation_config(meta: dict) -> dict:
    out = {}
    if "tokenizer.ggml.bos_token_id" in meta:
        out["bos_token_id"] = int(meta["tokenizer.ggml.bos_token_id"])
    eos = [int(meta[f"tokenizer.ggml.{k}_token_id"]) for k in ("eos", "eot", "eom")
           if f"tokenizer.ggml.{k}_token_id" in meta]
    eos = list(dict.fromkeys(eos))  # in order, without repeats
    if eos:
        out["eos_token_id"] = eos[0] if len(eos) == 1 else eos
    if "tokenizer.ggml.padding_token_id" in meta:
        out["pad_token_id"] = int(meta["tokenizer.ggml.padding_token_id"])
    return out


# ----------------------------------------------------------------------------------------------------------
# tensors


def hf_tensor_name(gguf_name: str) -> str | None:
    """The Hugging Face name of a GGUF tensor, or None when it has none."""
    if gguf_name in _GLOBAL_TENSORS:
        return _GLOBAL_TENSORS[gguf_name]
    prefix, _, rest = gguf_name.partition(".")
    layer, _, suffix = rest.partition(".")
    if prefix == "blk" and layer.isdigit() and suffix in _LAYER_TENSORS:
        return f"model.layers.{int(layer)}.{_LAYER_TENSORS[suffix]}"
    return None


def _expected_names(config: dict) -> set[str]:
    names = {"model.embed_tokens.weight", "model.norm.weight"}
    if not config["tie_word_embeddings"]:
        names.add("lm_head.weight")
    for i in range(config["num_hidden_layers"]):
        names.update(f"model.layers.{i}.{suffix}" for suffix in _LAYER_TENSORS.values())
    return names


def _expected_shape(name: str, config: dict) -> tuple[int, ...]:
    hidden, ffn = config["hidden_size"], config["intermediate_size"]
    q_rows = config["num_attention_heads"] * config["head_dim"]
    kv_rows = config["num_key_value_heads"] * config["head_dim"]
    shapes = {"embed_tokens": (config["vocab_size"], hidden), "lm_head": (config["vocab_size"], hidden),
              "norm": (hidden,), "input_layernorm": (hidden,), "post_attention_layernorm": (hidden,),
              "q_proj": (q_rows, hidden), "k_proj": (kv_rows, hidden), "v_proj": (kv_rows, hidden),
              "o_proj": (hidden, q_rows), "gate_proj": (ffn, hidden), "up_proj": (ffn, hidden),
              "down_proj": (hidden, ffn)}
    return shapes[name.split(".")[-2]]


def convert_gguf(gguf_path: str | Path, out_dir: str | Path, progress: bool = True, *,
                 overwrite: bool = False) -> Path:
    """Convert a Llama-architecture GGUF file into a Hugging Face-layout directory `out_dir`; returns it.

    `out_dir` must not exist (or be an empty directory) unless `overwrite` is true.
    """
    from gguf import GGUFReader
    from gguf.quants import dequantize
    from tqdm import tqdm

    gguf_path, out_dir = Path(gguf_path), Path(out_dir)
    if out_dir.exists() and not overwrite and (not out_dir.is_dir() or any(out_dir.iterdir())):
        raise FileExistsError(f"{out_dir} already exists and is not empty (ask to overwrite it to replace it)")
    try:
        reader = GGUFReader(gguf_path, "r")
    except (ValueError, OSError) as exc:
        raise GGUFError(f"{gguf_path}: not a readable GGUF file ({exc})") from None
    meta = read_metadata(reader)
    arch = meta.get("general.architecture")
    if arch != "llama":
        raise GGUFError(f"{gguf_path}: architecture {arch!r} is not supported; only 'llama' GGUF files convert")

    tensors = {t.name: t for t in reader.tensors}
    rope_freqs = tensors.pop("rope_freqs.weight", None)
    config = build_config(meta, "output.weight" in tensors,
                          None if rope_freqs is None else dequantize(rope_freqs.data, rope_freqs.tensor_type))
    unknown = sorted(n for n in tensors if hf_tensor_name(n) is None)
    if unknown:
        raise GGUFError(f"{gguf_path}: tensors with no Llama counterpart: {', '.join(unknown[:8])}")
    names = {hf_tensor_name(n): n for n in tensors}
    missing = sorted(_expected_names(config) - set(names))
    extra = sorted(set(names) - _expected_names(config))
    if missing or extra:
        raise GGUFError(f"{gguf_path}: tensors do not match the metadata: missing {missing[:8]}, extra {extra[:8]}")
    tokenizer = build_tokenizer(meta)

    out_dir.parent.mkdir(parents=True, exist_ok=True)
    # a plain mkdir (not mkdtemp, which makes it private): the model directory is an ordinary one
    tmp = out_dir.parent / f".{out_dir.name}.partial-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        arrays = {}
        order = sorted(names, key=_sort_key)
        for hf_name in tqdm(order, desc=f"converting {gguf_path.name}", unit="tensor", disable=not progress,
                            file=sys.stderr):
            tensor = tensors[names[hf_name]]
            values = dequantize(tensor.data, tensor.tensor_type).astype(np.float32, copy=False)
            if values.shape != _expected_shape(hf_name, config):
                raise GGUFError(f"{gguf_path}: tensor {names[hf_name]} has shape {values.shape}, "
                                f"expected {_expected_shape(hf_name, config)} for {hf_name}")
            if hf_name.endswith("q_proj.weight"):
                values = unpermute_rows(values, config["num_attention_heads"])
            elif hf_name.endswith("k_proj.weight"):
                values = unpermute_rows(values, config["num_key_value_heads"])
            arrays[hf_name] = f32_to_bf16(values)
        write_safetensors(tmp / "model.safetensors", arrays, {"format": "pt"})
        del arrays
        tokenizer.save(str(tmp / "tokenizer.json"))
        _write_json(tmp / "config.json", config)
        _write_json(tmp / "tokenizer_config.json", build_tokenizer_config(meta, config))
        _write_json(tmp / "generation_config.json", build_generation_config(meta))
        _write_json(tmp / MARKER_FILE, {"converter_version": CONVERTER_VERSION, "source": gguf_path.name,
                                        "source_bytes": gguf_path.stat().st_size})
        if out_dir.exists():
            old = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.old-", dir=out_dir.parent))
            os.replace(out_dir, old / "dir")
            os.rename(tmp, out_dir)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.rename(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir


def _sort_key(name: str):
    # embeddings first, then layers in numeric order, then the final norm and head (the file reads naturally)
    parts = name.split(".")
    if parts[:2] == ["model", "layers"]:
        return (1, int(parts[2]), name)
    return (0 if "embed" in name else 2, 0, name)


def _write_json(path: Path, obj: dict) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
