"""config.json in both layouts: the older one (top-level rope_theta / rope_scaling / torch_dtype) and the
one transformers 5 writes (rope_parameters, dtype). Both must give the same model, the same RoPE tables and
the same tokens; a file whose two layouts disagree, or that states an unsupported RoPE, is refused by name."""

import json

import numpy as np
import pytest

from reference.rope import rope_tables
from tinyvllm import LLM, SamplingParams
from tinyvllm.config import DEFAULT_ROPE_THETA, ConfigError, ModelConfig
from tinyvllm.random_model import PRESETS, make_random_model, transformers5_layout

ARCH = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "torch_dtype": "bfloat16"}


def legacy(preset: str) -> dict:
    return {**ARCH, **PRESETS[preset]}


def test_transformers5_layout_is_what_transformers_5_writes():
    """The fixture itself: Llama 3.2 1B's RoPE as one object, nothing left at the top level."""
    v5 = transformers5_layout(legacy("llama-3.2-1b"))
    assert v5["rope_parameters"] == {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0,
                                     "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                     "original_max_position_embeddings": 8192}
    assert v5["dtype"] == "bfloat16"
    assert not {"rope_theta", "rope_scaling", "torch_dtype"} & set(v5)
    assert transformers5_layout(legacy("tiny"))["rope_parameters"] == {"rope_type": "default",
                                                                       "rope_theta": 10000.0}


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_both_layouts_give_the_same_config_and_rope_tables(preset):
    old = ModelConfig.from_dict(legacy(preset))
    new = ModelConfig.from_dict(transformers5_layout(legacy(preset)))
    assert new == old
    assert new.rope_theta == PRESETS[preset]["rope_theta"]
    assert (new.rope_scaling is None) == ("rope_scaling" not in PRESETS[preset])
    cos_old, sin_old = rope_tables(old.head_dim, 4096, old.rope_theta, old.rope_scaling)
    cos_new, sin_new = rope_tables(new.head_dim, 4096, new.rope_theta, new.rope_scaling)
    assert np.array_equal(cos_new, cos_old) and np.array_equal(sin_new, sin_old)


def test_the_old_default_would_have_been_wrong():
    """What the bug did: theta 10000 without scaling gives other tables than the v5 file states."""
    new = ModelConfig.from_dict(transformers5_layout(legacy("llama-3.2-1b")))
    cos, _ = rope_tables(new.head_dim, 4096, new.rope_theta, new.rope_scaling)
    cos_default, _ = rope_tables(new.head_dim, 4096, DEFAULT_ROPE_THETA, None)
    assert np.abs(cos - cos_default).max() > 1.0


def test_llama3_scaling_tables_match_the_formula():
    """Independent check of the llama3 tables at one frequency in each band (wavelength vs the thresholds)."""
    c = ModelConfig.from_dict(transformers5_layout(legacy("llama-3.2-1b")))
    s = c.rope_scaling
    d = c.head_dim
    cos, _ = rope_tables(d, 4096, c.rope_theta, s)
    inv = c.rope_theta ** (-np.arange(0, d, 2) / d)
    wavelen = 2 * np.pi / inv
    low_wl = s.original_max_position_embeddings / s.low_freq_factor
    high_wl = s.original_max_position_embeddings / s.high_freq_factor
    kept, slowed = np.flatnonzero(wavelen < high_wl)[0], np.flatnonzero(wavelen > low_wl)[0]
    mid = np.flatnonzero((wavelen >= high_wl) & (wavelen <= low_wl))[0]
    smooth = (s.original_max_position_embeddings / wavelen[mid] - s.low_freq_factor) / (
        s.high_freq_factor - s.low_freq_factor)
    expected = {kept: inv[kept], slowed: inv[slowed] / s.factor,
                mid: (1 - smooth) * inv[mid] / s.factor + smooth * inv[mid]}
    for i, freq in expected.items():
        np.testing.assert_allclose(cos[4095, i], np.cos(4095 * freq), atol=1e-6)


def greedy_tokens(model_dir):
    llm = LLM(model_dir, backend="cpu", block_size=4)
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    outs = llm.generate([[5, 17, 200, 3, 9, 41, 77], list(range(60, 130))], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def test_same_weights_in_either_layout_give_the_same_tokens(tmp_path):
    """The 'tiny-llama3' model (theta 500000, llama3 scaling) saved in both layouts, greedy on the CPU."""
    old = make_random_model(tmp_path / "legacy", "tiny-llama3", seed=1)
    new = make_random_model(tmp_path / "v5", "tiny-llama3", seed=1, config_layout="transformers5")
    assert "rope_parameters" in json.loads((new / "config.json").read_text())
    tokens = greedy_tokens(old)
    assert greedy_tokens(new) == tokens
    # The check can fail: the same weights under the RoPE the bug used give other tokens.
    buggy = make_random_model(tmp_path / "bug", "tiny-llama3", seed=1, rope_theta=DEFAULT_ROPE_THETA,
                              rope_scaling=None)
    assert greedy_tokens(buggy) != tokens


def v5(**rope) -> dict:
    cfg = transformers5_layout(legacy("llama-3.2-1b"))
    cfg["rope_parameters"] = {**cfg["rope_parameters"], **rope}
    return cfg


def v5_without(field: str) -> dict:
    cfg = v5()
    del cfg["rope_parameters"][field]
    return cfg


@pytest.mark.parametrize("config, message", [
    ({**v5(), "rope_theta": 10000.0}, "'rope_theta and rope_parameters.rope_theta' disagree"),
    ({**v5(), "rope_theta": 500000}, None),  # the same value stated twice is fine
    ({**v5(), "rope_scaling": None}, "'rope_scaling and rope_parameters' disagree"),
    ({**v5(), "rope_scaling": {**legacy("llama-3.2-1b")["rope_scaling"], "factor": 8.0}},
     "'rope_scaling and rope_parameters' disagree"),
    ({**v5(), "rope_scaling": legacy("llama-3.2-1b")["rope_scaling"]}, None),
    (v5(rope_type="yarn"), "'rope_parameters' has type 'yarn'; supported: 'default' and 'llama3'"),
    (v5(rope_type="linear"), "'rope_parameters' has type 'linear'"),
    (v5(rope_type=None), "'rope_parameters' states scaling fields but no 'rope_type'"),
    (v5(partial_rotary_factor=0.5), "'rope_parameters.partial_rotary_factor' is 0.5"),
    (v5(rope_theta=-1.0), "'rope_parameters.rope_theta' must be a positive number, got -1.0"),
    (v5_without("factor"), "'rope_parameters' of type 'llama3' lacks 'factor'"),
    ({**v5(), "rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 1e4}}},
     "per-layer-type settings"),
    ({**v5(), "rope_parameters": [1, 2]}, "'rope_parameters' must be an object or null"),
    ({**v5(), "torch_dtype": "float16"}, "'torch_dtype and dtype' disagree"),
    ({**legacy("tiny"), "rope_scaling": {"factor": 2.0}}, "'rope_scaling' states scaling fields but no"),
])
def test_conflicting_or_unsupported_rope_is_refused_by_name(config, message):
    if message is None:
        assert ModelConfig.from_dict(config) == ModelConfig.from_dict(legacy("llama-3.2-1b"))
        return
    with pytest.raises(ConfigError) as err:
        ModelConfig.from_dict(config, source="m/config.json")
    assert str(err.value).startswith("m/config.json: field") and message in str(err.value)


def test_theta_only_rope_parameters_is_plain_rope():
    cfg = {**legacy("tiny")}
    del cfg["rope_theta"]
    cfg["rope_parameters"] = {"rope_theta": 20000.0}
    c = ModelConfig.from_dict(cfg)
    assert c.rope_theta == 20000.0 and c.rope_scaling is None


def test_hugging_face_reads_our_v5_fixture_the_same_way(tmp_path):
    """Where transformers is installed: the RoPE it computes from a config it saved equals ours."""
    transformers = pytest.importorskip("transformers")
    torch = pytest.importorskip("torch")
    cfg = legacy("tiny-llama3")
    hf_config = transformers.LlamaConfig(**{k: v for k, v in cfg.items() if k not in ("architectures",)})
    hf_config.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    ours = ModelConfig.from_dir(tmp_path)
    assert ours.rope_theta == cfg["rope_theta"] and ours.rope_scaling is not None, saved
    rotary = transformers.models.llama.modeling_llama.LlamaRotaryEmbedding(config=hf_config)
    positions = torch.arange(0, 1000, 37)[None, :]
    cos_hf, _ = rotary(torch.zeros(1, dtype=torch.float32), positions)
    cos, _ = rope_tables(ours.head_dim, 1000, ours.rope_theta, ours.rope_scaling)
    half = ours.head_dim // 2
    np.testing.assert_allclose(cos_hf[0, :, :half].numpy(), cos[positions[0].numpy()], atol=2e-6)
