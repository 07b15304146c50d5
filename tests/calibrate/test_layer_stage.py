"""The layer stage split over layer subsets and merged equals the stage of one run."""

import pytest
import torch

from quantmla.calibrate import calibrate_model, layer_stage, merge_layer_stages
from tiny_models import tiny_model

CFG = dict(scheme="c2r4", steps=3, num_seqs=4, val_seqs=2, seq_len=32, batch_size=2, progress=False)


def _ids():
    return torch.randint(0, 100, (6, 32), generator=torch.Generator().manual_seed(0))


def _same_transforms(a, b) -> None:
    assert a.keys() == b.keys()
    for idx in a:
        (ca, ra), (cb, rb) = a[idx], b[idx]
        assert torch.equal(ca.rotation, cb.rotation) and torch.equal(ca.scales, cb.scales)
        assert torch.equal(ra.angles, rb.angles) and torch.equal(ra.log_scales, rb.log_scales)


@pytest.mark.parametrize("name", ["deepseek_v3", "longcat_flash"])
def test_merged_subsets_equal_one_run(name):
    whole = layer_stage(tiny_model(name), None, _ids(), **CFG)
    idxs = whole.layers
    assert len(idxs) >= 2
    parts = [layer_stage(tiny_model(name), None, _ids(), layers=[i], **CFG) for i in reversed(idxs)]
    merged = merge_layer_stages(parts)
    assert merged.layers == idxs and merged.key == whole.key
    _same_transforms(merged.chosen, whole.chosen)
    assert merged.rows == whole.rows
    # at least one learned transform moved off its start, so the equality above compares real draws
    assert any(r["content"]["best_step"] > 0 or r["rope"]["best_step"] > 0 for r in whole.rows)


def test_partial_or_overlapping_stages_are_refused():
    one = layer_stage(tiny_model("deepseek_v3"), None, _ids(), layers=[0], **CFG)
    with pytest.raises(ValueError, match=r"lacks layers \[1\]"):
        calibrate_model(tiny_model("deepseek_v3"), None, _ids(), layer_stage=one, model_steps=0, **CFG)
    with pytest.raises(ValueError, match="layer 0 is in stage 0 and stage 1"):
        merge_layer_stages([one, one])
    other = layer_stage(tiny_model("deepseek_v3"), None, _ids(), layers=[1], **{**CFG, "steps": 2})
    with pytest.raises(ValueError, match="different configs"):
        merge_layer_stages([one, other])
    with pytest.raises(ValueError, match=r"layers \[7\] are not cache indices of this model; valid: \[0, 1\]"):
        layer_stage(tiny_model("deepseek_v3"), None, _ids(), layers=[7], **CFG)
