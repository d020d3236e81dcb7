"""`python -m netem.sandbox` without a guest: arguments, exit codes and messages. Booting one
through it is tests/netns/test_sandbox_guest.py's part."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest

from netem.sandbox import GuestTimeout, SandboxError, cli


@pytest.fixture
def called(monkeypatch) -> list[tuple]:
    """What `main` handed to the commands, instead of running them."""
    calls: list[tuple] = []
    monkeypatch.setattr(cli, "pytest_command", lambda args: calls.append(("pytest", args)) or 0)
    monkeypatch.setattr(
        cli, "run_command", lambda argv, **options: calls.append(("run", argv, options)) or 7
    )
    return calls


def test_pytest_arguments_pass_through_in_order(called):
    args = ["-m", "netem_kernel", "tests/x.py", "-q", "--help", "--", "-k"]
    assert cli.main(["pytest", *args]) == 0
    assert called == [("pytest", args)]


def test_run_takes_the_command_after_the_separator(called):
    assert cli.main(["run", "--mem", "2G", "--", "sh", "-c", "exit 7", "--mem"]) == 7
    assert called == [("run", ["sh", "-c", "exit 7", "--mem"], {"timeout": 1800, "mem": "2G"})]


@pytest.mark.parametrize("argv", [["run"], ["run", "--"], ["prepare", "--no-such-option"], []])
def test_usage_errors_exit_with_2(called, argv, capsys):
    with pytest.raises(SystemExit) as caught:
        cli.main(argv)
    assert caught.value.code == 2
    assert "usage: python -m netem.sandbox" in capsys.readouterr().err
    assert called == []


@pytest.mark.parametrize(
    ("error", "code"),
    [
        (GuestTimeout("the guest ran too long", output="", umid="u", workdir=Path("/w")), 124),
        (SandboxError("no kernel"), 1),
        (ValueError("mem: expected a size"), 2),
    ],
)
def test_guarded_reports_errors_with_an_exit_code(error, code, capsys):
    before = signal.getsignal(signal.SIGTERM)

    def fail() -> None:
        raise error

    with pytest.raises(SystemExit) as caught:
        cli.guarded(fail, prog="here")
    assert caught.value.code == code
    assert capsys.readouterr().err == f"here: {error}\n"
    assert signal.getsignal(signal.SIGTERM) is before


def test_guarded_returns_what_the_call_returns():
    assert cli.guarded(lambda: 42) == 42


def test_mirror_without_one_is_a_message_and_exit_code_1(monkeypatch, capsys):
    def nowhere() -> str:
        raise LookupError("no Debian mirror found in /etc/apt/sources.list")

    monkeypatch.setattr(cli, "apt_mirror", nowhere)
    assert cli.main(["mirror"]) == 1
    out, err = capsys.readouterr()
    assert out == ""
    assert err == "python -m netem.sandbox: no Debian mirror found in /etc/apt/sources.list\n"
