"""The window policy: which positions of a request are read unquantised. One definition, used by the cache
(:class:`~quantmla.cache.QuantizedLatentCache`'s stores), the decode-cache simulation
(:mod:`quantmla.measure.simulate`), the engines' BF16 shadows (:mod:`quantmla.serving.windows`), the
kernels' shadow reads and the paged torch decode (both take the range :meth:`WindowPolicy.paged_range` gives).

* **Decode.** A step that brings a request to ``n`` tokens reads its first ``sink`` positions and its last
  ``recent`` (``[n - recent, n)``) unquantised, every other position as stored (quantised once, when it left
  the recent window). A request of at most ``sink + recent`` tokens is read wholly unquantised.
* **Prefill** (a step adding ``q > 1`` tokens): its own new tokens are attended as computed, its context as the
  cache holds it after the step, windows relative to the step's end.

Positions, lengths and counts may be Python integers, numpy arrays or torch tensors (elementwise).

In an engine's pages the shadows of window tokens are kept per **sub-page** of :data:`SUB` slots (a slot's
sub-page is ``slot // SUB``); :meth:`WindowPolicy.subpages_per_request` bounds how many one request touches.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

#: slots per shadow sub-page: a divisor of every block size the engines page by (16-128). Small, so that a
#: request's windows take few rows beyond their own: 34 sub-pages, 136 rows, for 4 + 128 (exact: 132)
SUB = 4


def _where(cond, a, b):
    if isinstance(cond, torch.Tensor):
        return torch.where(cond, a, b)
    return np.where(cond, a, b)


def _arange(n: int, like):
    if isinstance(like, torch.Tensor):
        return torch.arange(n, device=like.device)
    return np.arange(n)


@dataclass(frozen=True)
class WindowPolicy:
    """The first ``sink`` and last ``recent`` tokens of each request are read unquantised (0, 0: none)."""

    sink: int = 4
    recent: int = 128

    def __post_init__(self) -> None:
        for name in ("sink", "recent"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int | np.integer) or v < 0:
                raise ValueError(f"{name}={v!r} must be an integer >= 0")

    @property
    def width(self) -> int:
        """Window positions of a request longer than the windows: ``sink + recent``."""
        return self.sink + self.recent

    @property
    def enabled(self) -> bool:
        return self.width > 0

    def unquantised(self, pos, length):
        """Whether position ``pos`` is read unquantised by the decode step that brings its request to
        ``length`` tokens: a sink, or one of the last ``recent``."""
        return (pos < self.sink) | (pos >= length - self.recent)

    def prefill_unquantised(self, pos, length, new):
        """Whether position ``pos`` is attended unquantised by a step that adds ``new`` tokens and brings its
        request to ``length``: one of the step's own tokens (as computed), or a window position of ``length``."""
        return (pos >= length - new) | self.unquantised(pos, length)

    def decode_mask(self, s: int, device=None) -> torch.Tensor:
        """``[S, S]`` bool: query ``t`` (the decode step of ``t + 1`` tokens) reads key ``j`` unquantised."""
        t = torch.arange(s, device=device).unsqueeze(1)
        j = torch.arange(s, device=device).unsqueeze(0)
        return self.unquantised(j, t + 1)

    def split(self, length: int) -> tuple[int, int, int]:
        """``(sinks, middle, recent)``: how many of a request's ``length`` tokens are sinks, stored (quantised)
        and recent."""
        n_sink = min(self.sink, length)
        n_recent = min(self.recent, length - n_sink)
        return n_sink, length - n_sink - n_recent, n_recent

    def positions(self, lengths):
        """Window positions of requests of ``lengths [B]`` tokens: ``pos [B, W]`` (``W = sink + recent``: the
        sinks, then the recent window, in order) and ``ok [B, W]`` (the position exists: a request of
        ``n <= W`` tokens has all ``n`` in its window, first)."""
        w = self.width
        n = lengths[:, None]
        k = _arange(w, lengths)[None, :]
        pos = _where((n > w) & (k >= self.sink), n - w + k, k)
        return pos, pos < n

    def paged_range(self, lengths):
        """``(start, end)``: the positions ``[start, end)`` of requests of ``lengths`` tokens that are read as
        stored (both 0 for a request wholly inside its windows)."""
        long_ = lengths > self.width
        return _where(long_, self.sink, 0), _where(long_, lengths - self.recent, 0)

    @property
    def subpages_per_request(self) -> int:
        """Shadow sub-pages one request's windows can touch: the sinks' plus the recent window's at any offset."""
        return self.subpages(0)

    def subpages(self, extra: int) -> int:
        """Shadow sub-pages one request's windows can touch when its recent window reaches ``extra`` positions
        further back (the earlier query tokens of a speculative-decoding step)."""
        if extra < 0:
            raise ValueError(f"extra={extra}: must be >= 0")
        # ``recent + extra`` consecutive positions starting anywhere in a sub-page span at most this many
        return -(-self.sink // SUB) + (-(-(self.recent + extra + SUB - 1) // SUB) if self.recent else 0)

    def shadow_rows(self, max_requests: int, extra: int = 0) -> int:
        """Shadow rows of a pool for ``max_requests`` requests at once (without the scratch row), each window
        reaching ``extra`` positions further back."""
        return self.subpages(extra) * max_requests * SUB
