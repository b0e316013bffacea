"""GGUF loading: a tiny llama.cpp-style file written here loads to exactly HF's model.

The file is written the way llama.cpp's convert_hf_to_gguf.py writes a Llama: F32 tensors under
llama.cpp names, q/k rows permuted for llama.cpp's RoPE layout, llama.* metadata and a gpt2-style
BPE vocabulary. HF transformers reading the same file back is a cross-check that the file is
conformant, so a mismatch points at our loader, not at the writer.
"""

from __future__ import annotations

import json
import math
import random

import numpy as np
import pytest
import torch

from conveyor import LLM, SamplingParams
from tests.hf_reference import hf_greedy, hf_model_from_gguf

N_NEW = 12


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.permute: HF's rotate-half rows -> llama.cpp's interleaved."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def llama3_rope_factors(cfg: dict) -> np.ndarray:
    """convert_hf_to_gguf.py's rope_freqs for llama3 RoPE scaling: each frequency's divisor."""
    rope = cfg["rope_parameters"]
    dim = cfg["hidden_size"] // cfg["num_attention_heads"]
    freqs = 1.0 / (rope["rope_theta"] ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    factor, low, high = rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"]
    old = rope["original_max_position_embeddings"]
    out = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < old / high:
            out.append(1)
        elif wavelen > old / low:
            out.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return torch.tensor(out, dtype=torch.float32).numpy()


def write_llama_gguf(path, hf_dir, arch: str = "llama", qtype: str | None = None, rope_freqs: bool = True,
                     quantize=None) -> None:
    """Write the HF checkpoint in `hf_dir` as an F32 GGUF with its tokenizer and chat template
    (`qtype`, e.g. "Q4_1": the layers' linear weights and the embedding quantized as llama.cpp would;
    llama3 RoPE scaling as a rope_freqs tensor, as llama.cpp's converter writes it, unless `rope_freqs` is off;
    `quantize(name, array)`: a tensor's (blocks, GGMLQuantizationType) to write instead, or None for F32)."""
    import gguf
    from safetensors.torch import load_file

    cfg = json.loads((hf_dir / "config.json").read_text())
    tok = json.loads((hf_dir / "tokenizer.json").read_text())
    tok_cfg = json.loads((hf_dir / "tokenizer_config.json").read_text())
    sd = {k: v.float().numpy() for k, v in load_file(str(hf_dir / "model.safetensors")).items()}
    heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]

    w = gguf.GGUFWriter(str(path), arch)
    w.add_name("tiny-test-llama")
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_rope_freq_base(cfg["rope_parameters"]["rope_theta"])
    w.add_rope_dimension_count(cfg["hidden_size"] // heads)
    w.add_file_type(gguf.LlamaFileType.ALL_F32)

    vocab = tok["model"]["vocab"]
    tokens = [None] * len(vocab)
    for t, i in vocab.items():
        tokens[i] = t
    specials = {a["id"]: a["content"] for a in tok["added_tokens"]}
    for i, t in specials.items():
        tokens[i] = t
    assert all(t is not None for t in tokens)
    merges = [m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_merges(merges)
    w.add_token_types([gguf.TokenType.CONTROL if i in specials else gguf.TokenType.NORMAL
                       for i in range(len(tokens))])
    w.add_bos_token_id(cfg["bos_token_id"])
    w.add_eos_token_id(cfg["eos_token_id"])
    w.add_pad_token_id(vocab.get("<|endoftext|>", 0))
    w.add_chat_template(tok_cfg.get("chat_template") or (hf_dir / "chat_template.jinja").read_text())

    names = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
             "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
             "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm"}
    def add(name: str, t: np.ndarray) -> None:
        q = quantize(name, t) if quantize is not None else None
        if q is not None:
            w.add_tensor(name, q[0], raw_dtype=q[1])
        else:
            w.add_tensor(name, t)

    if rope_freqs and (cfg.get("rope_parameters") or {}).get("rope_type") == "llama3":
        w.add_tensor("rope_freqs.weight", llama3_rope_factors(cfg))
    add("token_embd.weight", sd.pop("model.embed_tokens.weight"))
    w.add_tensor("output_norm.weight", sd.pop("model.norm.weight"))
    if "lm_head.weight" in sd:
        add("output.weight", sd.pop("lm_head.weight"))
    for i in range(cfg["num_hidden_layers"]):
        for hf_name, cpp_name in names.items():
            t = sd.pop(f"model.layers.{i}.{hf_name}.weight")
            if cpp_name == "attn_q":
                t = llama_cpp_permute(t, heads)
            elif cpp_name == "attn_k":
                t = llama_cpp_permute(t, kv_heads)
            t = np.ascontiguousarray(t)
            if qtype is not None and t.ndim == 2:
                gt = getattr(gguf.GGMLQuantizationType, qtype)
                w.add_tensor(f"blk.{i}.{cpp_name}.weight", gguf.quants.quantize(t, gt), raw_dtype=gt)
            else:
                add(f"blk.{i}.{cpp_name}.weight", t)
    assert not sd, f"tensors left unwritten: {list(sd)}"
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.fixture(autouse=True)
def private_cache(tmp_path, monkeypatch):
    """Each test dequantizes and converts the tokenizer itself instead of finding another run's cache."""
    monkeypatch.setenv("CONVEYOR_CACHE", str(tmp_path / "conveyor-cache"))


@pytest.fixture(scope="module")
def tiny_gguf(tiny_llama, tmp_path_factory):
    path = tmp_path_factory.mktemp("gguf") / "tiny-llama-f32.gguf"
    write_llama_gguf(path, tiny_llama)
    return path


def prompts(vocab: int) -> list[list[int]]:
    rng = random.Random(3)
    return [[rng.randrange(vocab) for _ in range(n)] for n in (3, 11, 40, 97)]


def test_permutation_roundtrip_is_not_identity():
    """Guard for the test itself: the permutation must move rows, and the loader must undo it."""
    from conveyor.model.loader import unpermute

    w = np.arange(8 * 16 * 3, dtype=np.float32).reshape(8 * 16, 3)
    p = llama_cpp_permute(w, 8)
    assert not np.array_equal(p, w)
    np.testing.assert_array_equal(unpermute(p, 8), w)


def test_gguf_greedy_matches_hf(tiny_gguf, hf_tiny):
    llm = LLM(str(tiny_gguf), dtype="float32", num_kv_blocks=32, max_model_len=256)
    cfg = llm.engine.model_config
    assert (cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.hidden_size) == (2, 4, 2, 64)
    assert not cfg.tie_word_embeddings
    assert cfg.eos_token_ids == [hf_tiny.config.eos_token_id]
    ps = prompts(hf_tiny.config.vocab_size)
    outs = llm.generate([{"prompt_token_ids": p} for p in ps],
                        SamplingParams(temperature=0, max_tokens=N_NEW, ignore_eos=True), use_tqdm=False)
    for p, o in zip(ps, outs):
        assert o.outputs[0].token_ids == hf_greedy(hf_tiny, p, N_NEW)


def test_gguf_file_is_what_hf_reads_too(tiny_gguf, hf_tiny):
    """HF transformers, reading our file with its own llama.cpp conventions, gets the same weights back."""
    hf_from_gguf = hf_model_from_gguf(tiny_gguf)
    want = hf_tiny.state_dict()
    got = hf_from_gguf.state_dict()
    for name in ("model.layers.0.self_attn.q_proj.weight", "model.layers.1.self_attn.k_proj.weight",
                 "lm_head.weight"):
        torch.testing.assert_close(got[name], want[name], atol=0, rtol=0)


def test_gguf_tokenizer_and_chat_template(tiny_gguf, tiny_llama):
    """The vocabulary inside the GGUF tokenizes and renders chats like the original tokenizer."""
    from transformers import AutoTokenizer

    llm = LLM(str(tiny_gguf), dtype="float32", num_kv_blocks=32, max_model_len=256)
    ref = AutoTokenizer.from_pretrained(str(tiny_llama))
    tok = llm.get_tokenizer()
    for text in ("The quick brown fox jumps over the lazy dog.", "Hello world! café 🎉 日本語"):
        assert tok.encode(text, add_special_tokens=False) == ref.encode(text, add_special_tokens=False)
    msgs = [{"role": "user", "content": "Hello world!"}]
    want = ref.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
    want = list(want["input_ids"] if hasattr(want, "keys") else want)
    assert llm.apply_chat_template(msgs) == want
    assert tok.eos_token_id == ref.eos_token_id
    out = llm.chat(msgs, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 8


def test_gguf_with_separate_tokenizer(tiny_gguf, tiny_llama, hf_tiny):
    llm = LLM(str(tiny_gguf), tokenizer=str(tiny_llama), dtype="float32", num_kv_blocks=32, max_model_len=256)
    out = llm.generate("The quick brown fox", SamplingParams(temperature=0, max_tokens=N_NEW, ignore_eos=True),
                       use_tqdm=False)[0]
    assert out.outputs[0].token_ids == hf_greedy(hf_tiny, out.prompt_token_ids, N_NEW)


def test_gguf_directory_and_no_weight_cache(tiny_gguf, tmp_path):
    """A directory holding one .gguf resolves to it; no dequantized copy of the weights is written to disk (an
    8B file's would be 32 GB of fp32): a second load converts the file again, to the same model."""
    first = LLM(str(tiny_gguf.parent), dtype="float32", num_kv_blocks=16, max_model_len=128)
    assert not list((tmp_path / "conveyor-cache").rglob("*.safetensors"))
    second = LLM(str(tiny_gguf), dtype="float32", num_kv_blocks=16, max_model_len=128)
    assert vars(second.engine.model_config) == vars(first.engine.model_config)
    sp = SamplingParams(temperature=0, max_tokens=N_NEW, ignore_eos=True)
    a = first.generate([[5, 6, 7, 8]], sp, use_tqdm=False)[0].outputs[0].token_ids
    b = second.generate([[5, 6, 7, 8]], sp, use_tqdm=False)[0].outputs[0].token_ids
    assert a == b


def test_tied_gguf_without_output_tensor(tmp_path_factory):
    """No `output.weight` in the file means the head is the embedding (llama.cpp's convention)."""
    from transformers import AutoModelForCausalLM

    from tests.conftest import build_tiny_llama

    hf_dir = build_tiny_llama(tmp_path_factory.mktemp("tied"), seed=5, tie_word_embeddings=True)
    path = hf_dir / "tied.gguf"
    write_llama_gguf(path, hf_dir)
    hf = AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32).eval()
    llm = LLM(str(path), dtype="float32", num_kv_blocks=16, max_model_len=128)
    assert llm.engine.model_config.tie_word_embeddings
    p = prompts(hf.config.vocab_size)[2]
    got = llm.generate([p], SamplingParams(temperature=0, max_tokens=N_NEW, ignore_eos=True), use_tqdm=False)
    assert got[0].outputs[0].token_ids == hf_greedy(hf, p, N_NEW)


def test_gguf_llama3_rope_scaling(tmp_path_factory):
    """Llama 3.x's RoPE scaling reaches a GGUF as per-frequency factors (rope_freqs): served as HF serves the
    config's llama3 scaling. Without them (the loader used to drop the tensor) the same file's logits differ."""
    from transformers import AutoModelForCausalLM

    from tests.conftest import build_tiny_llama

    rope = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
    hf_dir = build_tiny_llama(tmp_path_factory.mktemp("llama3-rope"), seed=7, rope_parameters=rope)
    hf = AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32).eval()
    logits = {}
    for with_factors in (True, False):
        path = hf_dir / f"rope-{with_factors}.gguf"
        write_llama_gguf(path, hf_dir, rope_freqs=with_factors)
        llm = LLM(str(path), dtype="float32", num_kv_blocks=32, max_model_len=256)
        ids = prompts(hf.config.vocab_size)[3]
        logits[with_factors] = prompt_logits(llm, ids)
        if with_factors:
            assert llm.engine.model_config.rope_scaling["rope_type"] == "freq_factors"
            got = llm.generate([ids], SamplingParams(temperature=0, max_tokens=N_NEW, ignore_eos=True), use_tqdm=False)
            assert got[0].outputs[0].token_ids == hf_greedy(hf, ids, N_NEW)
    with torch.inference_mode():
        want = hf(torch.tensor([ids])).logits[0].float()
    scale = want.abs().max().item()
    assert (logits[True] - want).abs().max().item() < 1e-4 * scale
    assert (logits[False] - want).abs().max().item() > 1e-2 * scale


def test_unsupported_gguf_architecture_is_named(tmp_path):
    import gguf

    path = tmp_path / "gpt2.gguf"
    w = gguf.GGUFWriter(str(path), "gpt2")
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.zeros((8, 4), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ValueError, match="gpt2"):
        LLM(str(path), dtype="float32", num_kv_blocks=4)


@torch.inference_mode()
def prompt_logits(llm, ids: list[int]) -> torch.Tensor:
    """Logits of every position of one prompt, straight through the engine's model and KV cache."""
    return llm.engine.prompt_logits(ids)


@pytest.mark.parametrize("qtype,method", [("Q4_0", "int4"), ("Q4_1", "int4"), ("Q8_0", "int8")])
def test_gguf_kept_quantized_matches_dequantized(qtype, method, tiny_llama, tmp_path_factory):
    """A quantized GGUF served with --quantization gives the dequantized model's logits within tolerance;
    Q4 blocks are used as shipped (their values exactly), Q8_0 is requantized per channel."""
    from conveyor.model.quantization import QuantizedLinear

    path = tmp_path_factory.mktemp("gguf-q") / f"tiny-{qtype}.gguf"
    write_llama_gguf(path, tiny_llama, qtype=qtype)
    dense = LLM(str(path), dtype="float32", num_kv_blocks=32, max_model_len=256, quantization="none")
    quant = LLM(str(path), dtype="float32", num_kv_blocks=32, max_model_len=256, quantization=method)
    qkv = quant.engine.model.layers[0].self_attn.qkv_proj
    assert isinstance(qkv, QuantizedLinear) and qkv.bits == (4 if method == "int4" else 8)
    if method == "int4":  # the file's own blocks: the same weight as the dequantized file, value for value
        from conveyor.model.loader import load_checkpoint

        t = load_checkpoint(str(path)).tensors
        want = torch.cat([t[f"model.layers.0.self_attn.{p}_proj.weight"] for p in "qkv"])
        torch.testing.assert_close(qkv.reference_weight.dequantize(), want, atol=0, rtol=0)
    ids = prompts(dense.engine.model_config.vocab_size)[2]
    a, b = prompt_logits(dense, ids), prompt_logits(quant, ids)
    # int4: the layers are exact, the LM head is int8 of an F32 tensor (measured 0.7-0.8%);
    # int8: every weight requantized per channel (measured 5.2% of the largest logit on this random model)
    err = (a - b).abs().max().item() / a.abs().max().item()
    assert err < (0.02 if method == "int4" else 0.1), err
    assert (a.argmax(-1) == b.argmax(-1)).float().mean() > 0.8
