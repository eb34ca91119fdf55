"""A real client on torch 2.15: torchtitan 0.3.0's Llama 3 model definition (tiny config, no
weights, CPU), profiled with fake tensors, planned at 0.35 of its activation peak (ops priced
at 2 us a kernel, helpers.two_us_kernels, so that the plan recomputes as well as swaps) and trained
three AdamW steps bitwise equal to eager with `patch(model)` and with
`compile_planned(per_block=True)` (aot_eager), as the blocks of the Hugging Face Llama do
in test_compiled.py.

Attention: torchtitan 0.3.0 builds its language models with flex attention (a BlockMask
from `torch.compile(create_block_mask)`, attention through `torch.compile(flex_attention)`),
and `get_attention_config("sdpa")` refuses SDPA for them. torch 2.15's flex_attention has no
backward on a CPU (`torch.nn.attention.flex_attention._validate_device`: "FlexAttention does
not support backward on CPU"), so that model cannot train here at all, with or without
slackswap. The training tests therefore put torchtitan's own `ScaledDotProductAttention`
(causal, no mask) in each block's `GQAttention` config, the rest of the definition as
torchtitan ships it; the flex model is profiled to show that slackswap gets through the
BlockMask and the compiled functions and stops at torch's refusal with its reason (before
the fix, inductor's compiled `create_block_mask` ran on fake tensors and the process died of
a segmentation fault).

Skipped where torchtitan 0.3.x is not installed (CI runs torch 2.13). On torch 2.15:
`make test-torch TORCH=2.15.0`, then `.venv-torch-2.15.0/bin/python -m pip install --no-deps
torchtitan==0.3.0 spmd_types==0.2.3 tyro docstring-parser` (no-deps: pip must not replace
torch) and `.venv-torch-2.15.0/bin/python -m pytest tests/test_torchtitan.py`. They pass on
torch 2.15.0 and 2.14.1 alike.
"""
import os
import subprocess
import sys
from importlib import metadata

import pytest
import torch
from helpers import two_us_kernels
from workloads import HW, adamw_steps, plan_at, write_patched

from slackswap_cli.run.compiled.report import totals
from slackswap_cli.run.emit import load_patched
from slackswap_cli.trace import profile_workload
from slackswap_cli.trace.workload import load_workload


def _titan_version():
    try:
        return metadata.version("torchtitan")
    except metadata.PackageNotFoundError:
        return None


pytestmark = pytest.mark.skipif(
    not (_titan_version() or "").startswith("0.3."),
    reason=f"needs torchtitan 0.3.x (installed: {_titan_version()}), which needs torch >= 2.14: "
           "see this file's docstring")

TITAN_LLAMA = '''
import torch
from torchtitan.models.common import (ComplexRoPE, Embedding, Linear, RMSNorm,
                                      compute_ffn_hidden_dim)
from torchtitan.models.llama3 import (Llama3Model, _EMBEDDING_INIT, _NORM_INIT,
                                      _build_llama3_layers, _output_linear_init)
ATTN = "ATTENTION"
def workload(batch=2, seq=32):
    # torchtitan's debugmodel flavor (llama3_configs["debugmodel"]) made tiny: 2 layers,
    # dim 64, 4 heads, 2 key/value heads (grouped-query), fused wqkv, complex RoPE
    torch.manual_seed(0)
    dim, n_heads, vocab = 64, 4, 128
    cfg = Llama3Model.Config(
        dim=dim, vocab_size=vocab,
        tok_embeddings=Embedding.Config(num_embeddings=vocab, embedding_dim=dim,
                                        param_init=_EMBEDDING_INIT),
        norm=RMSNorm.Config(normalized_shape=dim, param_init=_NORM_INIT),
        lm_head=Linear.Config(in_features=dim, out_features=vocab,
                              param_init=_output_linear_init(dim)),
        layers=_build_llama3_layers(
            n_layers=2, dim=dim, n_heads=n_heads, n_kv_heads=2,
            hidden_dim=compute_ffn_hidden_dim(dim, multiple_of=32),
            rope=ComplexRoPE.Config(dim=dim // n_heads, max_seq_len=seq, theta=500000,
                                    scaling="llama"),
            attn_backend="flex"))
    if ATTN == "sdpa":   # get_attention_config("sdpa") refuses it; the block config takes it
        from torchtitan.models.common.attention import ScaledDotProductAttention
        for layer in cfg.layers:
            layer.attention.inner_attention = ScaledDotProductAttention.Config()
    model = cfg.build()
    model.init_states()
    ids = torch.randint(0, vocab, (batch, seq + 1))
    tokens, labels = ids[:, :-1], ids[:, 1:]
    positions = torch.arange(seq).repeat(batch, 1)      # one document per row
    masks = model.get_attention_masks(positions) if ATTN == "flex" else None
    def loss_fn(out, inputs):
        return torch.nn.functional.cross_entropy(out.flatten(0, 1).float(), labels.flatten())
    return model, (tokens, positions, masks), loss_fn
'''


@pytest.fixture(scope="module")
def titan(tmp_path_factory):
    """The workload files (sdpa, flex), the sdpa model's profile and its plan at 0.35 of the peak
    written as a patched module."""
    d = tmp_path_factory.mktemp("titan")
    paths = {}
    for attn in ("sdpa", "flex"):
        paths[attn] = d / f"titan_llama_{attn}.py"
        paths[attn].write_text(TITAN_LLAMA.replace("ATTENTION", attn))
    with pytest.MonkeyPatch.context() as mp:   # module-scoped: priced as helpers says
        two_us_kernels(mp)                      # (a plan that recomputes as well as swaps)
        prof = profile_workload(str(paths["sdpa"]), device="fake", hardware=HW)
        # 0.3-0.4 recompute in both blocks; 0.45 and above only keep and swap
        plan = plan_at(prof, 0.35 * prof.summary["peak_activation_bytes"])
    mod = load_patched(str(write_patched(d, plan, prof, name="titan_patched.py")))
    return paths, prof, plan, mod


def _twin(path):
    a, b = load_workload(str(path)), load_workload(str(path))
    b.model.load_state_dict(a.model.state_dict())
    return a, b


def _same(got, want):
    return got[0] == want[0] and all(torch.equal(a, b) for a, b in zip(got[1], want[1]))


def test_the_plan_swaps_and_recomputes_across_both_blocks(titan):
    _, prof, plan, _ = titan
    assert plan.feasible
    acts = {d.action for d in plan.decisions}
    assert {"keep", "swap", "recompute"} <= acts, acts
    module = {d.tensor: prof.ops[prof.tensors[d.tensor].producer].module
              for d in plan.decisions if d.action != "keep"}
    blocks = {m.split(".")[1] for m in module.values() if m.startswith("layers.")}
    assert blocks == {"0", "1"}


def test_patch_trains_torchtitan_llama_bitwise_like_eager(titan):
    paths, _, _, mod = titan
    eager, work = _twin(paths["sdpa"])
    want = adamw_steps(eager.model, eager)
    assert mod.patch(work.model) is work.model
    got = adamw_steps(work.model, work)
    assert _same(got, want), (got[0], want[0])
    rep = work.model.forward.__slackswap__.last_report
    assert rep["held_bytes"] <= rep["budget_bytes"] and rep["run_unmatched"] == 0, rep
    # every op the runtime expects in the model's call lines up (the profile's ops outside
    # it, the loss run by loss_fn after the patched forward returned, are not expected)
    assert rep["lined_up"] == rep["expected"] > 0, rep


def test_compile_planned_per_block_trains_torchtitan_llama_bitwise_like_eager(titan):
    paths, _, _, mod = titan
    eager, work = _twin(paths["sdpa"])
    want = adamw_steps(eager.model, eager)
    model = mod.compile_planned(work.model, per_block=True, backend="aot_eager", quiet=True)
    assert model is work.model
    got = adamw_steps(model, work)
    assert _same(got, want), (got[0], want[0])
    parts = model._slackswap_partitions
    assert [p.label for p in parts] == ["layers.0", "layers.1"]
    t = totals(parts)
    assert t["graphs"] == 2 and t["lined_up_ops"] == t["graph_ops"] > 0
    assert t["offloaded_bytes"] > 0 and t["recomputed_ops"] >= 1


def test_flex_attention_llama_stops_at_torchs_cpu_refusal_not_a_crash(titan):
    """The flex model as torchtitan 0.3.0 builds it: eager training refuses on a CPU (torch's
    own limit), and `slackswap profile` builds it under fake tensors (the BlockMask through
    the compiled create_block_mask), traces into flex_attention and reports that same refusal
    as an error, in a process of its own (a segmentation fault would kill pytest)."""
    paths, *_ = titan
    work = load_workload(str(paths["flex"]))
    from torch.nn.attention.flex_attention import BlockMask
    assert isinstance(work.inputs[2], BlockMask)
    with pytest.raises(NotImplementedError, match="FlexAttention does not support backward on CPU"):
        work.model(*work.inputs).sum().backward()
    exe = os.path.join(os.path.dirname(sys.executable), "slackswap")
    res = subprocess.run([exe, "profile", str(paths["flex"]), "--device", "fake",
                          "--hardware", "a100-pcie4", "-o", os.devnull],
                         capture_output=True, text=True, timeout=600)
    assert res.returncode > 0, (res.returncode, res.stderr[-2000:])
    assert "tracing the training step failed" in res.stderr, res.stderr[-2000:]
    assert "FlexAttention does not support backward on CPU" in res.stderr
    assert "Traceback" not in res.stderr
