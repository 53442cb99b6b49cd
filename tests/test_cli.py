import subprocess
import sys

from conftest import main_without_torch, subprocess_env


def test_help_lists_subcommands_without_importing_torch():
    out = main_without_torch("sddoctor.cli", ["--help"])
    assert out.returncode == 0, out.stderr
    for name in ("run", "report", "check-nccl", "tui"):
        assert name in out.stdout


def test_unknown_command_is_usage_error():
    out = subprocess.run(
        [sys.executable, "-m", "sddoctor", "frobnicate"], capture_output=True, text=True, env=subprocess_env()
    )
    assert out.returncode == 2
    assert "unknown command 'frobnicate'" in out.stderr


def test_one_exit_code_table_in_docs_and_in_every_help():
    from pathlib import Path

    from sddoctor.exitcodes import TABLE

    doc = (Path(__file__).resolve().parents[1] / "docs" / "exit-codes.md").read_text()
    codes = [code for code, _, _ in TABLE]
    assert len(codes) == len(set(codes)), "a code with two meanings"
    for code, where, text in TABLE:
        assert f"| {code} | {where} | {text} |" in doc, code
    for command, must in (("run", "124"), ("report", "1 "), ("check-nccl", "3 "), ("tui", "141")):
        out = subprocess.run(
            [sys.executable, "-m", "sddoctor", command, "--help"],
            capture_output=True,
            text=True,
            env=subprocess_env(),
        )
        assert out.returncode == 0 and "one table for every sddoctor command" in out.stdout, command
        assert f"\n  {must}" in out.stdout, (command, out.stdout)


def test_a_bug_is_one_line_and_exit_70_unless_debugging(monkeypatch, capsys):
    import sddoctor.cli as cli

    monkeypatch.setitem(cli.SUBCOMMANDS, "boom", ("json:loads", "raises"))  # json.loads([]) -> TypeError
    monkeypatch.delenv("SDDOCTOR_DEBUG", raising=False)
    assert cli.main(["boom"]) == 70
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "internal error: TypeError" in err and "SDDOCTOR_DEBUG=1" in err
    monkeypatch.setenv("SDDOCTOR_DEBUG", "1")
    import pytest

    with pytest.raises(TypeError):
        cli.main(["boom"])
