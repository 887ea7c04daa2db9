"""The command line: ``flightcache demo`` end to end in real processes, and clean errors."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from flightcache import ConfigError
from flightcache._backends.embedded import server_binary
from flightcache._cli.main import main

SMALL = ["--workers", "3", "--callers", "10", "--loader-seconds", "1", "--lease", "1"]


def _has_server() -> bool:
    try:
        server_binary()
    except ConfigError:
        return False
    return True


needs_server = pytest.mark.skipif(not _has_server(), reason="no valkey-server binary")


def run_cli(*args: str, timeout: float = 45.0) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "flightcache", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def figure(output: str, label: str) -> str:
    """The first word after ``label`` in a table row (rich or plain)."""
    match = re.search(rf"{re.escape(label)}\W+(\S+)", output)
    assert match, f"no {label!r} in:\n{output}"
    return match.group(1)


@needs_server
def test_demo_kills_the_owner_and_one_taker_over_finishes() -> None:
    result = run_cli("demo", *SMALL)
    out = result.stdout
    assert result.returncode == 0, out + result.stderr
    assert figure(out, "loader runs") == "2"
    assert figure(out, "takeovers") == "1"
    assert figure(out, "distinct values delivered") == "1"
    assert "SIGKILL" in out
    assert "every surviving caller got the same value: yes" in out


@needs_server
def test_demo_without_kill_runs_the_loader_once() -> None:
    result = run_cli("demo", *SMALL, "--no-kill")
    out = result.stdout
    assert result.returncode == 0, out + result.stderr
    assert figure(out, "loader runs") == "1"
    assert figure(out, "takeovers") == "0"
    assert figure(out, "distinct values delivered") == "1"
    assert "SIGKILL" not in out


def test_inspect_unreachable_server_is_one_line_without_password() -> None:
    result = run_cli("inspect", "some key", "--redis", "redis://user:secret@127.0.0.1:1/0")
    assert result.returncode == 2
    assert result.stdout == ""
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert "BackendUnavailable" in lines[0]
    assert "Traceback" not in result.stderr
    assert "secret" not in result.stdout + result.stderr


def test_status_unreachable_server_in_process(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["status", "--redis", "redis://:secret@127.0.0.1:1/0"]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert len(captured.err.strip().splitlines()) == 1
    assert "secret" not in captured.err


def test_bad_namespace_is_a_clean_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["inspect", "k", "--redis", "redis://127.0.0.1:1/0", "--namespace", "a b"]) == 2
    assert "ConfigError" in capsys.readouterr().err


def test_demo_refuses_to_kill_its_only_worker(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["demo", "--workers", "1"]) == 2
    assert "--workers 2" in capsys.readouterr().err
