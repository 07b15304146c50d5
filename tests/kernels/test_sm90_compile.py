"""The decode kernel with its window program, and the fused gather, compile for sm_90 (Hopper) ahead of time:
Triton's NVIDIA backend lowers them to PTX and ptxas assembles it, no GPU needed. This catches on the CPU
what the interpreter cannot: constructs the GPU compiler rejects. It runs in a child process, because the
test session's ``TRITON_INTERPRET`` turns every kernel into an interpreted function."""

import os
import subprocess
import sys

import pytest

POINTERS = {"Q": "*bf16", "QR": "*bf16", "CW": "*i32", "CSM": "*i32", "RW": "*i16", "RSM": "*i32", "BT": "*i32",
            "NPAGED": "*i32", "KSTART": "*i32", "OP": "*fp32", "LP": "*fp32", "NUSED": "*i32", "ROWS": "*bf16",
            "MAP": "*i32", "scale_log2": "fp32", "TRASH": "i64", "P32": "*i32", "P16": "*i16", "PH": "*fp16",
            "SLOTS": "*i64", "WANT": "*i8", "SROWS": "*i16", "SMAP": "*i32", "OUT": "*i16"}  # fmt: skip


def _compile_all() -> None:
    import triton
    import triton.language as tl
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from quantmla.kernels.decode import WINDOW_BLOCK_T
    from quantmla.kernels.decode_lowbit import lowbit_kernel
    from quantmla.kernels.gather import _gather_kernel
    from quantmla.kernels.splits import MAX_SPLITS, PLAN_BLOCK

    def build(fn, consts, **options):
        sig = {n: "constexpr" if n in consts else POINTERS.get(n, "i32") for n in fn.arg_names}
        return triton.compile(ASTSource(fn, sig, consts), target=GPUTarget("cuda", 90, 32), options=options)

    for qt, bh in ((1, 16), (4, 64)):  # one query token a sequence; four (speculative decoding), 16 heads
        k = build(lowbit_kernel, dict(DC=512, DR=64, G=64, PAGE=64, BLOCK_T=64, BLOCK_H=bh, CBITS=4, ASM_OK=True,
                                       DT=tl.float16, WS=4, WR=128, SUB=4, WBLOCK_T=WINDOW_BLOCK_T, PLAN=True, SMS=132,
                                       MAXS=MAX_SPLITS, PLAN_B=PLAN_BLOCK, QT=qt),
                  num_warps=4 if bh <= 16 else 8, num_stages=2 if bh <= 16 else 1)  # fmt: skip
        assert len(k.asm["cubin"]) > 0 and ("cp.async" in k.asm["ptx"] or bh > 16)  # assembled; pipelined at 16
    for quant, rec in ((True, 324), (False, 1152)):  # c4r4 records, and BF16 ones (a branch of its own)
        consts = dict(DC=512, DR=64, G=64, CB=4, BS=64, REC=rec, CC=0, CSM=256, RC=288, RSM=320, QUANT=quant,
                      SHADOW=True, SUB=4)  # fmt: skip
        k = build(_gather_kernel, consts, num_warps=4, enable_fp_fusion=False)
        assert len(k.asm["cubin"]) > 0
    print("compiled for sm_90")


def test_the_window_decode_and_the_gather_compile_for_sm90():
    pytest.importorskip("triton.backends.nvidia.compiler", reason="Triton without its NVIDIA backend")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    code = "import sys; sys.path.insert(0, sys.argv[1]); import test_sm90_compile as t; t._compile_all()"
    r = subprocess.run([sys.executable, "-c", code, os.path.dirname(__file__)], env=env, capture_output=True,
                       text=True, timeout=600)  # fmt: skip
    if r.returncode and "ptxas" in r.stderr and "not found" in r.stderr:
        pytest.skip("no ptxas for this Triton on this machine")
    assert r.returncode == 0 and "compiled for sm_90" in r.stdout, r.stderr[-3000:]
