"""compile_planned on the four small models: does the compiled graph carry the plan out, and
does it train like eager? (CPU).

For tiny GPT (dropout on), HF GPT-2 (dropout on), Llama and the BatchNorm CNN, profiled with
fake tensors and planned by slackswap at 0.3/0.5/0.7 of the keep-all peak, `verify --compile`
(`run/verify/compiled.py`, 3 AdamW steps against eager) with backend aot_eager at every
budget and inductor at the budgets given by --inductor. Writes
benchmarks/results/compiled_check.json and .md: the compiled graphs beside the whole plan
(the plan's bytes as the graphs hold them: `verify_compiled`'s docstring).

The profiles are `--device fake` (random ops traced as CUDA runs them): AOTAutograd turns
`aten.dropout` into `native_dropout` on every device, as a CUDA-target profile traces
`nn.Dropout`, so that profile is the one the compiled graph on this CPU lines up with; a
`fake:cpu` profile traces every dropout as eager CPU runs it (`bernoulli_` on float noise);
it lines up as well (`graph_plan.graph_units`), with every dropout's mask held in a quarter of
the planned bytes (tiny GPT at 0.5: 130/130 ops, 7 resized roots against 2, passed).

    PYTHONPATH=$PWD python benchmarks/compiled_check.py [--inductor 0.5] [--models tiny_gpt,...]
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))


# the held-out cases of the inductor check (Hugging Face Llama with grouped-query attention,
# ViT, GPT-2 with dropout on), as a new user would write them: `--models llama_heldout,...`
HELDOUT = {
    "llama_heldout": '''
import torch
from transformers import LlamaConfig, LlamaForCausalLM
def workload(batch=2, seq=128):
    torch.manual_seed(0)
    cfg = LlamaConfig(num_hidden_layers=4, hidden_size=256, intermediate_size=688,
                      num_attention_heads=8, num_key_value_heads=4, vocab_size=2000)
    ids = torch.randint(0, 2000, (batch, seq))
    return LlamaForCausalLM(cfg), {"input_ids": ids, "labels": ids}
''',
    "vit_heldout": '''
import torch
from transformers import ViTConfig, ViTForImageClassification
def workload(batch=2):
    torch.manual_seed(0)
    cfg = ViTConfig(image_size=32, patch_size=8, num_channels=3, hidden_size=64,
                    num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
                    hidden_dropout_prob=0.1, attention_probs_dropout_prob=0.1, num_labels=10)
    return ViTForImageClassification(cfg), {"pixel_values": torch.randn(batch, 3, 32, 32),
                                            "labels": torch.randint(0, 10, (batch,))}
''',
    "gpt2_heldout": '''
import torch
from transformers import GPT2Config, GPT2LMHeadModel
def workload(batch=2, seq=128):
    torch.manual_seed(0)
    cfg = GPT2Config(n_layer=4, n_embd=256, n_head=4, vocab_size=2000, n_positions=128)
    ids = torch.randint(0, 2000, (batch, seq))
    return GPT2LMHeadModel(cfg), {"input_ids": ids, "labels": ids}
''',
}

HEAD = ("| model | budget | backend | lined up | saved B | offloaded B | recomputed | "
        "re-derived views | plan kept B | plan swapped B | plan kept B in graph | "
        "plan swapped B in graph | resized roots | merged roots | plan recomputed | max loss rel | "
        "max param rel | max buffer rel | passed |")


def _line(r: dict) -> str:
    """One row of the table: the compiled graphs beside the whole plan (see the docstring)."""
    c, p = r["compiled"], r["plan"]
    cells = [r["model"], r["budget"], r["backend"], f"{c['lined_up_ops']}/{c['graph_ops']}",
             c["saved_bytes"], c["offloaded_bytes"], c["recomputed_ops"], c["rederived_views"],
             p["kept_bytes"], p["swapped_bytes"], p["kept_bytes_in_graph"],
             p["swapped_bytes_in_graph"], p["resized_roots"], ", ".join(p["merged_roots"]) or "-",
             p["recomputed_ops"],
             f"{r['max_loss_rel_diff']:.1e}", f"{r['max_param_rel_diff']:.1e}",
             f"{r['max_buffer_rel_diff']:.1e}", r["passed"]]
    return "| " + " | ".join(str(x) for x in cells) + " |"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="tiny_gpt,gpt2,llama,cnn")
    ap.add_argument("--budgets", default="0.3,0.5,0.7")
    ap.add_argument("--inductor", default="", help="budgets to run with inductor too")
    ap.add_argument("--inductor-only", action="store_true", help="skip aot_eager")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "compiled_check"))
    ap.add_argument("--device", default="fake", help="profile device (fake, fake:cpu)")
    ap.add_argument("--steps", type=int, default=3, help="AdamW steps per verify")
    a = ap.parse_args()
    import torch
    from workloads import HW, SOURCES, plan_at
    from workloads import ROOT as TROOT

    from slackswap_cli.run.emit import apply_plan
    from slackswap_cli.run.verify.compiled import verify_compiled
    from slackswap_cli.trace import profile_workload
    tmp = Path(tempfile.mkdtemp())
    rows = []
    for name in a.models.split(","):
        path = TROOT / "examples" / "tiny_gpt.py" if name == "tiny_gpt" else tmp / f"{name}.py"
        if name != "tiny_gpt":
            path.write_text({**SOURCES, **HELDOUT}[name])
        prof = profile_workload(str(path), device=a.device, hardware=HW)
        for frac in [float(x) for x in a.budgets.split(",")]:
            plan = plan_at(prof, frac * prof.summary["peak_activation_bytes"])
            mod = tmp / f"{name}_{frac}.py"
            mod.write_text(apply_plan(plan, prof))
            backends = ([] if a.inductor_only else ["aot_eager"]) + \
                (["inductor"] if str(frac) in a.inductor.split(",") else [])
            for backend in backends:
                # each verify compiles the same model code anew (inductor: twice, planned and
                # plain); past dynamo's recompile_limit (8) it would run eager and capture no graph
                torch._dynamo.reset()
                r = verify_compiled(str(mod), backend=backend, steps=a.steps)
                rows.append({"model": name, "budget": frac, "device": a.device, **r})
                print(_line(rows[-1]), flush=True)
    Path(a.out + ".json").write_text(json.dumps(rows, indent=1))
    write_md(rows, a.out + ".md")


def write_md(rows: list[dict], path: str) -> None:
    """The table, with what each column means and why a row did not pass."""
    lines = ["# compile_planned: the compiled graphs against the whole plan (CPU, 3 AdamW steps)",
             "", "`python benchmarks/compiled_check.py --inductor 0.5`. Profiles `--device fake`, "
             "plans by slackswap at 0.3/0.5/0.7 of the keep-all peak, `verify --compile` "
             "(run/verify/compiled.py). Bytes: saved for backward on the device and offloaded, "
             "beside the plan's kept and swapped bytes, whole and as the graphs hold them "
             "(\"in graph\": bool dropout masks for the profile's float noise (resized roots), "
             "roots of CSE-merged ops (merged roots) and roots only a recompute chain's ops "
             "make, re-made with the op, taken out). Recomputed: ops of the plan's chains "
             "backward re-runs; re-derived views apart. Differences (`verify_compiled."
             "scaled_diff`) against the reference: eager for aot_eager (bitwise), plain "
             "torch.compile with the same options for inductor (eager figures in the JSON's "
             "`vs_eager`). With inductor every byte saved on the device for backward (the "
             "decompositions' own values included) is checked against the plan's kept bytes "
             "(+2%), and offloaded against the swapped bytes backward reads (the notes below "
             "say what inductor decomposed, per row).", "",
             HEAD, "|" + "---|" * (HEAD.count("|") - 1)]
    lines += [_line(r) for r in rows]
    failed = [r for r in rows if not r["passed"]]
    if failed:
        lines += ["", "Rows that did not pass:", ""]
        lines += [f"- {r['model']} {r['budget']} {r['backend']}: " + "; ".join(r["reasons"])
                  for r in failed]
    noted = [r for r in rows if r.get("notes")]
    if noted:
        lines += ["", "Notes (inductor):", ""]
        lines += [f"- {r['model']} {r['budget']}: " + "; ".join(r["notes"]) for r in noted]
    Path(path).write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
