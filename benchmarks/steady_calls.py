"""Which calls of a patched model are recorded: the models found stuck in the recorder
(every call recorded, each step several times eager), each planned and patched as a user
would, then trained for a few steps; per call, `model.forward.__slackswap__.last_report`'s
`recorded` and the patched/eager seconds of the step.

    python benchmarks/steady_calls.py                      # every case
    python benchmarks/steady_calls.py --only lcnet_050     # one

Ops are priced as in the zoo (slackswap_testkit/small_costs.py), where the budgets below
were met. Prints one line per case; exits 1 if a case records after its first steady call
(the second call at its signature, the third where the first re-plans).
"""
from __future__ import annotations

import argparse
import copy
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

CALLS = 5


def timm_case(name, side=32):
    def build():
        import timm
        import torch

        from benchmarks.zoo_models import classify_loss
        torch.manual_seed(0)
        m = timm.create_model(name, pretrained=False, num_classes=8)
        return m, (torch.randn(2, 3, side, side),), classify_loss
    return build


def lraspp():
    import torch
    import torchvision

    from benchmarks.zoo_models import classify_loss
    torch.manual_seed(0)
    m = torchvision.models.segmentation.lraspp_mobilenet_v3_large(
        weights=None, weights_backbone=None, num_classes=4)

    def loss(out, inputs):
        return classify_loss(out["out"], inputs)
    return m, (torch.randn(2, 3, 32, 32),), loss


def speech2text():
    import torch
    from transformers import Speech2TextConfig, Speech2TextForConditionalGeneration
    torch.manual_seed(0)
    cfg = Speech2TextConfig(vocab_size=64, d_model=32, encoder_layers=2, decoder_layers=2,
                            encoder_attention_heads=2, decoder_attention_heads=2,
                            encoder_ffn_dim=64, decoder_ffn_dim=64, input_feat_per_channel=16,
                            max_source_positions=64, max_target_positions=32,
                            conv_channels=32, dropout=0.1, use_cache=False)
    m = Speech2TextForConditionalGeneration(cfg)
    m.gradient_checkpointing_enable()
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 64, (2, 6), generator=g)
    return m, {"input_features": torch.randn(2, 32, 16, generator=g), "labels": ids}, None


def roberta_mc():
    import torch
    from transformers import RobertaConfig, RobertaForMultipleChoice
    torch.manual_seed(0)
    cfg = RobertaConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2,
                        num_attention_heads=2, intermediate_size=64,
                        max_position_embeddings=40, hidden_dropout_prob=0.1,
                        attention_probs_dropout_prob=0.1)
    m = RobertaForMultipleChoice(cfg)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 64, (2, 3, 8), generator=g)
    mask = torch.ones_like(ids)   # choices of one length, as a tokenizer gives them: eager
    # asks whether the mask pads anything and drops it, the fake trace builds it (84% of the
    # profile's ops line up), so the first call plans again along eager's branches
    return m, {"input_ids": ids, "attention_mask": mask, "labels": torch.tensor([0, 2])}, None


def zamba():
    from benchmarks.zoo_models import build
    return build("transformers", "causal-lm/zamba")    # (the zoo's row)


# name: (builder, planner, budget)
CASES = {
    "lcnet_050": (timm_case("lcnet_050"), "recompute-only", 0.661),
    "tinynet_e": (timm_case("tinynet_e"), "recompute-only", 0.573),
    "lraspp_mobilenet_v3_large": (lraspp, "recompute-only", 0.551),
    "speech2text_checkpointing": (speech2text, "slackswap", 0.535),
    "roberta_multiple_choice": (roberta_mc, "slackswap", 0.3),
    # refused at 0.05: planned at recompute-only's first feasible budget, as the zoo plans it
    "zamba_recompute_only": (zamba, "recompute-only", 0.05),
}


def plan_at(model, inputs, loss_fn, planner, budget):
    """(plan, budget fraction) at `budget`, or at the planner's first feasible budget where
    `budget` is refused (Speech2Text's 0.535, met when the budget's base was the model
    without its own checkpointing, is below the checkpointed step's floor)."""
    import slackswap_cli as slackswap
    from slackswap_cli.budget import first_feasible_budget
    from slackswap_cli.errors import InfeasibleError
    from slackswap_cli.hardware import load_hardware
    kw = dict(loss_fn=loss_fn, device="fake:cpu", planner=planner)
    try:
        return slackswap.plan_model(model, inputs, budget=budget, **kw), budget
    except InfeasibleError as exc:
        prof = exc.plan.profile
        first = first_feasible_budget(prof, load_hardware(None), planner)
        if first is None:
            raise SystemExit(f"{planner} fits no budget") from exc
        print(f"  infeasible at {budget}: planned at its first feasible budget",
              file=sys.stderr)
        return (slackswap.plan_model(model, inputs, budget=int(first), **kw),
                round(first / prof.keep_all_peak_bytes, 3))


def run_case(name: str, calls: int = CALLS) -> dict:
    """Plan, patch and train `calls` steps against an eager twin; per call: recorded?, the
    fraction of the profile's ops it lined up, patched/eager seconds; and whether the losses and gradients were bitwise equal."""
    import torch

    import slackswap_cli as slackswap
    from slackswap_cli.trace.joint import loss_from_output, split_inputs
    from slackswap_testkit.small_costs import small_model_costs
    build, planner, budget = CASES[name]
    model, inputs, loss_fn = build()
    model.train()
    twin = copy.deepcopy(model)
    with small_model_costs():
        plan, budget = plan_at(model, inputs, loss_fn, planner, budget)
    slackswap.patch(model, plan)
    state = model.forward.__slackswap__
    a, kw = split_inputs(inputs)
    recorded, fractions, ratios, same = [], [], [], True
    for k in range(calls):
        secs = []
        grads = []
        for m in (twin, model):
            torch.manual_seed(k)
            t = time.perf_counter()
            loss = loss_from_output(m(*a, **kw), inputs, loss_fn)
            loss.backward()
            secs.append(time.perf_counter() - t)
            grads.append([loss.detach()] + [p.grad for p in m.parameters()])
            m.zero_grad(set_to_none=True)
        same = same and all((x is None and y is None) or torch.equal(x, y)
                            for x, y in zip(*grads))
        recorded.append(state.last_report["recorded"])
        fractions.append(state.last_report["fraction"])
        ratios.append(secs[1] / secs[0])
    return {"name": name, "planner": planner, "budget": budget, "recorded": recorded,
            "fractions": fractions, "ratios": ratios, "bitwise": same, "report": state.last_report}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", help="comma-separated case names: " + ", ".join(CASES))
    ap.add_argument("--calls", type=int, default=CALLS)
    args = ap.parse_args()
    import torch
    torch.set_num_threads(1)
    bad = 0
    for name in (args.only.split(",") if args.only else CASES):
        r = run_case(name, args.calls)
        stuck = any(r["recorded"][2:])
        bad += stuck
        print(f"{name:28s} {r['planner']:15s} {r['budget']:<6} recorded={r['recorded']} "
              f"bitwise={r['bitwise']} ratios={[round(x, 2) for x in r['ratios']]}"
              + (f" why={r['report'].get('not_steady')}" if stuck else ""), flush=True)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
