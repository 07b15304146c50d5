"""Helper of the crop tests: two quantised latent caches read the same, layer by layer."""

import torch


def assert_same_reads(a, b) -> None:
    """``a`` and ``b`` hold as many tokens and every layer reads the same latent and RoPE key, bit for bit."""
    assert a.get_seq_length() == b.get_seq_length()
    for la, lb in zip(a.layers, b.layers, strict=True):
        assert la.get_seq_length() == lb.get_seq_length()
        for x, y in zip(la._view(torch.float32), lb._view(torch.float32), strict=True):
            assert torch.equal(x, y)
