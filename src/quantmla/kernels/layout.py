"""Paged storage of the quantised MLA cache for the decode kernels, and its write path.

Pages hold ``page_size`` tokens of one sequence; a block table maps each sequence's logical pages
to physical ones. Per page and token the fields are stored as separate arrays (struct of arrays):

* content codes ``[pages, page_size, d_c * bits / 8]`` uint8 (or the BF16 latent itself),
* content scale and minimum ``[pages, page_size, d_c / group, 2]`` fp16, interleaved, so the
  kernel reads one 32-bit word per token and group (``c_scale`` / ``c_min`` are views of it),
* RoPE codes ``[pages, page_size, d_r * bits / 8]`` uint8 (or BF16), scale and minimum likewise.

Codes are packed *group-planar* (:func:`pack_words`): a path of ``d`` channels is cut into
``planes`` runs of ``d / planes`` channels (8 for the content latent, 4 for the RoPE key), each
inside one quantisation group; a little-endian word of ``planes * bits`` bits holds one code of
every run (code ``k`` of word ``e`` is channel ``k * d / planes + e``, at bit ``k * bits``). The
kernel turns a pair of words into one fp16 pair per run with a few bit operations
(:mod:`quantmla.kernels.unpack`), and each run is a contiguous channel slice with one scale and
minimum per token.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from quantmla.quant.affine import quantize_groups

KERNEL_CONTENT_BITS = (16, 4, 2)
KERNEL_ROPE_BITS = (16, 4)
PAGE_SIZES = (16, 32, 64, 128)


class NoKernelLayout(ValueError):
    """The kernel layout cannot hold this cache (scheme format, geometry, group or page size); the
    message says why. The torch path of the cache may still serve it."""


CONTENT_PLANES = 8
ROPE_PLANES = 4


def pack_words(codes: torch.Tensor, bits: int, planes: int) -> torch.Tensor:
    """Group-planar packing of ``codes`` (last dim ``d``) into little-endian bytes
    ``[..., d * bits / 8]``: word ``e`` (``planes * bits`` bits) holds channel ``k * d / planes + e``
    at bit ``k * bits``, for ``k < planes``."""
    word_bits = planes * bits
    if bits not in (2, 4) or word_bits not in (16, 32):
        raise ValueError(f"bits={bits}, planes={planes}: words must be 16 or 32 bits of 2- or 4-bit codes")
    d = codes.shape[-1]
    if d % planes:
        raise ValueError(f"{d} channels do not split into {planes} planes")
    runs = codes.to(torch.int64).reshape(*codes.shape[:-1], planes, d // planes)
    words = torch.zeros_like(runs[..., 0, :])
    for k in range(planes):
        words |= runs[..., k, :] << (bits * k)
    nbytes = word_bits // 8
    out = torch.stack([(words >> (8 * i)) & 255 for i in range(nbytes)], dim=-1)  # little-endian
    return out.flatten(-2).to(torch.uint8)


def unpack_words(packed: torch.Tensor, bits: int, planes: int) -> torch.Tensor:
    """Inverse of :func:`pack_words`: codes ``[..., d]`` (uint8)."""
    nbytes = planes * bits // 8
    by = packed.to(torch.int64).unflatten(-1, (-1, nbytes))
    words = sum(by[..., i] << (8 * i) for i in range(nbytes))
    mask = (1 << bits) - 1
    return torch.cat([(words >> (bits * k)) & mask for k in range(planes)], dim=-1).to(torch.uint8)


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
            raise NoKernelLayout(f"content_bits={self.content_bits}; the kernel supports {KERNEL_CONTENT_BITS}")
        if self.rope_bits not in KERNEL_ROPE_BITS:
            raise NoKernelLayout(f"rope_bits={self.rope_bits}; the kernel supports {KERNEL_ROPE_BITS}")
        if self.quantized and self.rope_bits == 16:
            raise NoKernelLayout("a quantised content path with a BF16 RoPE key is not a kernel layout")
        if self.quantized:
            for name, d in (("kv_lora_rank", self.kv_lora_rank), ("rope_dim", self.rope_dim)):
                if self.group_size <= 0 or d % self.group_size:
                    raise NoKernelLayout(
                        f"group_size={self.group_size} does not divide {name}={d}; the kernel layout needs a"
                        f" group size dividing both kv_lora_rank={self.kv_lora_rank} and rope_dim={self.rope_dim}"
                    )
        # each plane (a run of d / planes channels) is an MMA operand (>= 16 wide) inside one group
        for name, d, planes in (
            ("kv_lora_rank", self.kv_lora_rank, CONTENT_PLANES),
            ("rope_dim", self.rope_dim, ROPE_PLANES),
        ):
            w = d // planes
            if d % planes or w < 16 or w & (w - 1) or (self.quantized and self.group_size % w):
                raise NoKernelLayout(
                    f"{name}={d}: the kernel layout needs {planes} runs of a power-of-two width >= 16 that"
                    f" divides group_size={self.group_size} (e.g. {name}={planes * 16} .. {planes * self.group_size})"
                )
        if self.page_size not in PAGE_SIZES:
            raise NoKernelLayout(f"page_size={self.page_size}; the kernel layout supports {PAGE_SIZES}")

    @classmethod
    def for_scheme(cls, scheme: str, **kw) -> PagedLayout:
        from quantmla.quant.scheme import parse_scheme

        s = parse_scheme(scheme)

        def b(fmt) -> int:
            if not fmt.uniform:
                raise NoKernelLayout(
                    f"scheme {s.name!r}: the kernel reads plain per-token groups; valid: bf16, c4r4, c2r4"
                )
            if fmt.kind == "fp8":
                raise NoKernelLayout(f"scheme {s.name!r}: the kernel has no FP8 path; valid: bf16, c4r4, c2r4")
            if fmt.kind == "bf16":
                return 16
            if fmt.bits not in KERNEL_CONTENT_BITS:
                raise NoKernelLayout(
                    f"scheme {s.name!r}: the kernel has no INT{fmt.bits} path; valid: bf16, c4r4, c2r4"
                )
            return fmt.bits

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
            self.c_sm = torch.zeros(p, t, g, 2, dtype=torch.float16, device=device)  # (scale, minimum)
            self.c_scale, self.c_min = self.c_sm[..., 0], self.c_sm[..., 1]
            gr = lay.rope_dim // lay.group_size
            self.rope = torch.zeros(p, t, lay.rope_width(), dtype=torch.uint8, device=device)
            self.r_sm = torch.zeros(p, t, gr, 2, dtype=torch.float16, device=device)
            self.r_scale, self.r_min = self.r_sm[..., 0], self.r_sm[..., 1]
        else:
            self.content = torch.zeros(p, t, lay.kv_lora_rank + lay.rope_dim, dtype=torch.bfloat16, device=device)
            self.c_sm = self.c_scale = self.c_min = self.rope = self.r_sm = self.r_scale = self.r_min = None

    def tensors(self) -> list[torch.Tensor]:
        """The storage arrays (scale/minimum views not repeated)."""
        return [x for x in (self.content, self.c_sm, self.rope, self.r_sm) if x is not None]

    def kernel_views(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Content words (int32 for INT4, int16 for INT2), scale|minimum words (int32), RoPE words
        (int16), RoPE scale|minimum words: the typed views the low-bit kernel reads."""
        cw = self.content.view(torch.int32 if self.layout.content_bits == 4 else torch.int16)
        return cw, self.c_sm.view(torch.int32), self.rope.view(torch.int16), self.r_sm.view(torch.int32)

    def nbytes(self) -> int:
        """Bytes of the whole pool (every page, in use or not)."""
        return sum(x.numel() * x.element_size() for x in self.tensors())

    def page_nbytes(self) -> int:
        """Bytes of one page, measured from the storage arrays (codes, scale|minimum words, RoPE)."""
        return sum(x[0].numel() * x.element_size() for x in self.tensors())

    def write(
        self, pages: torch.Tensor, slots: torch.Tensor, c: torch.Tensor, r: torch.Tensor, check: bool = True
    ) -> None:
        """Store tokens ``c [N, d_c]``, ``r [N, d_r]`` at ``(pages[i], slots[i])``, quantised once.
        ``check``: reject non-finite values or values beyond the fp16 range of the scales (this reads the
        values back to the host: a GPU sync; the cache's decode steps pass ``False``)."""
        lay = self.layout
        if not lay.quantized:
            self.content[pages, slots] = torch.cat([c, r], dim=-1).to(torch.bfloat16)
            return
        qc = quantize_groups(c, lay.content_bits, lay.group_size, check=check)
        qr = quantize_groups(r, lay.rope_bits, lay.group_size, check=check)
        self.content[pages, slots] = pack_words(qc.codes, lay.content_bits, CONTENT_PLANES)
        self.c_sm[pages, slots] = torch.stack([qc.scale, qc.minimum], dim=-1).to(torch.float16)
        self.rope[pages, slots] = pack_words(qr.codes, lay.rope_bits, ROPE_PLANES)
        self.r_sm[pages, slots] = torch.stack([qr.scale, qr.minimum], dim=-1).to(torch.float16)

    def read(self, pages: torch.Tensor, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Dequantised ``(c, r)`` of the tokens at ``(pages, slots)``, float32 (the reference path)."""
        lay = self.layout
        if not lay.quantized:
            x = self.content[pages, slots].float()
            return x[..., : lay.kv_lora_rank], x[..., lay.kv_lora_rank :]
        g = lay.group_size
        cc = unpack_words(self.content[pages, slots], lay.content_bits, CONTENT_PLANES).float()
        c = (
            cc.unflatten(-1, (-1, g)) * self.c_scale[pages, slots].float().unsqueeze(-1)
            + self.c_min[pages, slots].float().unsqueeze(-1)
        ).flatten(-2)
        rc = unpack_words(self.rope[pages, slots], lay.rope_bits, ROPE_PLANES).float()
        r = (
            rc.unflatten(-1, (-1, g)) * self.r_scale[pages, slots].float().unsqueeze(-1)
            + self.r_min[pages, slots].float().unsqueeze(-1)
        ).flatten(-2)
        return c, r
