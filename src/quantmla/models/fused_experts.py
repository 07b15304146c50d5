"""Mixture-of-experts weights fused as they are read, so a layer's experts are held once.

transformers stores a MoE layer's experts as fused tensors (DeepSeek-V2/V3, Kimi-K2, GLM-4.7-Flash:
``mlp.experts.gate_up_proj`` of shape ``[experts, 2 * intermediate, hidden]`` and ``mlp.experts.down_proj``), while
the checkpoints hold one tensor per expert and projection. Its loader converts the one into the other with the
operations of its conversion mapping (stack over the experts, then concatenate gate and up): the per-expert
tensors, the stacked ones and the concatenated one are alive at once, about three copies of a layer's experts on
the host. Reading one decoder layer at a time (:mod:`quantmla.models.streaming`), quantmla fills the fused tensors
itself, one expert at a time, where the mapping is exactly that merge (:func:`fusion_plan`); the model class's
loader then takes them as they are. Any other mapping is left to transformers (the same weights, more memory).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Slot:
    """Where a checkpoint tensor goes: rows ``start:stop`` of expert ``expert`` of the fused tensor ``target``."""

    target: str
    expert: int
    start: int
    stop: int


@dataclass(frozen=True)
class FusionPlan:
    """Per checkpoint tensor its :class:`Slot`, and the fused tensors' shapes."""

    slots: dict[str, Slot]
    shapes: dict[str, tuple[int, ...]]

    def fill(self, buffers: dict[str, torch.Tensor], name: str, tensor: torch.Tensor, dtype: torch.dtype) -> None:
        """Copy checkpoint tensor ``name`` into its slot (the fused tensor allocated in ``dtype`` on first use)."""
        s = self.slots[name]
        if s.target not in buffers:
            buffers[s.target] = torch.empty(self.shapes[s.target], dtype=dtype)
        buffers[s.target][s.expert, s.start : s.stop] = tensor


def _merge_ops(converter) -> bool:
    """The converter is the merge :func:`fusion_plan` performs: stack over experts, then (for several sources)
    concatenate along rows."""
    from transformers.conversion_mapping import Concatenate, MergeModulelist

    ops = list(getattr(converter, "operations", []) or [])
    if not ops or type(ops[0]) is not MergeModulelist or ops[0].dim != 0:
        return False
    if len(converter.source_patterns) == 1:
        return len(ops) == 1
    return len(ops) == 2 and type(ops[1]) is Concatenate and ops[1].dim == 1


def fusion_plan(model_type: str, shapes: dict[str, list[int]], rename) -> FusionPlan | None:
    """The fused expert tensors of the checkpoint tensors ``shapes`` (name: shape) as transformers' conversion
    mapping for ``model_type`` builds them, the names passed through ``rename``; ``None`` when the mapping holds
    anything but the stack-and-concatenate merge of experts (transformers then converts, to the same weights)."""
    from transformers.conversion_mapping import WeightConverter, get_checkpoint_conversion_mapping

    mapping = get_checkpoint_conversion_mapping(model_type) or []
    if not mapping or not all(isinstance(c, WeightConverter) and _merge_ops(c) for c in mapping):
        return None
    slots: dict[str, Slot] = {}
    plan_shapes: dict[str, tuple[int, ...]] = {}
    for conv in mapping:
        (target,) = conv.target_patterns
        found: dict[str, dict[int, dict[int, tuple[str, list[int]]]]] = {}  # prefix -> pattern -> expert -> tensor
        for j, pattern in enumerate(conv.source_patterns):
            rx = re.compile(r"^(.*\.)?" + re.escape(pattern).replace(r"\*", r"(\d+)") + "$")
            for name, shape in shapes.items():
                m = rx.match(name)
                if m is not None:
                    found.setdefault(m.group(1) or "", {}).setdefault(j, {})[int(m.group(2))] = (name, shape)
        for prefix, by_pattern in found.items():
            experts = sorted(by_pattern[0])
            if sorted(by_pattern) != list(range(len(conv.source_patterns))) or any(
                sorted(e) != experts for e in by_pattern.values()
            ) or experts != list(range(len(experts))):  # fmt: skip
                return None  # not every expert has every part: left to transformers, which names what is missing
            fused = rename(prefix + target)
            start, tail = 0, None
            for j in range(len(conv.source_patterns)):
                rows_shape = by_pattern[j][0][1]
                if tail is not None and list(rows_shape[1:]) != tail:
                    return None
                tail = list(rows_shape[1:])
                for e in experts:
                    name, shape = by_pattern[j][e]
                    if list(shape) != list(rows_shape):
                        return None
                    slots[name] = Slot(fused, e, start, start + shape[0])
                start += rows_shape[0]
            plan_shapes[fused] = (len(experts), start, *tail)
    return FusionPlan(slots, plan_shapes) if slots else None
