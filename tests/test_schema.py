import orjson
import pytest

from slackswap_cli import schema
from slackswap_cli.errors import FormatError, InputError
from slackswap_testkit.synthetic import chain_profile


def test_profile_roundtrip(tmp_path):
    p = chain_profile(4)
    path = tmp_path / "p.json"
    schema.save(p, path)
    assert schema.load_profile(path) == p
    assert [t.name for t in p.saved_activations] == ["a0", "a1", "a2", "a3"]
    assert p.summary["saved_bytes"] == 4 << 20


def test_rejects_wrong_format_newer_version_and_bad_ids(tmp_path):
    d = chain_profile(2).to_dict()
    path = tmp_path / "p.json"
    for mutate, needle in [
        (lambda d: d.update(format="other"), "format"),
        (lambda d: d.update(version=99), "newer"),
        (lambda d: d["ops"][0].update(inputs=[999]), "does not exist"),
        (lambda d: d["tensors"][3].update(producer=77), "does not exist"),
    ]:
        bad = orjson.loads(orjson.dumps(d))
        mutate(bad)
        path.write_bytes(orjson.dumps(bad))
        with pytest.raises(FormatError, match=needle):
            schema.load_profile(path)
    with pytest.raises(InputError, match="does not exist"):
        schema.load_profile(tmp_path / "missing.json")
    path.write_text("{not json")
    with pytest.raises(FormatError, match="not valid JSON"):
        schema.load_profile(path)


def test_write_atomic_leaves_no_file_on_failure(tmp_path):
    target = tmp_path / "out.json"


    with pytest.raises(TypeError):
        schema.write_atomic(target, object())  # type: ignore[arg-type]
    assert list(tmp_path.iterdir()) == []


def _refused(d, needle, tmp_path, loader=schema.load_profile):
    path = tmp_path / "m.json"
    path.write_bytes(orjson.dumps(d))
    with pytest.raises(FormatError, match=needle):
        loader(path)


PROFILE_EDITS = [
    (lambda d: d["ops"][0]["outputs"].append(d["ops"][1]["outputs"][0]), "one producer"),
    (lambda d: d["tensors"][2]["consumers"].append(len(d["ops"]) - 1), "lists consumers"),
    (lambda d: d["summary"].update(peak_activation_bytes="12"), "peak_activation_bytes"),
    (lambda d: d["summary"].update(peak_activation_bytes=[1]), "peak_activation_bytes"),
    (lambda d: d["summary"].update(peak_activation_bytes=-42), "peak_activation_bytes"),
    (lambda d: d["summary"].update(peak_activation_bytes=2**64 - 1), "peak_activation_bytes"),
    (lambda d: d["summary"].update(peak_activation_bytes=1), "the ops and tensors give"),
    (lambda d: d["summary"].update(forward_us=-1.0), "forward_us"),
    (lambda d: d["env"].update(hardware=7), "env.hardware"),
    (lambda d: d["env"].update(hardware={"name": "x"}), "missing hardware field"),
    (lambda d: d["ops"][0].update(time_us=1e300), "time_us"),
    (lambda d: d["tensors"][2].update(size_bytes=2**62), "size_bytes"),
    (lambda d: d.update(ops=[], tensors=[]), "no ops"),
]


def _json(obj):
    return orjson.loads(schema.dumps(obj))


@pytest.mark.parametrize("edit,needle", PROFILE_EDITS)
def test_profile_loader_refuses_inconsistent_files(tmp_path, edit, needle):
    d = _json(chain_profile(3))
    edit(d)
    _refused(d, needle, tmp_path)


def test_a_saved_tensor_nobody_in_backward_reads_is_refused(tmp_path):
    d = _json(chain_profile(3))
    last_fwd = max(o["id"] for o in d["ops"] if o["phase"] == "forward")
    loss_out = d["ops"][last_fwd]["outputs"][0]            # read by nothing in backward
    d["tensors"][loss_out]["saved"] = True
    _refused(d, "no backward op reads it", tmp_path)


def _plan(tmp_path):
    from slackswap_cli.hardware import PRESETS
    from slackswap_cli.planners import make_plan
    prof = chain_profile(4)
    return prof, _json(make_plan("swap-all", prof, PRESETS["a100-pcie4"], 3 << 20))


@pytest.mark.parametrize("edit,needle", [
    (lambda d: d["decisions"].append(dict(d["decisions"][0], action="recompute")), "two decisions"),
    (lambda d: d["predicted"].update(step_us=-1.0), "step_us"),
    (lambda d: d["predicted"].update(retention=1.5), "retention"),
    (lambda d: d.update(budget_bytes=0), "budget_bytes"),
    (lambda d: d.update(budget_fraction=2.0), "budget_fraction"),
    (lambda d: d["hardware"].update(h2d_bytes_per_s=5e-324), "h2d_bytes_per_s"),
    (lambda d: d["hardware"].update(name=3), "name"),
    (lambda d: d["schedule"][0].update(end_us=-5.0), "schedule"),
])
def test_plan_loader_refuses_inconsistent_files(tmp_path, edit, needle):
    _, d = _plan(tmp_path)
    edit(d)
    _refused(d, needle, tmp_path, schema.load_plan)


def test_a_plan_deciding_a_tensor_its_profile_does_not_save_is_refused(tmp_path):
    prof, d = _plan(tmp_path)
    d["decisions"][0]["tensor"] = 0                        # the input, not a saved activation
    plan = schema.plan_from_dict(d)
    with pytest.raises(FormatError, match="not a saved activation"):
        plan.check_profile(prof)


def test_save_refuses_what_it_could_not_read_back(tmp_path):
    import dataclasses
    prof, d = _plan(tmp_path)
    plan = schema.plan_from_dict(d)
    bad = dataclasses.replace(plan, predicted=dataclasses.replace(plan.predicted,
                                                                  step_us=float("inf")))
    with pytest.raises(InputError, match="nothing was written"):
        schema.save(bad, tmp_path / "bad.json")
    assert not (tmp_path / "bad.json").exists()
    assert not list(tmp_path.iterdir())
