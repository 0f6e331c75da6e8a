"""Building byte-level BPE tokenizers (GPT-2 style) with the `tokenizers` library.

Used where a model comes without a tokenizer.json: the GGUF converter (vocabulary and merges from the GGUF
metadata) and the random test models (the 256 byte symbols and no merges). Byte-level means every byte of
UTF-8 text is first mapped to one printable symbol, so any text encodes without an unknown token.
"""

from __future__ import annotations

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors


def byte_level_bpe(vocab: dict[str, int], merges: list[tuple[str, str]], special_tokens: list[str],
                   split_digits: bool = False) -> Tokenizer:
    """A byte-level BPE tokenizer; `special_tokens` must already be in `vocab` and are never split."""
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.pre_tokenizer = (pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
                               if split_digits else byte_level)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in special_tokens])
    return tokenizer


def byte_alphabet() -> list[str]:
    """The 256 printable symbols byte-level BPE uses for bytes 0..255, in byte order."""
    return sorted(pre_tokenizers.ByteLevel.alphabet(), key=_byte_of_symbol)


def _byte_of_symbol(symbol: str) -> int:
    # GPT-2's map: printable Latin-1 bytes stand for themselves; the other 68 bytes are shifted to 256 + k.
    code = ord(symbol)
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    if code in printable:
        return code
    others = [b for b in range(256) if b not in printable]
    return others[code - 256]
