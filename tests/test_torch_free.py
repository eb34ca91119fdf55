"""The planning core must run without torch: plan, show, simulate and compare start fast, and
the commands that need torch say so plainly."""
from helpers import run_torch_blocked


def test_core_imports_and_plans_with_torch_blocked(tmp_path):
    r = run_torch_blocked(f"""
        from slackswap_cli import schema, hardware, profile_build, simulate, budget, render, chrome_trace
        from slackswap_cli import planners, units, synthetic, chains, layers
        from slackswap_cli.cli import app
        from slackswap_cli.hardware import PRESETS
        from slackswap_cli.synthetic import chain_profile
        from typer.testing import CliRunner
        assert simulate.simulate(chain_profile(3), {{}}, PRESETS["a100-pcie4"]).predicted.retention == 1.0
        schema.save(chain_profile(4), r"{tmp_path}/p.json")
        r = CliRunner().invoke(app, ["plan", r"{tmp_path}/p.json", "--budget", "0.6",
                                     "-o", r"{tmp_path}/plan.json"])
        assert r.exit_code == 0, r.output
        r = CliRunner().invoke(app, ["show", r"{tmp_path}/plan.json"])
        assert r.exit_code == 0, r.output
        print("ok")
    """)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip().endswith("ok")


def test_torch_commands_without_torch_say_how_to_install_it(tmp_path):
    r = run_torch_blocked(f"""
        from typer.testing import CliRunner
        from slackswap_cli.cli import app
        for args in (["profile", r"{__file__}", "--device", "fake", "-o", r"{tmp_path}/p.json"],
                     ["verify", r"{__file__}"]):
            r = CliRunner().invoke(app, args)
            assert r.exit_code == 2, (args, r.output)
            assert "needs torch" in r.stderr and "pip install 'slackswap[torch]'" in r.stderr, r.stderr
            assert "internal error" not in r.stderr and "Traceback" not in r.output
        print("ok")
    """)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip().endswith("ok")
