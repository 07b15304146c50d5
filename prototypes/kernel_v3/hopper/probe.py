"""The fragment probe on the GPU: the v3 register operands of packed words times a 16 x 16 matrix, on the tensor
cores (``fragment_probe.cu``)."""

from __future__ import annotations

import torch

from kernel_v3.hopper.build import extension


def as_int32(words: torch.Tensor) -> torch.Tensor:
    """uint32 patterns held in int64 (:func:`~kernel_v3.fragment.pack_fragments`) as int32 words."""
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def fragment_probe(words: torch.Tensor, b: torch.Tensor, bits: int, output: bool,
                   dtype: torch.dtype = torch.float16) -> torch.Tensor:  # fmt: skip
    """``[tiles, 16, 16]`` fp32: each tile's A operand (the scores' or, ``output``, the output product's) times
    ``b [16, 16]`` (``dtype``), as ``mma.sync.m16n8k16`` computes it; ``words [.., 32]`` from ``pack_fragments``."""
    if dtype not in (torch.float16, torch.bfloat16):
        raise ValueError(f"dtype {dtype}; valid: torch.float16, torch.bfloat16")
    dev = torch.device("cuda")
    w = as_int32(words.reshape(-1, 32)).to(dev).contiguous()
    raw = b.to(dtype).contiguous().view(torch.int16).to(dev)
    stream = torch.cuda.current_stream(dev).cuda_stream
    return extension("v3").fragment_probe(w, raw, bits, output, dtype == torch.bfloat16, stream)
