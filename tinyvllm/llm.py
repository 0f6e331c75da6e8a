"""The offline API: `LLM(model).generate(prompts, sampling_params)`, as vLLM and nano-vllm users expect.

    from tinyvllm import LLM, SamplingParams
    llm = LLM()                                   # the embedded default model; or LLM(model="path")
    outs = llm.generate(["The capital of France is", [{"role": "user", "content": "Hi!"}]],
                        SamplingParams(temperature=0, max_tokens=32))
    print(outs[0].outputs[0].text)
    for piece in llm.stream("Tell me a story", SamplingParams(max_tokens=100)):
        print(piece, end="", flush=True)

A prompt is a string (raw text), a list of token ids, or a list of chat messages (rendered with the model's
chat template). `chat()` takes one conversation.
"""

from __future__ import annotations

import sys
import time
from typing import Iterator, Sequence

from tinyvllm.engine import LLMEngine, RequestOutput
from tinyvllm.sampling_params import SamplingParams


# Seconds between progress-bar redraws into a file or a pipe, where each redraw stays (a terminal overwrites
# the bar in place and gets tqdm's usual 0.1 s).
LOG_REDRAW_INTERVAL = 5.0


def _progress_bar(total: int):
    """A tqdm bar on stderr that redraws at most every LOG_REDRAW_INTERVAL seconds when stderr is no terminal."""
    from tqdm import tqdm

    interval = 0.1 if sys.stderr.isatty() else LOG_REDRAW_INTERVAL
    return tqdm(total=total, desc="generating", unit="req", dynamic_ncols=True, mininterval=interval,
                file=sys.stderr)


def _show_rate(bar, tokens_per_s: float) -> None:
    """The output tokens/s in the bar, redrawn only when the bar's last redraw is older than its mininterval
    (set_postfix_str redraws at once, which was a redraw per engine step)."""
    due = time.time() - bar.last_print_t >= bar.mininterval   # tqdm's own clock and redraw time
    bar.set_postfix_str(f"{tokens_per_s:.0f} tok/s", refresh=due)


def _is_single_prompt(prompts) -> bool:
    if isinstance(prompts, str):
        return True
    if isinstance(prompts, (list, tuple)) and prompts:
        first = prompts[0]
        return isinstance(first, dict) or (isinstance(first, int) and not isinstance(first, bool))
    return False


class LLM:
    def __init__(self, model=None, **engine_options):
        self.engine = LLMEngine.from_options(model, **engine_options)
        self.tokenizer = self.engine.tokenizer

    @classmethod
    def from_engine(cls, engine: LLMEngine) -> "LLM":
        """The offline API over an engine built otherwise (tools/sim_runner.py's, over a simulated GPU)."""
        llm = cls.__new__(cls)
        llm.engine, llm.tokenizer = engine, engine.tokenizer
        return llm

    def generate(self, prompts, sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """Outputs in the order of the prompts; a bar shows progress and output tokens/s for many prompts."""
        if _is_single_prompt(prompts):
            prompts = [prompts]
        prompts = list(prompts)
        if isinstance(sampling_params, (list, tuple)):
            if len(sampling_params) != len(prompts):
                raise ValueError(f"{len(sampling_params)} sampling params for {len(prompts)} prompts")
            params = list(sampling_params)
        else:
            params = [sampling_params or SamplingParams()] * len(prompts)
        ids = [self.engine.add_request(p, sp, final_only=True) for p, sp in zip(prompts, params)]
        finished: dict[str, RequestOutput] = {}
        bar = None
        if use_tqdm and len(prompts) > 1:
            bar = _progress_bar(len(prompts))
        start, tokens_before = time.perf_counter(), self.engine.num_generated_tokens
        try:
            while self.engine.has_unfinished_requests():
                for out in self.engine.step():
                    if out.finished:
                        finished[out.request_id] = out
                        if bar is not None:
                            bar.update(1)
                if bar is not None:
                    new_tokens = self.engine.num_generated_tokens - tokens_before
                    _show_rate(bar, new_tokens / max(time.perf_counter() - start, 1e-9))
        finally:
            if bar is not None:
                bar.close()
            for rid in ids:
                if rid not in finished:
                    self.engine.abort(rid)
        return [finished[rid] for rid in ids]

    def chat(self, messages: list[dict], sampling_params: SamplingParams | None = None) -> RequestOutput:
        return self.generate([messages], sampling_params, use_tqdm=False)[0]

    def stream(self, prompt, sampling_params: SamplingParams | None = None) -> Iterator[str]:
        """Text pieces of one request as they are produced; the final RequestOutput is the return value."""
        rid = self.engine.add_request(prompt, sampling_params)
        last = None
        try:
            while last is None or not last.finished:
                for out in self.engine.step():
                    if out.request_id == rid:
                        last = out
                        if out.new_text:
                            yield out.new_text
        finally:
            if last is None or not last.finished:
                self.engine.abort(rid)
        return last
