"""Pipeline parallelism, torch-free: the schedules' orders of actions (orders.py), what each
rank holds and one plan per stage under a per-rank budget (stages.py), a pipeline as one step
(step.py), the rank-level copy judge (copies.py), plans in the idle windows (windows.py) and
`fit --pp` (fit.py). The run side (torch's schedules, plan_pipeline) is run/parallel/.
"""
