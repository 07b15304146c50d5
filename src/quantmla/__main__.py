"""``python -m quantmla``: the CLI, for trees run from source (``PYTHONPATH=src``), with quantmla's INFO log
(which path ran: e.g. ``quantmla cache c4r4: triton kernel (CUDA, bfloat16)``) on stderr."""

import logging

from quantmla.cli.main import app

logging.basicConfig(level=logging.WARNING, format="%(name)s: %(message)s")
logging.getLogger("quantmla").setLevel(logging.INFO)
app(prog_name="quantmla")
