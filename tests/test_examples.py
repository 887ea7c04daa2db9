"""The examples in examples/ run as documented and print what they promise."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from flightcache import EmbeddedServer

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def run(name: str, *args: str) -> str:
    proc = subprocess.run(
        [sys.executable, str(EXAMPLES / name), *args],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


@pytest.mark.parametrize("embedded", [True, False], ids=["embedded", "server-url"])
def test_quickstart(server: EmbeddedServer, embedded: bool) -> None:
    out = run("quickstart.py", *([] if embedded else [server.url]))
    assert "100 answers, 1 distinct, loader runs: 1" in out
    assert "cached: Relativity" in out


def test_decorator(server: EmbeddedServer) -> None:
    out = run("decorator.py", server.url)
    assert "[5.0, 5.0] [5.0, 5.0] 1 loader run(s)" in out


@pytest.mark.parametrize("embedded", [True, False], ids=["embedded", "server-url"])
def test_threads(server: EmbeddedServer, embedded: bool) -> None:
    out = run("threads.py", *([] if embedded else [server.url]))
    assert "50 answers, 1 distinct, loader runs: 1" in out
    assert "cached: summary of document 7" in out
    if hasattr(os, "fork"):
        assert "forked child: summary of document 7, loader runs: 1" in out


def test_testing() -> None:
    out = run("testing.py")
    assert "2 tests passed; pricing service calls: ['tea', 'cake', 'cake']" in out


@pytest.mark.parametrize("embedded", [True, False], ids=["embedded", "server-url"])
def test_batch(server: EmbeddedServer, embedded: bool) -> None:
    out = run("batch.py", *([] if embedded else [server.url]))
    assert "3 pages, queries: [[1, 2, 3, 4], [5, 6], [7]]" in out
    assert "page 2: ['user 3', 'user 4', 'user 5', 'user 6']" in out
    assert "later: ['user 7', 'user 8', flightcache.NOT_FOUND] query: [8, 10]" in out


def test_openai_sdk(server: EmbeddedServer) -> None:
    pytest.importorskip("openai")
    pytest.importorskip("starlette")
    out = run("openai_sdk.py", server.url)
    assert "50 ChatCompletion answers, 1 distinct, {'MISS': 1, 'COALESCED': 49}" in out
    assert "stream: HIT, same text: True" in out
    assert "responses: Response, one answer: True" in out
    assert "upstream calls: 2" in out


def test_anthropic_sdk(server: EmbeddedServer) -> None:
    pytest.importorskip("anthropic")
    pytest.importorskip("starlette")
    out = run("anthropic_sdk.py", server.url)
    assert "20 Message answers from threads, 1 distinct" in out
    assert "stream: HIT, RawMessageStartEvent first, same text: True" in out
    assert "upstream calls: 1" in out
