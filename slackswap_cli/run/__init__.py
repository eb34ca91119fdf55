"""The run side: carrying a plan out on the real model, and checking that it was.

The modules, one line each, are listed in docs/design.md, section 3 (the one list of the
layout): the emitted file (emit.py, and door.py, the one module it imports), the plan inside
the model's own forward (inplace.py and the modules it runs: signatures, call_state and the
kinds of call, first_call, steady_call, new_shape, holding, backward, swap), the written-out step (step_code.py, step.py), torch.compile (compiled.py, sac.py) and
the checks (verify*.py).

Everything here imports torch; the planning core (schema, simulate, planners, ...) never imports
this package (tests/test_torch_free.py).
"""
