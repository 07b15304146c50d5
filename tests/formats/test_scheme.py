import pytest

from quantmla.formats import parse_scheme, valid_scheme_names


@pytest.mark.parametrize(
    "name,bytes_",
    [("bf16", 1152), ("fp8", 656), ("c8r8", 576 + 36), ("c4r4", 324), ("c2r4", 196), ("C4R8", 256 + 32 + 64 + 4)],
)
def test_bytes_per_token(name, bytes_):
    assert parse_scheme(name).bytes_per_token(512, 64, 64) == bytes_


@pytest.mark.parametrize("bad", ["int4", "c5r4", "c4", "c4r16", ""])
def test_unknown_scheme(bad):
    with pytest.raises(ValueError, match="valid: bf16, fp8"):
        parse_scheme(bad)


def test_valid_names_parse():
    for n in valid_scheme_names():
        assert parse_scheme(n).name == n
