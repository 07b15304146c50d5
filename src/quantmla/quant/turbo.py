"""TurboQuant-MSE (TQ-MSE), and Block-GTQ's grouping of it by bit width.

TQ-MSE quantises a vector ``x`` of ``d`` values in three steps: divide by its norm, rotate by a fixed random
orthogonal ``Q`` (Haar-distributed; after it every coordinate of a unit vector is close to ``N(0, 1/d)``),
and round each coordinate to the nearest centroid of the MSE-optimal (Lloyd-Max) scalar codebook of
``N(0, 1/d)`` at ``b`` bits. Reading back: the centroids ``y_hat``, rotated back, times the norm. As in
Block-GTQ's reference code the read-back is *norm-corrected*: ``y_hat`` is scaled to unit norm first, so a
token keeps its norm exactly (up to the stored fp16). Here the stored scalar is that corrected norm,
``||x|| / ||y_hat||``, one fp16 per group:

    codes = argmin_c |(x / ||x||) Q - c|,   x_hat = (||x|| / ||y_hat||) * y_hat Q^T,   y_hat = centroids[codes].

Block-GTQ gives each 2-D RoPE block its own width; channels of equal width form one group with its own
rotation (of that group's size), codebook and norm (its ``_post_allocation_setup``). A channel of width 0
stores nothing and reads as 0. Storage per token: the codes as one bit stream (``ceil(sum(bits) / 8)``
bytes, channel order) plus 2 bytes a group.

Departures, chosen here: the rotation of every group is a seeded Haar matrix (seed from the group's size
and width, the same for every token, layer and model: the reference seeds ``42 + width``), and every group
is rotated (the reference leaves groups below 3 bits unrotated, which TurboQuant itself does not); the norm
is fp16 (the reference keeps float32).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch

from quantmla.quant.affine import FP16_MAX

#: TQ-MSE widths (Lloyd's algorithm converges too slowly beyond 6 bits to compute the codebook on the fly;
#: at 7-8 bits the affine grid is as good as any)
TURBO_BITS = (1, 2, 3, 4, 5, 6)
_LLOYD_MAX_ITERATIONS = 1_000_000


@functools.cache
def lloyd_max_gaussian(bits: int) -> tuple[float, ...]:
    """The ``2**bits`` centroids (ascending) of the MSE-optimal scalar quantiser of ``N(0, 1)`` (Lloyd's
    algorithm from the companded start, closed-form conditional means, float64, to 1e-13)."""
    if bits not in TURBO_BITS:
        raise ValueError(f"TQ-MSE bits={bits!r}; valid: {TURBO_BITS}")
    n = 1 << bits
    normal = torch.distributions.Normal(torch.tensor(0.0, dtype=torch.float64), torch.tensor(1.0, dtype=torch.float64))
    # start from the asymptotically optimal (companded) quantiser: points density ~ pdf^(1/3), i.e. N(0, 3)
    start = math.sqrt(3) * normal.icdf((torch.arange(n, dtype=torch.float64) + 0.5) / n)
    edges = (start[:-1] + start[1:]) / 2
    inf = torch.tensor([math.inf], dtype=torch.float64)
    pdf = lambda t: torch.exp(-0.5 * t * t) / math.sqrt(2 * math.pi)  # noqa: E731  (0 at +-inf)
    centroids = torch.zeros(n, dtype=torch.float64)
    for _ in range(_LLOYD_MAX_ITERATIONS):
        lo, hi = torch.cat([-inf, edges]), torch.cat([edges, inf])
        new = (pdf(lo) - pdf(hi)) / (normal.cdf(hi) - normal.cdf(lo))  # E[X | lo < X < hi]
        done = bool((new - centroids).abs().max() < 1e-13)
        centroids, edges = new, (new[:-1] + new[1:]) / 2
        if done:
            break
    else:
        raise RuntimeError(f"Lloyd's algorithm did not converge at {bits} bits")
    return tuple(centroids.tolist())


@functools.lru_cache(maxsize=128)
def codebook(bits: int, dim: int, device=None, dtype=torch.float32) -> torch.Tensor:
    """Centroids of ``N(0, 1/dim)`` at ``bits`` bits: the Gaussian codebook scaled by ``1/sqrt(dim)`` (built
    once per device and dtype; read-only)."""
    return torch.tensor(lloyd_max_gaussian(bits), dtype=torch.float64).div(math.sqrt(dim)).to(device, dtype)


@functools.lru_cache(maxsize=128)
def rotation(dim: int, bits: int, device=None, dtype=torch.float32) -> torch.Tensor:
    """The fixed Haar-random orthogonal ``[dim, dim]`` of a group of ``dim`` channels at ``bits`` bits (drawn
    in float64 on the CPU, then built once per device and dtype; read-only)."""
    g = torch.Generator().manual_seed(0x7B50 + 1009 * dim + bits)
    q, r = torch.linalg.qr(torch.randn(dim, dim, generator=g, dtype=torch.float64))
    return (q * torch.sign(torch.diagonal(r))).to(device, dtype)


@functools.lru_cache(maxsize=128)
def width_groups(channel_bits: tuple[int, ...]) -> tuple[tuple[int, torch.Tensor], ...]:
    """``(width, channel indices)`` of each group of equal nonzero width, widths ascending (read-only)."""
    t = torch.tensor(channel_bits)
    return tuple((b, torch.nonzero(t == b).flatten()) for b in sorted({b for b in channel_bits if b}))


@dataclass(frozen=True)
class TurboQuantized:
    """Unpacked codes (uint8, ``x``'s shape; 0 in zero-width channels) and the fp16 corrected norm of each
    width group ``[..., groups]`` (groups in :func:`width_groups` order)."""

    codes: torch.Tensor
    norms: torch.Tensor
    channel_bits: tuple[int, ...]

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return dequantize_turbo(self.codes, self.norms, self.channel_bits, dtype)


def quantize_turbo(x: torch.Tensor, channel_bits: tuple[int, ...], check: bool = True) -> TurboQuantized:
    """TQ-MSE of each token of ``x [..., d]`` within each group of equal width of ``channel_bits``."""
    if len(channel_bits) != x.shape[-1]:
        raise ValueError(f"{len(channel_bits)} channel widths for a path of {x.shape[-1]} channels")
    if check and x.numel():
        if not bool(torch.isfinite(x).all()):
            raise ValueError("cannot quantise non-finite values (nan/inf) with TQ-MSE")
    wide = torch.promote_types(x.dtype, torch.float32)  # float32 math, float64 for a float64 input
    xf = x.to(wide)
    codes = torch.zeros(x.shape, dtype=torch.uint8, device=x.device)
    norms = []
    for b, idx in width_groups(channel_bits):
        idx = idx.to(x.device)
        d = idx.numel()
        v = xf[..., idx]
        norm = v.norm(dim=-1, keepdim=True)
        y = (v / torch.where(norm > 0, norm, 1.0)) @ rotation(d, b, x.device, wide)
        cb = codebook(b, d, x.device, wide)
        c = torch.searchsorted((cb[:-1] + cb[1:]) / 2, y.contiguous())
        y_hat = cb[c]
        corrected = norm / y_hat.norm(dim=-1, keepdim=True).clamp_min(1e-30)
        if check and bool((corrected > FP16_MAX).any()):
            raise ValueError(f"a group norm beyond fp16 ({FP16_MAX}) cannot be stored")
        codes[..., idx] = c.to(torch.uint8)
        norms.append(corrected.to(torch.float16))
    empty = torch.zeros(*x.shape[:-1], 0, dtype=torch.float16, device=x.device)
    return TurboQuantized(codes, torch.cat(norms, -1) if norms else empty, tuple(channel_bits))


def dequantize_turbo(codes: torch.Tensor, norms: torch.Tensor, channel_bits: tuple[int, ...],
                     dtype: torch.dtype = torch.float32) -> torch.Tensor:  # fmt: skip
    wide = torch.promote_types(dtype, torch.float32)
    out = torch.zeros(codes.shape, dtype=wide, device=codes.device)
    for g, (b, idx) in enumerate(width_groups(channel_bits)):
        idx = idx.to(codes.device)
        d = idx.numel()
        y_hat = codebook(b, d, codes.device, wide)[codes[..., idx].long()]
        out[..., idx] = norms[..., g : g + 1].to(wide) * (y_hat @ rotation(d, b, codes.device, wide).T)
    return out.to(dtype)
