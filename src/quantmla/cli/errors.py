"""User mistakes on the command line: one line on stderr, exit code 2, no traceback.

Every command runs its checks and its work inside :func:`user_errors`: a ``ValueError`` (the
library's way of saying "bad input", with the bad value and the valid ones) becomes one line;
any other exception is a bug and propagates with its traceback.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import NoReturn

import typer

#: exit code of a usage error (click's convention)
USAGE_ERROR = 2


def one_line(message: str) -> str:
    """``message`` with its line breaks and runs of spaces folded into single spaces."""
    return " ".join(str(message).split())


def fail(message: str) -> NoReturn:
    """Print ``Error: message`` as one line on stderr and exit with code 2."""
    typer.echo(f"Error: {one_line(message)}", err=True)
    raise typer.Exit(USAGE_ERROR)


@contextmanager
def user_errors() -> Iterator[None]:
    """Within the block, a ``ValueError`` ends the command with :func:`fail`; other exceptions propagate."""
    try:
        yield
    except ValueError as e:
        fail(str(e))


def parse_layers(text: str | None, num_layers: int) -> list[int] | None:
    """``--layers``: comma-separated cache indices in ``0 .. num_layers - 1`` (``None``: all)."""
    if text is None:
        return None
    valid = f"comma-separated cache indices in 0..{num_layers - 1}"
    parts = [p.strip() for p in text.split(",") if p.strip()]
    if not parts:
        raise ValueError(f"--layers {text!r} names no layer; valid: {valid}")
    bad = [p for p in parts if not p.lstrip("-").isdigit()]
    if bad:
        raise ValueError(f"--layers {text!r}: {', '.join(map(repr, bad))} is not an integer; valid: {valid}")
    idx = [int(p) for p in parts]
    out = [i for i in idx if not 0 <= i < num_layers]
    if out:
        raise ValueError(f"--layers {text!r}: {out} out of range for this model; valid: {valid}")
    return idx


def check_cache(source, scheme: str, group_size: int) -> None:
    """That a cache of ``scheme`` with ``group_size`` fits the model of ``source`` (a ``ModelSource``):
    its group size divides the latent and RoPE key it quantises. Needs the config only."""
    from quantmla.cache import LatentCacheConfig
    from quantmla.formats.scheme import parse_scheme

    dims = source.dims
    LatentCacheConfig(parse_scheme(scheme), dims.kv_lora_rank, dims.rope_dim, group_size)
