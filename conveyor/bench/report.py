"""The comparison report: Markdown with the measured table and generated conclusions.

Everything the report states is computed from the runs passed in (`analysis.py`); the only fixed
text is the seed's claims (quoted, to be tested) and the description of the method. The plots are
drawn by `plots.py`. Nothing here imports torch: `conveyor bench report` re-renders from JSON alone.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from conveyor.bench.analysis import Analysis, _rate_label, analyze
from conveyor.bench.claims import (
    BASELINE,
    headroom_sentence,
    noise_sentence,
    per_load_leaders,
    summary_sentence,
    verdicts_json,
)
from conveyor.bench.plots import _name, plot_kv_waste, plot_occupancy, plot_throughput, plot_ttft
from conveyor.bench.result import CompareResults, RunResult
from conveyor.scheduler.policies import POLICIES

# what each strategy promises, from its PolicySpec (conveyor/scheduler/policies.py)
SEED_CLAIMS = {**{name: spec.claim for name, spec in POLICIES.items()}, BASELINE: "(baseline)"}


def _ms(x: float | None) -> str:
    if x is None:
        return "-"
    return f"{x * 1000:.0f}" if x >= 0.1 else f"{x * 1000:.1f}"


def _pct(x: float | None, digits: int = 1) -> str:
    return "-" if x is None else f"{x * 100:.{digits}f}%"


def _f(x: float | None, fmt: str = ".2f") -> str:
    return "-" if x is None else format(x, fmt)


def _count(x: float | None) -> str:
    return "-" if x is None else f"{x:.0f}"


def tenant_table(table: dict[str, RunResult], order: list[str]) -> list[str]:
    """Per-tenant results (multi-tenant workloads): each tenant's service and latency under each strategy,
    Jain's index of the tenants' output tokens/s, and goodput by each request's own targets."""
    runs = [(s, table[s]) for s in order if s in table and table[s].tenants]
    if not runs:
        return []
    lines = ["## Per tenant", "",
             "| strategy | Jain's index | tenant | requests | output tok/s | TTFT p50 (ms) | TTFT p99 (ms) | "
             "goodput (req/s) |", "|---|---|---|---|---|---|---|---|"]
    for s, r in runs:
        for k, (tenant, t) in enumerate(r.tenants.items()):
            lines.append(f"| {'**' + _name(s) + '**' if k == 0 else ''} | {_f(r.jain, '.3f') if k == 0 else ''} | "
                         f"{tenant} | {t['requests']} | {_f(t['output_tok_s'], '.1f')} | {_ms(t['ttft_p50_s'])} | "
                         f"{_ms(t['ttft_p99_s'])} | {_f(t['goodput_rps'], '.3f')} |")
    lines += ["", "Jain's index is over the tenants' output tokens per second (1: equal service, 1/n: one tenant "
              "took all). Goodput counts the requests that met their own TTFT/TPOT targets (else the run's).", ""]
    return lines


def comparison_table(table: dict[str, RunResult], order: list[str]) -> list[str]:
    base = table.get(BASELINE)
    has_goodput = any(r.goodput.requests_per_s is not None for r in table.values())
    head = ["strategy", "seed's claim", "output tok/s", "req/s", "vs no batching", "TTFT p50 (ms)", "TTFT p99 (ms)",
            "TPOT p50 (ms)", "E2E p50 (ms)", "E2E p99 (ms)", "mean batch", "KV usage", "MFU", "CPU util"]
    if has_goodput:
        head.append("goodput (req/s)")
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for s in order:
        r = table.get(s)
        if r is None:
            continue
        rel = r.output_throughput / base.output_throughput if base and base.output_throughput else None
        row = [f"**{_name(s)}**", SEED_CLAIMS.get(s, ""), _f(r.output_throughput, ".1f"),
               _f(r.request_throughput, ".3f"), "1.0x" if s == BASELINE else (f"{rel:.1f}x" if rel else "-"),
               _ms(r.ttft_s.p50), _ms(r.ttft_s.p99), _ms(r.tpot_s.p50), _ms(r.e2e_s.p50),
               _ms(r.e2e_s.p99), _f(r.engine.mean_batch_size, ".1f"),
               _pct(r.engine.mean_kv_usage), _pct(r.utilization.mfu, 2),
               _pct(r.utilization.cpu, 0)]
        if has_goodput:
            row.append(_f(r.goodput.requests_per_s, ".3f"))
        lines.append("| " + " | ".join(row) + " |")
    return lines


def sweep_table(sweep: dict[str, dict[float, RunResult]], rates: list[float], order: list[str]) -> list[str]:
    head = ["strategy"] + [f"{_rate_label(r)} req/s" if r != float("inf") else "all at once" for r in rates]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for s in order:
        if s not in sweep:
            continue
        cells = []
        for r in rates:
            res = sweep[s].get(r)
            cells.append("-" if res is None else
                         f"{res.output_throughput:.1f} tok/s, {_ms(res.ttft_s.p99)} ms")
        lines.append(f"| **{_name(s)}** | " + " | ".join(cells) + " |")
    return lines


def kv_table(table: dict[str, RunResult], order: list[str]) -> list[str]:
    head = ["strategy", "mean KV usage", "peak KV usage", "KV waste (paged)", "KV waste (contiguous reservation)",
            "prefix-cache hit rate", "preemptions", "engine steps"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for s in order:
        r = table.get(s)
        if r is None:
            continue
        e = r.engine
        lines.append("| " + " | ".join([
            f"**{_name(s)}**", _pct(e.mean_kv_usage), _pct(e.peak_kv_usage),
            _pct(e.kv_waste_paged), _pct(e.kv_waste_contiguous), _pct(e.prefix_hit_rate),
            _count(e.num_preemptions), _count(e.num_steps)]) + " |")
    return lines



def write_report(data: CompareResults, out_dir: Path, command: str) -> Path:
    """Write results.json, the PNGs and report.md into `out_dir`; return the report's path."""
    out_dir.mkdir(parents=True, exist_ok=True)
    a = analyze(data)
    data = dataclasses.replace(data, command=command, verdicts=verdicts_json(a.verdicts),
                               verdicts_other_loads={_rate_label(r): verdicts_json(v)
                                                     for r, v in a.other_loads.items()})
    (out_dir / "results.json").write_text(json.dumps(data.to_json(), indent=1))
    occ = write_plots(a, out_dir)
    path = out_dir / "report.md"
    path.write_text("\n".join(markdown(a, data, command, occ)))
    return path


def write_plots(a: Analysis, out_dir: Path) -> list[tuple[str, str]]:
    """The report's PNGs; returns (strategy, file) of the occupancy plots drawn."""
    plot_throughput(a.sweep, a.rates, a.order, a.baseline, out_dir / "throughput_vs_load.png")
    plot_ttft(a.sweep, a.rates, a.order, a.baseline, out_dir / "ttft_p99_vs_load.png")
    plot_kv_waste(a.table, a.order, out_dir / "kv_waste.png")
    occ = []
    for s in a.order:
        if s in a.table and a.table[s].steps:
            fname = f"occupancy_{s}.png"
            plot_occupancy(a.table[s], s, out_dir / fname)
            occ.append((s, fname))
    return occ


def markdown(a: Analysis, data: CompareResults, command: str, occ: list[tuple[str, str]]) -> list[str]:
    """The report's lines: every statement computed from `a` and `data`."""
    spec, setup, runs = data.spec, data.setup, data.runs
    table_rate, rates, order, table, sweep = a.table_rate, a.rates, a.order, a.table, a.sweep
    baseline, tolerance, verdicts, other_loads = a.baseline, a.tolerance, a.verdicts, a.other_loads
    strategies_at_table = a.strategies_at_table
    w = spec["workload"]
    peaks = setup.get("peak_flops_samples") or [setup["peak_flops_per_s"]]
    gemm = spec.get("peak_matmul_size", 2048)
    load_txt = _rate_label(table_rate) + ("" if table_rate == float("inf") else " req/s (Poisson"
                                          + (f", burstiness {spec['burstiness']:g})" if spec["burstiness"] != 1
                                             else ")"))
    md = ["# Batching lab: four strategies and no batching, measured", "",
          "Generated by `conveyor bench compare` with:", "", "```", command, "```", ""]
    md += ["## Setup", ""]
    md += [f"- model `{setup['model']}` ({setup['dtype']} on {setup['device']}, {setup['torch_threads']} torch "
           f"thread(s), CPU `{setup['cpu']}` with {setup.get('num_cpus', '?')} cores); weights loaded once and "
           "shared by every run",
           f"- KV cache: {setup['num_kv_blocks']} blocks x {setup['block_size']} tokens, max_model_len "
           f"{setup['max_model_len']}",
           f"- workload `{w['name']}`: {w['num_prompts']} requests, seed {w['seed']}, "
           + _workload_text(w) + f"; {setup['workload_tokens']['input']} prompt and "
           f"{setup['workload_tokens']['output']} output tokens in all (random token ids, ignore_eos, greedy)",
           f"- the comparison table is taken at offered load **{load_txt}**; the sweep covers "
           + ", ".join(_rate_label(r) for r in rates) + " req/s",
           f"- peak matmul throughput measured by the lab on this machine: "
           f"**{setup['peak_flops_per_s'] / 1e9:.1f} GFLOP/s** ({setup['dtype']}, {gemm}^3 GEMMs on "
           f"{setup['torch_threads']} torch thread(s) as the engine ran, the best of "
           f"{len(peaks)} measurements taken before each run; they ranged {min(peaks) / 1e9:.1f}-"
           f"{max(peaks) / 1e9:.1f})",
           f"- whole comparison took {setup['total_wall_s'] / 60:.1f} min"]
    cfgs = {r.meta["strategy"]: r.meta["engine_config"] for r in runs}
    md += ["- engine settings per strategy: " + "; ".join(
        f"{_name(s)}: max_num_seqs {c['max_num_seqs']}, budget {c['max_num_batched_tokens']} tokens"
        + (f", {POLICIES[s].describe(c)}" if s in POLICIES and POLICIES[s].options else "")
        for s, c in cfgs.items())]
    md += ["", f"## Comparison table (offered load: {load_txt})", ""]
    md += comparison_table(table, order)
    md += ["", "TTFT counts from the moment the request was sent, so time spent queueing is included. "
           "TPOT is (E2E - TTFT) / (output tokens - 1). MFU = model FLOP/s achieved / peak matmul FLOP/s "
           "measured above. CPU util = CPU time of the process / wall time / cores.", ""]
    md += tenant_table(table, order)
    md += ["## The seed's claims, tested", "", summary_sentence(verdicts), ""]
    for v in verdicts:
        mark = {"holds": "holds", "tie": "tie", "disagrees": "**disagrees**", "untested": "untested"}[v.status]
        md.append(f"- {mark}: *{v.claim}* - {v.detail}")
    md += ["", f"Two numbers within {tolerance:.0%} of each other count as a tie.", ""]
    noise = noise_sentence(strategies_at_table)
    if noise:
        md += [noise, ""]
    headroom = headroom_sentence(strategies_at_table, baseline)
    if headroom:
        md += [headroom, ""]
    if other_loads:
        md += ["### The same claims at the other offered loads", "",
               "(The baseline ran at the table's load only, so the speedup claims are untested here.)", ""]
        for r, vs in other_loads.items():
            md.append(f"- at {_rate_label(r)} req/s: {summary_sentence(vs)}")
        md.append("")
    md += ["### Utilization per strategy", ""]
    for s in order:
        r = table.get(s)
        if r is None:
            continue
        u, e = r.utilization, r.engine
        md.append(f"- {_name(s)}: MFU {_pct(u.mfu, 2)} ({_f((u.achieved_flops_per_s or 0) / 1e9, '.2f')}"
                  f" GFLOP/s), CPU {_pct(u.cpu, 0)}, engine busy {_pct(u.engine_busy, 0)} of the "
                  f"wall time, mean batch {_f(e.mean_batch_size, '.1f')} sequences / "
                  f"{_f(e.mean_step_tokens, '.0f')} tokens per step")
    md += ["", "## Throughput and latency vs offered load", "",
           "![throughput vs offered load](throughput_vs_load.png)", "",
           "![p99 TTFT vs offered load](ttft_p99_vs_load.png)", "",
           "Each cell: output tokens/s, p99 TTFT.", ""]
    md += sweep_table(sweep, rates, order)
    md += [""] + [f"- {line}" for line in per_load_leaders(sweep)]
    md += ["", "## Batch occupancy", "",
           "Rows are requests in arrival order, columns are engine steps (not seconds): grey = sent but not "
           "in that step's batch (queued, or admitted but stalled), orange = in the batch for its prompt "
           "(prefill, possibly a chunk of it), blue = in the batch decoding.", ""]
    for s, fname in occ:
        md += [f"### {_name(s)}", "", f"![{_name(s)} occupancy]({fname})", ""]
    md += ["## KV cache: paged blocks vs contiguous reservation", "",
           "Sampled after every engine step: paged waste = 1 - used slots / (used blocks x block size); "
           "contiguous waste = 1 - tokens held / (running requests x max_model_len), i.e. what reserving "
           "the longest possible sequence per request up front would have left empty (a prefix shared in the "
           "paged cache counts once per request there, since contiguous buffers cannot share it).", ""]
    md += kv_table(table, order)
    md += ["", "![KV waste](kv_waste.png)", "", _waste_sentence(table, order, setup), ""]
    md += ["## Method", "",
           "- One process: the lab loads the model once, measures peak matmul FLOP/s, warms up, then for every "
           "(strategy, load) gives the engine a fresh scheduler, policy and empty KV cache and drives it on a "
           "background thread. A request reaches the engine only when its arrival time has come (open loop, "
           "seeded gamma/Poisson arrivals, identical for every strategy); each token is timestamped when the "
           "engine step that produced it returns.",
           "- Model FLOPs count 2 FLOPs per weight for every token the engine actually processed (prompt tokens "
           "not served by the prefix cache, recomputes after preemption, and all decode tokens), the LM head "
           "only for sampled rows (as the runner does), and 4 x layers x q_width x context for attention.",
           "- Static batching starts a batch when `batch_size` requests wait or, as in `conveyor serve`, when "
           "the oldest has waited the flush time; without a flush timer it is told when the load generator has "
           "sent its last request, so that the last partial batch can go. Dynamic batching uses its timeout.",
           "- Numbers come from a shared, noisy machine; differences within a few percent are not meaningful.",
           ""]
    return md


def _workload_text(w: dict) -> str:
    if w["name"] == "mixed-slo":
        return (f"{w['long_fraction']:.0%} batch jobs (tenant batch: prompt {w['long_input'][0]}-{w['long_input'][1]}, "
                f"output {w['long_output'][0]}-{w['long_output'][1]}, TTFT target {w['batch_ttft_ms']:g} ms), the "
                f"rest chat (tenant chat: prompt {w['short_input'][0]}-{w['short_input'][1]}, output "
                f"{w['short_output'][0]}-{w['short_output'][1]}, targets TTFT {w['chat_ttft_ms']:g} ms, TPOT "
                f"{w['chat_tpot_ms']:g} ms)")
    if w["name"] == "longtail":
        return (f"{w['long_fraction']:.0%} long (prompt {w['long_input'][0]}-{w['long_input'][1]}, output "
                f"{w['long_output'][0]}-{w['long_output'][1]}), the rest short (prompt {w['short_input'][0]}-"
                f"{w['short_input'][1]}, output {w['short_output'][0]}-{w['short_output'][1]})")
    rr = f" +/-{w['range_ratio']:.0%}" if w["range_ratio"] else ""
    text = f"prompt {w['input_len']}{rr} tokens, output {w['output_len']}{rr} tokens"
    if w["name"] == "shared-prefix":
        k = w.get("num_prefixes", 1)
        shared = "a shared" if k == 1 else f"one of {k} shared"
        text = f"{shared} {w['prefix_len']}-token system prompt{'s' if k > 1 else ''}, then " + text
    if w["name"] == "noisy-neighbour":
        text += f"; two tenants, noisy sending {w['noisy_ratio']:g}x as many requests as quiet"
    return text


def _waste_sentence(table: dict[str, RunResult], order: list[str], setup: dict) -> str:
    rows = [(s, table[s].engine) for s in order if s in table and table[s].engine.kv_waste_paged is not None]
    if not rows:
        return ""
    paged = [e.kv_waste_paged for _, e in rows]
    contig = [e.kv_waste_contiguous for _, e in rows if e.kv_waste_contiguous is not None]
    s = (f"Paged allocation left {min(paged):.1%}-{max(paged):.1%} of the reserved slots empty across strategies")
    if contig:
        s += (f"; reserving max_model_len ({setup['max_model_len']}) contiguous slots per request would have left "
              f"{min(contig):.1%}-{max(contig):.1%} empty")
    return s + "."
