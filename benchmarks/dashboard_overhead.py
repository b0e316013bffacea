"""Do dashboard viewers slow the engine? Output tok/s on the 64-client load with 0 and with 3 viewers.

    python benchmarks/dashboard_overhead.py --out docs/dashboard/overhead.json [--screenshot docs/dashboard.png]

One `conveyor serve` (default model and flags) takes these runs in turn, all with the same
requests: 64 streaming clients, prompts of 128-384 tokens, outputs of 64-192 tokens. The runs are:
- `none`: no viewers;
- `sse`: three viewers reading /dashboard/events, which is all the server sees of a browser;
- `chromium` (with --chromium): three real headless Chromium pages on /dashboard. These also
  draw on this machine's own cores, so they cost more than a browser elsewhere would.

`none` and `sse` alternate `--repeats` times, so drift on a shared machine hits both.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time

import httpx

from conveyor.bench.study import Server, Study, cpu_name, free_port, lab_run_command


class SSEViewers:
    """`n` clients reading the dashboard's event stream as a browser would (and counting events)."""

    def __init__(self, url: str, n: int) -> None:
        self.stop = threading.Event()
        self.events = [0] * n
        self.threads = [threading.Thread(target=self._read, args=(url, i), daemon=True) for i in range(n)]
        for t in self.threads:
            t.start()

    def _read(self, url: str, i: int) -> None:
        with httpx.stream("GET", url + "/dashboard/events", timeout=None) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    json.loads(line[6:])  # a browser parses every event too
                    self.events[i] += 1
                if self.stop.is_set():
                    return

    def close(self) -> None:
        self.stop.set()


class ChromiumViewers:
    def __init__(self, url: str, n: int, screenshot: str | None) -> None:
        from playwright.sync_api import sync_playwright

        self.pw = sync_playwright().start()
        exe = shutil.which("chromium") or shutil.which("chromium-browser")
        self.browser = self.pw.chromium.launch(executable_path=exe, headless=True, args=[
            "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
            "--disable-component-update", "--disable-sync", "--disable-dev-shm-usage"])
        self.pages = []
        for _ in range(n):
            page = self.browser.new_page(viewport={"width": 1400, "height": 1000})
            page.goto(url + "/dashboard")
            self.pages.append(page)
        self.screenshot = screenshot
        self.events = [0] * n

    def close(self) -> None:
        if self.screenshot:
            self.pages[0].screenshot(path=self.screenshot, full_page=True)
        self.events = [int(p.evaluate("window.dashboard.stepsSeen")) for p in self.pages]
        self.browser.close()
        self.pw.stop()


def bench(url: str, model: str, num_prompts: int, out: str, shot_at: float | None = None,
          viewers: ChromiumViewers | None = None) -> dict:
    proc = subprocess.Popen(lab_run_command(url, ["--model", model, "--no-progress", "--concurrency", "64",
                                                  "--num-prompts", str(num_prompts), "--input-len", "256",
                                                  "--output-len", "128", "--range-ratio", "0.5", "--seed", "0"], out),
                            stdout=subprocess.DEVNULL)  # in the background: a screenshot is taken mid-run
    if shot_at is not None and viewers is not None and viewers.screenshot:
        time.sleep(shot_at)  # mid-run: the page under load
        viewers.pages[0].screenshot(path=viewers.screenshot, full_page=True)
        viewers.screenshot = None
    if proc.wait() != 0:
        raise RuntimeError("the benchmark client failed")
    return json.load(open(out))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="dashboard-overhead.json")
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--num-prompts", type=int, default=128)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--chromium", action="store_true", help="also a run with 3 real headless Chromium pages")
    p.add_argument("--screenshot", default=None, help="save the first Chromium page mid-run here (needs --chromium)")
    args = p.parse_args()
    study = Study()

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    rows = []
    with Server([sys.executable, "-m", "conveyor", "serve", "--model", args.model, "--port", str(port),
                 "--disable-log-requests", "--uvicorn-log-level", "warning"], port, ready_timeout=300, poll_s=0.5):
        tmp = tempfile.mkdtemp()
        for w in range(2):  # warm-up, not counted: the first full run after start is slow (kernels, caches, pages)
            bench(url, args.model, args.num_prompts, os.path.join(tmp, f"warm{w}.json"))
        plan = ["none", "sse"] * args.repeats + (["chromium"] if args.chromium else [])
        for i, kind in enumerate(plan):
            viewers = None
            if kind == "sse":
                viewers = SSEViewers(url, 3)
            elif kind == "chromium":
                viewers = ChromiumViewers(url, 3, args.screenshot)
            time.sleep(1.0)
            res = bench(url, args.model, args.num_prompts, os.path.join(tmp, f"{i}.json"), shot_at=20.0,
                        viewers=viewers if kind == "chromium" else None)
            if viewers is not None:
                viewers.close()
            row = {"viewers": kind, "output_tok_s": res["output_throughput"],
                   "tpot_p50_ms": 1000 * res["tpot_s"]["p50"], "ttft_p50_ms": 1000 * res["ttft_s"]["p50"],
                   "viewer_events": viewers.events if viewers is not None else None}
            print(json.dumps(row), flush=True)
            rows.append(row)
    none = [r["output_tok_s"] for r in rows if r["viewers"] == "none"]
    sse = [r["output_tok_s"] for r in rows if r["viewers"] == "sse"]
    summary = {"none_mean": sum(none) / len(none), "sse_mean": sum(sse) / len(sse)}
    summary["sse_ratio"] = summary["sse_mean"] / summary["none_mean"]
    chrome = [r["output_tok_s"] for r in rows if r["viewers"] == "chromium"]
    if chrome:
        summary["chromium_ratio"] = chrome[0] / summary["none_mean"]
    print(json.dumps(summary))
    study.write(args.out, {"cpu": f"{cpu_name()}, {os.cpu_count()} CPUs", "args": vars(args), "rows": rows,
                           "summary": summary})



if __name__ == "__main__":
    main()
