"""Helpers of the float64 exactness tests of the codec methods: a codec's transforms with nothing quantised keep
the model's logits within 1e-9."""

import torch

from quantmla.formats.codec import LayerCodec, ModelCodec, PathCodec
from quantmla.formats.scheme import parse_scheme
from quantmla.measure.simulate import simulated_decode


def float64_norms(model) -> None:
    """transformers' RMSNorm computes in float32; here in float64, as the bar is 1e-9."""
    for mod in model.modules():
        if type(mod).__name__.endswith("RMSNorm"):
            mod.forward = lambda x, m=mod: m.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True)
                                                                       + m.variance_epsilon))  # fmt: skip


def unquantised(codec: ModelCodec) -> ModelCodec:
    """``codec``'s write-side transforms with nothing quantised (bf16 formats; learned ranges need none)."""
    bf16 = parse_scheme("bf16")
    return ModelCodec("unquantised", tuple(
        LayerCodec(PathCodec(bf16.content, lc.content.transform), PathCodec(bf16.rope, lc.rope.transform))
        for lc in codec.layers))  # fmt: skip


@torch.no_grad()
def unquantised_logit_gap(model, codec: ModelCodec, probe: torch.Tensor, reference=None) -> float:
    """Largest |logit| difference between ``reference`` (default: ``model``) as it is and ``model`` with
    ``codec``'s transforms and nothing quantised (no sink/recent window)."""
    want = (reference or model)(probe, use_cache=False).logits
    with simulated_decode(model, unquantised(codec), sink=0, recent=0):
        got = model(probe, use_cache=False).logits
    return (got - want).abs().max().item()
