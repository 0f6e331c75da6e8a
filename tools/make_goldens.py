"""Record Hugging Face transformers' greedy answer of the default model, for the tests to compare against.

    python tools/make_goldens.py            (needs torch and transformers; neither is a tinyvllm dependency)

The default model (SmolLM2-135M-Instruct, converted from its GGUF by tinyvllm.default_model) is run by
transformers on the CPU with float32 compute over the bf16 weights, greedily, on the ChatML prompt for
"What is the capital of France?" rendered by transformers' own apply_chat_template. The result goes to
tests/goldens/smollm2_capital_of_france.json. A second golden, tests/goldens/smollm2_repetition_penalty.json,
is the same model's greedy answer to REPETITION_QUESTION under generate(repetition_penalty=REPETITION_PENALTY)
(Hugging Face's RepetitionPenaltyLogitsProcessor, whose rule the engine's repetition_penalty follows).
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
try:
    import tinyvllm.default_model  # noqa: F401
except ImportError:  # run from a checkout without installing
    sys.path.insert(0, str(REPO))

from tinyvllm.default_model import DEFAULT_MODEL_GGUF, DEFAULT_MODEL_NAME, DEFAULT_MODEL_REQUIREMENT, default_model_dir

QUESTION = "What is the capital of France?"
MAX_NEW_TOKENS = 32
GOLDEN = REPO / "tests" / "goldens" / "smollm2_capital_of_france.json"
REPETITION_QUESTION = "List some colours."
REPETITION_PENALTY = 1.3
REPETITION_GOLDEN = REPO / "tests" / "goldens" / "smollm2_repetition_penalty.json"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=GOLDEN, help=f"where to write (default {GOLDEN})")
    args = parser.parse_args(argv)

    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model_dir = default_model_dir()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    # NOTE: float32 compute: the weights are bf16 values, widened exactly; this matches the engine's policy.
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.eval()

    messages = [{"role": "user", "content": QUESTION}]
    prompt_text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    prompt_ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                               return_dict=True)["input_ids"]
    if prompt_ids != tokenizer(prompt_text, add_special_tokens=False)["input_ids"]:
        raise SystemExit("the chat template's token ids differ from tokenizing its text")
    user_ids = tokenizer(QUESTION, add_special_tokens=False)["input_ids"]

    eos = model.generation_config.eos_token_id
    with torch.no_grad():
        output = model.generate(torch.tensor([prompt_ids]), attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long),
                                max_new_tokens=MAX_NEW_TOKENS, do_sample=False, eos_token_id=eos,
                                pad_token_id=model.generation_config.pad_token_id)
    generated = output[0, len(prompt_ids):].tolist()
    text = tokenizer.decode(generated, skip_special_tokens=False)

    golden = {
        "model": DEFAULT_MODEL_NAME,
        "source": f"{DEFAULT_MODEL_GGUF} from {DEFAULT_MODEL_REQUIREMENT}, converted to bf16 by tinyvllm.gguf_convert",
        "messages": messages,
        "prompt": QUESTION,
        "prompt_text": prompt_text,
        "prompt_token_ids": prompt_ids,
        "user_text_token_ids": user_ids,
        "max_new_tokens": MAX_NEW_TOKENS,
        "eos_token_id": eos,
        "generated_token_ids": generated,
        "text": text,
        "transformers_version": transformers.__version__,
        "torch_version": torch.__version__,
        "date": datetime.date.today().isoformat(),
        "how": "python tools/make_goldens.py  (transformers AutoModelForCausalLM, dtype=torch.float32 on CPU, "
               "model.generate(do_sample=False, max_new_tokens=32), prompt from tokenizer.apply_chat_template("
               "messages, add_generation_prompt=True))",
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(golden, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    print(f"{args.out}: {text!r} ({len(generated)} tokens)")

    messages = [{"role": "user", "content": REPETITION_QUESTION}]
    prompt_ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                               return_dict=True)["input_ids"]
    with torch.no_grad():
        mask = torch.ones(1, len(prompt_ids), dtype=torch.long)
        output = model.generate(torch.tensor([prompt_ids]), attention_mask=mask, max_new_tokens=MAX_NEW_TOKENS,
                                do_sample=False, eos_token_id=eos, repetition_penalty=REPETITION_PENALTY,
                                pad_token_id=model.generation_config.pad_token_id)
    generated = output[0, len(prompt_ids):].tolist()
    text = tokenizer.decode(generated, skip_special_tokens=False)
    repetition = {**golden, "messages": messages, "prompt": REPETITION_QUESTION, "prompt_token_ids": prompt_ids,
                  "repetition_penalty": REPETITION_PENALTY, "generated_token_ids": generated, "text": text,
                  "how": golden["how"].replace("do_sample=False", f"do_sample=False, repetition_penalty="
                                                                  f"{REPETITION_PENALTY}")}
    for key in ("prompt_text", "user_text_token_ids"):
        repetition.pop(key)
    REPETITION_GOLDEN.write_text(json.dumps(repetition, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    print(f"{REPETITION_GOLDEN}: {text!r} ({len(generated)} tokens)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
