"""config.json parsing and checkpoint loading, including every error a user can run into."""

import json
import shutil

import numpy as np
import pytest

from reference.bf16 import bf16_to_f32, f32_to_bf16
from tinyvllm.config import ConfigError, ModelConfig
from tinyvllm.random_model import LLAMA_3_2_1B
from tinyvllm.safetensors_io import SafetensorsFile, write_safetensors
from tinyvllm.weights import WeightsError, expected_shapes, load_weights

BASE = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", **LLAMA_3_2_1B}


def test_llama_3_2_1b_config():
    c = ModelConfig.from_dict(BASE, {"eos_token_id": [128001, 128008, 128009], "bos_token_id": 128000})
    assert (c.hidden_size, c.num_layers, c.num_heads, c.num_kv_heads, c.head_dim) == (2048, 16, 32, 8, 64)
    assert (c.intermediate_size, c.vocab_size, c.q_size, c.kv_size) == (8192, 128256, 2048, 512)
    assert c.rope_scaling.factor == 32 and c.rope_scaling.original_max_position_embeddings == 8192
    assert c.tie_word_embeddings and c.eos_token_ids == (128001, 128008, 128009) and c.bos_token_id == 128000
    assert c.rms_norm_eps == 1e-5 and c.rope_theta == 500000


def test_head_dim_defaults_to_hidden_over_heads_and_eos_may_be_an_int():
    cfg = {k: v for k, v in BASE.items() if k not in ("head_dim", "rope_scaling")}
    c = ModelConfig.from_dict({**cfg, "eos_token_id": 7})
    assert c.head_dim == 64 and c.rope_scaling is None and c.eos_token_ids == (7,)


@pytest.mark.parametrize("change, message", [
    ({"architectures": ["MistralForCausalLM"], "model_type": "mistral"}, "'architectures' is ['MistralForCausalLM']"),
    ({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}, "tinyvllm runs LlamaForCausalLM only"),
    ({"num_key_value_heads": 5}, "'num_key_value_heads' is 5, which does not divide num_attention_heads 32"),
    ({"hidden_size": -1}, "'hidden_size' must be a positive integer, got -1"),
    ({"num_hidden_layers": "16"}, "'num_hidden_layers' must be a positive integer, got '16'"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "'rope_scaling' has type 'yarn'"),
    ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "lacks 'low_freq_factor'"),
    ({"hidden_act": "gelu"}, "'hidden_act' is 'gelu'"),
    ({"head_dim": 63}, "even head_dim"),
    ({"attention_bias": True}, "'attention_bias' is true"),
])
def test_config_errors_name_the_field(change, message):
    with pytest.raises(ConfigError) as err:
        ModelConfig.from_dict({**BASE, **change}, source="m/config.json")
    assert message in str(err.value) and str(err.value).startswith("m/config.json: field")


def test_missing_and_broken_config_files(tmp_path):
    with pytest.raises(ConfigError, match="config.json: not found"):
        ModelConfig.from_dir(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="config.json: not valid JSON"):
        ModelConfig.from_dir(tmp_path)


@pytest.fixture
def model_copy(tiny_model_dir, tmp_path):
    return shutil.copytree(tiny_model_dir, tmp_path / "model")


def test_loads_every_tensor_with_its_shape(tiny_model_dir):
    config = ModelConfig.from_dir(tiny_model_dir)
    weights = load_weights(tiny_model_dir, config)
    for name, shape in expected_shapes(config).items():
        assert weights[name].shape == shape and weights[name].dtype == np.uint16
    assert "lm_head.weight" in weights and config.tie_word_embeddings is False


def test_tied_embeddings_share_the_table(tiny_llama3_model_dir):
    config = ModelConfig.from_dir(tiny_llama3_model_dir)
    weights = load_weights(tiny_llama3_model_dir, config)
    assert weights["lm_head.weight"] is weights["model.embed_tokens.weight"]


def rewrite(model_dir, edit):
    path = model_dir / "model.safetensors"
    f = SafetensorsFile(path)
    tensors = {name: np.array(f.array(name)) for name in f.keys()}
    del f
    edit(tensors)
    write_safetensors(path, tensors)


def test_missing_tensor(model_copy):
    rewrite(model_copy, lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(WeightsError, match=r"tensor 'model.layers.1.mlp.up_proj.weight' is missing"):
        load_weights(model_copy, ModelConfig.from_dir(model_copy))


def test_wrong_shape_names_tensor_and_both_shapes(model_copy):
    def edit(t):
        t["model.layers.0.self_attn.k_proj.weight"] = t["model.layers.0.self_attn.k_proj.weight"][:16]
    rewrite(model_copy, edit)
    with pytest.raises(WeightsError) as err:
        load_weights(model_copy, ModelConfig.from_dir(model_copy))
    assert "tensor 'model.layers.0.self_attn.k_proj.weight' has shape [16, 64], expected [32, 64]" in str(err.value)


def test_truncated_file(model_copy):
    path = model_copy / "model.safetensors"
    data = path.read_bytes()
    path.write_bytes(data[: len(data) - 100])
    with pytest.raises(WeightsError, match="model.safetensors: not a valid safetensors file"):
        load_weights(model_copy, ModelConfig.from_dir(model_copy))


def test_garbage_file(model_copy):
    (model_copy / "model.safetensors").write_bytes(b"\x00" * 5)
    with pytest.raises(WeightsError, match="not a valid safetensors file"):
        load_weights(model_copy, ModelConfig.from_dir(model_copy))


def test_no_checkpoint(model_copy):
    (model_copy / "model.safetensors").unlink()
    with pytest.raises(WeightsError, match="no model.safetensors or model.safetensors.index.json"):
        load_weights(model_copy, ModelConfig.from_dir(model_copy))


def test_sharded_fp32_and_fp16_checkpoint_matches_bf16(tiny_model_dir, model_copy):
    """Split the checkpoint over two shards, one stored as fp32 and one as fp16, with an index."""
    config = ModelConfig.from_dir(tiny_model_dir)
    original = load_weights(tiny_model_dir, config)
    f = SafetensorsFile(model_copy / "model.safetensors")
    names = f.keys()
    first, second = names[: len(names) // 2], names[len(names) // 2:]
    write_safetensors(model_copy / "model-00001-of-00002.safetensors",
                      {n: bf16_to_f32(f.array(n)) for n in first})
    write_safetensors(model_copy / "model-00002-of-00002.safetensors",
                      {n: bf16_to_f32(f.array(n)).astype(np.float16) for n in second})
    del f
    (model_copy / "model.safetensors").unlink()
    index = {"weight_map": {**{n: "model-00001-of-00002.safetensors" for n in first},
                            **{n: "model-00002-of-00002.safetensors" for n in second}}}
    (model_copy / "model.safetensors.index.json").write_text(json.dumps(index))
    loaded = load_weights(model_copy, config)
    for n in first:  # fp32 copies of bf16 values round back exactly
        assert np.array_equal(loaded[n], original[n])
    for n in second:  # fp16 may lose low bits of tiny values; bf16 rounding of it stays within 1 bf16 ulp
        np.testing.assert_allclose(bf16_to_f32(loaded[n]), bf16_to_f32(original[n]), rtol=2 ** -7, atol=1e-4)
    (model_copy / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(WeightsError, match="shard named by the index .* does not exist"):
        load_weights(model_copy, config)


def test_unsupported_dtype(model_copy):
    rewrite(model_copy, lambda t: t.update({"model.norm.weight": np.arange(64, dtype=np.int32)}))
    with pytest.raises(WeightsError, match="'model.norm.weight' has dtype I32; expected BF16, F16 or F32"):
        load_weights(model_copy, ModelConfig.from_dir(model_copy))


def test_fp32_weights_round_to_nearest_even_bf16(model_copy):
    value = np.float32(1.00390625)  # exactly halfway between two bf16 values: ties to even (1.0)
    rewrite(model_copy, lambda t: t.update({"model.norm.weight": np.full(64, value, np.float32)}))
    loaded = load_weights(model_copy, ModelConfig.from_dir(model_copy))
    assert (loaded["model.norm.weight"] == f32_to_bf16(np.float32(1.0))).all()
