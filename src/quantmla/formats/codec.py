"""Per-layer cache codecs: each layer's storage format plus what a calibration method fitted for its cache.

Most methods change only the weights (their transforms are fused offline) and store every layer in one
scheme. Three things of the related methods do not fit that, and live here, per layer and path:

* **a per-layer format** (Block-GTQ gives each layer its own widths per RoPE pair);
* **a write-side transform** ``A`` that cannot be fused into the weights (RAQ-MLA: a general invertible
  ``A_c`` after the norm, ``A_R`` after RoPE): the path stores ``Q(x A)``; the read side compensates, so at
  full precision every score and output is unchanged: ``A_c^-1`` fused into ``W_UK`` and ``W_UV`` (as
  ``W A^-T``), the RoPE query multiplied by ``A_R^-T``;
* **learned ranges** (RoLaQ): a threshold ratio and reconstruction gain per group, used when a token is
  written (:mod:`~quantmla.quant.ranged`); the stored format is the plain affine one.

A :class:`ModelCodec` is one :class:`LayerCodec` per cache layer and a name; a plain scheme is the codec with
that scheme on every layer and nothing fitted (:meth:`ModelCodec.uniform`).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from quantmla.formats.scheme import CacheScheme, PathFormat, parse_scheme
from quantmla.quant.ranged import check_ranges, quantize_ranged

#: the largest condition number a write-side transform may have (its inverse is applied on the read side)
MAX_CONDITION = 1e6


@dataclass(frozen=True, eq=False)
class PathCodec:
    """One path of one layer: its format, an optional write-side transform ``[d, d]`` (stores ``Q(x A)``) and
    optional learned ranges (``clip_ratio``, ``gain``: one per group of an affine per-token format)."""

    fmt: PathFormat
    transform: torch.Tensor | None = None
    clip_ratio: torch.Tensor | None = None
    gain: torch.Tensor | None = None

    def __post_init__(self) -> None:
        if self.transform is not None:
            a = self.transform
            if a.dim() != 2 or a.shape[0] != a.shape[1] or not bool(torch.isfinite(a).all()):
                raise ValueError(f"a write-side transform must be a finite square matrix, got {tuple(a.shape)}")
            cond = float(torch.linalg.cond(a.double()))
            if not cond < MAX_CONDITION:
                raise ValueError(f"write-side transform has condition number {cond:.3g} (at most {MAX_CONDITION:g})")
        if (self.clip_ratio is None) != (self.gain is None):
            raise ValueError("learned ranges need both threshold ratios and gains")
        f = self.fmt
        plain_affine = f.kind == "int" and not f.turbo and f.channel_bits is None and f.page is None and f.clip is None
        if self.clip_ratio is not None and not plain_affine:
            raise ValueError(f"learned ranges apply to plain affine per-token groups, not {self.fmt.spec!r}")

    @property
    def fitted(self) -> bool:
        """Whether anything beyond the format is stored for this path."""
        return self.transform is not None or self.clip_ratio is not None

    @functools.cached_property
    def inverse(self) -> torch.Tensor | None:
        """``A^-1`` in float64 (``None`` without a transform)."""
        return None if self.transform is None else torch.linalg.inv(self.transform.double())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x A`` (the stored space; ``x`` itself without a transform)."""
        return x if self.transform is None else x @ self.transform.to(x.device, x.dtype)

    def backward(self, y: torch.Tensor) -> torch.Tensor:
        """``y A^-1`` (back from the stored space)."""
        return y if self.transform is None else y @ self.inverse.to(y.device, y.dtype)

    def compensate(self, w: torch.Tensor) -> torch.Tensor:
        """``w A^-T`` for a read-side matrix ``w [..., d]`` that multiplies the path (``W_UK``, ``W_UV``, the
        RoPE query): ``(w A^-T) . (x A) = w . x``."""
        return w if self.transform is None else w @ self.inverse.T.to(w.device, w.dtype)

    def stored(self, y: torch.Tensor, group_size: int) -> torch.Tensor:
        """``y`` (already in the stored space) quantised and read back, in ``y``'s dtype."""
        if self.clip_ratio is not None:
            g = self.fmt.group_size(group_size)
            return quantize_ranged(y, self.fmt.bits, g, self.clip_ratio, self.gain, check=False).dequantize(y.dtype)
        return self.fmt.fake_quantize(y, group_size)

    def check(self, dim: int, group_size: int) -> None:
        if self.transform is not None and self.transform.shape[0] != dim:
            raise ValueError(f"write-side transform {tuple(self.transform.shape)} for a path of {dim} channels")
        if self.clip_ratio is not None:
            check_ranges(self.clip_ratio, self.gain, dim // self.fmt.group_size(group_size))


@dataclass(frozen=True, eq=False)
class LayerCodec:
    content: PathCodec
    rope: PathCodec

    @property
    def scheme(self) -> CacheScheme:
        c, r = self.content.fmt, self.rope.fmt
        if not c.quantized and not r.quantized:
            return parse_scheme("bf16")
        if c.kind == "fp8" and not r.quantized:
            return parse_scheme("fp8")
        return CacheScheme(f"c{c.spec}r{r.spec}", c, r)

    @property
    def fitted(self) -> bool:
        return self.content.fitted or self.rope.fitted

    @classmethod
    def of(cls, scheme: str | CacheScheme) -> LayerCodec:
        s = parse_scheme(scheme)
        return cls(PathCodec(s.content), PathCodec(s.rope))


@dataclass(frozen=True, eq=False)
class ModelCodec:
    """One codec per cache layer; ``name`` labels it in tables (a plain scheme's name, or method and scheme)."""

    name: str
    layers: tuple[LayerCodec, ...]

    def __post_init__(self) -> None:
        if not self.layers:
            raise ValueError("a model codec needs at least one layer")

    @classmethod
    def uniform(cls, scheme: str | CacheScheme, num_layers: int) -> ModelCodec:
        s = parse_scheme(scheme)
        return cls(s.name, (LayerCodec.of(s),) * num_layers)

    @property
    def quantized(self) -> bool:
        return any(lc.scheme.quantized for lc in self.layers)

    @property
    def plain(self) -> CacheScheme | None:
        """The one scheme of every layer when nothing is fitted (a plain scheme), else ``None``."""
        first = self.layers[0].scheme
        same = all(lc.scheme.name == first.name and not lc.fitted for lc in self.layers)
        return first if same else None

    def bytes_per_token(self, kv_lora_rank: int, rope_dim: int, group_size: int = 64) -> float:
        """Persistent bytes of one quantised token, averaged over the layers."""
        per = [lc.scheme.bytes_per_token(kv_lora_rank, rope_dim, group_size) for lc in self.layers]
        return sum(per) / len(per)

    def bits_per_element(self, kv_lora_rank: int, rope_dim: int, group_size: int = 64) -> float:
        """Effective bits per cached element (BPE), metadata included, averaged over the layers."""
        return 8 * self.bytes_per_token(kv_lora_rank, rope_dim, group_size) / (kv_lora_rank + rope_dim)

    def check(self, num_layers: int, kv_lora_rank: int, rope_dim: int, group_size: int) -> None:
        if len(self.layers) != num_layers:
            raise ValueError(f"codec {self.name!r} has {len(self.layers)} layers; the model has {num_layers}")
        for lc in self.layers:
            lc.content.check(kv_lora_rank, group_size)
            lc.rope.check(rope_dim, group_size)


def model_codec(scheme: str | CacheScheme | ModelCodec, num_layers: int) -> ModelCodec:
    """``scheme`` as a :class:`ModelCodec` of ``num_layers`` layers (a codec is returned as it is)."""
    if isinstance(scheme, ModelCodec):
        if len(scheme.layers) != num_layers:
            raise ValueError(f"codec {scheme.name!r} has {len(scheme.layers)} layers; the model has {num_layers}")
        return scheme
    return ModelCodec.uniform(scheme, num_layers)


def scheme_name(scheme: str | CacheScheme | ModelCodec) -> str:
    """The label of a scheme or codec (a scheme's canonical name; a codec's ``name``)."""
    return scheme.name if isinstance(scheme, ModelCodec) else parse_scheme(scheme).name


def is_quantized(scheme: str | CacheScheme | ModelCodec) -> bool:
    return scheme.quantized if isinstance(scheme, ModelCodec) else parse_scheme(scheme).quantized
