"""The parity test on the real model: SmolLM2-135M with 4 random peft adapters mixed in one batch, greedy
tokens equal to HF transformers + peft with each adapter merged into the same GGUF's weights, fp32.

HF's model gets the weights our loader dequantized (HF's own GGUF reader takes ~25 s here; that the two
readers give the same model is tests/test_smollm2.py's job)."""

from __future__ import annotations

import pytest
import torch

from conveyor import LLM, SamplingParams
from conveyor.lora import LoRARequest
from conveyor.model.loader import load_checkpoint
from tests.conftest import needs_smollm2
from tests.hf_reference import hf_greedy
from tests.lora.peft_adapters import ALL_PROJECTIONS, make_adapter

pytestmark = [needs_smollm2, pytest.mark.slow]

N_TOKENS = 5
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time,", "The three primary colors are"]


def hf_llama(ckpt):
    """HF's LlamaForCausalLM (fp32) holding a loaded checkpoint's HF-named tensors."""
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.initialization import no_init_weights

    c = ckpt.config
    cfg = LlamaConfig(vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
                      num_hidden_layers=c.num_layers, num_attention_heads=c.num_heads,
                      num_key_value_heads=c.num_kv_heads, head_dim=c.head_dim, rms_norm_eps=c.rms_norm_eps,
                      rope_theta=c.rope_theta, max_position_embeddings=c.max_position_embeddings,
                      tie_word_embeddings=c.tie_word_embeddings)
    with no_init_weights():
        model = LlamaForCausalLM(cfg)
    missing, unexpected = model.load_state_dict(ckpt.tensors, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
    if c.tie_word_embeddings:
        model.tie_weights()
    return model.float().eval()


def test_mixed_adapters_match_hf_peft_merged_on_smollm2(tmp_path):
    from peft import PeftModel

    from conveyor.model.loader import resolve

    _, gguf = resolve("smollm2-135m")
    hf = hf_llama(load_checkpoint("smollm2-135m"))
    specs = [(16, ALL_PROJECTIONS), (8, ["q_proj", "v_proj"]), (4, ["gate_proj", "up_proj", "down_proj"]),
             (16, ["k_proj", "o_proj"])]
    loras = [LoRARequest(f"a{i}", i + 1, str(make_adapter(gguf, tmp_path / f"a{i}", r, t, seed=i, scale=0.2,
                                                              base_model=hf)))
             for i, (r, t) in enumerate(specs)]
    llm = LLM("smollm2-135m", dtype="float32", num_kv_blocks=64, max_model_len=512, enable_lora=True, max_loras=4,
              max_num_batched_tokens=16)
    tok = llm.get_tokenizer()
    prompts = [tok.encode(p) for p in PROMPTS]
    per_prompt = [loras[i % 4] for i in range(len(prompts))]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0.0, max_tokens=N_TOKENS, ignore_eos=True), use_tqdm=False,
                        lora_request=per_prompt)
    params = SamplingParams(temperature=0.0, max_tokens=N_TOKENS, ignore_eos=True)
    base = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                                                         use_tqdm=False)]
    for i, lora in enumerate(loras):
        peft_model = PeftModel.from_pretrained(hf, lora.lora_path)
        peft_model.merge_adapter()  # the merge merge_and_unload does, undone below for the next adapter
        with torch.no_grad():
            for j in range(i, len(prompts), 4):
                assert outs[j].outputs[0].token_ids == hf_greedy(peft_model, prompts[j], N_TOKENS), (lora, PROMPTS[j])
        peft_model.unmerge_adapter()
        hf = peft_model.unload()
    assert any(outs[i].outputs[0].token_ids != base[i] for i in range(4))  # the adapters change the text
