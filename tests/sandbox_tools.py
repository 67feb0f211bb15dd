"""Tools that misbehave on purpose, for the sandbox tests (imported inside the sandbox's processes)."""

from __future__ import annotations

import socket
import time


def sleepy(seconds: float) -> str:
    time.sleep(seconds)
    return "woke up"


def raises(message: str) -> str:
    raise RuntimeError(message)


def allocate(megabytes: int) -> str:
    block = bytearray(int(megabytes) * 1024 * 1024)
    return f"allocated {len(block) // (1024 * 1024)} MiB"


def spin() -> str:
    while True:
        pass


def connect(port: int) -> str:
    with socket.create_connection(("127.0.0.1", int(port)), timeout=2) as s:
        return s.recv(16).decode()


def not_a_string() -> int:
    return 42


def echo(text: str, prefix: str = "") -> str:
    return prefix + text
