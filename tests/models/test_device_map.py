"""Models larger than one device: accelerate's device map (GPUs, then the host, then disk) through
``quantmla.models.loading``; latent attention reads the offloaded up-projection through its hook. On CPU the map
puts layers on disk when ``max_memory`` is small: the same perplexity as the model in memory."""

import pytest
import torch

from fp8_checkpoints import write_v3_fp8_checkpoint
from quantmla.eval.ppl import PerplexityConfig, perplexity
from quantmla.models.loading import Placement, builtin_text, load, load_model, parse_max_memory

pytest.importorskip("accelerate")


def test_a_disk_offloaded_model_gives_the_same_perplexity():
    cfg = PerplexityConfig(scheme="c4r4", seq_len=256, num_seqs=2, batch_size=2)
    model, tok = load("builtin:tiny-mla")
    want = perplexity(model, tok, builtin_text(), cfg, progress=False)
    mapped, _ = load("builtin:tiny-mla", placement=Placement(device_map="auto", max_memory={"cpu": "20MiB"}))
    assert "disk" in set(mapped.hf_device_map.values())  # some layers wait on disk
    got = perplexity(mapped, tok, builtin_text(), cfg, progress=False)
    assert got.ppl == pytest.approx(want.ppl, rel=1e-6) and got.bytes_per_token == want.bytes_per_token


def test_an_fp8_checkpoint_loads_with_a_device_map_without_a_whole_state_dict(tmp_path, monkeypatch):
    import quantmla.models.loading as loading

    src = write_v3_fp8_checkpoint(tmp_path / "src", layers=2)
    x = torch.randint(3, 500, (1, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = load_model(src, dtype="float32")(x).logits

        def whole(*a, **k):
            raise AssertionError("the device-map path built the whole state dict in host memory")

        monkeypatch.setattr(loading, "read_state_dict", whole)
        placement = Placement(device_map="auto", max_memory={"cpu": "2MiB"}, offload_folder=str(tmp_path / "off"))
        mapped = load_model(src, dtype="float32", placement=placement)
        got = mapped(x).logits
    assert "disk" in set(mapped.hf_device_map.values())
    assert (tmp_path / "off" / "dequantized" / "model.safetensors.index.json").is_file()
    torch.testing.assert_close(got, want)


def test_dequantized_shards_hold_every_tensor_within_their_size(tmp_path):
    from safetensors import safe_open

    from quantmla.models.fp8_checkpoint import Fp8Blocks, read_state_dict, write_dequantized

    src = write_v3_fp8_checkpoint(tmp_path / "src", layers=2)
    want = read_state_dict(src, Fp8Blocks(), torch.float32)
    limit = 1 << 20
    out = write_dequantized(src, Fp8Blocks(), torch.float32, tmp_path / "dq", shard_bytes=limit)
    seen = {}
    for f in sorted(out.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as st:
            tensors = {k: st.get_tensor(k) for k in st.keys()}  # noqa: SIM118
        size = sum(t.numel() * t.element_size() for t in tensors.values())
        assert size <= limit or len(tensors) == 1, (f.name, size)
        seen |= tensors
    assert len(list(out.glob("*.safetensors"))) > 1
    assert seen.keys() == want.keys() and all(torch.equal(seen[k], want[k]) for k in want)


@pytest.mark.parametrize(
    ("kwargs", "fragment"),
    [
        (dict(device_map="balanced"), "device_map='balanced'; valid: auto"),
        (dict(max_memory={"cpu": "1GiB"}), "max_memory applies to device_map='auto'"),
        (dict(device_map="auto", max_memory={"gpu0": "1GiB"}), "max_memory key 'gpu0'"),
        (dict(device_map="auto", max_memory={"cpu": "lots"}), "max_memory size 'lots'"),
    ],
)
def test_a_bad_placement_is_one_clear_error(kwargs, fragment):
    with pytest.raises(ValueError, match=fragment.replace("(", r"\(").replace(")", r"\)")):
        Placement(**kwargs)


def test_max_memory_text():
    assert parse_max_memory("0=70GiB,cpu=200GiB") == {0: "70GiB", "cpu": "200GiB"}
    with pytest.raises(ValueError, match="DEVICE=SIZE"):
        parse_max_memory("70GiB")
