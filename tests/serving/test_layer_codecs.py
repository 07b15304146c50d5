"""A calibrated export's per-layer codec in an engine's pages (write-side transforms, learned ranges, a format per
layer, records padded to the largest), decoded through the paged decode, against QuantizedLatentCache holding the
same codec: float64 attention over the cache's view of the same tokens (no vLLM needed)."""

import pytest
import torch

from quantmla import QuantizedLatentCache
from quantmla.formats.codec import LayerCodec, ModelCodec, PathCodec
from quantmla.formats.scheme import parse_scheme
from quantmla.serving.layer_codecs import interleaved_to_rotate_half, runs_kernels, served_layers
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


@pytest.mark.parametrize("engine_order", [False, True])
def test_from_stored_inverts_the_stored_space(engine_order):
    """A prefill reads its context back from the stored space: ``from_stored(stored_space(c, r)) == (c, r)``, the key
    in the engine's channel order again (float64: exact up to the transform's inverse)."""
    order = interleaved_to_rotate_half(DR) if engine_order else None
    g = torch.Generator().manual_seed(2)
    c, r = torch.randn(9, DC, generator=g, dtype=torch.float64), torch.randn(9, DR, generator=g, dtype=torch.float64)
    for served in served_layers(_codec(), DC, DR, 64, order):
        sc, sr = served.stored_space(c, r)
        if served.transformed:
            assert not torch.allclose(sc.double(), c)  # not the identity: the round trip means something
        if engine_order:
            assert not torch.equal(sr.double(), r) or served.transformed
        bc, br = served.from_stored(sc.double(), sr.double())
        torch.testing.assert_close(bc.double(), c, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(br.double(), r, atol=1e-5, rtol=1e-5)


def test_a_layer_on_its_device_copies_nothing_from_the_host(monkeypatch):
    """After ``to(device)`` the writes' and reads' transforms and RoPE order make no tensor from host data (what a
    CUDA graph could not capture), and they compute what the layer did before the move."""
    order = interleaved_to_rotate_half(DR)
    g = torch.Generator().manual_seed(3)
    c, r = torch.randn(5, DC, generator=g), torch.randn(5, DR, generator=g)
    q_lat, q_pe = torch.randn(5, H, DC, generator=g), torch.randn(5, H, DR, generator=g)

    def steps(lay):
        return (*lay.stored_space(c, r), *lay.queries(q_lat, q_pe), lay.output(q_lat), *lay.from_stored(c, r))

    for served in served_layers(_codec(), DC, DR, 64, order):
        want = steps(served)
        moved = served.to("cpu")

        def no_host_tensor(*args, **kwargs):
            raise AssertionError("a tensor made from host data in a step")

        with monkeypatch.context() as m:
            m.setattr(torch, "tensor", no_host_tensor)
            m.setattr(torch, "as_tensor", no_host_tensor)
            got = steps(moved)
        for a, b in zip(got, want, strict=True):
            torch.testing.assert_close(a, b)


def test_which_layers_the_kernels_serve():
    """The Triton kernels write and read plain per-token bf16 / c4r4 / c2r4 layers, transforms around them; learned
    ranges (the torch quantiser) and other formats take the torch path."""
    codec = _codec()  # layer 0: c4r4 with transforms; layer 1: c2r3t with learned ranges
    s = parse_scheme("c2r4")
    ranged = LayerCodec(PathCodec(s.content, clip_ratio=torch.full((DC // 64,), 0.8), gain=torch.ones(DC // 64)),
                        PathCodec(s.rope))  # fmt: skip
    layers = served_layers(ModelCodec("mixed", (*codec.layers, ranged, LayerCodec.of("c2r4"), LayerCodec.of("bf16"),
                                                 LayerCodec.of("c3r4"))), DC, DR, 64)  # fmt: skip
    assert [runs_kernels(lay) for lay in layers] == [True, False, False, True, True, False]
