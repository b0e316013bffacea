"""Does the startup choice of the bf16 linear kernel survive a busy machine?

    python benchmarks/kernel_choice.py [--starts 10]

Starts a CPU-bound process (a Python busy loop) and, beside it, `--starts` fresh processes that each
measure the choice anew (`CONVEYOR_REMEASURE=1`, as the first start on a new kind of machine does), then
prints each one's choice and timings. Later starts read the remembered decision and cannot flip at all.
"""

from __future__ import annotations

import argparse
import collections
import os
import subprocess
import sys

from conveyor.bench.study import Neighbours

PROBE = """
import logging
logging.basicConfig(level=logging.INFO, format="%(message)s")
from conveyor.model import packed_linear
packed_linear.linear_kernel()
"""


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--starts", type=int, default=10)
    args = ap.parse_args()
    from conveyor.kernels.decisions import cpu_facts

    print(f"CPU: {cpu_facts()}")
    choices = collections.Counter()
    with Neighbours(1):
        for i in range(args.starts):
            out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, check=True,
                                 env={**os.environ, "CONVEYOR_REMEASURE": "1"})
            line = next(ln for ln in out.stderr.splitlines() if ln.startswith("bf16 linears"))
            choices[line.split()[2]] += 1
            print(f"start {i + 1}: {line}", flush=True)
    print(f"\nchoices beside a busy process: {dict(choices)}")
    return 0 if len(choices) == 1 else 1


if __name__ == "__main__":
    sys.exit(main())
