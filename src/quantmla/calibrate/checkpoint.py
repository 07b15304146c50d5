"""A calibrated model written as its source checkpoint with only the changed tensors replaced.

Calibration fuses its transforms into a few attention tensors per layer (``kv_a_proj_with_mqa``, ``kv_a_layernorm``,
``kv_b_proj``, the query projection). Rewriting every weight would write the whole model again (2.7 TB in float32
for DeepSeek-V3), so :func:`export_changed` compares those tensors with the source's and writes:

* every source shard with no changed tensor, hard-linked (``copy=True``: copied);
* every shard holding a changed tensor, anew: its other tensors as they were (FP8 codes and scales included), the
  changed ones in the source's format: an FP8 block-quantised weight re-quantised with new 128 x 128 block scales
  from its float32 fusion (whatever dtype the model ran in), or, with ``keep_bf16``, in BF16 without a scale (its
  module named in the quantization config's ``modules_to_not_convert``); an unquantised one in its dtype;
* the index with the same shard names, the source's ``config.json`` (and ``generation_config.json``, tokenizer
  files) and ``quantmla.json``.

So the export is the source's size but for the changed tensors' difference, and it loads in transformers (an
unquantised source), in :func:`quantmla.load` and in vLLM as the calibrated model.
"""

from __future__ import annotations

import copy as copying
import json
import logging
import os
import shutil
from collections.abc import Callable, Mapping
from pathlib import Path

import torch
from torch import nn

from quantmla.models.adapter import get_adapter
from quantmla.models.fp8_checkpoint import (
    INDEX_FILE,
    SCALE_SUFFIX,
    Fp8Blocks,
    dequantize_blocks,
    quantize_blocks,
    shards,
    tensor_headers,
)
from quantmla.transforms.fuse import ContentTransform, RopeTransform, fuse_content, fuse_rope

logger = logging.getLogger(__name__)

#: files of the source directory carried into the export as they are (beside the weights and quantmla.json)
CARRIED = ("generation_config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
           "tokenizer.model", "vocab.json", "merges.txt")  # fmt: skip


def calibrated_tensor_names(model: nn.Module) -> dict[str, torch.Tensor]:
    """The tensors calibration may change, by state-dict name: each attention module's latent projection, latent
    norm, up-projection and query projection."""
    adapter = get_adapter(model)
    names = {id(p): n for n, p in model.named_parameters()}
    out = {}
    for _, attn in adapter.attention_modules(model):
        for module in (adapter.kv_a_proj(attn), adapter.kv_norm(attn), adapter.kv_b_proj(attn), adapter.q_proj(attn)):
            out[names[id(module.weight)]] = module.weight
    return out


def _headers(files: list[Path]) -> dict[str, tuple[Path, str]]:
    """``name -> (shard, dtype)`` from the shards' headers."""
    return {name: (f, dtype) for f, name, dtype, _ in tensor_headers(files)}


def changed_among(tensors: dict[str, torch.Tensor], source: Path, blocks: Fp8Blocks | None) -> dict[str, torch.Tensor]:
    """Those of ``tensors`` (by checkpoint name) that differ from the source checkpoint's."""
    where = _headers(shards(source))
    out = {}
    for name, t in tensors.items():
        if name not in where:
            raise ValueError(f"{source}: the calibrated tensor {name} is not in the checkpoint")
        old = _source_tensor(name, where, blocks)
        if not torch.equal(old.to(t.dtype).to(t.device), t.detach()):
            out[name] = t.detach()
    return out


def _source_tensor(name: str, where: dict[str, tuple[Path, str]], blocks: Fp8Blocks | None) -> torch.Tensor:
    """The checkpoint's tensor ``name`` as stored; an FP8 weight dequantised to float32."""
    from safetensors import safe_open

    with safe_open(str(where[name][0]), framework="pt") as st:
        t = st.get_tensor(name)
    if t.dtype == torch.float8_e4m3fn:
        scale = name + SCALE_SUFFIX
        with safe_open(str(where[scale][0]), framework="pt") as ss:
            t = dequantize_blocks(t, ss.get_tensor(scale), blocks, torch.float32)
    return t


#: the transforms fused into each attention module, by cache index: ``(content or None, RoPE or None)``
Fusions = dict[int, tuple[ContentTransform | None, RopeTransform | None]]


def fp8_fused_in_float32(model: nn.Module, fusions: Fusions, source: Path, blocks: Fp8Blocks,
                         rename: Callable[[str], str] = str) -> dict[str, torch.Tensor]:  # fmt: skip
    """The FP8-stored calibrated weights of the attention modules in ``fusions``, fused again in float32 from the
    source's float32-dequantised weights: what an FP8 export re-quantises (the model's own fused weights are in its
    dtype, e.g. bfloat16 on CUDA, rounded once more). Keys: the checkpoint's names (``rename`` of the model's)."""
    adapter = get_adapter(model)
    modules = dict(adapter.attention_modules(model))
    names = {id(p): n for n, p in model.named_parameters()}
    where = _headers(shards(source))
    roles = (adapter.kv_a_proj, adapter.kv_norm, adapter.kv_b_proj, adapter.q_proj)
    out = {}
    for idx, (content, rope) in fusions.items():
        attn = modules[idx]
        ckpt = [rename(names[id(role(attn).weight)]) for role in roles]
        if not any(where[n][1] == "F8_E4M3" for n in ckpt):
            continue
        # the module's structure copied, its tensors shared; the four calibrated modules get float32 tensors
        shadow = copying.deepcopy(attn, {id(t): t for t in (*attn.parameters(), *attn.buffers())})
        for role, n in zip(roles, ckpt, strict=True):
            m = role(shadow)
            m.weight = nn.Parameter(_source_tensor(n, where, blocks).float().to(m.weight.device), requires_grad=False)
            if getattr(m, "bias", None) is not None:
                m.bias = nn.Parameter(m.bias.detach().float().clone(), requires_grad=False)
        if content is not None:
            fuse_content(adapter, shadow, content)
        if rope is not None:
            fuse_rope(adapter, shadow, rope, model.config)
        out |= {n: role(shadow).weight.detach() for role, n in zip(roles, ckpt, strict=True)
                if where[n][1] == "F8_E4M3"}  # fmt: skip
    return out


def _link(src: Path, dst: Path, copy: bool) -> None:
    if not copy:
        try:
            os.link(src, dst)
            return
        except OSError:  # another file system: a copy
            logger.info("%s: hard link not possible, copied", dst.name)
    shutil.copy2(src, dst)


def export_changed(model: nn.Module, source: str | Path, out: str | Path, meta_writer, copy: bool = False,
                   keep_bf16: bool = False, fusions: Fusions | None = None) -> dict:  # fmt: skip
    """Write ``model`` (calibrated from the checkpoint in ``source``) to ``out`` as the source with only its changed
    tensors replaced; ``meta_writer(out)`` writes ``quantmla.json`` (and a codec). ``fusions``: the transforms fused
    into ``model``; an FP8 source's weights are then re-quantised from their float32 fusion
    (:func:`fp8_fused_in_float32`), not from the model's. Returns what was written:
    ``{"changed": [...], "rewritten": [...], "linked": [...]}``."""
    from quantmla.models.loading import inspect_model

    src = inspect_model(source)
    if keep_bf16 and src.fp8 is None:
        raise ValueError("--keep-bf16 applies to an FP8 checkpoint; this one is unquantised")
    tensors = calibrated_tensor_names(model)
    if src.fp8 is not None and fusions:
        tensors |= fp8_fused_in_float32(model, fusions, src.path, src.fp8)
    return write_changed(src.path, out, changed_among(tensors, src.path, src.fp8), meta_writer, copy, keep_bf16)


class StoredTensors(Mapping):
    """Tensors by checkpoint name, read on access from the safetensors ``files`` that hold them (a layer-by-layer
    calibration's changed tensors: never all in memory at once)."""

    def __init__(self, files: list[Path]) -> None:
        self._where: dict[str, Path] = {}
        for f in files:
            self._where |= {name: f for name in _headers([f])}

    def __getitem__(self, name: str) -> torch.Tensor:
        from safetensors import safe_open

        with safe_open(str(self._where[name]), framework="pt") as st:
            return st.get_tensor(name)

    def __iter__(self):
        return iter(self._where)

    def __len__(self) -> int:
        return len(self._where)


def write_changed(source: str | Path, out: str | Path, changed: Mapping[str, torch.Tensor], meta_writer,
                  copy: bool = False, keep_bf16: bool = False) -> dict:  # fmt: skip
    """The export of :func:`export_changed` from the changed tensors themselves (by checkpoint name)."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    from quantmla.models.loading import inspect_model

    src = inspect_model(source)
    blocks = src.fp8
    if keep_bf16 and blocks is None:
        raise ValueError("--keep-bf16 applies to an FP8 checkpoint; this one is unquantised")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    files = shards(src.path)
    where = _headers(files)
    # vLLM fuses q_a_proj with kv_a_proj_with_mqa and refuses a fused layer of mixed precision: a kept-BF16
    # kv_a_proj_with_mqa takes its q_a_proj along (its FP8 values dequantised, stored in BF16)
    siblings = set()
    if keep_bf16:
        for name in changed:
            sib = name.replace(".kv_a_proj_with_mqa.", ".q_a_proj.")
            if sib != name and where[name][1] == "F8_E4M3" and sib in where and where[sib][1] == "F8_E4M3":
                siblings.add(sib)
        siblings -= set(changed)
    by_file: dict[Path, list[str]] = {}
    for name in [*changed, *sorted(siblings)]:
        by_file.setdefault(where[name][0], []).append(name)
    replaced = set(changed) | siblings
    weight_map, linked, rewritten, kept_bf16 = {}, [], [], []
    for f in files:
        names = [n for n, (g, _) in where.items() if g == f]
        if f not in by_file:
            _link(f, out / f.name, copy)
            linked.append(f.name)
            weight_map |= dict.fromkeys(names, f.name)
            continue
        tensors = {}
        with safe_open(str(f), framework="pt") as st:
            for n in names:
                if n not in replaced and not (n.endswith(SCALE_SUFFIX) and n[: -len(SCALE_SUFFIX)] in replaced):
                    tensors[n] = st.get_tensor(n)
            for n in by_file[f]:
                if n in siblings:
                    with safe_open(str(where[n + SCALE_SUFFIX][0]), framework="pt") as ss:
                        scale = ss.get_tensor(n + SCALE_SUFFIX)
                    tensors[n] = dequantize_blocks(st.get_tensor(n), scale, blocks, torch.bfloat16)
                    kept_bf16.append(n.removesuffix(".weight"))
        for n in by_file[f]:
            if n in siblings:
                continue
            t = changed[n].float().cpu()
            if where[n][1] == "F8_E4M3" and not keep_bf16:
                tensors[n], scale = quantize_blocks(t, blocks)
                tensors[n + SCALE_SUFFIX] = scale
            elif where[n][1] == "F8_E4M3":
                tensors[n] = t.to(torch.bfloat16)
                kept_bf16.append(n.removesuffix(".weight"))
            else:
                tensors[n] = t.to(_DTYPES[where[n][1]])
        save_file({n: v.contiguous() for n, v in tensors.items()}, str(out / f.name), metadata={"format": "pt"})
        rewritten.append(f.name)
        weight_map |= dict.fromkeys(tensors, f.name)
    if (src.path / INDEX_FILE).is_file() or len(files) > 1:
        index = {"metadata": {}, "weight_map": dict(sorted(weight_map.items()))}
        (out / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
    config = json.loads((src.path / "config.json").read_text())
    if kept_bf16:
        q = config["quantization_config"]
        q["modules_to_not_convert"] = sorted({*q.get("modules_to_not_convert", []), *kept_bf16})
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    for name in CARRIED:
        if (src.path / name).is_file() and not (out / name).exists():
            shutil.copy2(src.path / name, out / name)
    meta_writer(out)
    logger.info("export: %d tensors changed, %d shards rewritten, %d %s", len(changed), len(rewritten), len(linked),
                "copied" if copy else "hard-linked")  # fmt: skip
    if siblings:
        logger.info("export: %d q_a_proj weights stored in BF16 beside their kept kv_a_proj_with_mqa (vLLM fuses the"
                    " two and needs one precision)", len(siblings))  # fmt: skip
    return {"changed": sorted(changed), "rewritten": rewritten, "linked": linked, "kept_bf16": sorted(kept_bf16)}


_DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32, "F64": torch.float64}
