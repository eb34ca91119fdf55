"""A torchvision that imports beside a CPU torch, built from PyPI's wheel (`make install`).

timm imports torchvision's Python modules at import time (`torchvision.ops.misc`,
`torchvision.transforms`, `torchvision.datasets`) and the zoo benchmark builds torchvision's
classification models; none of that needs torchvision's C++ extension. PyPI serves one Linux
x86_64 torchvision per torch release, built against CUDA: its `_C.so` links libtorch_cuda.so,
which a CPU torch does not have. torchvision then means to carry on without its ops
(`torchvision.extension._has_ops()` is False), but its module `_meta_registrations`
registers fake kernels for `torchvision::nms` and `torchvision::qnms` without asking
`_has_ops()`, and
`torch.library.register_fake` on an operator nobody defined raises "operator torchvision::nms
does not exist": `import torchvision` fails, and with it timm and every transformers module
that imports torchvision when it is installed.

This module rewrites that wheel into a pure-Python one of the same version: the native
libraries (`_C.so`, `image.so`, `torchvision.libs/`) left out, those two registrations put
under `_has_ops()` like the others, the tag `py3-none-any`, the RECORD rewritten. The ops
(nms, roi_align, deform_conv2d, image decoding) then raise torchvision's own "Couldn't load
custom C++ ops" error when called; nothing else changes.

    python -m slackswap_testkit.torchvision_wheel --install   # what `make install` runs
    python -m slackswap_testkit.torchvision_wheel WHEEL OUTDIR   # the rewrite alone

`--install` installs into the running interpreter the torchvision release that goes with its
torch (torch 2.N: torchvision 0.(N+15)): PyPI's wheel as it is where torch is a CUDA build,
else PyPI's wheel rewritten here.
"""
from __future__ import annotations

import base64
import hashlib
import re
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

DROPPED = (re.compile(r"^torchvision/[^/]+\.so$"), re.compile(r"^torchvision\.libs/"))
META = "torchvision/_meta_registrations.py"
UNGUARDED = re.compile(r'^@torch\.library\.register_fake\("torchvision::(\w+)"\)\n'
                       r"def (\w+)\(", re.M)


def _guard(source: str) -> str:
    """The `_meta_registrations` module's source with each bare `register_fake` applied only
    when the ops loaded (the same test its `register_meta` makes)."""
    fixed, n = UNGUARDED.subn(
        lambda m: f"@_if_has_ops(\"torchvision::{m[1]}\")\ndef {m[2]}(", source)
    if n == 0:
        raise SystemExit(f"{META}: no unguarded register_fake found; this torchvision may not "
                         "need the rewrite (try importing it as it is)")
    helper = ('\n\ndef _if_has_ops(qualname):\n'
              '    """register_fake(qualname) when the C++ ops loaded; else leave fn as is."""\n'
              '    if torchvision.extension._has_ops():\n'
              '        return torch.library.register_fake(qualname)\n'
              '    return lambda fn: fn\n')
    anchor = "import torchvision.extension  # noqa: F401\n"
    if anchor not in fixed:
        raise SystemExit(f"{META}: the import of torchvision.extension moved; update {__file__}")
    return fixed.replace(anchor, anchor + helper, 1)


def _record_line(name: str, data: bytes) -> str:
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return f"{name},sha256={digest},{len(data)}"


def rewrite(wheel: Path, outdir: Path) -> Path:
    """Write the pure-Python wheel into `outdir`; returns its path."""
    m = re.match(r"torchvision-([^-]+)-", wheel.name)
    if not m:
        raise SystemExit(f"{wheel} is not a torchvision wheel")
    out = outdir / f"torchvision-{m[1]}-py3-none-any.whl"
    outdir.mkdir(parents=True, exist_ok=True)
    records, record_name = [], None
    with zipfile.ZipFile(wheel) as src, zipfile.ZipFile(out.with_suffix(".tmp"), "w",
                                                        zipfile.ZIP_DEFLATED) as dst:
        for info in src.infolist():
            name = info.filename
            if any(p.search(name) for p in DROPPED):
                continue
            if name.endswith(".dist-info/RECORD"):
                record_name = name
                continue
            data = src.read(name)
            if name == META:
                data = _guard(data.decode()).encode()
            elif name == "torchvision/version.py":      # '0.28.0+cu130': no CUDA in it now
                data = re.sub(rb"\+cu\d+'", b"'", data)
            elif name.endswith(".dist-info/WHEEL"):
                data = re.sub(rb"Root-Is-Purelib: false", b"Root-Is-Purelib: true", data)
                data = re.sub(rb"Tag: .*", b"Tag: py3-none-any", data)
            dst.writestr(name, data)
            records.append(_record_line(name, data))
        if record_name is None:
            raise SystemExit(f"{wheel} has no RECORD")
        dst.writestr(record_name, "\n".join([*records, f"{record_name},,"]) + "\n")
    out.with_suffix(".tmp").replace(out)
    return out


def matching_version(torch_version: str) -> str:
    """The torchvision release built against torch `torch_version` ("2.13.0+cpu": "0.28.0")."""
    major, minor, patch = (int(re.match(r"\d+", x)[0]) for x in torch_version.split(".")[:3])
    if major != 2:
        raise SystemExit(f"torch {torch_version}: no torchvision pairing known for it")
    return f"0.{minor + 15}.{patch}"


def install() -> None:
    """Install the torchvision that goes with this interpreter's torch (see the docstring)."""
    import torch

    spec = f"torchvision=={matching_version(torch.__version__)}"
    pip = [sys.executable, "-m", "pip", "install", "-q"]
    if torch.version.cuda is not None:
        subprocess.run([*pip, spec], check=True)
        return
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps",
                        "--only-binary=:all:", "-d", tmp, spec], check=True)
        (wheel,) = Path(tmp).glob("torchvision-*.whl")
        subprocess.run([*pip, str(rewrite(wheel, Path(tmp) / "out"))], check=True)


if __name__ == "__main__":
    if sys.argv[1:] == ["--install"]:
        install()
    elif len(sys.argv) == 3:
        print(rewrite(Path(sys.argv[1]), Path(sys.argv[2])))
    else:
        raise SystemExit("usage: python -m slackswap_testkit.torchvision_wheel --install | "
                         "WHEEL OUTDIR")
