"""`slackswap profile`: trace one training step (or import an ONNX graph) and write its profile."""
from __future__ import annotations

from pathlib import Path
from typing import List, Optional

import typer

from ..errors import InputError, require_file
from .common import (
    app,
    check_output_path,
    help_examples,
    json_option,
    quiet_option,
    renderer,
)
from .output import Result, Sink


# The library's modules are imported inside the functions, not here: `plan`, `show`, `simulate`
# and `compare` start without importing torch (tests/test_torch_free.py).
@app.command(short_help="Trace one training step and write its profile.",
             epilog=help_examples(
                 "slackswap profile model.py --device fake -o model.profile.json",
                 "slackswap profile examples/tiny_gpt.py --arg n_layer=2 --arg seq=256",
                 "slackswap profile model.onnx --input-shape input=8x3x224x224",
             ))
def profile(
    model: Path = typer.Argument(..., metavar="MODEL", help="workload file (model.py with a workload() function) or an ONNX file"),
    output: Optional[Path] = typer.Option(None, "-o", "--output", help="profile path [default: <model>.profile.json]"),
    entry: str = typer.Option("workload", "--entry", help="function in the workload file that returns (model, inputs[, loss_fn])"),
    arg: List[str] = typer.Option([], "--arg", metavar="KEY=VALUE", help="key=value passed to the entry function (Python literal); repeatable"),
    device: str = typer.Option("auto", "--device", help="auto | cuda | cpu | fake (FakeTensorMode: nothing allocated, roofline costs; random ops traced as CUDA runs them) | fake:cpu (the same, random ops as a CPU runs them: for a plan to run on a CPU)"),
    autocast: Optional[str] = typer.Option(None, "--autocast", help="bf16 | fp16: trace the step under torch.autocast in that dtype (forward and loss inside, backward outside)"),
    hardware: Optional[str] = typer.Option(None, "--hardware", help="preset or JSON file for roofline costs [default: a100-pcie4]"),
    input_shape: List[str] = typer.Option([], "--input-shape", metavar="NAME=SHAPE", help="ONNX only: name=1x3x224x224 for a dynamic input; repeatable"),
    as_json: bool = json_option("the profile summary"),
    quiet: bool = quiet_option(),
) -> None:
    """Trace one training step and write its profile (every saved activation, its cost and lifetime)."""
    sink = Sink(as_json, quiet)
    from ..hardware import load_hardware
    from ..schema import save
    hw = load_hardware(hardware)
    require_file(model, "model file", hint="pass a workload .py file or an .onnx file")
    if model.suffix.lower() == ".json":
        raise InputError(f"{model} is a JSON file, not a workload",
                         hint="profile takes a workload .py file or an .onnx file; to plan "
                              f"an existing profile run `slackswap plan {model} --budget 0.5`")
    from ..trace import split_device
    split_device(device)   # refuses an unknown --device before anything is written
    target = output or model.with_suffix(".profile.json")
    check_output_path(target, "-o", [model, hardware])
    warnings: list[str] = []
    if hardware and not device.startswith("fake") and model.suffix.lower() != ".onnx":
        warnings.append(f"--hardware {hardware} is not used: --device {device} measures op "
                        "times (the roofline costs only --device fake and ONNX profiles)")
    if model.suffix.lower() == ".onnx":
        from ..onnx.importer import parse_input_shapes, profile_onnx
        if autocast:
            raise InputError("--autocast applies to workload files only",
                             hint="an ONNX graph's dtypes are the ones it was exported with")
        shapes = parse_input_shapes(input_shape)
        prof, warnings = profile_onnx(str(model), hw, input_shapes=shapes or None)
    else:
        if input_shape:
            raise InputError("--input-shape applies to ONNX files only",
                             hint="for a workload file, set shapes with --arg")
        from ..trace import profile_workload
        from ..trace.workload import parse_workload_args
        args = parse_workload_args(arg)
        with sink.working("tracing the training step"):
            prof = profile_workload(str(model), entry=entry, args=args, device=device,
                                    hardware=hw, autocast=autocast, progress=sink.status)
    save(prof, target)
    from ..profile_build import attention_warning
    for w in [*warnings, *filter(None, [attention_warning(prof)])]:
        sink.warn(w)
    sink.show(Result({"profile": str(target), "fingerprint": prof.fingerprint,
                      "workload": prof.workload, "env": prof.env, "summary": prof.summary},
                     views=lambda: renderer().profile_views(prof), lines=[f"wrote {target}"]))
