"""How fast the command line answers, and how fast a server answers and becomes ready.

    python benchmarks/cli_startup.py              # --help, serve --help, a typo: median of 5 runs each
    python benchmarks/cli_startup.py --serve      # also: `conveyor serve` to first /health answer and to 200

Each command runs as a fresh process (`python -m conveyor ...`, as the `conveyor` script does), the
median of `--runs` runs; `python -c pass` is timed the same way as the floor (the interpreter's own
start), so the table also shows each command's time above it. The issue's target: under 1 s each.
With `--serve`, a `conveyor serve --port 0` (default model, or `--model`) is started and `/health`
polled every 20 ms: the time to its first HTTP answer (503 "loading") and to 200, and the phases it
reported on the way.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from pathlib import Path

from conveyor.bench.study import Server

REPO = Path(__file__).resolve().parent.parent
COMMANDS = {
    "python -c pass (floor)": [sys.executable, "-c", "pass"],
    "conveyor --help": [sys.executable, "-m", "conveyor", "--help"],
    "conveyor serve --help": [sys.executable, "-m", "conveyor", "serve", "--help"],
    "conveyor serve --modle x": [sys.executable, "-m", "conveyor", "serve", "--modle", "x"],
    "conveyor bench run --help": [sys.executable, "-m", "conveyor", "bench", "run", "--help"],
}


def time_command(cmd: list[str], runs: int) -> tuple[float, int, str]:
    times, rc, err = [], 0, ""
    for _ in range(runs):
        t0 = time.perf_counter()
        p = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO)
        times.append(time.perf_counter() - t0)
        rc, err = p.returncode, p.stderr
    return statistics.median(times), rc, err


def time_serve(model: str | None, timeout: float) -> dict:
    cmd = [sys.executable, "-m", "conveyor", "serve", "--port", "0"] + (["--model", model] if model else [])
    server = Server(cmd, 0, cwd=REPO, ready_timeout=timeout, poll_s=0.02, stop_timeout=30).start()
    out = {"first_answer_s": None, "ready_s": None, "phases": []}

    def answered(r) -> None:
        now = time.monotonic() - server.started
        if out["first_answer_s"] is None:
            out["first_answer_s"] = now
        phase = r.json().get("phase") if r.status_code != 200 else None
        if phase and (not out["phases"] or out["phases"][-1][0] != phase):
            out["phases"].append((phase, round(now, 2)))

    try:
        out["ready_s"] = server.wait_ready(on_answer=answered)
    except (RuntimeError, TimeoutError) as e:
        print(e, file=sys.stderr)
    finally:
        if server.bound_s is not None:
            out["bound_s"] = server.bound_s
        server.stop()
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--serve", action="store_true", help="also time `conveyor serve` to first answer and to ready")
    ap.add_argument("--model", default=None, help="--serve: the model (default: the server's default)")
    ap.add_argument("--timeout", type=float, default=600.0)
    args = ap.parse_args()
    print(f"| command | median of {args.runs} (s) | above the floor (s) | exit code |")
    print("|---|---|---|---|")
    floor = None
    for label, cmd in COMMANDS.items():
        t, rc, _ = time_command(cmd, args.runs)
        floor = t if floor is None else floor
        print(f"| `{label}` | {t:.2f} | {t - floor:.2f} | {rc} |")
    if args.serve:
        s = time_serve(args.model, args.timeout)
        print(f"\n`conveyor serve`: port bound at {s.get('bound_s', float('nan')):.2f} s, first /health answer at "
              f"{s['first_answer_s'] or float('nan'):.2f} s, 200 at {s['ready_s'] or float('nan'):.2f} s")
        print("phases seen: " + ", ".join(f"{p} (from {t} s)" for p, t in s["phases"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
