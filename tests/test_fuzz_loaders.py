"""Structural fuzzing of the three files users can hand to slackswap: profiles, plans and
hardware specs.

Each mutant is a valid file with one random edit somewhere in its JSON tree (a value replaced
by something odd, a key deleted or added, a list element dropped, duplicated or swapped). It
goes through the commands that read it, in-process. Every mutant must end in one of the ways a
user may see: exit 0 (the edit was harmless), 2 (refused as bad input, with `Error:` and
`Hint:`) or 4 (no plan fits); never exit 1 (a bug), never a hang, and any plan the command
wrote must load again. The seed is fixed, so a failure reproduces. `make test` runs 300
mutants; `make fuzz` runs 3000 more.
"""
from __future__ import annotations

import copy
import os
import random
import signal
from contextlib import contextmanager

import orjson
import pytest
from typer.testing import CliRunner

from slackswap_cli import schema
from slackswap_cli.cli import app
from slackswap_cli.hardware import PRESETS
from slackswap_testkit.synthetic import chain_profile

runner = CliRunner()
SECONDS_PER_MUTANT = 10   # generous on a loaded machine; a hang is hours

# odd values a hand edit or a bad generator writes
ODD = [None, True, False, 0, -1, 1, 2**63, 2**64 - 1, -42598.4, 0.5, 1e308, 5e-324, -0.0,
       "", "x", "42", "1e9", [], [0], [1, 2], {}, {"a": 1}, 3, 7, 10**6]


def _paths(node, prefix=()):
    """Every location in a JSON tree (dict keys and list indices), parents before children."""
    yield prefix
    if isinstance(node, dict):
        for k, v in node.items():
            yield from _paths(v, prefix + (k,))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            yield from _paths(v, prefix + (i,))


def _get(node, path):
    for k in path:
        node = node[k]
    return node


def mutate(doc, rng: random.Random):
    """A copy of `doc` with one random structural edit, and a word saying what it was."""
    doc = copy.deepcopy(doc)
    # pick a field name first, then one of its places: `summary.peak_activation_bytes` is as
    # likely to be hit as one of the thousand `tensors[*].shape[*]` entries
    groups: dict[str, list] = {}
    for p in _paths(doc):
        if p:
            name = "/".join("[]" if isinstance(k, int) else k for k in p)
            groups.setdefault(name, []).append(p)
    path = rng.choice(groups[rng.choice(sorted(groups))])
    parent, key = _get(doc, path[:-1]), path[-1]
    op = rng.choice(["replace", "replace", "replace", "nudge", "delete", "dup", "swap", "add"])
    value = parent[key]
    if op == "nudge" and isinstance(value, (int, float)) and not isinstance(value, bool):
        parent[key] = rng.choice([value + 1, value - 1, -value, value * 1000, value / 3])
    elif op == "delete":
        del parent[key]
    elif op == "dup" and isinstance(parent, list):
        parent.insert(key, copy.deepcopy(value))
    elif op == "swap" and isinstance(parent, list) and len(parent) > 1:
        other = rng.randrange(len(parent))
        parent[key], parent[other] = parent[other], parent[key]
    elif op == "add" and isinstance(parent, dict):
        parent[rng.choice(["extra", "saved", "hardware", "id"])] = rng.choice(ODD)
    else:
        op = "replace"
        parent[key] = copy.deepcopy(rng.choice(ODD))
    return doc, f"{op} {'/'.join(map(str, path))}"


@contextmanager
def _deadline(seconds: int, what: str):
    def expired(*_):
        raise TimeoutError(f"{what} ran past {seconds} s")
    old = signal.signal(signal.SIGALRM, expired)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


def _run(args, what):
    with _deadline(SECONDS_PER_MUTANT, what):
        r = runner.invoke(app, [str(a) for a in args])
    text = r.stdout + r.stderr
    assert r.exit_code in (0, 2, 4), f"{what}: exit {r.exit_code}\n{text}"
    assert "Traceback" not in text, f"{what}\n{text}"
    if r.exit_code != 0:
        assert "Error:" in r.stderr and "Hint:" in r.stderr, f"{what}\n{text}"
    return r


def _check_written(path, what):
    if path.exists():           # written: it must load again, with finite numbers
        schema.load_plan(path)
        path.unlink()


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    d = tmp_path_factory.mktemp("fuzz")
    prof = chain_profile(5, act_bytes=[1 << 20, 2 << 20, 1 << 20, 3 << 20, 1 << 20],
                         fwd_us=[100.0, 50.0, 80.0, 120.0, 60.0], random_layers=(2,))
    schema.save(prof, d / "p.json")
    r = runner.invoke(app, ["plan", str(d / "p.json"), "--budget", "0.6", "-o", str(d / "plan.json")])
    assert r.exit_code == 0, r.stderr
    return {"dir": d, "profile": orjson.loads((d / "p.json").read_bytes()),
            "plan": orjson.loads((d / "plan.json").read_bytes()),
            "hardware": PRESETS["a100-pcie4"].to_dict() | {"name": "fuzz-hw"}}


def fuzz(base, n: int, seed: int) -> dict[str, int]:
    """Run `n` mutants of each kind; return how many ended with each exit code."""
    rng = random.Random(seed)
    d = base["dir"]
    out = d / "out.json"
    codes: dict[str, int] = {}
    for i in range(n):
        kind = ("profile", "plan", "hardware")[i % 3]
        doc, edit = mutate(base[kind], rng)
        what = f"seed {seed} mutant {i} ({kind}: {edit})"
        src = d / f"m.{kind}.json"
        src.write_bytes(orjson.dumps(doc))
        if kind == "profile":
            runs = [["plan", src, "--budget", "0.6", "-o", out],
                    ["show", src]]
        elif kind == "plan":
            runs = [["show", src], ["simulate", src, "--json"],
                    ["simulate", src, "--trace", d / "t.json", "--json"]]
        else:
            runs = [["plan", d / "p.json", "--budget", "0.6", "--hardware", src, "-o", out],
                    ["hardware", src, "--json"]]
        for args in runs:
            r = _run(args, f"{what}: {' '.join(map(str, args[:1]))}")
            codes[str(r.exit_code)] = codes.get(str(r.exit_code), 0) + 1
            _check_written(out, what)
            if (d / "t.json").exists():
                orjson.loads((d / "t.json").read_bytes())   # a trace is JSON too
                (d / "t.json").unlink()
    return codes


def test_mutated_files_are_refused_or_handled(base):
    codes = fuzz(base, 300, seed=11)
    # the mutants exercise both outcomes: most edits are refused, some are harmless
    assert codes.get("2", 0) > 100 and codes.get("0", 0) > 50, codes


@pytest.mark.slow
@pytest.mark.skipif(not os.environ.get("SLACKSWAP_FUZZ_MANY"),
                    reason="3000 mutants take about 50 s of CPU: `make fuzz` runs them")
def test_many_mutated_files_are_refused_or_handled(base):
    codes = fuzz(base, 3000, seed=1211)
    assert codes.get("2", 0) > 1000, codes
