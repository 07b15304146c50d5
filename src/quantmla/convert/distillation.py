"""Parameter-efficient distillation of a converted model: the frozen source as teacher, the KL of the next-token
distributions (plus cross-entropy, optionally), only the attention and the norms trained."""

from __future__ import annotations

import logging
import math
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from tqdm.auto import tqdm

logger = logging.getLogger(__name__)

#: which student parameters train: attention and RMSNorms (MLPs, experts, router, embeddings frozen), or all
TRAINABLE = ("attention", "all")


@dataclass(frozen=True)
class DistillConfig:
    steps: int = 300
    lr: float = 5e-4  # AdamW; linear warm-up, then cosine decay to 0
    warmup: int = 20
    ce_weight: float = 0.0  # loss = KL + ce_weight * cross-entropy on the next token
    trainable: str = "attention"
    clip: float = 1.0
    log_every: int = 10

    def __post_init__(self) -> None:
        if self.trainable not in TRAINABLE:
            raise ValueError(f"trainable={self.trainable!r}; valid: {', '.join(TRAINABLE)}")
        if self.steps < 0 or self.lr <= 0 or self.warmup < 0 or self.ce_weight < 0 or self.clip <= 0:
            raise ValueError(
                f"steps={self.steps}, lr={self.lr}, warmup={self.warmup}, ce_weight={self.ce_weight}, "
                f"clip={self.clip}: steps, warmup, ce_weight >= 0; lr, clip > 0"
            )
        if self.log_every < 1:
            raise ValueError(f"log_every={self.log_every} must be >= 1")


def trainable_names(model: nn.Module, which: str) -> list[str]:
    """The parameter names that train: with ``attention``, those of ``self_attn`` and of every RMSNorm."""
    names = [n for n, _ in model.named_parameters()]
    if which == "all":
        return names
    return [n for n in names if ".self_attn." in n or "norm" in n.rsplit(".", 2)[-2]]


def kl_per_token(teacher_logits: torch.Tensor, student_logits: torch.Tensor) -> torch.Tensor:
    """Mean KL(teacher || student) of the next-token distributions, in nats a token (float32)."""
    t = F.log_softmax(teacher_logits.float(), -1)
    s = F.log_softmax(student_logits.float(), -1)
    return (t.exp() * (t - s)).sum(-1).mean()


def distill(student: nn.Module, teacher: nn.Module, batches: Iterator[torch.Tensor], cfg: DistillConfig,
            progress: bool = True) -> list[dict]:  # fmt: skip
    """Train ``student``'s attention and norms in place on ``cfg.steps`` batches of token ids; returns the loss curve
    (``{"step", "kl", "ce", "lr", "tokens"}`` every ``log_every`` steps and at the last)."""
    names = set(trainable_names(student, cfg.trainable))
    params = []
    for n, p in student.named_parameters():
        p.requires_grad_(n in names)
        if n in names:
            params.append(p)
    for p in teacher.parameters():
        p.requires_grad_(False)
    logger.info("distillation: %d of %d parameter tensors train (%s), %d steps", len(params),
                len(list(student.parameters())), cfg.trainable, cfg.steps)  # fmt: skip
    opt = torch.optim.AdamW(params, lr=cfg.lr, betas=(0.9, 0.95), weight_decay=0.0)

    def lr_at(step: int) -> float:
        if step < cfg.warmup:
            return cfg.lr * (step + 1) / cfg.warmup
        frac = (step - cfg.warmup) / max(cfg.steps - cfg.warmup, 1)
        return cfg.lr * 0.5 * (1 + math.cos(math.pi * min(frac, 1.0)))

    device = next(student.parameters()).device
    curve: list[dict] = []
    tokens = 0
    student.train()
    teacher.eval()
    bar = tqdm(range(cfg.steps), desc="distillation", unit="step", disable=not progress)
    for step in bar:
        ids = next(batches).to(device)
        with torch.no_grad():
            t_logits = teacher(ids, use_cache=False).logits
        s_logits = student(ids, use_cache=False).logits
        kl = kl_per_token(t_logits, s_logits)
        ce = F.cross_entropy(s_logits[:, :-1].float().reshape(-1, s_logits.shape[-1]), ids[:, 1:].reshape(-1))
        loss = kl + cfg.ce_weight * ce if cfg.ce_weight else kl
        for group in opt.param_groups:
            group["lr"] = lr_at(step)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, cfg.clip)
        opt.step()
        tokens += ids.numel()
        if step % cfg.log_every == 0 or step == cfg.steps - 1:
            curve.append({"step": step, "kl": kl.item(), "ce": ce.item(), "lr": lr_at(step), "tokens": tokens})
            bar.set_postfix(kl=f"{kl.item():.4f}", ce=f"{ce.item():.3f}")
    student.eval()
    for p in student.parameters():
        p.requires_grad_(False)
    return curve
