"""The decode kernels' split plan (:mod:`quantmla.kernels.splits`): the device's figure against the host's
(CPU: Triton's interpreter)."""

import pytest
import torch

pytest.importorskip("triton", reason="triton is an optional dependency (pip install 'quantmla[triton]')")
DEV = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("graph", [True, False])
@pytest.mark.parametrize(
    "lens,sink,recent",
    [([40000] * 5 + [0] * 3, 0, 0), ([40000] * 5, 0, 0), ([33000] * 5 + [0] * 3, 4, 128), ([100, 0, 9000, 3], 4, 128),
     ([0, 0], 0, 0), ([130, 131, 132, 133], 4, 128), ([5000] * 200, 0, 0), ([64 * 300] + [64] * 7, 0, 0)],
)  # fmt: skip
def test_device_split_plan_is_the_host_plan(lens, sink, recent, graph):
    """The kernels plan their splits on the device from the lengths: the same figure as the host's
    :func:`pages_per_split`, which plans for the sequences that have pages (a padded batch plans as its real
    one) and spreads the batch's pages over them; with a grid sized for a graph replaying half its batch or
    more, and with one sized for the launch's batch alone (fewer splits than a shorter real batch plans)."""
    from quantmla.kernels.splits import default_num_splits, pages_per_split, planned_pages_per_split, split_capacity

    dev = torch.device(DEV)
    n = torch.tensor(lens, dtype=torch.int32, device=DEV)
    lo = -(-len(lens) // 2) if graph else len(lens)
    cap = split_capacity(len(lens), 1, max(1, -(-max(lens) // 64)), dev, min_batch=lo)
    per = planned_pages_per_split(n, 1, cap, 64, sink, recent)
    assert per == pages_per_split(lens, 1, cap, 64, dev, sink, recent)
    real = [x for x in lens if x > sink + recent] if sink + recent else [x for x in lens if x]
    if real and len(set(real)) == 1:  # uniform: the real batch's default splits, padding or not
        pages = -(-(real[0] - recent if sink + recent else real[0]) // 64)
        ns = min(default_num_splits(len(real), 1, pages, dev), cap)
        assert per == -(-pages // ns)
    longest = max([-(-(x - recent if sink + recent else x) // 64) for x in real], default=0)
    assert -(-longest // per) <= cap  # never more splits than the grid holds


def test_split_capacity_covers_the_batches_a_graph_replays():
    """A graph's grid holds what every real batch it replays plans (``min_batch`` up to its batch), and no more
    than the worst of them. On the CPU's 4-SM stand-in a graph of 6 replaying 5-6 needs 4 splits, where the
    launch's batch alone plans 3 and half the batch up (3-6) 6."""
    from quantmla.kernels.splits import default_num_splits, split_capacity

    dev = torch.device("cpu")
    for batch, lo in [(6, 5), (8, 5), (8, 3), (16, 9), (48, 41), (48, 24)]:
        assert split_capacity(batch, 1, 96, dev, min_batch=lo) == max(
            default_num_splits(b, 1, 96, dev) for b in range(lo, batch + 1)
        )
    assert (split_capacity(6, 1, 96, dev), split_capacity(6, 1, 96, dev, min_batch=5),
            split_capacity(6, 1, 96, dev, min_batch=3)) == (3, 4, 6)  # fmt: skip
    for bad in (0, 49):
        with pytest.raises(ValueError, match=f"min_batch={bad}"):
            split_capacity(48, 1, 96, dev, min_batch=bad)


def test_large_batches_of_short_sequences_take_four_programs_an_sm(monkeypatch):
    """Past 32 programs a split index, a plan of eight programs an SM that would leave fewer than 4 pages a
    split takes four (48 x 4K on the H200's 132 SMs: 11 splits of 6 pages, not 22 of 3, where each split's
    partial costs as much traffic as half its records); longer sequences keep eight, and so does 128 x 4K
    (9 splits, about 7 pages each, which beat four an SM on the H200). The device plans the same (Triton's
    interpreter on the CPU, with the SM count patched)."""
    from quantmla.kernels import splits

    monkeypatch.setattr(splits, "sm_count", lambda device: 132)
    dev = torch.device(DEV)
    assert splits.default_num_splits(48, 1, 62, dev) == 11
    assert splits.default_num_splits(48, 1, 510, dev) == 22  # 48 x 32K: 22 splits of 24 pages
    assert splits.default_num_splits(40, 1, 62, dev) == 14
    assert splits.default_num_splits(128, 1, 64, dev) == 9
    lens = [4096] * 48
    cap = splits.split_capacity(48, 1, 528, dev, min_batch=41)
    per = splits.planned_pages_per_split(torch.tensor(lens, dtype=torch.int32, device=DEV), 1, cap, 64, 4, 128)
    assert per == splits.pages_per_split(lens, 1, cap, 64, dev, 4, 128) == 6
