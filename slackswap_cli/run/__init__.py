"""The run side: carrying a plan out on the real model, and checking that it was.

    emit.py       plan -> the patched module file (`slackswap apply`); load_patched
    inplace.py    `patch(model)`: the plan carried out inside the model's own forward (what
                  users train with): op recorder, saved-tensor hooks, replay of chains
    step_code.py  the joint graph split by the plan's layout, written as a forward step and a
                  backward step (Python source in the emitted file)
    step.py       `step_module(model)`: runs those two steps as one autograd node
    swap.py       the swap engine both runtimes use: host pool, side streams, StepStore
    replan.py     a plan for new input shapes, from inside a patched model
    memtrace.py   activation memory measured op by op (verify, benchmarks)
    verify.py     original vs patched: runs the checks below in order, the VerifyReport
    verify_steps.py     the two models stepped side by side; losses, gradients, buffers
    verify_timeline.py  memory op by op, aligned with the simulator's prediction
    verify_memory.py    does the run fit here; why a measured peak fails the budget
    verify_inplace.py   the model patched in place against eager

Everything here imports torch; the planning core (schema, simulate, planners, ...) never imports
this package (tests/test_torch_free.py).
"""
