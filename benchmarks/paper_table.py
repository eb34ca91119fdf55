"""Reproduce the reference paper's table: retention of every planner on the sample profiles.

For each profile (default: sample_profiles/bert-large.json, gpt2-xl.json, llama-7b.json) this
plans the step with every registered planner at budget 0.5 of the keep-all activation peak on
`a100-pcie4`, then sweeps the budget from 0.1 to 1.0, and writes

- `<out>/paper_table.json`: every (profile, planner, budget) result with the simulator's numbers,
- `<out>/paper_table.md`: the table at 0.5 next to the published figures, and the sweep,
- `<out>/paper_table.png`: retention against budget, one panel a profile (if matplotlib imports).

    python benchmarks/paper_table.py [--profiles a.json b.json] [--out benchmarks/results]
                                     [--hardware a100-pcie4] [--optimal-time-limit 60]
                                     [--synthetic]

`--synthetic` (or a missing sample profile) uses transformer-shaped synthetic profiles built
here with ProfileBuilder (see `transformer_profile`), so the benchmark runs before the traced
samples exist. Those are stand-ins, not the paper's workloads: the table says which was used.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from slackswap_cli.hardware import PRESETS, HardwareSpec, load_hardware  # noqa: E402
from slackswap_cli.profile_build import ProfileBuilder  # noqa: E402
from slackswap_cli.schema import Profile  # noqa: E402

# Published retention at half the activation peak, A100 + PCIe 4.0 (DESIGN.md §1).
PUBLISHED = {"bert-large": 0.963, "gpt2-xl": 0.976, "llama-7b": 0.996}
SAMPLES = ["sample_profiles/bert-large.json", "sample_profiles/gpt2-xl.json",
           "sample_profiles/llama-7b.json"]
SWEEP = [0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0]

# name -> (architecture, layers, hidden, heads, ffn, batch, seq)
SYNTHETIC_SHAPES = {
    "bert-large": ("bert", 24, 1024, 16, 4096, 8, 512),
    "gpt2-xl": ("gpt2", 48, 1600, 25, 6400, 4, 1024),
    "llama-7b": ("llama", 32, 4096, 32, 11008, 1, 4096),
}


# --------------------------------------------------------------------------------------------
# Synthetic transformer profiles (stand-ins until traced samples exist)
# --------------------------------------------------------------------------------------------
def transformer_profile(arch: str = "gpt2", layers: int = 4, hidden: int = 256, heads: int = 4,
                        ffn: int | None = None, batch: int = 2, seq: int = 128,
                        hw: HardwareSpec | None = None, name: str | None = None) -> Profile:
    """An aten-level-looking training step of a transformer, roofline-timed on `hw`.

    Per block (bf16): norm (output + fp32 statistics), QKV projection(s), flash-style attention
    (output + fp32 log-sum-exp), output projection, dropout (bert/gpt2: output and bool mask, not
    recomputable), residual add, norm, MLP (GELU, or SwiGLU for llama), dropout, residual add;
    backward mirrors it, reading what forward saved and producing gradient transients.
    """
    hw = hw or PRESETS["a100-pcie4"]
    ffn = ffn or 4 * hidden
    n_tok = batch * seq
    bf = 2
    b = ProfileBuilder()

    def act(nm, cols, dtype="bfloat16", rec=True):
        return b.add_tensor(nm, "activation", (n_tok, cols), dtype, recomputable=rec)

    def op(nm, target, phase, ins, outs, mod, flops=0, extra_bytes=0):
        moved = sum(b.tensors[t].size_bytes for t in (*ins, *outs)
                    if b.tensors[t].kind == "activation") + extra_bytes
        return b.add_op(nm, target, phase, ins, outs, module=mod, flops=int(flops), bytes=moved,
                        time_us=hw.roofline_us(flops, moved))

    def param(nm, n_el):
        return b.add_tensor(nm, "parameter", (n_el,), "bfloat16")

    x_in = b.add_tensor("input_embeds", "input", (n_tok, hidden), "bfloat16")
    prefix = {"bert": "bert.encoder.layer", "gpt2": "transformer.h", "llama": "model.layers"}[arch]
    dropout = arch != "llama"
    x = act("embed", hidden)
    op("embed", "aten.embedding.default", "forward", (x_in,), (x,), "embed", 0)
    saved_per_layer = []
    for li in range(layers):
        mod = f"{prefix}.{li}"
        w = {k: param(f"{k}{li}", n) for k, n in (
            ("wqkv", 3 * hidden * hidden), ("wo", hidden * hidden),
            ("w1", hidden * ffn * (2 if arch == "llama" else 1)), ("w2", hidden * ffn))}
        s = {}
        s["x"] = x
        h1, mu1, rs1 = act(f"ln1_{li}", hidden), act(f"mu1_{li}", 1, "float32"), act(f"rs1_{li}", 1, "float32")
        op(f"ln1_{li}", "aten.native_layer_norm.default", "forward", (x,), (h1, mu1, rs1), f"{mod}.ln_1")
        qkv = act(f"qkv_{li}", 3 * hidden)
        op(f"qkv_{li}", "aten.addmm.default", "forward", (h1, w["wqkv"]), (qkv,), f"{mod}.attn.c_attn",
           2 * n_tok * hidden * 3 * hidden, 3 * hidden * hidden * bf)
        if arch == "llama":  # rotary embedding: q, k rotated copies
            qk = act(f"rope_{li}", 2 * hidden)
            op(f"rope_{li}", "aten.mul.Tensor", "forward", (qkv,), (qk,), f"{mod}.attn.rotary")
            att_in = (qk, qkv)
        else:
            att_in = (qkv,)
        o = act(f"attn_{li}", hidden)
        lse = b.add_tensor(f"lse_{li}", "activation", (batch, heads, seq), "float32")
        causal = 0.5 if arch != "bert" else 1.0
        att_flops = 4 * batch * seq * seq * hidden * causal
        op(f"attn_{li}", "aten._scaled_dot_product_flash_attention.default", "forward", att_in,
           (o, lse), f"{mod}.attn", att_flops)
        pr = act(f"proj_{li}", hidden)
        op(f"proj_{li}", "aten.addmm.default", "forward", (o, w["wo"]), (pr,), f"{mod}.attn.c_proj",
           2 * n_tok * hidden * hidden, hidden * hidden * bf)
        if dropout:
            pd, mask = act(f"drop1_{li}", hidden, rec=False), act(f"mask1_{li}", hidden, "bool", rec=False)
            op(f"drop1_{li}", "aten.native_dropout.default", "forward", (pr,), (pd, mask), f"{mod}.attn.dropout")
        else:
            pd, mask = pr, None
        x2 = act(f"res1_{li}", hidden)
        op(f"res1_{li}", "aten.add.Tensor", "forward", (x, pd), (x2,), mod)
        h2, mu2, rs2 = act(f"ln2_{li}", hidden), act(f"mu2_{li}", 1, "float32"), act(f"rs2_{li}", 1, "float32")
        op(f"ln2_{li}", "aten.native_layer_norm.default", "forward", (x2,), (h2, mu2, rs2), f"{mod}.ln_2")
        if arch == "llama":
            u = act(f"gateup_{li}", 2 * ffn)
            op(f"gateup_{li}", "aten.mm.default", "forward", (h2, w["w1"]), (u,), f"{mod}.mlp.gate_up",
               2 * n_tok * hidden * 2 * ffn, 2 * hidden * ffn * bf)
            g = act(f"swiglu_{li}", ffn)
            op(f"swiglu_{li}", "aten.mul.Tensor", "forward", (u,), (g,), f"{mod}.mlp.act")
        else:
            u = act(f"fc1_{li}", ffn)
            op(f"fc1_{li}", "aten.addmm.default", "forward", (h2, w["w1"]), (u,), f"{mod}.mlp.c_fc",
               2 * n_tok * hidden * ffn, hidden * ffn * bf)
            g = act(f"gelu_{li}", ffn)
            op(f"gelu_{li}", "aten.gelu.default", "forward", (u,), (g,), f"{mod}.mlp.act")
        v = act(f"fc2_{li}", hidden)
        op(f"fc2_{li}", "aten.addmm.default", "forward", (g, w["w2"]), (v,), f"{mod}.mlp.c_proj",
           2 * n_tok * hidden * ffn, hidden * ffn * bf)
        if dropout:
            vd, mask2 = act(f"drop2_{li}", hidden, rec=False), act(f"mask2_{li}", hidden, "bool", rec=False)
            op(f"drop2_{li}", "aten.native_dropout.default", "forward", (v,), (vd, mask2), f"{mod}.mlp.dropout")
        else:
            vd, mask2 = v, None
        x3 = act(f"res2_{li}", hidden)
        op(f"res2_{li}", "aten.add.Tensor", "forward", (x2, vd), (x3,), mod)
        saved_per_layer.append(dict(mod=mod, w=w, x=x, h1=h1, mu1=mu1, rs1=rs1, qkv=qkv,
                                    qk=att_in[0] if arch == "llama" else None, o=o, lse=lse,
                                    mask=mask, x2=x2, h2=h2, mu2=mu2, rs2=rs2, u=u, g=g,
                                    mask2=mask2))
        x = x3
    loss = b.add_tensor("loss", "activation", (), "float32")
    op("loss", "aten.mean.default", "forward", (x,), (loss,), "loss")
    gy = b.add_tensor("tangent", "input", (), "float32")
    gx = act("grad_out", hidden)
    op("loss_bwd", "aten.expand.default", "backward", (gy, x), (gx,), "loss")
    for li in reversed(range(layers)):
        s = saved_per_layer[li]
        mod, w = s["mod"], s["w"]

        def gw(nm):
            return b.add_tensor(f"{nm}_grad{li}", "gradient", (1,), "bfloat16",
                                size_bytes=b.tensors[w[nm]].size_bytes)
        if dropout:
            gv = act(f"gdrop2_{li}", hidden)
            op(f"gdrop2_{li}", "aten.native_dropout_backward.default", "backward", (gx, s["mask2"]), (gv,), f"{mod}.mlp.dropout")
        else:
            gv = gx
        gg = act(f"gfc2_{li}", ffn)
        op(f"gfc2_{li}", "aten.mm.default", "backward", (gv, s["g"]), (gg, gw("w2")), f"{mod}.mlp.c_proj",
           4 * n_tok * hidden * ffn, hidden * ffn * bf)
        gu = act(f"gact_{li}", 2 * ffn if arch == "llama" else ffn)
        op(f"gact_{li}", "aten.gelu_backward.default" if arch != "llama" else "aten.mul.Tensor",
           "backward", (gg, s["u"]), (gu,), f"{mod}.mlp.act")
        gh2 = act(f"gfc1_{li}", hidden)
        op(f"gfc1_{li}", "aten.mm.default", "backward", (gu, s["h2"]), (gh2, gw("w1")), f"{mod}.mlp.c_fc",
           4 * n_tok * hidden * ffn * (2 if arch == "llama" else 1), hidden * ffn * bf)
        gx2 = act(f"gln2_{li}", hidden)
        op(f"gln2_{li}", "aten.native_layer_norm_backward.default", "backward",
           (gh2, gx, s["x2"], s["mu2"], s["rs2"]), (gx2,), f"{mod}.ln_2")
        if dropout:
            gp = act(f"gdrop1_{li}", hidden)
            op(f"gdrop1_{li}", "aten.native_dropout_backward.default", "backward", (gx2, s["mask"]), (gp,), f"{mod}.attn.dropout")
        else:
            gp = gx2
        go = act(f"gproj_{li}", hidden)
        op(f"gproj_{li}", "aten.mm.default", "backward", (gp, s["o"]), (go, gw("wo")), f"{mod}.attn.c_proj",
           4 * n_tok * hidden * hidden, hidden * hidden * bf)
        gqkv = act(f"gattn_{li}", 3 * hidden)
        att_ins = (go, s["qkv"], s["o"], s["lse"]) + ((s["qk"],) if s["qk"] is not None else ())
        causal = 0.5 if arch != "bert" else 1.0
        op(f"gattn_{li}", "aten._scaled_dot_product_flash_attention_backward.default", "backward",
           att_ins, (gqkv,), f"{mod}.attn", 2.5 * 4 * batch * seq * seq * hidden * causal)
        gh1 = act(f"gqkv_{li}", hidden)
        op(f"gqkv_{li}", "aten.mm.default", "backward", (gqkv, s["h1"]), (gh1, gw("wqkv")), f"{mod}.attn.c_attn",
           4 * n_tok * hidden * 3 * hidden, 3 * hidden * hidden * bf)
        gxn = act(f"gln1_{li}", hidden)
        op(f"gln1_{li}", "aten.native_layer_norm_backward.default", "backward",
           (gh1, gx2, s["x"], s["mu1"], s["rs1"]), (gxn,), f"{mod}.ln_1")
        gx = gxn
    gemb = b.add_tensor("embed_grad", "gradient", (1,), "bfloat16")
    op("embed_bwd", "aten.embedding_dense_backward.default", "backward", (gx,), (gemb,), "embed")
    return b.build(workload={"name": name or f"synthetic-{arch}", "synthetic": True,
                             "args": dict(arch=arch, layers=layers, hidden=hidden, heads=heads,
                                          ffn=ffn, batch=batch, seq=seq)},
                   env={"device": "synthetic", "hardware": hw.name})


def synthetic_sample(name: str, hw: HardwareSpec) -> Profile:
    arch, layers, hidden, heads, ffn, batch, seq = SYNTHETIC_SHAPES[name]
    return transformer_profile(arch, layers, hidden, heads, ffn, batch, seq, hw=hw,
                               name=f"synthetic-{name}")


# --------------------------------------------------------------------------------------------
# The benchmark
# --------------------------------------------------------------------------------------------
def _profile_key(prof: Profile, path: str | None) -> str:
    name = str(prof.workload.get("name") or Path(path or "profile").stem)
    return name.removeprefix("synthetic-")


def run_one(prof: Profile, hw: HardwareSpec, planner: str, fraction: float,
            optimal_time_limit_s: float) -> dict:
    from slackswap_cli.errors import SlackswapError
    from slackswap_cli.planners import make_plan
    from slackswap_cli.simulate import budget_floor_bytes

    peak = int(prof.summary["peak_activation_bytes"])
    budget = int(fraction * peak)
    row = {"planner": planner, "budget_fraction": fraction, "budget_bytes": budget}
    if budget < budget_floor_bytes(prof):
        row.update(feasible=False, below_floor=True, retention=None)
        return row
    options = {"time_limit_s": optimal_time_limit_s} if planner == "optimal" else {}
    try:
        t0 = time.perf_counter()
        plan = make_plan(planner, prof, hw, budget, budget_fraction=fraction, **options)
        wall_ms = (time.perf_counter() - t0) * 1e3
    except SlackswapError as exc:
        row.update(feasible=False, error=str(exc), retention=None)
        return row
    pr = plan.predicted
    acts = [d.action for d in plan.decisions]
    row.update(feasible=plan.feasible, retention=pr.retention, step_us=pr.step_us,
               ideal_us=pr.ideal_us, peak_bytes=pr.peak_bytes, stall_us=pr.stall_us,
               recompute_us=pr.recompute_us, swapped_bytes=pr.swapped_bytes,
               n_keep=acts.count("keep"), n_swap=acts.count("swap"),
               n_recompute=acts.count("recompute"), solve_ms=plan.solve_ms,
               plan_and_simulate_ms=wall_ms, notes=list(plan.notes))
    return row


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--profiles", nargs="*", default=None,
                    help="profile JSON files [default: the three sample profiles]")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results"),
                    help="output folder [default: benchmarks/results]")
    ap.add_argument("--hardware", default="a100-pcie4")
    ap.add_argument("--budget", type=float, default=0.5, help="budget of the main table")
    ap.add_argument("--sweep", default=",".join(str(x) for x in SWEEP),
                    help="comma-separated budget fractions of the sweep")
    ap.add_argument("--planners", default=None, help="comma-separated subset")
    ap.add_argument("--optimal-time-limit", type=float, default=60.0,
                    help="seconds for the MILP at the main budget [default 60]")
    ap.add_argument("--sweep-optimal-time-limit", type=float, default=0.0,
                    help="seconds for the MILP at each sweep budget; 0 leaves optimal out of "
                         "the sweep [default 0]")
    ap.add_argument("--synthetic", action="store_true",
                    help="use the synthetic transformer stand-ins instead of sample profiles")
    ap.add_argument("--plot-only", action="store_true",
                    help="redraw <out>/paper_table.png from <out>/paper_table.json, run nothing")
    args = ap.parse_args(argv)
    if args.plot_only:
        import orjson
        results = orjson.loads((Path(args.out) / "paper_table.json").read_bytes())
        names = list(dict.fromkeys(r["planner"] for e in results["profiles"] for r in e["main"]))
        png = plot(results, names, Path(args.out) / "paper_table.png")
        print(f"[paper_table] wrote {png}" if png else "[paper_table] matplotlib is not installed")
        return 0 if png else 1

    from slackswap_cli.planners import planner_names
    from slackswap_cli.schema import load_profile, save, write_atomic, dumps

    hw = load_hardware(args.hardware)
    names = args.planners.split(",") if args.planners else planner_names()
    sweep = [float(x) for x in args.sweep.split(",") if x.strip()]
    profiles: list[tuple[str, Profile, str]] = []
    paths = args.profiles if args.profiles is not None else [str(ROOT / s) for s in SAMPLES]
    for path in paths:
        if not args.synthetic and Path(path).exists():
            prof = load_profile(path)
            profiles.append((_profile_key(prof, path), prof, str(path)))
        else:
            key = Path(path).stem
            if key not in SYNTHETIC_SHAPES:
                raise SystemExit(f"profile {path} does not exist")
            print(f"[paper_table] {path} missing: using the synthetic stand-in", flush=True)
            profiles.append((key, synthetic_sample(key, hw), "synthetic"))

    results = {"hardware": hw.name, "budget": args.budget, "sweep": sweep,
               "optimal_time_limit_s": args.optimal_time_limit, "profiles": []}
    for key, prof, source in profiles:
        slack = (prof.summary.get("forward_us", 0.0) * 1e-6 * hw.d2h_bytes_per_s
                 / max(1, prof.summary["peak_activation_bytes"]))
        entry = {"name": key, "source": source, "workload": prof.workload,
                 "slack_fraction": slack,
                 "n_ops": len(prof.ops), "n_saved": len(prof.saved_activations),
                 "peak_activation_bytes": prof.summary["peak_activation_bytes"],
                 "published_retention": PUBLISHED.get(key), "main": [], "sweep": []}
        for name in names:
            row = run_one(prof, hw, name, args.budget, args.optimal_time_limit)
            entry["main"].append(row)
            print(f"[paper_table] {key:12s} {args.budget:.2f} {name:17s} "
                  f"{_fmt_ret(row)} ({row.get('plan_and_simulate_ms', 0):.0f} ms)", flush=True)
        for frac in sweep:
            for name in names:
                if name == "optimal" and args.sweep_optimal_time_limit <= 0:
                    continue
                if abs(frac - args.budget) < 1e-9:
                    row = next(r for r in entry["main"] if r["planner"] == name)
                else:
                    row = run_one(prof, hw, name, frac, args.sweep_optimal_time_limit)
                entry["sweep"].append(row)
            print(f"[paper_table] {key:12s} {frac:.2f} " + "  ".join(
                f"{r['planner']}={_fmt_ret(r)}" for r in entry["sweep"]
                if r["budget_fraction"] == frac), flush=True)
        results["profiles"].append(entry)

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    write_atomic(out / "paper_table.json", dumps(results))
    write_atomic(out / "paper_table.md", render_markdown(results, names).encode())
    png = plot(results, names, out / "paper_table.png")
    print(f"[paper_table] wrote {out / 'paper_table.json'}, {out / 'paper_table.md'}"
          + (f", {png}" if png else ""))
    return 0


def _fmt_ret(row: dict) -> str:
    if row.get("below_floor"):
        return "below floor"
    if row.get("retention") is None:
        return "error"
    mark = "" if row["feasible"] else " (over budget)"
    return f"{100 * row['retention']:.2f}%{mark}"


def render_markdown(results: dict, names: list[str]) -> str:
    lines = [f"# Paper table: retention at budget {results['budget']} on {results['hardware']}",
             "",
             "Retention = ideal step time / simulated step time (the simulator of "
             "`slackswap_cli/simulate.py`). A plan over budget is marked; 'below floor' means no "
             "plan can meet that budget.", ""]
    head = "| workload | source | published | " + " | ".join(names) + " | slackswap plan+sim |"
    lines += [head, "|" + "---|" * (len(names) + 4)]
    for e in results["profiles"]:
        pub = e["published_retention"]
        cells = []
        for name in names:
            row = next((r for r in e["main"] if r["planner"] == name), None)
            cells.append(_fmt_ret(row) if row else "-")
        ss = next((r for r in e["main"] if r["planner"] == "slackswap"), {})
        lines.append(f"| {e['name']} | {Path(e['source']).name} | "
                     f"{'-' if pub is None else f'{100 * pub:.1f}%'} | " + " | ".join(cells)
                     + f" | {ss.get('plan_and_simulate_ms', 0):.0f} ms |")
    lines += ["", "Against the published figure and the MILP's bound (`optimal` proves a lower bound "
              "on the overhead of its model; the model is close to, not the same as, the "
              "simulator). *Slack* = forward time x D2H bandwidth / keep-all peak: the share of "
              "the peak that copies hidden under forward compute can move out; at budget "
              f"{results['budget']} the rest of what must leave has to be recomputed.", "",
              "| workload | slackswap | optimal | MILP bound | slackswap - optimal | slack |",
              "|---|---|---|---|---|---|"]
    for e in results["profiles"]:
        ss = next((r for r in e["main"] if r["planner"] == "slackswap"), None)
        opt = next((r for r in e["main"] if r["planner"] == "optimal"), None)
        bound = _bound(opt)
        diff = (f"{100 * (ss['retention'] - opt['retention']):+.2f} points"
                if ss and opt and ss.get("retention") is not None
                and opt.get("retention") is not None else "-")
        slack = e.get("slack_fraction")
        lines.append(f"| {e['name']} | {_fmt_ret(ss) if ss else '-'} | "
                     f"{_fmt_ret(opt) if opt else '-'} | "
                     f"{'-' if bound is None else f'<= {100 * bound:.2f}%'} | {diff} | "
                     f"{'-' if slack is None else f'{100 * slack:.1f}%'} |")
    lines.append("")
    for e in results["profiles"]:
        opt = next((r for r in e["main"] if r["planner"] == "optimal"), None)
        if opt and opt.get("notes"):
            lines.append(f"- {e['name']} optimal: " + "; ".join(opt["notes"]))
    lines += ["", "## Budget sweep", ""]
    for e in results["profiles"]:
        swept = sorted({r["planner"] for r in e["sweep"]}, key=names.index)
        lines += [f"### {e['name']}", "", "| budget | " + " | ".join(swept) + " |",
                  "|" + "---|" * (len(swept) + 1)]
        for frac in results["sweep"]:
            cells = []
            for name in swept:
                row = next((r for r in e["sweep"] if r["planner"] == name
                            and r["budget_fraction"] == frac), None)
                cells.append(_fmt_ret(row) if row else "-")
            lines.append(f"| {frac:.1f} | " + " | ".join(cells) + " |")
        lines.append("")
    return "\n".join(lines) + "\n"


def _bound(row: dict | None) -> float | None:
    """The MILP's retention bound, from its notes."""
    import re
    for note in (row or {}).get("notes", []):
        m = re.search(r"retention at most ([0-9.]+)", note)
        if m:
            return float(m.group(1))
    return None


MARKERS = ("o", "s", "^", "D", "v", "P", "X")


def plot(results: dict, names: list[str], path: Path) -> str | None:
    """Retention against budget, one panel a profile, the hardware in the title.

    The y axis spans the band where the planners differ: a planner whose every point lies
    far below it (swap-all, flat where the link cannot hide its copies) is named in the
    legend with its value instead of flattening the band. Each planner has its own marker
    and a small sideways offset, so equal points stay visible."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception:   # matplotlib is optional
        return None
    profs = results["profiles"]
    fig, axes = plt.subplots(1, len(profs), figsize=(5 * len(profs), 5.2), squeeze=False)
    for ax, e in zip(axes[0], profs):
        lines = {}
        for name in names:
            pts = [(r["budget_fraction"], r["retention"]) for r in e["sweep"]
                   if r["planner"] == name and r.get("retention") is not None and r["feasible"]]
            if pts:
                lines[name] = sorted(pts)
        tops = [max(y for _, y in pts) for pts in lines.values()]
        # the band: from the lowest point of the lines that reach within 0.3 of the best
        near = [pts for pts in lines.values() if max(y for _, y in pts) >= max(tops) - 0.3]
        lo = min(y for pts in near for _, y in pts) - 0.02 if near else 0.0
        lo = max(0.0, min(lo, 0.95))
        step = 0.006 * (max(x for pts in lines.values() for x, _ in pts) or 1.0)
        for i, (name, pts) in enumerate(lines.items()):
            xs, ys = zip(*pts)
            if max(ys) < lo:            # entirely below the band: say where, do not squash it
                flat = min(ys) == max(ys)
                where = f"{ys[0]:.2f}" if flat else f"{min(ys):.2f}-{max(ys):.2f}"
                ax.plot([], [], marker=MARKERS[i % len(MARKERS)], ls="--", color=f"C{i}",
                        label=f"{name}: {where}, below the axis")
                continue
            dx = (i - (len(lines) - 1) / 2) * step
            ax.plot([x + dx for x in xs], ys, marker=MARKERS[i % len(MARKERS)], ms=5,
                    color=f"C{i}", alpha=0.85, label=name)
        opt = next((r for r in e["main"] if r["planner"] == "optimal"
                    and r.get("retention") is not None), None)
        if opt:
            ax.plot([opt["budget_fraction"]], [opt["retention"]], "kx", ms=9, label="optimal")
        if e.get("published_retention"):
            ax.plot([results["budget"]], [e["published_retention"]], "k*", ms=12,
                    label="published")
        ax.set_ylim(lo, 1.005)
        ax.set_title(e["name"])
        ax.set_xlabel("budget (fraction of keep-all peak)")
        ax.set_ylabel("retention")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.16), ncol=2,
                  frameon=False)
    fig.suptitle(f"Retention against activation budget, simulated on {results['hardware']}",
                 fontsize=11)
    fig.tight_layout()
    tmp = path.with_suffix(".tmp.png")
    fig.savefig(tmp, dpi=110)
    tmp.replace(path)
    plt.close(fig)
    return str(path)


if __name__ == "__main__":
    raise SystemExit(main())
