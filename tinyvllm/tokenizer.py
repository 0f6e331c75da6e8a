"""Text <-> token ids: a Hugging Face `tokenizers` tokenizer, its chat template, and streaming detokenization.

The heavy lifting (BPE, pre-tokenization, byte-level decoding) is done by the `tokenizers` library, which
reads a model's tokenizer.json as is. This module adds what a model directory says around it, the way Hugging
Face transformers reads it, so that our prompts are token for token the ones the model was trained on:

- tokenizer_config.json: the chat template, the bos/eos tokens and `add_bos_token`;
- the chat template, rendered with Jinja in a sandbox with the same settings and helpers as transformers;
- `IncrementalDetokenizer`, which turns a stream of generated ids into a stream of text without ever
  printing half a character.

generation_config.json (sampling defaults, the list of stop ids) is read by the engine, not here.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import Any

import jinja2
import tokenizers
from jinja2 import nodes
from jinja2.ext import Extension
from jinja2.sandbox import ImmutableSandboxedEnvironment

__all__ = ["IncrementalDetokenizer", "Tokenizer", "TokenizerError"]


class TokenizerError(ValueError):
    """A tokenizer file is missing or broken, a chat template failed, or messages are malformed."""


# ----------------------------------------------------------------------------------------------------------
# Chat template rendering


def _raise_exception(message: str) -> None:
    # Templates call this to reject a conversation they cannot format ("Conversation roles must alternate").
    raise TokenizerError(f"chat template error: {message}")


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
            sort_keys: bool = False) -> str:
    # NOTE: Jinja's own `tojson` escapes <, >, & and ' as \u003c... for HTML safety, which would change the
    # prompt (tool schemas in templates); transformers replaces it with plain json.dumps, and so do we.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


class _GenerationTag(Extension):
    # transformers' templates may wrap assistant text in {% generation %}...{% endgeneration %} to mark it
    # for training loss masks; for inference the block renders its body unchanged.
    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.CallBlock(self.call_method("_render_body"), [], [], body).set_lineno(lineno)

    def _render_body(self, caller):
        return caller()


@lru_cache(maxsize=16)
def _compile_template(source: str):
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=["jinja2.ext.loopcontrols", _GenerationTag])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    try:
        return env.from_string(source)
    except jinja2.TemplateSyntaxError as exc:
        raise TokenizerError(f"the chat template does not parse: {exc.message} (template line {exc.lineno})") from exc


def _check_messages(messages: Any) -> None:
    if not isinstance(messages, (list, tuple)):
        raise TokenizerError(f"messages must be a list of {{'role': ..., 'content': ...}} dicts, "
                             f"got {type(messages).__name__}")
    if not messages:
        raise TokenizerError("messages is empty: a chat needs at least one message")
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise TokenizerError(f"messages[{i}] must be a dict with 'role' and 'content', "
                                 f"got {type(message).__name__}")
        for key in ("role", "content"):
            if key not in message:
                raise TokenizerError(f"messages[{i}] has no {key!r} key (it has {sorted(message)})")
            if not isinstance(message[key], str):
                raise TokenizerError(f"messages[{i}][{key!r}] must be a string, "
                                     f"got {type(message[key]).__name__}")


# ----------------------------------------------------------------------------------------------------------
# Tokenizer


def _token_content(value: Any, what: str, source: Path) -> str | None:
    # tokenizer_config.json writes special tokens either as a plain string or as a serialized AddedToken.
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        return value["content"]
    raise TokenizerError(f"{source}: {what} must be a string or {{'content': ...}}, got {value!r}")


def _byte_level_chars() -> dict[str, int]:
    """The byte-level alphabet (GPT-2's bytes_to_unicode, which the `tokenizers` ByteLevel decoder uses):
    character -> the byte it stands for. Printable bytes stand for themselves; the rest are shifted to
    U+0100 and up, in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("\xa1"), ord("\xac") + 1),
                 *range(ord("\xae"), ord("\xff") + 1)]
    chars = {chr(b): b for b in printable}
    shifted = 0
    for b in range(256):
        if b not in printable:
            chars[chr(256 + shifted)] = b
            shifted += 1
    return chars


_BYTE_OF_CHAR = _byte_level_chars()


class Tokenizer:
    """A `tokenizers.Tokenizer` plus what tokenizer_config.json says about it.

    `add_bos_token`: True always starts an encoding with bos, False never does, None (the usual case for
    Llama 3 and Hugging Face "fast" tokenizers) leaves it to tokenizer.json's post-processor. Whatever the
    setting, bos is never added twice by us and the library together.
    """

    def __init__(self, hf_tokenizer: tokenizers.Tokenizer, chat_template: str | None = None,
                 bos_token: str | None = None, eos_token: str | None = None,
                 add_bos_token: bool | None = None) -> None:
        self._hf = hf_tokenizer
        self.chat_template = chat_template
        self.add_bos_token = add_bos_token
        added = hf_tokenizer.get_added_tokens_decoder()
        self._special_ids = frozenset(i for i, tok in added.items() if tok.special)
        # Byte-level BPE (Llama 3, SmolLM2, GPT-2): decode() maps ids to bytes itself (see _decode_bytes).
        self._byte_level = isinstance(hf_tokenizer.decoder, tokenizers.decoders.ByteLevel) and \
            isinstance(hf_tokenizer.model, tokenizers.models.BPE)
        self._token_bytes: list | None = None   # id -> bytes (model tokens, filled on first use) or added token
        self._added = {i: (tok.content, tok.special) for i, tok in added.items()}
        # Probe once what the post-processor does around a text, so encode() knows whether bos is already
        # there. A post-processor (TemplateProcessing) adds tokens by id, without us seeing its config.
        try:
            plain = hf_tokenizer.encode("a", add_special_tokens=False).ids
            full = hf_tokenizer.encode("a", add_special_tokens=True).ids
        except Exception:  # a vocabulary that cannot encode "a" (no unknown token): assume nothing is added
            plain = full = []
        prepended = full[0] if len(full) > len(plain) and full[1:1 + len(plain)] == plain else None
        if bos_token is None and prepended is not None and prepended in self._special_ids:
            # No config says what bos is, but the post-processor prepends a special token: that is bos.
            bos_token = hf_tokenizer.id_to_token(prepended)
        self.bos_token = bos_token
        self.eos_token = eos_token
        self._bos_id = self._id_of(bos_token, "bos_token")
        self._eos_id = self._id_of(eos_token, "eos_token")
        self._processor_adds_bos = self._bos_id is not None and prepended == self._bos_id

    def _id_of(self, token: str | None, what: str) -> int | None:
        if token is None:
            return None
        token_id = self._hf.token_to_id(token)
        if token_id is None:
            raise TokenizerError(f"{what} {token!r} is not in the tokenizer's vocabulary")
        return token_id

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> Tokenizer:
        """Load tokenizer.json (required) and tokenizer_config.json (optional) from a model directory.

        The chat template comes from tokenizer_config.json's `chat_template` (a string, or a list of named
        templates of which "default" is used); newer transformers versions save it beside as
        chat_template.jinja instead, which is read when the config has none.
        """
        model_dir = Path(model_dir)
        path = model_dir / "tokenizer.json"
        if not path.is_file():
            raise TokenizerError(f"{path}: not found; a model directory needs a tokenizer.json "
                                 "(Hugging Face tokenizers format)")
        try:
            hf = tokenizers.Tokenizer.from_file(str(path))
        except Exception as exc:  # the library raises a bare Exception with serde's message
            raise TokenizerError(f"{path}: cannot be read as a tokenizer: {exc}") from exc

        config: dict[str, Any] = {}
        config_path = model_dir / "tokenizer_config.json"
        if config_path.is_file():
            try:
                config = json.loads(config_path.read_text(encoding="utf-8"))
            except (json.JSONDecodeError, UnicodeDecodeError) as exc:
                raise TokenizerError(f"{config_path}: not valid JSON: {exc}") from exc
            if not isinstance(config, dict):
                raise TokenizerError(f"{config_path}: expected a JSON object, got {type(config).__name__}")

        template = config.get("chat_template")
        if isinstance(template, list):
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, Mapping)}
            template = named.get("default")
        if template is not None and not isinstance(template, str):
            raise TokenizerError(f"{config_path}: chat_template must be a string or a list of "
                                 "{name, template}")
        jinja_path = model_dir / "chat_template.jinja"
        if template is None and jinja_path.is_file():
            template = jinja_path.read_text(encoding="utf-8")

        add_bos = config.get("add_bos_token")
        if add_bos is not None and not isinstance(add_bos, bool):
            raise TokenizerError(f"{config_path}: add_bos_token must be true or false, got {add_bos!r}")
        try:
            return cls(hf, chat_template=template,
                       bos_token=_token_content(config.get("bos_token"), "bos_token", config_path),
                       eos_token=_token_content(config.get("eos_token"), "eos_token", config_path),
                       add_bos_token=add_bos)
        except TokenizerError as exc:
            raise TokenizerError(f"{model_dir}: {exc}") from exc

    # -- properties -----------------------------------------------------------------------------------------

    @property
    def hf_tokenizer(self) -> tokenizers.Tokenizer:
        """The wrapped `tokenizers.Tokenizer`."""
        return self._hf

    @property
    def vocab_size(self) -> int:
        """Number of token ids, added tokens included (may differ from the model's embedding rows)."""
        return self._hf.get_vocab_size(with_added_tokens=True)

    @property
    def bos_token_id(self) -> int | None:
        return self._bos_id

    @property
    def eos_token_id(self) -> int | None:
        return self._eos_id

    @property
    def special_ids(self) -> frozenset[int]:
        """Ids of the added tokens marked special (bos, eos, chat markers): skipped by decode by default."""
        return self._special_ids

    def token_to_id(self, token: str) -> int | None:
        return self._hf.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self._hf.id_to_token(int(token_id))

    # -- encode / decode ------------------------------------------------------------------------------------

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`. With `add_special_tokens`, bos is handled as `add_bos_token` says."""
        ids = self._hf.encode(text, add_special_tokens=add_special_tokens).ids
        if add_special_tokens and self._bos_id is not None:
            if self.add_bos_token and not self._processor_adds_bos:
                ids.insert(0, self._bos_id)
            elif self.add_bos_token is False and self._processor_adds_bos and ids[:1] == [self._bos_id]:
                del ids[0]
        return ids

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        """Text of `ids`; bytes that do not form whole UTF-8 characters come out as U+FFFD.

        No "clean-up of tokenization spaces" is done (transformers' option that turns " ." into "."): it is
        lossy, and it would make the streamed text differ from the decoded text.
        """
        if self._byte_level:
            text = self._decode_bytes(ids if type(ids) is list else list(ids), skip_special_tokens)
            if text is not None:
                return text
        return self._hf.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def _decode_bytes(self, ids: list, skip_special_tokens: bool) -> str | None:
        """decode() of a byte-level BPE tokenizer without calling into the library: the same text, in half the
        time for the few ids the incremental detokenizer decodes (two decodes per streamed token; the library's
        per-call cost dominates there).

        The ByteLevel decoder maps each token's characters to bytes (a token with a character outside the
        byte alphabet: its UTF-8 bytes) and decodes them lossily: U+FFFD for each invalid or incomplete
        sequence, as Python's "replace". An added token is not decoded but written as its content (a skipped
        special token not at all), the bytes on either side decoded apart; its content being whole UTF-8
        characters, decoding it together with them gives the same text. None (the caller asks the library)
        for an id outside the vocabulary or one that is not an int."""
        table = self._token_bytes
        if table is None:
            table = [None] * self._hf.get_vocab_size(with_added_tokens=True)
            for i, (content, special) in self._added.items():
                if i < len(table):
                    table[i] = (content.encode("utf-8"), special)
            self._token_bytes = table
        size = len(table)
        pieces = []
        for i in ids:
            if i.__class__ is not int or not 0 <= i < size:
                return None
            piece = table[i]
            if piece is None:
                piece = table[i] = self._model_token_bytes(i)
            if piece.__class__ is bytes:
                pieces.append(piece)
            elif not (skip_special_tokens and piece[1]):  # an added token: (content, special)
                pieces.append(piece[0])
        return b"".join(pieces).decode("utf-8", "replace")

    def _model_token_bytes(self, token_id: int) -> bytes:
        token = self._hf.id_to_token(token_id)
        if token is None:  # a hole in the vocabulary: the library decodes it to nothing
            return b""
        try:
            return bytes([_BYTE_OF_CHAR[c] for c in token])
        except KeyError:
            return token.encode("utf-8")

    # -- chat -----------------------------------------------------------------------------------------------

    def apply_chat_template(self, messages: Sequence[Mapping[str, str]], add_generation_prompt: bool = True,
                            **extra: Any) -> str:
        """Render `messages` with the chat template, as transformers' `apply_chat_template(tokenize=False)`.

        The template sees `messages`, `add_generation_prompt`, `bos_token`, `eos_token`, `tools` and
        `documents` (None) and every keyword in `extra` (for example `date_string` for Llama 3).
        """
        if self.chat_template is None:
            raise TokenizerError("this model has no chat template (tokenizer_config.json has no chat_template); "
                                 "pass a template, or use --no-chat to send the prompt as plain text")
        _check_messages(messages)
        template = _compile_template(self.chat_template)
        variables: dict[str, Any] = {"tools": None, "documents": None}
        # A token that is not set stays undefined (renders as ""), rather than the string "None".
        if self.bos_token is not None:
            variables["bos_token"] = self.bos_token
        if self.eos_token is not None:
            variables["eos_token"] = self.eos_token
        variables.update(extra)
        variables["messages"] = [dict(m) for m in messages]
        variables["add_generation_prompt"] = add_generation_prompt
        try:
            return template.render(**variables)
        except TokenizerError:
            raise
        except jinja2.TemplateError as exc:
            raise TokenizerError(f"the chat template failed: {type(exc).__name__}: {exc}") from exc

    def encode_chat(self, messages: Sequence[Mapping[str, str]], add_generation_prompt: bool = True,
                    **extra: Any) -> list[int]:
        """Prompt ids of a conversation: the rendered template encoded without adding special tokens.

        The template already writes bos (`{{ bos_token }}`) where the model wants it; letting the
        post-processor add another would give the model a doubled bos it never saw in training.
        Special tokens in the rendered text (<|eot_id|>, <|im_start|>) are matched as single ids.
        """
        text = self.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, **extra)
        return self.encode(text, add_special_tokens=False)


# ----------------------------------------------------------------------------------------------------------
# Streaming detokenization


class IncrementalDetokenizer:
    """Turns generated token ids, one at a time, into text that can be printed as it comes.

    Decoding each new token on its own is wrong in two ways. A byte-level BPE token can be part of a UTF-8
    character (an emoji is often 3 or 4 tokens of one byte each), which decodes alone to U+FFFD; and some
    decoders make a token's text depend on its neighbours (SentencePiece-style decoders drop the leading
    space of the first token of whatever they decode). So, as vLLM does, we keep two offsets into the ids:
    `read` (everything before it has been printed) and `prefix` (a few tokens before `read`, for context).
    For each new token we decode ids[prefix:read] and ids[prefix:] and print the difference, but only when
    the longer text does not end in U+FFFD, i.e. when its last character is complete; otherwise we print
    nothing and wait for more bytes. After printing, the window moves to start where the printed part
    began, so each decode is a few tokens long, not the whole output.

    The window starts on the last few prompt ids, so that the first generated token is decoded with its
    left context just as it will be in the full text. For byte-level tokenizers (Llama 3, SmolLM2, GPT-2)
    the concatenation of everything `push` and `flush` return is exactly `tokenizer.decode(generated_ids)`.
    """

    #: How many prompt ids seed the window (vLLM uses the same). Enough context for any decoder we know of.
    CONTEXT_TOKENS = 5

    def __init__(self, tokenizer: Tokenizer, prompt_ids: Sequence[int] = (), skip_special_tokens: bool = True):
        self._tok = tokenizer
        self._skip = skip_special_tokens
        seed = [int(i) for i in prompt_ids[-self.CONTEXT_TOKENS:]]
        # A prompt that ends inside a UTF-8 character (possible with raw byte-token prompts) would glue its
        # partial bytes onto the first generated ones, printing text the generated ids alone do not contain.
        if seed and tokenizer.decode(seed, skip_special_tokens).endswith("\ufffd"):
            seed = []
        self._ids: list[int] = seed
        self._prefix = 0
        self._read = len(seed)
        self._prefix_text = tokenizer.decode(seed, skip_special_tokens)
        self._num_generated = 0
        self._text_parts: list[str] = []

    @property
    def text(self) -> str:
        """Everything returned by `push` and `flush` so far."""
        return "".join(self._text_parts)

    @property
    def generated_ids(self) -> list[int]:
        """The ids pushed so far."""
        return self._ids[len(self._ids) - self._num_generated:]

    def push(self, token_id: int) -> str:
        """Add one generated id; return the text that became printable ("" while a character is incomplete)."""
        self.append(token_id)
        return self._advance(final=False)

    def append(self, token_id: int) -> None:
        """Add one generated id without decoding: its text comes with the next push or flush (one decode)."""
        self._ids.append(int(token_id))
        self._num_generated += 1

    def flush(self) -> str:
        """Return whatever is still held back (an incomplete character shows as U+FFFD, as decode shows it)."""
        return self._advance(final=True)

    def _advance(self, final: bool) -> str:
        if self._read == len(self._ids):
            return ""
        text = self._tok.decode(self._ids[self._prefix:], self._skip)
        # Hold back while the tail is an incomplete character, or while the new ids print nothing yet (a
        # skipped special token): keeping them in the window costs nothing and keeps later diffs right.
        if not final and (text.endswith("\ufffd") or len(text) <= len(self._prefix_text)):
            return ""
        piece = text[len(self._prefix_text):]
        # The printed part becomes the context of the next decode.
        self._prefix = self._read
        self._read = len(self._ids)
        self._prefix_text = self._tok.decode(self._ids[self._prefix:self._read], self._skip)
        if piece:
            self._text_parts.append(piece)
        return piece
