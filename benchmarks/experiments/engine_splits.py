"""The decode kernel as vLLM runs it, stand-alone: a CUDA graph of one call per layer (27 layers, each its
own pages, so no layer finds its pages in L2), a batch padded to the captured size with empty requests,
the block table as wide as ``max_model_len``, C4R4 (``--scheme c2r4``: C2R4) with the 4 + 128 windows read in place.

    PYTHONPATH=src python benchmarks/experiments/engine_splits.py [--json F]

For each case (real requests x context, graph batch, table width) it times ``mla_decode`` with the splits
planned on the device in a grid sized for the batches vLLM replays in that graph (``min_batch`` one past the
next smaller captured size: ``splits_default``, what the plugin runs) and for any batch from half the graph's
up (``splits_half``, the grid before the plugin passed ``min_batch``), at fixed counts (``splits_N``; before
the plan, the default was ``old_default_splits``, fixed by the graph's batch and the table width), and the
default call on one layer repeated (what the stand-alone serving benchmark measured); ``--chunks`` and
``--window-splits`` time the default call at other combine steps and window programs, ``--fp16-partials`` the
default and fixed split counts with float16 partials, ``--launches`` the default call at other launch parameters
(tile rows / warps / pipeline stages; the defaults were tuned at 32 x 64K, where a split reads far more pages
than at 48 x 4K). Prints a markdown table of µs per call (median of ``--repeats`` replays); ``--json`` is
rewritten after each case, so a run cut short keeps the cases it finished.

``--device cpu`` is a dry run of the same calls under Triton's interpreter (``TRITON_INTERPRET=1``), timed
without a graph: its figures mean nothing, it checks that every variant runs before a GPU call is spent.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch

from quantmla.formats.records import RecordLayout
from quantmla.formats.windows import WindowPolicy
from quantmla.kernels.decode import ShadowWindow, mla_decode
from quantmla.kernels.layout import PagedLatentStore
from quantmla.kernels.splits import default_num_splits, planned_pages_per_split, split_capacity
from quantmla.kernels.write import write_records
from quantmla.serving.vllm.plugin_state import graph_min_batch
from quantmla.serving.windows import ShadowRows, WindowPool

CASES = [(5, 32768, 8, 33792), (5, 32768, 5, 32768), (8, 32768, 8, 33792), (3, 32768, 4, 33792),
         (48, 4096, 48, 6144), (40, 4096, 48, 6144), (6, 12288, 8, 14336)]  # fmt: skip
SPLITS = [0, 22, 33, 44, 53, 66, 88]
VLLM_SIZES = [1, 2, 4, *range(8, 256, 8)]  # vLLM 0.26's default decode capture sizes (to max_num_seqs x 2)


def graph_time(calls, repeats: int, dev: str = "cuda") -> float:
    """Median µs of one call in a CUDA graph of ``calls`` (a list of closures), replayed ``repeats`` times;
    on the CPU (a dry run) the calls in order, by the wall clock."""
    if dev != "cuda":
        ts = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            for fn in calls:
                fn()
            ts.append((time.perf_counter() - t0) * 1e6 / len(calls))
        return statistics.median(ts)
    for fn in calls[:3]:
        fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for fn in calls:
            fn()
    ts = []
    for _ in range(repeats):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        graph.replay()
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b) * 1e3 / len(calls))
    return statistics.median(ts)


def case(real: int, length: int, batch: int, max_len: int, layers: int, repeats: int, scheme: str = "c4r4",
         chunks: tuple[int, ...] = (), window_splits: tuple[int, ...] = (), fp16_partials: bool = False,
         dev: str = "cuda", launches: tuple[tuple[int, int, int], ...] = ()) -> dict:  # fmt: skip
    torch.manual_seed(0)
    bs, h = 64, 16
    lay = RecordLayout(scheme)
    width = -(-max_len // bs)
    pages = -(-length // bs)
    table = torch.zeros(batch, width, dtype=torch.int32, device=dev)
    table[:real, :pages] = torch.arange(real * pages, device=dev, dtype=torch.int32).reshape(real, pages)
    lens = torch.zeros(batch, dtype=torch.int32, device=dev)
    lens[:real] = length
    q = (torch.randn(batch, h, 576, device=dev) / 8).bfloat16()
    wcfg = WindowPolicy(4, 128)
    stores = []
    for _ in range(layers):
        pg = torch.empty(real * pages + 1, bs, lay.record_bytes, dtype=torch.uint8, device=dev)
        c = torch.randn(real * pages * bs, 512, device=dev)
        r = torch.randn(real * pages * bs, 64, device=dev)
        pool = WindowPool(wcfg, pg.shape[0] * bs, batch, dev)
        pool.plan(table.cpu().numpy(), lens.cpu().numpy(), lens.cpu().numpy(), bs)
        shadow = ShadowRows(wcfg, batch, 576, torch.bfloat16, dev)
        write_records(lay, pg, torch.arange(real * pages * bs, device=dev), c, r, shadow_rows=shadow.rows,
                      shadow_map=pool.map)  # fmt: skip
        del c, r
        stores.append(
            (PagedLatentStore.from_pages(pg, lay), ShadowWindow(shadow.rows, pool.map, 4, 128), pg, pool, shadow)
        )
    lo = graph_min_batch(batch, VLLM_SIZES)
    cap = split_capacity(batch, 1, width, torch.device(dev), min_batch=lo)
    row = {"scheme": scheme, "real": real, "L": length, "graph_batch": batch, "table_pages": width,
           "old_default_splits": default_num_splits(batch, 1, width, torch.device(dev)), "min_batch": lo,
           "grid_splits": cap, "grid_splits_half": split_capacity(batch, 1, width, torch.device(dev), -(-batch // 2)),
           "planned_pages_per_split": planned_pages_per_split(lens, 1, cap, bs, 4, 128)}  # fmt: skip

    def timed(layer_stores=stores, n_calls=None, **kw) -> float:
        """µs of the call a layer with ``mla_decode`` keywords ``kw`` (``min_batch`` the graph's by default)."""
        kw = {"min_batch": lo} | kw
        calls = [lambda s=s: mla_decode(q[..., :512], q[..., 512:], s[0], table, lens, 0.1, shadow=s[1], **kw)
                 for s in layer_stores]  # fmt: skip
        return graph_time(calls * (n_calls or 1), repeats, dev)

    row["splits_half_us"] = timed(min_batch=None)  # any batch from half the graph's up
    for ns in SPLITS:
        row[f"splits_{ns or 'default'}_us"] = timed(num_splits=ns or None)
    import quantmla.kernels.decode as dec

    default_chunk = dec.COMBINE_CHUNK
    for c in chunks:  # the combine's splits a step (the default call otherwise)
        dec.COMBINE_CHUNK = c
        row[f"combine_chunk_{c}_us"] = timed()
    dec.COMBINE_CHUNK = default_chunk
    for k in window_splits:  # the window's rows over k programs a sequence (the default call otherwise)
        row[f"window_splits_{k}_us"] = timed(window_splits=k)
    for ns in SPLITS if fp16_partials else ():  # the split partials in float16, at the default and fixed counts
        row[f"fp16_partials_splits_{ns or 'default'}_us"] = timed(num_splits=ns or None, partial_dtype=torch.float16)
    for t, w, st in launches:  # tile rows, warps, pipeline stages (the default call otherwise)
        row[f"launch_{t}_{w}_{st}_us"] = timed(block_t=t, num_warps=w, num_stages=st)
    row["one_layer_repeated_us"] = timed(stores[:1], layers)  # one layer's call, as many times
    del stores
    if dev == "cuda":
        torch.cuda.empty_cache()
    return row


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=27)
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--json", default="")
    ap.add_argument("--scheme", default="c4r4", choices=["c4r4", "c2r4"])
    ap.add_argument("--chunks", default="", help="also time the default call at these combine chunks, e.g. 8,16,32")
    ap.add_argument(
        "--window-splits",
        default="",
        help="also time the default call with the window read by this many programs a sequence, e.g. 1,3,9",
    )
    ap.add_argument("--fp16-partials", action="store_true",
                    help="also time the default and fixed split counts with the partials in float16")  # fmt: skip
    ap.add_argument(
        "--splits", default="", help="the fixed split counts timed (default: 22,33,44,53,66,88; none: no fixed counts)"
    )
    ap.add_argument("--cases", default="", help="e.g. 5x32768/8/33792 (real x L / graph batch / max len), comma list")
    ap.add_argument("--launches", default="",
                    help="also time the default call at BLOCK_T/WARPS/STAGES launches, e.g. 32/4/2,64/8/2")  # fmt: skip
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"],
                    help="cpu: a dry run under Triton's interpreter (figures meaningless)")  # fmt: skip
    args = ap.parse_args()
    if args.device == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        raise SystemExit("--device cpu runs the kernels in Triton's interpreter: set TRITON_INTERPRET=1")
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device here (--device cpu with TRITON_INTERPRET=1 is a dry run)")
    if args.splits:
        SPLITS[1:] = [] if args.splits == "none" else [int(n) for n in args.splits.split(",")]
    launches = tuple(tuple(int(x) for x in la.split("/")) for la in args.launches.split(",") if la)
    if any(len(la) != 3 or la[0] not in (16, 32, 64) for la in launches):
        raise SystemExit(f"--launches {args.launches!r}: BLOCK_T/WARPS/STAGES triples, BLOCK_T one of 16, 32, 64")
    rows = []
    cases = CASES
    if args.cases:
        cases = [(int(c.split("x")[0]), int(c.split("x")[1].split("/")[0]), int(c.split("/")[1]), int(c.split("/")[2]))
                 for c in args.cases.split(",")]  # fmt: skip
    chunks = tuple(int(c) for c in args.chunks.split(",") if c)
    wsplits = tuple(int(k) for k in args.window_splits.split(",") if k)
    for real, length, batch, max_len in cases:
        rows.append(case(real, length, batch, max_len, args.layers, args.repeats, args.scheme, chunks, wsplits,
                         args.fp16_partials, args.device, launches))  # fmt: skip
        print(json.dumps(rows[-1]), flush=True)
        if args.json:  # after each case: a run cut short keeps what it finished
            with open(args.json, "w") as f:
                json.dump(rows, f, indent=1)
    cols = [k for k in rows[0] if k.endswith("_us")]
    print("| real x L | graph batch | table pages | old default splits | grid splits (half) | planned pages a split | "
          + " | ".join(cols) + " |")  # fmt: skip
    print("|---" * (6 + len(cols)) + "|")
    for r in rows:
        print(f"| {r['real']} x {r['L']} | {r['graph_batch']} | {r['table_pages']} | {r['old_default_splits']} | "
              f"{r['grid_splits']} ({r['grid_splits_half']}) | {r['planned_pages_per_split']} | "
              + " | ".join(f"{r[c]:.1f}" for c in cols) + " |")  # fmt: skip


if __name__ == "__main__":
    main()
