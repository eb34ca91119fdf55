"""The compiled path: `compile_planned` (the plan tagged into torch.compile's joint graphs), the
plan per forward op (graph_plan.py), symbolic sizes, re-derived values, and the plan as a
selective-checkpoint policy (sac.py). The module list: docs/design.md, section 3.
"""
