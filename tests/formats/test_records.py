"""Token records: sizes = formula, values = the cache's quantisers, paged decode = a float64 reference."""

import pytest
import torch

from quantmla.formats.records import RecordLayout
from quantmla.formats.scheme import parse_scheme
from quantmla.serving.paged_decode import paged_decode

BYTES_576 = {"bf16": 1152, "fp8": 656, "c8r8": 612, "c4r4": 324, "c2r4": 196}
RECORD_SCHEMES = tuple(BYTES_576)


@pytest.mark.parametrize("scheme", RECORD_SCHEMES)
def test_record_bytes_equal_the_scheme_formula(scheme):
    lay = RecordLayout(scheme)
    assert lay.record_bytes == BYTES_576[scheme]
    s = parse_scheme(scheme)
    want = s.bytes_per_token(512, 64) if s.quantized else 2 * 576
    assert lay.record_bytes == want
    assert RecordLayout(scheme, kv_lora_rank=128).record_bytes < lay.record_bytes


@pytest.mark.parametrize("scheme", RECORD_SCHEMES)
@pytest.mark.parametrize("dims", [(512, 64, 64), (128, 64, 32), (256, 64, 16)])
def test_round_trip_equals_the_cache_quantisers(scheme, dims):
    d_c, d_r, g = dims
    if scheme == "fp8" and d_c % 128:
        pytest.skip("fp8 tiles are 128 wide")
    lay = RecordLayout(scheme, d_c, d_r, g)
    gen = torch.Generator().manual_seed(0)
    c = torch.randn(37, d_c, generator=gen) * 3
    r = torch.randn(37, d_r, generator=gen)
    rec = lay.pack(c, r)
    assert rec.dtype == torch.uint8 and rec.shape == (37, lay.record_bytes)
    c2, r2 = lay.unpack(rec)
    s = parse_scheme(scheme)
    for got, fmt, x in ((c2, s.content, c), (r2, s.rope, r)):  # BF16 paths hold the value in BF16
        want = fmt.fake_quantize(x, g) if fmt.quantized else x.to(torch.bfloat16)
        torch.testing.assert_close(got, want.float(), rtol=0, atol=0)


def test_a_paged_format_has_no_token_record():
    with pytest.raises(ValueError, match="per-channel-in-page format 'r4p128' has no per-token record"):
        RecordLayout("c2g128q94r4p128")


def _reference(q_nope, q_pe, c, r, lens, scale):
    out = []
    for i, n in enumerate(lens):
        s = (q_nope[i].double() @ c[i, :n].double().T + q_pe[i].double() @ r[i, :n].double().T) * scale
        out.append(torch.softmax(s, -1) @ c[i, :n].double())
    return torch.stack(out)


@pytest.mark.parametrize(
    ("scheme", "group"),
    [("bf16", 64), ("c4r4", 64), ("c2r4", 64), ("fp8", 64), ("c8r8", 64)]
    + [("c4r4", 16), ("c2r4", 32), ("c4r4", 32), ("c2r4", 16)],
)
@pytest.mark.parametrize("backend", ["torch", "auto"])
def test_paged_decode_matches_float64_attention(scheme, group, backend):
    """Groups smaller than a content plane of codes (16, 32: several a plane) and one (64); on the RoPE
    key (planes of 16 channels) one group a plane (16) or a group over two or four planes (32, 64)."""
    lay = RecordLayout(scheme, 512, 64, group)
    gen = torch.Generator().manual_seed(1)
    lens, bs, h = [1, 5, 37, 16, 64], 16, 4
    num_blocks = 40
    t_max = max(lens)
    c = torch.randn(len(lens), t_max, 512, generator=gen)
    r = torch.randn(len(lens), t_max, 64, generator=gen)
    pages = torch.full((num_blocks, bs, lay.record_bytes), 255, dtype=torch.uint8)  # garbage where unused
    perm = torch.randperm(num_blocks, generator=gen)
    per = -(-t_max // bs)
    table = perm[: len(lens) * per].reshape(len(lens), per).int()
    for i, n in enumerate(lens):
        slots = table[i, torch.arange(n) // bs].long() * bs + torch.arange(n) % bs
        lay.write_pages(pages, slots, c[i, :n], r[i, :n])
    cq, rq = lay.unpack(lay.pack(c.reshape(-1, 512), r.reshape(-1, 64)))
    cq, rq = cq.reshape(c.shape), rq.reshape(r.shape)
    q_nope = torch.randn(len(lens), h, 512, generator=gen) / 8
    q_pe = torch.randn(len(lens), h, 64, generator=gen) / 8
    seq = torch.tensor(lens)
    want = _reference(q_nope, q_pe, cq, rq, lens, 0.1)
    # one chunk; groups of a few requests; chunks of one page a request
    for max_tokens, chunk in ((1 << 16, 4096), (64, 4096), (1 << 16, 16)):
        got = paged_decode(
            q_nope, q_pe, pages, lay, table, seq, 0.1, max_tokens=max_tokens, chunk_tokens=chunk, backend=backend
        )
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(("bits", "planes"), [(4, 8), (2, 8), (4, 4)])
def test_byte_wise_unpack_equals_the_kernels_unpack(bits, planes):
    from quantmla.formats.packing import pack_words, unpack_planar, unpack_words

    codes = torch.randint(0, 1 << bits, (3, 5, planes * 16), generator=torch.Generator().manual_seed(2))
    packed = pack_words(codes, bits, planes)
    assert torch.equal(unpack_planar(packed, bits, planes), codes.to(torch.uint8))
    assert torch.equal(unpack_planar(packed, bits, planes), unpack_words(packed, bits, planes))


def test_paged_decode_backend_errors():
    lay = RecordLayout("fp8", 512, 64, 64)
    pages = torch.zeros(2, 16, lay.record_bytes, dtype=torch.uint8)
    q, table, seq = torch.zeros(1, 4, 576), torch.zeros(1, 1, dtype=torch.int32), torch.tensor([3])
    with pytest.raises(ValueError, match="backend='triton'; valid: auto, torch, cpp"):
        paged_decode(q[..., :512], q[..., 512:], pages, lay, table, seq, 0.1, backend="triton")
    with pytest.raises(RuntimeError, match="no planar 2- or 4-bit codes"):
        paged_decode(q[..., :512], q[..., 512:], pages, lay, table, seq, 0.1, backend="cpp")
