"""A cache layer whose quantised tokens live in the paged kernel layout, and whose decode steps run
the fused Triton kernel (:func:`quantmla.kernels.decode.mla_decode`) instead of dequantise-then-attend.

Same policy as :class:`QuantizedLatentLayer` (sinks and recent window unquantised, a token quantised
once when it leaves the window). A decode step returns lightweight references instead of the whole
dequantised cache; the registered latent attention function sees them and calls :meth:`attend`.
"""

from __future__ import annotations

import torch

from quantmla.cache.latent_cache import LatentCacheConfig, QuantizedLatentLayer
from quantmla.kernels.layout import PagedLatentStore, PagedLayout

KERNEL_ATTR = "_quantmla_kernel_layer"


def kernel_layout(cfg: LatentCacheConfig) -> PagedLayout:
    """The paged layout for ``cfg``, or a ``ValueError`` saying why the kernel cannot serve it."""
    return PagedLayout.for_scheme(
        cfg.scheme.name, kv_lora_rank=cfg.kv_lora_rank, rope_dim=cfg.rope_dim, group_size=cfg.group_size,
        page_size=64,
    )  # fmt: skip


class KernelLatentLayer(QuantizedLatentLayer):
    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        if key_states.dtype != torch.bfloat16:
            raise ValueError(f"the triton backend needs a bfloat16 model, got activations in {key_states.dtype}")
        self.layout = kernel_layout(self.cfg)
        super().lazy_initialization(key_states, value_states)

    def _windows(self) -> tuple[int, int | None]:
        if not self.cfg.scheme.quantized:  # bf16: every token in BF16 pages (FlashMLA's dense layout)
            return 0, 0
        return self.cfg.sink, self.cfg.recent

    def _init_mid(self, batch: int) -> None:
        self.store = PagedLatentStore(self.layout, num_pages=4 * batch, device=self.device)
        self.block_table = torch.zeros(batch, 4, dtype=torch.int32, device=self.device)
        self.free_page = 0
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
        self.store.write(pages.flatten(), slots.flatten(), c.flatten(0, 1).float(), r.flatten(0, 1).float())
        self.n_mid += n

    def _mid_view(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        b = self.block_table.shape[0]
        idx = torch.arange(self.n_mid, device=self.device)
        pages = self.block_table[:, idx // self.layout.page_size].long()
        c, r = self.store.read(pages.flatten(), (idx % self.layout.page_size).expand(b, -1).flatten())
        return c.view(b, self.n_mid, -1).to(dtype), r.view(b, self.n_mid, -1).to(dtype)

    def _mid_nbytes(self) -> int:
        return self.n_mid * self.batch * self.layout.bytes_per_token()  # pages in use (pool may be larger)

    def _result(self, c: torch.Tensor, r: torch.Tensor, s: int):
        if s > 1:  # prefill: the torch path, new tokens as computed
            return super()._result(c, r, s)
        ref_c, ref_r = c.unsqueeze(1), r.unsqueeze(1)
        setattr(ref_c, KERNEL_ATTR, self)
        return ref_c, ref_r

    # -- attention through the kernel ---------------------------------------------------------
    def _window(self) -> tuple[torch.Tensor, torch.Tensor]:
        sink = torch.cat([self.sink_c.dequantize(torch.bfloat16), self.sink_r.dequantize(torch.bfloat16)], -1)
        rec = torch.cat([self.rec_c, self.rec_r], -1).to(torch.bfloat16)
        win = torch.cat([sink, rec], dim=1)
        n = torch.full((self.batch,), win.shape[1], dtype=torch.int32, device=self.device)
        if win.shape[1] == 0:
            win = torch.zeros(self.batch, 1, win.shape[-1], dtype=torch.bfloat16, device=self.device)
        return win, n

    def _padding(self, mask: torch.Tensor | None) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Per-row masks for left padding, from the boolean decode mask ``[B, 1, 1, L]``."""
        if mask is None:
            return None, None
        m = mask[:, 0, -1] if mask.dtype == torch.bool else mask[:, 0, -1] == 0
        L = m.shape[-1]
        first = m.int().argmax(-1)
        expect = torch.arange(L, device=m.device).unsqueeze(0) >= first.unsqueeze(1)
        if not torch.equal(m, expect):
            raise NotImplementedError("the triton decode kernel supports left padding only, not arbitrary masks")
        ns, nr = self.sink_c.length, self.rec_c.shape[1]
        paged_start = (first - ns).clamp(0, self.n_mid)
        window_skip = torch.where(first <= ns, first, ns + (first - (L - nr)).clamp_min(0))
        return paged_start.int(), window_skip.int()

    def attend(self, q_nope, q_pe, w_uk, w_uv, scale, mask) -> torch.Tensor:
        from quantmla.kernels.decode import mla_decode

        q_lat = torch.einsum("bhsd,hdc->bhsc", q_nope, w_uk.to(q_nope.dtype))[:, :, 0].to(torch.bfloat16)
        paged_start, window_skip = self._padding(mask)
        win, win_len = self._window()
        o_lat, _ = mla_decode(
            q_lat.contiguous(), q_pe[:, :, 0].to(torch.bfloat16).contiguous(), self.store, self.block_table,
            torch.full((self.batch,), self.n_mid, dtype=torch.int32, device=self.device), scale, win, win_len,
            paged_start=paged_start, window_skip=window_skip,
        )  # fmt: skip
        out = torch.einsum("bhc,hvc->bhv", o_lat, w_uv.to(o_lat.dtype))
        return out.unsqueeze(1).to(q_nope.dtype)
