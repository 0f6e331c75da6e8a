"""Prompts to token ids for the server, with the length checks done before the engine sees a request.

The ids are the ones `LLM.generate` computes for the same prompt (the engine's own encoding: raw text with the
tokenizer's special tokens, chat messages through the chat template), so the server and the offline API give
the same tokens.

An over-long prompt is refused before it is tokenized in full: no token is longer than the longest string in
the vocabulary (`max_token_chars` characters), so a text longer than max_model_len * max_token_chars
characters cannot fit, whatever its tokens. Tokenizing it would cost time for nothing.
"""

from __future__ import annotations

from tinyvllm.server.engine_core import EngineInfo
from tinyvllm.server.protocol import APIError
from tinyvllm.tokenizer import TokenizerError


class PromptEncoder:
    def __init__(self, info: EngineInfo):
        self.tokenizer = info.tokenizer
        self.max_model_len = info.max_model_len
        self.vocab_size = info.config.vocab_size
        vocab = self.tokenizer.hf_tokenizer.get_vocab(with_added_tokens=True)
        self.max_token_chars = max(map(len, vocab), default=1)

    def chat(self, messages: list[dict[str, str]]) -> list[int]:
        try:
            text = self.tokenizer.apply_chat_template(messages)
        except TokenizerError as exc:  # no template, or the template refused the conversation
            raise APIError(400, str(exc), param="messages") from None
        self._check_chars(text, "messages")
        return self._checked(self.tokenizer.encode(text, add_special_tokens=False), "messages")

    def completion(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            self._check_chars(prompt, "prompt")
            return self._checked(self.tokenizer.encode(prompt), "prompt")
        bad = [t for t in prompt if not 0 <= t < self.vocab_size]
        if bad:
            raise APIError(400, f"prompt token id {bad[0]} is outside the vocabulary [0, {self.vocab_size})",
                           param="prompt")
        return self._checked(list(prompt), "prompt")

    def max_tokens(self, prompt_ids: list[int], requested: int | None, field: str) -> int:
        """The output limit: the requested one if prompt + output fit the context, else a 400 naming `field`;
        by default whatever room the context leaves (as vLLM does)."""
        room = self.max_model_len - len(prompt_ids)
        if requested is None:
            return room
        if requested < 1:
            raise APIError(400, f"{field} must be at least 1, got {requested}", param=field)
        if requested > room:
            raise APIError(400, f"this model's context is {self.max_model_len} tokens, but {len(prompt_ids)} "
                                f"prompt tokens plus {field}={requested} make {len(prompt_ids) + requested}: "
                                f"lower {field} to at most {room}, or shorten the prompt",
                           param=field, code="context_length_exceeded")
        return requested

    def _check_chars(self, text: str, field: str) -> None:
        if len(text) > self.max_model_len * self.max_token_chars:
            raise APIError(400, f"the prompt has {len(text)} characters: more than the {self.max_model_len}-token "
                                "context can hold with any tokenization", param=field,
                           code="context_length_exceeded")

    def _checked(self, ids: list[int], field: str) -> list[int]:
        if not ids:
            raise APIError(400, "the prompt is empty: nothing to generate from", param=field)
        if len(ids) >= self.max_model_len:
            raise APIError(400, f"the prompt has {len(ids)} tokens, but at most {self.max_model_len - 1} fit "
                                f"(this model's context is {self.max_model_len} tokens)", param=field,
                           code="context_length_exceeded")
        return ids
