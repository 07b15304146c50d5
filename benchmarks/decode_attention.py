"""MLA decode attention on the GPU: our BF16 and low-bit Triton kernels against the copy roofline, a torch
reference, and FlashMLA (BF16) and vLLM's FP8 kernel timed in the same process (benchmarks/flashmla_baseline.py).

    PYTHONPATH=src python benchmarks/decode_attention.py --flashmla-lib DIR --out table.md
    PYTHONPATH=src python benchmarks/decode_attention.py --sweep      # tune launch parameters

One table: per (heads, batch, context, scheme) the median time (do_bench, L2 flushed) of one decode call
replayed from a CUDA graph (the GPU time of its kernels, as a serving stack that captures its decode step
sees it) and of the same call from Python (eager: below ~100 us the Python launch cost dominates), GB/s on
the bytes the kernel must read, % of the measured copy bandwidth, TFLOP/s (2*B*h*L*(576+512)), and the
speedup over our BF16 kernel and over FlashMLA BF16 (graph times) and over the torch reference (eager times).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time

import torch

from quantmla.kernels.layout import PagedLatentStore, PagedLayout

SCHEMES = {"bf16": (16, 16), "c4r4": (4, 4), "c2r4": (2, 4)}
DC, DR, PAGE = 512, 64, 64


def copy_bandwidth_gbs() -> float:
    n = 4 * 1024**3 // 4
    a = torch.empty(n, dtype=torch.float32, device="cuda").uniform_()
    b = torch.empty_like(a)
    import triton.testing

    ms = triton.testing.do_bench(lambda: b.copy_(a), warmup=50, rep=400, return_mode="median")
    return 2 * n * 4 / (ms * 1e-3) / 1e9


def random_store(scheme: str, batch: int, ctx: int, gen: torch.Generator):
    """A full paged store with random contents (timing only; no zeros), and a permuted block table."""
    cb, rb = SCHEMES[scheme]
    lay = PagedLayout(cb, rb, DC, DR, 64, PAGE)
    pages = batch * math.ceil(ctx / PAGE)
    store = PagedLatentStore(lay, pages, device="cuda")
    for name in store.records.fields:
        f = store.field(name)
        if name == "bf16":
            f.view(torch.bfloat16).normal_(generator=gen)
        elif name.endswith("_sm"):
            f.view(torch.float16).uniform_(0.01, 0.1, generator=gen)
        else:
            f.random_(0, 256, generator=gen)
    bt = torch.randperm(pages, device="cuda", generator=gen).view(batch, -1).int()
    n_paged = torch.full((batch,), ctx, dtype=torch.int32, device="cuda")
    return store, bt, n_paged


def torch_reference(q_lat, q_pe, store, bt, n_paged, scale):
    """Batched torch path: gather pages, dequantise to bf16, attend with matmuls (all lengths equal)."""
    lay = store.layout
    B = q_lat.shape[0]
    pages = bt.long()
    if lay.quantized:
        from quantmla.formats.packing import CONTENT_PLANES, ROPE_PLANES, unpack_words

        def sm(name):  # (scale, minimum) per token and group
            return store.field(name)[pages].contiguous().view(torch.float16).unflatten(-1, (-1, 2))

        codes = unpack_words(store.field("c_codes")[pages], lay.content_bits, CONTENT_PLANES).to(torch.bfloat16)
        c_sm, r_sm = sm("c_sm"), sm("r_sm")
        sc = c_sm[..., 0].repeat_interleave(64, -1).to(torch.bfloat16)
        mn = c_sm[..., 1].repeat_interleave(64, -1).to(torch.bfloat16)
        c = (codes * sc + mn).flatten(1, 2)  # [B, P * T, DC]
        rc = unpack_words(store.field("r_codes")[pages], lay.rope_bits, ROPE_PLANES).to(torch.bfloat16)
        r = (rc * r_sm[..., 0].to(torch.bfloat16) + r_sm[..., 1].to(torch.bfloat16)).flatten(1, 2)
    else:
        kv = store.content[pages].flatten(1, 2)
        c, r = kv[..., :DC], kv[..., DC:]
    s = (torch.einsum("bhc,blc->bhl", q_lat, c) + torch.einsum("bhr,blr->bhl", q_pe, r)).float() * scale
    p = torch.softmax(s, -1).to(torch.bfloat16)
    return torch.einsum("bhl,blc->bhc", p, c), torch.logsumexp(s, -1).view(B, -1)


def bench(fn) -> float:
    import triton.testing

    return triton.testing.do_bench(fn, warmup=20, rep=100, return_mode="median") * 1e3  # microseconds


def graph_of(fn) -> torch.cuda.CUDAGraph:
    """``fn`` captured in a CUDA graph (after two warm-up calls on a side stream)."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
        fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return g


def flashmla_row(h, B, L, gen, fp8: bool, s_q: int = 1) -> tuple[float, float | None]:
    """FlashMLA's time for one shape (CUDA graph replay, like ours) and the median SM clock meanwhile."""
    from flashmla_baseline import FlashMLA, SmClock

    fm = FlashMLA(B, s_q, h, L, gen, fp8=fp8)
    fm.call()
    g = graph_of(fm.call)
    clk = SmClock()
    clk.start()
    us = bench(g.replay)
    mhz = clk.stop()
    del g, fm
    torch.cuda.empty_cache()
    return us, mhz


def run_row(h, B, L, scheme, gen, kernel_kw, with_torch: bool, s_q: int = 1):
    """(graph us, eager us, torch reference eager us or None, bytes read); ``s_q`` causal query tokens a
    sequence (``[B, s_q, h, d]`` queries; no torch reference then)."""
    from quantmla.kernels.decode import mla_decode

    store, bt, n_paged = random_store(scheme, B, L, gen)
    shape = (B, h) if s_q == 1 else (B, s_q, h)
    q = torch.randn(*shape, DC, device="cuda", generator=gen).bfloat16()
    qr = torch.randn(*shape, DR, device="cuda", generator=gen).bfloat16()
    with_torch = with_torch and s_q == 1
    scale = 1 / math.sqrt(192)
    call = lambda: mla_decode(q, qr, store, bt, n_paged, scale, **kernel_kw)  # noqa: E731
    eager_us = bench(call)
    g = graph_of(call)
    from flashmla_baseline import SmClock

    clk = SmClock()
    clk.start()
    us = bench(g.replay)
    run_row.mhz = clk.stop()
    del g
    t_us = None
    if with_torch:
        try:
            o_ref, _ = torch_reference(q, qr, store, bt, n_paged, scale)
            o, _ = mla_decode(q, qr, store, bt, n_paged, scale, **kernel_kw)
            rel = float((o.float() - o_ref.float()).norm() / o_ref.float().norm())
            if rel > 2e-2:
                raise RuntimeError(f"kernel disagrees with the torch reference: rel err {rel:.3g}")
            t_us = bench(lambda: torch_reference(q, qr, store, bt, n_paged, scale))
        except torch.OutOfMemoryError:
            t_us = None
    nbytes = B * L * store.layout.bytes_per_token()
    return us, eager_us, t_us, nbytes


def splits_for(per_sm: float, B: int, h: int, max_pages: int) -> int:
    """Splits per sequence for about ``per_sm`` programs per SM (64 heads per program), at most one per
    page and the library's ``MAX_SPLITS``: the launches the benchmark scripts compare."""
    from quantmla.kernels.splits import MAX_SPLITS

    sms = torch.cuda.get_device_properties(0).multi_processor_count
    return max(1, min(max_pages, MAX_SPLITS, math.ceil(per_sm * sms / (B * math.ceil(h / 64)))))


def sweep(
    gen,
    out_json: str | None,
    heads=(16, 128),
    schemes=tuple(SCHEMES),
    stages=(2,),
    muls=(2, 4),
    block_hs=(None,),
    block_ts=(64,),
    warps_big=(8,),
) -> dict:
    """Time launch variants at B=32, 64K for each (heads, scheme); returns the best per (heads, scheme).
    ``block_hs``: heads a program (``None``: the library's choice); ``warps_big``: warps tried above 64 heads."""
    from quantmla.kernels.decode import mla_decode

    B, L = 32, 65536
    best = {}
    for h in heads:
        for scheme in schemes:
            warps = (4, 8) if h <= 64 else warps_big
            grid = [dict(block_t=bt, num_warps=w, num_stages=st, **({} if bh is None else {"block_h": bh}))
                    for w in warps for st in stages for bh in block_hs for bt in block_ts
                    if bh is None or bh <= max(16, h)]  # fmt: skip
            store, bt_, n_paged = random_store(scheme, B, L, gen)
            q = torch.randn(B, h, DC, device="cuda", generator=gen).bfloat16()
            qr = torch.randn(B, h, DR, device="cuda", generator=gen).bfloat16()
            nbytes = B * L * store.layout.bytes_per_token()
            res = []
            for kw in grid:
                for mul in muls:
                    kw2 = dict(kw, num_splits=splits_for(mul, B, h, bt_.shape[1]))
                    try:
                        args = (q, qr, store, bt_, n_paged, 0.07)
                        us = bench(lambda kw2=kw2, args=args: mla_decode(*args, **kw2))
                        k = mla_decode.last_kernel
                        smem = getattr(getattr(k, "metadata", None), "shared", None)
                        res.append((us, dict(kw, split_mul=mul), getattr(k, "n_regs", None),
                                    (getattr(k, "n_spills", None), smem)))  # fmt: skip
                    except Exception as e:  # noqa: BLE001  (a config that does not compile is skipped, and said)
                        print(f"  skip {kw2}: {type(e).__name__}: {str(e)[:100]}", file=sys.stderr)
            res.sort(key=lambda x: x[0])
            for us, kw, regs, spills in res[:4]:
                print(
                    f"sweep h={h} {scheme}: {us:.1f} us ({nbytes / us / 1e3:.0f} GB/s) "
                    f"regs={regs} spills,smem={spills} {kw}",
                    flush=True,
                )
            worst = res[-1]
            print(f"  worst h={h} {scheme}: {worst[0]:.1f} us regs={worst[2]} spills={worst[3]} {worst[1]}", flush=True)
            best[f"{h}/{scheme}"] = res[0][1]
            del store
            torch.cuda.empty_cache()
    if out_json:
        with open(out_json, "w") as fh:
            json.dump(best, fh, indent=1)
    return best


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None, help="write the markdown table here")
    ap.add_argument("--json", default=None, help="write all rows as JSON here")
    ap.add_argument("--sweep", action="store_true", help="tune launch variants first, then use the best ones")
    ap.add_argument("--sweep-json", default=None, help="write the tuned launch parameters here")
    ap.add_argument("--sweep-heads", default="16,128")
    ap.add_argument("--sweep-schemes", default=",".join(SCHEMES))
    ap.add_argument("--sweep-stages", default="2")
    ap.add_argument("--sweep-splits", default="2,4", help="programs per SM (splits x B x head groups / SMs) to time")
    ap.add_argument("--sweep-block-h", default="", help="heads a program to try, e.g. 32,64,128 (default: ours)")
    ap.add_argument("--sweep-block-t", default="64", help="tokens a tile to try")
    ap.add_argument("--sweep-warps", default="8", help="warps to try above 64 heads")
    ap.add_argument("--heads", default="16,128")
    ap.add_argument("--batches", default="1,8,32,128")
    ap.add_argument("--contexts", default="4096,16384,65536,131072")
    ap.add_argument("--queries", default="1", help="query tokens a sequence (speculative decoding: 1 + drafts)")
    ap.add_argument("--kernels", default="auto", help="page kernels to time for the low-bit schemes: auto,sm90,triton")
    ap.add_argument("--flashmla-lib", default=None, help="folder with FlashMLA's .so files from vLLM's wheel")
    ap.add_argument("--no-flashmla", action="store_true", help="skip FlashMLA (not timed in this run)")
    ap.add_argument("--torch-max-tokens", type=int, default=32 * 65536, help="skip the torch reference above B*L")
    args = ap.parse_args()
    kernels = args.kernels.split(",")
    from quantmla.kernels.decode import mla_decode

    gen = torch.Generator(device="cuda").manual_seed(0)
    tuned = {}
    if args.sweep:
        tuned = sweep(
            gen, args.sweep_json, tuple(map(int, args.sweep_heads.split(","))), tuple(args.sweep_schemes.split(",")),
            tuple(map(int, args.sweep_stages.split(","))), tuple(map(float, args.sweep_splits.split(","))),
            tuple(map(int, args.sweep_block_h.split(","))) if args.sweep_block_h else (None,),
            tuple(map(int, args.sweep_block_t.split(","))), tuple(map(int, args.sweep_warps.split(","))),
        )  # fmt: skip
    fm_src = None
    if not args.no_flashmla:
        from flashmla_baseline import load_flashmla

        fm_src = load_flashmla(args.flashmla_lib)
        print(f"FlashMLA: {fm_src}", flush=True)
    bw = copy_bandwidth_gbs()
    print(f"copy bandwidth: {bw:.0f} GB/s ({torch.cuda.get_device_name()})", flush=True)
    rows = []
    t0 = time.time()
    shapes = [(h, B, L, sq) for h in map(int, args.heads.split(",")) for B in map(int, args.batches.split(","))
              for L in map(int, args.contexts.split(",")) for sq in map(int, args.queries.split(","))]  # fmt: skip
    for h, B, L, sq in shapes:
        fm = fm_mhz = fp8 = None
        if fm_src:
            fm, fm_mhz = flashmla_row(h, B, L, gen, fp8=False, s_q=sq)
            try:
                fp8, _ = flashmla_row(h, B, L, gen, fp8=True, s_q=sq)
            except RuntimeError as e:  # said, not hidden: the FP8 column stays empty
                print(f"vLLM FP8 kernel at h={h} B={B} L={L}: {str(e).splitlines()[0][:200]}", flush=True)
        base = None
        for scheme, kern in [(s, k) for s in SCHEMES for k in (["triton"] if s == "bf16" else kernels)]:
            kw = dict(tuned.get(f"{h}/{scheme}", {}), kernel=kern)
            if "split_mul" in kw:
                kw["num_splits"] = splits_for(kw.pop("split_mul"), B, h, math.ceil(L / PAGE))
            us, eager_us, t_us, nbytes = run_row(h, B, L, scheme, gen, kw, B * L <= args.torch_max_tokens, sq)
            base = us if scheme == "bf16" else base
            row = dict(
                h=h,
                B=B,
                L=L,
                s_q=sq,
                scheme=scheme,
                kernel=mla_decode.last_backend,
                us=us,
                eager_us=eager_us,
                gbs=nbytes / us / 1e3,
                pct_copy=100 * nbytes / us / 1e3 / bw,
                tflops=2 * B * sq * h * L * (DC + DC + DR) / us / 1e6,
                vs_bf16=base / us,
                vs_torch=(t_us / eager_us) if t_us else None,
                torch_us=t_us,
                flashmla_us=fm,
                vs_flashmla=(fm / us) if fm else None,
                vllm_fp8_us=fp8,
                sm_mhz=run_row.mhz,
                flashmla_sm_mhz=fm_mhz,
            )
            rows.append(row)
            print(json.dumps(row), flush=True)
    print(f"{len(rows)} rows in {time.time() - t0:.0f} s", file=sys.stderr)
    lines = [
        f"GPU: {torch.cuda.get_device_name()}; measured copy bandwidth {bw:.0f} GB/s (4 GiB device-to-device, "
        "read + write); torch " + torch.__version__ + "; times are do_bench medians with L2 flushed; µs: the "
        "call replayed from a CUDA graph, eager µs: called from Python; FlashMLA BF16 and vLLM's FP8 kernel "
        f"({fm_src or 'not run'}) replayed from a CUDA graph in the same process; MHz: median SM clock while timed "
        "(ours / FlashMLA's).",
        "",
        "| h | B | L | q | scheme | kernel | µs | eager µs | GB/s | % copy BW | TFLOP/s | vs our BF16 | vs torch ref |"
        " FlashMLA BF16 µs | vs FlashMLA | vLLM FP8 µs | MHz |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:

        def f(x, fmt):
            return "-" if x is None else format(x, fmt)

        lines.append(
            f"| {r['h']} | {r['B']} | {r['L'] // 1024}K | {r['s_q']} | {r['scheme']} | {r['kernel']} | {r['us']:.1f} | "
            f"{r['eager_us']:.1f} | "
            f"{r['gbs']:.0f} | "
            f"{r['pct_copy']:.0f}% | {r['tflops']:.1f} | {r['vs_bf16']:.2f}x | {f(r['vs_torch'], '.1f')}x | "
            f"{f(r['flashmla_us'], '.1f')} | {f(r['vs_flashmla'], '.2f')}x | {f(r['vllm_fp8_us'], '.1f')} | "
            f"{f(r['sm_mhz'], '.0f')} / {f(r['flashmla_sm_mhz'], '.0f')} |"
        )
    table = "\n".join(lines)
    print(table)
    if args.out:
        with open(args.out, "w") as fh:
            fh.write(table + "\n")
    if args.json:
        with open(args.json, "w") as fh:
            timing = "do_bench median, L2 flushed; us: CUDA graph replay, eager_us: Python call"
            json.dump({"copy_gbs": bw, "rows": rows, "timing": timing}, fh)


if __name__ == "__main__":
    main()
