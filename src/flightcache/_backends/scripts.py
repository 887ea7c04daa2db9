"""Lua scripts as package files, and the command packing of the hot path."""

from __future__ import annotations

import hashlib
from importlib.resources import files
from typing import Any

INCLUDE = "-- include: "


class Script:
    """A Lua script kept as a package file, ``<package>/lua/<name>.lua``; each connection
    registers it (EVALSHA, reloaded on NOSCRIPT) the first time it runs it."""

    __slots__ = ("name", "sha", "text")

    def __init__(self, package: str, name: str) -> None:
        self.name = name
        folder = files(package).joinpath("lua")
        lines = []
        for line in folder.joinpath(f"{name}.lua").read_text(encoding="utf-8").splitlines():
            if line.startswith(INCLUDE):  # code shared by several scripts, written once
                line = folder.joinpath(line[len(INCLUDE) :].strip()).read_text(encoding="utf-8")
            lines.append(line)
        self.text = "\n".join(lines) + "\n"
        self.sha = hashlib.sha1(self.text.encode()).hexdigest().encode()  # what EVALSHA names

    def __repr__(self) -> str:
        return f"Script({self.name!r})"


def scripts(package: str, *names: str) -> dict[str, Script]:
    """The named scripts of one package, by name."""
    return {name: Script(package, name) for name in names}


def pack_command(*args: Any) -> bytes:
    """One command in RESP: an array of bulk strings (str, bytes, int and float args)."""
    out = [b"*%d\r\n" % len(args)]
    for arg in args:
        if isinstance(arg, bytes):
            data = arg
        elif isinstance(arg, str):
            data = arg.encode()
        elif isinstance(arg, int):
            data = b"%d" % arg
        else:
            data = repr(float(arg)).encode()
        out.append(b"$%d\r\n%s\r\n" % (len(data), data))
    return b"".join(out)
