"""Read a PEFT LoRA adapter directory (`adapter_config.json` + `adapter_model.safetensors`) into
per-layer, per-projection low-rank pairs, checked against the base model before anything runs.

What is accepted, as vLLM accepts it: LoRA (not DoRA, no trained biases, no `modules_to_save`) on
any of the attention and MLP projections (q, k, v, o, gate, up, down) of any layers, at one rank r
up to `--max-lora-rank`, scaled by PEFT's `lora_alpha / r` (or `lora_alpha / sqrt(r)` with
`use_rslora`). The scaling is folded into B once here, so a step computes `(x A^T) B'^T` only.

Every way a directory can be wrong (missing, no config, a config that is not LoRA, a rank above the
limit, a tensor for a module the engine cannot adapt, a shape that does not fit the base) raises
`AdapterError` (a ValueError) naming the adapter and the problem: a startup error for
`--lora-modules`, a 400 for a runtime load.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch

from conveyor.model.llama import ModelConfig

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_NAME = re.compile(r"(?:^|\.)layers\.(\d+)\.(?:self_attn|mlp)\.(" + "|".join(PROJECTIONS)
                   + r")\.lora_([AB])(?:\.[A-Za-z0-9_-]+)?\.weight$")
CONFIG_FILE = "adapter_config.json"
WEIGHT_FILES = ("adapter_model.safetensors", "adapter_model.bin")


class AdapterError(ValueError):
    """The adapter cannot be used with this engine; the message says why."""


@dataclass(frozen=True)
class LoRASpec:
    """What an adapter must fit: the base model's projection shapes (in, out), its layer count and the
    engine's rank limit. Small and picklable: the HTTP side checks runtime loads with it."""

    num_layers: int
    shapes: dict[str, tuple[int, int]]
    max_lora_rank: int

    @classmethod
    def for_model(cls, cfg: ModelConfig, max_lora_rank: int) -> LoRASpec:
        h, q, kv, inter = cfg.hidden_size, cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, \
            cfg.intermediate_size
        shapes = {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
                  "gate_proj": (h, inter), "up_proj": (h, inter), "down_proj": (inter, h)}
        return cls(cfg.num_layers, shapes, max_lora_rank)


@dataclass
class LoRAAdapter:
    """One adapter's weights: (layer, projection) -> (A [r, in], B [out, r] with the scaling folded in)."""

    name: str
    path: str
    rank: int
    scaling: float
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]
    key: str  # a digest of the config and weights: the prefix cache's notion of "the same adapter"
    targets: tuple[str, ...] = field(default=())

    @property
    def num_bytes(self) -> int:
        return sum(a.numel() * a.element_size() + b.numel() * b.element_size() for a, b in self.weights.values())


def read_config(path: Path, name: str) -> dict:
    if not path.exists():
        raise AdapterError(f"LoRA adapter {name!r}: path {str(path)!r} does not exist")
    if not path.is_dir():
        raise AdapterError(f"LoRA adapter {name!r}: {str(path)!r} is not a directory (a PEFT adapter is a "
                           f"directory holding {CONFIG_FILE} and adapter_model.safetensors)")
    cfg_file = path / CONFIG_FILE
    if not cfg_file.is_file():
        raise AdapterError(f"LoRA adapter {name!r}: {str(path)!r} has no {CONFIG_FILE}")
    try:
        cfg = json.loads(cfg_file.read_text())
    except (ValueError, UnicodeDecodeError) as e:
        raise AdapterError(f"LoRA adapter {name!r}: {CONFIG_FILE} is not valid JSON ({e})") from None
    if not isinstance(cfg, dict):
        raise AdapterError(f"LoRA adapter {name!r}: {CONFIG_FILE} must hold a JSON object")
    return cfg


def check_config(cfg: dict, name: str, spec: LoRASpec) -> tuple[int, float]:
    """(rank, scaling) of a LoRA config this engine can run; AdapterError otherwise."""
    def bad(why: str) -> AdapterError:
        return AdapterError(f"LoRA adapter {name!r}: {why}")

    if cfg.get("peft_type", "LORA") != "LORA":
        raise bad(f"peft_type is {cfg.get('peft_type')!r}; only LORA adapters are supported")
    r, alpha = cfg.get("r"), cfg.get("lora_alpha", cfg.get("r"))
    if not isinstance(r, int) or isinstance(r, bool) or r < 1:
        raise bad(f"'r' must be a positive integer, got {r!r}")
    if r > spec.max_lora_rank:
        raise bad(f"rank {r} is above --max-lora-rank {spec.max_lora_rank}")
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool):
        raise bad(f"'lora_alpha' must be a number, got {alpha!r}")
    for key, what in (("use_dora", "DoRA"), ("lora_bias", "trained LoRA biases")):
        if cfg.get(key):
            raise bad(f"{what} ({key}) is not supported")
    if cfg.get("bias", "none") != "none":
        raise bad(f"bias={cfg.get('bias')!r} is not supported (only 'none')")
    if cfg.get("modules_to_save"):
        raise bad(f"modules_to_save {cfg['modules_to_save']} is not supported (only LoRA on the projections)")
    for key in ("rank_pattern", "alpha_pattern"):
        if cfg.get(key):
            raise bad(f"{key} (per-module ranks or alphas) is not supported")
    if cfg.get("fan_in_fan_out"):
        raise bad("fan_in_fan_out is not supported (Llama-family projections are nn.Linear)")
    targets = cfg.get("target_modules")
    if isinstance(targets, list):
        unknown = [t for t in targets if t.rsplit(".", 1)[-1] not in PROJECTIONS]
        if unknown:
            raise bad(f"target_modules {unknown} are not supported (supported: {', '.join(PROJECTIONS)})")
    scaling = alpha / math.sqrt(r) if cfg.get("use_rslora") else alpha / r
    return r, float(scaling)


def _read_tensors(path: Path, name: str) -> tuple[dict[str, torch.Tensor], bytes]:
    for fname in WEIGHT_FILES:
        f = path / fname
        if not f.is_file():
            continue
        data = f.read_bytes()
        try:
            if fname.endswith(".safetensors"):
                from safetensors.torch import load

                return load(data), data
            import io

            return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True), data
        except Exception as e:  # a truncated or foreign file
            raise AdapterError(f"LoRA adapter {name!r}: {fname} could not be read ({type(e).__name__}: {e})") from None
    raise AdapterError(f"LoRA adapter {name!r}: {str(path)!r} has no {' or '.join(WEIGHT_FILES)}")


def load_adapter(path: str | Path, spec: LoRASpec, name: str | None = None,
                 dtype: torch.dtype = torch.float32) -> LoRAAdapter:
    """Read and check the adapter at `path`; its weights in `dtype`, the scaling folded into B."""
    path = Path(path).expanduser()
    name = name or path.name
    cfg = read_config(path, name)
    rank, scaling = check_config(cfg, name, spec)
    tensors, raw = _read_tensors(path, name)
    if not isinstance(tensors, dict):
        raise AdapterError(f"LoRA adapter {name!r}: the weights file does not hold named tensors")
    pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, t in tensors.items():
        m = _NAME.search(key)
        if m is None:
            raise AdapterError(f"LoRA adapter {name!r}: weight {key!r} is not a LoRA A/B matrix of a supported "
                               f"projection ({', '.join(PROJECTIONS)})")
        layer, proj, which = int(m.group(1)), m.group(2), m.group(3)
        if layer >= spec.num_layers:
            raise AdapterError(f"LoRA adapter {name!r}: weight {key!r} is for layer {layer}, but the base model "
                               f"has {spec.num_layers} layers")
        if not isinstance(t, torch.Tensor) or t.dim() != 2 or not t.is_floating_point():
            raise AdapterError(f"LoRA adapter {name!r}: weight {key!r} must be a 2-D float tensor")
        slot = pairs.setdefault((layer, proj), {})
        if which in slot:
            raise AdapterError(f"LoRA adapter {name!r}: two lora_{which} weights for layer {layer} {proj}")
        slot[which] = t
    if not pairs:
        raise AdapterError(f"LoRA adapter {name!r}: the weights file holds no LoRA weights")
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = {}
    for (layer, proj), ab in sorted(pairs.items()):
        if set(ab) != {"A", "B"}:
            missing = "B" if "A" in ab else "A"
            raise AdapterError(f"LoRA adapter {name!r}: layer {layer} {proj} has no lora_{missing} weight")
        a, b = ab["A"], ab["B"]
        fan_in, fan_out = spec.shapes[proj]
        if tuple(a.shape) != (rank, fan_in) or tuple(b.shape) != (fan_out, rank):
            raise AdapterError(f"LoRA adapter {name!r}: layer {layer} {proj} has lora_A {tuple(a.shape)} and "
                               f"lora_B {tuple(b.shape)}; this base model and r={rank} need {(rank, fan_in)} and "
                               f"{(fan_out, rank)}")
        weights[(layer, proj)] = (a.float().to(dtype).contiguous(), (b.float() * scaling).to(dtype).contiguous())
    digest = hashlib.sha256()
    digest.update(json.dumps(cfg, sort_keys=True).encode())
    digest.update(raw)
    return LoRAAdapter(name=name, path=str(path), rank=rank, scaling=scaling, weights=weights,
                       key=digest.hexdigest()[:32], targets=tuple(sorted({p for _, p in weights})))


def check_adapter(path: str | Path, spec: LoRASpec, name: str | None = None) -> LoRAAdapter:
    """Load in fp32 only to check it (the HTTP side, before it names the adapter to clients)."""
    return load_adapter(path, spec, name)
