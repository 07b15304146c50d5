"""The step's block table and sequence lengths on the host, for the window plan, without a device sync.

The window plan (:meth:`quantmla.serving.windows.WindowPool.plan`) runs on the host once a step and needs
the step's block table and lengths there. Copying vLLM's device tensors back would wait for the GPU every
step, so the plugin reads host copies that vLLM's model runners already hold or that it mirrors:

* **model runner V1** (``vllm.v1.worker.block_table.BlockTable``): each block table is a ``CpuGpuBuffer``
  whose host half vLLM writes before copying it up; the plugin remembers it by the device buffer's
  address;
* **model runner V2** (``vllm.v1.worker.gpu``; vLLM 0.26 runs ``DeepseekV2ForCausalLM`` on it by default):
  block tables live on the device only (block ids are staged and written up, and a kernel gathers each
  step's rows by request-state index). The plugin mirrors the staged block ids into host arrays
  (``BlockTables.append_block_ids``) and, when the runner prepares a step's attention inputs, takes that
  step's rows by the request indices the runner holds on the host (``InputBatch.idx_mapping_np``).

The lengths are the host ``seq_lens_cpu_upper_bound`` both runners hand the metadata builder, exact
without speculative decoding.

Where neither is available (a dummy or capture run, an unknown runner, speculative decoding under V2),
the device tensor is copied back: a sync, logged once.
"""

from __future__ import annotations

import numpy as np
import torch

from quantmla.serving.vllm.plugin_state import log_once

#: V1: the host side of vLLM's block tables, by the address of their device buffer
_HOST_TABLES: dict[int, object] = {}
#: V2: the host rows of the next step's block table, by the address of the device table it gathers into
_STEP_ROWS: dict[int, np.ndarray] = {}


def track_block_tables() -> None:
    """Patch vLLM's model runners (V1 and, where this vLLM has it, V2) so :func:`host_block_table` finds
    each step's block table on the host."""
    from vllm.v1.worker.block_table import BlockTable

    original = BlockTable.__init__
    if getattr(original, "_quantmla", False):
        return

    def __init__(self, *args, **kwargs):
        original(self, *args, **kwargs)
        _HOST_TABLES[self.block_table.gpu.data_ptr()] = self.block_table

    __init__._quantmla = True
    BlockTable.__init__ = __init__
    try:
        from vllm.v1.worker.gpu import block_table as v2
    except ImportError:  # a vLLM without model runner V2
        return
    track_v2_block_tables(v2.BlockTables)


def track_v2_block_tables(tables_cls) -> None:
    """Patch V2's ``BlockTables`` class: a host mirror of each table, kept by :func:`mirror_block_ids`; the
    first one built patches the runner (:func:`patch_v2_runner`)."""
    original_init, original_append = tables_cls.__init__, tables_cls.append_block_ids

    def __init__(self, *args, **kwargs):
        original_init(self, *args, **kwargs)
        self.quantmla_host = [np.zeros(tuple(t.gpu.shape), dtype=np.int32) for t in self.block_tables]
        from vllm.v1.worker.gpu.model_runner import GPUModelRunner  # imported by now: it builds these

        patch_v2_runner(GPUModelRunner)

    def append_block_ids(self, req_index: int, new_block_ids, overwrite: bool) -> None:
        original_append(self, req_index, new_block_ids, overwrite)
        mirror_block_ids(self, req_index, new_block_ids)

    tables_cls.__init__ = __init__
    tables_cls.append_block_ids = append_block_ids


def mirror_block_ids(tables, req_index: int, new_block_ids) -> None:
    """Write the block ids vLLM just staged for request-state ``req_index`` into the host mirror of V2's
    ``BlockTables`` (``tables``): the row ends where vLLM's host count ``num_blocks.np`` now ends it, each
    id expanded to the kernel's blocks as vLLM 0.26 does (0.33 keeps the manager's ids: no
    ``blocks_per_kv_block``)."""
    split = getattr(tables, "blocks_per_kv_block", None)
    for i, host in enumerate(tables.quantmla_host):
        ids = new_block_ids[i]
        per = 1 if split is None else split[i]
        if per > 1:
            ids = [b * per + k for b in ids for k in range(per)]
        end = int(tables.num_blocks.np[i, req_index])
        host[req_index, end - len(ids) : end] = ids


def patch_v2_runner(runner_cls) -> None:
    """Record, each time V2's runner gathers a step's block tables, the step's host rows (a copy, taken by
    the host request indices), under the address of the device table the metadata builder receives."""
    original = runner_cls.prepare_attn
    if getattr(original, "_quantmla", False):
        return

    def prepare_attn(self, input_batch):
        tables, slots = original(self, input_batch)
        host = getattr(self.block_tables, "quantmla_host", None)
        if host is not None:
            _STEP_ROWS[tables[0].data_ptr()] = host[0][input_batch.idx_mapping_np]
        return tables, slots

    prepare_attn._quantmla = True
    runner_cls.prepare_attn = prepare_attn


def host_block_table(table: torch.Tensor, n: int) -> np.ndarray:
    """The first ``n`` rows of a step's block table (vLLM's device tensor) on the host, as numpy."""
    if table.device.type == "cpu":
        return table[:n].numpy()
    rows = _STEP_ROWS.pop(table.data_ptr(), None)  # V2: this step's rows, used once
    if rows is not None and rows.shape[1] == table.shape[1]:
        log_once("quantmla windows: planned from host block tables mirrored from vLLM's model runner V2 (no sync)")
        if rows.shape[0] < n:  # padded requests: vLLM's gather fills their rows with block 0
            rows = np.concatenate([rows, np.zeros((n - rows.shape[0], rows.shape[1]), dtype=rows.dtype)])
        return rows[:n]
    buf = _HOST_TABLES.get(table.data_ptr())
    if buf is not None and tuple(buf.gpu.shape[1:]) == tuple(table.shape[1:]):
        log_once("quantmla windows: planned from vLLM's host block table (model runner V1, no sync)")
        return buf.np[:n]
    log_once("quantmla windows: a step's block table had no host copy (a dummy or capture run, or an unknown"
             " model runner); it was copied back from the device: a sync")  # fmt: skip
    return table[:n].cpu().numpy()


def host_seq_lens(cm, n: int, exact_upper_bound: bool) -> np.ndarray:
    """The step's ``n`` sequence lengths on the host (``cm``: vLLM's ``CommonAttentionMetadata``).

    Both runners hand over ``seq_lens_cpu_upper_bound`` (the lengths if every scheduled token is kept:
    exact without speculative decoding, ``exact_upper_bound``); otherwise V1's ``seq_lens_cpu`` is the same
    host copy and V2's copies back from the device."""
    seq = cm.seq_lens[:n]
    if seq.device.type == "cpu":
        return seq.numpy()
    bound = getattr(cm, "seq_lens_cpu_upper_bound", None)
    if bound is not None and exact_upper_bound:
        return bound[:n].numpy()
    log_once("quantmla windows: the step's lengths are taken from seq_lens_cpu (speculative decoding, or no host"
             " bound): under model runner V2 a sync")  # fmt: skip
    host = getattr(cm, "seq_lens_cpu", None)  # vLLM 0.33 has none: the device lengths, copied back
    return (cm.seq_lens[:n].cpu() if host is None else host[:n]).numpy()
