"""Experiment: how far quantmla's own reference paths part on the GPU plugin test's chunked prompt (the random
DeepSeek-V2 of `tests/serving/test_vllm_gpu.py`, its 400-token prompt in chunks of 128, 16 greedy tokens of the
float32 unquantised model), teacher-forced through ``QuantizedLatentCache`` with the model in float32 and in BF16,
per scheme and per test codec. The spread is the scale the GPU codec tests bound vLLM's difference by.

    PYTHONPATH=src python benchmarks/experiments/reference_spread.py
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))
import quantmla  # noqa: E402
from quantmla.formats.export import read_codec, read_meta  # noqa: E402
from vllm_reference import (  # noqa: E402
    codec_export,
    max_abs_diff,
    mean_abs_diff,
    random_v2,
    teacher_forced_logprobs,
)

CASES = {  # name: the codec export's layers and options, or a plain scheme
    "bf16": "bf16",
    "c4r4": "c4r4",
    "c2r4": "c2r4",
    "codec transforms (I + 0.5N)": ([("c4r4", "transforms"), ("c2r4", "transforms")], False),
    "codec transforms (rotations)": ([("c4r4", "transforms"), ("c2r4", "transforms")], True),
    "codec ranges": ([("c2r4", "ranges"), ("c3r4", "")], False),
}


def main() -> None:
    from transformers import AutoModelForCausalLM

    model_dir = random_v2(tempfile.mkdtemp())
    models = {}
    for dtype in (torch.float32, torch.bfloat16):
        m = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()
        quantmla.enable_latent_attention(m)
        models[dtype] = m
    prompts = [list(range(300, 700))]
    ids = torch.tensor(prompts)
    tokens = []
    with torch.no_grad():
        for _ in range(16):
            tokens.append(int(models[torch.float32](ids).logits[0, -1].argmax()))
            ids = torch.cat([ids, torch.tensor([[tokens[-1]]])], 1)
    tokens = [tokens]
    clean = teacher_forced_logprobs(models[torch.float32], None, prompts, tokens)
    print("| case | float32 vs BF16 reference: mean / max | float32 reference vs unquantised |")
    print("|---|---|---|")
    for name, case in CASES.items():
        scheme = case
        if isinstance(case, tuple):
            d = codec_export(model_dir, tempfile.mkdtemp(), case[0], strength=0.5, orthogonal=case[1])
            scheme = read_codec(d, read_meta(d))
        f32, bf16 = (teacher_forced_logprobs(models[t], scheme, prompts, tokens, 128) for t in models)
        print(f"| {name} | {mean_abs_diff(f32, bf16):.3f} / {max_abs_diff(f32, bf16):.3f} |"
              f" {mean_abs_diff(f32, clean):.3f} |", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
