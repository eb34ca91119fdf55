"""A backward in two passes over a retained graph, through dropout, with plans that recompute.

What a pipeline's split backward does (ZBVZeroBubble, DualPipeV, InterleavedZeroBubble: the
input pass, then the weight pass), in one process: `torch.autograd.grad(loss, x,
retain_graph=True)`, then `torch.autograd.grad(loss, params)`. The second pass makes the
recomputed saved tensors again (run/eager/backward.py, `unpack_again`); a chain that reads a
dropout mask reads it as the first pass did (the host copy of its swapped storage, or what
autograd keeps), never drawing its random numbers anew. Bitwise as eager over three steps:
the recorded first call and two that follow its template.
"""
import dataclasses
import sys
from pathlib import Path

import pytest
import torch

import slackswap_cli as slackswap
from slackswap_cli.hardware import load_hardware

ROOT = Path(__file__).resolve().parents[1]
# the host link planned for: on these KiB-sized blocks plans recompute as well as swap
LINK = 5e7


def _hardware():
    hw = load_hardware(None)
    return dataclasses.replace(hw, h2d_bytes_per_s=LINK, d2h_bytes_per_s=LINK)


def _tiny_gpt_blocks():
    """Two of examples/tiny_gpt.py's blocks, dropout 0.1 (attention and residual): a middle
    pipeline stage, its input an activation that needs a gradient."""
    sys.path.insert(0, str(ROOT / "examples"))
    from tiny_gpt import Block

    class Mid(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = torch.nn.ModuleList(Block(32, 2, 0.1) for _ in range(2))

        def forward(self, x):
            for block in self.blocks:
                x = block(x)
            return x
    return Mid


def _hf_gpt2():
    """A Hugging Face GPT-2 from its config (dropout 0.1 everywhere), fed embeddings."""
    from transformers import GPT2Config, GPT2LMHeadModel
    cfg = GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=2,
                     resid_pdrop=0.1, embd_pdrop=0.1, attn_pdrop=0.1, bos_token_id=0,
                     eos_token_id=0)
    return lambda: GPT2LMHeadModel(cfg)


def _steps(model, call, x0, steps=3):
    """`steps` split backwards: the input's gradient (graph retained), then the parameters'."""
    torch.manual_seed(5)
    out = []
    for _ in range(steps):
        x = x0.clone().requires_grad_()
        loss = call(model, x)
        gx, = torch.autograd.grad(loss, x, retain_graph=True)
        gp = torch.autograd.grad(loss, list(model.parameters()))
        out.append([loss.detach(), gx, *gp])
    return out


CASES = {
    "tiny_gpt_blocks": (_tiny_gpt_blocks, lambda m, x: m(x).square().mean(),
                        lambda out, inp: out.square().mean()),
    "hf_gpt2": (_hf_gpt2, None, None),
}


@pytest.mark.parametrize("name,budget,planner", [
    ("tiny_gpt_blocks", 0.4, "slackswap"),
    ("tiny_gpt_blocks", 0.6, "recompute-only"),     # the masks kept, chains read them
    ("hf_gpt2", 0.4, "slackswap"),
])
def test_a_split_backward_through_dropout_is_eager_bitwise(name, budget, planner):
    make, call, loss_fn = CASES[name]
    cls = make()
    torch.manual_seed(0)
    eager, model = cls(), cls()
    model.load_state_dict(eager.state_dict())
    eager.train(), model.train()      # (a Hugging Face model is built in eval mode)
    x0 = torch.randn(2, 16, 32)
    if call is None:              # Hugging Face: the loss from labels
        labels = torch.randint(0, 64, (2, 16))

        def call(m, x):
            return m(inputs_embeds=x, labels=labels).loss
        inputs = {"inputs_embeds": x0.clone().requires_grad_(), "labels": labels}
    else:
        inputs = (x0.clone().requires_grad_(),)
    plan = slackswap.plan_model(model, inputs, budget=budget, planner=planner,
                                hardware=_hardware(), loss_fn=loss_fn, measure=False)
    acts = plan.actions()
    assert acts["recompute"] > 0 and (acts["swap"] > 0) == (planner == "slackswap"), acts
    want = _steps(eager, call, x0)
    slackswap.patch(model, plan)
    got = _steps(model, call, x0)
    assert all(torch.equal(a, b) for w, g in zip(want, got) for a, b in zip(w, g))
    run = model.forward.__slackswap__.last_run
    assert run.tpl is not None and run.rerun_ops > 0   # the last step followed the template


@pytest.mark.parametrize("budget", [0.5, 0.4])
def test_torchs_own_split_backward_over_microbatches_is_eager_bitwise(budget):
    """What a pipeline stage runs: torch's `stage_backward_input` then `stage_backward_weight`
    (the weight pass starts from the intermediates the input pass kept), microbatch after
    microbatch with the next one's forward already run (calls that follow the template):
    a chain's kept dropout mask is read from what autograd holds, not drawn again."""
    from torch.distributed.pipelining._backward import stage_backward_input, stage_backward_weight

    from slackswap_testkit.pipeline_run import make_gpt2_stage
    eager, model = make_gpt2_stage(1, 4, 2), make_gpt2_stage(1, 4, 2)
    torch.manual_seed(0)
    x0 = torch.randn(2, 16, 32)
    plan = slackswap.plan_model(model, (x0.clone().requires_grad_(),), budget=budget,
                                hardware=_hardware(), loss_fn=lambda out, inp: out.sum(),
                                measure=False)
    assert plan.actions()["recompute"] > 0

    def steps(m, n=3, mbs=3):
        torch.manual_seed(5)
        got = []
        for _ in range(n):
            xs = [x0.clone().requires_grad_() for _ in range(mbs)]
            outs = [m(x) for x in xs]
            for out, x in zip(outs, xs):
                gx, groups = stage_backward_input([out], [torch.ones_like(out)], [x],
                                                  m.parameters())
                stage_backward_weight(m.parameters(), groups)
                got += [out.detach(), gx[0], *(p.grad for p in m.parameters())]
                for p in m.parameters():
                    p.grad = None
        return got
    want = steps(eager)
    slackswap.patch(model, plan)
    got = steps(model)
    assert all(torch.equal(a, b) for a, b in zip(want, got))
    assert model.forward.__slackswap__.last_run.tpl is not None


def test_interleaved_zero_bubble_rank_order_over_two_stages_is_eager_bitwise():
    """Rank 1 of InterleavedZeroBubble (pp=2, two stages a rank: 1 and 3, 4 microbatches) in
    one process: torch's order for that rank (`schedule_order`), each stage first called as
    PipelineStage's metadata inference calls it (a forward on an uninitialised input, then
    its input's gradient alone), then input and weight passes of several microbatches
    interleaved across the two patched stage modules, a stage's forward of a later
    microbatch between a microbatch's input pass and its weight pass; GPT-2 blocks with
    dropout 0.1 under plans that swap and recompute, bitwise as eager over two steps."""
    from torch.distributed.pipelining._backward import stage_backward_input, stage_backward_weight

    from slackswap_cli.run.parallel.pipeline import schedule_order
    from slackswap_testkit.pipeline_run import make_gpt2_stage
    order = schedule_order("InterleavedZeroBubble", 2, 4, 2)[1]
    assert [k for k, s, m in order if s == 1][:6] == ["F", "F", "F", "I", "F", "I"]
    torch.manual_seed(0)
    xs = {m: torch.randn(2, 16, 32) for m in range(4)}
    gs = {m: torch.randn(2, 16, 32) for m in range(4)}
    loss = lambda out: out.float().square().mean()     # (the last stage's loss)
    models, acts = {}, {}
    for s in (1, 3):
        models[s] = (make_gpt2_stage(s, 4, 1), make_gpt2_stage(s, 4, 1))
        plan = slackswap.plan_model(models[s][1], (xs[0].clone().requires_grad_(),),
                                    budget=0.6, hardware=_hardware(),
                                    measure=False,
                                    loss_fn=(lambda out, inp: loss(out)) if s == 3 else
                                    (lambda out, inp: out.sum()))
        acts[s] = plan.actions()
        slackswap.patch(models[s][1], plan)

    def steps(which, n=2):
        torch.manual_seed(5)
        mods, got = {s: pair[which] for s, pair in models.items()}, []
        for s in (1, 3):                   # PipelineStage's metadata inference
            x = torch.empty(2, 16, 32).requires_grad_()
            out = mods[s](x)
            torch.autograd.grad([out], [x], [torch.ones_like(out)], allow_unused=True)
        for _ in range(n):
            ins, outs, groups = {}, {}, {}
            for kind, s, m in order:
                if kind == "F":
                    ins[s, m] = xs[m].clone().requires_grad_()
                    out = mods[s](ins[s, m])
                    outs[s, m] = loss(out) if s == 3 else out
                elif kind == "I":
                    grad = [None] if s == 3 else [gs[m]]
                    gx, groups[s, m] = stage_backward_input([outs[s, m]], grad, [ins[s, m]],
                                                            mods[s].parameters())
                    got += [outs[s, m].detach(), gx[0]]
                else:
                    stage_backward_weight(mods[s].parameters(), groups.pop((s, m)))
            for s in (1, 3):
                got += [p.grad for p in mods[s].parameters()]
                for p in mods[s].parameters():
                    p.grad = None
        return got
    assert all(a["recompute"] > 0 for a in acts.values()) and any(
        a["swap"] > 0 for a in acts.values()), acts
    want, got = steps(0), steps(1)
    assert len(want) == len(got) and all(torch.equal(a, b) for a, b in zip(want, got))
