"""Model configuration read from a Hugging Face `config.json` (and `generation_config.json`).

Only the Llama family is supported: decoder-only, RMSNorm, rotary embeddings (optionally with Llama 3
frequency scaling), grouped-query attention and a SiLU-gated MLP. Anything else is rejected with an error
that names the field, before any weight is read.

config.json comes in two layouts, and both are read:
- the older one (as the Llama 3.2 repository ships it): top-level `rope_theta`, `rope_scaling` (null or an
  object with `rope_type`), `torch_dtype`;
- the one transformers 5 writes: `rope_parameters` = {"rope_type", "rope_theta", and the scaling fields},
  `dtype`.
A value the file states in one layout is never replaced by a default of the other; where a file states a
value in both and they disagree, it is refused with an error naming both fields.
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

        rope_theta, rope_scaling = _rope(config, fail)
        _one_value(config, ("torch_dtype", "dtype"), fail)

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
            rope_theta=rope_theta,
            max_position_embeddings=positive_int("max_position_embeddings", 2048),
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
            rope_scaling=rope_scaling,
            bos_token_id=bos,
            eos_token_ids=eos_ids,
        )


# HF's default theta when a config states none in either layout (LlamaConfig's own default)
DEFAULT_ROPE_THETA = 10000.0


def _rope(config: dict, fail) -> tuple[float, RopeScaling | None]:
    """(theta, scaling) from either layout; a value stated in both must agree."""
    params = config.get("rope_parameters")
    if params is not None:
        if not isinstance(params, dict):
            raise fail("rope_parameters", f"must be an object or null, got {params!r}")
        if any(isinstance(v, dict) for v in params.values()):
            raise fail("rope_parameters", f"holds per-layer-type settings {sorted(params)}; Llama has one RoPE")
        partial = params.get("partial_rotary_factor", 1.0)
        if partial != 1.0:
            raise fail("rope_parameters.partial_rotary_factor", f"is {partial!r}; Llama rotates every dimension")

    stated = {}  # field name as the file spells it -> value it gives for theta
    if config.get("rope_theta") is not None:
        stated["rope_theta"] = config["rope_theta"]
    if params is not None and params.get("rope_theta") is not None:
        stated["rope_parameters.rope_theta"] = params["rope_theta"]
    for field, value in stated.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
            raise fail(field, f"must be a positive number, got {value!r}")
    thetas = {field: float(value) for field, value in stated.items()}
    if len(set(thetas.values())) > 1:
        raise fail(" and ".join(thetas), f"disagree: {thetas}")
    theta = next(iter(thetas.values()), DEFAULT_ROPE_THETA)

    scalings = {}
    if "rope_scaling" in config:
        scalings["rope_scaling"] = _rope_scaling(config["rope_scaling"], "rope_scaling", fail)
    if params is not None:
        scalings["rope_parameters"] = _rope_scaling(params, "rope_parameters", fail)
    if len(set(scalings.values())) > 1:
        raise fail(" and ".join(scalings), f"disagree: {scalings}")
    return theta, next(iter(scalings.values()), None)


def _rope_scaling(raw, field: str, fail) -> RopeScaling | None:
    """The Llama 3 scaling an object of either layout describes (None for plain RoPE)."""
    if raw is None:
        return None
    if not isinstance(raw, dict):
        raise fail(field, f"must be an object or null, got {raw!r}")
    kind = raw.get("rope_type", raw.get("type"))  # older configs spell the key "type"
    if kind is None:
        # An object that only states theta is plain RoPE; one with scaling fields but no type is ambiguous.
        if set(raw) - {"rope_theta", "partial_rotary_factor"}:
            raise fail(field, f"states scaling fields but no 'rope_type': {raw!r}")
        kind = "default"
    if kind == "default":
        return None
    if kind != "llama3":
        raise fail(field, f"has type {kind!r}; supported: 'default' and 'llama3'")
    try:
        scaling = RopeScaling(
            factor=float(raw["factor"]),
            low_freq_factor=float(raw["low_freq_factor"]),
            high_freq_factor=float(raw["high_freq_factor"]),
            original_max_position_embeddings=int(raw["original_max_position_embeddings"]),
        )
    except KeyError as missing:
        raise fail(field, f"of type 'llama3' lacks {missing.args[0]!r}") from None
    if not (scaling.factor >= 1 and scaling.high_freq_factor > scaling.low_freq_factor > 0
            and scaling.original_max_position_embeddings > 0):
        raise fail(field, f"has inconsistent values {raw!r}")
    return scaling


def _one_value(config: dict, fields: tuple[str, ...], fail) -> None:
    """Refuse a file that gives one setting different values under its old and new names."""
    given = {f: config[f] for f in fields if config.get(f) is not None}
    if len(set(map(str, given.values()))) > 1:
        raise fail(" and ".join(given), f"disagree: {given}")


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
