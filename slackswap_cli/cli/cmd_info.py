"""`slackswap hardware` (the presets) and `slackswap version`."""
from __future__ import annotations

import platform
from typing import Optional

import typer

from .common import (
    app,
    help_examples,
    json_option,
    quiet_option,
    renderer,
)
from .output import Result, Sink


# The library's modules are imported inside the functions, not here: `plan`, `show`, `simulate`
# and `compare` start without importing torch (tests/test_torch_free.py).
@app.command("hardware", short_help="List hardware presets, or print one.",
             epilog=help_examples(
                 "slackswap hardware",
                 "slackswap hardware a100-pcie4 --json > my-a100.json",
             ))
def hardware_cmd(
    name: Optional[str] = typer.Argument(None, metavar="NAME", help="a preset to print in full"),
    as_json: bool = json_option("the preset(s) (a starting point for a custom --hardware file)"),
    quiet: bool = quiet_option(),
) -> None:
    """List hardware presets, or print one (its fields are the format of a --hardware JSON file)."""
    from ..hardware import PRESETS, load_hardware
    specs = [load_hardware(name)] if name else list(PRESETS.values())
    # indented: the JSON is the starting point of a hand-edited --hardware file
    Sink(as_json, quiet).show(Result(specs[0].to_dict() if name else {s.name: s.to_dict() for s in specs},
                              views=lambda: [renderer().hardware_table(specs)], indent=True))


@app.command(short_help="Print the version.",
             epilog=help_examples(
                 "slackswap version --json",
             ))
def version(as_json: bool = json_option("{version, python, torch}"),
            quiet: bool = quiet_option()) -> None:
    """Print the version (with --json: also Python's and torch's, null if torch is missing)."""
    from .. import __version__
    Sink(as_json, quiet).show(Result(_versions, views=lambda: [__version__]))


def _versions() -> dict:
    """`version --json`: slackswap's, Python's and torch's (null when torch is missing)."""
    from importlib import metadata  # slow to import: only `version` needs it

    from .. import __version__
    try:
        torch_version = metadata.version("torch")
    except metadata.PackageNotFoundError:
        torch_version = None
    return {"version": __version__, "python": platform.python_version(),
            "torch": torch_version}
