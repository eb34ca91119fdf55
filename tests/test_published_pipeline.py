"""benchmarks/published_pipeline.py's arithmetic (the 405B split, its TP-local parameters and a
rank's memory beside its activations), checked by hand and against the stage modules it
traces (the benchmark itself traces six fake profiles: run it as a benchmark)."""
from pathlib import Path

from helpers import load_benchmark

ROOT = Path(__file__).resolve().parents[1]
GIB = 1 << 30


def _load():
    return load_benchmark("published_pipeline")


def test_the_split_is_torchtitans():
    """torchtitan's generate_split_points on 126 layers: base 126 // stages, the first stage
    the base, each middle one the base plus one while 126 % stages lasts, the last the rest."""
    pp = _load()
    assert pp.split(8) == [15, 16, 16, 16, 16, 16, 16, 15]
    assert pp.split(16) == [7] + [8] * 14 + [7]


def test_tp_local_parameters_are_the_stage_modules_and_make_405b():
    """Llama 3.1 405B has 405,853,388,800 parameters: 126 blocks and the embedding and
    output shards times TP 8, the norms (replicated) once."""
    import torch
    pp = _load()
    with torch.device("meta"):
        for layers, first, last in ((1, False, False), (1, True, False), (1, False, True)):
            module = pp.Stage(layers, first, last)
            lin, other = pp._params(layers, first, last)
            assert sum(p.numel() for p in module.parameters()) == lin + other
    stages = [(n, s == 0, s == 7) for s, n in enumerate(pp.split(8))]
    lin = sum(pp._params(*st)[0] for st in stages)
    other = sum(pp._params(*st)[1] for st in stages)
    norms = (2 * pp.LAYERS + 1) * pp.DIM
    assert (lin + other - norms) * pp.TP + norms == 405_853_388_800


def test_a_ranks_memory_beside_its_activations_by_hand():
    """A middle 1F1B stage of 16 layers: 16 x 398,458,880 TP-local linear parameters and
    16 x 2 x 16384 norm weights; sharded fp32 state 12 bytes a parameter over FSDP 8, float8
    linears and bf16 norms unsharded, fp32 unsharded gradients, 8 receive buffers each way of
    4 x 1024 x 16384 bf16 (128 MiB)."""
    pp = _load()
    lin, other = 16 * 398_458_880, 16 * 2 * 16384
    parts = pp.static_parts([(16, False, False)])
    assert parts["sharded_state"] == 12 * (lin + other) // 8
    assert parts["unsharded_params"] == lin + 2 * other
    assert parts["unsharded_grads_fp32"] == 4 * (lin + other)
    assert parts["receive_buffers"] == 16 * 128 * (1 << 20)
    assert parts["last_stage_outputs"] == 0
    last = pp.static_parts([(15, False, True)])
    assert last["receive_buffers"] == 8 * 128 * (1 << 20)
    assert last["last_stage_outputs"] == 7 * 4 * 8192 * (128256 // 8) * 2
