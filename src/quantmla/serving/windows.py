"""The sink and recent windows inside a paged engine: BF16 shadows of the tokens in some window.

The window policy (:class:`~quantmla.formats.windows.WindowPolicy`, as in
:class:`~quantmla.cache.QuantizedLatentCache`) reads each sequence's first ``sink`` tokens and its last ``recent``
tokens unquantised and every other token as stored. An engine's page holds one record a
token, written once, so the plugin keeps the unquantised copy of the window tokens beside the pages:

* a pool of **sub-pages** of :data:`~quantmla.formats.windows.SUB` slots (a slot's sub-page is
  ``slot // SUB``; a vLLM block of 64 tokens has 16). :class:`WindowPool` maps sub-pages to shadow sub-pages, least
  recently needed first out. It is planned on the host once per engine step (:meth:`WindowPool.plan`): every
  sub-page that holds a window position of a request in the step, after the step's tokens, gets a shadow
  before the tokens are written. The pool holds :attr:`WindowPolicy.subpages_per_request` sub-pages per
  request the engine may run at once, so a step always fits;
* per layer, the shadow rows themselves (:class:`ShadowRows`, the model's dtype). Every write to a
  slot whose sub-page has a shadow also lands in the shadow.

The plan also knows, on the host, which shadow rows hold their slot's current token (a row becomes
valid when the step that writes its slot has the shadow in place, and invalid when the shadow changes
hands). Every window position of the step then reads a valid row: one that is not is **repaired**
before the step, from the record as stored, in every layer (:meth:`WindowPool.register`), and counted
in :attr:`WindowPool.misses`. That happens only for tokens another request wrote before this one needed
them (a prefix-cache hit), or when a running request that was not scheduled for many steps lost its
shadows to newer ones; everything else is the exact policy, token for token. The decode reads the
rows through the map alone (no validity check on the device).

The step's decode attends positions ``[sink, n - recent)`` from the pages and the window rows from
:meth:`ShadowRows.window` (``n`` tokens in the cache after the step). As in ``QuantizedLatentCache``, a
prefill attends its own new tokens as computed and its context (earlier chunks, prefix hits) as the
cache holds it, windows relative to the end of the step.
"""

from __future__ import annotations

import numpy as np
import torch

from quantmla.formats.windows import SUB, WindowPolicy


def host_to_device(a: np.ndarray, device) -> torch.Tensor:
    """``a`` on ``device``, queued behind the stream's work without waiting for it: a blocking copy from
    pageable memory synchronises the stream (PyTorch waits for the copy), which would stall vLLM's
    asynchronous scheduling. On CUDA the copy goes from pinned memory, non-blocking (PyTorch's caching host
    allocator keeps the pinned block until the copy has run)."""
    t = torch.from_numpy(np.ascontiguousarray(a))
    if torch.device(device).type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


class WindowPool:
    """Which sub-pages have a shadow, for all layers of one engine (shadow rows: :class:`ShadowRows`).

    ``num_slots``: the engine's token slots (``num_blocks * block_size``); ``max_requests``: requests it
    runs at once (vLLM's ``max_num_seqs``); ``extra``: positions further back each request's windows may reach
    (speculative decoding's draft tokens: with as many, every step of at most ``extra + 1`` tokens a request is
    granted as decode tokens by :meth:`plan`).
    """

    def __init__(self, cfg: WindowPolicy, num_slots: int, max_requests: int, device, extra: int = 0) -> None:
        if not cfg.enabled:
            raise ValueError("a window pool needs sink + recent > 0")
        self.cfg = cfg
        self.subpages = cfg.subpages(extra) * max_requests
        self.trash = self.subpages * SUB  # the scratch row: writes to slots without a shadow land there
        keys = -(-num_slots // SUB)
        self._shadow_of = np.full(keys, -1, dtype=np.int64)  # sub-page -> shadow sub-page (host)
        self._owner = np.full(self.subpages, -1, dtype=np.int64)
        self._last = np.full(self.subpages, -1, dtype=np.int64)  # step it was last needed
        self._valid = np.zeros(self.trash, dtype=bool)  # the row holds its slot's current token
        self._step = 0
        self._repairers: dict[int, object] = {}
        sink, w = cfg.sink, cfg.width
        cols = [*range(0, sink, SUB), sink - 1, *range(sink, w, SUB), w - 1]
        self._key_cols = np.unique(np.array([c for c in cols if 0 <= c < w], dtype=np.int64))
        self.misses = 0  # window rows repaired from their records (read as stored)
        self.map = torch.full((keys,), -1, dtype=torch.int32, device=device)

    def register(self, key: int, repair) -> None:
        """``repair(rows, slots)`` (device long tensors) copies the records of ``slots`` as stored into the
        shadow ``rows`` of one layer; called from :meth:`plan` for the rows that need it."""
        self._repairers[key] = repair

    def _rows(self, slots: np.ndarray) -> np.ndarray:
        sh = self._shadow_of[slots // SUB]
        return np.where(sh >= 0, sh * SUB + slots % SUB, -1)

    def plan(self, block_table: np.ndarray, seq_lens: np.ndarray, query_lens: np.ndarray, block_size: int,
             short: np.ndarray | None = None) -> np.ndarray:  # fmt: skip
        """Give a shadow to every sub-page this step needs (host block tables ``[B, pages]``, lengths after
        the step ``[B]`` and tokens the step adds ``[B]``); evicts the least recently needed, updates
        :attr:`map` and repairs the window rows that need it.

        ``short`` (bool ``[B]``): requests whose new tokens should attend one by one, as decode tokens (token
        ``j`` of ``q``: the window of ``n - q + 1 + j`` tokens, reaching up to ``q - 1`` positions before the
        step's window). Their earlier window rows get shadows too, kept from the last step, for as many of
        them as the pool holds beside the step's own windows, fewest new tokens first. Returns the mask of
        the requests whose tokens may attend one by one: those adding one token and the short ones that
        got their windows (the others attend as a prefill does, windows relative to the step's end)."""
        table = block_table.astype(np.int64)
        n, q = np.asarray(seq_lens, dtype=np.int64), np.asarray(query_lens, dtype=np.int64)
        wslots, keys = self._window_slots(table, n, block_size)
        step = self._step
        self._step += 1
        sh = self._shadow_of[keys]
        self._last[sh[sh >= 0]] = step
        missing = [keys[sh < 0]]
        granted = q <= 1
        if short is not None and np.any(short & (q > 1)):
            spare = int((self._last < step).sum()) - missing[0].size  # beside the step's own windows
            for i in np.argsort(np.where(short & (q > 1), q, np.iinfo(np.int64).max), kind="stable"):
                if not short[i] or q[i] <= 1:
                    break
                lens = n[i] - q[i] + 1 + np.arange(q[i])  # the windows of its tokens, one by one
                ws, ks = self._window_slots(np.repeat(table[i : i + 1], q[i], axis=0), lens, block_size)
                ksh = self._shadow_of[ks]
                kept = ksh[ksh >= 0]
                kept = kept[self._last[kept] < step]
                new = np.setdiff1d(ks[ksh < 0], missing[0])
                if kept.size + new.size > spare:
                    break  # the rest add as many tokens or more
                self._last[kept] = step
                spare -= kept.size + new.size
                missing.append(new)
                wslots = np.concatenate([wslots, ws])
                granted[i] = True
        missing = np.unique(np.concatenate(missing))
        if missing.size:
            self._assign(missing, keys.size, step)
        # the step's new tokens: their rows (where they have one) hold them once the layers have written
        req = np.repeat(np.arange(n.size), q)
        new_pos = n[req] - q[req] + (np.arange(req.size) - np.repeat(np.cumsum(q) - q, q))
        rows = self._rows(table[req, new_pos // block_size] * block_size + new_pos % block_size)
        self._valid[rows[rows >= 0]] = True
        self._repair(wslots)
        return granted

    def _window_slots(self, table: np.ndarray, seq_lens: np.ndarray, block_size: int):
        """The window slots of requests of ``seq_lens`` tokens (host table rows), flattened, and the
        sub-pages they touch."""
        pos, ok = self.cfg.positions(seq_lens)
        col = np.minimum(pos // block_size, table.shape[1] - 1)
        wslots = np.take_along_axis(table, col, axis=1) * block_size + pos % block_size
        # every sub-page the window touches holds one of these columns (each segment's start, every SUB-th
        # position after it, its end) or the request's last token: the keys without a unique over every slot
        cols = self._key_cols
        last = np.take_along_axis(wslots, np.maximum(ok.sum(1) - 1, 0)[:, None], axis=1)[:, 0]  # position n - 1
        keys = np.unique(np.concatenate([(wslots[:, cols] // SUB)[ok[:, cols]], (last // SUB)[ok[:, 0]]]))
        if keys.size and keys[-1] >= self._shadow_of.size:
            raise ValueError(f"slot sub-page {keys[-1]} beyond the {self._shadow_of.size} the pool was built for")
        return wslots[ok], keys

    def _repair(self, wslots: np.ndarray) -> int:
        """Repair the window rows of ``wslots`` that do not hold their slot's token; returns how many."""
        wrows = self._rows(wslots)
        bad = ~self._valid[wrows]
        if not bad.any():
            return 0
        rows, slots = np.unique(np.stack([wrows[bad], wslots[bad]]), axis=1)
        self._valid[rows] = True
        self.misses += rows.size
        rows_t, slots_t = self._upload(rows), self._upload(slots)
        for repair in self._repairers.values():
            repair(rows_t, slots_t)
        return int(rows.size)

    def _assign(self, missing: np.ndarray, wanted: int, step: int) -> None:
        order = np.argsort(self._last, kind="stable")
        free = order[self._last[order] < step][: missing.size]
        if free.size < missing.size:
            raise RuntimeError(
                f"the window pool ({self.subpages} sub-pages) cannot hold this step's {wanted}: more requests"
                " at once than it was sized for"
            )
        old = self._owner[free]
        old = old[old >= 0]
        self._shadow_of[old] = -1
        self._owner[free] = missing
        self._shadow_of[missing] = free
        self._last[free] = step
        self._valid[(free[:, None] * SUB + np.arange(SUB)).ravel()] = False
        changed = np.concatenate([old, missing])
        self.map[self._upload(changed)] = self._upload(self._shadow_of[changed].astype(np.int32))

    def _upload(self, a: np.ndarray) -> torch.Tensor:
        return host_to_device(a, self.map.device)

    def rows_of(self, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Shadow rows of ``slots`` (any shape, -1 for none) and whether they have one (else the scratch row)."""
        sh = self.map[slots.clamp_min(0) // SUB].long()
        good = (slots >= 0) & (sh >= 0)
        return torch.where(good, sh * SUB + slots % SUB, self.trash), good


class ShadowRows:
    """One layer's shadow rows ``[rows + 1, d_c + d_r]`` (the last: scratch), in the model's dtype."""

    def __init__(self, cfg: WindowPolicy, max_requests: int, width: int, dtype: torch.dtype, device=None,
                 extra: int = 0) -> None:  # fmt: skip
        self.cfg = cfg
        self.rows = torch.zeros(cfg.shadow_rows(max_requests, extra) + 1, width, dtype=dtype, device=device)

    @property
    def nbytes(self) -> int:
        return self.rows.numel() * self.rows.element_size()

    def write(self, pool: WindowPool, slots: torch.Tensor, c: torch.Tensor, r: torch.Tensor) -> None:
        """Store the new tokens ``c [N, d_c]``, ``r [N, d_r]`` of ``slots [N]`` in their shadows (if any)."""
        rows, _ = pool.rows_of(slots.long())
        self.rows[rows] = torch.cat([c, r.reshape(r.shape[0], -1)], dim=-1).to(self.rows.dtype)

    def repair(self, read, rows: torch.Tensor, slots: torch.Tensor) -> None:
        """Rows ``rows`` from the records of ``slots`` as stored (``read(slots) -> [N, d]``)."""
        self.rows[rows] = read(slots).to(self.rows.dtype)

    def lookup(self, pool: WindowPool, slots: torch.Tensor, wanted: torch.Tensor, stored: torch.Tensor):
        """Tokens of ``slots`` (any shape): the shadow where ``wanted`` (a window position of the step: its
        row is valid), else ``stored`` (``[*slots.shape, d]``, the records as stored)."""
        rows, good = pool.rows_of(slots)
        return torch.where((good & wanted)[..., None], self.rows[rows], stored.to(self.rows.dtype))

    def window(self, pool: WindowPool, pages: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor):
        """The decode window of each request: ``(win [B, W, d], win_len [B] int32, paged_start, n_paged)``
        (``pages [num_blocks, block_size, ...]`` for the block size)."""
        lens = seq_lens.long()
        pos, ok = self.cfg.positions(lens)
        paged_start, n_paged = (x.int() for x in self.cfg.paged_range(lens))
        bs = pages.shape[1]
        col = (pos // bs).clamp_max(block_table.shape[1] - 1)
        slots = torch.where(ok, block_table.long().gather(1, col) * bs + pos % bs, -1)
        rows, _ = pool.rows_of(slots)
        win = self.rows[rows].masked_fill(~ok[..., None], 0.0)  # rows past n: whatever the scratch row holds
        return win, ok.sum(1).int(), paged_start, n_paged
