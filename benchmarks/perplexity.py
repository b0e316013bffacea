"""Quality of quantized weights and KV cache, measured: perplexity and greedy agreement.

Perplexity is computed over a fixed English text that ships with every CPython (`pydoc_data.topics`,
its topics joined in order), its first `--tokens` tokens in non-overlapping windows of `--window`,
each window run as one prompt through the engine (`LLMEngine.prompt_logits`), so attention reads K/V back
from the (possibly int8) paged cache and the linear layers run the quantized kernels themselves
(`CONVEYOR_QUANT_DENSE_ABOVE=none`: no dense copies, even for these 1,024-row steps).

Greedy agreement: 32 prompts of 48 tokens taken from the same text after the perplexity part,
64 greedy tokens each through `LLM.generate`, compared with the unquantized configuration: tokens
identical up to the first difference, and prompts whose 64 tokens are all identical.

    python benchmarks/perplexity.py --out docs/quantization/quality.json

Against llama.cpp (`--llama-cpp BIN_DIR --files A.gguf,B.gguf,...`): each GGUF file's perplexity from
llama.cpp's own `llama-perplexity` and from conveyor on the same tokens, scored as llama-perplexity scores them
(the text's tokens, llama.cpp's tokenization fetched from `llama-server`'s /tokenize, cut into chunks of `--ctx`;
the first token of a chunk replaced by BOS where the vocabulary adds one; the chunk's second half scored).
conveyor runs each file as served by default (a GGUF's blocks as shipped where the kernels take them) and
dequantized (`--quantization none`):

    python benchmarks/perplexity.py --llama-cpp /tmp/peers/llama.cpp/build/bin \
        --files /work/models/smollm2-quants/smollm2-Q8_0.gguf,... --text /usr/share/common-licenses/GPL-3 \
        --out docs/quantization/vs_llama_cpp.json
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import time

os.environ.setdefault("CONVEYOR_QUANT_DENSE_ABOVE", "none")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from conveyor.bench.study import Server, Study, cpu_name, free_port  # noqa: E402
from conveyor.llm import LLM  # noqa: E402
from conveyor.model import w8a8  # noqa: E402
from conveyor.sampling_params import SamplingParams  # noqa: E402

CONFIGS = {  # name -> LLM kwargs
    "bf16": {},
    "W8A8 int8": {"quantization": "int8_per_channel"},
    # the LM head's choice under W8A8 (conveyor/model/w8a8.py QUANTIZE_HEAD), measured: "_w8a8_head" is this
    # script's, not an LLM argument
    "W8A8 int8 (bf16 LM head)": {"quantization": "int8_per_channel", "_w8a8_head": False},
    "int8 weights": {"quantization": "int8"},
    "int4 weights": {"quantization": "int4"},
    "int8 KV": {"kv_cache_dtype": "int8"},
    "int8 weights + int8 KV": {"quantization": "int8", "kv_cache_dtype": "int8"},
    "int4 weights + int8 KV": {"quantization": "int4", "kv_cache_dtype": "int8"},
}


LLAMA_CPP_TEXT = "/usr/share/common-licenses/GPL-3"  # plain English prose on every Debian


def corpus_text(path: str | None) -> str:
    """The text scored: a file (e.g. /usr/share/common-licenses/GPL-3, plain English prose on every Debian), or by
    default CPython's pydoc_data.topics (English about Python, with code) joined in order."""
    if path:
        with open(path, encoding="utf-8") as f:
            return f.read()
    from pydoc_data import topics

    return "\n\n".join(topics.topics.values())


def corpus_ids(tokenizer, n: int, path: str | None = None) -> list[int]:
    return tokenizer(corpus_text(path), add_special_tokens=False)["input_ids"][:n]


@torch.inference_mode()
def perplexity(llm: LLM, ids: list[int], window: int) -> tuple[float, int]:
    nll, count = 0.0, 0
    for start in range(0, len(ids) - window + 1, window):
        chunk = ids[start:start + window]
        logits = llm.engine.prompt_logits(chunk)[:-1]
        nll += F.cross_entropy(logits, torch.tensor(chunk[1:], device=logits.device), reduction="sum").item()
        count += window - 1
    return math.exp(nll / count), count


def llama_cpp_tokens(bin_dir: str, model: str, text: str) -> list[int]:
    """The text as llama.cpp tokenizes it for llama-perplexity (special tokens added as the vocabulary says),
    from a short-lived llama-server's /tokenize."""
    import httpx

    port = free_port()
    with Server([os.path.join(bin_dir, "llama-server"), "-m", model, "--port", str(port), "-c", "512", "-t", "1"],
                port, ready_timeout=120, poll_s=0.5, stop_timeout=30) as server:
        r = httpx.post(server.url + "/tokenize", json={"content": text, "add_special": True}, timeout=30)
        r.raise_for_status()
        return r.json()["tokens"]


def llama_cpp_perplexity(bin_dir: str, model: str, text_file: str, ctx: int, threads: int) -> float:
    """llama-perplexity's final estimate on `text_file` with chunks of `ctx`."""
    import re
    import subprocess

    out = subprocess.run([os.path.join(bin_dir, "llama-perplexity"), "-m", model, "-f", text_file, "-c", str(ctx),
                          "-b", str(ctx), "-t", str(threads)], capture_output=True, text=True, check=True)
    m = re.search(r"Final estimate: PPL = ([0-9.]+)", out.stdout + out.stderr)
    if m is None:
        raise RuntimeError("llama-perplexity printed no final estimate:\n" + (out.stdout + out.stderr)[-2000:])
    return float(m.group(1))


@torch.inference_mode()
def perplexity_as_llama_cpp(llm: LLM, tokens: list[int], ctx: int, bos: int | None) -> float:
    """llama-perplexity's scoring: chunks of `ctx` tokens, the first replaced by `bos` (if any), the logits of
    positions ctx/2 .. ctx-2 scored against the next token."""
    nll, count, first = 0.0, 0, ctx // 2
    for c in range(len(tokens) // ctx):
        chunk = list(tokens[c * ctx:(c + 1) * ctx])
        if bos is not None:
            chunk[0] = bos
        logits = llm.engine.prompt_logits(chunk)[first:ctx - 1].float()
        target = torch.tensor(tokens[c * ctx + first + 1:(c + 1) * ctx], device=logits.device)
        nll += F.cross_entropy(logits, target, reduction="sum").item()
        count += ctx - 1 - first
    return math.exp(nll / count)


def vs_llama_cpp(args, study: Study) -> None:
    text_file = args.text or LLAMA_CPP_TEXT
    text = open(text_file, encoding="utf-8").read()
    files = [f.strip() for f in args.files.split(",") if f.strip()]
    tokens = llama_cpp_tokens(args.llama_cpp, files[0], text)
    rows = []
    for path in files:
        t0 = time.perf_counter()
        ref = llama_cpp_perplexity(args.llama_cpp, path, text_file, args.ctx, torch.get_num_threads())
        row = {"file": os.path.basename(path), "llama_cpp": round(ref, 4)}
        for label, quantization in (("conveyor", None), ("conveyor_dequantized", "none")):
            llm = LLM(path, kv_cache_memory=0.5, quantization=quantization, use_tqdm_on_load=False)
            bos = llm.engine.model_config.bos_token_id
            row.setdefault("tokens", len(tokens))
            row.setdefault("bos_added", tokens[0] == bos)
            ppl = perplexity_as_llama_cpp(llm, tokens, args.ctx, bos if tokens[0] == bos else None)
            row[label] = round(ppl, 4)
            row[label + "_vs_llama_cpp"] = round(ppl / ref - 1, 4)
            if quantization is None:
                row["weights"] = llm.engine.info.weight_dtype
            del llm
            gc.collect()
        row["seconds"] = round(time.perf_counter() - t0, 1)
        rows.append(row)
        print(json.dumps(row), flush=True)
    if args.out:
        study.write(args.out, {"text": text_file, "ctx": args.ctx,
                               "scored_tokens_per_chunk": args.ctx - 1 - args.ctx // 2,
                               "chunks": len(tokens) // args.ctx, "cpu": cpu_name(), "torch": torch.__version__,
                               "results": rows})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--tokens", type=int, default=20000)
    ap.add_argument("--window", type=int, default=1024)
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=48)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--configs", default=",".join(CONFIGS), help="comma-separated names from: " + ", ".join(CONFIGS))
    ap.add_argument("--text", default=None, help="a text file to score (default: pydoc_data.topics; with --llama-cpp: "
                    f"{LLAMA_CPP_TEXT}); with fewer tokens than --tokens + the greedy prompts, the prompts come from "
                    "its end and the windows from the rest")
    ap.add_argument("--out", default=None)
    ap.add_argument("--llama-cpp", default=None, help="llama.cpp's bin folder: compare --files with llama-perplexity")
    ap.add_argument("--files", default="", help="comma-separated GGUF files (with --llama-cpp)")
    ap.add_argument("--ctx", type=int, default=512, help="chunk length (with --llama-cpp)")
    args = ap.parse_args()
    study = Study()
    if args.llama_cpp:
        vs_llama_cpp(args, study)
        return
    names = [c.strip() for c in args.configs.split(",")]
    results, base_tokens = [], None
    ids = prompts = None
    default_head = w8a8.QUANTIZE_HEAD
    for name in names:
        t0 = time.perf_counter()
        kwargs = dict(CONFIGS[name])
        w8a8.QUANTIZE_HEAD = kwargs.pop("_w8a8_head", default_head)
        llm = LLM(args.model, kv_cache_memory=0.5, **kwargs)
        if ids is None:
            n_prompt_tokens = args.prompts * args.prompt_len
            all_ids = corpus_ids(llm.tokenizer, args.tokens + n_prompt_tokens, args.text)
            scored = min(args.tokens, len(all_ids) - n_prompt_tokens)  # a short text: prompts from its end
            ids = all_ids[:scored]
            rest = all_ids[scored:]
            prompts = [rest[i * args.prompt_len:(i + 1) * args.prompt_len] for i in range(args.prompts)]
        ppl, n = perplexity(llm, ids, args.window)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                            SamplingParams(max_tokens=args.max_tokens, temperature=0, ignore_eos=True),
                            use_tqdm=False)
        tokens = [list(o.outputs[0].token_ids) for o in outs]
        row = {"config": name, "perplexity": round(ppl, 4), "scored_tokens": n, "seconds": 0.0}
        if base_tokens is None:
            base_tokens = tokens
        else:
            prefix = []
            for a, b in zip(tokens, base_tokens):
                k = 0
                while k < len(a) and k < len(b) and a[k] == b[k]:
                    k += 1
                prefix.append(k)
            row["agree_tokens_until_first_difference"] = round(sum(prefix) / (len(prefix) * args.max_tokens), 4)
            row["identical_outputs"] = f"{sum(p == args.max_tokens for p in prefix)}/{len(prefix)}"
            row["perplexity_vs_first"] = round(ppl / results[0]["perplexity"] - 1, 4)
        row["seconds"] = round(time.perf_counter() - t0, 1)
        results.append(row)
        print(json.dumps(row), flush=True)
        del llm
        gc.collect()
    if args.out:
        study.write(args.out, {"model": args.model, "text": args.text or "pydoc_data.topics", "tokens": len(ids),
                               "window": args.window, "cpu": cpu_name(), "torch": torch.__version__,
                               "results": results})


if __name__ == "__main__":
    main()
