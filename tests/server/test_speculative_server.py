"""A server with ngram speculation: the same greedy answers as without it, streamed or not, and vLLM's
spec_decode_* series in /metrics."""

from __future__ import annotations

import openai

from conveyor import LLM, SamplingParams

from .conftest import MODEL, run_server, tiny_config

SPEC = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 2,
        "backoff": False}


def test_speculative_server_matches_plain_decoding(tiny_llama):
    prompt = [5, 9, 13, 21, 5, 9, 13, 21, 5, 9]
    ref = LLM(str(tiny_llama), dtype="float32", num_kv_blocks=64, max_model_len=256).generate(
        [{"prompt_token_ids": prompt}], SamplingParams(temperature=0, max_tokens=40, ignore_eos=True),
        use_tqdm=False)[0].outputs[0]
    with run_server(tiny_config(tiny_llama, speculative_config=SPEC)) as s:
        client = openai.OpenAI(base_url=s.base_url, api_key="x", max_retries=0, timeout=60)
        whole = client.completions.create(model=MODEL, prompt=prompt, max_tokens=40, temperature=0,
                                          extra_body={"ignore_eos": True})
        chunks = [c.choices[0].text for c in client.completions.create(
            model=MODEL, prompt=prompt, max_tokens=40, temperature=0, stream=True, extra_body={"ignore_eos": True})]
        assert whole.choices[0].text == "".join(chunks) == ref.text
        assert whole.usage.completion_tokens == 40
        m = s.wait_idle()
        assert m["conveyor:spec_decode_num_draft_tokens_total"] > 0
        kept = m["conveyor:spec_decode_num_accepted_tokens_total"]
        guessed = m["conveyor:spec_decode_num_draft_tokens_total"]
        assert 0 < kept <= guessed
        assert m["conveyor:spec_decode_num_accepted_tokens_per_pos_total{position=0}"] > 0
        assert m["conveyor:spec_decode_mean_acceptance_length"] > 1
