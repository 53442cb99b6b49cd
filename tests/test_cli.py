import subprocess
import sys

from conftest import subprocess_env


def test_help_lists_subcommands_without_importing_torch():
    code = (
        "import sys; from sddoctor.cli import main; rc = main(['--help']); "
        "assert 'torch' not in sys.modules, 'torch imported'; sys.exit(rc)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=subprocess_env())
    assert out.returncode == 0, out.stderr
    for name in ("run", "report", "check-nccl", "tui"):
        assert name in out.stdout


def test_unknown_command_is_usage_error():
    out = subprocess.run(
        [sys.executable, "-m", "sddoctor", "frobnicate"], capture_output=True, text=True, env=subprocess_env()
    )
    assert out.returncode == 2
    assert "unknown command 'frobnicate'" in out.stderr
