"""The Llama family (Llama 2/3, SmolLM2, TinyLlama, Mistral, Qwen2) on a paged KV cache.

Weights keep Hugging Face's names so checkpoints load as they are; q/k/v and gate/up are fused
into one matmul each at load time (fewer, larger GEMMs are what a CPU or GPU runs fastest).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Collection
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from conveyor import kernels
from conveyor.model.attention import AttentionMetadata, paged_attention


@dataclass
class ModelConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    eos_token_ids: list[int] = field(default_factory=list)
    bos_token_id: int | None = None
    architecture: str = "LlamaForCausalLM"

    @classmethod
    def from_hf(cls, cfg: dict) -> ModelConfig:
        arch = (cfg.get("architectures") or ["LlamaForCausalLM"])[0]
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ValueError(f"model architecture {arch!r} is not supported (supported: "
                             f"{', '.join(SUPPORTED_ARCHITECTURES)})")
        if cfg.get("sliding_window") and cfg.get("use_sliding_window", arch == "MistralForCausalLM"):
            if cfg["sliding_window"] < cfg.get("max_position_embeddings", 0):
                raise ValueError("model uses sliding-window attention, which is not supported")
        heads = cfg["num_attention_heads"]
        eos = cfg.get("eos_token_id")
        eos_ids = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
        attn_bias = bool(cfg.get("attention_bias", False))
        rope = cfg.get("rope_scaling") or cfg.get("rope_parameters")
        theta = cfg.get("rope_theta") or (rope or {}).get("rope_theta") or 10000.0
        return cls(
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=float(theta),
            rope_scaling=rope if rope and rope.get("rope_type", rope.get("type")) not in (None, "default")
            else None,
            max_position_embeddings=cfg.get("max_position_embeddings", 2048),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=attn_bias or arch == "Qwen2ForCausalLM",
            o_bias=attn_bias,
            mlp_bias=bool(cfg.get("mlp_bias", False)),
            eos_token_ids=eos_ids,
            bos_token_id=cfg.get("bos_token_id"),
            architecture=arch,
        )


SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")


def rope_inv_freq(cfg: ModelConfig) -> torch.Tensor:
    d = cfg.head_dim
    # float32 exactly as HF computes it, so positions map to bit-identical angles
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
    rs = cfg.rope_scaling
    if not rs:
        return inv
    kind = rs.get("rope_type", rs.get("type"))
    if kind == "linear":
        return inv / rs["factor"]
    if kind == "llama3":
        factor, low, high = rs["factor"], rs.get("low_freq_factor", 1.0), rs.get("high_freq_factor", 4.0)
        old_ctx = rs.get("original_max_position_embeddings", 8192)
        wavelen = 2 * math.pi / inv
        low_wl, high_wl = old_ctx / low, old_ctx / high
        smooth = (old_ctx / wavelen - low) / (high - low)
        scaled = torch.where(wavelen > low_wl, inv / factor, inv)
        mid = (wavelen <= low_wl) & (wavelen >= high_wl)
        return torch.where(mid, (1 - smooth) * inv / factor + smooth * inv, scaled)
    if kind == "freq_factors":  # a GGUF's rope_freqs tensor: llama.cpp divides each frequency by its factor
        factors = torch.tensor(rs["factors"], dtype=torch.float32)
        if factors.shape != inv.shape:
            raise ValueError(f"rope_freqs has {factors.numel()} factors for {inv.numel()} frequencies")
        return inv / factors
    raise ValueError(f"rope_scaling type {kind!r} is not supported")


class RMSNorm(nn.Module):
    """RMSNorm that can first add a residual: `norm(x, residual)` does residual += x (in place) and
    returns (norm(residual), residual), so each layer's two residual adds ride on its two norms."""

    fused = False  # set by the runner: use the compiled kernel (same numerics, one pass)

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if self.fused:
            return kernels.load().rms_norm(x, residual, self.weight, self.eps), residual
        if residual is not None:
            residual.add_(x)
            x = residual
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(dtype), residual


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """HF's rotate-half convention; x: [T, H, D], cos/sin: [T, D/2] fp32."""
    x1, x2 = x.float().chunk(2, dim=-1)
    cos, sin = cos[:, None, :], sin[:, None, :]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.h, self.hkv, self.d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.qkv_proj = nn.Linear(cfg.hidden_size, (self.h + 2 * self.hkv) * self.d, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(self.h * self.d, cfg.hidden_size, bias=cfg.o_bias)
        self.scale = self.d ** -0.5

    fused = False  # set by the runner: RoPE in place with the compiled kernel

    def forward(self, x, cos, sin, cache: tuple[torch.Tensor, ...], meta: AttentionMetadata) -> torch.Tensor:
        """cache: this layer's (k_cache, v_cache), or (k, v, k_scale, v_scale) for an int8 cache."""
        t = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.h * self.d, self.hkv * self.d, self.hkv * self.d], dim=-1)
        q, k, v = q.view(t, self.h, self.d), k.view(t, self.hkv, self.d), v.view(t, self.hkv, self.d)
        if self.fused:
            ops = kernels.load()
            ops.rope_(q, cos, sin)
            ops.rope_(k, cos, sin)
        else:
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        o = paged_attention(q, k, v, cache[0], cache[1], meta, self.scale, *cache[2:])
        return self.o_proj(o.reshape(t, self.h * self.d))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.inter = cfg.intermediate_size
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=cfg.mlp_bias)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=cfg.mlp_bias)

    fused = False  # set by the runner: silu(gate) * up in one compiled pass

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        if self.fused:
            return self.down_proj(kernels.load().silu_and_mul(gate_up))
        gate, up = gate_up.split(self.inter, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x, residual, cos, sin, cache, meta):
        """Returns (this layer's MLP output, the residual stream before it is added)."""
        if residual is None:
            residual = x
            x, _ = self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(x, cos, sin, cache, meta)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


# a decoder layer's linear modules, each the HF weights `linear_parts` names fused in row order
LAYER_LINEARS = ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")


def linear_parts(cfg: ModelConfig, tied: bool | None = None) -> dict[str, list[str]]:
    """Every linear module of the model (`lm_head`, `layers.{i}.self_attn.qkv_proj`, ...) and the HF weights it
    is made of, fused in row order (q/k/v, gate/up): the one statement of the fusing, for the loader and for the
    memory estimate (runner/memory.py). A tied LM head is the embedding's weight (`tied`: default from cfg)."""
    tied = cfg.tie_word_embeddings if tied is None else tied
    out = {"lm_head": ["model.embed_tokens.weight" if tied else "lm_head.weight"]}
    for i in range(cfg.num_layers):
        a, m = f"model.layers.{i}.self_attn.", f"model.layers.{i}.mlp."
        out[f"layers.{i}.self_attn.qkv_proj"] = [a + "q_proj.weight", a + "k_proj.weight", a + "v_proj.weight"]
        out[f"layers.{i}.self_attn.o_proj"] = [a + "o_proj.weight"]
        out[f"layers.{i}.mlp.gate_up_proj"] = [m + "gate_proj.weight", m + "up_proj.weight"]
        out[f"layers.{i}.mlp.down_proj"] = [m + "down_proj.weight"]
    return out


class LlamaModel(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.register_buffer("inv_freq", rope_inv_freq(cfg).float(), persistent=False)
        self.rope_cos: torch.Tensor | None = None  # [max_position_embeddings, head_dim / 2]: build_rope_table
        self.rope_sin: torch.Tensor | None = None
        # fuse_body(): (linear op, layer weights, each layer's qkv bias or none, W8A8's Hadamard block per linear)
        self.fused_body: tuple[str, list[torch.Tensor], list[torch.Tensor], list[int]] | None = None
        self.fused_max_rows: int | None = None  # larger steps run the loop (quantized layers' dense copies)

    def forward(
        self,
        input_ids: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T]
        kv_caches: list[tuple[torch.Tensor, ...]],  # per layer (k, v) or, int8, (k, v, k_scale, v_scale)
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """Hidden states [T, hidden] after the final norm; the caller picks rows to turn into logits."""
        cos, sin = self.rope_cos.index_select(0, positions), self.rope_sin.index_select(0, positions)
        x, residual = self.embed_tokens(input_ids), None
        if (self.fused_body is not None and meta.backend == "kernel" and len(kv_caches[0]) == 2
                and (self.fused_max_rows is None or input_ids.shape[0] <= self.fused_max_rows)):
            op, weights, qkv_biases, hadamard = self.fused_body
            attn = self.layers[0].self_attn
            x, residual = kernels.load().decoder_layers(
                x, None, cos, sin, weights, [c[0] for c in kv_caches], [c[1] for c in kv_caches], meta.slot_mapping,
                meta.block_tables, meta.cu_query_lens, meta.context_lens, attn.h, attn.hkv, self.cfg.rms_norm_eps,
                attn.scale, op, qkv_biases, hadamard)
            return self.norm(x, residual)[0]
        for layer, cache in zip(self.layers, kv_caches):
            x, residual = layer(x, residual, cos, sin, cache, meta)
        return self.norm(x, residual)[0]

    def fuse_body(self, on: bool = True) -> bool:
        """Run the decoder layers in one compiled call (`decoder_layers`, bindings.cpp) where every op of the
        layers has its compiled kernel: the fused RMSNorm/RoPE/SiLU, the kernel attention on a bf16/fp32
        cache, and every linear packed for one of our bf16 kernels, without bias (q/k/v's aside, below). The
        same kernels run in the same order, so outputs are bit-identical; what goes is ~20 Python-level calls
        per layer (about 4 ms of a 17 ms one-stream decode step on a 2-core Zen 3). int8 and int4 layers on our
        kernels qualify too, for the steps their dense copies (see quantization.py) do not take, GGUF block
        weights (gguf_weights.py) too, W8A8 layers on theirs (w8a8.py) for every step, and so do Qwen2's q/k/v
        biases (added by the same torch op as the loop adds them). Returns whether it is on.

        Anything else (LoRA's wrapped linears, oneDNN or torch's linears, the torch reference path, an int8 KV
        cache at call time) keeps the Python loop, which stays the reference."""
        from conveyor.model.gguf_weights import GGUFLinear
        from conveyor.model.packed_linear import _OPS, PackedLinear
        from conveyor.model.quantization import QuantizedLinear
        from conveyor.model.w8a8 import W8A8Linear

        def op_of(m: nn.Module, bias_ok: bool = False) -> tuple[str, list[torch.Tensor]] | None:
            if getattr(m, "bias", None) is not None and not bias_ok:
                return None
            if type(m) is PackedLinear and m.kernel in _OPS:
                return _OPS[m.kernel], [m.packed]
            if type(m) is QuantizedLinear and m.ours:
                return f"linear_int{m.bits}", [m.qweight, m.scales]
            if type(m) is GGUFLinear:
                return "gguf_linear", [m.packed, m.meta]
            if type(m) is W8A8Linear and m.kernel:
                return "linear_w8a8", [m.packed, m.comp, m.sw]
            return None

        self.fused_body, self.fused_max_rows = None, None
        if not on or not hasattr(kernels.load(), "decoder_layers"):
            return False
        ops, weights, limits, biases, hadamards = set(), [], [], [], set()
        for layer in self.layers:
            attn, mlp = layer.self_attn, layer.mlp
            lins = [op_of(attn.qkv_proj, bias_ok=True), *(op_of(m) for m in (attn.o_proj, mlp.gate_up_proj,
                                                                              mlp.down_proj))]
            if not (attn.fused and mlp.fused and layer.input_layernorm.fused and layer.post_attention_layernorm.fused
                    and all(lins)):
                return False
            ops.update(op for op, _ in lins)
            (_, qkv), (_, o), (_, gu), (_, down) = lins
            weights += [layer.input_layernorm.weight, *qkv, *o, layer.post_attention_layernorm.weight, *gu, *down]
            if attn.qkv_proj.bias is not None:
                biases.append(attn.qkv_proj.bias.detach())
            limits += [m.dense_above for m in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
                       if isinstance(m, QuantizedLinear) and m.dense is not None and m.dense_above is not None]
            hadamards.add(tuple(getattr(m, "hadamard", 0) for m in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj,
                                                                    mlp.down_proj)))
        if len(ops) != 1 or len(biases) not in (0, len(self.layers)) or len(hadamards) != 1:
            return False
        self.fused_body = (ops.pop(), [w.detach() for w in weights], biases, list(hadamards.pop()))
        self.fused_max_rows = min(limits, default=None)
        return True

    def build_rope_table(self) -> None:
        """cos/sin for every position, computed once (in HF's arithmetic: fp32 position x inv_freq).

        A position then gets the same bits whatever step it is in. Computed per step instead, a large
        step's `cos` is split across threads, and a split that falls mid-vector sends some elements
        down the scalar path, which may round differently: a token's numerics would depend on its batch.
        """
        n = self.cfg.max_position_embeddings
        pos = torch.arange(n, device=self.inv_freq.device, dtype=torch.float32)
        freqs = pos[:, None] * self.inv_freq[None, :]
        self.rope_cos, self.rope_sin = freqs.cos().contiguous(), freqs.sin().contiguous()

    def use_fused_ops(self, on: bool) -> None:
        """Switch RMSNorm, RoPE and SiLU-mul between the compiled kernels and the torch reference."""
        for mod in self.modules():
            if isinstance(mod, (RMSNorm, Attention, MLP)):
                mod.fused = on

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()

    def load_weights(self, names: Collection[str], read: Callable[[str], torch.Tensor],
                     make_linear: Callable[[str, list[str], list[str] | None, torch.Tensor | None], nn.Module],
                     make_embedding: Callable[[str], nn.Module | None] | None = None) -> None:
        """Take weights named as in HF's LlamaForCausalLM, one module at a time: `read(hf_name)` gives a tensor
        as it will be served (dtype, device), `make_linear(module, parts, bias_parts, weight)` builds a linear
        module from HF weights fused in row order (`linear_parts`: q/k/v and gate/up into one matmul each;
        `weight`: a tensor already read, the embedding for a tied LM head), `make_embedding(hf_name)` the
        embedding where it is served otherwise than as a float table (a GGUF's blocks; None: a table from
        `read`; a tied LM head then comes from the module's `tied_head()`). The caller decides what a linear
        becomes (plain, packed, quantized, GGUF blocks) and reads its parts itself, so no tensor is held longer
        than its own conversion. The embedding and the LM head come first: the largest tensors convert while
        little else is held."""
        names = set(names)
        used: set[str] = set()
        embed_name = "model.embed_tokens.weight"

        def get(name: str) -> nn.Parameter:
            used.add(name)
            return nn.Parameter(read(name), requires_grad=False)

        def linear(module: str, parts: list[str], weight: torch.Tensor | None = None) -> nn.Module:
            bias_parts = [p.removesuffix(".weight") + ".bias" for p in parts] if self._has_bias(module) else None
            missing = [n for n in [*parts, *(bias_parts or [])] if n not in names and weight is None]
            if missing:
                raise ValueError(f"checkpoint does not fit the model: missing {missing[:5]}")
            used.update(parts)
            used.update(bias_parts or [])
            return make_linear(module, parts, bias_parts, weight)

        if embed_name not in names:
            raise ValueError(f"checkpoint does not fit the model: missing [{embed_name!r}]")
        embedding = make_embedding(embed_name) if make_embedding is not None else None
        if embedding is not None:
            used.add(embed_name)
            self.embed_tokens = embedding
        else:
            self.embed_tokens.weight = get(embed_name)
        parts = linear_parts(self.cfg, tied=self.cfg.tie_word_embeddings or "lm_head.weight" not in names)
        if parts["lm_head"] == [embed_name]:  # tied
            self.lm_head = (embedding.tied_head() if embedding is not None
                            else linear("lm_head", [embed_name], self.embed_tokens.weight))
        else:
            self.lm_head = linear("lm_head", parts["lm_head"])
        self.norm.weight = get("model.norm.weight")
        for i, layer in enumerate(self.layers):
            p = f"model.layers.{i}."
            layer.input_layernorm.weight = get(p + "input_layernorm.weight")
            layer.post_attention_layernorm.weight = get(p + "post_attention_layernorm.weight")
            for attr in LAYER_LINEARS:
                owner, _, name = attr.rpartition(".")
                setattr(layer.get_submodule(owner), name, linear(f"layers.{i}.{attr}", parts[f"layers.{i}.{attr}"]))
        leftover = sorted(n for n in names - used if not n.endswith("rotary_emb.inv_freq"))
        if leftover:
            raise ValueError(f"checkpoint has weights this model does not use: {leftover[:5]}")

    def _has_bias(self, module: str) -> bool:
        c = self.cfg
        return (c.qkv_bias if module.endswith("qkv_proj") else c.o_bias if module.endswith("o_proj")
                else c.mlp_bias if module.endswith(("gate_up_proj", "down_proj")) else False)
