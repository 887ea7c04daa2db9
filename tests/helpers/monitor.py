"""Counts the commands each client connection sends, from the server's MONITOR feed.

Commands run inside Lua scripts show up as ``[db lua]`` and are not counted: a script call
is one command on the wire.
"""

from __future__ import annotations

import re
import socket
import threading
from collections import Counter

_LINE = re.compile(r'^\+\d+\.\d+ \[\d+ ([^\]]+)\] "([^"]+)"(?: "([^"]+)")?')


class CommandLog:
    def __init__(self, host: str, port: int) -> None:
        self._sock = socket.create_connection((host, port), timeout=5)
        self._sock.sendall(b"MONITOR\r\n")
        self._buf = b""
        first = self._readline()
        if first != b"+OK":
            raise RuntimeError(f"MONITOR refused: {first!r}")
        self._sock.settimeout(None)
        self.commands: Counter[tuple[str, str]] = Counter()  # (client address, COMMAND)
        self.scripts: Counter[str] = Counter()  # EVALSHA calls by script SHA, any client
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _readline(self) -> bytes:
        while b"\r\n" not in self._buf:
            chunk = self._sock.recv(65536)
            if not chunk:
                raise EOFError
            self._buf += chunk
        line, self._buf = self._buf.split(b"\r\n", 1)
        return line

    def _run(self) -> None:
        try:
            while True:
                m = _LINE.match(self._readline().decode("utf-8", "replace"))
                if m and m.group(1) != "lua":
                    command = m.group(2).upper()
                    with self._lock:
                        self.commands[(m.group(1), command)] += 1
                        if command == "EVALSHA" and m.group(3):
                            self.scripts[m.group(3)] += 1
        except (OSError, EOFError):
            return

    def sent_by(self, addresses: set[str]) -> Counter[str]:
        """Commands (by name) sent by the given ``host:port`` client addresses."""
        out: Counter[str] = Counter()
        with self._lock:
            for (addr, cmd), n in self.commands.items():
                if addr in addresses:
                    out[cmd] += n
        return out

    def close(self) -> None:
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._sock.close()
        self._thread.join(5)
