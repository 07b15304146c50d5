"""What every MLA layer of a step would otherwise recompute, computed by the step's first layer and reused
by the others.

vLLM hands the same attention metadata to every MLA layer of a step. In a step that prefills beside running
decodes, each of quantmla's layers computed two things from it that are the same in every layer:

* the prefill context's gather plan (:func:`context_slots` of a :class:`ContextChunk`): each context token's
  slot in the pages and, with windows, whether it is in its request's window; about 20 small kernels a layer;
* the short extends' decode rows (:meth:`~quantmla.serving.vllm.short_extends.DecodeTokens.rows`): 3 a layer.

On an H100 (vLLM 0.26, DeepSeek-V2-Lite, 27 layers, 5 x 32K prompts; ``docs/serving-gpu-1205-h100-profiles.json``)
these were 567 of a prefill step's 1,841 GPU operations (kernels, copies, memsets) against FLASH_ATTN_MLA's
1,274. The 8 steps' GPU time was the same (0.5 ms apart in all), but the host, whose launches waited on a full
launch queue, finished issuing that step 83 ms later than BF16's, and the previous step's token (the second
request's first) came 79 ms later. With the plans, on another H100 side by side with BF16
(``docs/serving-gpu-1205-h100-step-plans.json``): 1,322 operations against 1,274, and that token 1 ms later.

:class:`StepPlans` holds them for one step: quantmla's metadata builder makes a new one a step
(``QuantMLAMetadata.plans``). Inside a step the plans are keyed by the tensors vLLM passes (their addresses:
vLLM builds them once a step and keeps them for the step).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

import torch

from quantmla.formats.windows import WindowPolicy
from quantmla.serving.vllm.short_extends import DecodeTokens

T = TypeVar("T")


@dataclass(frozen=True)
class ContextSlots:
    """A chunk of the prefill context as read from the pages: ``slots [n]`` (int64, token ``i``'s slot) and
    ``wanted [n]`` (bool, token ``i`` is in its request's window: read from its shadow; ``None`` without
    windows)."""

    slots: torch.Tensor
    wanted: torch.Tensor | None


@dataclass(frozen=True, eq=False)
class ContextChunk:
    """One chunk of vLLM's chunked context, as ``gather_and_maybe_dequant_cache`` gets it: token ``i`` belongs
    to request ``token_to_seq[i]`` at position ``i - cu_seq_lens[seq] + seq_starts[seq]`` (``seq_starts``
    ``None``: from 0). With ``window`` (the policy) and ``ends`` (each prefill request's length after the
    step), the tokens the policy reads unquantised at those lengths are in its window."""

    block_table: torch.Tensor
    cu_seq_lens: torch.Tensor
    token_to_seq: torch.Tensor
    num_tokens: int
    block_size: int
    seq_starts: torch.Tensor | None = None
    window: WindowPolicy | None = None
    ends: torch.Tensor | None = None

    def __post_init__(self) -> None:
        if (self.window is None) != (self.ends is None):
            raise ValueError("ContextChunk: give both window and ends, or neither")

    def key(self) -> tuple:
        """What tells this chunk apart from the step's others."""
        tensors = (self.block_table, self.cu_seq_lens, self.token_to_seq, self.seq_starts, self.ends)
        return (*(_address(x) for x in tensors), self.num_tokens, self.block_size, self.window)


def context_slots(chunk: ContextChunk) -> ContextSlots:
    """Each token's slot in the pages and, with windows, its window mark."""
    t = torch.arange(chunk.num_tokens, device=chunk.block_table.device)
    seq = chunk.token_to_seq[: chunk.num_tokens].long()
    pos = t - chunk.cu_seq_lens[seq].long()
    if chunk.seq_starts is not None:
        pos = pos + chunk.seq_starts[seq].long()
    bs = chunk.block_size
    slots = chunk.block_table[seq, pos // bs].long() * bs + pos % bs
    wanted = None
    if chunk.window is not None:
        wanted = chunk.window.unquantised(pos, chunk.ends[seq].long())
    return ContextSlots(slots, wanted)


def context_runs(prefill) -> dict[int, slice]:
    """vLLM 0.33 gathers the prefill context in chunks that each cover a run of prefill requests, with request
    indices local to the run (``chunk.request_slice``); the runs by the identity of each chunk's ``cu_seq_lens``,
    the tensor vLLM passes to the gather. Empty for vLLM 0.26, whose every chunk spans all prefill requests."""
    chunks = getattr(getattr(prefill, "chunked_context", None), "chunks", None) or ()
    return {id(c.cu_seq_lens): c.request_slice for c in chunks if getattr(c, "request_slice", None) is not None}


def run_ends(ends: torch.Tensor | None, runs: dict[int, slice], cu_seq_lens) -> torch.Tensor | None:
    """The window ends (each prefill request's length after the step) of the requests of the chunk that
    ``cu_seq_lens`` belongs to, indexed as the chunk's ``token_to_seq`` indexes them."""
    run = runs.get(id(cu_seq_lens))
    return ends if run is None or ends is None else ends[run]


class StepPlans:
    """One step's plans, each made by the first layer that asks and returned to the others."""

    def __init__(self) -> None:
        self._plans: dict[tuple, object] = {}

    def _get(self, key: tuple, make: Callable[[], T]) -> T:
        if key not in self._plans:
            self._plans[key] = make()
        return self._plans[key]  # type: ignore[return-value]

    def context(self, chunk: ContextChunk) -> ContextSlots:
        """:func:`context_slots` of one chunk of the step's context, once a step."""
        return self._get(("context", *chunk.key()), lambda: context_slots(chunk))

    def decode_rows(
        self, rows: DecodeTokens, block_table: torch.Tensor, seq_lens: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``rows.rows(block_table, seq_lens)``, once a step (``rows`` lives one step: its identity is its key)."""
        key = ("rows", id(rows), *(_address(x) for x in (block_table, seq_lens)))
        return self._get(key, lambda: rows.rows(block_table, seq_lens))


def _address(x: torch.Tensor | None) -> tuple | None:
    """A tensor's place in memory (views of different rows differ), for keys that live one step."""
    if x is None:
        return None
    return (x.data_ptr(), x.dtype, tuple(x.shape), tuple(x.stride()))
