"""The ``quantmla`` command line."""

from __future__ import annotations

import typer
from rich.console import Console

from quantmla import __version__
from quantmla.cli import eval_cmd

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    help="Small and fast low-bit KV caches for Multi-Head Latent Attention (MLA) models.",
)
app.add_typer(eval_cmd.app, name="eval")


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
    model: str = typer.Option("builtin:tiny-mla", help="builtin:NAME, a local model directory, or a cached hub id."),
    schemes: str = typer.Option(
        "bf16,fp8,c4r4,c2r4", help="Comma-separated cache schemes; the first is the reference."
    ),
    num_seqs: int = typer.Option(16, min=1, help="Test windows for perplexity."),
    seq_len: int = typer.Option(512, min=2, help="Tokens per window."),
    new_tokens: int = typer.Option(48, min=1, help="Greedy tokens to generate."),
    sink: int = typer.Option(4, min=0, help="Leading tokens kept unquantised."),
    recent: int = typer.Option(128, min=0, help="Most recent tokens kept unquantised."),
) -> None:
    """Perplexity, generation and bytes/token with BF16, FP8 and low-bit latent caches side by side."""
    from quantmla.cli.demo import DemoConfig, render

    try:
        cfg = DemoConfig(
            model=model,
            schemes=tuple(s.strip() for s in schemes.split(",") if s.strip()),
            num_seqs=num_seqs,
            seq_len=seq_len,
            new_tokens=new_tokens,
            sink=sink,
            recent=recent,
        )
        render(cfg, Console())
    except ValueError as e:
        raise typer.BadParameter(str(e)) from None


if __name__ == "__main__":
    app()
