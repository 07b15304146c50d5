"""Runs the sm_90a decode kernel for the page splits of :func:`quantmla.kernels.decode.mla_decode`: which
caches and shapes it takes (:func:`unsupported` says why not, in one line), and the launch (:func:`page_splits`),
whose partial outputs are the Triton page splits' (the window programs and the combine pass stay Triton's)."""

from __future__ import annotations

import torch

from quantmla.kernels.hopper.build import extension, missing
from quantmla.kernels.layout import PagedLayout

SM90_ROWS = 64  # query rows a CTA (heads x query tokens of one sequence)


def unsupported(layout: PagedLayout, rows: int, device: torch.device, check_machine: bool = True) -> str | None:
    """Why the sm_90a kernel does not serve this cache and query shape (``None``: it does). ``rows``: query
    rows a sequence (heads x query tokens). Without ``check_machine`` the GPU's architecture is checked (a GPU
    that is not sm_90 is a reason, not a missing piece); with it also nvcc and ninja, whether this machine can build
    the kernel."""
    if not layout.quantized:
        return "a BF16 store (the sm_90a kernel reads low-bit pages)"
    if (layout.kv_lora_rank, layout.rope_dim) != (512, 64):
        return f"latent widths {layout.kv_lora_rank} + {layout.rope_dim} (the sm_90a kernel is built for 512 + 64)"
    if layout.group_size != 64 or layout.rope_bits != 4:
        return f"{layout.scheme} in groups of {layout.group_size} (the sm_90a kernel reads INT4 RoPE in groups of 64)"
    if rows < SM90_ROWS:
        return f"{rows} query rows a sequence (the sm_90a kernel runs {SM90_ROWS} a CTA; fewer run on Triton)"
    if device.type != "cuda":
        return f"a {device.type} tensor"
    if check_machine:
        return missing(device)
    if torch.cuda.is_available() and torch.cuda.get_device_capability(device) != (9, 0):
        major, minor = torch.cuda.get_device_capability(device)
        return f"an sm_{major}{minor} GPU (the kernel is built for sm_90)"
    return None


def query_reason(q_lat: torch.Tensor, q_pe: torch.Tensor) -> str | None:
    """Why the kernel cannot read these queries (``[B, S, H, d]``) in place (``None``: it can): it loads ``q_lat``
    rows 16 bytes and ``q_pe`` 4 bytes at a time, so the channels must be contiguous and the rows so aligned."""
    for name, t, elems in (("q_lat", q_lat, 8), ("q_pe", q_pe, 2)):
        if t.stride(-1) != 1 or any(st % elems for st in t.stride()[:-1]) or t.data_ptr() % (2 * elems):
            return f"{name} rows not {2 * elems}-byte aligned with contiguous channels (strides {tuple(t.stride())})"
    return None


def page_splits(q_lat, q_pe, store, block_table, n_paged, paged_start, op, lp, used, num_splits: int, sink: int,
                recent: int, plan: bool, sms: int, max_splits: int, scale_log2: float) -> None:  # fmt: skip
    """Splits ``0 .. num_splits - 1`` of every sequence into ``op [B, nsp, S * H, 512]`` / ``lp``, and the used
    split counts into ``used``: queries ``[B, S, H, d]`` (bf16), ``store`` a low-bit
    :class:`~quantmla.kernels.layout.PagedLatentStore` that :func:`unsupported` accepts."""
    ext = extension()
    f = store.field
    ext.decode(q_lat, q_pe, f("c_codes"), f("c_sm"), f("r_codes"), f("r_sm"), block_table, n_paged, paged_start, op,
               lp, used, num_splits, sink, recent, plan, sms, max_splits, scale_log2, store.layout.content_bits,
               torch.cuda.current_stream(q_lat.device).cuda_stream)  # fmt: skip
