"""The lab's plots (PNG, matplotlib's Agg backend: no display needed)."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
from matplotlib.colors import ListedColormap  # noqa: E402
from matplotlib.patches import Patch  # noqa: E402

from conveyor.bench.analysis import _rate_label  # noqa: E402
from conveyor.bench.claims import BASELINE  # noqa: E402
from conveyor.bench.result import RunResult  # noqa: E402
from conveyor.scheduler.policies import POLICIES  # noqa: E402

# names and colours come from each strategy's PolicySpec (conveyor/scheduler/policies.py)
DISPLAY = {BASELINE: "no batching", **{name: spec.shown for name, spec in POLICIES.items()}}
COLORS = {BASELINE: "tab:gray", **{name: spec.color for name, spec in POLICIES.items()}}
ABSENT, WAITING, PREFILL, DECODE = 0, 1, 2, 3


def _name(s: str) -> str:
    return DISPLAY.get(s, s)


def _x(rates: list[float]) -> tuple[list[int], list[str]]:
    return list(range(len(rates))), [_rate_label(r) for r in rates]


def plot_throughput(sweep: dict, rates: list[float], order: list[str], baseline: RunResult | None, path: Path) -> None:
    xs, labels = _x(rates)
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for s in order:
        if s not in sweep:
            continue
        pts = [(x, sweep[s][r]) for x, r in zip(xs, rates) if r in sweep[s]]
        axes[0].plot([p[0] for p in pts], [p[1].output_throughput for p in pts], "o-", color=COLORS.get(s),
                     label=_name(s))
        axes[1].plot([p[0] for p in pts], [p[1].request_throughput for p in pts], "o-", color=COLORS.get(s),
                     label=_name(s))
    finite = [(x, r) for x, r in zip(xs, rates) if r != float("inf")]
    if finite:
        axes[1].plot([p[0] for p in finite], [p[1] for p in finite], ":", color="black", label="offered load")
    if baseline is not None:
        axes[0].axhline(baseline.output_throughput, ls="--", color=COLORS[BASELINE], label="no batching")
        axes[1].axhline(baseline.request_throughput, ls="--", color=COLORS[BASELINE], label="no batching")
    for ax, title in zip(axes, ("output tokens/s", "requests/s")):
        ax.set_xticks(xs, labels)
        ax.set_xlabel("offered load (requests/s)")
        ax.set_title(f"Throughput ({title}) vs offered load")
        ax.grid(alpha=0.3)
    axes[1].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_ttft(sweep: dict, rates: list[float], order: list[str], baseline: RunResult | None, path: Path) -> None:
    xs, labels = _x(rates)
    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    for s in order:
        if s not in sweep:
            continue
        pts = [(x, sweep[s][r].ttft_s.p99) for x, r in zip(xs, rates)
               if r in sweep[s] and sweep[s][r].ttft_s.p99 is not None]
        ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-", color=COLORS.get(s), label=_name(s))
    if baseline is not None and baseline.ttft_s.p99 is not None:
        ax.axhline(baseline.ttft_s.p99, ls="--", color=COLORS[BASELINE], label="no batching (table load)")
    ax.set_yscale("log")
    ax.set_xticks(xs, labels)
    ax.set_xlabel("offered load (requests/s)")
    ax.set_ylabel("p99 time to first token (s)")
    ax.set_title("p99 TTFT vs offered load")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def occupancy_matrix(res: dict) -> np.ndarray:
    """Rows = requests (in arrival order), columns = engine steps; cell = absent/waiting/prefill/decode.

    A request is *waiting* from the moment it was sent until it finished, in every step it is not
    part of; in a step it is part of, it is *prefill* until the step that produced its first token
    (inclusive) and *decode* after.
    """
    steps = res.steps or []
    reqs = res.requests
    m = np.zeros((len(reqs), len(steps)), dtype=np.int8)
    starts = np.array([st["t"] for st in steps], dtype=float)
    eps = 1e-5
    for i, q in enumerate(reqs):
        if q["sent_s"] is None:
            continue
        done = q["sent_s"] + q["e2e_s"] if q["e2e_s"] is not None else float("inf")
        m[i, (starts >= q["sent_s"] - eps) & (starts < done - eps)] = WAITING
    for j, st in enumerate(steps):
        end = st["t"] + st["d"]
        for i in st["ids"]:
            q = reqs[i]
            first = q["sent_s"] + q["ttft_s"] if q["ttft_s"] is not None else float("inf")
            m[i, j] = PREFILL if end <= first + eps else DECODE
    return m


def plot_occupancy(res: dict, name: str, path: Path) -> None:
    m = occupancy_matrix(res)
    n_req, n_steps = m.shape
    fig, ax = plt.subplots(figsize=(11, max(2.5, min(7.0, 0.09 * n_req + 1.5))))
    cmap = ListedColormap(["white", "#e6e6e6", "tab:orange", "tab:blue"])
    ax.imshow(m, aspect="auto", interpolation="nearest", cmap=cmap, vmin=0, vmax=3)
    wall = res.duration_s
    ax.set_title(f"{_name(name)}: who was in each step's batch ({n_steps} steps, {wall:.1f} s, "
                 f"mean batch {res.engine.mean_batch_size or 0:.1f})")
    ax.set_xlabel("engine step")
    ax.set_ylabel("request (arrival order)")
    ax.legend(handles=[Patch(color="#e6e6e6", label="sent, not in this step\n(queued or stalled)"),
                       Patch(color="tab:orange", label="prefill"), Patch(color="tab:blue", label="decode")],
              loc="upper left", bbox_to_anchor=(1.005, 1.0), fontsize=7, frameon=False)
    ax.yaxis.get_major_locator().set_params(integer=True)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_kv_waste(table: dict[str, RunResult], order: list[str], path: Path) -> None:
    names = [s for s in order if s in table and table[s].engine.kv_waste_paged is not None]
    if not names:
        return
    xs = np.arange(len(names))
    paged = [table[s].engine.kv_waste_paged * 100 for s in names]
    contig = [(table[s].engine.kv_waste_contiguous or 0) * 100 for s in names]
    fig, ax = plt.subplots(figsize=(7.5, 3.8))
    ax.bar(xs - 0.2, paged, 0.4, label="paged (blocks)", color="tab:green")
    ax.bar(xs + 0.2, contig, 0.4, label="contiguous max_model_len reservation", color="tab:red")
    ax.set_xticks(xs, [_name(s) for s in names])
    ax.set_ylabel("KV slots reserved but empty (%)")
    ax.set_ylim(0, 118)
    ax.set_yticks(range(0, 101, 20))
    ax.set_title("KV cache waste, mean over engine steps")
    ax.legend(fontsize=8, loc="upper center", ncol=2, frameon=False)
    ax.grid(alpha=0.3, axis="y")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


