"""A cache layer whose quantised tokens live in the paged kernel layout, and whose decode steps run
the fused Triton kernel (:func:`quantmla.kernels.decode.mla_decode`) instead of dequantise-then-attend.

Same policy as :class:`QuantizedLatentLayer` (sinks and recent window unquantised, a token quantised
once when it leaves the window). A decode step (one new token) returns only the new token; the cache's
:meth:`~quantmla.cache.latent_cache.QuantizedLatentCache.decode_backend` then hands this layer to the
latent attention function, which calls :meth:`KernelLatentLayer.attend`.

A decode step makes no GPU->CPU sync (page bookkeeping is host-side integers), so it can run inside a
CUDA graph; ``validate=True`` on the cache adds the checks that need one.
"""

from __future__ import annotations

import importlib.util

import torch

from quantmla.cache.latent_cache import LatentCacheConfig, QuantizedLatentLayer
from quantmla.kernels.layout import NoKernelLayout, PagedLatentStore, PagedLayout


def kernel_layout(cfg: LatentCacheConfig) -> PagedLayout:
    """The paged layout for ``cfg`` (its page size included), or :class:`NoKernelLayout` saying why the
    kernel cannot serve it."""
    return PagedLayout.for_scheme(
        cfg.scheme.name, kv_lora_rank=cfg.kv_lora_rank, rope_dim=cfg.rope_dim, group_size=cfg.group_size,
        page_size=cfg.page_size,
    )  # fmt: skip


def supports_kernel(cfg: LatentCacheConfig) -> tuple[bool, str]:
    """``(True, layout description)`` when the kernel can serve ``cfg``, else ``(False, reason)``."""
    if importlib.util.find_spec("triton") is None:
        return False, "triton is not installed (pip install 'quantmla[triton]')"
    try:
        lay = kernel_layout(cfg)
    except NoKernelLayout as e:
        return False, str(e)
    return True, f"scheme {cfg.scheme.name}, group {lay.group_size}, page {lay.page_size}"


class KernelLatentLayer(QuantizedLatentLayer):
    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        if key_states.dtype != torch.bfloat16:
            raise ValueError(f"the triton backend needs a bfloat16 model, got activations in {key_states.dtype}")
        self.layout = kernel_layout(self.cfg)
        self.kernel_step = False
        self.page_kernel = "triton"  # which kernel read the pages at the last decode step (mla_decode's choice)
        super().lazy_initialization(key_states, value_states)

    def _split(self, total: int) -> tuple[int, int]:
        if not self.cfg.scheme.quantized:  # bf16: every token in BF16 pages (FlashMLA's dense layout)
            return 0, 0
        return super()._split(total)

    def _init_mid(self, batch: int) -> None:
        self.store = PagedLatentStore(self.layout, num_pages=4 * batch, device=self.device)
        self.block_table = torch.zeros(batch, 4, dtype=torch.int32, device=self.device)
        self.free_page = 0  # pages handed out to sequences (host-side: no sync)
        self.n_mid = 0

    def _grow(self, need_pages: int) -> None:
        b, have = self.block_table.shape
        if need_pages <= have:
            return
        new = max(need_pages, 2 * have)
        pool = PagedLatentStore(self.layout, num_pages=b * new, device=self.device)
        for dst, src in zip(pool.tensors(), self.store.tensors(), strict=True):
            dst[: src.shape[0]] = src
        bt = torch.zeros(b, new, dtype=torch.int32, device=self.device)
        bt[:, :have] = self.block_table
        self.store, self.block_table = pool, bt

    def _append_mid(self, c: torch.Tensor, r: torch.Tensor) -> None:
        b, n = c.shape[:2]
        page = self.layout.page_size
        first, last = self.n_mid // page, (self.n_mid + n - 1) // page
        self._grow(last + 1)
        for p in range(first, last + 1):  # assign physical pages to new logical pages
            if p * page >= self.n_mid:
                self.block_table[:, p] = torch.arange(b, device=self.device, dtype=torch.int32) + self.free_page
                self.free_page += b
        idx = torch.arange(self.n_mid, self.n_mid + n, device=self.device)
        pages = self.block_table[:, idx // page].long()  # [B, n]
        slots = (idx % page).expand(b, n)
        # checked in update() already (at prefill, or every token with validate=True)
        self.store.write(
            pages.flatten(), slots.flatten(), c.flatten(0, 1).float(), r.flatten(0, 1).float(), check=False
        )
        self.n_mid += n

    # -- rollback: kernel pages quantise each token on its own, so a prefix is exact --------------------
    def _set_mid_recording(self, on: bool) -> None:
        pass

    def _mid_truncation_error(self, length: int) -> str | None:
        return None

    def _truncate_mid(self, length: int) -> None:
        """Keep the first ``length`` paged tokens; the pages past them go back to the pool (the slots they held
        are rewritten when tokens are appended again)."""
        if length >= self.n_mid:
            return
        used = -(-length // self.layout.page_size)
        self.block_table[:, used:] = 0
        self.free_page = self.block_table.shape[0] * used  # pages are handed out in order, one per row and page
        self.n_mid = length

    def _mid_view(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        b = self.block_table.shape[0]
        idx = torch.arange(self.n_mid, device=self.device)
        pages = self.block_table[:, idx // self.layout.page_size].long()
        c, r = self.store.read(pages.flatten(), (idx % self.layout.page_size).expand(b, -1).flatten())
        shape = (b, self.n_mid)
        return c.view(*shape, self.cfg.kv_lora_rank).to(dtype), r.view(*shape, self.cfg.rope_dim).to(dtype)

    def _mid_nbytes(self) -> int:
        """Bytes of the pages the block table holds (``free_page`` pages, each measured from the pool's
        arrays); the pool itself may hold more pages, not yet handed out (``store.nbytes()``)."""
        return self.free_page * self.store.page_nbytes()

    def _map_batch(self, fn) -> None:
        """Reorder, repeat or select batch rows (beam search): ``fn`` maps the rows of any ``[B, ...]`` tensor. Each
        new row gets fresh pages holding a copy of its source row's (a sequence writes its pages in place, so two
        rows never share one), and the windows follow their rows."""
        if not self.is_initialized:
            return
        page = self.layout.page_size
        used = -(-self.n_mid // page)
        src = fn(self.block_table.long())[:, :used]  # [B', used]: each new row's source pages
        b_new, width = src.shape[0], self.block_table.shape[1]
        pool = PagedLatentStore(self.layout, num_pages=max(b_new * width, 1), device=self.device)
        pool.pages[: b_new * used] = self.store.pages[src.flatten()]
        bt = torch.zeros(b_new, width, dtype=torch.int32, device=self.device)
        bt[:, :used] = torch.arange(b_new * used, dtype=torch.int32, device=self.device).view(b_new, used)
        self.store, self.block_table, self.free_page = pool, bt, b_new * used
        for st in (self.sink_c, self.sink_r):
            st.map_batch(fn)
        self._map_windows(fn)
        self.batch = b_new

    def _result(self, c: torch.Tensor, r: torch.Tensor, s: int):
        self.kernel_step = s == 1
        if s > 1:  # prefill: the torch path, new tokens as computed
            return super()._result(c, r, s)
        return c.unsqueeze(1), r.unsqueeze(1)

    # -- attention through the kernel ---------------------------------------------------------
    def _window(self) -> tuple[torch.Tensor, torch.Tensor]:
        sink = torch.cat([self.sink_c.dequantize(torch.bfloat16), self.sink_r.dequantize(torch.bfloat16)], -1)
        rec = torch.cat([self.rec_c, self.rec_r], -1).to(torch.bfloat16)
        win = torch.cat([sink, rec], dim=1)
        n = torch.full((self.batch,), win.shape[1], dtype=torch.int32, device=self.device)
        if win.shape[1] == 0:
            win = torch.zeros(self.batch, 1, win.shape[-1], dtype=torch.bfloat16, device=self.device)
        return win, n

    def _padding(self, mask: torch.Tensor | None):
        """Per-row masks for left padding, from the decode mask ``[B or 1, 1, 1, L]`` (boolean, or additive
        float with 0 = attend): ``(paged_start, window_skip, bad)``, ``bad [B]`` marking rows whose mask is
        not a left padding (the kernel cannot apply it; :meth:`attend` makes their output NaN). Without
        syncs; with ``validate=True`` such a mask raises instead."""
        if mask is None:
            return None, None, None
        m = mask[:, 0, -1] if mask.dtype == torch.bool else mask[:, 0, -1] == 0
        m = m.expand(self.batch, -1)
        L = m.shape[-1]
        first = m.int().argmax(-1)
        expect = torch.arange(L, device=m.device).unsqueeze(0) >= first.unsqueeze(1)
        bad = (m != expect).any(-1)
        if self.cfg.validate and bool(bad.any()):
            raise NotImplementedError("the triton decode kernel supports left padding only, not arbitrary masks")
        ns, nr = self.sink_c.length, self.rec_c.shape[1]
        paged_start = (first - ns).clamp(0, self.n_mid)
        window_skip = torch.where(first <= ns, first, ns + (first - (L - nr)).clamp_min(0))
        return paged_start.int(), window_skip.int(), bad

    def attend(self, q_nope, q_pe, w_uk, w_uv, scale, mask) -> torch.Tensor:
        """Absorbed attention of one query token per sequence over this layer's cache, through the kernel.
        ``q_nope [B,H,1,d_n]``, ``q_pe [B,H,1,d_r]``, ``w_uk [H,d_n,d_c]``, ``w_uv [H,d_v,d_c]``; ``mask``
        the decode mask or None. Returns ``[B,1,H,d_v]``."""
        from quantmla.kernels.decode import mla_decode

        q_lat = torch.einsum("bhsd,hdc->bhsc", q_nope, w_uk.to(q_nope.dtype))[:, :, 0].to(torch.bfloat16)
        paged_start, window_skip, bad = self._padding(mask)
        win, win_len = self._window()
        o_lat, _ = mla_decode(
            q_lat.contiguous(), q_pe[:, :, 0].to(torch.bfloat16).contiguous(), self.store, self.block_table,
            torch.full((self.batch,), self.n_mid, dtype=torch.int32, device=self.device), scale, win, win_len,
            paged_start=paged_start, window_skip=window_skip,
        )  # fmt: skip
        self.page_kernel = mla_decode.last_backend
        out = torch.einsum("bhc,hvc->bhv", o_lat, w_uv.to(o_lat.dtype))
        if bad is not None:  # a mask the kernel could not apply: NaN, never a silently different result
            out = torch.where(bad[:, None, None], torch.full_like(out, float("nan")), out)
        return out.unsqueeze(1).to(q_nope.dtype)
