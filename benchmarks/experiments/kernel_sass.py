"""Compile the decode kernels for sm_90 *without a GPU* and report what the compiler made of them:
registers, spills (stack), shared memory and the SASS instruction mix per warp.

Triton's wheel carries ptxas and cuobjdump, so this runs on any machine with triton installed; it is
how the low-bit kernel was tuned between GPU runs (the static counts cover one 64-token tile plus the
prologue and epilogue).

    python benchmarks/experiments/kernel_sass.py                      # both kernels, default launches
    python benchmarks/experiments/kernel_sass.py --bits 4 --warps 8 --stages 2 --block-h 64 --top 30
    python benchmarks/experiments/kernel_sass.py --bits 4 --maxnreg 168 --loop   # register cap; the hot loop's mix

``--loop`` also counts the instructions of the hottest loop (the widest backward branch): one
64-token tile per warp, without prologue and epilogue.

The counts are those of the installed triton. Triton versions lay kernels out differently (a change
that 3.9 compiled well, 3.6 did not: BENCHMARKS.md), so compile with the GPU image's version too:

    python -m venv --system-site-packages /tmp/v36 && /tmp/v36/bin/pip install --no-deps triton==3.6.0
    PYTHONPATH=src:benchmarks /tmp/v36/bin/python benchmarks/experiments/kernel_sass.py --loop
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import subprocess
import tempfile

import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

BIN = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")


def compile_sm90(fn, sig: dict, consts: dict, num_warps: int, num_stages: int, maxnreg: int | None = None):
    """Compile with the specialisations a real launch gets (16-byte aligned pointers, H % 16 == 0)."""
    attrs = {
        (i,): [["tt.divisibility", 16]]
        for i, n in enumerate(sig)
        if sig[n].startswith("*") or n in ("H", "MAXP") or n.endswith("_PS")
    }
    sig = dict(sig, **{k: "constexpr" for k in consts})
    src = ASTSource(fn=fn, signature=sig, constexprs=consts, attrs=attrs)
    opts = dict(num_warps=num_warps, num_stages=num_stages, **({"maxnreg": maxnreg} if maxnreg else {}))
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=opts)


def _cuobjdump(kernel, flag: str) -> str:
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        return subprocess.run([os.path.join(BIN, "cuobjdump"), flag, f.name], capture_output=True, text=True).stdout


def loop_mix(kernel) -> collections.Counter:
    """Instruction mix of the hottest loop: the instructions between the widest backward branch's
    target and the branch."""
    lines = []
    for line in _cuobjdump(kernel, "--dump-sass").splitlines():
        m = re.match(r"\s+/\*([0-9a-f]+)\*/\s+(.*?);", line)
        if m:
            lines.append((int(m.group(1), 16), m.group(2)))
    index = {a: i for i, (a, _) in enumerate(lines)}
    best = (0, -1)
    for i, (a, ins) in enumerate(lines):
        m = re.search(r"BRA\s+(?:`\(\.L_x_\d+\)\s*)?(0x[0-9a-f]+)", ins)
        if m and int(m.group(1), 16) < a and int(m.group(1), 16) in index:
            j = index[int(m.group(1), 16)]
            if i - j > best[1] - best[0]:
                best = (j, i)
    mix = collections.Counter()
    for _, ins in lines[best[0] : best[1] + 1]:
        mix[re.sub(r"^@!?U?P\w+\s+", "", ins).split()[0].split(".")[0]] += 1
    return mix


def report(kernel) -> dict:
    usage = dict(re.findall(r"(REG|STACK|SHARED|LOCAL):(\d+)", _cuobjdump(kernel, "--dump-resource-usage")))
    mix = collections.Counter()
    for line in _cuobjdump(kernel, "--dump-sass").splitlines():
        m = re.match(r"\s+/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+\s+)?([A-Z0-9_]+)", line)
        if m:
            mix[m.group(1)] += 1
    return {"registers": int(usage.get("REG", 0)), "stack_bytes": int(usage.get("STACK", 0)),
            "shared_bytes": kernel.metadata.shared, "instructions": sum(mix.values()), "mix": mix}  # fmt: skip


def _signature(fn, types: dict) -> dict:
    """Every argument of ``fn`` in order: its type from ``types``, else ``i32``."""
    return {n: types.get(n, "i32") for n in fn.arg_names}


def lowbit(bits: int, block_h: int, warps: int, stages: int, dc: int = 512, maxnreg: int | None = None):
    from quantmla.kernels.decode_lowbit import lowbit_kernel
    from quantmla.kernels.splits import MAX_SPLITS, PLAN_BLOCK

    types = dict(Q="*bf16", QR="*bf16", CW="*i32" if bits == 4 else "*i16", CSM="*i32", RW="*i16", RSM="*i32",
                 BT="*i32", NPAGED="*i32", KSTART="*i32", OP="*fp32", LP="*fp32", NUSED="*i32", scale_log2="fp32",
                 ROWS="*bf16", MAP="*i32", TRASH="i64")  # fmt: skip
    consts = dict(DC=dc, DR=64, G=64, PAGE=64, BLOCK_T=64, BLOCK_H=block_h, CBITS=bits, ASM_OK=True, DT=tl.float16,
                  WS=0, WR=0, SUB=4, WBLOCK_T=16, PLAN=True, SMS=132, MAXS=MAX_SPLITS, PLAN_B=PLAN_BLOCK)  # fmt: skip
    sig = {n: t for n, t in _signature(lowbit_kernel, types).items() if n not in consts}
    return compile_sm90(lowbit_kernel, sig, consts, warps, stages, maxnreg)


def bf16(block_h: int, warps: int, stages: int, dc: int = 512, maxnreg: int | None = None):
    from quantmla.kernels.decode import _paged_kernel
    from quantmla.kernels.splits import MAX_SPLITS, PLAN_BLOCK

    types = dict(Q="*bf16", QR="*bf16", KV="*bf16", BT="*i32", NPAGED="*i32", KSTART="*i32", OP="*fp32", LP="*fp32",
                 NUSED="*i32", scale_log2="fp32")  # fmt: skip
    consts = dict(DC=dc, DR=64, PAGE=64, BLOCK_T=64, BLOCK_H=block_h, DT=tl.bfloat16, PLAN=True, SMS=132,
                  MAXS=MAX_SPLITS, PLAN_B=PLAN_BLOCK)  # fmt: skip
    sig = {n: t for n, t in _signature(_paged_kernel, types).items() if n not in consts}
    return compile_sm90(_paged_kernel, sig, consts, warps, stages, maxnreg)


def main() -> None:
    from quantmla.kernels.decode import default_launch

    ap = argparse.ArgumentParser()
    ap.add_argument("--bits", type=int, nargs="*", default=[16, 4, 2], help="content bits: 16 (BF16 kernel), 4, 2")
    ap.add_argument("--block-h", type=int, default=16, help="heads per program (16 for h <= 16, 64 for h = 128)")
    ap.add_argument("--warps", type=int, default=None)
    ap.add_argument("--stages", type=int, default=None)
    ap.add_argument("--top", type=int, default=16, help="most frequent instructions to list")
    ap.add_argument(
        "--maxnreg", type=int, default=None, help="register cap per thread; default: the library's, 0: none"
    )
    ap.add_argument("--loop", action="store_true", help="also count the hot loop's instructions (one tile)")
    args = ap.parse_args()
    for bits in args.bits:
        tuned = default_launch(args.block_h, bits)
        warps, stages = args.warps or tuned["num_warps"], args.stages or tuned["num_stages"]
        cap = tuned["maxnreg"] if args.maxnreg is None else (args.maxnreg or None)
        if bits == 16:
            k = bf16(args.block_h, warps, stages, maxnreg=cap)
        else:
            k = lowbit(bits, args.block_h, warps, stages, maxnreg=cap)
        r = report(k)
        name = "bf16" if bits == 16 else f"c{bits}r4"
        print(f"{name} block_h={args.block_h} warps={warps} stages={stages}: {r['registers']} registers, "
              f"stack {r['stack_bytes']} B, shared {r['shared_bytes'] // 1024} KB, "
              f"{r['instructions']} SASS instructions per warp")  # fmt: skip
        print("   ", ", ".join(f"{op} {n}" for op, n in r["mix"].most_common(args.top)))
        if args.loop:
            mix = loop_mix(k)
            top = ", ".join(f"{op} {n}" for op, n in mix.most_common(args.top))
            print(f"    hot loop: {sum(mix.values())} per warp: {top}")


if __name__ == "__main__":
    main()
