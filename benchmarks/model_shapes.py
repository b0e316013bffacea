"""Random-weight models in the exact shapes of Llama-3.2-1B, Llama-3.2-3B and Llama-3.1-8B, as HF directories
and as GGUF files made by llama.cpp's own converter and quantizer: the files the real-size benchmarks load.

    python benchmarks/model_shapes.py hf --shape llama-3.2-1b --out /work/models/llama-3.2-1b
    python benchmarks/model_shapes.py gguf --hf /work/models/llama-3.2-1b --types F16,BF16,Q8_0,Q4_0,Q4_K_M
    python benchmarks/model_shapes.py list                                    # the shapes and their sizes

`hf` writes config.json (the real hidden and intermediate sizes, layers, heads, GQA KV heads, head_dim, tied
or untied embeddings, rope_theta and the llama3 rope_scaling, the 128,256-row vocabulary), bf16 safetensors
shards with a `model.safetensors.index.json`, and a tokenizer. It streams: each shard's header is written
first (every shape is known in advance), then each tensor is drawn and written a few rows at a time, so the
writer never holds more than one chunk of ~64 MB (the 8B shape, 16 GB of weights, is written by a process of
a few hundred MB). The weights are reproducible (each tensor from its own seed) and scaled so a forward pass
stays sane: normal with std 1/sqrt(fan_in) for the linears (activations keep their size through every layer),
0.02 for the embedding (so with tied embeddings the current token does not dominate the logits, which made
greedy repeat one token forever), norms at 1. Rows of the vocabulary the tokenizer cannot produce are scaled
by 0.25, so a greedy run emits tokens that detokenize (a real model rarely emits unused ids either).

There is no hub here, so the tokenizer is SmolLM2's (49,152 tokens, default /tmp/peers/smollm2-hf) with the
config's vocab_size at 128,256: conveyor, vLLM and HF transformers load such a directory (the model's rows
beyond the tokenizer are simply never prompted), and llama.cpp's converter pads its vocabulary with [PAD]
tokens as it does for any model whose embedding outgrows its tokenizer.

`gguf` runs llama.cpp's converter (`convert_hf_to_gguf.py`, with its own Python environment: by default
/tmp/peers/convvenv/bin/python, which needs `pip install sentencepiece` besides torch, numpy, gguf,
transformers, tokenizers and safetensors) for F16, BF16 and Q8_0, and `llama-quantize` on the BF16 file (an
exact copy of the weights) for Q4_0, Q4_K_M, Q5_K_M and Q6_K, exactly as the peers' users make their files.
Files land beside the HF directory as `<name>-<TYPE>.gguf` (or in --out-dir). Disk: the 8B shape takes 16 GB
as HF, 16 GB per 16-bit GGUF, 8.5 GB as Q8_0 and 4.7-6.6 GB per 4-6-bit file.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import struct
import subprocess
import sys
import time
import zlib
from dataclasses import dataclass
from pathlib import Path

import torch

GiB = 2**30
LLAMA3_VOCAB = 128256
CHUNK_BYTES = 64 * 2**20  # fp32 bytes drawn at a time


def llama3_rope(factor: float) -> dict:
    return {"factor": factor, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192, "rope_type": "llama3"}


# The published configs (hidden, intermediate, layers, heads, KV heads, head_dim, tying, RoPE) of each model
SHAPES: dict[str, dict] = {
    "llama-3.2-1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                         num_key_value_heads=8, head_dim=64, tie_word_embeddings=True, rope_theta=500000.0,
                         rope_scaling=llama3_rope(32.0), max_position_embeddings=131072),
    "llama-3.2-3b": dict(hidden_size=3072, intermediate_size=8192, num_hidden_layers=28, num_attention_heads=24,
                         num_key_value_heads=8, head_dim=128, tie_word_embeddings=True, rope_theta=500000.0,
                         rope_scaling=llama3_rope(32.0), max_position_embeddings=131072),
    "llama-3.1-8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                         num_key_value_heads=8, head_dim=128, tie_word_embeddings=False, rope_theta=500000.0,
                         rope_scaling=llama3_rope(8.0), max_position_embeddings=131072),
}
GGUF_TYPES = ("F16", "BF16", "Q8_0", "Q4_0", "Q4_K_M", "Q5_K_M", "Q6_K")
CONVERTER_TYPES = {"F16": "f16", "BF16": "bf16", "Q8_0": "q8_0"}  # the rest: llama-quantize on the BF16 file


@dataclass(frozen=True)
class TensorSpec:
    name: str
    shape: tuple[int, ...]
    std: float  # 0: ones (norms)
    scale_rows_from: int | None = None  # rows from here on (ids the tokenizer cannot produce) scaled by 0.25

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * 2  # bf16


def tensor_specs(cfg: dict, tokenizer_vocab: int) -> list[TensorSpec]:
    """Every tensor of the checkpoint, in HF's names and layer order."""
    h, inter, d = cfg["hidden_size"], cfg["intermediate_size"], cfg["head_dim"]
    q, kv, vocab = cfg["num_attention_heads"] * d, cfg["num_key_value_heads"] * d, cfg["vocab_size"]
    unused = tokenizer_vocab if tokenizer_vocab < vocab else None
    specs = [TensorSpec("model.embed_tokens.weight", (vocab, h), 0.02, unused)]
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        specs += [TensorSpec(p + "input_layernorm.weight", (h,), 0.0),
                  TensorSpec(p + "self_attn.q_proj.weight", (q, h), h ** -0.5),
                  TensorSpec(p + "self_attn.k_proj.weight", (kv, h), h ** -0.5),
                  TensorSpec(p + "self_attn.v_proj.weight", (kv, h), h ** -0.5),
                  TensorSpec(p + "self_attn.o_proj.weight", (h, q), q ** -0.5),
                  TensorSpec(p + "post_attention_layernorm.weight", (h,), 0.0),
                  TensorSpec(p + "mlp.gate_proj.weight", (inter, h), h ** -0.5),
                  TensorSpec(p + "mlp.up_proj.weight", (inter, h), h ** -0.5),
                  TensorSpec(p + "mlp.down_proj.weight", (h, inter), inter ** -0.5)]
    specs.append(TensorSpec("model.norm.weight", (h,), 0.0))
    if not cfg["tie_word_embeddings"]:
        specs.append(TensorSpec("lm_head.weight", (vocab, h), h ** -0.5, unused))
    return specs


def draw(spec: TensorSpec, seed: int):
    """The tensor's bf16 values, a chunk of rows at a time (each tensor from its own seed: reproducible)."""
    if spec.std == 0.0:
        yield torch.ones(spec.shape, dtype=torch.bfloat16)
        return
    rows, cols = spec.shape
    g = torch.Generator().manual_seed(zlib.crc32(spec.name.encode()) ^ seed)
    step = max(1, CHUNK_BYTES // (4 * cols))
    for a in range(0, rows, step):
        b = min(rows, a + step)
        chunk = torch.randn(b - a, cols, generator=g).mul_(spec.std)
        if spec.scale_rows_from is not None and b > spec.scale_rows_from:
            chunk[max(0, spec.scale_rows_from - a):].mul_(0.25)
        yield chunk.to(torch.bfloat16)


def shard(specs: list[TensorSpec], shard_bytes: int) -> list[list[TensorSpec]]:
    out: list[list[TensorSpec]] = [[]]
    size = 0
    for s in specs:
        if out[-1] and size + s.nbytes > shard_bytes:
            out.append([])
            size = 0
        out[-1].append(s)
        size += s.nbytes
    return out


def write_safetensors(path: Path, specs: list[TensorSpec], seed: int) -> None:
    """The safetensors format, streamed: an 8-byte header length, the JSON header (padded to 8 bytes), then
    each tensor's bytes in header order, drawn chunk by chunk."""
    header: dict = {"__metadata__": {"format": "pt"}}
    offset = 0
    for s in specs:
        header[s.name] = {"dtype": "BF16", "shape": list(s.shape), "data_offsets": [offset, offset + s.nbytes]}
        offset += s.nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    tmp = path.with_suffix(".tmp")
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        for s in specs:
            for chunk in draw(s, seed):
                f.write(chunk.contiguous().view(torch.int16).numpy().tobytes())
        assert f.tell() == 8 + len(text) + offset
    tmp.replace(path)


def write_hf(shape: str, out: Path, tokenizer: Path, seed: int, shard_gib: float) -> Path:
    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
           "attention_bias": False, "mlp_bias": False, "attention_dropout": 0.0, "rms_norm_eps": 1e-5,
           "initializer_range": 0.02, "pretraining_tp": 1, "use_cache": True, "torch_dtype": "bfloat16",
           "vocab_size": LLAMA3_VOCAB, **SHAPES[shape]}
    tok_cfg = json.loads((tokenizer / "tokenizer.json").read_text())
    tok_vocab = len(tok_cfg["model"]["vocab"]) + sum(1 for t in tok_cfg.get("added_tokens", [])
                                                     if t["content"] not in tok_cfg["model"]["vocab"])
    vocab = {t["content"]: t["id"] for t in tok_cfg.get("added_tokens", [])}
    tc = json.loads((tokenizer / "tokenizer_config.json").read_text())
    cfg["bos_token_id"] = vocab.get(tc.get("bos_token"), 1)
    cfg["eos_token_id"] = vocab.get(tc.get("eos_token"), 2)
    out.mkdir(parents=True, exist_ok=True)
    for f in tokenizer.iterdir():
        if f.name.startswith("tokenizer") or f.name in ("chat_template.jinja", "special_tokens_map.json"):
            shutil.copy(f, out / f.name)
    specs = tensor_specs(cfg, tok_vocab)
    shards = shard(specs, int(shard_gib * GiB))
    n = len(shards)
    weight_map, t0 = {}, time.perf_counter()
    for i, part in enumerate(shards, 1):
        fname = f"model-{i:05d}-of-{n:05d}.safetensors"
        write_safetensors(out / fname, part, seed)
        weight_map.update({s.name: fname for s in part})
        print(f"  {fname}: {len(part)} tensors, {sum(s.nbytes for s in part) / GiB:.2f} GiB "
              f"({time.perf_counter() - t0:.0f} s)", file=sys.stderr)
    total = sum(s.nbytes for s in specs)
    (out / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    (out / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": cfg["bos_token_id"], "eos_token_id": cfg["eos_token_id"], "do_sample": False}, indent=2))
    print(f"{out}: {shape}, {sum(math.prod(s.shape) for s in specs) / 1e9:.2f} B parameters, "
          f"{total / GiB:.2f} GiB bf16 in {n} shards ({time.perf_counter() - t0:.0f} s)")
    return out


def write_gguf(hf: Path, types: list[str], out_dir: Path, llama_cpp: Path, python: Path, keep_bf16: bool) -> None:
    unknown = [t for t in types if t not in GGUF_TYPES]
    if unknown:
        raise SystemExit(f"unknown GGUF types {unknown}; known: {', '.join(GGUF_TYPES)}")
    out_dir.mkdir(parents=True, exist_ok=True)

    def path(t: str) -> Path:
        return out_dir / f"{hf.name}-{t}.gguf"

    def run(cmd: list[str]) -> None:
        t0 = time.perf_counter()
        print("  $ " + " ".join(cmd), file=sys.stderr)
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
        print(f"    {time.perf_counter() - t0:.0f} s", file=sys.stderr)

    quantized = [t for t in types if t not in CONVERTER_TYPES]
    direct = [t for t in types if t in CONVERTER_TYPES]
    if quantized and "BF16" not in direct:
        direct.append("BF16")  # the quantizer's source; removed after unless asked for
    for t in direct:
        if not path(t).exists():
            run([str(python), str(llama_cpp / "convert_hf_to_gguf.py"), str(hf), "--outtype", CONVERTER_TYPES[t],
                 "--outfile", str(path(t))])
    for t in quantized:
        if not path(t).exists():
            run([str(llama_cpp / "build" / "bin" / "llama-quantize"), str(path("BF16")), str(path(t)), t])
    if "BF16" not in types and not keep_bf16:
        path("BF16").unlink(missing_ok=True)
    for t in types:
        print(f"{path(t)}: {path(t).stat().st_size / GiB:.2f} GiB")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    a = sub.add_parser("hf", help="write a random-weight HF directory of a shape")
    a.add_argument("--shape", choices=sorted(SHAPES), required=True)
    a.add_argument("--out", type=Path, required=True)
    a.add_argument("--tokenizer", type=Path, default=Path("/tmp/peers/smollm2-hf"),
                   help="a directory with tokenizer.json and tokenizer_config.json (default: SmolLM2's)")
    a.add_argument("--seed", type=int, default=0)
    a.add_argument("--shard-gib", type=float, default=2.0, help="shard size (default 2 GiB)")
    g = sub.add_parser("gguf", help="convert an HF directory to GGUF files with llama.cpp's tools")
    g.add_argument("--hf", type=Path, required=True)
    g.add_argument("--types", default=",".join(GGUF_TYPES), help=f"comma-separated, of {', '.join(GGUF_TYPES)}")
    g.add_argument("--out-dir", type=Path, help="default: beside the HF directory")
    g.add_argument("--llama-cpp", type=Path, default=Path("/tmp/peers/llama.cpp"))
    g.add_argument("--python", type=Path, default=Path("/tmp/peers/convvenv/bin/python"),
                   help="the Python environment of llama.cpp's converter")
    g.add_argument("--keep-bf16", action="store_true", help="keep the BF16 file the quantizer read")
    sub.add_parser("list", help="the shapes, their parameter counts and sizes")
    args = ap.parse_args()
    if args.cmd == "hf":
        write_hf(args.shape, args.out, args.tokenizer, args.seed, args.shard_gib)
    elif args.cmd == "gguf":
        write_gguf(args.hf, [t.strip() for t in args.types.split(",") if t.strip()], args.out_dir or args.hf.parent,
                   args.llama_cpp, args.python, args.keep_bf16)
    else:
        for name, shape in SHAPES.items():
            specs = tensor_specs({**shape, "vocab_size": LLAMA3_VOCAB}, LLAMA3_VOCAB)
            params = sum(math.prod(s.shape) for s in specs)
            print(f"{name}: {params / 1e9:.2f} B parameters, {params * 2 / GiB:.2f} GiB in bf16")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    sys.exit(main())
