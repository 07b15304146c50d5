"""A calibrated export's per-layer codec in an engine's pages (write-side transforms, learned ranges, a format per
layer, records padded to the largest), decoded through the paged decode, against QuantizedLatentCache holding the
same codec: float64 attention over the cache's view of the same tokens (no vLLM needed)."""

import pytest
import torch

from quantmla import QuantizedLatentCache
from quantmla.formats.codec import LayerCodec, ModelCodec, PathCodec
from quantmla.formats.scheme import parse_scheme
from quantmla.serving.layer_codecs import interleaved_to_rotate_half, served_layers
from quantmla.serving.paged_decode import paged_decode
from tiny_models import tiny_config

CFG = tiny_config("deepseek_v3")  # latent 128, RoPE 64, 2 layers
DC, DR, H, BS = 128, 64, 4, 16


def _codec() -> ModelCodec:
    g = torch.Generator().manual_seed(0)

    def transform(d):
        return torch.eye(d, dtype=torch.float64) + 0.2 * torch.randn(d, d, generator=g, dtype=torch.float64) / d**0.5

    s0, s1 = parse_scheme("c4r4"), parse_scheme("c2r3t")
    ranges = (
        0.6 + 0.4 * torch.rand(DC // 64, generator=g, dtype=torch.float64),
        1 + 0.1 * torch.rand(DC // 64, generator=g, dtype=torch.float64),
    )
    layer0 = LayerCodec(PathCodec(s0.content, transform=transform(DC)), PathCodec(s0.rope, transform=transform(DR)))
    layer1 = LayerCodec(PathCodec(s1.content, clip_ratio=ranges[0], gain=ranges[1]), PathCodec(s1.rope))
    return ModelCodec("test codec", (layer0, layer1))


@pytest.mark.parametrize(("backend", "engine_order"), [("torch", False), ("auto", False), ("auto", True)])
def test_served_layers_read_what_the_cache_holds(backend, engine_order):
    """``engine_order``: the engine holds the RoPE key (and its query) in interleaved pairs, the cache rotate-half."""
    codec = _codec()
    order = interleaved_to_rotate_half(DR) if engine_order else None
    layers = served_layers(codec, DC, DR, 64, order)
    back = torch.argsort(torch.tensor(order)) if engine_order else torch.arange(DR)  # cache order -> engine order
    assert len({lay.layout.record_bytes for lay in layers}) == 1  # padded to the largest record
    assert layers[0].layout.record_bytes > layers[1].layout.record_bytes - 1 and not layers[1].layout.dense
    g = torch.Generator().manual_seed(1)
    lens = [37, 80]
    cache = QuantizedLatentCache(CFG, scheme=codec, sink=0, recent=0, backend="torch")
    for i, served in enumerate(layers):
        c = torch.randn(len(lens), 1, max(lens), DC, generator=g, dtype=torch.float64)
        r = torch.randn(len(lens), 1, max(lens), DR, generator=g, dtype=torch.float64)
        cache.update(c, r, i)
        view_c, view_r = cache.layers[i].keys[:, 0].double(), cache.layers[i].values[:, 0].double()
        # the engine: each request's tokens in its own shuffled blocks, written as the layer stores them
        pages = torch.zeros(32, BS, served.layout.record_bytes, dtype=torch.uint8)
        table = torch.randperm(32, generator=g)[: 2 * 5].view(2, 5).int()
        for b, n in enumerate(lens):
            pos = torch.arange(n)
            slots = table[b, pos // BS].long() * BS + pos % BS
            cs, rs = served.stored_space(c[b, 0, :n].float(), r[b, 0, :n, back].float())
            served.layout.write_pages(pages, slots, cs, rs, ranges=served.ranges)
        q_lat = torch.randn(len(lens), H, DC, generator=g)
        q_pe = torch.randn(len(lens), H, DR, generator=g)
        ql, qp = served.queries(q_lat, q_pe[..., back])
        out = served.output(paged_decode(ql, qp, pages, served.layout, table, torch.tensor(lens), 0.1, backend=backend))
        for b, n in enumerate(lens):
            s = (q_lat[b].double() @ view_c[b, :n].T + q_pe[b].double() @ view_r[b, :n].T) * 0.1
            want = torch.softmax(s, -1) @ view_c[b, :n]
            torch.testing.assert_close(out[b].double(), want, atol=2e-4, rtol=2e-4)


def test_a_format_without_a_token_record_is_refused():
    s = parse_scheme("c2r4p64")
    codec = ModelCodec("paged", (LayerCodec(PathCodec(s.content), PathCodec(s.rope)),))
    with pytest.raises(ValueError, match="layer 0 .*per-channel-in-page format 'r4p64' has no per-token record"):
        served_layers(codec, DC, DR, 64)
