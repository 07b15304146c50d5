"""The decode kernel v3's h = 16 inner loop, prototypes: scores and the probability-weighted output of an INT4
content latent (512 channels, groups of 64) in the fragment-ordered layout, with the scales folded out of both
wgmma products. ``P`` is given (no softmax): the prototypes measure the products. ``tile_h16.cu`` loads each
step synchronously; ``stream_h16.cu`` copies the steps ahead with cp.async, keeps two groups' products in flight
and builds ``s o P`` from registers in the scores' layout; ``stream_h16_cs.cu`` splits the channels across the
warps and unpacks each code once."""

from __future__ import annotations

import torch

from kernel_v3.fragment import group_major, pack_fragments
from kernel_v3.hopper.build import extension
from kernel_v3.hopper.probe import as_int32

#: no-swizzle core-matrix strides of the shared-memory operands (bytes): along K, along N
LBO, SBO = 256, 128


def pack_h16(codes: torch.Tensor) -> torch.Tensor:
    """INT4 codes ``[T, 512]`` as the kernel's int32 words ``[T / 16, 32, 32]``."""
    return as_int32(pack_fragments(codes, 4))


def tile_h16(words: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor, q: torch.Tensor, p: torch.Tensor,
             per_cta: int = 1024, lbo: int = LBO, sbo: int = SBO) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """``(S^T [T, 16], O [16, 512])`` fp32 on the GPU; inputs fp16 CUDA (``words`` from :func:`pack_h16`)."""
    stream = torch.cuda.current_stream(words.device).cuda_stream
    scores, partial, rank1 = extension("v3").tile_h16(words, scale, minimum, q, p, per_cta, lbo, sbo, stream)
    return scores, _output(partial, rank1)


def stream_h16(words: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor, q: torch.Tensor, p_t: torch.Tensor,
               per_cta: int = 1024, write_scores: bool = True, variant: int = 0, lbo: int = LBO, sbo: int = SBO,
               ) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """As :func:`tile_h16` through the pipelined kernel; ``p_t`` token-major ``[T, 16]``. Without
    ``write_scores`` the scores are not stored (an empty ``[0, 16]`` tensor comes back). ``variant`` 1 stores
    ``s o P`` by ``stmatrix`` and takes the magic number's 1024 off on the tensor cores."""
    stream = torch.cuda.current_stream(words.device).cuda_stream
    scores, partial, rank1 = extension("v3").stream_h16(words, scale, minimum, q, p_t, per_cta, write_scores, variant,
                                                        lbo, sbo, stream)  # fmt: skip
    return scores, _output(partial, rank1)


def stream_h16_dq(words: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor, q: torch.Tensor, p_t: torch.Tensor,
                  per_cta: int = 1024, write_scores: bool = True, lbo: int = LBO, sbo: int = SBO,
                  ) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """As :func:`stream_h16`, variant 2: the operands dequantised in registers (``x = u s + m`` in fp16, no fold);
    ``scale`` and ``minimum`` ``[T, 8]`` as everywhere here (made group-major for the kernel)."""
    stream = torch.cuda.current_stream(words.device).cuda_stream
    scores, partial = extension("v3").stream_h16_dq(words, group_major(scale), group_major(minimum), q, p_t, per_cta,
                                                    write_scores, lbo, sbo, stream)  # fmt: skip
    return scores, partial.sum(0)


#: variant 3's schedules (:func:`stream_h16_cs`): the extension's code of each
CS_SCHEDULES = {"plain": 0, "wgmma-output": 1, "skewed": 2, "skewed-split": 3, "plain-split": 4}


def stream_h16_cs(words: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor, q: torch.Tensor, p_t: torch.Tensor,
                  per_cta: int = 1024, write_scores: bool = True, warps: int = 4,
                  schedule: str = "plain") -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """As :func:`stream_h16_dq`, variant 3: the channels split across ``warps`` warps (4: 128 channels a warp, 8:
    64), on ``mma.sync``, each code unpacked and dequantised once and transposed in registers (``movmatrix``) for
    the output; ``per_cta`` a multiple of 32. ``schedule`` (4 warps for all but ``plain``): ``wgmma-output``
    (variant 4) the output product on wgmma, its A operand the transposed tiles in registers (the c-th product
    takes every warp's c-th tile); ``skewed`` (variant 5) each step's output product after the next step's
    barrier, beside its scores, P in its own double-buffered slot (two barriers a step instead of three);
    ``skewed-split`` and ``plain-split`` those with the scores' mma chain split in two."""
    if warps not in (4, 8):
        raise ValueError(f"warps={warps} is not supported; valid: 4, 8")
    if schedule not in CS_SCHEDULES:
        raise ValueError(f"schedule={schedule!r} is not a variant-3 schedule; valid: {', '.join(CS_SCHEDULES)}")
    if schedule != "plain" and warps != 4:
        raise ValueError(f"schedule {schedule!r} runs one warpgroup: warps={warps} is not supported with it; valid: 4")
    stream = torch.cuda.current_stream(words.device).cuda_stream
    scores, partial = extension("v3").stream_h16_cs(words, group_major(scale), group_major(minimum), q, p_t, per_cta,
                                                    write_scores, warps, CS_SCHEDULES[schedule], stream)  # fmt: skip
    return scores, partial.sum(0)


def _output(partial: torch.Tensor, rank1: torch.Tensor) -> torch.Tensor:
    """``O [16, 512]``: the CTAs' partial products plus their rank-1 terms, broadcast over each group's channels."""
    return partial.sum(0) + rank1.sum(0).repeat_interleave(64, dim=1)
