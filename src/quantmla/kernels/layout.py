"""Paged storage of the quantised MLA cache for the decode kernels, and its write path.

Pages hold ``page_size`` tokens of one sequence; a block table maps each sequence's logical pages
to physical ones. Per page and token the fields are stored as separate arrays (struct of arrays):

* content codes ``[pages, page_size, d_c * bits / 8]`` uint8 (or the BF16 latent itself),
* content scale and minimum ``[pages, page_size, d_c / group]`` fp16,
* RoPE codes ``[pages, page_size, d_r * bits / 8]`` uint8 (or BF16), scale and minimum fp16.

Codes are packed *plane-major*: with ``per = 8 // bits`` codes in a byte and ``P = d / per``,
byte ``j`` holds the codes of channels ``j, j + P, ..., j + (per - 1) P`` at bit offsets
``0, bits, ...``. The kernel then unpacks a byte column with one shift and mask per plane, and
each plane is a contiguous run of channels, so no shuffling is needed.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from quantmla.quant.affine import check_group, quantize_groups

KERNEL_CONTENT_BITS = (16, 4, 2)
KERNEL_ROPE_BITS = (16, 4)


def pack_planar(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Plane-major packing of ``codes`` (last dim ``d``, a multiple of ``8 // bits``)."""
    if bits not in (2, 4, 8):
        raise ValueError(f"planar packing supports bits in (2, 4, 8), got {bits}")
    per = 8 // bits
    d = codes.shape[-1]
    if d % per:
        raise ValueError(f"{d} channels do not split into {per} planes")
    planes = codes.to(torch.uint8).reshape(*codes.shape[:-1], per, d // per)
    out = planes[..., 0, :].clone()
    for k in range(1, per):
        out |= planes[..., k, :] << (bits * k)
    return out


def unpack_planar(packed: torch.Tensor, bits: int) -> torch.Tensor:
    per = 8 // bits
    mask = (1 << bits) - 1
    planes = [(packed >> (bits * k)) & mask for k in range(per)]
    return torch.cat(planes, dim=-1)


@dataclass(frozen=True)
class PagedLayout:
    """Shape of one paged cache: formats of both paths and the page geometry."""

    content_bits: int
    rope_bits: int
    kv_lora_rank: int = 512
    rope_dim: int = 64
    group_size: int = 64
    page_size: int = 64

    def __post_init__(self) -> None:
        if self.content_bits not in KERNEL_CONTENT_BITS:
            raise ValueError(f"content_bits={self.content_bits}; the kernel supports {KERNEL_CONTENT_BITS}")
        if self.rope_bits not in KERNEL_ROPE_BITS:
            raise ValueError(f"rope_bits={self.rope_bits}; the kernel supports {KERNEL_ROPE_BITS}")
        if self.kv_lora_rank % 64 or self.kv_lora_rank < 64:
            raise ValueError(f"kv_lora_rank={self.kv_lora_rank} must be a multiple of 64 (4 planes of >= 16)")
        if self.rope_dim % 32 or self.rope_dim < 32:
            raise ValueError(f"rope_dim={self.rope_dim} must be a multiple of 32 (2 planes of >= 16)")
        check_group(self.kv_lora_rank, self.group_size)
        check_group(self.rope_dim, self.group_size)
        if self.page_size not in (16, 32, 64, 128):
            raise ValueError(f"page_size={self.page_size}; valid: 16, 32, 64, 128")

    @classmethod
    def for_scheme(cls, scheme: str, **kw) -> PagedLayout:
        from quantmla.quant.scheme import parse_scheme

        s = parse_scheme(scheme)
        bits = {"bf16": 16, "int": None}

        def b(fmt) -> int:
            if fmt.kind == "fp8":
                raise ValueError(f"scheme {scheme!r}: the low-bit kernel has no FP8 path; valid: bf16, c4r4, c2r4")
            return bits["bf16"] if fmt.kind == "bf16" else fmt.bits

        return cls(content_bits=b(s.content), rope_bits=b(s.rope), **kw)

    @property
    def quantized(self) -> bool:
        return self.content_bits != 16

    def content_width(self) -> int:
        return self.kv_lora_rank * self.content_bits // 8 if self.quantized else self.kv_lora_rank + self.rope_dim

    def rope_width(self) -> int:
        return self.rope_dim * self.rope_bits // 8

    def bytes_per_token(self) -> int:
        if not self.quantized:
            return 2 * (self.kv_lora_rank + self.rope_dim)
        c = self.content_width() + 4 * (self.kv_lora_rank // self.group_size)
        r = self.rope_width() + 4 * (self.rope_dim // self.group_size) if self.rope_bits != 16 else 2 * self.rope_dim
        return c + r


class PagedLatentStore:
    """A pool of pages in :class:`PagedLayout`, with a quantise-and-pack write path.

    For ``content_bits == 16`` the content array holds the whole BF16 token ``[c | k^R]`` (576
    values at DeepSeek geometry), as FlashMLA's dense cache does.
    """

    def __init__(self, layout: PagedLayout, num_pages: int, device: str | torch.device = "cpu") -> None:
        self.layout, self.num_pages = layout, num_pages
        lay, p, t = layout, num_pages, layout.page_size
        if lay.quantized:
            self.content = torch.zeros(p, t, lay.content_width(), dtype=torch.uint8, device=device)
            g = lay.kv_lora_rank // lay.group_size
            self.c_scale = torch.zeros(p, t, g, dtype=torch.float16, device=device)
            self.c_min = torch.zeros(p, t, g, dtype=torch.float16, device=device)
            if lay.rope_bits == 16:
                raise ValueError("a quantised content path with a BF16 RoPE key is not a kernel layout")
            gr = lay.rope_dim // lay.group_size
            self.rope = torch.zeros(p, t, lay.rope_width(), dtype=torch.uint8, device=device)
            self.r_scale = torch.zeros(p, t, gr, dtype=torch.float16, device=device)
            self.r_min = torch.zeros(p, t, gr, dtype=torch.float16, device=device)
        else:
            self.content = torch.zeros(p, t, lay.kv_lora_rank + lay.rope_dim, dtype=torch.bfloat16, device=device)
            self.c_scale = self.c_min = self.rope = self.r_scale = self.r_min = None

    def tensors(self) -> list[torch.Tensor]:
        return [
            x for x in (self.content, self.c_scale, self.c_min, self.rope, self.r_scale, self.r_min) if x is not None
        ]

    def nbytes(self) -> int:
        return sum(x.numel() * x.element_size() for x in self.tensors())

    def write(self, pages: torch.Tensor, slots: torch.Tensor, c: torch.Tensor, r: torch.Tensor) -> None:
        """Store tokens ``c [N, d_c]``, ``r [N, d_r]`` at ``(pages[i], slots[i])``, quantised once."""
        lay = self.layout
        if not lay.quantized:
            self.content[pages, slots] = torch.cat([c, r], dim=-1).to(torch.bfloat16)
            return
        qc = quantize_groups(c, lay.content_bits, lay.group_size)
        qr = quantize_groups(r, lay.rope_bits, lay.group_size)
        self.content[pages, slots] = pack_planar(qc.codes, lay.content_bits)
        self.c_scale[pages, slots], self.c_min[pages, slots] = qc.scale, qc.minimum
        self.rope[pages, slots] = pack_planar(qr.codes, lay.rope_bits)
        self.r_scale[pages, slots], self.r_min[pages, slots] = qr.scale, qr.minimum

    def read(self, pages: torch.Tensor, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Dequantised ``(c, r)`` of the tokens at ``(pages, slots)``, float32 (the reference path)."""
        lay = self.layout
        if not lay.quantized:
            x = self.content[pages, slots].float()
            return x[..., : lay.kv_lora_rank], x[..., lay.kv_lora_rank :]
        g = lay.group_size
        cc = unpack_planar(self.content[pages, slots], lay.content_bits).float()
        c = (
            cc.unflatten(-1, (-1, g)) * self.c_scale[pages, slots].float().unsqueeze(-1)
            + self.c_min[pages, slots].float().unsqueeze(-1)
        ).flatten(-2)
        rc = unpack_planar(self.rope[pages, slots], lay.rope_bits).float()
        r = (
            rc.unflatten(-1, (-1, g)) * self.r_scale[pages, slots].float().unsqueeze(-1)
            + self.r_min[pages, slots].float().unsqueeze(-1)
        ).flatten(-2)
        return c, r
