"""A checkpoint read one decoder layer at a time: the rest of the model is never materialised.

A model too large for one device (DeepSeek-V3: 61 layers, 671B parameters) is calibrated layer by layer. The
checkpoint's shards are indexed from their headers; :meth:`CheckpointLayers.layer` reads only the tensors of one
decoder layer (FP8 blocks dequantised on the target device) into a **one-layer model** of the same class, whose
config is the source's with one layer of that layer's kind (dense or MoE). The model class's own loader builds it,
so transformers' conversions of the checkpoint's names apply as in a full load, and the layer computes exactly what it
computes inside the whole model. The experts' fused tensors are filled one expert at a time as they are read
(:mod:`quantmla.models.fused_experts`), so the host holds a layer's experts once, not three times.
:meth:`CheckpointLayers.embedding` builds the same one-layer model with the real embedding and rotary tables (its
layer is never run): a forward of it up to its layer gives the first layer's inputs and the keyword arguments
(position embeddings, mask) every decoder layer receives.
"""

from __future__ import annotations

import copy
import logging
import math
import re
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from quantmla.models.adapter import get_adapter
from quantmla.models.fp8_checkpoint import SCALE_SUFFIX, dequantize_blocks, shards, tensor_headers
from quantmla.models.fused_experts import FusionPlan, fusion_plan
from quantmla.models.loading import ModelSource, inspect_model, resolve_device, resolve_dtype

logger = logging.getLogger(__name__)

#: model types whose decoder layers are built one at a time (their layer kind is read from the config)
STREAMED_MODEL_TYPES = ("deepseek_v2", "deepseek_v3", "kimi_k2", "glm4_moe_lite")
_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


def layer_config(config, index: int):
    """``config`` with one decoder layer, of the kind (dense or MoE) layer ``index`` has in the full model."""
    one = copy.deepcopy(config)
    if getattr(one, "mlp_layer_types", None) is not None:
        one.mlp_layer_types = [config.mlp_layer_types[index]]
    if getattr(one, "layer_types", None) is not None:
        one.layer_types = [config.layer_types[index]]
    if getattr(one, "first_k_dense_replace", None) is not None:
        one.first_k_dense_replace = 1 if index < config.first_k_dense_replace else 0
    one.num_hidden_layers = 1
    return one


@dataclass
class CheckpointLayers:
    """The decoder layers of the checkpoint ``source``, built one at a time in ``dtype`` on ``device``."""

    source: ModelSource | str | Path
    dtype: torch.dtype | str = "auto"
    device: torch.device | str = "cpu"
    _where: dict[str, Path] = field(init=False, repr=False)
    _layers: dict[int, list[str]] = field(init=False, repr=False)
    _shapes: dict[str, list[int]] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.source = inspect_model(self.source)
        self.device = resolve_device(self.device)
        self.dtype = resolve_dtype(self.dtype, self.device)
        model_type = getattr(self.source.config, "model_type", None)
        if model_type not in STREAMED_MODEL_TYPES:
            raise ValueError(f"model_type {model_type!r} cannot be calibrated layer by layer; valid: "
                             f"{', '.join(STREAMED_MODEL_TYPES)} (calibrate it in memory)")  # fmt: skip
        self._where, self._shapes = {}, {}
        for f, name, _, shape in tensor_headers(shards(self.source.path)):
            self._where[name] = f
            self._shapes[name] = shape
        self._layers = {}
        for name in self._where:
            m = _LAYER.match(name)
            if m is not None:
                self._layers.setdefault(int(m.group(1)), []).append(name)
        want = list(range(self.num_layers))
        if sorted(self._layers) != want:
            missing = sorted(set(want) - set(self._layers))
            raise ValueError(f"{self.source.path}: the checkpoint lacks the tensors of layers {missing} of "
                             f"{self.num_layers}")  # fmt: skip

    @property
    def config(self):
        return self.source.config

    @property
    def num_layers(self) -> int:
        return int(self.config.num_hidden_layers)

    def layer_shapes(self, index: int) -> dict[str, list[int]]:
        """The checkpoint's tensors of layer ``index`` (scales included) and their shapes, from the headers."""
        return {n: self._shapes[n] for n in self._layers[index]}

    def layer_bytes(self, index: int) -> int:
        """Bytes of layer ``index``'s parameters in the compute dtype (from the headers)."""
        return self._numel([n for n in self._layers[index] if not n.endswith(SCALE_SUFFIX)]) * _itemsize(self.dtype)

    def model_bytes(self) -> int:
        """Bytes of the whole model's parameters in the compute dtype."""
        return self._numel([n for n in self._where if not n.endswith(SCALE_SUFFIX)]) * _itemsize(self.dtype)

    def _numel(self, names: list[str]) -> int:
        return sum(math.prod(self._shapes[n]) for n in names)

    def _read(self, names: list[str], rename, plan: FusionPlan | None = None) -> dict[str, torch.Tensor]:
        """The tensors ``names`` (FP8 weights dequantised on the device, scales dropped), keys ``rename(name)``;
        those of ``plan`` copied into their fused tensors one at a time."""
        from safetensors import safe_open

        out: dict[str, torch.Tensor] = {}
        fused: dict[str, torch.Tensor] = {}
        with ExitStack() as stack:
            opened = {}

            def get(n: str) -> torch.Tensor:
                f = self._where[n]
                if f not in opened:
                    opened[f] = stack.enter_context(safe_open(str(f), framework="pt"))
                return opened[f].get_tensor(n)

            for n in names:
                if n.endswith(SCALE_SUFFIX) and n[: -len(SCALE_SUFFIX)] in self._where:
                    continue
                t = get(n)
                if t.dtype == torch.float8_e4m3fn:  # dequantised on the device, kept on the host
                    scale = get(n + SCALE_SUFFIX).to(self.device)
                    t = dequantize_blocks(t.to(self.device), scale, self.source.fp8, self.dtype).cpu()
                elif t.is_floating_point():
                    t = t.to(self.dtype)
                if plan is not None and n in plan.slots:
                    plan.fill(fused, n, t, self.dtype)
                else:
                    out[rename(n)] = t
                del t
        return out | fused

    def _one_layer_model(self, index: int, state: dict[str, torch.Tensor], vocab: bool = False) -> nn.Module:
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING
        from transformers.utils import logging as hf_logging

        config = layer_config(self.config, index)
        if not vocab:  # placeholders of the embedding and output layer: as small as the special token ids allow
            special = [getattr(config, k, None) for k in ("pad_token_id", "bos_token_id", "eos_token_id")]
            config.vocab_size = 1 + max([0, *(i for i in special if isinstance(i, int))])
        if hasattr(config, "quantization_config"):
            del config.quantization_config  # dequantised by quantmla
        cls = MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]
        # one layer a call: transformers' per-load messages (the placeholders reported missing, a progress bar) off
        level, bars = hf_logging.get_verbosity(), hf_logging.is_progress_bar_enabled()
        hf_logging.set_verbosity_error()
        hf_logging.disable_progress_bar()
        try:
            model = cls.from_pretrained(None, config=config, state_dict=state, dtype=self.dtype,
                                        attn_implementation="sdpa")  # fmt: skip
        finally:
            hf_logging.set_verbosity(level)
            if bars:
                hf_logging.enable_progress_bar()
        model = model.to(self.device).eval()
        for _, attn in get_adapter(model).attention_modules(model):
            attn.layer_idx = index  # the cache index the layer has in the full model
        return model

    def layer(self, index: int) -> nn.Module:
        """The one-layer model holding decoder layer ``index`` (its ``model.layers[0]``), every tensor of that
        layer read from the checkpoint; its embedding and output layer are placeholders, never used."""
        if not 0 <= index < self.num_layers:
            raise ValueError(f"layer {index}; valid: 0 .. {self.num_layers - 1}")
        prefix = f"model.layers.{index}."

        def rename(n: str) -> str:
            return "model.layers.0." + n[len(prefix) :]

        shapes = self.layer_shapes(index)
        plan = fusion_plan(self.config.model_type, shapes, rename)
        state = self._read(list(shapes), rename, plan)
        model = self._one_layer_model(index, state)
        _check_loaded(model.model.layers[0], state, "model.layers.0.", index)
        return model

    def embedding(self) -> nn.Module:
        """The one-layer model with the checkpoint's embedding, final norm and output layer (its decoder layer is a
        placeholder): run up to its layer, it gives the first layer's inputs."""
        names = [n for n in self._where if _LAYER.match(n) is None]
        return self._one_layer_model(0, self._read(names, lambda n: n), vocab=True)


def _check_loaded(layer: nn.Module, state: dict, prefix: str, index: int) -> None:
    """Every parameter of the built layer came from the checkpoint (none left at its random initialisation)."""
    have = {n[len(prefix) :] for n in state}
    for name, _ in layer.named_parameters():
        if name in have:
            continue
        # a fused tensor (transformers' conversion): the checkpoint holds its parts under the module's prefix
        module = name.rsplit(".", 1)[0]
        if not any(h.startswith(module + ".") for h in have):
            raise ValueError(f"layer {index}: the checkpoint has no tensor for {name}")


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()
