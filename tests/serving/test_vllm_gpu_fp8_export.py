"""quantmla's export of an FP8 block-quantised DeepSeek-V3-config checkpoint, served by vLLM (0.26 or 0.33, CUDA):
the export with re-quantised FP8 tensors and the ``--keep-bf16`` one both load in vLLM's FP8 DeepSeek loader, and
with the C4R4 cache from their ``quantmla.json`` they are as close to quantmla's own teacher-forced logprobs (the export
read by ``quantmla.models.loading``, BF16 on the same GPU) as vLLM serving the source checkpoint is to quantmla's of
the source. Skips without a GPU and vLLM; on the H200: ``bash scripts/serving_gpu.sh test``."""

from __future__ import annotations

import gc
import os

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU and vLLM (0.26 or 0.33)", allow_module_level=True)
vllm = pytest.importorskip("vllm", reason="needs vLLM 0.26 or 0.33 on CUDA")
# vLLM 0.26 JIT-compiles DeepGEMM for ~1,400 shapes before serving an FP8 model (5 minutes on an H100); the test
# needs only the shapes it runs, compiled on first use
os.environ.setdefault("VLLM_DEEP_GEMM_WARMUP", "skip")

from fp8_checkpoints import write_v3_fp8_checkpoint  # noqa: E402
from vllm_reference import mean_abs_diff, teacher_forced_logprobs  # noqa: E402

PROMPTS = [list(range(300, 700)), [483, 1719, 9, 3781, 10] * 40]
GEN = 16
# vLLM's FP8 GEMMs need block-aligned widths: 16 heads, hidden 512, q_lora 256 (kv_a_proj_with_mqa keeps its 576)
SIZES = dict(vocab=4096, experts=4, moe_width=256, hidden_size=512, intermediate_size=1024, num_attention_heads=16,
             num_key_value_heads=16, q_lora_rank=256, max_position_embeddings=2048, topk_method="noaux_tc")  # fmt: skip


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    from quantmla.calibrate import calibrate_model
    from quantmla.calibrate.api import export_changed
    from quantmla.models.loading import load_model

    root = tmp_path_factory.mktemp("v3-fp8")
    src = write_v3_fp8_checkpoint(root / "src", layers=2, **SIZES)
    windows = torch.randint(3, 4000, (12, 128), generator=torch.Generator().manual_seed(0))
    model = load_model(src, dtype=torch.float32)
    model, report = calibrate_model(model, None, windows, progress=False, scheme="c4r4", method="quantmla", steps=20,
                                    model_steps=0, num_seqs=8, val_seqs=4, seq_len=128)  # fmt: skip
    fp8 = export_changed(model, src, root / "export-fp8", report)
    bf16 = export_changed(model, src, root / "export-bf16", report, keep_bf16=True)
    print(f"export: {len(fp8['changed'])} tensors changed; --keep-bf16 keeps {len(bf16['kept_bf16'])} in BF16")
    return {"source": src, "fp8": root / "export-fp8", "bf16": root / "export-bf16"}


def _serve(model_dir, scheme=None):
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    extra = {} if scheme is None else {"quantmla": {"scheme": scheme}}
    llm = LLM(model=str(model_dir), dtype="bfloat16", max_model_len=1024, enforce_eager=True, block_size=64,
              kv_cache_memory_bytes=64 << 20, additional_config=extra, max_num_seqs=8, seed=0,
              gpu_memory_utilization=0.3, skip_tokenizer_init=True)  # fmt: skip
    sp = SamplingParams(max_tokens=GEN, temperature=0, logprobs=0, ignore_eos=True)
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in PROMPTS], sp, use_tqdm=False)
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    lps = [[d[t].logprob for d, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids, strict=True)] for o in outs]
    llm.llm_engine.engine_core.shutdown()
    del llm
    gc.collect()
    return tokens, lps


def _reference(model_dir, tokens):
    import quantmla
    from quantmla.models.loading import load_model

    model = load_model(model_dir, dtype=torch.bfloat16, device="cuda")
    quantmla.enable_latent_attention(model)
    out = teacher_forced_logprobs(model, "c4r4", PROMPTS, tokens)
    del model
    torch.cuda.empty_cache()
    return out


def test_fp8_exports_load_in_vllm_as_the_calibrated_model(dirs):
    diffs = {}
    for name in ("source", "fp8", "bf16"):
        tokens, lps = _serve(dirs[name], "c4r4" if name == "source" else None)  # exports: from quantmla.json
        diffs[name] = mean_abs_diff(lps, _reference(dirs[name], tokens))
    print("mean |logprob vLLM - quantmla|, C4R4: " + ", ".join(f"{k} {v:.3g}" for k, v in diffs.items()))
    # vLLM computes with FP8 activations in its block-FP8 GEMMs; the source measures that difference. Bound: an
    # export's difference at most twice the source's plus 0.05
    for name in ("fp8", "bf16"):
        assert diffs[name] <= 2 * diffs["source"] + 0.05, diffs
