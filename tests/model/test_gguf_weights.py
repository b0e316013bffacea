"""GGUF block weights served as they ship (conveyor/model/gguf_weights.py, kernels/csrc/linear_gguf.cpp).

References: gguf-py's own `gguf.quants.dequantize` (the repacked blocks must give exactly its values back),
fp32 `x @ W^T` on those values (the kernel quantizes activations to int8, so it is close, not equal), and
`emulate`, the kernel's integer arithmetic in torch (equal up to an fp32 ulp). Blocks of the legacy types
come from `gguf.quants.quantize`; gguf-py cannot make k-quants, so theirs are random bytes with sane fp16
scales, which are valid blocks (every byte pattern decodes).
"""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from conveyor.model import gguf_weights as G

pytestmark = pytest.mark.skipif(not G.kernels_available(), reason="no GGUF kernels in this build or on this CPU")

TYPES = list(G.BLOCKS)


def random_weight(qtype: str, n: int, k: int, seed: int = 0, scale: float = 0.02, centered: bool = False
                  ) -> G.GGUFWeight:
    """An n x k weight of `qtype`: quantized random floats (legacy types) or random blocks (k-quants: every
    byte random but the fp16 scales; `centered`: Q4_K/Q5_K sub-block mins half their scales, so that weights
    spread around 0 with a standard deviation near `scale`, as a model's do)."""
    import gguf

    rng = np.random.default_rng(seed)
    qk, bb = G.BLOCKS[qtype]
    if qk == 32:
        w = (rng.standard_normal((n, k)) * scale).astype(np.float32)
        raw = gguf.quants.quantize(w, gguf.GGMLQuantizationType[qtype])
        return G.GGUFWeight.from_raw(qtype, raw.reshape(n, -1), (n, k))
    blocks = n * (k // qk)
    raw = rng.integers(0, 256, size=(blocks, bb), dtype=np.uint8)
    half = lambda v: v.astype(np.float16).view(np.uint8).reshape(-1, 2)  # noqa: E731
    if qtype == "Q6_K":  # w = d sc (q - 32): |sc| ~ 64, q - 32 ~ 18
        raw[:, 208:210] = half(rng.uniform(0.5, 1.5, blocks) * scale / 1200)
    elif not centered:
        raw[:, 0:2] = half(rng.uniform(0.2, 1.0, blocks) * scale / 20)
        raw[:, 2:4] = half(rng.uniform(0.0, 1.0, blocks) * scale / 20)
    else:  # w = d sc q - dmin m with m = sc // 2 and dmin = (q's range) d: centered
        top = 15 if qtype == "Q4_K" else 31
        sc = rng.integers(16, 64, size=(blocks, 8))
        m = sc // 2
        s = raw[:, 4:16]
        s[:, 0:4] = (sc[:, :4] & 63) | ((sc[:, 4:] >> 4) << 6)
        s[:, 4:8] = (m[:, :4] & 63) | ((m[:, 4:] >> 4) << 6)
        s[:, 8:12] = (sc[:, 4:] & 15) | ((m[:, 4:] & 15) << 4)
        d = rng.uniform(0.5, 1.5, blocks) * scale / (40 * top / 3.4)
        raw[:, 0:2], raw[:, 2:4] = half(d), half(d * top)
    return G.GGUFWeight.from_raw(qtype, raw.reshape(n, -1), (n, k))


@pytest.fixture(scope="module")
def ops():
    from conveyor import kernels

    return kernels.load()


@pytest.mark.parametrize("qtype", TYPES)
def test_packing_keeps_every_byte_and_rows_dequantize_as_gguf_py(qtype, ops):
    """gguf_pack rearranges without changing a byte (unpacking gives the file's rows back), and a packed row
    dequantizes to exactly gguf-py's values (what the embedding lookup and the dequantized model use)."""
    import gguf

    n, k = 48, 512
    raw = random_weight(qtype, n, k, seed=1).raw()  # the file's bytes, made as in a file
    ty = G.GGML_TYPES[qtype]
    packed = ops.gguf_pack(ty, torch.from_numpy(raw), k)
    assert packed.numel() == raw.size and not torch.equal(packed, torch.from_numpy(raw).flatten())
    rows = torch.tensor([0, 5, 16, 47, 5])
    np.testing.assert_array_equal(ops.gguf_unpack_rows(ty, packed, n, k, rows).numpy(), raw[rows.numpy()])
    want = torch.from_numpy(gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[qtype]).reshape(n, k))
    torch.testing.assert_close(ops.gguf_dequant_rows(ty, packed, n, k, torch.arange(n)), want, atol=0, rtol=0)
    lin = G.GGUFLinear([G.GGUFWeight(qtype, packed, (n, k))], torch.float32)
    torch.testing.assert_close(lin.dequantize(), want, atol=0, rtol=0)


def test_activations_are_quantized_as_the_emulation_says(ops):
    x = torch.randn(5, 512) * torch.tensor([0.0, 1.0, 1e-3, 50.0, 1.0])[:, None]  # a zero row too
    for qk in (32, 256):
        q, d, s = ops.gguf_quantize_rows(x, qk)
        eq, ed, es = G.quantize_rows(x, qk)
        assert torch.equal(q, eq) and torch.equal(d, ed) and torch.equal(s, es)
        assert int(q.abs().max()) == 127 and not q[0].any()


@pytest.mark.parametrize("qtype", TYPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_matches_its_emulation_and_the_dequantized_weight(qtype, dtype):
    n, k, m = 64, 768 if G.BLOCKS[qtype][0] == 256 else 96, 7
    w = random_weight(qtype, n, k, seed=2)
    lin = G.GGUFLinear([w], dtype)
    x = torch.randn(m, k).to(dtype)
    y = lin(x)
    assert y.dtype == dtype and y.shape == (m, n)
    emu = G.emulate(x.float(), w)
    # the same operations in the same order: the same bits (the emulation's fp64 fma could round twice, one
    # ulp off, on some other input; not on these)
    assert torch.equal(y, emu.to(dtype))
    ref = lin.reference(x)
    err = ((emu - ref).abs().max() / ref.abs().max()).item()
    assert err < 0.03, err  # int8 activations: ~0.5% per element, averaged over K


def test_a_broken_weight_is_caught():
    """The comparison above can fail: one flipped nibble in one block changes that column's output."""
    w = random_weight("Q4_K", 16, 256, seed=3)
    raw = w.raw().copy()
    raw[3, 100] ^= 0x0F
    y = G.GGUFLinear([G.GGUFWeight.from_raw("Q4_K", raw, w.shape)], torch.float32)(torch.ones(1, 256))
    emu = G.emulate(torch.ones(1, 256), w)
    assert not torch.allclose(y[0, 3], emu[0, 3]) and torch.equal(y[0, :3], emu[0, :3])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rows_do_not_depend_on_the_rows_beside_them(dtype):
    """Batch invariance: every row alone, in every prefix and in the whole batch gives the same bits; fused parts
    of different types side by side give each part's own output."""
    k = 512
    parts = [random_weight("Q4_K", 64, k, 4), random_weight("Q6_K", 32, k, 5), random_weight("Q8_0", 48, k, 6),
             random_weight("Q5_0", 16, k, 7)]
    lin = G.GGUFLinear(parts, dtype)
    assert lin.out_features == 160 and lin.qtypes == ["Q4_K", "Q6_K", "Q8_0", "Q5_0"]
    x = torch.randn(19, k).to(dtype)
    full = lin(x)
    for r in range(19):
        assert torch.equal(lin(x[r:r + 1]), full[r:r + 1]), r
    for m in (2, 3, 4, 5, 8, 13):
        assert torch.equal(lin(x[:m]), full[:m]), m
    alone = torch.cat([G.GGUFLinear([p], dtype)(x) for p in parts], dim=1)
    assert torch.equal(alone, full)


def test_embedding_rows_are_the_dequantized_rows():
    w = random_weight("Q6_K", 64, 256, seed=8)
    emb = G.GGUFEmbedding(G.GGUFLinear([w], torch.bfloat16), torch.bfloat16)
    ids = torch.tensor([[3, 63, 0], [3, 17, 40]])
    got = emb(ids)
    assert got.shape == (2, 3, 256) and got.dtype == torch.bfloat16
    assert torch.equal(got, w.dequantize()[ids].bfloat16())


def test_bad_weights_are_refused(ops):
    w = random_weight("Q4_K", 16, 256)
    lin = G.GGUFLinear([w], torch.float32)
    with pytest.raises(RuntimeError, match="K of 256"):
        ops.gguf_linear(torch.randn(1, 250), lin.packed, lin.meta)
    with pytest.raises(RuntimeError, match="outside packed"):
        ops.gguf_linear(torch.randn(1, 256), lin.packed[:-1], lin.meta)
    with pytest.raises(RuntimeError, match="not one the kernels take"):
        ops.gguf_linear(torch.randn(1, 256), lin.packed, torch.tensor([[10, 16, 0]]))
    with pytest.raises(RuntimeError, match="out of range"):
        ops.gguf_dequant_rows(12, lin.packed, 16, 256, torch.tensor([16]))


def _T(name: str, qtype: str, shape: tuple[int, int], nbytes: int = 100):
    """A tensor of a GGUF file's header, as the loader reads it (`shape` in numpy order: rows, cols)."""
    from conveyor.model.loader import GGUFTensor

    return GGUFTensor("", name, qtype, shape, 0, nbytes)


def test_without_kernels_every_file_is_dequantized(monkeypatch):
    monkeypatch.setattr(G, "kernels_available", lambda: False)
    q4k = [_T("blk.0.attn_q.weight", "Q4_K", (32, 256), 1000)]
    assert G.keep_policy(q4k, None) == frozenset() and G.keep_policy(q4k, "gguf") == frozenset()


def test_which_files_are_kept_by_default():
    """A file that is mostly a kernel type keeps its blocks; mostly Q4_1 (the built-in model) or floats is
    dequantized as before; `gguf` keeps any kernel type, `none`/`int8`/`int4` none."""
    def file(main: str) -> list:
        return [_T("token_embd.weight", "Q8_0", (32, 256)), _T("blk.0.attn_q.weight", main, (32, 256), 1000),
                _T("blk.0.ffn_down.weight", "Q6_K", (32, 256), 500), _T("blk.0.attn_norm.weight", "F32", (256,))]

    for main in ("Q4_K", "Q5_K", "Q6_K", "Q8_0", "Q4_0", "Q5_0", "Q5_1"):
        assert G.keep_policy(file(main), None) == frozenset(G.DEFAULT_TYPES), main
    for main in ("Q4_1", "F16", "F32", "Q2_K"):
        assert G.keep_policy(file(main), None) == frozenset(), main
    assert G.keep_policy(file("Q4_1"), "gguf") == frozenset(G.GGML_TYPES)
    for q in ("none", "int8", "int4"):
        assert G.keep_policy(file("Q4_K"), q) == frozenset()
    keep = frozenset(G.GGML_TYPES)
    assert G.keepable("Q4_K", (32, 256), keep)
    assert not G.keepable("Q4_K", (24, 256), keep)  # 24 rows: not whole column groups
    assert not G.keepable("Q2_K", (32, 256), keep)
    assert not G.keepable("F32", (256,), keep)
    assert not G.keepable("Q6_K", (32, 256), frozenset({"Q4_K"}))


# --- a whole model ------------------------------------------------------------------------------------------

# a Q4_K_M-like mix: q/k/gate/up Q4_K, v and down Q6_K, o Q5_K, the embedding (and tied head) Q8_0
MIX = {"attn_q": "Q4_K", "attn_k": "Q4_K", "attn_v": "Q6_K", "attn_output": "Q5_K", "ffn_gate": "Q4_K",
       "ffn_up": "Q4_K", "ffn_down": "Q6_K", "token_embd": "Q8_0"}


@pytest.fixture(scope="module")
def kquant_gguf(tmp_path_factory):
    """A tiny tied Llama (hidden 256, so that K holds whole 256-blocks) written as GGUF in MIX's types."""
    import gguf

    from tests.conftest import build_tiny_llama
    from tests.model.test_gguf import write_llama_gguf

    d = tmp_path_factory.mktemp("kquant")
    hf = build_tiny_llama(d / "hf", seed=9, hidden_size=256, intermediate_size=512, num_attention_heads=4,
                          num_key_value_heads=2, tie_word_embeddings=True, initializer_range=0.05)

    def quantize(name: str, t: np.ndarray):
        base = name.split(".")[-2] if name.startswith("blk.") else name.split(".")[0]
        qtype = MIX.get(base)
        if qtype is None or t.ndim != 2 or t.shape[0] % 16:
            return None
        seed = abs(hash(name)) % 2**31
        w = random_weight(qtype, t.shape[0], t.shape[1], seed, scale=float(t.std()), centered=True)
        return w.raw(), gguf.GGMLQuantizationType[qtype]

    path = d / "tiny-kquant.gguf"
    write_llama_gguf(path, hf, quantize=quantize)
    return path


def test_kquant_file_is_served_as_its_blocks(kquant_gguf):
    """By default every linear runs on its blocks (mixed types fused side by side); `none` dequantizes the
    same file. The kept model's logits are the dequantized model's with each linear computed by `emulate`
    (the kernels' arithmetic), and close to the plain dequantized model's (int8 activations: a few %)."""
    from conveyor import LLM

    kept = LLM(str(kquant_gguf), dtype="float32", num_kv_blocks=32, max_model_len=256)
    dense = LLM(str(kquant_gguf), dtype="float32", num_kv_blocks=32, max_model_len=256, quantization="none")
    model = kept.engine.model
    qkv = model.layers[0].self_attn.qkv_proj
    assert isinstance(qkv, G.GGUFLinear) and qkv.qtypes == ["Q4_K", "Q4_K", "Q6_K"]
    assert isinstance(model.layers[1].self_attn.o_proj, G.GGUFLinear)
    assert isinstance(model.layers[1].mlp.down_proj, G.GGUFLinear)
    vocab = model.cfg.vocab_size
    if vocab % 16 == 0:  # the tied head reads the embedding's blocks
        assert isinstance(model.embed_tokens, G.GGUFEmbedding) and model.lm_head is model.embed_tokens.table
    assert kept.engine.info.weight_dtype == "gguf" and kept.engine.info.batch_invariant
    assert not isinstance(dense.engine.model.layers[0].self_attn.qkv_proj, G.GGUFLinear)
    rng = random.Random(0)
    ids = [rng.randrange(vocab) for _ in range(60)]
    a, b = dense.engine.prompt_logits(ids), kept.engine.prompt_logits(ids)
    err = ((a - b).abs().max() / a.abs().max()).item()
    assert err < 0.06, err  # measured 3.4%: int8 activations, compounded over the layers of a random model
    assert (a.argmax(-1) == b.argmax(-1)).float().mean() > 0.75  # measured 0.85: near-ties of a random model

    def emulated(mod: G.GGUFLinear):
        ws = mod.weights()
        return lambda x: torch.cat([G.emulate(x.reshape(-1, x.shape[-1]), w) for w in ws], 1).view(
            *x.shape[:-1], mod.out_features).to(x.dtype)

    for name, mod in model.named_modules(remove_duplicate=False):
        if isinstance(mod, G.GGUFLinear) and not name.endswith(".table"):  # the embedding's own: its head's
            dense.engine.model.get_submodule(name).forward = emulated(mod)
    c = dense.engine.prompt_logits(ids)
    assert ((c - b).abs().max() / c.abs().max()).item() < 1e-4  # fp32 sums in another order elsewhere


def test_kquant_greedy_is_batch_invariant(kquant_gguf):
    from conveyor import LLM, SamplingParams

    llm = LLM(str(kquant_gguf), dtype="bfloat16", num_kv_blocks=64, max_model_len=256)
    vocab = llm.engine.model_config.vocab_size
    rng = random.Random(1)
    prompts = [[rng.randrange(vocab) for _ in range(n)] for n in (5, 17, 33, 9)]
    sp = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    together = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], sp,
                                                             use_tqdm=False)]
    alone = [llm.generate([{"prompt_token_ids": p}], sp, use_tqdm=False)[0].outputs[0].token_ids for p in prompts]
    assert together == alone


def test_decoder_layers_in_one_call_give_the_loops_bits(kquant_gguf):
    """GGUF linears qualify for the compiled decoder body (`LlamaModel.fuse_body`): the same kernels in the same
    order, so the logits are the Python loop's, bit for bit."""
    from conveyor import LLM

    llm = LLM(str(kquant_gguf), dtype="bfloat16", num_kv_blocks=32, max_model_len=256)
    model = llm.engine.model
    assert model.fused_body is not None and model.fused_body[0] == "gguf_linear"
    ids = list(range(3, 40))
    fused = llm.engine.prompt_logits(ids)
    assert not model.fuse_body(False)
    loop = llm.engine.prompt_logits(ids)
    assert torch.equal(fused, loop)


def mapped_kib(path) -> int:
    """Resident KiB of this process's mappings of `path` (/proc/self/smaps)."""
    total, inside = 0, False
    with open("/proc/self/smaps") as f:
        for line in f:
            if line[0] in "0123456789abcdef" and "-" in line.split()[0]:
                inside = line.rstrip().endswith(str(path))
            elif inside and line.startswith("Rss:"):
                total += int(line.split()[1])
    return total


def test_a_kept_tensor_is_packed_from_the_mapped_file_and_lets_it_go(kquant_gguf):
    """The loader's per-tensor hook packs a kept tensor from a mapping of the file (its pages resident while it
    packs, no copy read first) and lets the mapping go (none of the file resident after); the weight is the
    file's rows, q/k rows put back in HF's order."""
    from conveyor.model.loader import GGUFSource, keep_gguf_tensor, unpermute

    path = kquant_gguf.resolve()
    source = GGUFSource(kquant_gguf)
    types = source.keep_types(None)
    assert types == frozenset(G.DEFAULT_TYPES)
    t = source.tensors["model.layers.1.mlp.up_proj.weight"]  # 512 x 256 Q4_K: 72 KiB
    want = t.raw()
    inside = []
    assert t.convert_mapped(lambda view: inside.append(mapped_kib(path)) or view.copy()).shape == want.shape
    assert inside[0] >= t.n_bytes // 1024 - 4 and mapped_kib(path) == 0, (inside, mapped_kib(path))
    w = keep_gguf_tensor(t, None, types)
    assert w.qtype == "Q4_K" and w.shape == (512, 256) and mapped_kib(path) == 0
    np.testing.assert_array_equal(w.raw(), want)
    q = source.tensors["model.layers.0.self_attn.q_proj.weight"]
    assert q.heads == 4
    np.testing.assert_array_equal(keep_gguf_tensor(q, None, types).raw(), unpermute(q.raw(), 4))
    assert keep_gguf_tensor(t, None, frozenset({"Q6_K"})) is None
    assert keep_gguf_tensor(t, "none", source.keep_types("none")) is None


def test_kept_blocks_are_counted_at_their_size(kquant_gguf, monkeypatch):
    """The memory check counts kept blocks at their size (runner/memory.py): its estimate is what the runner
    holds, for the blocks kept and for the same file dequantized."""
    from conveyor import LLM
    from conveyor.model.loader import GGUFSource
    from conveyor.model.packed_linear import packing_available
    from conveyor.runner.memory import estimate_weight_bytes

    monkeypatch.setenv("CONVEYOR_QUANT_DENSE_ABOVE", "none")
    source = GGUFSource(kquant_gguf)
    packed = packing_available(torch.device("cpu"), torch.bfloat16)
    for q in (None, "none"):
        blocks = source.kept_blocks(q)
        assert bool(blocks) == (q is None)
        held = LLM(str(kquant_gguf), dtype="bfloat16", num_kv_blocks=8, max_model_len=64,
                   quantization=q).engine.info.weight_bytes
        est = estimate_weight_bytes(source.config, 2, None, packed, blocks)
        assert abs(est - held) <= 0.01 * held, (q, est, held)
    assert estimate_weight_bytes(source.config, 2, None, packed, source.kept_blocks(None)) < 0.5 * est
