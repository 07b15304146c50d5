"""``python -m quantmla``: the CLI, for trees run from source (``PYTHONPATH=src``); it logs as the installed
``quantmla`` script does (:func:`quantmla.cli.main.configure_logging`: quantmla's INFO lines, e.g. ``quantmla cache
c4r4: triton kernel (CUDA, bfloat16)``, on stderr)."""

from quantmla.cli.main import app

app(prog_name="quantmla")
