"""FP8 block-quantised checkpoints (DeepSeek-V3/R1, Kimi-K2): read with their scales, and written back.

Such a checkpoint's ``config.json`` says ``quantization_config: {quant_method: fp8, fmt: e4m3,
weight_block_size: [128, 128]}``; each quantised weight ``W [rows, cols]`` is stored as float8 e4m3 codes beside
``W_scale_inv [ceil(rows / 128), ceil(cols / 128)]``, one float32 factor per 128 x 128 block (the last block of
a dimension may be partial: DeepSeek-V3's ``kv_a_proj_with_mqa`` has 576 rows, four and a half blocks), so
``W = codes * scale_inv`` block by block.

quantmla reads them itself: transformers' CPU dequantisation derives the block from the scale grid and refuses a
partial block. :func:`check_checkpoint` validates the headers only (shards, every scale's presence and grid), so a
bad checkpoint is one clear error before any weight is read; :func:`read_state_dict` dequantises;
:func:`quantize_blocks` writes a weight back in the same format (re-computed block scales).
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

#: the largest finite float8 e4m3 value
E4M3_MAX = 448.0
INDEX_FILE = "model.safetensors.index.json"
SCALE_SUFFIX = "_scale_inv"


@dataclass(frozen=True)
class Fp8Blocks:
    """The quantisation of an FP8 block-quantised checkpoint: its block shape (rows, cols)."""

    block: tuple[int, int] = (128, 128)

    def __post_init__(self) -> None:
        if len(self.block) != 2 or any(not isinstance(b, int) or b < 1 for b in self.block):
            raise ValueError(f"weight_block_size={list(self.block)}: two positive integers (e.g. [128, 128])")

    @classmethod
    def of(cls, config) -> Fp8Blocks | None:
        """The checkpoint's FP8 blocks from its config (``None``: not quantised); a ``ValueError`` for a quantisation
        quantmla does not read."""
        q = getattr(config, "quantization_config", None)
        if q is None:
            return None
        q = q if isinstance(q, dict) else q.to_dict() if hasattr(q, "to_dict") else vars(q)
        method = q.get("quant_method")
        if method != "fp8":
            raise ValueError(f"quantization_config.quant_method={method!r}: quantmla reads unquantised checkpoints and"
                             " FP8 block-quantised ones (quant_method fp8, fmt e4m3)")  # fmt: skip
        fmt = str(q.get("fmt", "e4m3"))
        if fmt not in ("e4m3", "float8_e4m3fn"):
            raise ValueError(f"quantization_config.fmt={fmt!r}: quantmla reads FP8 e4m3 checkpoints")
        block = q.get("weight_block_size")
        if block is None:
            raise ValueError("quantization_config has no weight_block_size: quantmla reads block-quantised FP8"
                             " (e.g. weight_block_size [128, 128])")  # fmt: skip
        return cls(tuple(int(b) for b in block))

    def grid(self, shape) -> tuple[int, int]:
        """The scale grid of a weight of ``shape`` ``[rows, cols]``: partial last blocks included."""
        return math.ceil(shape[-2] / self.block[0]), math.ceil(shape[-1] / self.block[1])


def shards(path: Path) -> list[Path]:
    """The checkpoint's safetensors files (its index's, or every ``*.safetensors``), each checked to exist."""
    index = path / INDEX_FILE
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        missing = [n for n in names if not (path / n).is_file()]
        if missing:
            raise ValueError(f"{index} names shards that are missing: {missing}")
        return [path / n for n in names]
    found = sorted(path.glob("*.safetensors"))
    if not found:
        raise ValueError(f"{path} holds no *.safetensors weights")
    return found


def tensor_headers(files: list[Path]) -> Iterator[tuple[Path, str, str, list[int]]]:
    """``(file, name, dtype, shape)`` of every tensor, read from the shards' headers (no data)."""
    for f in files:
        with f.open("rb") as h:
            n = int.from_bytes(h.read(8), "little")
            header = json.loads(h.read(n))
        for name, info in header.items():
            if name != "__metadata__":
                yield f, name, info["dtype"], info["shape"]


def check_checkpoint(path: Path, blocks: Fp8Blocks) -> int:
    """Check an FP8 checkpoint from its headers: every float8 weight has its ``_scale_inv`` of the right grid.
    Returns the number of quantised weights; a ``ValueError`` naming the first bad tensor."""
    tensors = {name: (dtype, shape) for _, name, dtype, shape in tensor_headers(shards(path))}
    count = 0
    for name, (dtype, shape) in tensors.items():
        if dtype != "F8_E4M3":
            continue
        scale = name + SCALE_SUFFIX
        if scale not in tensors:
            raise ValueError(f"{path}: {name} is float8 but its scale {scale} is missing")
        want = list(blocks.grid(shape))
        if len(shape) != 2 or tensors[scale][1] != want:
            raise ValueError(f"{path}: {scale} has shape {tensors[scale][1]}; {name} {shape} in blocks of"
                             f" {list(blocks.block)} needs {want}")  # fmt: skip
        count += 1
    return count


def dequantize_blocks(codes: torch.Tensor, scale_inv: torch.Tensor, blocks: Fp8Blocks,
                      dtype: torch.dtype = torch.float32) -> torch.Tensor:  # fmt: skip
    """``codes * scale_inv`` block by block (partial last blocks included), in ``dtype`` (computed in float32)."""
    rows, cols = codes.shape
    b0, b1 = blocks.block
    s = scale_inv.float().repeat_interleave(b0, 0)[:rows].repeat_interleave(b1, 1)[:, :cols]
    return (codes.float() * s).to(dtype)


def quantize_blocks(w: torch.Tensor, blocks: Fp8Blocks) -> tuple[torch.Tensor, torch.Tensor]:
    """``(codes, scale_inv)`` of ``w [rows, cols]``: each block's largest magnitude maps to the e4m3 maximum."""
    rows, cols = w.shape
    b0, b1 = blocks.block
    g0, g1 = blocks.grid(w.shape)
    padded = torch.zeros(g0 * b0, g1 * b1, dtype=torch.float32, device=w.device)
    padded[:rows, :cols] = w.float()
    amax = padded.view(g0, b0, g1, b1).abs().amax(dim=(1, 3))
    scale_inv = (amax / E4M3_MAX).clamp_min(torch.finfo(torch.float32).tiny)
    s = scale_inv.repeat_interleave(b0, 0)[:rows].repeat_interleave(b1, 1)[:, :cols]
    codes = (w.float() / s).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return codes, scale_inv


def dequantized_tensors(path: Path, blocks: Fp8Blocks, dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor]]:
    """``(name, tensor)`` of every tensor of the checkpoint, one at a time: float8 weights dequantised to ``dtype``,
    their scales dropped, other floating tensors cast (the checkpoint's own names)."""
    from contextlib import ExitStack

    from safetensors import safe_open

    where = {name: f for f, name, _, _ in tensor_headers(shards(path))}
    with ExitStack() as stack:
        opened = {f: stack.enter_context(safe_open(str(f), framework="pt")) for f in set(where.values())}

        def get(name: str) -> torch.Tensor:
            return opened[where[name]].get_tensor(name)

        for name in where:
            if name.endswith(SCALE_SUFFIX) and name[: -len(SCALE_SUFFIX)] in where:
                continue  # a weight's scale: applied with it
            t = get(name)
            if t.dtype == torch.float8_e4m3fn:
                t = dequantize_blocks(t, get(name + SCALE_SUFFIX), blocks, dtype)
            elif t.is_floating_point():
                t = t.to(dtype)
            yield name, t


def read_state_dict(path: Path, blocks: Fp8Blocks, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Every tensor of the checkpoint as :func:`dequantized_tensors` gives it, in one state dict (host memory: the
    whole model in ``dtype``)."""
    return dict(dequantized_tensors(path, blocks, dtype))


def write_dequantized(path: Path, blocks: Fp8Blocks, dtype: torch.dtype, out: Path,
                      shard_bytes: int = 2 << 30) -> Path:  # fmt: skip
    """The checkpoint dequantised to ``dtype`` as safetensors shards of at most ``shard_bytes`` in ``out`` (with an
    index), one tensor at a time: host memory holds one shard, whatever the model's size; the disk the whole model in
    ``dtype``. For loaders that place a checkpoint lazily (accelerate's device map)."""
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    weight_map: dict[str, str] = {}
    pending: dict[str, torch.Tensor] = {}
    size, names = 0, []

    def flush() -> None:
        nonlocal pending, size
        if pending:
            name = f"dequantized-{len(names) + 1:05d}.safetensors"
            save_file({k: v.contiguous() for k, v in pending.items()}, str(out / name), metadata={"format": "pt"})
            names.append(name)
            weight_map.update(dict.fromkeys(pending, name))
            pending, size = {}, 0

    for name, t in dequantized_tensors(path, blocks, dtype):
        if pending and size + t.numel() * t.element_size() > shard_bytes:
            flush()
        pending[name] = t
        size += t.numel() * t.element_size()
    flush()
    (out / INDEX_FILE).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}, indent=1))
    return out
