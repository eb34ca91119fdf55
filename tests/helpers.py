"""Checks several test files share: one definition each."""
import subprocess
import sys
import textwrap


def assert_clean_error(result, code, needle=""):
    """A CliRunner result that is a user-facing error: the exit code, `Error:` and `Hint:` on
    stderr, `needle` in the message (case-insensitive), no traceback, no stray exception."""
    text = result.stdout + result.stderr
    assert result.exit_code == code, text
    assert "Error:" in result.stderr and "Hint:" in result.stderr, text
    assert needle.lower() in result.stderr.lower(), text
    assert "Traceback" not in text, text
    assert result.exception is None or isinstance(result.exception, SystemExit), text


def run_torch_blocked(code: str, timeout: int = 120) -> subprocess.CompletedProcess:
    """Run `code` in a fresh interpreter where `import torch` fails (as on a machine without
    torch); afterwards it asserts torch was never imported. Returns the finished process."""
    body = ("import sys\nsys.modules['torch'] = None  # any `import torch` now raises\n"
            + textwrap.dedent(code)
            + "\nassert 'torch' not in {m.split('.')[0] for m in sys.modules"
              " if sys.modules[m] is not None}\n")
    return subprocess.run([sys.executable, "-c", body], capture_output=True, text=True,
                          timeout=timeout)
