import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from quantmla.formats.packing import pack_codes, packed_size, unpack_codes


@settings(max_examples=100, deadline=None)
@given(st.integers(1, 8), st.integers(1, 6), st.integers(1, 4), st.integers(0, 2**31 - 1))
def test_round_trip(bits, n8, rows, seed):
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 2**bits, (rows, 8 * n8), generator=g, dtype=torch.int64).to(torch.uint8)
    packed = pack_codes(codes, bits)
    assert packed.dtype == torch.uint8
    assert packed.shape[-1] == packed_size(8 * n8, bits) == n8 * bits
    assert torch.equal(unpack_codes(packed, bits, 8 * n8), codes)


def test_layout_4bit_low_nibble_first():
    codes = torch.tensor([[1, 2, 3, 4, 5, 6, 7, 15]], dtype=torch.uint8)
    assert pack_codes(codes, 4).tolist() == [[0x21, 0x43, 0x65, 0xF7]]


def test_bad_sizes():
    with pytest.raises(ValueError, match="multiple of 8"):
        pack_codes(torch.zeros(1, 12, dtype=torch.uint8), 4)
    with pytest.raises(ValueError, match="cannot be packed"):
        pack_codes(torch.zeros(1, 8, dtype=torch.uint8), 9)
