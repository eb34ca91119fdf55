"""The planning core must run without torch: plan, show, simulate and compare start fast."""
import subprocess
import sys
import textwrap


def test_core_imports_and_plans_with_torch_blocked(tmp_path):
    code = textwrap.dedent(f"""
        import sys
        sys.modules["torch"] = None  # any `import torch` now raises ImportError
        from slackswap_cli import schema, hardware, profile_build, simulate, budget, render, chrome_trace
        from slackswap_cli import planners
        from slackswap_cli.cli import app
        from slackswap_cli.synthetic import chain_profile
        from typer.testing import CliRunner
        schema.save(chain_profile(4), r"{tmp_path}/p.json")
        r = CliRunner().invoke(app, ["plan", r"{tmp_path}/p.json", "--budget", "0.6",
                                     "-o", r"{tmp_path}/plan.json"])
        assert r.exit_code == 0, r.output
        r = CliRunner().invoke(app, ["show", r"{tmp_path}/plan.json"])
        assert r.exit_code == 0, r.output
        assert "torch" not in {{m.split(".")[0] for m in sys.modules if sys.modules[m] is not None}}
        print("ok")
    """)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip().endswith("ok")
