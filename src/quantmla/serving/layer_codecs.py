"""A calibrated export's per-layer cache codec in an engine's pages: what each layer writes and how it is read.

A calibration method may fit more than transforms fused into the weights (:mod:`quantmla.formats.codec`): a
write-side transform per path (RAQ-MLA's ``A_c`` after the latent's norm, ``A_R`` after RoPE), learned ranges
(RoLaQ) and a format per layer (Block-GTQ, RAQ-MLA's allocation). In an engine they are served exactly as
:class:`~quantmla.cache.QuantizedLatentCache` holds them:

* **write**: a layer stores ``Q(c A_c)`` and ``Q(k^R A_R)`` in its own format, with its learned ranges; its window
  shadows hold ``c A_c`` and ``k^R A_R`` unquantised (the same space, so one softmax reads both);
* **read**: the absorbed query ``q_lat`` is multiplied by ``A_c^-T`` and the RoPE query by ``A_R^-T`` (``(q A^-T) .
  (x A) = q . x``), and the attention output in the latent space by ``A_c^-1``: exact at full precision;
* **pages**: every layer's record is padded to the largest, since the engine pages every layer alike;
* **RoPE channel order**: an engine may hold the RoPE key in another channel order than quantmla's calibration
  (vLLM pairs channels ``(2i, 2i+1)``, transformers' DeepSeek-V3 cache ``(i, i + d/2)``); the key and its query are
  put in the calibration's order first, so groups, mixed widths, TQ-MSE and the transform see the channels they
  were fitted on.

A format that is not per token (``p<P>``: per channel within pages) has no record and is refused.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from quantmla.formats.codec import LayerCodec, ModelCodec, PathCodec
from quantmla.formats.records import RecordLayout
from quantmla.kernels.layout import has_kernel


@dataclass(frozen=True, eq=False)
class ServedLayer:
    """One cache layer in an engine: its record layout (padded to the engine's record) and its fitted codec
    (``None``: the plain scheme, nothing fitted)."""

    layout: RecordLayout
    codec: LayerCodec | None = None
    #: the RoPE channels in the calibration's order: ``k_cal = k_engine[..., rope_order]`` (``None``: the same)
    rope_order: tuple[int, ...] | None = None
    #: ``rope_order`` and its inverse as index tensors, per device (made once: a read or write copies nothing
    #: from the host, so CUDA graphs can capture it)
    _indices: dict = field(default_factory=dict, init=False, compare=False, repr=False)

    def to(self, device: torch.device | str) -> ServedLayer:
        """This layer with its codec's tensors on ``device``, their inverses and the RoPE order's index tensors
        made there now (an engine's steps then copy nothing from the host)."""

        def move(p: PathCodec) -> PathCodec:
            t = [None if x is None else x.to(device) for x in (p.transform, p.clip_ratio, p.gain)]
            return PathCodec(p.fmt, *t)

        codec = None if self.codec is None else LayerCodec(move(self.codec.content), move(self.codec.rope))
        out = ServedLayer(self.layout, codec, self.rope_order)
        if codec is not None:
            for p in (codec.content, codec.rope):
                _ = p.inverse  # computed on the device now, not in a step
        if self.rope_order is not None:
            for inverse in (False, True):
                out._index(torch.device(device), inverse)
        return out

    def _index(self, device: torch.device, inverse: bool = False) -> torch.Tensor:
        key = (str(device), inverse)
        if key not in self._indices:
            order = torch.tensor(self.rope_order, device=device)
            self._indices[key] = torch.argsort(order) if inverse else order
        return self._indices[key]

    @property
    def ranges(self):
        """Learned ranges ``(content, rope)`` for :meth:`RecordLayout.write_pages` (``None`` without)."""
        if self.codec is None:
            return None
        out = tuple(None if p.clip_ratio is None else (p.clip_ratio, p.gain) for p in (self.codec.content,
                                                                                      self.codec.rope))  # fmt: skip
        return None if out == (None, None) else out

    @property
    def transformed(self) -> bool:
        """Whether a path is stored through a write-side transform (the reads compensate it)."""
        return self.codec is not None and any(p.transform is not None for p in (self.codec.content, self.codec.rope))

    def _order(self, x: torch.Tensor) -> torch.Tensor:
        if self.rope_order is None:
            return x
        return x[..., self._index(x.device)]

    def stored_space(self, c: torch.Tensor, r: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The new tokens as the layer stores them: ``(c A_c, k^R A_R)`` (float32; the key in the calibration's
        channel order), or as they are."""
        r = self._order(r)
        if not self.transformed:
            return c, r
        path_c, path_r = self.codec.content, self.codec.rope
        return path_c.forward(c.float()), path_r.forward(r.float())

    def from_stored(self, c: torch.Tensor, r: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Tokens read back in the layer's stored space as the engine's model uses them: ``(c A_c^-1, k^R A_R^-1)``,
        the key in the engine's channel order (the inverse of :meth:`stored_space`; float32 where transformed).
        A prefill reads its context this way."""
        if self.transformed:
            c, r = self.codec.content.backward(c.float()), self.codec.rope.backward(r.float())
        if self.rope_order is not None:
            r = r[..., self._index(r.device, inverse=True)]
        return c, r

    def queries(self, q_lat: torch.Tensor, q_pe: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The absorbed query and the RoPE query in the stored space: ``q_lat A_c^-T``, ``q_pe A_R^-T`` (the RoPE
        query in the calibration's channel order, as its key)."""
        q_pe = self._order(q_pe)
        if not self.transformed:
            return q_lat, q_pe
        return self.codec.content.compensate(q_lat.float()), self.codec.rope.compensate(q_pe.float())

    def output(self, o_lat: torch.Tensor) -> torch.Tensor:
        """The attention output back from the stored space: ``o A_c^-1`` (in ``o_lat``'s dtype)."""
        if self.codec is None or self.codec.content.transform is None:
            return o_lat
        return self.codec.content.backward(o_lat.float()).to(o_lat.dtype)


def runs_kernels(layer: ServedLayer) -> bool:
    """Whether a layer is written, decoded and gathered by the Triton kernels (:mod:`quantmla.kernels`): a kernel
    format (``bf16``, ``c4r4``, ``c2r4`` in plain per-token groups) without learned ranges (those are written by the
    torch quantiser, which checks them on the host). Its transforms and RoPE order are device matmuls and gathers
    around the kernels."""
    return has_kernel(layer.layout) and layer.ranges is None


def interleaved_to_rotate_half(dim: int) -> tuple[int, ...]:
    """``rope_order`` from an engine's interleaved pairs ``(2i, 2i+1)`` to a rotate-half cache ``(i, i + d/2)``."""
    return (*range(0, dim, 2), *range(1, dim, 2))


def served_layers(codec: ModelCodec, kv_lora_rank: int, rope_dim: int, group_size: int,
                  rope_order: tuple[int, ...] | None = None) -> list[ServedLayer]:  # fmt: skip
    """Each cache layer of ``codec`` as an engine serves it, records padded to the largest layer's (``rope_order``:
    see :class:`ServedLayer`). A layer whose format has no per-token record is one ``ValueError`` naming it."""
    plain = []
    for i, lc in enumerate(codec.layers):
        try:
            plain.append(RecordLayout(lc.scheme.name, kv_lora_rank, rope_dim, group_size))
        except ValueError as e:
            raise ValueError(f"codec {codec.name!r}, layer {i} ({lc.scheme.name}): {e}; an engine's pages hold"
                             " per-token formats only") from None  # fmt: skip
    pad = max(lay.record_bytes for lay in plain)
    return [
        ServedLayer(
            RecordLayout(lay.scheme, kv_lora_rank, rope_dim, group_size, pad_to=pad),
            lc if lc.fitted else None,
            rope_order,
        )  # fmt: skip
        for lay, lc in zip(plain, codec.layers, strict=True)
    ]
