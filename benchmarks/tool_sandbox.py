"""Per-call cost of the tool sandbox: calculator calls per second, one at a time and `workers` at once.

Every call starts a fresh interpreter and (where the kernel allows) new user, network, PID and mount
namespaces; this prints what that costs, and the isolation the calls got.

    python benchmarks/tool_sandbox.py [--calls N] [--workers W]

Target (PASS/MISS): a sequential call costs at most 2x the start of a bare interpreter that imports
the tool module's dependencies (``python -c "import trajflow.envs.tools"``, measured in the same run):
the confinement itself (namespaces, private root, cgroup, seccomp, two forks) stays small next to the
interpreter every call starts. (The unconfined sandbox of earlier versions measured 1.4-1.5x.)
"""

from __future__ import annotations

import argparse
import os
import platform
import subprocess
import sys
import time

from trajflow.envs.sandbox import Sandbox, ToolCall
from trajflow.envs.tools import BUILTIN_TOOLS


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=40)
    ap.add_argument("--workers", type=int, default=4)
    args = ap.parse_args()
    env = {"PATH": os.environ.get("PATH", ""), "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    t0 = time.perf_counter()
    for _ in range(args.calls // 2):
        subprocess.run([sys.executable, "-c", "import trajflow.envs.tools"], env=env, check=True)
    bare = (time.perf_counter() - t0) / (args.calls // 2)
    sb = Sandbox([BUILTIN_TOOLS["calculator"]], workers=args.workers)
    call = ToolCall("calculator", {"expression": "1234 * 5678"}, "")
    assert sb.call(call).result == "7006652"  # warm-up, and the isolation probe
    t0 = time.perf_counter()
    for _ in range(args.calls):
        r = sb.call(call)
        assert r.result == "7006652", r
    seq = args.calls / (time.perf_counter() - t0)
    t0 = time.perf_counter()
    rs = sb.run([call] * args.calls)
    assert all(r.result == "7006652" for r in rs), rs[0]
    par = args.calls / (time.perf_counter() - t0)
    print(f"machine: {platform.machine()}, {os.cpu_count()} CPUs, load {os.getloadavg()[0]:.1f}; "
          f"isolation: {sb.isolation}")
    print(f"bare interpreter start: {1000 * bare:.1f} ms")
    print(f"sequential: {seq:.1f} calls/s ({1000 / seq:.1f} ms per call)")
    print(f"{args.workers} at once: {par:.1f} calls/s")
    try:  # the confinement alone: the supervisor's work in this process, without its interpreter start
        from trajflow.envs.sandbox_worker import supervise
    except ImportError:  # a sandbox without a supervisor
        supervise = None
    if supervise is not None:
        request = {"function": BUILTIN_TOOLS["calculator"].function, "arguments": {"expression": "1234 * 5678"},
                   "options": {}, "timeout_s": 10, "cpu_s": 5, "memory_mb": 1024, "max_processes": 16,
                   "file_size": 1 << 26, "max_chars": 256, "env": {}}
        t0 = time.perf_counter()
        for _ in range(args.calls // 2):
            assert supervise(dict(request))["value"] == "7006652"
        print(f"confinement and the call without the interpreter start: "
              f"{1000 * (time.perf_counter() - t0) / (args.calls // 2):.1f} ms")
    ratio = 1 / seq / bare
    print(f"{'PASS' if ratio <= 2.0 else 'MISS'}: a call costs <= 2x a bare interpreter start ({ratio:.2f}x)")


if __name__ == "__main__":
    main()
