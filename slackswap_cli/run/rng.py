"""Every random number generator a model may draw from, saved and restored around what
slackswap runs of the model besides the user's own step (a trace, a re-plan, a check).

torch's generators (CPU and CUDA) are not the only ones a step reads: Hugging Face's wav2vec2
family draws its SpecAugment masks with NumPy's global generator, and models may call
Python's `random`. A re-plan inside a patched call traces the model's forward once more; had
it advanced NumPy's generator, the next step would mask other frames than eager does, and the
patched run would no longer train bitwise like eager.
"""
from __future__ import annotations

import contextlib
import random
import sys

import torch


def rng_state() -> tuple:
    """(torch CPU, CUDA (None unless initialized), NumPy's global (None unless NumPy is
    loaded), Python's `random`) states."""
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
    np = sys.modules.get("numpy")
    return (torch.get_rng_state(), cuda, np.random.get_state() if np is not None else None,
            random.getstate())


def set_rng_state(state: tuple) -> None:
    torch.set_rng_state(state[0])
    if state[1] is not None:
        torch.cuda.set_rng_state_all(state[1])
    if state[2] is not None:
        sys.modules["numpy"].random.set_state(state[2])
    random.setstate(state[3])


@contextlib.contextmanager
def forked_rng():
    """Every generator of `rng_state` as it was when the block ends."""
    saved = rng_state()
    try:
        yield
    finally:
        set_rng_state(saved)
