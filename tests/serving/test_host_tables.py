"""The host copies of a step's block table and lengths (``quantmla.serving.vllm.host_tables``).

vLLM 0.26's model runner V2 keeps block tables on the device only; the plugin mirrors the block ids it
stages. ``_V2Tables`` below does what vLLM 0.26's ``vllm.v1.worker.gpu.block_table.BlockTables`` does with
them (``append_block_ids``: ids expanded to kernel blocks, written from the host count, or from 0 when
``overwrite``; ``gather_block_tables``: the step's rows by request-state index, padded rows block 0),
on a CPU tensor standing in for its device table, so the mirror is checked against what the device
would hold, over many steps of requests joining, growing, being preempted and leaving.
"""

from __future__ import annotations

import sys
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from quantmla.serving.vllm import host_tables as ht


class _Device:
    """A CPU tensor that reports itself as a device tensor, as vLLM's would be."""

    def __init__(self, t: torch.Tensor) -> None:
        self.t = t
        self.device = SimpleNamespace(type="cuda")
        self.shape = t.shape

    def data_ptr(self) -> int:
        return self.t.data_ptr()

    def __getitem__(self, i):
        return _Device(self.t[i])

    def cpu(self) -> torch.Tensor:
        raise AssertionError("the plan copied the device table back (a sync)")


class _V2Tables:
    """``per``: kernel blocks a KV block (vLLM 0.26's ``blocks_per_kv_block``); ``None``: vLLM 0.33's tables,
    which keep the manager's ids and have no such attribute."""

    def __init__(self, max_reqs: int, max_blocks: int, per: int | None) -> None:
        if per is not None:
            self.blocks_per_kv_block = [per]
        per = per or 1
        self.block_tables = [SimpleNamespace(gpu=torch.zeros(max_reqs, max_blocks * per, dtype=torch.int32))]
        self.num_blocks = SimpleNamespace(np=np.zeros((1, max_reqs), dtype=np.int32))
        self.input = torch.zeros(max_reqs, max_blocks * per, dtype=torch.int32)

    def append_block_ids(self, req_index: int, new_block_ids, overwrite: bool) -> None:
        start = self.num_blocks.np[0, req_index] if not overwrite else 0
        ids, per = new_block_ids[0], getattr(self, "blocks_per_kv_block", [1])[0]
        if per > 1:
            ids = [b * per + k for b in ids for k in range(per)]
        self.block_tables[0].gpu[req_index, start : start + len(ids)] = torch.tensor(ids, dtype=torch.int32)
        self.num_blocks.np[0, req_index] = start + len(ids)

    def gather_block_tables(self, idx: np.ndarray, padded: int):
        self.input[:padded] = 0
        self.input[: len(idx)] = self.block_tables[0].gpu[torch.from_numpy(idx).long()]
        return (_Device(self.input[:padded]),)


class _V2Runner:
    def __init__(self, tables: _V2Tables) -> None:
        self.block_tables = tables

    def prepare_attn(self, input_batch):
        return self.block_tables.gather_block_tables(input_batch.idx_mapping_np, input_batch.padded), None


@pytest.fixture
def v2(monkeypatch):
    monkeypatch.setattr(ht, "_STEP_ROWS", {})
    runner_cls = type("Runner", (_V2Runner,), {})
    tables_cls = type("Tables", (_V2Tables,), {})
    # the module the patched constructor imports the runner from (vLLM's, where vLLM is installed)
    monkeypatch.setitem(sys.modules, "vllm.v1.worker.gpu.model_runner", SimpleNamespace(GPUModelRunner=runner_cls))
    ht.track_v2_block_tables(tables_cls)
    return tables_cls, runner_cls


@pytest.mark.parametrize("per", [1, 4, None])
def test_v2_host_rows_equal_the_device_gather_over_many_steps(v2, per):
    tables_cls, runner_cls = v2
    tables = tables_cls(max_reqs=8, max_blocks=12, per=per)
    runner = runner_cls(tables)
    rng = np.random.default_rng(0)
    live: dict[int, int] = {}  # request-state index -> kv blocks
    steps = 0
    for _ in range(60):
        for r in range(8):  # join, grow, get preempted and recomputed (overwrite), or leave
            u = rng.random()
            if r not in live and u < 0.3:
                live[r] = int(rng.integers(1, 4))
                tables.append_block_ids(r, ([int(b) for b in rng.integers(0, 500, live[r])],), True)
            elif r in live and u < 0.3 and live[r] < 11:
                tables.append_block_ids(r, ([int(rng.integers(0, 500))],), False)
                live[r] += 1
            elif r in live and u < 0.35:
                live[r] = int(rng.integers(1, 4))
                tables.append_block_ids(r, ([int(b) for b in rng.integers(0, 500, live[r])],), True)
            elif r in live and u < 0.4:
                del live[r]
        if not live:
            continue
        idx = rng.permutation(np.array(sorted(live), dtype=np.int32))
        padded = min(8, len(idx) + int(rng.integers(0, 3)))  # vLLM pads to at most max_num_seqs
        (device,), _ = runner.prepare_attn(SimpleNamespace(idx_mapping_np=idx, padded=padded))
        host = ht.host_block_table(device, padded)
        np.testing.assert_array_equal(host, device.t.numpy())  # the whole row, stale tail included
        steps += 1
    assert steps > 40


def test_v2_rows_are_used_once_then_a_logged_copy(v2, monkeypatch):
    tables_cls, runner_cls = v2
    tables = tables_cls(max_reqs=2, max_blocks=4, per=1)
    tables.append_block_ids(0, ([7, 9],), True)
    (device,), _ = runner_cls(tables).prepare_attn(SimpleNamespace(idx_mapping_np=np.array([0]), padded=1))
    assert ht.host_block_table(device, 1).tolist() == [[7, 9, 0, 0]]
    with pytest.raises(AssertionError, match="copied the device table back"):
        ht.host_block_table(device, 1)  # a second build of the same step (or a dummy run) has no host rows


def test_lengths_from_the_host_bound_only_when_exact():
    cm = SimpleNamespace(seq_lens=_Device(torch.tensor([5, 9])), seq_lens_cpu_upper_bound=torch.tensor([5, 9, 0]),
                         seq_lens_cpu=torch.tensor([4, 8]))  # fmt: skip
    assert ht.host_seq_lens(cm, 2, exact_upper_bound=True).tolist() == [5, 9]
    assert ht.host_seq_lens(cm, 2, exact_upper_bound=False).tolist() == [4, 8]  # speculative decoding
    # vLLM 0.33's metadata has no seq_lens_cpu: the device lengths, copied back (a logged sync)
    copied = []
    first_two = SimpleNamespace(device=SimpleNamespace(type="cuda"),
                                cpu=lambda: copied.append(1) or torch.tensor([6, 11]))  # fmt: skip
    cm033 = SimpleNamespace(seq_lens=_Sliced(first_two), seq_lens_cpu_upper_bound=torch.tensor([7, 12]))
    assert ht.host_seq_lens(cm033, 2, exact_upper_bound=True).tolist() == [7, 12] and not copied
    assert ht.host_seq_lens(cm033, 2, exact_upper_bound=False).tolist() == [6, 11] and copied == [1]


class _Sliced:
    """A device tensor stand-in whose slices are ``part`` (``device`` and ``cpu()``)."""

    def __init__(self, part) -> None:
        self.part, self.device = part, part.device

    def __getitem__(self, i):
        return self.part
