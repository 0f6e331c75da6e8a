"""tools/compare_layers.py: its table shows where the CUDA engine and the reference part. In the simulator on
the tiny model, with one GPU weight perturbed: every row before the perturbed operation agrees to summation
order, the perturbed operation's row holds the difference the perturbation makes (computed here from the
weights), and the printed table carries the compared numbers."""

import re

import numpy as np

from tools import compare_layers


def test_a_perturbed_weight_is_located_at_its_layer_and_operation(tiny_model_dir, capsys, monkeypatch):
    results = {}
    real = compare_layers.compare

    def keeping(*args, **kwargs):
        results["rows"] = real(*args, keep=results, **kwargs)
        return results["rows"]

    monkeypatch.setattr(compare_layers, "compare", keeping)
    assert compare_layers.main(["--model", str(tiny_model_dir), "--prompt-tokens", "6", "2",
                                "--block-size", "4", "--perturb", "1.o"]) == 0
    out = capsys.readouterr().out
    rows = results["rows"]
    assert [(r.layer, r.op) for r in rows][:3] == [(-1, "embedding"), (0, "input_norm"), (0, "q")]
    assert (rows[-1].layer, rows[-1].op) == (-1, "logits") and len(rows) == 3 + 2 * 8
    first = compare_layers.first_parting(rows, 1e-4)
    assert (rows[first].layer, rows[first].op) == (1, "o_proj")
    assert all(r.rel <= 1e-5 for r in rows[:first]) and all(r.rel > 1e-3 for r in rows[first:])
    # the o_proj difference is what the perturbation makes: attention output (layer 1) times the change of
    # row 0 of W_o, in output column 0 (the attention outputs agree to 1e-6, so this holds to about that)
    from reference.bf16 import bf16_to_f32, f32_to_bf16
    from tinyvllm.config import ModelConfig
    from tinyvllm.weights import load_weights

    config = ModelConfig.from_dir(tiny_model_dir)
    w = load_weights(tiny_model_dir, config)["model.layers.1.self_attn.o_proj.weight"][0]
    delta = bf16_to_f32(f32_to_bf16(bf16_to_f32(w) * np.float32(1.125))) - bf16_to_f32(w)
    attn = results["reference"][1, "attention"].reshape(len(results["reference"][1, "o_proj"]), -1)
    expected = np.abs(attn.astype(np.float64) @ delta).max()
    assert abs(rows[first].max_abs - expected) <= 1e-5 * rows[first].scale + 1e-6, (rows[first].max_abs, expected)
    got, want = results["cuda"][1, "o_proj"], results["reference"][1, "o_proj"]
    assert np.abs(got - want)[:, 1:].max() <= 1e-5 * rows[first].scale    # the other columns are untouched
    # the table prints these numbers
    line = next(line for line in out.splitlines() if line.startswith("| 1 | o_proj |"))
    printed = [float(x) for x in re.findall(r"\d\.\d{3}e[+-]\d\d", line)]
    assert np.allclose(printed, [rows[first].max_abs, rows[first].rel, rows[first].scale], rtol=1e-3)
    assert "first above the threshold" in line and "first above rel 0.0001: layer 1, o_proj" in out
