"""The demo's tables at 80 columns (a terminal, or ``quantmla demo > log``): every number printed whole, no cell
cut short, with the widest labels and values the demo prints."""

import io
import re

import pytest
from rich.console import Console

from quantmla.cli.demo import DemoConfig, GenerationRow, generation_table, needle_table, production_table
from quantmla.cli.eval_cmd import results_tables
from quantmla.eval.niah import NiahRow
from quantmla.eval.ppl import PerplexityResult

CFG = DemoConfig()


def _result(scheme: str, ppl: float, dtype: str = "float32", **kw) -> PerplexityResult:
    base = dict(nll=2.1, tokens=6132, sequences=12, seq_len=512, sink=4, recent=128, group_size=64,
                bytes_per_token=1152.0, unquantised_bytes_per_token=1152.0, dtype=dtype, device="cpu",
                cache_backend="torch", ppl_ci=(ppl - 1.234, ppl + 1.234), window_nll=[1000.0 + i for i in range(12)],
                bits_per_element=16.0)  # fmt: skip
    return PerplexityResult(scheme=scheme, ppl=ppl, **(base | kw))


def _tables():
    results = [
        _result("bf16", 8.4321),
        _result("fp8", 8.4501, bytes_per_token=656.0, bits_per_element=9.11),
        _result(
            "c4r4", 8.6000, bytes_per_token=324.0, bits_per_element=4.5, window_nll=[1100.0 + 3 * i for i in range(12)]
        ),
        _result(
            "c2r4",
            123.4567,
            bytes_per_token=196.0,
            bits_per_element=2.72,
            window_nll=[900.0 - 7 * i for i in range(12)],
        ),  # fmt: skip
        _result("c2r4+quantmla", 9.876, bytes_per_token=196.0, bits_per_element=2.72),
    ]
    title = "Perplexity on the bundled test split (12 x 512 tokens), float32 on cpu"
    gen = [GenerationRow("unquantised (float32)", 1.0, None, "static int foo(void)\n{\n" * 8),
           GenerationRow("c2r4", 0.5625, 27, "x" * 200)]  # fmt: skip
    value = "0f3a9c1e-77b2-4d55-9e0a-1c2b3d4e5f60"
    needle = [NiahRow("bf16", "niah-3", 2048, 50, 0, value, value, True),
              NiahRow("c2r4", "niah-3", 2048, 50, 0, value, value[:13], False)]  # fmt: skip
    measured = {"bf16": (1156.1, 1152.0), "fp8": (668.4, 656.1), "c4r4": (345.2, 324.3), "c2r4": (221.0, 196.2)}
    return [
        *results_tables(title, results),
        generation_table(gen, CFG),
        needle_table(needle, CFG),
        production_table(measured, ("bf16", "fp8", "c4r4", "c2r4"), CFG),
    ]


@pytest.mark.parametrize("index", range(5))
def test_every_number_is_whole_at_80_columns(index):
    table = _tables()[index]
    buf = io.StringIO()
    Console(file=buf, width=80, force_terminal=False, color_system=None).print(table)
    out = buf.getvalue()
    assert max(len(line) for line in out.splitlines()) <= 80
    assert "…" not in out
    numeric = [cell for col in table.columns for cell in col._cells if re.search(r"\d", str(cell))]
    assert numeric
    cut = [c for c in numeric if not re.search(r"(^|[│ ])" + re.escape(str(c)) + r"($|[│ ])", out, re.M)]
    assert not cut, f"cut or wrapped at 80 columns: {cut}\n{out}"
    for col in table.columns:  # headers whole too
        for word in str(col.header).split():
            assert word in out, (word, out)
