"""Checking and measuring a plan on the real model: `verify` (verify.py and the steps it runs),
`check` (check.py), activation memory op by op (memtrace.py) and what eager holds beyond the
simulator (excess.py, plan_model's measure). The module list: docs/design.md, section 3.
"""
