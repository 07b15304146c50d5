"""``quantmla convert`` end to end on a tiny random Qwen3 directory, and its refusals before any weight is read."""

import json

import pytest
import torch
from transformers import Qwen3Config, Qwen3ForCausalLM
from typer.testing import CliRunner

from quantmla.cli.main import app
from quantmla.models.loading import load_tokenizer

runner = CliRunner()


@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory):
    tok = load_tokenizer("builtin:tiny-mla")
    cfg = Qwen3Config(vocab_size=len(tok), hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
                      tie_word_embeddings=True)  # fmt: skip
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("qwen3")
    Qwen3ForCausalLM(cfg).save_pretrained(path)
    tok.save_pretrained(path)
    return path


SMALL = ["--num-seqs", "4", "--val-seqs", "2", "--seq-len", "64", "--batch-size", "2", "--dtype", "float32"]


def test_convert_distils_and_writes_a_deepseek_directory(qwen3_dir, tmp_path):
    out = tmp_path / "mla"
    args = ["convert", str(qwen3_dir), "--rope-pairs", "2", "--latent-rank", "16", "--out", str(out), *SMALL,
            "--distill-steps", "3", "--distill-batch", "2"]  # fmt: skip
    res = runner.invoke(app, args)
    assert res.exit_code == 0, res.output
    assert "DeepSeek export, distilled 3 steps" in res.output
    flat = " ".join(res.output.split())  # (rich wraps at the terminal's width)
    assert "no quantmla group size (16, 32, 64, 128) divides both the latent (16) and the RoPE key (4)" in flat
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "deepseek_v3" and config["kv_lora_rank"] == 16 and config["qk_rope_head_dim"] == 4
    record = json.loads((out / "mlafication.json").read_text())
    assert record["cache_elements"] == {"converted": 20, "source": 64, "share": 20 / 64}
    assert len(record["distillation"]["curve"]) >= 2
    assert set(record["kl_to_source"]) == {
        "converted layers, per-KV-head RoPE (not exportable)", "DeepSeek export", "DeepSeek export, distilled 3 steps"
    }  # fmt: skip
    from quantmla.models.loading import load

    model, tok = load(str(out), dtype="float32")
    assert model.config.model_type == "deepseek_v3" and len(tok) == config["vocab_size"]


@pytest.mark.parametrize("extra,match", [
    (["--latent-rank", "100000"], "latent_rank=100000"),
    (["--rope-pairs", "3"], "must divide the head's 8 pairs"),
    (["--rope", "contribution"], "rope='contribution'"),
    (["--to", "gqa"], "--to 'gqa'; valid: mla"),
    (["--svd", "random"], "svd='random'"),
    (["--num-seqs", "100000"], "windows of 64 tokens"),
])  # fmt: skip
def test_bad_input_is_one_line_before_any_weight(qwen3_dir, tmp_path, extra, match):
    args = ["convert", str(qwen3_dir), "--rope-pairs", "2", "--latent-rank", "16", "--out", str(tmp_path / "o"),
            *SMALL, *extra]  # fmt: skip
    res = runner.invoke(app, args)
    assert res.exit_code == 2, res.output
    assert match in " ".join(res.output.split())
    assert not (tmp_path / "o").exists()


def test_an_mla_model_is_refused_with_the_families_that_convert(tmp_path):
    res = runner.invoke(app, ["convert", "builtin:tiny-mla", "--rope-pairs", "2", "--latent-rank", "8",
                              "--out", str(tmp_path / "o")])  # fmt: skip
    assert res.exit_code == 2
    assert "model_type='deepseek_v3'" in res.output and "qwen3_moe" in " ".join(res.output.split())
