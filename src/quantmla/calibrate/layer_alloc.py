"""Bits across layers: Block-GTQ's greedy allocation by marginal gain, applied to whole layers' formats.

The layers of a model do not suffer alike from the same cache error: on the bundled model, one layer's INT2
latent costs more held-out KL than four others together. So at a budget of bits per element, the combined
method ``raq-alloc`` gives each layer its own formats from a small menu around the budget's scheme
(:func:`layer_menu`) and spends the bits where the model-level error falls most per byte:

* each layer's options are its (content, RoPE key) format pairs, with RAQ-MLA's write-side transform fitted for
  each format (:mod:`quantmla.calibrate.related`);
* start: every layer at its cheapest option; a layer's gain for an option is the fall of the held-out KL
  (the model's next-token distributions with the quantised cache, sink and recent windows included, against
  full precision) when that layer alone takes the option;
* :func:`greedy`: repeatedly the move of one layer to a dearer option with the largest gain per byte, while the
  mean bytes per token stay within the budget's (gains taken as additive across layers, as Block-GTQ takes its
  blocks' errors).

The result's bits per element never exceed the budget scheme's.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import replace

import torch
from tqdm.auto import tqdm

from quantmla.formats.codec import LayerCodec, ModelCodec
from quantmla.formats.scheme import QUANT_BITS, CacheScheme, PathFormat, parse_scheme
from quantmla.measure.simulate import simulated_decode

#: the menu's group for the latent's cheaper and wider options
MENU_GROUP = 128


def _affine(fmt: PathFormat) -> bool:
    """An integer path of one width in per-token groups or pages (the formats whose widths the menu varies)."""
    return fmt.kind == "int" and not fmt.turbo and fmt.channel_bits is None


def layer_menu(scheme: str | CacheScheme) -> tuple[list[PathFormat], list[PathFormat]]:
    """The formats a layer may take at ``scheme``'s budget: ``(content, rope)``.

    Content: the scheme's own, the same width in groups of 128 (cheaper when its groups are smaller) and the next
    width in groups of 128, clipping as the scheme's. RoPE key: the scheme's own and one bit narrower in the same
    layout. A path that is not an affine integer one keeps its format alone.
    """
    s = parse_scheme(scheme)
    c, r = s.content, s.rope
    content = [c]
    if _affine(c) and c.page is None:
        content.append(replace(c, group=MENU_GROUP))
        wider = [b for b in QUANT_BITS if b > c.bits]
        if wider:
            content.append(replace(c, bits=wider[0], group=MENU_GROUP))
    rope = [r]
    narrower = [b for b in QUANT_BITS if b < r.bits]
    if _affine(r) and narrower:
        rope.append(replace(r, bits=narrower[-1]))
    return list({f.spec: f for f in content}.values()), list({f.spec: f for f in rope}.values())


def menu_options(content: list[PathFormat], rope: list[PathFormat], kv_lora_rank: int, rope_dim: int,
                 group_size: int) -> list[tuple[float, PathFormat, PathFormat]]:  # fmt: skip
    """Every ``(bytes per token, content, rope)`` pair of the menu, cheapest first."""
    opts = [(c.bytes_per_token(kv_lora_rank, group_size) + r.bytes_per_token(rope_dim, group_size), c, r)
            for c, r in itertools.product(content, rope)]  # fmt: skip
    return sorted(opts, key=lambda o: (o[0], o[1].spec, o[2].spec))


def greedy(costs: list[list[float]], gains: list[list[float]], budget: float) -> list[int]:
    """Per layer the option index: every layer starts at option 0 (its cheapest), then the move of one layer
    from its option ``c`` to a dearer ``j`` with the largest ``(gains[i][j] - gains[i][c]) / (costs[i][j] -
    costs[i][c])`` (a move at no extra cost first) is taken while ``sum of costs <= budget``; only moves that
    gain. ``costs[i]`` ascending, ``gains[i][0] == 0``."""
    if len(costs) != len(gains) or any(len(c) != len(g) for c, g in zip(costs, gains, strict=True)):
        raise ValueError("costs and gains need one list per layer of the same length")
    for c in costs:
        if any(b < a for a, b in itertools.pairwise(c)):
            raise ValueError(f"a layer's option costs must ascend, got {c}")
    choice = [0] * len(costs)
    total = sum(c[0] for c in costs)
    if total > budget * (1 + 1e-12):
        raise ValueError(f"the cheapest options cost {total:g}, over the budget {budget:g}")
    while True:
        best = None
        for i, (c, g) in enumerate(zip(costs, gains, strict=True)):
            k = choice[i]
            for j in range(k + 1, len(c)):
                extra, gain = c[j] - c[k], g[j] - g[k]
                if gain <= 0 or total + extra > budget * (1 + 1e-12):
                    continue
                rate = math.inf if extra <= 0 else gain / extra
                if best is None or (rate, gain) > (best[0], best[1]):
                    best = (rate, gain, i, j, extra)
        if best is None:
            return choice
        _, _, i, j, extra = best
        choice[i], total = j, total + extra


@torch.no_grad()
def held_out_kl(model, windows: torch.Tensor, codec: ModelCodec, group_size: int, sink: int, recent: int,
                batch_size: int) -> float:  # fmt: skip
    """Mean KL per predicted token of the next-token distributions with ``codec``'s cache (as decode sees it)
    from the full-precision ones, over ``windows``."""
    device = next(model.parameters()).device
    total = count = 0.0
    for x in torch.split(windows, batch_size):
        x = x.to(device)
        ref = torch.log_softmax(model(x, use_cache=False).logits.float()[:, :-1], -1)
        with simulated_decode(model, codec, group_size, sink, recent):
            out = torch.log_softmax(model(x, use_cache=False).logits.float()[:, :-1], -1)
        total += float(torch.nn.functional.kl_div(out, ref, log_target=True, reduction="sum"))
        count += ref.shape[0] * ref.shape[1]
    return total / count


def allocate(model, options: list[list[tuple[float, LayerCodec]]], budget: float, windows: torch.Tensor,
             group_size: int, sink: int, recent: int, batch_size: int, name: str,
             progress: bool = True) -> tuple[ModelCodec, dict]:  # fmt: skip
    """The codec of :func:`greedy` over ``options`` (per layer: ``(bytes per token, layer codec)``, cheapest
    first) within ``budget`` bytes per token (mean over layers), the gains measured by :func:`held_out_kl` on
    ``windows``; and its report (every measured KL, the choice)."""

    def codec(choice: list[int]) -> ModelCodec:
        return ModelCodec(name, tuple(opts[k][1] for opts, k in zip(options, choice, strict=True)))

    start = [0] * len(options)
    kl = {"start": held_out_kl(model, windows, codec(start), group_size, sink, recent, batch_size)}
    gains = []
    todo = [(i, j) for i, opts in enumerate(options) for j in range(1, len(opts))]
    bar = tqdm(total=len(todo), desc=f"allocate {name}", unit="option", disable=not progress)
    for i, opts in enumerate(options):
        row = [0.0]
        for j in range(1, len(opts)):
            trial = list(start)
            trial[i] = j
            v = held_out_kl(model, windows, codec(trial), group_size, sink, recent, batch_size)
            kl[f"{i}:{opts[j][1].scheme.name}"] = v
            row.append(kl["start"] - v)
            bar.update()
        gains.append(row)
    bar.close()
    costs = [[o[0] for o in opts] for opts in options]
    choice = greedy(costs, gains, budget * len(options))
    chosen = codec(choice)
    report = {
        "budget_bytes_per_token": budget,
        "bytes_per_token": sum(c[k] for c, k in zip(costs, choice, strict=True)) / len(options),
        "held_out_kl": kl,
        "windows": list(windows.shape),
        "schemes": [lc.scheme.name for lc in chosen.layers],
    }
    return chosen, report
