"""Command-line interface (placeholder: the commands are wired in as their modules land)."""
from __future__ import annotations

import typer

app = typer.Typer(add_completion=False, no_args_is_help=True,
                  help="Fit training into GPU memory: keep, swap or recompute each saved activation.")


@app.command()
def version() -> None:
    """Print the version."""
    from . import __version__
    typer.echo(__version__)


def main() -> None:
    app()
