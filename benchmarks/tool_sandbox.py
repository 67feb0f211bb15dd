"""Per-call cost of the tool sandbox: calculator calls per second, one at a time and `workers` at once.

Every call starts a fresh interpreter and (where the kernel allows) new user, network, PID and mount
namespaces; this prints what that costs, and the isolation the calls got.

    python benchmarks/tool_sandbox.py [--calls N] [--workers W]

Target (PASS/MISS): sequential calls >= 10 per second (a 4-call turn adds < 0.4 s to an episode).
"""

from __future__ import annotations

import argparse
import platform
import time

from trajflow.envs.sandbox import Sandbox, ToolCall
from trajflow.envs.tools import BUILTIN_TOOLS


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=40)
    ap.add_argument("--workers", type=int, default=4)
    args = ap.parse_args()
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
    print(f"cpu: {platform.processor() or platform.machine()}; isolation: {sb.isolation}")
    print(f"sequential: {seq:.1f} calls/s ({1000 / seq:.1f} ms per call)")
    print(f"{args.workers} at once: {par:.1f} calls/s")
    print(f"{'PASS' if seq >= 10 else 'MISS'}: sequential calls >= 10/s ({seq:.1f})")


if __name__ == "__main__":
    main()
