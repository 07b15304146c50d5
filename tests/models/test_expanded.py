"""The expanded form of MLA attention equals the absorbed form (float64), for every mask convention."""

import pytest
import torch

from quantmla.models.expanded import expanded_is_cheaper, expanded_latent_attention, padded_sdpa
from quantmla.models.latent import absorbed_attention


def _inputs(b=2, h=3, s=7, l_kv=7, d_n=5, d_r=4, d_c=16, d_v=6, seed=0):
    g = torch.Generator().manual_seed(seed)

    def r(*shape):
        return torch.randn(*shape, generator=g, dtype=torch.float64)

    return r(b, h, s, d_n), r(b, h, s, d_r), r(b, 1, l_kv, d_c), r(b, 1, l_kv, d_r), r(h, d_n, d_c), r(h, d_v, d_c)


@pytest.mark.parametrize("s,l_kv", [(7, 7), (3, 9), (1, 5)])
@pytest.mark.parametrize("mask_kind", ["none", "causal-bool", "padding-bool", "additive"])
def test_expanded_equals_absorbed(s, l_kv, mask_kind):
    q_nope, q_pe, lat, rk, w_uk, w_uv = _inputs(s=s, l_kv=l_kv)
    causal = torch.ones(s, l_kv, dtype=torch.bool).tril(l_kv - s)
    mask = {
        "none": None,
        "causal-bool": causal[None, None].expand(2, 1, s, l_kv),
        # key 1 of batch row 1 is masked out (no query loses every key: each sees key 0)
        "padding-bool": torch.stack([causal, causal & (torch.arange(l_kv) != 1)])[:, None],
        "additive": torch.where(causal, 0.0, float("-inf")).to(torch.float64)[None, None]
        + torch.linspace(-0.5, 0.5, l_kv, dtype=torch.float64),
    }[mask_kind]
    ref = absorbed_attention(q_nope, q_pe, lat, rk, w_uk, w_uv, 0.3, mask)
    out = expanded_latent_attention(q_nope, q_pe, lat, rk, w_uk, w_uv, 0.3, mask)
    assert out.shape == ref.shape
    assert (out - ref).abs().max().item() < 1e-12


def test_padded_sdpa_pads_and_slices_the_value_width():
    g = torch.Generator().manual_seed(1)
    q, k = (
        torch.randn(1, 2, 5, 8, generator=g, dtype=torch.float64),
        torch.randn(1, 2, 5, 8, generator=g, dtype=torch.float64),
    )
    v = torch.randn(1, 2, 5, 3, generator=g, dtype=torch.float64)
    out = padded_sdpa(q, k, v, 0.5, None, causal=True)
    scores = (q @ k.transpose(-1, -2) * 0.5).masked_fill(~torch.ones(5, 5, dtype=torch.bool).tril(), float("-inf"))
    assert out.shape == (1, 2, 5, 3)
    assert (out - torch.softmax(scores, -1) @ v).abs().max().item() < 1e-12


def test_expanded_is_cheaper_for_prefills_not_for_decode_steps():
    dims = dict(d_c=512, d_n=128, d_r=64, d_v=128)  # DeepSeek-V3
    assert not expanded_is_cheaper(1, 4096, **dims)
    assert expanded_is_cheaper(4096, 4096, **dims)
    tiny = dict(d_c=256, d_n=32, d_r=64, d_v=32)  # the bundled model
    assert not expanded_is_cheaper(4, 4096, **tiny)
    assert expanded_is_cheaper(512, 4096, **tiny)
