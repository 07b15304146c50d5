"""The re-quantisation error of an FP8 export against a BF16 fusion, beside the cache quantisation's own damage.

Writes the bundled model (``builtin:tiny-mla``) as an FP8 block-quantised checkpoint (e4m3, 128 x 128 block scales,
``quantization_config: {quant_method: fp8, fmt: e4m3, weight_block_size: [128, 128]}``; every linear layer's
weight in FP8, norms and embeddings in BF16, as DeepSeek ships them), calibrates it layer by layer (``quantmla
calibrate --sequential``, QuantMLA's layer stage, ``--model-steps 0``) and exports it twice: re-quantised to FP8
(new block scales, from the float32 fusion) and with ``--keep-bf16``. On windows of the bundled test split, per
token, in float32:

* KL(BF16 fusion || FP8 export): the BF16 fusion is the calibrated model with its changed projections in BF16
  (the ``--keep-bf16`` export's values) and every other weight the source's FP8 dequantised;
* KL(BF16 fusion || ``--keep-bf16`` export): the same but for its ``q_a_proj``, which the export stores in BF16
  beside ``kv_a_proj_with_mqa`` (vLLM fuses the two);
* KL(BF16 fusion, BF16 cache || BF16 fusion, ``--scheme`` cache): the cache quantisation's own damage
  (:class:`~quantmla.eval.ppl.PerplexityConfig` ``kl=True``), with the sink + recent windows and without;
* for context, KL(the bundled float32 model || its FP8 checkpoint): the FP8 checkpoint's own error.

Prints a markdown table and writes a JSON (``--json``) with the command, date, CPU and versions.

    PYTHONPATH=src python benchmarks/fp8_requant.py --json docs/fp8-requant-cpu.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

QUANTIZATION = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128], "activation_scheme": "dynamic"}


def stored_in_fp8(name: str, t: torch.Tensor) -> bool:
    """The weights DeepSeek's FP8 checkpoints store in FP8: every linear layer's but the router's."""
    return (t.dim() == 2 and name.endswith(".weight") and not any(k in name for k in ("norm", "embed", "lm_head"))
            and not name.endswith("mlp.gate.weight"))  # fmt: skip


def write_fp8_checkpoint(model: str, out: Path) -> Path:
    """``model``'s shards re-written with FP8 block-quantised weights (the same shards and names)."""
    from safetensors.torch import load_file, save_file

    from quantmla.models.fp8_checkpoint import Fp8Blocks, quantize_blocks
    from quantmla.models.loading import inspect_model

    src = inspect_model(model).path
    out.mkdir(parents=True, exist_ok=True)
    blocks = Fp8Blocks((128, 128))
    for f in sorted(src.glob("*.safetensors")):
        tensors = {}
        for name, t in load_file(str(f)).items():
            if stored_in_fp8(name, t):
                tensors[name], tensors[name + "_scale_inv"] = quantize_blocks(t, blocks)
            else:
                tensors[name] = t.to(torch.bfloat16) if t.is_floating_point() else t
        save_file(tensors, str(out / f.name), metadata={"format": "pt"})
    index = src / "model.safetensors.index.json"
    if index.is_file():
        weight_map = {}
        for f in sorted(out.glob("*.safetensors")):
            from safetensors import safe_open

            with safe_open(str(f), framework="pt") as st:
                weight_map |= dict.fromkeys(st.keys(), f.name)
        (out / index.name).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}, indent=2))
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = QUANTIZATION
    (out / "config.json").write_text(json.dumps(config, indent=2))
    for name in ("generation_config.json", "tokenizer.json", "tokenizer_config.json"):
        if (src / name).is_file():
            shutil.copy(src / name, out / name)
    return out


def calibrate(src: Path, out: Path, args, keep_bf16: bool) -> list[str]:
    """``quantmla calibrate --sequential`` as a subprocess; returns its command line."""
    cmd = [sys.executable, "-m", "quantmla", "calibrate", str(src), "--out", str(out), "--sequential",
           "--method", args.method, "--scheme", args.scheme, "--steps", str(args.steps), "--model-steps", "0",
           "--num-seqs", str(args.calib_seqs), "--val-seqs", str(args.val_seqs), "--seq-len", str(args.seq_len),
           "--dtype", "float32", "--device", "cpu"]  # fmt: skip
    if keep_bf16:
        cmd.append("--keep-bf16")
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    return cmd


@torch.no_grad()
def kl_per_token(p_model, q_model, windows: torch.Tensor, batch_size: int) -> float:
    """Mean KL(p || q) of the next-token distributions over every position but each window's last, float64."""
    total, count = 0.0, 0
    for x in windows.split(batch_size):
        p = p_model(x, use_cache=False).logits[:, :-1].double().log_softmax(-1)
        q = q_model(x, use_cache=False).logits[:, :-1].double().log_softmax(-1)
        total += float((p.exp() * (p - q)).sum())
        count += p.shape[0] * p.shape[1]
    return total / count


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="builtin:tiny-mla")
    ap.add_argument("--scheme", default="c4r4")
    ap.add_argument("--method", default="quantmla")
    ap.add_argument("--steps", type=int, default=50, help="QuantMLA's learning steps per path and layer")
    ap.add_argument("--calib-seqs", type=int, default=32, help="calibration sequences (bundled validation split)")
    ap.add_argument("--val-seqs", type=int, default=8, help="held-out calibration sequences")
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--eval-seqs", type=int, default=16, help="test-split windows, spread over the split")
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--dir", default=None, help="work directory (default: a temporary one, removed)")
    ap.add_argument("--json", default=None, help="write the results here")
    args = ap.parse_args()
    torch.set_grad_enabled(False)

    from quantmla.eval.ppl import PerplexityConfig, perplexity
    from quantmla.measure.tokens import all_windows, select_windows
    from quantmla.models.loading import builtin_text, load, load_model

    start = time.perf_counter()
    root = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="quantmla-fp8-requant-"))
    try:
        src = write_fp8_checkpoint(args.model, root / "src")
        fp8_cmd = calibrate(src, root / "fp8", args, keep_bf16=False)
        calibrate(src, root / "bf16", args, keep_bf16=True)
        meta = [json.loads((root / d / "quantmla.json").read_text()) for d in ("fp8", "bf16")]
        assert meta[0]["layers"] == meta[1]["layers"], "the two calibrations differ"

        float_model, tok = load(args.model, dtype="float32")
        source = load_model(src, dtype="float32")
        fp8 = load_model(root / "fp8", dtype="float32")
        kept = load_model(root / "bf16", dtype="float32")
        # the BF16 fusion: the --keep-bf16 export with its q_a_proj (stored in BF16 beside kv_a_proj_with_mqa)
        # back to the source's FP8 values, which calibration never changes
        ref = load_model(root / "bf16", dtype="float32")
        own = source.state_dict()
        ref.load_state_dict({n: own[n] for n in own if ".q_a_proj." in n}, strict=False)
        changed = sum(not torch.equal(t, own[n]) for n, t in ref.state_dict().items() if n in own)

        text = builtin_text("test")
        windows = select_windows(all_windows(tok, text, args.seq_len), args.eval_seqs, spread=True)
        # KL(BF16 fusion || each), per token; the weights compared with unquantised caches
        rows = {
            "the FP8 export (changed weights re-quantised, new block scales)": kl_per_token(
                ref, fp8, windows, args.batch_size
            ),
            "the `--keep-bf16` export": kl_per_token(ref, kept, windows, args.batch_size),
        }
        for label, sink, recent in (("sink 4 + recent 128", 4, 128), ("no sink or recent window", 0, 0)):
            cfg = PerplexityConfig(scheme=args.scheme, seq_len=args.seq_len, num_seqs=args.eval_seqs, spread=True,
                                   sink=sink, recent=recent, batch_size=args.batch_size, kl=True)  # fmt: skip
            got = perplexity(ref, tok, text, cfg, progress=False)
            rows[f"the BF16 fusion with the `{args.scheme}` cache, {label} (the cache's own damage)"] = got.kl
        # for context: KL(float model || its FP8 checkpoint)
        rows["for context: the FP8 checkpoint against the float32 model it was written from"] = kl_per_token(
            float_model, source, windows, args.batch_size
        )
    finally:
        if not args.dir:
            shutil.rmtree(root, ignore_errors=True)

    title = (f"{args.model} as an FP8 checkpoint, {args.method} {args.scheme} ({args.steps} steps, "
             f"{args.calib_seqs} + {args.val_seqs} x {args.seq_len} tokens), layer by layer; KL per token over "
             f"{len(windows)} test windows of {args.seq_len}, float32 on the CPU")  # fmt: skip
    print(f"\n{title}\n\n| KL(BF16 fusion, unquantised cache \\|\\| this), unless said | per token |\n|---|---|")
    for k, v in rows.items():
        print(f"| {k} | {v:.3g} |")
    print(f"\n{changed} tensors of the BF16 fusion differ from the source; {time.perf_counter() - start:.0f} s")
    if args.json:
        import transformers

        record = {
            "command": "PYTHONPATH=src python benchmarks/fp8_requant.py " + " ".join(sys.argv[1:]),
            "calibration": " ".join(["quantmla", *fp8_cmd[3:]]),
            "date": datetime.date.today().isoformat(),
            "cpu": f"{cpu_name()}, {os.cpu_count()} cores",
            "versions": {"torch": torch.__version__, "transformers": transformers.__version__},
            "dtype": "float32",
            "model": args.model,
            "eval_windows": len(windows),
            "seq_len": args.seq_len,
            "kl_per_token": rows,
            "seconds": round(time.perf_counter() - start, 1),
        }
        Path(args.json).write_text(json.dumps(record, indent=2) + "\n")


if __name__ == "__main__":
    main()
