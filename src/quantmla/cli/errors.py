"""User mistakes on the command line: one line on stderr, exit code 2, no traceback; and internal errors: a
traceback, labelled a bug, exit code 1.

Every command checks all its inputs inside :func:`user_errors` before it reads a weight: a ``ValueError`` (the
library's way of saying "bad input", with the bad value and the valid ones) becomes one line. The work itself
runs inside :func:`internal_errors`: by then every input was checked, so an exception there is a bug.
"""

from __future__ import annotations

import os
import traceback
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
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


#: exit code of an internal error (a bug)
INTERNAL_ERROR = 1


@contextmanager
def internal_errors(command: str) -> Iterator[None]:
    """Within the block (the work, after every input was checked), an exception is a bug: its traceback, then one
    line saying so, exit code 1. ``typer.Exit`` and ``KeyboardInterrupt`` pass through."""
    try:
        yield
    except (typer.Exit, typer.Abort, KeyboardInterrupt):
        raise
    except Exception as e:  # noqa: BLE001 (everything else is a bug, reported as one)
        traceback.print_exc()
        typer.echo(
            f"quantmla {command}: internal error, a bug ({type(e).__name__}: {one_line(str(e))}); every input was"
            " checked before the work began: please report it with the traceback above",
            err=True,
        )
        raise typer.Exit(INTERNAL_ERROR) from None


def check_out(out: Path, overwrite: bool = False, option: str = "--out") -> None:
    """That ``out`` can take a command's output directory: not a file, writable, and empty (or ``overwrite``)."""
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise ValueError(f"{option} {out} is a file; give a directory (a new or an empty one)")
    if out.is_dir() and any(out.iterdir()) and not overwrite:
        raise ValueError(f"{option} {out} is not empty; give a new or an empty directory, or --overwrite")
    existing = out.absolute()
    while not existing.exists():
        existing = existing.parent
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ValueError(f"{option} {out}: {existing} is not writable")


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
