"""The combined method (``quantmla-raq``): QuantMLA's fused transforms, then RAQ-MLA's write-side transforms,
searched from both bases.

RAQ-MLA's trajectories start from a Hadamard of the basis they are given, and the comparison showed that the
start matters: on the bundled model at ~2.65 bits RAQ-MLA from the original weights beat RAQ-MLA from QuaRot's
basis. So the combined method fits RAQ-MLA twice per layer and path, on the unfused model and on the fused one,
and keeps the lower held-out attention-output error (the fused model's own basis, i.e. QuantMLA alone, is one of
the fused fit's candidates). A fit on the unfused model is carried to the fused one exactly: the fused model
caches ``x' = x U`` (content: ``U = diag(g)^-1 R S``; RoPE key: ``U = B``, which commutes with RoPE), so
storing ``Q(x A)`` is storing ``Q(x' U^-1 A)``, the write-side transform ``U^-1 A``. On its held-out layer
objective the combined method is therefore never worse than RAQ-MLA alone or QuantMLA alone.
"""

from __future__ import annotations

import torch

from quantmla.calibrate.objectives import latent_gain
from quantmla.formats.codec import MAX_CONDITION, LayerCodec, ModelCodec, PathCodec
from quantmla.transforms.fuse import ContentTransform, RopeTransform

#: the two bases RAQ-MLA's fits start from
BASES = ("fused", "unfused")


def content_undo(t: ContentTransform, gain: torch.Tensor) -> torch.Tensor:
    """``U^-1 = diag(S)^-1 R^T diag(g)``: maps the fused model's cached latent ``c diag(g)^-1 R S`` back to ``c``."""
    r, s, g = t.rotation.double().cpu(), t.scales.double().cpu(), gain.double().cpu()
    return r.T * g[None, :] / s[:, None]


def rope_undo(t: RopeTransform, cache_pairs: torch.Tensor) -> torch.Tensor:
    """``B^-1``: maps the fused model's cached RoPE key ``k B`` back to ``k``."""
    return t.inverse_matrix(cache_pairs.to(t.angles.device)).double().cpu()


def undo_maps(model, adapter, modules, chosen: dict, paths) -> list[dict[str, torch.Tensor]]:
    """Per layer (in ``modules`` order) and path, ``U^-1`` of the transforms ``chosen[idx]`` that will be fused
    into the still unfused ``model`` (the identity for a path in none of ``paths``)."""
    dims = adapter.dims(model.config)
    pairs = adapter.rope_layout(model.config).cache_pairs(dims.rope_dim)
    eye = {p: torch.eye(d, dtype=torch.float64) for p, d in (("content", dims.kv_lora_rank), ("rope", dims.rope_dim))}
    return [{"content": content_undo(chosen[idx][0], latent_gain(adapter, attn)) if "content" in paths
             else eye["content"],
             "rope": rope_undo(chosen[idx][1], pairs) if "rope" in paths else eye["rope"]}
            for idx, attn in modules]  # fmt: skip


def carried(codec: PathCodec, undo: torch.Tensor) -> PathCodec | None:
    """A path codec fitted on the unfused model, for the fused one: write-side transform ``U^-1 A``
    (``None`` when that matrix is beyond the codec's condition bound)."""
    a = undo if codec.transform is None else undo @ codec.transform.double()
    if not float(torch.linalg.cond(a)) < MAX_CONDITION:
        return None
    return PathCodec(codec.fmt, transform=a, clip_ratio=codec.clip_ratio, gain=codec.gain)


def pick(name: str, fused: tuple[ModelCodec, list[dict]], unfused: tuple[ModelCodec, list[dict]],
         undo: list[dict[str, torch.Tensor]]) -> tuple[ModelCodec, list[dict]]:  # fmt: skip
    """Per layer and path, the RAQ-MLA fit (``(codec, report rows)`` of each basis) with the lower held-out
    error; ``undo[i][path]`` is layer ``i``'s ``U^-1``. Rows: both fits' reports and the basis kept."""
    layers, rows = [], []
    for lc_f, row_f, lc_u, row_u, und in zip(fused[0].layers, fused[1], unfused[0].layers, unfused[1], undo,
                                             strict=True):  # fmt: skip
        paths, row = {}, {}
        for path in ("content", "rope"):
            pc_f, pc_u = getattr(lc_f, path), getattr(lc_u, path)
            info = {"fused": row_f[path], "unfused": row_u[path]}
            err_f, err_u = row_f[path].get("val_after"), row_u[path].get("val_after")
            moved = None if err_u is None or (err_f is not None and err_f <= err_u) else carried(pc_u, und[path])
            if moved is None:
                paths[path], info["basis"] = pc_f, "fused"
                if err_u is not None and err_f is not None and err_u < err_f:
                    info["note"] = "the unfused fit's transform is beyond the condition bound in the fused basis"
            else:
                paths[path], info["basis"] = moved, "unfused"
            info["val_after"] = info[info["basis"]].get("val_after")
            row[path] = info
        layers.append(LayerCodec(paths["content"], paths["rope"]))
        rows.append(row)
    return ModelCodec(name, tuple(layers)), rows
