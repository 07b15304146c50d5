"""The sm_90a decode kernel's shared-memory arithmetic on the CPU (tests/kernels/sm90_tile.py, step for step as the
CUDA code): every wgmma operand read of the scores (K-major) and of the output (N-major, the same tile) lands
on the value the producer stored there, and the producer's unpack of real records equals the cache's dequant."""

import numpy as np
import pytest
import sm90_tile as tile
import torch

from quantmla.formats.records import RecordLayout

KBASE = 65536  # the first K buffer (1024-aligned)


def test_tile_offsets_are_a_permutation_of_the_tile():
    offs = {tile.tile_offset(t, c) for t in range(64) for c in range(576)}
    assert len(offs) == 64 * 576 and min(offs) == 0 and max(offs) == 9 * tile.BLOCK_BYTES - 2
    assert all(o % 2 == 0 for o in offs)


def test_score_operands_read_token_rows_of_channels():
    """S = Q K^T: B step (block kb, k step ks) reads (token n, channel 64 kb + 16 ks + k)."""
    for kb in range(9):
        for ks in range(4):
            start = tile.scores_operand(KBASE, kb, ks)
            for n in range(64):
                for k in range(16):
                    assert tile.k_major_read(start, n, k) == KBASE + tile.tile_offset(n, 64 * kb + 16 * ks + k)


@pytest.mark.parametrize("swap", [False, True])
def test_value_operands_read_channels_of_token_rows(swap):
    """O += P V: warpgroup wg's step ks reads (channel 256 wg + n, token 16 ks + k) of the same tile; with LBO and
    SBO swapped (the bug this guards) the reads land elsewhere."""
    bad = 0
    for wg in range(2):
        for ks in range(4):
            start, lbo = tile.value_operand(KBASE, wg, ks)
            for n in range(256):
                for k in range(16):
                    got = tile.n_major_read(start, tile.SBO if swap else lbo, n, k)
                    bad += got != KBASE + tile.tile_offset(16 * ks + k, 256 * wg + n)
    assert (bad > 0) == swap


@pytest.mark.parametrize("scheme", ["c4r4", "c2r4"])
def test_the_producer_unpacks_records_as_the_cache_dequantises(scheme):
    g = torch.Generator().manual_seed(0)
    lay = RecordLayout(scheme, 512, 64, 64)
    c = torch.randn(5, 512, generator=g) * 3
    r = torch.randn(5, 64, generator=g) * 3
    rec = lay.pack(c, r).numpy()
    want_c, want_r = lay.unpack(lay.pack(c, r))
    want = torch.cat([want_c, want_r], -1).numpy().astype(np.float16)
    smem = bytearray(KBASE + 9 * tile.BLOCK_BYTES)
    f = lay.fields
    for t in range(5):
        b = rec[t].tobytes()
        parts = [b[f[n][0] : f[n][0] + f[n][1]] for n in ("c_codes", "c_sm", "r_codes", "r_sm")]
        tile.produce_token(smem, KBASE, 3 + 7 * t, *parts, cbits=4 if scheme == "c4r4" else 2)
    for t in range(5):
        row = 3 + 7 * t
        got = np.array([np.frombuffer(smem, np.float16, 1, tile.k_major_read(tile.scores_operand(KBASE, ch // 64,
                        (ch % 64) // 16), row, ch % 16))[0] for ch in range(576)])  # fmt: skip
        np.testing.assert_allclose(got.astype(np.float64), want[t].astype(np.float64), rtol=2e-3, atol=1e-3)
        assert np.abs(got - want[t]).max() < np.abs(want[t]).max() / 64  # every channel at its own place
