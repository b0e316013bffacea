"""Offline throughput: conveyor's LLM.generate against HF transformers' padded `generate`, same run.

    python benchmarks/offline_throughput.py --num-prompts 256 --input-len 128 --output-len 64

Both sides get the same random token prompts, greedy decoding and ignore-EOS, so they do the same
work; the ratio is what matters on a shared, noisy machine.
"""

from __future__ import annotations

import argparse
import json
import random
import time

import torch


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--num-prompts", type=int, default=256)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--hf-batch-size", type=int, default=64)
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--max-num-batched-tokens", type=int, default=8192)
    ap.add_argument("--scheduler", default="iteration")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: all cores)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    from conveyor import LLM, SamplingParams

    llm = LLM(args.model, dtype=args.dtype, max_num_seqs=args.max_num_seqs,
              max_num_batched_tokens=args.max_num_batched_tokens, scheduler=args.scheduler)
    vocab = llm.engine.model_config.vocab_size
    rng = random.Random(0)
    prompts = [[rng.randrange(100, vocab) for _ in range(args.input_len)] for _ in range(args.num_prompts)]
    params = SamplingParams(max_tokens=args.output_len, temperature=0, ignore_eos=True)

    llm.generate([{"prompt_token_ids": prompts[0]}], params, use_tqdm=False)  # warm-up
    llm.engine.reset_prefix_cache()
    t0 = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    ours = time.perf_counter() - t0
    n_out = sum(len(o.outputs[0].token_ids) for o in outs)
    result = {"conveyor_s": ours, "conveyor_out_tok_s": n_out / ours, "output_tokens": n_out,
              "dtype": str(llm.engine.info.torch_dtype), "device": llm.engine.info.device}
    print(f"conveyor: {n_out} output tokens in {ours:.1f}s = {n_out / ours:.1f} tok/s "
          f"({result['dtype']} on {result['device']})")

    if not args.skip_hf:
        hf = hf_model(args.model, llm.engine.info.torch_dtype)
        t0 = time.perf_counter()
        hf_out = 0
        for i in range(0, len(prompts), args.hf_batch_size):
            batch = torch.tensor(prompts[i:i + args.hf_batch_size])
            with torch.inference_mode():
                g = hf.generate(batch, attention_mask=torch.ones_like(batch), max_new_tokens=args.output_len,
                                min_new_tokens=args.output_len, do_sample=False, pad_token_id=0)
            hf_out += (g.shape[1] - batch.shape[1]) * batch.shape[0]
        hf_s = time.perf_counter() - t0
        result.update(hf_s=hf_s, hf_out_tok_s=hf_out / hf_s, speedup=(n_out / ours) / (hf_out / hf_s))
        print(f"HF generate (batch {args.hf_batch_size}, padded): {hf_out} tokens in {hf_s:.1f}s = "
              f"{hf_out / hf_s:.1f} tok/s; conveyor is {result['speedup']:.2f}x")
    print(json.dumps(result))


def hf_model(name: str, dtype: torch.dtype):
    """HF's own LlamaForCausalLM holding exactly the weights conveyor serves (for a GGUF: dequantized
    by conveyor's loader, since HF's GGUF path needs `accelerate`)."""
    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

    from conveyor.model.loader import load_checkpoint, resolve

    kind, path = resolve(name)
    if kind == "hf":
        return AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype).eval()
    c = load_checkpoint(name).config
    cfg = LlamaConfig(vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
                      num_hidden_layers=c.num_layers, num_attention_heads=c.num_heads,
                      num_key_value_heads=c.num_kv_heads, head_dim=c.head_dim, rms_norm_eps=c.rms_norm_eps,
                      rope_theta=c.rope_theta, max_position_embeddings=c.max_position_embeddings,
                      tie_word_embeddings=c.tie_word_embeddings)
    model = LlamaForCausalLM(cfg)
    tensors = load_checkpoint(name).tensors
    missing, unexpected = model.load_state_dict(tensors, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
    model.tie_weights()
    return model.to(dtype).eval()


if __name__ == "__main__":
    main()
