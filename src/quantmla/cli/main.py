"""The ``quantmla`` command line."""

from __future__ import annotations

import typer
from rich.console import Console

from quantmla import __version__

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    help="Small and fast low-bit KV caches for Multi-Head Latent Attention (MLA) models.",
)


def _version(value: bool) -> None:
    if value:
        typer.echo(f"quantmla {__version__}")
        raise typer.Exit()


@app.callback()
def main(
    version: bool = typer.Option(False, "--version", callback=_version, is_eager=True, help="Print the version."),
) -> None:
    """quantmla: quantise the MLA latent cache to 4 or 2 bits."""


@app.command()
def demo(
    model: str = typer.Option("deepseek_v3", help="Tiny model family to run."),
    schemes: str = typer.Option(
        "bf16,fp8,c8r8,c4r4,c2r4", help="Comma-separated cache schemes; the first is the reference."
    ),
    prompt_len: int = typer.Option(256, min=1, help="Prompt tokens per sequence."),
    new_tokens: int = typer.Option(32, min=1, help="Greedy tokens to generate."),
    batch: int = typer.Option(2, min=1, help="Sequences in the batch."),
    sink: int = typer.Option(4, min=0, help="Leading tokens kept unquantised."),
    recent: int = typer.Option(128, min=0, help="Most recent tokens kept unquantised."),
    seed: int = typer.Option(0, help="Random seed."),
) -> None:
    """Generate with BF16 and low-bit latent caches side by side and report bytes per token."""
    from quantmla.cli.demo import DemoConfig, render

    try:
        cfg = DemoConfig(
            model=model,
            schemes=tuple(s.strip() for s in schemes.split(",") if s.strip()),
            prompt_len=prompt_len,
            new_tokens=new_tokens,
            batch=batch,
            sink=sink,
            recent=recent,
            seed=seed,
        )
    except ValueError as e:
        raise typer.BadParameter(str(e)) from None
    render(cfg, Console())


if __name__ == "__main__":
    app()
