"""The one-forward decode-cache simulation equals token-by-token decoding through the real cache."""

import pytest
import torch

from quantmla import QuantizedLatentCache, enable_latent_attention
from quantmla.measure import simulate, simulated_decode
from quantmla.models.compat import cache_kwargs
from tiny_models import tiny_model


def _float64_throughout(model, max_positions: int = 64):
    """transformers computes RMSNorm and the RoPE angles in float32 even in a float64 model, and a prefill of
    29 positions and 29 single-position steps round them differently in the last bit (vectorised and
    scalar code): keys ~1e-9 apart, enough to flip a quantisation code now and then. Here the norms run in
    the model's dtype and the RoPE table is one computation indexed by position, so both paths quantise
    the same values."""
    for mod in model.modules():
        if type(mod).__name__.endswith("RMSNorm"):
            eps = getattr(mod, "variance_epsilon", getattr(mod, "eps", 1e-6))
            mod.forward = lambda x, mod=mod, eps=eps: mod.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True)
                                                                                     + eps))  # fmt: skip
    rope = model.model.rotary_emb
    original = rope.forward

    def forward(x, position_ids):
        table = original(x, torch.arange(max_positions, device=x.device)[None])
        if isinstance(table, tuple):
            return tuple(t[0][position_ids] for t in table)
        return table[0][position_ids]

    rope.forward = forward
    return model


def _fast_and_slow(model, ids, scheme, sink, recent):
    with torch.no_grad():
        with simulated_decode(model, scheme, sink=sink, recent=recent):
            fast = model(ids, use_cache=False).logits
        cache = QuantizedLatentCache(model.config, scheme=scheme, sink=sink, recent=recent)
        steps = [model(ids[:, t : t + 1], **cache_kwargs(cache), use_cache=True).logits for t in range(ids.shape[1])]
    return fast, torch.cat(steps, dim=1)


@pytest.mark.parametrize(
    "name,scheme,sink,recent",
    [
        ("deepseek_v3", "c2r4", 2, 5),
        ("deepseek_v3", "c4r4", 0, 0),
        ("longcat_flash", "c3r4", 3, 1),
        ("deepseek_v2", "fp8", 1, 4),
        ("glm4_moe_lite", "c4r8", 4, 8),
        ("deepseek_v3", "bf16", 4, 8),
        ("deepseek_v3", "c2g32q90r4p8", 2, 5),  # RAQ-MLA's formats: clipped groups, a per-channel-in-page key
        ("deepseek_v2", "c4rm4x16-2x16-3x32", 1, 0),  # mixed widths on the RoPE key
        ("deepseek_v3", "c2tr3t", 2, 5),  # TQ-MSE on both paths
        ("deepseek_v2", "c4rm4x16-2x16-3x32t", 1, 3),  # Block-GTQ's quantiser: TQ-MSE per width group
    ],
)
@pytest.mark.parametrize("chunked", [False, True], ids=["one-pass", "query-chunks"])
def test_simulation_equals_token_by_token_decode(name, scheme, sink, recent, chunked, monkeypatch):
    if chunked:  # the smallest chunk (16 queries): the 29-token rows attend in two chunks
        monkeypatch.setattr(simulate, "SCORE_CHUNK_ELEMENTS", 1)
        monkeypatch.setattr(simulate, "QUERY_CHUNK", 16)
    model = _float64_throughout(enable_latent_attention(tiny_model(name, dtype=torch.float64)))
    ids = torch.randint(3, 256, (2, 29))
    fast, slow = _fast_and_slow(model, ids, scheme, sink, recent)
    # what float32 paths remain (transformers' softmax, routers) leave unquantised decode and prefill ~1e-9
    # apart; the simulation may not differ by more than that noise
    f16, s16 = _fast_and_slow(model, ids, "bf16", sink, recent)
    noise = (f16 - s16).abs().max().item()
    assert (fast - slow).abs().max().item() <= 1e-10 + 4 * noise
    with torch.no_grad():
        plain = model(ids, use_cache=False).logits
    if scheme != "bf16":  # the simulation really quantises
        assert (fast - plain).abs().max().item() > 1e-6
    else:
        assert (fast - plain).abs().max().item() <= 1e-10


def test_simulation_refuses_a_cache():
    model = enable_latent_attention(tiny_model("deepseek_v3", dtype=torch.float64))
    cache = QuantizedLatentCache(model.config, scheme="c4r4")
    with simulated_decode(model, "c4r4"), pytest.raises(ValueError, match="use_cache=False"):
        model(torch.randint(3, 256, (1, 4)), **cache_kwargs(cache), use_cache=True)
        model(torch.randint(3, 256, (1, 1)), **cache_kwargs(cache), use_cache=True)


def test_simulation_is_switched_off_after_the_block():
    model = enable_latent_attention(tiny_model("deepseek_v3", dtype=torch.float64))
    ids = torch.randint(3, 256, (1, 12))
    with torch.no_grad():
        before = model(ids).logits
        with simulated_decode(model, "c2r4", sink=0, recent=0):
            model(ids, use_cache=False)
        assert torch.equal(model(ids).logits, before)


@pytest.mark.parametrize(("sink", "recent"), [(0, 0), (2, 5), (3, 0)])
def test_a_paged_rope_path_reads_its_filling_page_unquantised(sink, recent):
    """Per-channel-in-page RoPE key (``r4p8``): the cache's middle (from position ``sink``) fills pages as tokens
    leave the recent window; query t reads full pages as stored and the page still filling as computed, while
    the content path follows the windows alone. Checked against a float64 brute force, query by query."""
    from quantmla.formats.scheme import parse_scheme
    from quantmla.measure.simulate import SimulatedDecodeCache

    g = torch.Generator().manual_seed(0)
    b, h, s, dn, dc, dr, page = 2, 3, 29, 16, 64, 16, 8
    q_nope, q_pe = torch.randn(b, h, s, dn, generator=g).double(), torch.randn(b, h, s, dr, generator=g).double()
    latent, rope = torch.randn(b, 1, s, dc, generator=g).double(), 3 * torch.randn(b, 1, s, dr, generator=g).double()
    w_uk, w_uv = torch.randn(h, dn, dc, generator=g).double() / 4, torch.randn(h, 8, dc, generator=g).double() / 4
    scheme = parse_scheme(f"c2r4p{page}")
    sim = SimulatedDecodeCache(scheme, group_size=16, sink=sink, recent=recent)
    got = sim.attend(q_nope, q_pe, latent, rope, w_uk, w_uv, 0.2, None)
    c_q = scheme.content.fake_quantize(latent, 16)
    want = torch.empty_like(got)
    for t in range(s):
        j = torch.arange(t + 1)
        window = (j < sink) | (j > t - recent)
        left = max(t - recent - sink + 1, 0)  # tokens past the sinks that left the window
        full = sink + left // page * page  # the middle's full pages end here: quantised with their own tokens
        c = torch.where(window[:, None], latent[:, :, : t + 1], c_q[:, :, : t + 1])
        mid = scheme.rope.fake_quantize(rope[:, :, sink:full], 16)
        r_q = torch.cat([rope[:, :, : min(sink, t + 1)], mid, rope[:, :, full : t + 1]], -2)
        r = torch.where(window[:, None], rope[:, :, : t + 1], r_q)
        qc = torch.einsum("bhd,hdc->bhc", q_nope[:, :, t], w_uk)
        p = torch.softmax(0.2 * (qc[:, :, None] * c).sum(-1) + 0.2 * (q_pe[:, :, t, None] * r).sum(-1), -1)
        want[:, t] = torch.einsum("bhc,hvc->bhv", torch.einsum("bhj,bhjc->bhc", p, c.expand(b, h, -1, dc)), w_uv)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)
    # and the paged path is really read differently from a per-token one: the check can tell them apart
    other = SimulatedDecodeCache(parse_scheme("c2r4"), group_size=16, sink=sink, recent=recent)
    assert (other.attend(q_nope, q_pe, latent, rope, w_uk, w_uv, 0.2, None) - want).abs().max() > 1e-3


def _codec(model, scheme: str, ranges: bool, seed: int = 0):
    """A per-layer codec with random well-conditioned write-side transforms on both paths (RAQ-MLA's form),
    learned ranges on the content path if asked, and the RoPE widths differing by layer for ``m`` formats."""
    from quantmla.formats.codec import LayerCodec, ModelCodec, PathCodec
    from quantmla.formats.scheme import parse_scheme
    from quantmla.models.adapter import get_adapter

    g = torch.Generator().manual_seed(seed)
    adapter = get_adapter(model)
    dims, n = adapter.dims(model.config), adapter.num_cache_layers(model.config)
    s = parse_scheme(scheme)
    layers = []
    for _ in range(n):
        a_c, a_r = (
            torch.eye(d, dtype=torch.float64) + 0.3 * torch.randn(d, d, generator=g, dtype=torch.float64) / d**0.5
            for d in (dims.kv_lora_rank, dims.rope_dim)
        )
        kw = {}
        if ranges:
            groups = dims.kv_lora_rank // s.content.group_size(64)
            kw = {"clip_ratio": 0.7 + 0.3 * torch.rand(groups, generator=g, dtype=torch.float64),
                  "gain": 0.9 + 0.2 * torch.rand(groups, generator=g, dtype=torch.float64)}  # fmt: skip
        layers.append(LayerCodec(PathCodec(s.content, a_c, **kw), PathCodec(s.rope, a_r)))
    return ModelCodec(f"test {scheme}", tuple(layers))


def test_write_side_transforms_are_exact_at_full_precision():
    """RAQ-MLA's form: the latent stored as c A_c (read through W A_c^-T), the RoPE key as k A_R after RoPE with
    the query compensated by A_R^-T: unquantised, the float64 logits are the model's."""
    model = enable_latent_attention(tiny_model("deepseek_v3", dtype=torch.float64))
    ids = torch.randint(3, 256, (2, 29))
    codec = _codec(model, "bf16", ranges=False)
    with torch.no_grad():
        plain = model(ids, use_cache=False).logits
        with simulated_decode(model, codec, sink=2, recent=5):
            got = model(ids, use_cache=False).logits
        wrong = _codec(model, "bf16", ranges=False, seed=1)  # a transform without its compensation is not exact
        for lc in wrong.layers:
            object.__setattr__(lc.rope, "inverse", torch.eye(64, dtype=torch.float64))
        with simulated_decode(model, wrong, sink=2, recent=5):
            broken = model(ids, use_cache=False).logits
    assert (got - plain).abs().max().item() <= 1e-9
    assert (broken - plain).abs().max().item() > 1e-3


@pytest.mark.parametrize(
    "name,scheme,ranges,sink,recent",
    [
        ("deepseek_v3", "c2r4", True, 2, 5),  # RoLaQ's learned ranges behind a transform
        ("deepseek_v2", "c2g64q94r4p8", False, 1, 4),  # RAQ-MLA's formats (page 8) and transforms
        ("glm4_moe_lite", "c4rm4x16-2x16-3x32t", False, 0, 0),  # Block-GTQ's quantiser with transforms
    ],
)
def test_codec_simulation_equals_token_by_token_decode(name, scheme, ranges, sink, recent):
    model = _float64_throughout(enable_latent_attention(tiny_model(name, dtype=torch.float64)))
    ids = torch.randint(3, 256, (2, 29))
    codec = _codec(model, scheme, ranges)
    fast, slow = _fast_and_slow(model, ids, codec, sink, recent)
    f16, s16 = _fast_and_slow(model, ids, "bf16", sink, recent)
    noise = (f16 - s16).abs().max().item()
    # x A is formed on differently shaped tensors in the two paths (last-bit differences that the TQ-MSE rotation
    # carries on): the float64 bar of 1e-9; a wrong compensation or code is > 1e-6 off
    assert (fast - slow).abs().max().item() <= 1e-9 + 4 * noise
    plain_fast, _ = _fast_and_slow(model, ids, scheme, sink, recent)
    assert (fast - plain_fast).abs().max().item() > 1e-6  # the codec changes what is stored
