"""The eager runtime: the plan inside the model's own forward (`patch(model)`).

inplace.py decides which kind of call a call is; first_call.py, steady_call.py and new_shape.py
are the kinds, over call_state.py's one state; holding.py and backward.py are what autograd
holds and what backward does with it; signatures.py, templates.py, tables.py, packs.py,
lineup.py and recorded.py are their records; replan.py and branches.py plan again at new
shapes. The module list, one line each: docs/design.md, section 3.
"""
