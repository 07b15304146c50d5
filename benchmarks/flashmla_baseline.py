"""FlashMLA, timed in the same process as quantmla's kernels: BF16 dense decode (FlashMLA's SM90 kernel) and
vLLM's FP8 dense decode (``fwd_kvcache_mla_fp8``), both from vLLM's wheel.

vLLM 0.26's wheel carries FlashMLA as ``vllm/_flashmla_C.abi3.so`` and the FP8 kernel as
``vllm/_flashmla_extension_C.abi3.so``; they link only libtorch and the CUDA runtime, so they load without the
rest of vLLM: ``--flashmla-lib DIR`` names a folder holding them (unzipped from the wheel, e.g.
``unzip -j vllm-0.26.0-*.whl 'vllm/_flashmla*_C.abi3.so' -d DIR``); else ``import vllm`` is tried. Nothing here is
part of the installed package: it is the comparison a user would make.

Also: :class:`SmClock`, the SM clock sampled by ``nvidia-smi`` while a timing runs (FlashMLA's and our numbers
are only comparable at the clock they ran at).
"""

from __future__ import annotations

import math
import statistics
import subprocess
from pathlib import Path

import torch

DC, DR, PAGE = 512, 64, 64


def load_flashmla(lib_dir: str | None) -> str:
    """Register FlashMLA's ops (``torch.ops._flashmla_C``, ``torch.ops._flashmla_extension_C``); returns where
    they came from. Raises ``RuntimeError`` (one line) when neither ``lib_dir`` nor vLLM has them."""
    if lib_dir:
        d = Path(lib_dir)
        libs = [d / "_flashmla_C.abi3.so", d / "_flashmla_extension_C.abi3.so"]
        missing = [str(p) for p in libs if not p.is_file()]
        if missing:
            raise RuntimeError(f"--flashmla-lib {lib_dir}: missing {', '.join(missing)}")
        for p in libs:
            torch.ops.load_library(str(p))
        return f"{lib_dir} (from vLLM's wheel)"
    try:
        import vllm._flashmla_C  # noqa: F401
        import vllm._flashmla_extension_C  # noqa: F401
    except ImportError as e:
        raise RuntimeError(f"FlashMLA not found: give --flashmla-lib DIR or install vLLM ({e})") from None
    import vllm

    return f"vllm {vllm.__version__}"


def paged_bf16(batch: int, ctx: int, gen: torch.Generator):
    """FlashMLA's dense BF16 cache ``[pages, 64, 1, 576]`` with random contents, a permuted block table and the
    lengths (every sequence ``ctx`` tokens)."""
    per = math.ceil(ctx / PAGE)
    kv = torch.randn(batch * per, PAGE, 1, DC + DR, device="cuda", generator=gen).bfloat16()
    bt = torch.randperm(batch * per, device="cuda", generator=gen).view(batch, per).int()
    lens = torch.full((batch,), ctx, dtype=torch.int32, device="cuda")
    return kv, bt, lens


class FlashMLA:
    """One decode shape ``(B, s_q, h, L)`` on FlashMLA's BF16 dense kernel (``fp8=False``) or vLLM's FP8 dense
    kernel (``fp8=True``: e4m3 queries and cache, per-tensor descales, 576 B a token); ``causal`` among the
    ``s_q`` query tokens of a sequence. ``call()`` runs one decode."""

    def __init__(self, batch: int, s_q: int, heads: int, ctx: int, gen: torch.Generator, fp8: bool = False) -> None:
        self.kv, self.bt, self.lens = paged_bf16(batch, ctx, gen)
        self.q = torch.randn(batch, s_q, heads, DC + DR, device="cuda", generator=gen).bfloat16()
        self.scale = 1 / math.sqrt(192)
        self.fp8 = fp8
        self.causal = s_q > 1
        if fp8:
            self.kv = self.kv.to(torch.float8_e4m3fn)
            self.q = self.q.to(torch.float8_e4m3fn)
            one = torch.ones(1, dtype=torch.float32, device="cuda")
            self.descale = (one, one.clone())
            self.meta = torch.ops._flashmla_extension_C.get_mla_decoding_metadata_dense_fp8(self.lens, s_q * heads, 1)
        else:
            self.sched = (None, None)

    def call(self):
        if self.fp8:
            return torch.ops._flashmla_extension_C.fwd_kvcache_mla_fp8(
                self.q, self.kv, DC, self.lens, self.bt, self.scale, self.causal, *self.meta, *self.descale
            )
        out, lse, sched, splits = torch.ops._flashmla_C.dense_decode_fwd(
            self.q, self.kv, DC, self.lens, self.bt, self.scale, self.causal, *self.sched, None
        )
        self.sched = (sched, splits)  # the tile schedule, planned by the first call (FlashMLA's interface does so)
        return out, lse

    def bytes_read(self) -> int:
        return self.lens.numel() * int(self.lens[0]) * (DC + DR) * self.kv.element_size()


class SmClock:
    """The SM clock (MHz) sampled every 50 ms by ``nvidia-smi`` between ``start()`` and ``stop()``; ``stop()``
    returns the median, or ``None`` where ``nvidia-smi`` is missing."""

    def __init__(self) -> None:
        self.proc = None

    def start(self) -> None:
        try:
            self.proc = subprocess.Popen(
                ["nvidia-smi", "--query-gpu=clocks.sm", "--format=csv,noheader,nounits", "-lms", "50",
                 "-i", str(torch.cuda.current_device())],
                stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
            )  # fmt: skip
        except FileNotFoundError:
            self.proc = None

    def stop(self) -> float | None:
        if self.proc is None:
            return None
        self.proc.terminate()
        out, _ = self.proc.communicate(timeout=10)
        vals = [float(x) for x in out.split() if x.strip().replace(".", "", 1).isdigit()]
        self.proc = None
        return statistics.median(vals) if vals else None
