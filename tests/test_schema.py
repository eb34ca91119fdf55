import orjson
import pytest

from slackswap_cli import schema
from slackswap_cli.errors import FormatError, InputError
from slackswap_cli.synthetic import chain_profile


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
