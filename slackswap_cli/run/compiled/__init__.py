"""The compiled path: `compile_planned` (backend.py: the plan tagged into torch.compile's joint
graphs), reading a joint graph (graph_ops.py), the tags and their one map to checkpoint policies
(tags.py), offloading (offload.py), measuring what the graphs carry out (report.py), the plan
per forward op (graph_plan.py), symbolic sizes, re-derived values, and the plan as a
selective-checkpoint policy (sac.py). The module list: docs/design.md, section 3.
"""
