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


# ------------------------------------------------------------------------------- hostile tools
# Each does what model-written code running as the worker's user could (issue: root-level tool code).

def netns_escape(pid: int, port: int) -> str:
    """Enter the network namespace of process ``pid`` (the caller's) and connect to its loopback."""
    import ctypes
    import os

    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(f"/proc/{int(pid)}/ns/net", os.O_RDONLY)
    if libc.setns(fd, 0x40000000) != 0:
        raise OSError(ctypes.get_errno(), "setns")
    return connect(port)


def _pipes() -> list[int]:
    import os

    out = []
    for name in os.listdir("/proc/self/fd"):
        try:
            if os.readlink(f"/proc/self/fd/{name}").startswith("pipe:"):
                out.append(int(name))
        except OSError:
            pass
    return out


def forge_answer(payload: str) -> str:
    """Write ``payload`` into every pipe this process holds (the answer channel among them), then
    leave without answering."""
    import os

    data = payload.encode("latin-1")
    for fd in _pipes():
        try:
            os.write(fd, data)
        except OSError:
            pass
    os._exit(0)


def grandchild_flood(megabytes: int, seconds: float) -> str:
    """Fork a grandchild that keeps every pipe open and, once this call has answered, pushes
    ``megabytes`` MiB into each and stays ``seconds``; answer at once."""
    import os

    if os.fork() == 0:
        time.sleep(0.5)
        block = b"x" * (1 << 20)
        for fd in _pipes():
            for _ in range(int(megabytes)):
                try:
                    os.write(fd, block)
                except OSError:
                    break
        time.sleep(seconds)
        os._exit(0)
    return "parent done"


def spawn_and_hang(marker: str) -> str:
    """Start a subprocess whose command line carries ``marker`` that outlives the call, then hang."""
    import subprocess
    import sys

    subprocess.Popen([sys.executable, "-c", f"import time; time.sleep(60)  # {marker}"], start_new_session=True)
    time.sleep(60)
    return "never"


def children_allocate(children: int, megabytes: int) -> str:
    """``children`` processes each holding ``megabytes`` MiB at the same time; their exit codes."""
    import subprocess
    import sys

    code = f"b = b'\\x01' * ({int(megabytes)} << 20); import time; time.sleep(1.5)"
    procs = [subprocess.Popen([sys.executable, "-c", code]) for _ in range(int(children))]
    return ",".join(str(p.wait()) for p in procs)


def write_file(megabytes: int) -> str:
    """Write ``megabytes`` MiB to a file in the temp directory."""
    import os
    import tempfile

    path = os.path.join(tempfile.gettempdir(), "big")
    with open(path, "wb") as f:
        for _ in range(int(megabytes)):
            f.write(b"\0" * (1 << 20))
    return f"wrote {os.path.getsize(path) >> 20} MiB"


def fork_many(count: int) -> str:
    """Fork ``count`` children that sleep; how many were started."""
    import os

    started = []
    for _ in range(int(count)):
        pid = os.fork()
        if pid == 0:
            time.sleep(3)
            os._exit(0)
        started.append(pid)
    return str(len(started))


def read_file(path: str) -> str:
    with open(path) as f:
        return f.read()[:100]


def environment() -> str:
    import json
    import os

    return json.dumps(dict(os.environ))


def temp_marker(name: str) -> str:
    """Leave a file ``name`` in the temp directory; say which files were already there."""
    import os
    import tempfile

    d = tempfile.gettempdir()
    before = sorted(os.listdir(d))
    open(os.path.join(d, name), "w").close()
    return f"{d} {before}"


def new_namespace() -> str:
    """unshare(CLONE_NEWUSER | CLONE_NEWNS): a way into the kernel's namespace code from inside the sandbox."""
    import ctypes
    import os

    libc = ctypes.CDLL(None, use_errno=True)
    if libc.unshare(0x10000000 | 0x00020000) != 0:
        raise OSError(ctypes.get_errno(), os.strerror(ctypes.get_errno()))
    return "unshared"


def subprocess_runs() -> str:
    """A subprocess and a fork still work under the seccomp filter (clone without CLONE_NEW*)."""
    import os
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", "print('child')"], capture_output=True, text=True).stdout.strip()
    pid = os.fork()
    if pid == 0:
        os._exit(7)
    return f"{out} {os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])}"
