"""What a patched model says on stderr, and the shapes and errors it names.

Each note is given once (`Notes.say`), or, for notes per input signature, for the first
`SAY_MAX` signatures of a kind and then one line saying later ones are not printed (dynamic
padding meets hundreds of shapes: `say_capped`). `check_run` turns a call's report into a note
when less than 99% of the profile lined up or the guard acted.
"""
from __future__ import annotations

import sys

from ..units import fmt_bytes

__all__ = ["Notes", "SAY_MAX", "shapes", "brief", "tell", "checkpointing_on"]

ALIGN_WARN = 0.99       # say so when fewer of the profile's forward ops than this line up
SAY_MAX = 3             # signatures a kind of note is printed for (`Notes.say_capped`)


def tell(text: str) -> None:
    """One line on stderr, `slackswap: TEXT`: the library's one voice (every note of a
    patched or compiled model goes through here; the CLI prints only through cli/output.py)."""
    print(f"slackswap: {text}", file=sys.stderr)


class Notes:
    """The notes a patched model has given (`said`: keys; `said_count`: per kind); `quiet`:
    none printed (the library's check runs a patch of its own, reported otherwise)."""

    def __init__(self):
        self.said: set = set()                  # notes already given on stderr
        self.said_count: dict[str, int] = {}    # notes given per kind (`say_capped`)
        self.quiet = False

    def say(self, key: str, text: str) -> None:
        if key not in self.said:
            self.said.add(key)
            if not self.quiet:
                tell(text)

    def say_checkpointing(self, model) -> None:
        """Once: the model checkpoints blocks itself (`checkpointing_on`)."""
        text = checkpointing_on(model)
        if text is not None:
            self.say("checkpointing", text)

    def check_run(self, run, sig, replanned_next: bool = False, replans: bool = False) -> dict:
        """Say once per signature, on stderr, when less than 99% of the profile's forward ops
        lined up or the guard swapped what the plan could not place: what, what it cost and
        what to do (correctness is not at stake either way). Returns the call's report.
        `replanned_next`: a new shape on the profiled plan of a model planned along its
        branches, which its next call plans for (nothing to say unless the guard acted).
        `replans`: slackswap plans again along this call's path right after it (the next
        note says so): nothing for the user to do, so no advice to re-profile (a
        `SlackswapCallback` or `plan_model` user has no profile to redo)."""
        rep = run.report()
        low, acted = rep["fraction"] < ALIGN_WARN, rep["guard_swaps"] > 0
        if not (low or acted) or ("run", sig) in self.said:
            return rep
        self.said.add(("run", sig))
        if replanned_next and not acted:
            return rep
        text = (f"{rep['lined_up']} of the profile's {rep['expected']} forward ops lined up "
                f"({rep['fraction']:.1%}) at {shapes(sig)}")
        if acted:
            text += (f"; the guard swapped {rep['guard_swaps']} saved tensors the plan could not "
                     f"place ({fmt_bytes(rep['guard_swapped_bytes'])})")
        if rep["budget_bytes"]:
            over = rep["held_bytes"] > rep["budget_bytes"]
            text += (f"; {fmt_bytes(rep['held_bytes'])} held for backward, "
                     f"{rep['held_bytes'] / rep['budget_bytes']:.2f}x the budget of "
                     f"{fmt_bytes(rep['budget_bytes'])}"
                     + (" (what the plan itself keeps is over it)" if over else ""))
        if rep.get("borrowed") and not low:
            self.say_capped("run", f"{text}. The plan was made at other shapes: the guard "
                             "holds it to the budget at these (model.forward.__slackswap__"
                             ".last_report has each call's figures)")
            return rep
        if replans:
            self.say_capped("run", f"{text}. The run took another path than the profiled "
                             "trace (a library that branches otherwise under fake tensors "
                             "than in eager, or other shapes): slackswap plans again along "
                             "this call's path now, nothing to do (model.forward.__slackswap__"
                             ".last_report has each call's figures)")
            return rep
        self.say_capped("run", f"{text}. The run took another path than the profiled trace "
                         "(other shapes, routing, device or dtype, or a library that branches "
                         "otherwise under fake tensors than in eager): re-profile at these "
                         "shapes on this device for the whole plan; see docs/training.md, 'When "
                         "the run departs from the plan' (model.forward.__slackswap__"
                         ".last_report has each call's figures)")
        return rep

    def say_capped(self, kind: str, text: str) -> None:
        """A note on stderr for the first `SAY_MAX` signatures of a kind, then one line saying
        that later ones are not printed (dynamic padding meets hundreds of shapes)."""
        n = self.said_count.get(kind, 0)
        self.said_count[kind] = n + 1
        if self.quiet:
            return
        if n < SAY_MAX:
            tell(text)
        elif n == SAY_MAX:
            tell(f"({kind} notes for further input signatures are not printed; "
                 "model.forward.__slackswap__.last_report has each call's figures)")


# a model's own gradient checkpointing: (library, the flag its modules set, how to turn it off)
CHECKPOINTING = (("Hugging Face", "gradient_checkpointing", "model.gradient_checkpointing_disable()"),
                 ("timm", "grad_checkpointing", "model.set_grad_checkpointing(False)"))


def checkpointing_on(model) -> str | None:
    """What to say when a module of `model` has its library's gradient checkpointing on
    (Hugging Face's `gradient_checkpointing_enable()`, timm's `set_grad_checkpointing()`):
    its checkpointed blocks hold only their inputs and re-run in backward, out of the plan's
    reach (trace/checkpointed.py); None when off."""
    for library, flag, off in CHECKPOINTING:
        if any(getattr(m, flag, False) is True for m in model.modules()):
            return (f"{library} gradient checkpointing is on: its checkpointed blocks hold only "
                    "their inputs and re-run in backward, out of the plan's reach; the plan and "
                    "its budget count what the model holds with it (those inputs kept, the "
                    "re-runs in backward) and place the rest (turn it off with "
                    f"{off} before planning to let the plan place everything)")
    return None


def shapes(sig: tuple) -> str:
    return ", ".join("x".join(map(str, shape)) or "scalar" for shape, _ in sig[2:]) \
        + f" on {sig[0]}, {sig[1]} parameters"


def brief(exc: BaseException) -> str:
    """An exception as one line of a note: its type and its message's first line."""
    return f"{type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"
