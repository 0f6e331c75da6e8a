"""tinyvllm: a small, readable LLM inference engine whose every GPU operation is a hand-written Numba kernel.

    from tinyvllm import LLM, SamplingParams
    print(LLM().generate("The capital of France is", SamplingParams(temperature=0, max_tokens=8))[0].text)
"""

__version__ = "0.1.0"

__all__ = ["LLM", "LLMEngine", "SamplingParams"]


def __getattr__(name):
    # Lazy, so that `import tinyvllm` (e.g. by the CLI's --help) does not load NumPy models or numba.
    if name == "LLM":
        from tinyvllm.llm import LLM

        return LLM
    if name == "LLMEngine":
        from tinyvllm.engine import LLMEngine

        return LLMEngine
    if name == "SamplingParams":
        from tinyvllm.sampling_params import SamplingParams

        return SamplingParams
    raise AttributeError(f"module 'tinyvllm' has no attribute {name!r}")
