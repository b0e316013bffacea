"""/v1/embeddings with the official client, checked against Hugging Face's forward pass on the same weights.

The shared server pools the last token (the default for a causal LM); a second server pools the mean
with a small token budget (so long inputs are chunked) and the prefix cache on, which mean pooling must
not take blocks from.
"""

from __future__ import annotations

import base64

import httpx
import numpy as np
import openai
import pytest
import torch

from conveyor.server.api_server import ServerArgs

from .conftest import API_KEY, MAX_MODEL_LEN, MODEL, run_server, tiny_config

WORDS = "the quick brown fox jumps over the lazy dog paris is the capital of france hello world".split()
TEXTS = [" ".join(WORDS[(i * 7) % len(WORDS):] + WORDS[:(i * 3) % len(WORDS)]) * (1 + i % 5) for i in range(64)]


@pytest.fixture(scope="module")
def tok(tiny_llama):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tiny_llama))


def hf_embed(hf_tiny, ids: list[int], method: str, dims: int | None = None) -> np.ndarray:
    with torch.no_grad():
        h = hf_tiny.model(torch.tensor([ids])).last_hidden_state[0].float()
    v = h[-1] if method == "last" else h.mean(0)
    if dims is not None:
        v = v[:dims]
    return (v / v.norm()).numpy()


def _close(got, want) -> None:
    np.testing.assert_allclose(np.asarray(got, dtype=np.float64), want, atol=1e-3, rtol=0)


def test_single_string_list_of_64_and_token_ids_equal_hf(client, server, hf_tiny, tok):
    before = server.scrape()
    r = client.embeddings.create(model=MODEL, input=TEXTS[5], encoding_format="float")
    assert len(r.data) == 1 and r.data[0].index == 0 and r.model == MODEL
    ids5 = tok.encode(TEXTS[5])
    _close(r.data[0].embedding, hf_embed(hf_tiny, ids5, "last"))
    assert r.usage.prompt_tokens == len(ids5) == r.usage.total_tokens

    r = client.embeddings.create(model=MODEL, input=TEXTS, encoding_format="float")
    lens = {len(tok.encode(t)) for t in TEXTS}
    assert len(lens) > 20  # different lengths
    assert [d.index for d in r.data] == list(range(64))
    for t, d in zip(TEXTS, r.data):
        _close(d.embedding, hf_embed(hf_tiny, tok.encode(t), "last"))
    assert r.usage.prompt_tokens == sum(len(tok.encode(t)) for t in TEXTS)

    ids = [[5, 6, 7, 8, 9], list(range(20, 90))]
    r = client.embeddings.create(model=MODEL, input=ids, encoding_format="float")
    for x, d in zip(ids, r.data):
        _close(d.embedding, hf_embed(hf_tiny, x, "last"))
    r = client.embeddings.create(model=MODEL, input=ids[1], encoding_format="float")  # one list of ids
    _close(r.data[0].embedding, hf_embed(hf_tiny, ids[1], "last"))
    m = server.wait_idle()
    assert m["conveyor:embedding_requests_total"] - before["conveyor:embedding_requests_total"] == 4
    assert m["conveyor:embedding_inputs_total"] - before["conveyor:embedding_inputs_total"] == 68


def test_base64_and_dimensions(client, server, hf_tiny, tok):
    floats = client.embeddings.create(model=MODEL, input=TEXTS[:3], encoding_format="float")
    raw = httpx.post(server.base_url + "/embeddings", headers=server.headers(),
                     json={"model": MODEL, "input": TEXTS[:3], "encoding_format": "base64"}).json()
    for f, b in zip(floats.data, raw["data"]):
        assert isinstance(b["embedding"], str)
        np.testing.assert_array_equal(np.frombuffer(base64.b64decode(b["embedding"]), dtype="<f4"),
                                      np.asarray(f.embedding, dtype=np.float32))
    # the openai client asks for base64 by default and decodes it itself
    default = client.embeddings.create(model=MODEL, input=TEXTS[:3])
    for f, d in zip(floats.data, default.data):
        np.testing.assert_array_equal(np.asarray(d.embedding, np.float32), np.asarray(f.embedding, np.float32))
    r = client.embeddings.create(model=MODEL, input=TEXTS[0], dimensions=16, encoding_format="float")
    assert len(r.data[0].embedding) == 16
    _close(r.data[0].embedding, hf_embed(hf_tiny, tok.encode(TEXTS[0]), "last", dims=16))
    assert abs(np.linalg.norm(r.data[0].embedding) - 1) < 1e-5


@pytest.mark.parametrize("body,param", [
    ({"input": ""}, "input"),
    ({"input": []}, "input"),
    ({"input": ["ok", ""]}, "input"),
    ({"input": [[]]}, "input"),
    ({"input": list(range(1, MAX_MODEL_LEN + 5))}, "input"),
    ({"input": "fox " * (4 * MAX_MODEL_LEN)}, "input"),
    ({"input": [10**6]}, "input"),
    ({"input": "hi", "dimensions": 65}, "dimensions"),
    ({"input": "hi", "dimensions": 0}, "dimensions"),
    ({"input": "hi", "encoding_format": "int8"}, "encoding_format"),
    ({"input": 5}, "input"),
])
def test_bad_embedding_input_is_a_400_and_the_server_goes_on(client, server, body, param):
    r = httpx.post(server.base_url + "/embeddings", headers=server.headers(), json={"model": MODEL, **body})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["param"] == param, err
    assert len(client.embeddings.create(model=MODEL, input="still here").data) == 1
    assert server.wait_idle()["conveyor:kv_cache_blocks_used"] == 0


@pytest.fixture(scope="module")
def mean_server(tiny_llama):
    cfg = tiny_config(tiny_llama, max_num_batched_tokens=48, enable_prefix_caching=True)
    with run_server(cfg, ServerArgs(api_key=API_KEY, pooling="mean")) as s:
        yield s


def test_mean_pooling_chunked_and_never_from_the_prefix_cache(mean_server, hf_tiny, tok):
    """Mean pooling needs every token's hidden state: inputs longer than the 48-token budget are computed in
    chunks, and an input whose prefix is already cached (the same text sent again, and a longer text
    sharing it) is still computed whole, so each equals HF's mean."""
    with openai.OpenAI(base_url=mean_server.base_url, api_key=API_KEY, max_retries=0, timeout=60) as c:
        long = TEXTS[9] + " " + TEXTS[12]
        texts = [TEXTS[9], long, TEXTS[9], long + " more", "short"]
        assert len(tok.encode(long)) > 100
        for _ in range(2):  # the second round finds every block of the first in the cache
            r = c.embeddings.create(model=MODEL, input=texts, encoding_format="float")
            for t, d in zip(texts, r.data):
                _close(d.embedding, hf_embed(hf_tiny, tok.encode(t), "mean"))
        assert mean_server.wait_idle()["conveyor:prefix_cache_hits_total"] == 0
        # the blocks were cached all along (a completion of the same text takes them): embeddings declined them
        c.completions.create(model=MODEL, prompt=long, max_tokens=1)
        assert mean_server.wait_idle()["conveyor:prefix_cache_hits_total"] > 0
