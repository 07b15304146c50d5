"""Model-level stage of QuantMLA: pick and refine all layers' transforms against the model's output.

The layer objectives (:mod:`quantmla.calibrate.objectives`) see one layer with clean inputs; the
perplexity of the quantised model depends on how the errors of all layers compound. This stage
holds every layer's transform as parameters, applies them in the original basis with the quantiser
in the loop (straight-through estimator) and the cache exactly as decode sees it (the calibration's
sink and recent windows, :class:`~quantmla.measure.simulate.SimulatedDecodeCache`), and minimises the
KL divergence of the next-token distributions from the full-precision model's:

* the start is the candidate set with the lowest held-out KL: the layer-local QuantMLA transforms,
  the untouched model (``rtn``: the original-basis identity on every layer) and each baseline's
  transforms on every layer (each layer choosing, as the baseline does, between the baseline's
  transform and the original basis), so QuantMLA's held-out KL is never worse than RTN's or a
  baseline's;
* Adam on all layers' parameters jointly, best step on the held-out KL (step 0 counts and returns
  the start's transforms exactly). The content rotation's generator is a full ``d x d`` skew matrix:
  Adam moves each of its entries by about the learning rate, so one step whose gradient signs agree
  turns the rotation by about ``2 x rate x d`` radians. Its rate is therefore scaled by the width
  (``ModelLevelConfig.rotation_rate``); at the base rate a step at ``d = 256`` turned the rotation
  far enough to take the held-out KL from 7.9e-3 to 4.4 in ten steps (bundled model v3, C2R4).

The model's weights stay frozen; the result is fused like any other transform.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from tqdm.auto import tqdm

from quantmla.calibrate.methods import ContentParam, RopeParam
from quantmla.calibrate.objectives import quantize_content, quantize_rope
from quantmla.formats.scheme import CacheScheme
from quantmla.measure.simulate import SimulatedDecodeCache, installed
from quantmla.models.latent import module_state
from quantmla.transforms.fuse import ContentTransform, RopeTransform

OBJECTIVES = ("kl", "ce")
#: the width-scaled rotation rate is ``lr * ROTATION_WIDTH / d``: one coherent step turns the rotation by
#: about ``2 * lr * ROTATION_WIDTH`` radians at any width (lr / 64 at the bundled model's d = 256)
ROTATION_WIDTH = 4


@dataclass(frozen=True)
class ModelLevelConfig:
    steps: int = 100
    lr: float = 1e-3  # Adam, cosine decay to 0
    batch_size: int = 4
    eval_every: int = 10
    objective: str = "kl"  # kl: from the full-precision model's next-token distribution; ce: next-token loss
    #: Adam's rate for the content rotation's generator (None: ``lr * ROTATION_WIDTH / d``, width-scaled)
    rotation_lr: float | None = None

    def __post_init__(self) -> None:
        if self.objective not in OBJECTIVES:
            raise ValueError(f"model-level objective={self.objective!r}; valid: {', '.join(OBJECTIVES)}")
        if self.rotation_lr is not None and not self.rotation_lr > 0:
            raise ValueError(f"model-level rotation_lr={self.rotation_lr} must be > 0 (or None: width-scaled)")
        if self.steps < 0 or self.lr <= 0 or self.batch_size < 1 or self.eval_every < 1:
            raise ValueError(
                f"model-level steps={self.steps} (>= 0), lr={self.lr} (> 0), batch_size={self.batch_size} (>= 1), "
                f"eval_every={self.eval_every} (>= 1) out of range"
            )

    def rotation_rate(self, width: int) -> float:
        """Adam's rate for the generator of a ``width x width`` content rotation."""
        return self.rotation_lr if self.rotation_lr is not None else self.lr * ROTATION_WIDTH / width


class LayerPaths(nn.Module):
    """One attention module's content and RoPE transforms as parameters, applied in the original basis."""

    def __init__(self, content: ContentTransform, rope: RopeTransform, gain: torch.Tensor, pairs: torch.Tensor):
        super().__init__()
        self.content = ContentParam(content.rotation.double(), content.scales.double())
        self.rope = RopeParam(pairs.shape[0], pairs)
        self.register_buffer("gain", gain.double())
        self.set_(content, rope)

    def set_(self, content: ContentTransform, rope: RopeTransform) -> None:
        self.content.set_(content)
        self.rope.set_(rope)

    def transforms(self) -> tuple[ContentTransform, RopeTransform]:
        return self.content.transform(), self.rope.snapshot()

    def quantize(self, latent, rope_key, scheme: CacheScheme, group_size: int):
        c_hat = quantize_content(latent, self.gain, self.content.rotation(), self.content.scales(), scheme.content,
                                 group_size)  # fmt: skip
        t, pairs = self.rope.transform(), self.rope.pair_index
        k_hat = quantize_rope(rope_key, t.matrix(pairs), t.inverse_matrix(pairs), scheme.rope, group_size)
        return c_hat, k_hat


@dataclass(frozen=True, eq=False)
class TransformedDecodeCache(SimulatedDecodeCache):
    """The decode-cache simulation with one layer's learnable transforms around the quantiser."""

    paths: LayerPaths | None = None

    def quantize(self, latent, rope_key):
        s = self.sink
        if not s or (self.scheme.content.page is None and self.scheme.rope.page is None):
            return self.paths.quantize(latent, rope_key, self.scheme, self.group_size)
        # a paged path's pages start after the sinks, as in the cache; a paged scheme reads the sinks as computed
        c_mid, k_mid = self.paths.quantize(latent[..., s:, :], rope_key[..., s:, :], self.scheme, self.group_size)
        return torch.cat([latent[..., :s, :], c_mid], -2), torch.cat([rope_key[..., :s, :], k_mid], -2)


class InstalledPaths:
    """Each module attends through its layer's :class:`TransformedDecodeCache` while entered (re-enterable)."""

    def __init__(self, modules, layers: dict[int, LayerPaths], scheme, group_size, sink, recent) -> None:
        self.states = [module_state(attn) for _, attn in modules]
        if any(s is None for s in self.states):
            raise ValueError("latent attention is not enabled on every attention module; call enable_latent_attention")
        self.sims = [TransformedDecodeCache(scheme, group_size, sink, recent, paths=layers[idx]) for idx, _ in modules]
        self._ctx = None

    def __enter__(self):
        self._ctx = installed(self.states, self.sims)
        self._ctx.__enter__()

    def __exit__(self, *exc):
        return self._ctx.__exit__(*exc)


def model_loss(model, x: torch.Tensor, install: InstalledPaths, objective: str) -> torch.Tensor:
    """Per-token mean of KL(p_full || p_quantised) (``kl``) or of the next-token loss (``ce``) over ``x``."""
    with install:
        out = torch.log_softmax(model(x, use_cache=False).logits.float(), -1)
    if objective == "ce":
        return torch.nn.functional.nll_loss(out[:, :-1].flatten(0, 1), x[:, 1:].flatten())
    with torch.no_grad():
        ref = torch.log_softmax(model(x, use_cache=False).logits.float(), -1)
    return torch.nn.functional.kl_div(out.flatten(0, 1), ref.flatten(0, 1), log_target=True, reduction="batchmean")


def mean_model_loss(model, windows, install, cfg: ModelLevelConfig, device) -> float:
    """The model-level objective (``cfg.objective``) per token over ``windows``, without gradients."""
    with torch.no_grad():
        parts = [
            float(model_loss(model, w.to(device), install, cfg.objective)) * len(w)
            for w in torch.split(windows, cfg.batch_size)
        ]
    return sum(parts) / len(windows)


def optimizer(layers: dict[int, LayerPaths], trainable: tuple[str, ...], cfg: ModelLevelConfig):
    """Adam over the trainable paths: the content rotations' generators at :meth:`ModelLevelConfig.rotation_rate`
    of their width, every other parameter (content scales, RoPE angles and scales) at ``cfg.lr``."""
    groups: dict[tuple[str, float], list[nn.Parameter]] = {}
    for lp in layers.values():
        for path in trainable:
            for name, p in getattr(lp, path).named_parameters():
                rotation = path == "content" and name == "skew"
                key = ("rotation", cfg.rotation_rate(p.shape[0])) if rotation else ("other", cfg.lr)
                groups.setdefault(key, []).append(p)
    return torch.optim.Adam([{"params": ps, "lr": lr, "name": name} for (name, lr), ps in groups.items()])


def refine(
    model: nn.Module,
    modules: list[tuple[int, nn.Module]],
    starts: dict[str, dict[int, tuple[ContentTransform, RopeTransform]]],
    gains: dict[int, torch.Tensor],
    pairs: dict[int, torch.Tensor],
    train_w: torch.Tensor,
    val_w: torch.Tensor,
    scheme: CacheScheme,
    group_size: int,
    sink: int,
    recent: int,
    cfg: ModelLevelConfig,
    trainable: tuple[str, ...] = ("content", "rope"),
    progress: bool = True,
) -> tuple[dict[int, tuple[ContentTransform, RopeTransform]], dict]:
    """Best start by the held-out objective, then joint Adam on every layer's transforms.

    Returns the best step's transforms per cache index and a report.

    ``trainable``: the paths whose parameters learn (the others keep their start).
    """
    if not starts:
        raise ValueError("refine needs at least one start")
    bad = [t for t in trainable if t not in ("content", "rope")]
    if bad:
        raise ValueError(f"trainable paths {bad}; valid: ('content', 'rope')")
    device = next(model.parameters()).device
    first = next(iter(starts.values()))
    layers = {idx: LayerPaths(*first[idx], gains[idx], pairs[idx]).to(device) for idx, _ in modules}
    install = InstalledPaths(modules, layers, scheme, group_size, sink, recent)
    frozen = [p for p in model.parameters() if p.requires_grad]
    for p in frozen:
        p.requires_grad_(False)
    try:
        start_loss = {}
        for name, start in starts.items():
            for idx, lp in layers.items():
                lp.set_(*start[idx])
            start_loss[name] = mean_model_loss(model, val_w, install, cfg, device)
        init = min(start_loss, key=start_loss.get)
        for idx, lp in layers.items():
            lp.set_(*starts[init][idx])
        opt = optimizer(layers, trainable, cfg)
        sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, max(cfg.steps, 1))
        snap = lambda: {idx: lp.transforms() for idx, lp in layers.items()}  # noqa: E731
        best = (start_loss[init], 0, dict(starts[init]))  # step 0: the start itself, exactly
        history = [(0, start_loss[init])]
        g = torch.Generator().manual_seed(0)
        bar = tqdm(range(1, cfg.steps + 1), desc=f"model-level {cfg.objective}", unit="step", disable=not progress)
        for step in bar:
            pick = torch.randint(0, len(train_w), (cfg.batch_size,), generator=g)
            loss = model_loss(model, train_w[pick].to(device), install, cfg.objective)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
            if step % cfg.eval_every == 0 or step == cfg.steps:
                v = mean_model_loss(model, val_w, install, cfg, device)
                history.append((step, v))
                bar.set_postfix(val=f"{v:.3e}", best=f"{best[0]:.3e}")
                if v < best[0]:
                    best = (v, step, snap())
    finally:
        for p in frozen:
            p.requires_grad_(True)
    report = {
        "objective": cfg.objective,
        "start_val": start_loss,
        "init": init,
        "val_after": best[0],
        "best_step": best[1],
        "history": history,
        "sink": sink,
        "recent": recent,
        "rotation_lr": next((g["initial_lr"] for g in opt.param_groups if g["name"] == "rotation"), None),
    }
    return best[2], report
