import json
import logging
import shutil

import pytest
import torch
import transformers

import quantmla
from quantmla.models.loading import builtin_path, builtin_text, load_text, resolve_model_path
from tiny_models import tiny_llama, tiny_model


def test_builtin_loads_offline():
    model, tok = quantmla.load("builtin:tiny-mla")
    assert type(model).__name__ == "DeepseekV3ForCausalLM"
    cfg = model.config
    assert (cfg.kv_lora_rank, cfg.qk_rope_head_dim) == (256, 64) and cfg.q_lora_rank is not None
    n = sum(p.numel() for p in model.parameters())
    assert 8e6 <= n <= 15e6
    shards = [f.stat().st_size for f in builtin_path("tiny-mla").glob("*.safetensors")]
    assert sum(shards) <= 20e6 and max(shards) <= 16 * 2**20  # the bundle limits: 20 MB, shards of <= 16 MiB
    ids = tok("The Python interpreter", return_tensors="pt").input_ids
    with torch.no_grad():
        loss = model(ids, labels=ids).loss
    assert torch.isfinite(loss)


def test_bundled_text_splits():
    assert len(builtin_text("test")) > 100_000 and len(builtin_text("validation")) > 100_000
    with pytest.raises(ValueError, match="'validation' and 'test'"):
        builtin_text("train")


def test_unknown_builtin():
    with pytest.raises(ValueError, match="unknown builtin model 'nope'; valid: builtin:tiny-mla"):
        resolve_model_path("builtin:nope")


def test_hub_id_without_network_explains_what_to_do():
    with pytest.raises(ValueError, match="never downloads.*--local-dir DIR"):
        resolve_model_path("deepseek-ai/DeepSeek-V2-Lite")


def _copy_tokenizer(dst):
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(builtin_path("tiny-mla") / f, dst / f)


def test_local_directory_and_kimi_config(tmp_path):
    m = tiny_model("deepseek_v3", dtype=torch.float32)
    m.save_pretrained(tmp_path)
    _copy_tokenizer(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["model_type"] = "kimi_k2"  # as Kimi-K2 ships it; AutoConfig rejects it
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    loaded, _ = quantmla.load(str(tmp_path))
    ids = torch.randint(3, 256, (1, 7))
    with torch.no_grad():
        assert torch.allclose(loaded(ids).logits, m(ids).logits, atol=1e-6)


def test_bad_paths(tmp_path):
    (tmp_path / "f.txt").write_text("x")
    with pytest.raises(ValueError, match="is a file"):
        resolve_model_path(tmp_path / "f.txt")
    with pytest.raises(ValueError, match="no config.json"):
        resolve_model_path(tmp_path)


def test_non_mla_directory_rejected(tmp_path):
    tiny_llama().save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="not a supported MLA architecture"):
        quantmla.load(str(tmp_path))


def test_load_text(tmp_path):
    p = tmp_path / "t.txt"
    p.write_text("hello world")
    assert load_text(p) == "hello world"
    with pytest.raises(ValueError, match="does not exist"):
        load_text(tmp_path / "missing.txt")
    with pytest.raises(ValueError, match="not both"):
        load_text(p, dataset=tmp_path)


def test_load_text_from_saved_dataset(tmp_path):
    datasets = pytest.importorskip("datasets", reason="datasets is an optional extra (pip install 'quantmla[eval]')")
    datasets.DatasetDict({"test": datasets.Dataset.from_dict({"text": ["a b", "", "c"]})}).save_to_disk(tmp_path)
    assert load_text(dataset=tmp_path, split="test") == "a b\n\nc"
    with pytest.raises(ValueError, match="has splits"):
        load_text(dataset=tmp_path, split="train")


def test_dtype_auto_is_float32_on_cpu_and_bfloat16_on_cuda(caplog):
    from quantmla.models.loading import resolve_dtype

    with caplog.at_level(logging.INFO, logger="quantmla.models.loading"):
        model, _ = quantmla.load()
    assert model.dtype == torch.float32
    assert "dtype=auto on cpu: float32" in caplog.text
    assert resolve_dtype("auto", "cuda") == torch.bfloat16 and resolve_dtype("auto", "cuda:1") == torch.bfloat16
    assert resolve_dtype("bfloat16", "cpu") == torch.bfloat16 and resolve_dtype(torch.float64) == torch.float64
    assert quantmla.load(dtype="bfloat16")[0].dtype == torch.bfloat16
    for bad in ("float16", "bf16", torch.float16):
        with pytest.raises(ValueError, match="valid: auto, bfloat16, float32, float64"):
            resolve_dtype(bad)


def test_device_checked_before_loading(monkeypatch):
    from quantmla.models.loading import resolve_device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", _no_weights)
    with pytest.raises(ValueError, match="'cuda' requested, but torch sees no CUDA device here; valid: cpu"):
        quantmla.load(device="cuda")
    with pytest.raises(ValueError, match="'npu' is not a device name"):
        resolve_device("npu")
    assert resolve_device("cpu") == torch.device("cpu")


def _no_weights(*args, **kwargs):
    raise AssertionError("weights were read")


def test_hub_lookup_catches_only_the_hubs_not_found_errors(monkeypatch):
    import huggingface_hub
    from huggingface_hub.errors import LocalEntryNotFoundError

    def raising(exc):
        def f(*args, **kwargs):
            raise exc

        return f

    monkeypatch.setattr(huggingface_hub, "snapshot_download", raising(LocalEntryNotFoundError("not cached")))
    with pytest.raises(ValueError, match="'org/m' is neither .* nor in the local Hugging Face cache"):
        resolve_model_path("org/m")
    monkeypatch.setattr(huggingface_hub, "snapshot_download", raising(OSError("disk")))
    with pytest.raises(ValueError, match="never downloads"):
        resolve_model_path("org/m")
    monkeypatch.setattr(huggingface_hub, "snapshot_download", raising(RuntimeError("a bug")))
    with pytest.raises(RuntimeError, match="a bug"):  # not swallowed into "not available offline"
        resolve_model_path("org/m")
    monkeypatch.undo()
    with pytest.raises(ValueError, match="nor a valid hub id"):
        resolve_model_path("a/b/c")


def test_inspect_model_reads_no_weights(tmp_path, monkeypatch):
    from quantmla.models.loading import inspect_model

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", _no_weights)
    shutil.copy(builtin_path("tiny-mla") / "config.json", tmp_path / "config.json")  # config only, no weights
    src = inspect_model(str(tmp_path))
    assert src.meta is None and (src.dims.kv_lora_rank, src.dims.rope_dim) == (256, 64) and src.num_cache_layers == 8
    meta = {"format": 1, "scheme": "c4r4", "method": "rtn", "group_size": 48, "sink": 4, "recent": 128}
    (tmp_path / "quantmla.json").write_text(json.dumps(meta))
    with pytest.raises(ValueError, match=f"{tmp_path / 'quantmla.json'}: key 'group_size': group_size=48"):
        inspect_model(str(tmp_path))
    with pytest.raises(ValueError, match="key 'group_size'"):
        quantmla.load(str(tmp_path))
    meta["group_size"] = 32
    (tmp_path / "quantmla.json").write_text(json.dumps(meta))
    assert inspect_model(str(tmp_path)).meta == meta
