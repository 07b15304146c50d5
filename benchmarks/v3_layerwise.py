"""Layer-by-layer calibration at DeepSeek-V3's real attention width, from an FP8 block-quantised checkpoint.

Writes a DeepSeek-V3-config checkpoint with random FP8 weights (hidden 7168, 128 heads, q_lora 1536, kv_lora 512,
RoPE 64, nope 128, v 128, vocab 129,280, 128 x 128 block scales) of ``--layers`` layers, the routed experts shrunk
to ``--experts`` (V3 has 256: 11 GB of FP8 a layer, which only the layer's load and its forward see, not the
calibration), then runs ``quantmla.calibrate.streamed`` on it for each method with the paper's recipe (128 + 32
sequences of 512 tokens, 300 steps a path), as for a model that does not fit (the model-level stage skipped).
Prints per method the seconds of each layer, the peak GPU memory and this process's peak host memory, and the
whole V3 extrapolated: 3 dense + 58 MoE layers.

    PYTHONPATH=src python benchmarks/v3_layerwise.py --dir /tmp/v3 --json OUT/v3-layerwise.json
"""

from __future__ import annotations

import argparse
import json
import shutil
import time
from pathlib import Path

import torch


def v3_config(layers: int, experts: int, dense: int):
    from transformers import DeepseekV3Config

    return DeepseekV3Config(
        vocab_size=129280, hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048,
        num_hidden_layers=layers, num_attention_heads=128, num_key_value_heads=128, q_lora_rank=1536,
        kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128, n_routed_experts=experts,
        num_experts_per_tok=min(8, experts), n_shared_experts=1, n_group=1, topk_group=1,
        first_k_dense_replace=dense, max_position_embeddings=4096, tie_word_embeddings=False,
    )  # fmt: skip


def write_checkpoint(out: Path, layers: int, experts: int, dense: int, device: str) -> Path:
    """Random FP8 weights, one shard per layer plus one for the embeddings, written tensor by tensor."""
    from safetensors.torch import save_file
    from transformers import DeepseekV3ForCausalLM

    from quantmla.models.fp8_checkpoint import Fp8Blocks, quantize_blocks

    cfg = v3_config(layers, experts, dense)
    if (out / "config.json").is_file():
        return out
    out.mkdir(parents=True, exist_ok=True)
    with torch.device("meta"):
        skeleton = DeepseekV3ForCausalLM(cfg)
    shapes = {n: tuple(p.shape) for n, p in skeleton.named_parameters()}
    # the checkpoint's own names: per-expert weights (transformers fuses them on load)
    names = {}
    for n, shape in shapes.items():
        if ".mlp.experts.gate_up_proj" in n:
            base = n.removesuffix(".gate_up_proj")
            for e in range(experts):
                names[f"{base}.{e}.gate_proj.weight"] = (shape[1] // 2, shape[2])
                names[f"{base}.{e}.up_proj.weight"] = (shape[1] // 2, shape[2])
        elif ".mlp.experts.down_proj" in n:
            base = n.removesuffix(".down_proj")
            for e in range(experts):
                names[f"{base}.{e}.down_proj.weight"] = (shape[1], shape[2])
        else:
            names[n] = shape
    blocks, gen = Fp8Blocks((128, 128)), torch.Generator(device).manual_seed(0)
    groups: dict[str, dict] = {}
    for n in names:
        part = n.split(".")[2] if n.startswith("model.layers.") else "outer"
        groups.setdefault(part, {})[n] = names[n]
    weight_map = {}
    for i, (part, members) in enumerate(groups.items()):
        tensors = {}
        for n, shape in members.items():
            if len(shape) == 1:
                tensors[n] = torch.ones(shape, dtype=torch.bfloat16)
                continue
            w = torch.randn(shape, generator=gen, device=device) * shape[-1] ** -0.5
            fp8 = "norm" not in n and "embed" not in n and "lm_head" not in n and not n.endswith("mlp.gate.weight")
            if fp8:
                codes, scale = quantize_blocks(w, blocks)
                tensors[n], tensors[n + "_scale_inv"] = codes.cpu(), scale.cpu()
            else:
                tensors[n] = w.to(torch.bfloat16).cpu()
        if any(n.endswith("e_score_correction_bias") for n in shapes if n.startswith(f"model.layers.{part}.")):
            key = f"model.layers.{part}.mlp.gate.e_score_correction_bias"
            tensors[key] = torch.zeros(experts, dtype=torch.float32)
        shard = f"model-{i:05d}.safetensors"
        save_file(tensors, str(out / shard), metadata={"format": "pt"})
        weight_map |= dict.fromkeys(tensors, shard)
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    raw = cfg.to_dict()
    raw["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128],
                                  "activation_scheme": "dynamic"}  # fmt: skip
    raw["architectures"] = ["DeepseekV3ForCausalLM"]
    (out / "config.json").write_text(json.dumps(raw, indent=2))
    return out


def host_peak() -> int:
    status = dict(line.split(":", 1) for line in open("/proc/self/status"))
    return int(status["VmHWM"].split()[0]) * 1024


class _Enough(Exception):
    pass


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dir", type=Path, default=Path("/tmp/v3-fp8"))
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--dense", type=int, default=1, help="leading dense layers (V3: 3)")
    ap.add_argument("--experts", type=int, default=8, help="routed experts a layer (V3: 256)")
    ap.add_argument("--methods", default="rtn,quantmla,raq")
    ap.add_argument("--num-seqs", type=int, default=128)
    ap.add_argument("--val-seqs", type=int, default=32)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--max-seconds", type=float, default=240.0, help="per method: stop after the layer passing it")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()

    from quantmla.calibrate.streamed import StreamConfig, calibrate_streamed

    t0 = time.perf_counter()
    src = write_checkpoint(args.dir, args.layers, args.experts, args.dense, args.device)
    print(f"checkpoint written in {time.perf_counter() - t0:.0f} s: {src}", flush=True)
    vocab = v3_config(1, 1, 0).vocab_size
    ids = torch.randint(0, vocab, (args.num_seqs + args.val_seqs, args.seq_len), generator=torch.Generator())
    rows = []
    for method in args.methods.split(","):
        cuda = torch.device(args.device).type == "cuda"
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        times, start = [], time.perf_counter()
        last = [start]

        def done(idx, times=times, last=last, start=start, method=method):
            now = time.perf_counter()
            times.append(now - last[0])
            last[0] = now
            print(f"{method}: layer {idx} in {times[-1]:.1f} s ({now - start:.0f} s so far)", flush=True)
            if now - start > args.max_seconds and idx < args.layers - 1:
                raise _Enough

        stream = StreamConfig(device=args.device, dtype="bfloat16" if cuda else "float32", memory_limit=0)
        out = args.dir.parent / f"{args.dir.name}-{method}"
        shutil.rmtree(out.parent / f".{out.name}.quantmla-work", ignore_errors=True)  # an earlier run's
        try:
            calibrate_streamed(src, ids, out, stream=stream, progress=False, on_layer=done, method=method,
                               scheme="c4r4", steps=args.steps, num_seqs=args.num_seqs, val_seqs=args.val_seqs,
                               seq_len=args.seq_len, batch_size=4, model_steps=0)  # fmt: skip
            complete = True
        except _Enough:
            complete = False
        shutil.rmtree(out, ignore_errors=True)
        shutil.rmtree(out.parent / f".{out.name}.quantmla-work", ignore_errors=True)
        dense, moe = times[: args.dense], times[args.dense :]
        per_moe = sorted(moe)[len(moe) // 2] if moe else float("nan")
        per_dense = sorted(dense)[len(dense) // 2] if dense else per_moe
        row = {"method": method, "layer_seconds": times, "complete": complete, "dense_s": per_dense,
               "moe_s": per_moe, "v3_61_layers_min": (3 * per_dense + 58 * per_moe) / 60,
               "peak_gpu_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else 0.0,
               "host_peak_gib": host_peak() / 2**30, "card": torch.cuda.get_device_name() if cuda else "cpu",
               "experts": args.experts, "layers": args.layers, "wall_s": sum(times)}  # fmt: skip
        rows.append(row)
        print(json.dumps(row), flush=True)
    print("| method | seconds a layer (dense / MoE, first / later) | peak GPU GiB | host peak GiB | 61 layers, min |")
    print("|---|---|---|---|---|")
    for r in rows:
        secs = ", ".join(f"{t:.1f}" for t in r["layer_seconds"])
        print(f"| {r['method']} | {secs} | {r['peak_gpu_gib']:.1f} | {r['host_peak_gib']:.1f} |"
              f" {r['v3_61_layers_min']:.1f} |")  # fmt: skip
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
