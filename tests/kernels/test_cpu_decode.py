"""The fused CPU decode (:mod:`quantmla.kernels.cpu`) against the torch path of
:func:`quantmla.serving.paged_decode.paged_decode` (which the float64 test of ``tests/serving/test_records.py``
checks, also through the fused decode as its ``auto`` backend)."""

import pytest
import torch

from quantmla.formats.records import RecordLayout
from quantmla.serving.paged_decode import paged_decode


def _fused_or_skip():
    """The fused CPU decode extension; skips where the toolchain is missing, fails where it is there and the
    build breaks."""
    from quantmla.kernels.cpu.build import CPUExtensionUnavailable, extension

    try:
        return extension()
    except CPUExtensionUnavailable as e:
        if "a working build" in str(e):
            raise
        pytest.skip(f"the fused CPU decode needs {e}")


@pytest.mark.parametrize("scheme", ["c4r4", "c2r4"])
@pytest.mark.parametrize("heads", [16, 6, 1])
def test_fused_cpu_decode_equals_the_torch_path(scheme, heads):
    """The C++ decode against the torch path (both float32) on a batch with a 1-token request, requests ending
    inside a page and the window rows of the plugin's policy (paged tokens from ``paged_start``); the pages also
    as a view with a page stride of two pages (as a slice of an engine's larger tensor)."""
    _fused_or_skip()
    lay = RecordLayout(scheme, 512, 64, 32)
    gen = torch.Generator().manual_seed(3)
    lens, bs = [1, 70, 300, 129], 16
    per = -(-max(lens) // bs)
    pages = torch.full((len(lens) * per + 3, bs, lay.record_bytes), 255, dtype=torch.uint8)  # NaN-ish garbage
    table = torch.randperm(pages.shape[0], generator=gen)[: len(lens) * per].reshape(len(lens), per).int()
    for i, n in enumerate(lens):
        slots = table[i, torch.arange(n) // bs].long() * bs + torch.arange(n) % bs
        lay.write_pages(pages, slots, torch.randn(n, 512, generator=gen), torch.randn(n, 64, generator=gen))
    q = torch.randn(len(lens), heads, 576, generator=gen) / 8
    seq = torch.tensor(lens)
    rows = torch.randn(len(lens), 12, 576, generator=gen)
    count, start = torch.tensor([1, 12, 12, 12]), torch.tensor([1, 4, 4, 0])
    strided = torch.zeros(2 * pages.shape[0], *pages.shape[1:], dtype=torch.uint8)[::2]  # a page stride of 2 pages
    strided.copy_(pages)
    for win in ({}, dict(window=rows, window_len=count, paged_start=start)):
        want = paged_decode(q[..., :512], q[..., 512:], pages, lay, table, seq, 0.1, backend="torch", **win)
        got = paged_decode(q[..., :512], q[..., 512:], pages, lay, table, seq, 0.1, backend="cpp", **win)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
        got = paged_decode(q[..., :512], q[..., 512:], strided, lay, table, seq, 0.1, backend="cpp", **win)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_the_extensions_leave_the_language_standard_to_torch():
    """torch's extension builder compiles against torch's headers with the standard they need (C++20 from torch 2.14,
    whose headers stop at ``#error C++20 or later``); a ``-std`` of ours comes after torch's and wins, so the CPU and
    sm_90a builds carry none."""
    from quantmla.kernels.cpu.build import CFLAGS
    from quantmla.kernels.hopper.build import CUDA_FLAGS

    assert not [f for f in (*CFLAGS, *CUDA_FLAGS) if f.startswith("-std")], (CFLAGS, CUDA_FLAGS)
