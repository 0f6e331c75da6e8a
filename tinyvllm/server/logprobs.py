"""Log-probabilities in OpenAI's response shapes, from the engine's per-token {token id: Logprob} dicts.

The engine (as vLLM) reports, for each generated token, a dict holding the chosen token (with its rank in the
vocabulary) and the N most likely tokens (ranks 1..N; the chosen one among them keeps its entry once).
OpenAI's chat API wants, per token, {"token", "logprob", "bytes", "top_logprobs": [the N most likely]}; its
completions API wants parallel lists {"tokens", "token_logprobs", "top_logprobs": [{text: logprob}],
"text_offset"}. A token's text is its own decoding, so a byte that is part of a multi-byte character shows
as U+FFFD, and "bytes" are the UTF-8 bytes of that text.
"""

from __future__ import annotations


def _top(entry: dict, num: int) -> list[tuple[int, object]]:
    """The num most likely (token id, Logprob) of one position, most likely first."""
    ranked = [(token, lp) for token, lp in entry.items() if lp.rank is not None and lp.rank <= num]
    return sorted(ranked, key=lambda item: item[1].rank)


def _text(lp) -> str:
    return lp.decoded_token or ""


def chat_logprobs(token_ids: list[int], entries: list[dict], num_top: int) -> dict:
    """choice.logprobs of the chat API for `token_ids` (entries: one dict per token)."""
    def item(lp) -> dict:
        return {"token": _text(lp), "logprob": lp.logprob, "bytes": list(_text(lp).encode())}

    return {"content": [{**item(entry[token]), "top_logprobs": [item(lp) for _, lp in _top(entry, num_top)]}
                        for token, entry in zip(token_ids, entries)]}


def completion_logprobs(token_ids: list[int], entries: list[dict], num_top: int, text_offset: int = 0) -> dict:
    """choice.logprobs of the completions API; `text_offset` is where the first token's text starts in the
    completion (for a streamed chunk, the length of the text of the tokens before it)."""
    tokens, values, tops, offsets = [], [], [], []
    for token, entry in zip(token_ids, entries):
        chosen = entry[token]
        tokens.append(_text(chosen))
        values.append(chosen.logprob)
        tops.append({_text(lp): lp.logprob for _, lp in _top(entry, num_top)})
        offsets.append(text_offset)
        text_offset += len(_text(chosen))
    return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops, "text_offset": offsets}


def prompt_logprobs(entries: list[dict | None]) -> list[dict | None]:
    """vLLM's prompt_logprobs field: per prompt token None (the first) or {token id: {logprob, rank,
    decoded_token}}."""
    return [None if entry is None else
            {str(token): {"logprob": lp.logprob, "rank": lp.rank, "decoded_token": lp.decoded_token}
             for token, lp in entry.items()}
            for entry in entries]
