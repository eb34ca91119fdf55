"""Repeated blocks: which transformer layer (or other numbered block) each op belongs to.

Module paths name the blocks of a model with an index (`transformer.h.3.mlp`,
`model.layers.3.self_attn`, `bert.encoder.layer.11.output`). Rather than a list of usual
container names, the container is found from the data: `layer_container` picks the numbered
prefix whose index takes the most distinct values (`transformer.h`; a numbered submodule
inside a block, such as `mlp.experts.0`, takes fewer). `layer_of` then maps a module path to
its block (`transformer.h.3`) or, outside the blocks, to a short prefix (`transformer.wte`,
`lm_head`), and `layer_index` reads the block's number back.

The terminal views (`render`) group rows by block and the `checkpoint-layers` baseline
checkpoints every k-th block, both through `op_layers`, so they always agree. Torch-free.
"""
from __future__ import annotations

from typing import Iterable

UNATTRIBUTED = "(unattributed)"


def layer_container(modules: Iterable[str]) -> str | None:
    """The numbered container of the repeated blocks: the module-path prefix followed by an
    index that takes the most distinct values ("transformer.h" for "transformer.h.3.mlp"),
    or None when no prefix has two indices."""
    indices: dict[str, set[str]] = {}
    for m in set(modules):
        parts = m.split(".") if m else []
        for k, part in enumerate(parts):
            if part.isdigit():
                indices.setdefault(".".join(parts[:k]), set()).add(part)
                break   # the outermost numbered container only
    if not indices:
        return None
    best = max(indices, key=lambda c: (len(indices[c]), -len(c)))
    return best if len(indices[best]) >= 2 else None


def layer_of(module: str, container: str | None) -> str:
    """The block a module path belongs to (see the module docstring)."""
    if not module:
        return UNATTRIBUTED
    parts = module.split(".")
    if container is not None:
        cparts = container.split(".") if container else []
        n = len(cparts)
        if parts[:n] == cparts and len(parts) > n and parts[n].isdigit():
            return ".".join(parts[:n + 1])
        return ".".join(parts[:max(1, n)])
    return parts[0]


def layer_index(name: str, container: str | None) -> int | None:
    """The number of block `name` (a `layer_of` result) in `container`, or None outside it."""
    if container is None:
        return None
    prefix = f"{container}." if container else ""
    if name.startswith(prefix) and name[len(prefix):].isdigit():
        return int(name[len(prefix):])
    return None


def op_layers(profile) -> tuple[list[str], str | None]:
    """(the `layer_of` of every op of `profile`, the container)."""
    container = layer_container(op.module for op in profile.ops)
    cache: dict[str, str] = {}
    out = []
    for op in profile.ops:
        lay = cache.get(op.module)
        if lay is None:
            lay = cache[op.module] = layer_of(op.module, container)
        out.append(lay)
    return out, container


def op_layer_indices(profile) -> list[int | None]:
    """The repeated block's number of every op ("transformer.h.3.mlp" -> 3), or None."""
    layers, container = op_layers(profile)
    cache: dict[str, int | None] = {}
    out = []
    for lay in layers:
        if lay not in cache:
            cache[lay] = layer_index(lay, container)
        out.append(cache[lay])
    return out
