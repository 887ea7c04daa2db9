"""The soak's servers: one ``EmbeddedServer``, or an ``EmbeddedCluster``, that the nemesis
kills with SIGKILL and starts again in place (same port, same directory: a cluster node
finds its ``nodes.conf`` there and rejoins as a replica of whoever took over its slots)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time

import redis

from flightcache import EmbeddedServer


def alive(server: EmbeddedServer) -> bool:
    return server.proc is not None and server.proc.poll() is None


def kill(server: EmbeddedServer) -> None:
    """SIGKILL, and reap it; its directory stays for the restart."""
    if server.proc is not None and server.proc.poll() is None:
        os.kill(server.proc.pid, signal.SIGKILL)
        server.proc.wait(5)


def restart(server: EmbeddedServer, timeout: float = 10.0) -> None:
    """Start a killed server again with the same command line, port and directory."""
    folder = getattr(server, "_dir", None)  # EmbeddedServer's working directory
    if not folder:
        raise RuntimeError("EmbeddedServer no longer keeps its directory in _dir: update soak")
    server.proc = subprocess.Popen(
        [
            server.binary,
            "--port",
            str(server.port),
            "--bind",
            server.host,
            "--save",
            "",
            "--appendonly",
            "no",
            "--dir",
            folder,
            "--logfile",
            os.path.join(folder, "server.log"),
            *server.extra_args,
        ],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.proc.poll() is not None:
            raise RuntimeError(f"server on port {server.port} exited at restart")
        try:
            with socket.create_connection((server.host, server.port), timeout=0.5) as s:
                s.sendall(b"PING\r\n")
                if s.recv(64).startswith(b"+PONG"):
                    return
        except OSError:
            pass
        time.sleep(0.02)
    raise RuntimeError(f"server on port {server.port} did not answer after its restart")


def _client(server: EmbeddedServer) -> redis.Redis:
    return redis.Redis(
        host=server.host, port=server.port, socket_timeout=0.5, socket_connect_timeout=0.5
    )


def _ask(server: EmbeddedServer, *command: str) -> str:
    """A CLUSTER subcommand's text reply (redis-py leaves these unparsed)."""
    client = _client(server)
    try:
        reply = client.execute_command(*command)  # type: ignore[no-untyped-call]
    finally:
        client.close()
    return reply.decode() if isinstance(reply, bytes) else str(reply)


def _in_sync(server: EmbeddedServer) -> bool:
    client = _client(server)
    try:
        info = client.info("replication")
    finally:
        client.close()
    return info.get("role") != "slave" or info.get("master_link_status") == "up"


def masters(servers: list[EmbeddedServer]) -> list[EmbeddedServer]:
    """The live servers that are masters holding slots, as a live node sees the cluster."""
    by_port = {s.port: s for s in servers if alive(s)}
    for server in by_port.values():
        try:
            nodes = _ask(server, "CLUSTER", "NODES")
        except redis.RedisError:
            continue
        found = []
        for line in nodes.splitlines():
            parts = line.split()
            if len(parts) < 9 or "master" not in parts[2] or "fail" in parts[2]:
                continue  # a replica, a failed master, or a master with no slots
            port = int(parts[1].split("@")[0].rsplit(":", 1)[1])
            if port in by_port:
                found.append(by_port[port])
        return found
    return []


def settled(servers: list[EmbeddedServer]) -> bool:
    """Every server is up, says ``cluster_state:ok``, and every replica is in sync."""
    for server in servers:
        if not alive(server):
            return False
        try:
            if "cluster_state:ok" not in _ask(server, "CLUSTER", "INFO") or not _in_sync(server):
                return False
        except redis.RedisError:
            return False
    return True


def taken_over(servers: list[EmbeddedServer], victim: EmbeddedServer, shards: int) -> bool:
    """A replica took the dead ``victim``'s slots: ``shards`` live masters hold slots again,
    and every live node says ``cluster_state:ok``."""
    live = [s for s in servers if alive(s)]
    try:
        if not all("cluster_state:ok" in _ask(s, "CLUSTER", "INFO") for s in live):
            return False
    except redis.RedisError:
        return False
    holders = masters(servers)
    return victim not in holders and len(holders) == shards
