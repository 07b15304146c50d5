"""The progress bar of a long forward says which decoder layer runs, redrawn while the forward runs, at tqdm's own
rate."""

import io

import pytest
import torch
from tqdm import tqdm

from quantmla.measure.progress import layer_postfix
from quantmla.models.loading import load


@pytest.fixture(scope="module")
def model():
    return load("builtin:tiny-mla")[0]


def test_the_bar_shows_each_layer_while_the_forward_runs(model):
    n = model.config.num_hidden_layers
    out = io.StringIO()
    bar = tqdm(total=1, file=out, mininterval=0)
    printed = bar.last_print_t
    with layer_postfix(model, bar), torch.no_grad():
        model(torch.tensor([[5, 6, 7]]))
    text = out.getvalue()  # what the terminal showed before the bar's next update
    where = [text.find(f"layer {i}/{n}") for i in range(1, n + 1)]
    assert all(w >= 0 for w in where) and where == sorted(where), text
    assert bar.last_print_t == printed  # update()'s rate (and ETA) still measured from its own last print
    with torch.no_grad():
        model(torch.tensor([[5]]))  # the hooks are gone after the block
    assert out.getvalue() == text
    bar.close()


def test_the_layers_redraw_no_faster_than_the_bars_mininterval(model):
    n = model.config.num_hidden_layers
    out = io.StringIO()
    bar = tqdm(total=1, file=out, mininterval=3600)
    with layer_postfix(model, bar), torch.no_grad():
        model(torch.tensor([[5, 6, 7]]))
    assert "layer" not in out.getvalue()
    bar.close()  # the final draw: the last layer
    assert f"layer {n}/{n}" in out.getvalue()
