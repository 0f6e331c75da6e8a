"""Model configuration read from a Hugging Face `config.json` (and `generation_config.json`).

Only the Llama family is supported: decoder-only, RMSNorm, rotary embeddings (optionally with Llama 3
frequency scaling), grouped-query attention and a SiLU-gated MLP. Anything else is rejected with an error
that names the field, before any weight is read.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM",)


class ConfigError(ValueError):
    """config.json describes a model tinyvllm cannot run, or is unreadable."""


@dataclass(frozen=True)
class RopeScaling:
    """Llama 3 rope scaling: long wavelengths are slowed by `factor`, short ones kept, the band between blended."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int


@dataclass(frozen=True)
class ModelConfig:
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    rope_scaling: RopeScaling | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> "ModelConfig":
        """Read config.json, and generation_config.json when present (its bos/eos ids take precedence)."""
        model_dir = Path(model_dir)
        config = _read_json(model_dir / "config.json", required=True)
        generation = _read_json(model_dir / "generation_config.json", required=False) or {}
        return cls.from_dict(config, generation, source=str(model_dir / "config.json"))

    @classmethod
    def from_dict(cls, config: dict, generation: dict | None = None, source: str = "config.json") -> "ModelConfig":
        def fail(field: str, problem: str) -> ConfigError:
            return ConfigError(f"{source}: field {field!r} {problem}")

        architectures = config.get("architectures") or []
        if config.get("model_type") != "llama" and not any(a in SUPPORTED_ARCHITECTURES for a in architectures):
            found = architectures or config.get("model_type")
            raise fail("architectures", f"is {found!r}; tinyvllm runs {', '.join(SUPPORTED_ARCHITECTURES)} only")
        unsupported = [a for a in architectures if a not in SUPPORTED_ARCHITECTURES]
        if unsupported:
            raise fail("architectures", f"is {architectures!r}; tinyvllm runs {', '.join(SUPPORTED_ARCHITECTURES)} only")
        act = config.get("hidden_act", "silu")
        if act != "silu":
            raise fail("hidden_act", f"is {act!r}; Llama models use 'silu'")

        def positive_int(field: str, default: int | None = None) -> int:
            value = config.get(field, default)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise fail(field, f"must be a positive integer, got {value!r}")
            return value

        def positive_float(field: str, default: float | None = None) -> float:
            value = config.get(field, default)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise fail(field, f"must be a positive number, got {value!r}")
            return float(value)

        hidden = positive_int("hidden_size")
        heads = positive_int("num_attention_heads")
        kv_heads = positive_int("num_key_value_heads", heads)
        if heads % kv_heads:
            raise fail("num_key_value_heads", f"is {kv_heads}, which does not divide num_attention_heads {heads}")
        if config.get("head_dim") is None and hidden % heads:
            raise fail("hidden_size", f"is {hidden}, not a multiple of num_attention_heads {heads} (and no head_dim)")
        head_dim = positive_int("head_dim", hidden // heads)
        if head_dim % 2:
            raise fail("head_dim", f"is {head_dim}; rotary embeddings need an even head_dim")
        if config.get("attention_bias") or config.get("mlp_bias"):
            raise fail("attention_bias" if config.get("attention_bias") else "mlp_bias",
                       "is true; Llama projections without bias only")

        generation = generation or {}
        bos = generation.get("bos_token_id", config.get("bos_token_id"))
        eos = generation.get("eos_token_id", config.get("eos_token_id"))
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        if any(isinstance(e, bool) or not isinstance(e, int) for e in eos_ids):
            raise fail("eos_token_id", f"must be an integer or a list of integers, got {eos!r}")

        return cls(
            hidden_size=hidden,
            num_layers=positive_int("num_hidden_layers"),
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            intermediate_size=positive_int("intermediate_size"),
            vocab_size=positive_int("vocab_size"),
            rms_norm_eps=positive_float("rms_norm_eps", 1e-6),
            rope_theta=positive_float("rope_theta", 10000.0),
            max_position_embeddings=positive_int("max_position_embeddings", 2048),
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
            rope_scaling=_rope_scaling(config.get("rope_scaling"), fail),
            bos_token_id=bos,
            eos_token_ids=eos_ids,
        )


def _rope_scaling(raw, fail) -> RopeScaling | None:
    if raw is None:
        return None
    if not isinstance(raw, dict):
        raise fail("rope_scaling", f"must be an object or null, got {raw!r}")
    kind = raw.get("rope_type", raw.get("type"))
    if kind == "default":
        return None
    if kind != "llama3":
        raise fail("rope_scaling", f"has type {kind!r}; supported: 'llama3' (or none)")
    try:
        scaling = RopeScaling(
            factor=float(raw["factor"]),
            low_freq_factor=float(raw["low_freq_factor"]),
            high_freq_factor=float(raw["high_freq_factor"]),
            original_max_position_embeddings=int(raw["original_max_position_embeddings"]),
        )
    except KeyError as missing:
        raise fail("rope_scaling", f"of type 'llama3' lacks {missing.args[0]!r}") from None
    if not (scaling.factor >= 1 and scaling.high_freq_factor > scaling.low_freq_factor > 0
            and scaling.original_max_position_embeddings > 0):
        raise fail("rope_scaling", f"has inconsistent values {raw!r}")
    return scaling


def _read_json(path: Path, required: bool) -> dict | None:
    if not path.is_file():
        if required:
            raise ConfigError(f"{path}: not found (a model directory needs config.json in Hugging Face layout)")
        return None
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ConfigError(f"{path}: not valid JSON ({exc})") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data
