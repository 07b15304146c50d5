import json
import math

import pytest
import torch
from typer.testing import CliRunner

import quantmla
from quantmla import QuantizedLatentCache, enable_latent_attention
from quantmla.cli.main import app
from quantmla.measure.tokens import token_windows
from quantmla.models.compat import cache_kwargs
from quantmla.models.loading import builtin_text

runner = CliRunner()


def _json(res) -> dict:
    return json.loads(res.stdout[res.stdout.index("{") :])


def test_demo_small():
    res = runner.invoke(
        app,
        [
            "demo",
            "--num-seqs",
            "1",
            "--seq-len",
            "160",
            "--new-tokens",
            "4",
            "--schemes",
            "bf16,c4r4",
            "--calibrate-steps",
            "2",
            "--calibrate-model-steps",
            "1",
            "--needle-len",
            "256",
        ],
        env={"COLUMNS": "250"},  # rich's line width: no wrapped titles
    )
    assert res.exit_code == 0, res.output
    text = " ".join(res.output.split())  # rich wraps titles to the table's width
    needle = text[text.index("One needle per scheme") :]
    assert "bf16" in needle and "c4r4" in needle and " yes " in needle  # model v2 retrieves at 256 tokens
    assert "builtin:tiny-mla in float32 on cpu" in text  # the header says what ran (auto on CPU)
    assert "Perplexity on the bundled test split (1 x 160 tokens), float32 on cpu" in text
    assert "unquantised (float32)" in text and "c4r4+quantmla" in text
    assert "allocated storage of a real cache, random values" in text  # labelled for what it is
    assert "324.8" in text  # C4R4 at 128K, DeepSeek geometry: (512/2 + 8*4 + 64/2 + 4) = 324 + windows


def _nll_stock(ids: torch.Tensor) -> float:
    """Mean next-token NLL of the stock model (transformers' own attention, no quantmla path), float64."""
    model, _ = quantmla.load(dtype=torch.float64)
    with torch.no_grad():
        logits = model(ids).logits.double()
    return float(torch.nn.functional.cross_entropy(logits[0, :-1], ids[0, 1:]))


def _nll_decoded(ids: torch.Tensor, scheme: str) -> float:
    """Mean NLL decoding token by token through a real QuantizedLatentCache (sink = recent = 0), float64."""
    model, _ = quantmla.load(dtype=torch.float64)
    enable_latent_attention(model)
    cache = QuantizedLatentCache(model.config, scheme=scheme, sink=0, recent=0)
    nll = 0.0
    with torch.no_grad():
        for t in range(ids.shape[1] - 1):
            logits = model(ids[:, t : t + 1], use_cache=True, **cache_kwargs(cache)).logits.double()
            nll += float(torch.nn.functional.cross_entropy(logits[0, -1:], ids[0, t + 1 : t + 2]))
    return nll / (ids.shape[1] - 1)


def test_eval_ppl_equals_independent_references():
    """The CLI's perplexity against references that share none of its code path: the stock model's loss
    (bf16 = unquantised) and token-by-token decoding through the real cache (c2r4, no windows)."""
    seq = 96
    res = runner.invoke(
        app, ["eval", "ppl", "--scheme", "bf16,c2r4", "--num-seqs", "1", "--seq-len", str(seq), "--no-sink-recent",
              "--dtype", "float64", "--device", "cpu", "--json"],
    )  # fmt: skip
    assert res.exit_code == 0, res.output
    out = _json(res)
    assert (out["dtype"], out["device"]) == ("float64", "cpu")
    r = {x["scheme"]: x for x in out["results"]}
    assert all((x["dtype"], x["device"]) == ("float64", "cpu") for x in r.values())
    assert r["bf16"]["tokens"] == seq - 1 and r["c2r4"]["recent"] == 0 and r["c2r4"]["sink"] == 0
    _, tok = quantmla.load()
    ids = token_windows(tok, builtin_text("test"), seq, 1)  # the first window of the bundled test split
    assert math.isclose(r["bf16"]["nll"], _nll_stock(ids), rel_tol=1e-9, abs_tol=0)
    assert math.isclose(r["c2r4"]["nll"], _nll_decoded(ids, "c2r4"), rel_tol=1e-9, abs_tol=0)
    assert r["c2r4"]["ppl"] > r["bf16"]["ppl"] * 1.01  # 2-bit content without windows costs quality


def test_eval_ppl_bytes_come_from_the_storage_of_this_model():
    """float64 model: the unquantised windows are float64, so the bytes are 8 per value (random BF16
    tensors in a separate cache gave 2); the quantised middle is the packed codes plus fp16 scale words."""
    seq, sink, recent = 64, 4, 8
    res = runner.invoke(
        app, ["eval", "ppl", "--scheme", "c4r4", "--num-seqs", "1", "--seq-len", str(seq), "--sink", str(sink),
              "--recent", str(recent), "--dtype", "float64", "--device", "cpu", "--json"],
    )  # fmt: skip
    assert res.exit_code == 0, res.output
    (r,) = _json(res)["results"]
    d_c, d_r = 256, 64  # the bundled model's latent and RoPE key
    assert r["unquantised_bytes_per_token"] == 8 * (d_c + d_r)
    model, tok = quantmla.load(dtype=torch.float64)
    enable_latent_attention(model)
    cache = QuantizedLatentCache(model.config, scheme="c4r4", sink=sink, recent=recent)
    with torch.no_grad():
        model(token_windows(tok, builtin_text("test"), seq, 1), use_cache=True, **cache_kwargs(cache))
    assert r["bytes_per_token"] == cache.nbytes() / (model.config.num_hidden_layers * seq)
    assert r["cache_backend"] == "torch"


def test_eval_ppl_windows_default_to_the_model_context():
    res = runner.invoke(app, ["eval", "ppl", "--scheme", "bf16", "--num-seqs", "1", "--device", "cpu", "--json"])
    assert res.exit_code == 0, res.output
    (r,) = _json(res)["results"]
    assert r["seq_len"] == 4096 and r["sequences"] == 1  # model v2's max_position_embeddings
    assert r["tokens"] == 4095 and math.isfinite(r["ppl"])


def test_eval_ppl_table_states_dtype_and_device():
    res = runner.invoke(
        app,
        ["eval", "ppl", "--scheme", "bf16", "--num-seqs", "1", "--seq-len", "32", "--device", "cpu"],
        env={"COLUMNS": "250"},
    )
    assert res.exit_code == 0, res.output
    assert "in float32 on cpu" in res.output and "unquantised (float32)" in res.output


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_eval_ppl_on_cuda_defaults_to_bfloat16_and_reads_the_kernel_storage():
    seq, sink, recent = 256, 4, 16
    res = runner.invoke(
        app, ["eval", "ppl", "--scheme", "bf16,c4r4", "--num-seqs", "2", "--seq-len", str(seq), "--sink", str(sink),
              "--recent", str(recent), "--json"],
    )  # fmt: skip
    assert res.exit_code == 0, res.output
    out = _json(res)
    assert (out["dtype"], out["device"]) == ("bfloat16", "cuda")
    r = {x["scheme"]: x for x in out["results"]}
    assert r["bf16"]["bytes_per_token"] == r["c4r4"]["unquantised_bytes_per_token"] == 2 * (256 + 64)
    model, tok = quantmla.load(device="cuda")
    assert model.dtype == torch.bfloat16
    enable_latent_attention(model)
    cache = QuantizedLatentCache(model.config, scheme="c4r4", sink=sink, recent=recent)
    with torch.no_grad():
        model(token_windows(tok, builtin_text("test"), seq, 1).cuda(), use_cache=True, **cache_kwargs(cache))
    assert r["c4r4"]["cache_backend"] == ",".join(sorted(set(cache.backends_used())))
    assert r["c4r4"]["bytes_per_token"] == cache.nbytes() / (model.config.num_hidden_layers * seq)
    assert r["c4r4"]["bytes_per_token"] < r["bf16"]["bytes_per_token"] / 2


def test_version():
    res = runner.invoke(app, ["--version"])
    assert res.exit_code == 0 and res.output.startswith("quantmla ")


def test_eval_ppl_default_is_a_spread_subset_and_all_is_every_window():
    from quantmla.cli.eval_cmd import SUBSET_TOKENS

    n = SUBSET_TOKENS // 512  # the default subset: this many tokens of windows
    res = runner.invoke(app, ["eval", "ppl", "--seq-len", "512", "--scheme", "bf16,c4r4", "--json"])
    assert res.exit_code == 0, res.output
    rows = json.loads(res.stdout[res.stdout.index("{") :])["results"]
    assert all(r["sequences"] == n and r["tokens"] == n * 511 for r in rows)
    assert rows[0]["total_windows"] > n and rows[0]["ppl_ci"][0] < rows[0]["ppl"] < rows[0]["ppl_ci"][1]
    res = runner.invoke(app, ["eval", "ppl", "--seq-len", "64", "--all", "--num-seqs", "3"])
    assert res.exit_code == 2 and "either --all or --num-seqs" in res.output
