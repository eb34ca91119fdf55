"""The run side: carrying a plan out on the real model, and checking that it was.

One folder a part: eager/ (the plan inside the model's own forward: `patch(model)`), written/
(the written-out step: `step_module`), compiled/ (`compile_planned`, sac_policy), verify/
(`verify`, `check`, plan_model's measure), parallel/ (pipeline and tensor parallel). What they
share stays here: api.py (the library face), door.py (the one module a patched file imports),
emit.py and generated.py (the patched file), swap.py (the swap engine), notes.py (the library's
one voice), rng.py, hf.py (the Trainer callback). The module list, one line each:
docs/design.md, section 3.

Everything here imports torch; the planning core (schema, simulate, planners, ...) never imports
this package (tests/test_torch_free.py).
"""
