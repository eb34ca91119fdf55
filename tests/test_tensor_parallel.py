"""Tensor parallel models (DTensor, `parallelize_module`): planned on each rank's local shards,
collectives never recomputed, and trained bit for bit as the same model unpatched.

The profile tests run in this process on a fake process group of 2 ranks (a fake trace runs
no collective). The training tests spawn CPU ranks (gloo on 127.0.0.1) through
slackswap_testkit/tp_run.py: the model planned on each rank, then three AdamW steps plain and
patched. SLACKSWAP_SLOW=1 adds the other layouts (Hugging Face's LlamaForCausalLM among them)
and TP + FSDP2 on a 2x2 mesh of 4 ranks.
"""
import tempfile

import pytest
import torch

from slackswap_testkit import tp_run
from slackswap_testkit.small_costs import small_model_costs

pytestmark = pytest.mark.skipif(not torch.distributed.is_available(),
                                reason="torch.distributed is not built in")
COLLECTIVES = ("all_reduce", "all_gather_into_tensor", "reduce_scatter_tensor", "wait_tensor")


@pytest.fixture
def two_fake_ranks():
    """Rank 0 of a fake process group of 2 (no communication: enough for a fake trace)."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _plan(layout: str, device: str = "auto", budget: float = 0.5):
    import slackswap_cli as slackswap
    model, x, _ = tp_run.build(layout, 2)
    with small_model_costs():
        return slackswap.plan_model(model, (x,), budget=budget, device=device)


def _saved(plan) -> dict:
    p = plan.profile
    return {t.name: t for t in p.tensors if t.saved and t.kind == "activation"}


def test_saved_tensors_are_sized_by_their_local_shard(two_fake_ranks):
    """Sequence parallel norms save (B, T/2, D) on each of 2 ranks, not the global
    (B, T, D); the colwise projections' outputs hold half the heads (and half the MLP)."""
    plan = _plan("block-sp")
    p = plan.profile
    norm = [t for t in p.tensors if t.saved and t.kind == "activation"
            and p.ops[t.producer].module.endswith("attn_norm") and len(t.shape) == 3]
    assert norm and all(t.shape[:2] == (tp_run.B, tp_run.T // 2) for t in norm)
    assert all(t.size_bytes == 4 * tp_run.B * (tp_run.T // 2) * t.shape[2] for t in norm)
    sdpa = [t for t in p.tensors if "scaled_dot_product" in (p.ops[t.producer].target
                                                              if t.producer is not None else "")]
    assert sdpa and sdpa[0].shape == (tp_run.B, tp_run.H // 2, tp_run.T, tp_run.HD)
    # the same model unparallelised saves far more (what sizing by global shape counted)
    import slackswap_cli as slackswap
    torch.manual_seed(0)
    whole = slackswap.plan_model(tp_run.Model("block-sp"), (torch.randn(2, 16, 64),),
                                 budget=1.0)
    mine = sum(t.size_bytes for t in _saved(plan).values())
    assert mine < 0.75 * sum(t.size_bytes for t in _saved(whole).values())


def test_collectives_and_their_results_are_never_recomputed(two_fake_ranks):
    plan = _plan("block-sp")
    p = plan.profile
    ops = [o for o in p.ops if o.phase == "forward" and o.target.split(".")[1] in COLLECTIVES]
    kinds = {o.target.split(".")[1] for o in ops}
    assert {"all_gather_into_tensor", "reduce_scatter_tensor", "wait_tensor"} <= kinds
    made = {t for o in ops for t in o.outputs}
    assert made and not any(p.tensors[t].recomputable for t in made)
    # nor their aliases (a view of a gathered sequence)
    assert not any(p.tensors[t].recomputable for t in range(len(p.tensors))
                   if p.tensors[t].alias_of in made)
    recomputed = [d.tensor for d in plan.decisions if str(d.action) == "recompute"]
    assert recomputed and not set(recomputed) & made


def test_a_measured_trace_runs_on_local_shards(two_fake_ranks):
    """`device="cpu"` runs the traced step for its op times: the DTensor parameters are
    handed to it as their local shards (it failed with "Attempted to access the data pointer
    on an invalid python storage")."""
    plan = _plan("mlp", device="cpu", budget=0.7)
    assert {t.shape for t in _saved(plan).values()} >= {(tp_run.B, tp_run.T, tp_run.F_ // 2)}
    assert any(o.time_source != "roofline" for o in plan.profile.ops)


def _trained(layout: str, world: int, budget: float, blocks: int = 1) -> list[dict]:
    with tempfile.TemporaryDirectory() as tmp:
        try:
            return tp_run.run(layout, world, budget, tmp, blocks=blocks)
        except Exception as exc:          # a rank's traceback, not only "process 1 exited"
            raise AssertionError(f"tensor parallel run {layout} on {world} ranks failed: "
                                 f"{exc}") from None


def _check_ranks(ranks: list[dict]) -> None:
    for rank, res in enumerate(ranks):
        plain, patched = res["plain"], res["patched"]
        assert tp_run.same(plain, patched), f"rank {rank}: patched differs from plain TP"
        report = patched["report"]
        assert report["fraction"] == 1.0, report          # every profiled op lined up
        assert report["held_bytes"] <= res["budget_bytes"], report
        assert patched["swaps"] > 0, patched
        if res["actions"].get("recompute"):                # its chains ran, every step
            assert min(patched["rerun"]) > 0, patched
        # what the plan placed on collectives' results: kept or swapped, never recomputed
        assert not any(res["producer"][n].split(".")[1] in COLLECTIVES and a == "recompute"
                       for n, a in res["decisions"].items())


def test_sequence_parallel_block_trains_exactly_on_two_ranks():
    """Colwise q/k/v and gate/up, rowwise o and down, SequenceParallel norms: every rank's
    losses and local parameters bitwise equal to plain TP over three AdamW steps."""
    ranks = _trained("block-sp", 2, 0.5)
    assert ranks[0]["actions"].get("recompute") and ranks[0]["actions"].get("swap")
    _check_ranks(ranks)
    assert all(torch.equal(a, b) for a, b in zip(ranks[0]["plain"]["losses"],
                                                 ranks[1]["plain"]["losses"]))


@pytest.mark.slow_tier            # one spawn per layout (tests/conftest.py)
@pytest.mark.parametrize("layout,blocks,budget", [("mlp", 1, 0.7), ("block", 2, 0.5),
                                                  ("hf-llama", 2, 0.5)])
def test_tensor_parallel_layouts_train_exactly(layout, blocks, budget):
    _check_ranks(_trained(layout, 2, budget, blocks))


@pytest.mark.slow_tier            # 4 ranks
def test_tp_with_fsdp2_on_a_2x2_mesh_trains_exactly():
    """TP inside pairs of ranks, FSDP2 across them (each data parallel rank its own batch)."""
    ranks = _trained("block-fsdp", 4, 0.5, blocks=2)
    _check_ranks(ranks)
    dp0, dp1 = ranks[0]["plain"]["losses"], ranks[2]["plain"]["losses"]
    assert not all(torch.equal(a, b) for a, b in zip(dp0, dp1))


def test_a_fake_traced_tensor_parallel_plan_is_measured_by_default(two_fake_ranks):
    """A tensor parallel model traced with fake tensors (a CPU model, device "auto") is
    measured by default (plan_model's `measure`): its first eager call may take other
    branches than the trace, and eager's peak is known only by running it. The two-rank
    Hugging Face runs below check the budget it then holds."""
    plan = _plan("block")
    assert plan.profile.ops and all(o.time_source == "roofline" for o in plan.profile.ops)
    assert plan.measured is not None
    import slackswap_cli as slackswap
    model, x, _ = tp_run.build("block", 2)
    with small_model_costs():
        assert slackswap.plan_model(model, (x,), budget=0.5, measure=False).measured is None


@pytest.mark.slow_tier            # two ranks plan (measured) and train twice; the default
#                                   suite's test above checks that the plan is measured
@pytest.mark.parametrize("family", ["qwen2", "llama"])
def test_hugging_face_tensor_parallel_plans_hold_their_budget(family):
    """HF Qwen2 and Llama as docs/tensor_parallel.md parallelises them, `plan_model(model,
    batch, budget=0.5)` with its defaults on each of 2 gloo ranks: bitwise as unpatched over
    three AdamW steps, every profiled op lined up on the last call, and each rank's measured
    peak within 1.05x of its budget in steps 2 and 3 (the first step also re-plans along
    eager's branches: transformers builds an attention mask under fake tensors only)."""
    from slackswap_testkit import tp_hf_budget
    with tempfile.TemporaryDirectory() as tmp:
        ranks = tp_hf_budget.run(family, tmp)
    for rank, res in enumerate(ranks):
        assert tp_run.same(res["plain"], res["patched"]), f"rank {rank}"
        assert res["measured"] and res["report"]["fraction"] == 1.0, res["report"]
        assert max(res["patched"]["peaks"][1:]) <= 1.05 * res["budget_bytes"], \
            (rank, res["patched"]["peaks"], res["budget_bytes"])

