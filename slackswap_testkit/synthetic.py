"""Synthetic profiles whose answers can be worked out by hand (tests, docs, benchmarks).

`chain_profile(n)` is an n-layer chain: forward op f_i reads a_{i-1} (a_{-1} is the input) and
writes activation a_i; a loss op reads a_{n-1}; backward op b_i reads the incoming gradient and
a_i, and writes the gradient g_i for the layer below, plus the parameter gradient of w_i. Every
a_i is saved (read by b_i) and lives from f_i to b_i.

`transformer_profile(arch, ...)` is an aten-level-looking transformer step (bert, gpt2 or llama
blocks), roofline-timed: the stand-in for traced samples (`synthetic_sample(name, hw)` gives
the shapes of the paper's three workloads). `random_profile(seed)` is a small random step
(skip connections, multi-output and random ops, non-saved temporaries, views) for property
tests: every simulator rule gets exercised by some seed.
"""
from __future__ import annotations

from typing import Sequence

from slackswap_cli.hardware import PRESETS, HardwareSpec
from slackswap_cli.profile_build import ProfileBuilder
from slackswap_cli.schema import Profile


def chain_profile(n: int = 4, act_bytes: int | Sequence[int] = 1 << 20,
                  fwd_us: float | Sequence[float] = 100.0,
                  bwd_us: float | Sequence[float] | None = None,
                  grad_bytes: int | None = 0, random_layers: Sequence[int] = (),
                  name: str = "chain") -> Profile:
    """`grad_bytes=0` makes backward gradients free (so only saved activations count).

    `bwd_us` defaults to twice `fwd_us`. Layers in `random_layers` are dropout-like: their
    output is not recomputable.
    """
    def seq(x, default=None):
        if x is None:
            x = default
        return list(x) if isinstance(x, (list, tuple)) else [x] * n

    acts, fwd, bwd = seq(act_bytes), seq(fwd_us), seq(bwd_us, [2 * f for f in seq(fwd_us)])
    b = ProfileBuilder()
    x = b.add_tensor("x", "input", (1,), "float32", size_bytes=4)
    ws = [b.add_tensor(f"w{i}", "parameter", (1,), "float32", size_bytes=4) for i in range(n)]
    prev = x
    a = []
    for i in range(n):
        t = b.add_tensor(f"a{i}", "activation", (acts[i],), "uint8", size_bytes=acts[i],
                         recomputable=i not in random_layers)
        b.add_op(f"f{i}", "aten.mm.default" if i not in random_layers else "aten.native_dropout.default",
                 "forward", (prev, ws[i]), (t,), module=f"layers.{i}", time_us=fwd[i])
        a.append(t)
        prev = t
    loss = b.add_tensor("loss", "activation", (), "float32", size_bytes=4)
    b.add_op("loss", "aten.sum.default", "forward", (prev,), (loss,), module="", time_us=0.0)
    g = b.add_tensor("tangent", "input", (), "float32", size_bytes=4)  # d loss / d loss = 1
    for i in reversed(range(n)):
        gw = b.add_tensor(f"grad_w{i}", "gradient", (1,), "float32", size_bytes=4)
        outs = [gw]
        if i > 0:
            gi = b.add_tensor(f"g{i}", "activation", (grad_bytes,), "uint8", size_bytes=grad_bytes)
            outs.insert(0, gi)
        b.add_op(f"b{i}", "aten.mm.default", "backward", (g, a[i]), outs, module=f"layers.{i}",
                 time_us=bwd[i])
        if i > 0:
            g = outs[0]
    return b.build(workload={"name": name, "args": {"n": n}}, env={"device": "synthetic"})


# name -> (architecture, layers, hidden, heads, ffn, batch, seq)
SYNTHETIC_SHAPES = {
    "bert-large": ("bert", 24, 1024, 16, 4096, 8, 512),
    "gpt2-xl": ("gpt2", 48, 1600, 25, 6400, 4, 1024),
    "llama-7b": ("llama", 32, 4096, 32, 11008, 1, 4096),
}


def transformer_profile(arch: str = "gpt2", layers: int = 4, hidden: int = 256, heads: int = 4,
                        ffn: int | None = None, batch: int = 2, seq: int = 128,
                        hw: HardwareSpec | None = None, name: str | None = None) -> Profile:
    """An aten-level-looking training step of a transformer, roofline-timed on `hw`.

    Per block (bf16): norm (output + fp32 statistics), QKV projection(s), flash-style attention
    (output + fp32 log-sum-exp), output projection, dropout (bert/gpt2: output and bool mask, not
    recomputable), residual add, norm, MLP (GELU, or SwiGLU for llama), dropout, residual add;
    backward mirrors it, reading what forward saved and producing gradient transients.
    """
    st = _Step(arch, hidden, heads, ffn or 4 * hidden, batch, seq, hw or PRESETS["a100-pcie4"])
    b = st.b
    x_in = b.add_tensor("input_embeds", "input", (st.n_tok, hidden), "bfloat16")
    prefix = {"bert": "bert.encoder.layer", "gpt2": "transformer.h", "llama": "model.layers"}[arch]
    x = st.act("embed", hidden)
    st.op("embed", "aten.embedding.default", "forward", (x_in,), (x,), "embed", 0)
    saved_per_layer = []
    for li in range(layers):
        x, saved = _forward_block(st, li, f"{prefix}.{li}", x)
        saved_per_layer.append(saved)
    loss = b.add_tensor("loss", "activation", (), "float32")
    st.op("loss", "aten.mean.default", "forward", (x,), (loss,), "loss")
    gy = b.add_tensor("tangent", "input", (), "float32")
    gx = st.act("grad_out", hidden)
    st.op("loss_bwd", "aten.expand.default", "backward", (gy, x), (gx,), "loss")
    for li in reversed(range(layers)):
        gx = _backward_block(st, li, saved_per_layer[li], gx)
    gemb = b.add_tensor("embed_grad", "gradient", (1,), "bfloat16")
    st.op("embed_bwd", "aten.embedding_dense_backward.default", "backward", (gx,), (gemb,), "embed")
    return b.build(workload={"name": name or f"synthetic-{arch}", "synthetic": True,
                             "args": dict(arch=arch, layers=layers, hidden=hidden, heads=heads,
                                          ffn=st.ffn, batch=batch, seq=seq)},
                   env={"device": "synthetic", "hardware": st.hw.name})


class _Step:
    """The builder of one synthetic transformer step and its shapes: activations of
    (tokens, cols), roofline-timed ops, parameters, dropout forward and backward."""

    def __init__(self, arch: str, hidden: int, heads: int, ffn: int, batch: int, seq: int,
                 hw: HardwareSpec):
        self.arch, self.hidden, self.heads, self.ffn = arch, hidden, heads, ffn
        self.batch, self.seq, self.n_tok, self.hw = batch, seq, batch * seq, hw
        self.dropout = arch != "llama"
        self.causal = 0.5 if arch != "bert" else 1.0
        self.b = ProfileBuilder()

    def act(self, nm, cols, dtype="bfloat16", rec=True):
        return self.b.add_tensor(nm, "activation", (self.n_tok, cols), dtype, recomputable=rec)

    def op(self, nm, target, phase, ins, outs, mod, flops=0, extra_bytes=0):
        b = self.b
        moved = sum(b.tensors[t].size_bytes for t in (*ins, *outs)
                    if b.tensors[t].kind == "activation") + extra_bytes
        return b.add_op(nm, target, phase, ins, outs, module=mod, flops=int(flops), bytes=moved,
                        time_us=self.hw.roofline_us(flops, moved))

    def param(self, nm, n_el):
        return self.b.add_tensor(nm, "parameter", (n_el,), "bfloat16")

    def drop(self, k: int, src: int, where: str, li: int):
        """Dropout `k` of layer `li` (output, mask), or `src` itself without dropout."""
        if not self.dropout:
            return src, None
        out = self.act(f"drop{k}_{li}", self.hidden, rec=False)
        m = self.act(f"mask{k}_{li}", self.hidden, "bool", rec=False)
        self.op(f"drop{k}_{li}", "aten.native_dropout.default", "forward", (src,), (out, m), where)
        return out, m

    def gdrop(self, k: int, grad: int, mask, where: str, li: int):
        """Backward of dropout `k` of layer `li`, or `grad` itself without dropout."""
        if not self.dropout:
            return grad
        out = self.act(f"gdrop{k}_{li}", self.hidden)
        self.op(f"gdrop{k}_{li}", "aten.native_dropout_backward.default", "backward",
                (grad, mask), (out,), where)
        return out


def _forward_block(st: _Step, li: int, mod: str, x: int) -> tuple[int, dict]:
    """Block `li` in forward from input `x`: (its output, what its backward reads)."""
    arch, hidden, ffn, n_tok, bf = st.arch, st.hidden, st.ffn, st.n_tok, 2
    act, op = st.act, st.op
    w = {k: st.param(f"{k}{li}", n) for k, n in (
        ("wqkv", 3 * hidden * hidden), ("wo", hidden * hidden),
        ("w1", hidden * ffn * (2 if arch == "llama" else 1)), ("w2", hidden * ffn))}
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
    lse = st.b.add_tensor(f"lse_{li}", "activation", (st.batch, st.heads, st.seq), "float32")
    att_flops = 4 * st.batch * st.seq * st.seq * hidden * st.causal
    op(f"attn_{li}", "aten._scaled_dot_product_flash_attention.default", "forward", att_in,
       (o, lse), f"{mod}.attn", att_flops)
    pr = act(f"proj_{li}", hidden)
    op(f"proj_{li}", "aten.addmm.default", "forward", (o, w["wo"]), (pr,), f"{mod}.attn.c_proj",
       2 * n_tok * hidden * hidden, hidden * hidden * bf)
    pd, mask = st.drop(1, pr, f"{mod}.attn.dropout", li)
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
    vd, mask2 = st.drop(2, v, f"{mod}.mlp.dropout", li)
    x3 = act(f"res2_{li}", hidden)
    op(f"res2_{li}", "aten.add.Tensor", "forward", (x2, vd), (x3,), mod)
    return x3, dict(mod=mod, w=w, x=x, h1=h1, mu1=mu1, rs1=rs1, qkv=qkv,
                    qk=att_in[0] if arch == "llama" else None, o=o, lse=lse,
                    mask=mask, x2=x2, h2=h2, mu2=mu2, rs2=rs2, u=u, g=g, mask2=mask2)


def _backward_block(st: _Step, li: int, s: dict, gx: int) -> int:
    """Block `li` in backward from the incoming gradient `gx`, reading `s` (what its forward
    saved); returns the gradient for the block below."""
    arch, hidden, ffn, n_tok, bf = st.arch, st.hidden, st.ffn, st.n_tok, 2
    act, op = st.act, st.op
    mod, w = s["mod"], s["w"]

    def gw(nm):
        return st.b.add_tensor(f"{nm}_grad{li}", "gradient", (1,), "bfloat16",
                               size_bytes=st.b.tensors[w[nm]].size_bytes)

    gv = st.gdrop(2, gx, s["mask2"], f"{mod}.mlp.dropout", li)
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
    gp = st.gdrop(1, gx2, s["mask"], f"{mod}.attn.dropout", li)
    go = act(f"gproj_{li}", hidden)
    op(f"gproj_{li}", "aten.mm.default", "backward", (gp, s["o"]), (go, gw("wo")), f"{mod}.attn.c_proj",
       4 * n_tok * hidden * hidden, hidden * hidden * bf)
    gqkv = act(f"gattn_{li}", 3 * hidden)
    att_ins = (go, s["qkv"], s["o"], s["lse"]) + ((s["qk"],) if s["qk"] is not None else ())
    op(f"gattn_{li}", "aten._scaled_dot_product_flash_attention_backward.default", "backward",
       att_ins, (gqkv,), f"{mod}.attn", 2.5 * 4 * st.batch * st.seq * st.seq * hidden * st.causal)
    gh1 = act(f"gqkv_{li}", hidden)
    op(f"gqkv_{li}", "aten.mm.default", "backward", (gqkv, s["h1"]), (gh1, gw("wqkv")), f"{mod}.attn.c_attn",
       4 * n_tok * hidden * 3 * hidden, 3 * hidden * hidden * bf)
    gxn = act(f"gln1_{li}", hidden)
    op(f"gln1_{li}", "aten.native_layer_norm_backward.default", "backward",
       (gh1, gx2, s["x"], s["mu1"], s["rs1"]), (gxn,), f"{mod}.ln_1")
    return gxn


def synthetic_sample(name: str, hw: HardwareSpec) -> Profile:
    arch, layers, hidden, heads, ffn, batch, seq = SYNTHETIC_SHAPES[name]
    return transformer_profile(arch, layers, hidden, heads, ffn, batch, seq, hw=hw,
                               name=f"synthetic-{name}")


def random_profile(seed: int, max_layers: int = 7) -> Profile:
    """A small random training step (deterministic in `seed`) for property tests.

    Forward op i reads the previous op's main output and, sometimes, an earlier activation
    (a skip connection) or a view of one; it writes a main output, sometimes a second output
    (statistics) and sometimes a random op's outputs (not recomputable). Each activation is
    read by the backward op of its producer (saved) or only by forward (a temporary a chain
    must re-run); sometimes one is also read by a later backward op (a long life). Sizes are
    0.25-8 MB, times 5-400 us, backward gradients 0-2 MB.
    """
    import random
    rng = random.Random(seed)
    n = rng.randint(2, max_layers)
    b = ProfileBuilder()
    x = b.add_tensor("x", "input", (1,), "float32", size_bytes=4)
    mb = 1_000_000
    acts: list[int] = []
    saved_by: list[list[int]] = []       # per layer: tensors its backward op reads
    prev = x
    for i in range(n):
        w = b.add_tensor(f"w{i}", "parameter", (1,), "float32", size_bytes=4)
        ins = [prev, w]
        if acts and rng.random() < 0.4:
            src = rng.choice(acts)
            if rng.random() < 0.3:       # read it through a view
                v = b.add_tensor(f"v{i}", "activation", (b.tensors[src].size_bytes,), "uint8",
                                 size_bytes=b.tensors[src].size_bytes, alias_of=src)
                b.add_op(f"view{i}", "aten.view.default", "forward", (src,), (v,),
                         module=f"layers.{i}", time_us=0.0)
                src = v
            ins.append(src)
        is_random = i > 0 and rng.random() < 0.2
        size = rng.randint(mb // 4, 8 * mb)
        out = b.add_tensor(f"a{i}", "activation", (size,), "uint8", size_bytes=size,
                           recomputable=not is_random)
        outs = [out]
        if is_random or rng.random() < 0.25:
            s2 = rng.randint(1000, mb)
            outs.append(b.add_tensor(f"s{i}", "activation", (s2,), "uint8", size_bytes=s2,
                                     recomputable=not is_random))
        b.add_op(f"f{i}", "aten.native_dropout.default" if is_random else "aten.mm.default",
                 "forward", tuple(ins), tuple(outs), module=f"layers.{i}",
                 time_us=rng.uniform(5.0, 400.0))
        reads = [t for t in outs if is_random or rng.random() < 0.75]
        if len(ins) > 2 and rng.random() < 0.5:
            reads.append(ins[2])
        saved_by.append(reads)
        acts.extend(outs)
        prev = out
    loss = b.add_tensor("loss", "activation", (), "float32", size_bytes=4)
    b.add_op("loss", "aten.sum.default", "forward", (prev,), (loss,), time_us=1.0)
    g = b.add_tensor("tangent", "input", (), "float32", size_bytes=4)
    for i in reversed(range(n)):
        gs = rng.choice([0, rng.randint(1000, 2 * mb)])
        gi = b.add_tensor(f"g{i}", "activation", (gs,), "uint8", size_bytes=gs)
        ins = [g, *saved_by[i]]
        if acts and rng.random() < 0.2:
            ins.append(rng.choice(acts))   # a long life: read again late in backward
        b.add_op(f"b{i}", "aten.mm.default", "backward", tuple(dict.fromkeys(ins)), (gi,),
                 module=f"layers.{i}", time_us=rng.uniform(5.0, 800.0))
        g = gi
    return b.build(workload={"name": f"random-{seed}", "args": {"seed": seed}},
                   env={"device": "synthetic"})
