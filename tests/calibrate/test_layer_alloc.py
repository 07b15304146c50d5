"""raq-alloc: RAQ-MLA's transforms with each layer's formats allocated within the scheme's bits.

* the greedy allocator keeps the budget, takes only moves that gain, and where every upgrade costs the same it
  is the exhaustive optimum (the k largest gains);
* the menu around a scheme follows its documented rule;
* through ``calibrate_model``: the codec's bytes never exceed the scheme's, the choice is the greedy one on the
  held-out KL the report holds, the transforms keep the float64 function when nothing is quantised, and the
  per-layer schemes round-trip the export.
"""

import itertools
import json

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from float64_codec import float64_norms, unquantised_logit_gap
from quantmla.calibrate import calibrate_model, export
from quantmla.calibrate.layer_alloc import greedy, layer_menu, menu_options
from quantmla.formats.scheme import parse_scheme
from quantmla.models.loading import inspect_model
from tiny_models import tiny_model

TINY = dict(num_seqs=4, val_seqs=2, seq_len=32, batch_size=2, progress=False)


def _ids(n=6, t=32, seed=0):
    return torch.randint(3, 256, (n, t), generator=torch.Generator().manual_seed(seed))


@settings(max_examples=60, deadline=None)
@given(
    gains=st.lists(st.floats(-1.0, 1.0, allow_nan=False), min_size=1, max_size=6),
    k=st.integers(0, 6),
)
def test_greedy_equals_exhaustive_when_every_upgrade_costs_the_same(gains, k):
    n = len(gains)
    costs = [[10.0, 13.0]] * n
    choice = greedy(costs, [[0.0, g] for g in gains], budget=10.0 * n + 3.0 * k)
    best = max(
        (sum(g for g, up in zip(gains, ups, strict=True) if up), ups)
        for ups in itertools.product((0, 1), repeat=n)
        if sum(ups) <= k
    )
    assert sum(g for g, c in zip(gains, choice, strict=True) if c) == pytest.approx(best[0])
    assert sum(choice) <= k and all(g > 0 for g, c in zip(gains, choice, strict=True) if c)


@settings(max_examples=60, deadline=None)
@given(
    layers=st.lists(
        st.lists(st.tuples(st.floats(0.0, 20.0), st.floats(-1.0, 1.0, allow_nan=False)), min_size=1, max_size=4),
        min_size=1,
        max_size=5,
    ),
    slack=st.floats(0.0, 40.0),
)
def test_greedy_keeps_the_budget_and_never_loses_against_the_start(layers, slack):
    costs, gains = [], []
    for opts in layers:
        extra = sorted(c for c, _ in opts)
        costs.append([5.0 + e for e in [0.0, *extra[1:]]])
        gains.append([0.0, *(g for _, g in opts[1:])])
    budget = sum(c[0] for c in costs) + slack
    choice = greedy(costs, gains, budget)
    assert sum(c[k] for c, k in zip(costs, choice, strict=True)) <= budget * (1 + 1e-12)
    assert all(g[k] > 0 for g, k in zip(gains, choice, strict=True) if k)  # a layer moves only for a gain


def test_greedy_spends_bits_per_gain_and_takes_free_moves():
    # layer 1 gains most per byte; layer 0's dearer option gains more in all but costs twice as much
    costs = [[10.0, 20.0], [10.0, 15.0], [10.0, 10.0]]
    gains = [[0.0, 0.6], [0.0, 0.5], [0.0, 0.01]]
    assert greedy(costs, gains, budget=35.0) == [0, 1, 1]  # the free move of layer 2 first, then layer 1
    assert greedy(costs, gains, budget=45.0) == [1, 1, 1]
    with pytest.raises(ValueError, match="over the budget"):
        greedy(costs, gains, budget=29.0)
    with pytest.raises(ValueError, match="ascend"):
        greedy([[2.0, 1.0]], [[0.0, 1.0]], budget=10.0)


@pytest.mark.parametrize(
    "scheme,content,rope",
    [
        ("c2q94r4p64", ["2q94", "2g128q94", "3g128q94"], ["4p64", "3p64"]),
        ("c2g128q94r4p128", ["2g128q94", "3g128q94"], ["4p128", "3p128"]),
        ("c4r4", ["4", "4g128", "8g128"], ["4", "3"]),
        ("c8r8", ["8", "8g128"], ["8", "4"]),
        ("c2r4t", ["2", "2g128", "3g128"], ["4t"]),  # a TQ-MSE key keeps its format
        ("c2r2", ["2", "2g128", "3g128"], ["2"]),  # no narrower integer width
    ],
)
def test_layer_menu_follows_its_rule(scheme, content, rope):
    c, r = layer_menu(scheme)
    assert [f.spec for f in c] == content and [f.spec for f in r] == rope
    opts = menu_options(c, r, 512, 64, 64)
    assert len(opts) == len(c) * len(r)
    assert [o[0] for o in opts] == sorted(o[0] for o in opts)
    s = parse_scheme(scheme)
    assert any(o[1] == s.content and o[2] == s.rope for o in opts)  # the scheme itself is one option


def test_raq_alloc_keeps_the_budget_and_the_float64_function(tmp_path):
    model = tiny_model("deepseek_v3", dtype=torch.float64)
    float64_norms(model)
    scheme = "c2q94r4p8"
    _, rep = calibrate_model(model, None, _ids(), scheme=scheme, method="raq-alloc", model_seq_len=64, **TINY)
    alloc, codec = rep.allocation, rep.codec
    dims = (model.config.kv_lora_rank, model.config.qk_rope_head_dim)
    assert codec.bytes_per_token(*dims) <= parse_scheme(scheme).bytes_per_token(*dims) + 1e-9
    assert alloc["windows"] == [1, 64]  # the held-out windows at the served context
    # the choice is the greedy one on the report's held-out KL
    c, r = layer_menu(scheme)
    opts = menu_options(c, r, *dims, 64)
    names = [f"c{o[1].spec}r{o[2].spec}" for o in opts]
    gains = [[0.0] + [alloc["held_out_kl"]["start"] - alloc["held_out_kl"][f"{i}:{n}"] for n in names[1:]]
             for i in range(len(codec.layers))]  # fmt: skip
    want = greedy([[o[0] for o in opts]] * len(codec.layers), gains, alloc["budget_bytes_per_token"] * len(gains))
    assert alloc["schemes"] == [names[k] for k in want] == [lc.scheme.name for lc in codec.layers]
    # every layer's transforms with nothing quantised: the float64 logits are kept
    assert any(lc.content.transform is not None or lc.rope.transform is not None for lc in codec.layers)
    assert unquantised_logit_gap(model, codec, _ids(2, 24, seed=5)) <= 1e-9

    class Tok:
        def save_pretrained(self, path):
            pass

    export(model, Tok(), tmp_path / "m", rep)
    meta = json.loads((tmp_path / "m" / "quantmla.json").read_text())
    assert meta["method"] == "raq-alloc" and meta["allocation"]["schemes"] == alloc["schemes"]
    back = inspect_model(str(tmp_path / "m")).codec
    assert [lc.scheme.name for lc in back.layers] == alloc["schemes"]
