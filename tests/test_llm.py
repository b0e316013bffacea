"""The offline `LLM` API (vLLM's shape) and the errors it gives for bad input."""

from __future__ import annotations

import pytest

from conveyor import LLM, SamplingParams
from conveyor.config import EngineConfig
from tests.conftest import record_steps

MAX_LEN = 128


@pytest.fixture(scope="module")
def llm(tiny_llama) -> LLM:
    return LLM(str(tiny_llama), dtype="float32", num_kv_blocks=64, max_model_len=MAX_LEN)


def greedy(n: int, **kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, **kw)


# --- shapes of input and output ---------------------------------------------------------------------

def test_results_come_back_in_input_order(llm):
    prompts = ["The quick brown fox jumps over the lazy dog. " * 3, "Hi", "Paris is the capital of France.",
               "def f(x):", "Hello world! How are you today?"]
    lengths = [3, 17, 1, 9, 5]  # they finish in an order unrelated to the input order
    outs = llm.generate(prompts, [greedy(n) for n in lengths], use_tqdm=False)
    assert [o.prompt for o in outs] == prompts
    assert [len(o.outputs[0].token_ids) for o in outs] == lengths
    tok = llm.get_tokenizer()
    for p, o in zip(prompts, outs):
        assert o.prompt_token_ids == tok.encode(p)
        assert o.finished and o.outputs[0].finish_reason == "length"
        assert o.metrics is not None and o.metrics.first_token_time is not None
    assert len({o.request_id for o in outs}) == len(outs)
    # each result is the same as running that prompt alone
    alone = llm.generate(prompts[3], greedy(9), use_tqdm=False)
    assert alone[0].outputs[0].token_ids == outs[3].outputs[0].token_ids


def test_prompt_forms(llm):
    ids = [5, 17, 42, 99, 7]
    from_dict = llm.generate([{"prompt_token_ids": ids}], greedy(4), use_tqdm=False)
    assert len(from_dict) == 1
    assert from_dict[0].prompt_token_ids == ids and from_dict[0].prompt is None
    from_list = llm.generate(ids, greedy(4), use_tqdm=False)  # one prompt given as token ids
    assert len(from_list) == 1 and from_list[0].prompt_token_ids == ids
    assert from_list[0].outputs[0].token_ids == from_dict[0].outputs[0].token_ids
    text = llm.generate("Hello world", greedy(4), use_tqdm=False)
    assert len(text) == 1 and text[0].prompt == "Hello world"
    via_dict = llm.generate({"prompt": "Hello world"}, greedy(4), use_tqdm=False)
    assert via_dict[0].outputs[0].token_ids == text[0].outputs[0].token_ids
    assert text[0].prompt_token_ids == llm.get_tokenizer().encode("Hello world")


def test_chat_single_and_batch(llm):
    conv = [{"role": "user", "content": "What is the capital of France?"}]
    one = llm.chat(conv, greedy(5), use_tqdm=False)
    assert len(one) == 1
    tok = llm.get_tokenizer()
    want = tok.apply_chat_template(conv, add_generation_prompt=True, tokenize=True)
    want = list(want["input_ids"] if hasattr(want, "keys") else want)
    assert one[0].prompt_token_ids == want
    assert tok.decode(want).endswith("<|im_start|>assistant\n")
    conv2 = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello world!"}]
    two = llm.chat([conv, conv2], greedy(5), use_tqdm=False)
    assert len(two) == 2
    assert two[0].outputs[0].token_ids == one[0].outputs[0].token_ids
    assert two[1].prompt_token_ids != two[0].prompt_token_ids
    assert "Be brief." in tok.decode(two[1].prompt_token_ids)


def test_finish_reasons(llm):
    out = llm.generate("Hello", greedy(6), use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "length" and out.stop_reason is None and len(out.token_ids) == 6
    # a stop token that is sure to come: the first greedy token itself
    stop = llm.generate("Hello", greedy(6, stop_token_ids=[out.token_ids[0]]), use_tqdm=False)[0].outputs[0]
    assert stop.finish_reason == "stop" and stop.stop_reason == out.token_ids[0] and len(stop.token_ids) == 1
    # running into max_model_len ends with "length" even though max_tokens is larger
    ids = list(range(3, 3 + MAX_LEN - 4))
    capped = llm.generate([ids], greedy(50), use_tqdm=False)[0].outputs[0]
    assert capped.finish_reason == "length" and len(ids) + len(capped.token_ids) == MAX_LEN
    # max_tokens=None means "until the context is full"
    unbounded = llm.generate([ids], SamplingParams(temperature=0, max_tokens=None, ignore_eos=True),
                             use_tqdm=False)[0].outputs[0]
    assert unbounded.token_ids == capped.token_ids


def test_n_and_list_of_params(llm):
    outs = llm.generate(["a b c", "Hello"], [SamplingParams(n=3, temperature=1.0, seed=1, max_tokens=4),
                                              greedy(2)], use_tqdm=False)
    assert [len(o.outputs) for o in outs] == [3, 1]
    assert [c.index for c in outs[0].outputs] == [0, 1, 2]
    with pytest.raises(ValueError, match="sampling_params"):
        llm.generate(["a", "b"], [greedy(2)], use_tqdm=False)


def test_progress_bar_path(llm):
    outs = llm.generate(["Hello", "world"], greedy(3), use_tqdm=True)
    assert all(len(o.outputs[0].token_ids) == 3 for o in outs)


def test_engine_is_empty_after_generate(llm):
    llm.generate(["one", "two", "three"], greedy(4), use_tqdm=False)
    eng = llm.engine
    assert not eng.has_unfinished_requests()
    assert eng.snapshot().kv_blocks_used == 0


# --- validation ---------------------------------------------------------------------------------------

def test_empty_prompt(llm):
    with pytest.raises(ValueError, match="prompt"):
        llm.generate("", greedy(2), use_tqdm=False)
    with pytest.raises(ValueError, match="prompt"):
        llm.generate([{"prompt_token_ids": []}], greedy(2), use_tqdm=False)
    with pytest.raises(ValueError, match="messages"):
        llm.chat([[]], greedy(2), use_tqdm=False)  # a batch holding one empty conversation


def test_prompt_longer_than_max_model_len(llm):
    with pytest.raises(ValueError, match="max_model_len"):
        llm.generate([list(range(3, 3 + MAX_LEN + 5))], greedy(2), use_tqdm=False)
    with pytest.raises(ValueError, match="max_model_len"):
        llm.generate([list(range(3, 3 + MAX_LEN))], greedy(2), use_tqdm=False)  # no room for one token


def test_bad_token_ids(llm):
    vocab = llm.engine.model_config.vocab_size
    with pytest.raises(ValueError, match="token ids"):
        llm.generate([[1, 2, vocab]], greedy(2), use_tqdm=False)
    with pytest.raises(ValueError, match="token ids"):
        llm.generate([[1, -1]], greedy(2), use_tqdm=False)


def test_a_bad_prompt_queues_nothing(llm):
    with pytest.raises(ValueError):
        llm.generate(["fine", ""], greedy(2), use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()
    assert llm.generate("fine", greedy(2), use_tqdm=False)[0].outputs[0].finish_reason == "length"


@pytest.mark.parametrize("field,value", [("max_tokens", 0), ("temperature", -1.0), ("top_p", 0.0),
                                         ("top_p", 1.5)])
def test_bad_sampling_params_name_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


@pytest.mark.parametrize("model", ["no-such-model", "/nonexistent/dir/model.gguf", "./missing-dir"])
def test_unknown_model(model):
    with pytest.raises(ValueError, match="unknown model name or path") as e:
        LLM(model)
    assert model in str(e.value)


def test_directory_that_is_not_a_model(tmp_path):
    (tmp_path / "readme.txt").write_text("not a model")
    with pytest.raises(ValueError, match=str(tmp_path)):
        LLM(str(tmp_path))


def test_max_model_len_larger_than_the_pool(tiny_llama):
    with pytest.raises(ValueError, match="max_model_len"):
        LLM(str(tiny_llama), dtype="float32", num_kv_blocks=4, max_model_len=1024)


def test_max_model_len_beyond_the_models_context(tiny_llama):
    """Past max_position_embeddings (1024 here) the RoPE table ends: refused at startup, not mid-step."""
    with pytest.raises(ValueError, match="max_position_embeddings 1024"):
        LLM(str(tiny_llama), dtype="float32", num_kv_blocks=256, max_model_len=2048)


@pytest.mark.parametrize("field,value", [("block_size", 3), ("max_num_seqs", 0),
                                         ("max_num_batched_tokens", 0), ("dtype", "int8"), ("device", "tpu")])
def test_bad_engine_config_names_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        EngineConfig(**{field: value})


def test_an_unknown_scheduler_is_refused_before_the_model_loads():
    """The policy table (scheduler/) sits above config.py, so the engine checks the name, first thing."""
    with pytest.raises(ValueError, match="scheduler must be one of"):
        LLM("/no/such/model", scheduler="fifo")


def test_static_batch_runs_parallel_samples_together(tiny_llama):
    llm = LLM(str(tiny_llama), dtype="float32", num_kv_blocks=64, max_model_len=256, scheduler="static",
              batch_size=2)
    steps = record_steps(llm.engine)
    outs = llm.generate([[5, 6, 7, 8, 9], [10, 11, 12]], SamplingParams(n=3, max_tokens=6, ignore_eos=True),
                        use_tqdm=False)
    assert [len(c.token_ids) for o in outs for c in o.outputs] == [6] * 6
    # one batch: the prompts' step, the siblings' fork step, then decodes; not one batch per sibling
    assert len(steps) <= 6 + 2
    assert max(s.num_seqs for s in steps) == 6


def test_stop_token_adds_no_text(llm):
    probe = llm.generate(["Hello world"], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True),
                         use_tqdm=False)[0].outputs[0]
    stop_tok = probe.token_ids[2]
    out = llm.generate(["Hello world"], SamplingParams(max_tokens=4, temperature=0, stop_token_ids=[stop_tok]),
                       use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop_tok
    assert out.token_ids[-1] == stop_tok
    assert out.text == llm.get_tokenizer().decode(out.token_ids[:-1], skip_special_tokens=True)


# --- feedback on long steps ------------------------------------------------------------------------

def test_loading_and_generating_show_progress_unless_told_not_to(tiny_llama, capsys):
    capsys.readouterr()
    quiet = LLM(str(tiny_llama), dtype="float32", num_kv_blocks=16, max_model_len=MAX_LEN, use_tqdm_on_load=False)
    quiet.generate("Hello", greedy(4), use_tqdm=False)
    assert capsys.readouterr().err == ""
    llm = LLM(str(tiny_llama), dtype="float32", num_kv_blocks=16, max_model_len=MAX_LEN)
    err = capsys.readouterr().err
    assert f"Loading {tiny_llama}" in err and "ready" in err, err
    out = llm.generate("Hello", greedy(6))
    err = capsys.readouterr().err
    assert "Generating" in err and "6/6" in err and "tok" in err, err
    assert len(out[0].outputs[0].token_ids) == 6
    llm.generate(["Hello", "Hi"], greedy(2))
    assert "Processed requests" in capsys.readouterr().err
def test_generate_takes_tenant_and_priority(llm):
    """Strategy-neutral request fields, offline: one tenant for all prompts or one per prompt."""
    prompts = ["a b c", "d e f", "g h i"]
    seen = []
    real = llm.engine.add_request

    def recording(request):
        seen.append((request.tenant, request.priority))
        return real(request)

    llm.engine.add_request = recording
    try:
        plain = llm.generate(prompts, greedy(4), use_tqdm=False)
        tagged = llm.generate(prompts, greedy(4), use_tqdm=False, tenant=["x", None, "y"], priority=[2, 0, 1])
        one = llm.generate(prompts[:1], greedy(4), use_tqdm=False, tenant="z")
    finally:
        del llm.engine.add_request
    assert seen == [(None, 0)] * 3 + [("x", 2), (None, 0), ("y", 1), ("z", 0)]
    assert [o.outputs[0].token_ids for o in tagged] == [o.outputs[0].token_ids for o in plain]
    assert one[0].outputs[0].token_ids == plain[0].outputs[0].token_ids
    with pytest.raises(ValueError, match="tenant"):
        llm.generate(prompts, greedy(4), use_tqdm=False, tenant=["x"])
    with pytest.raises(ValueError, match="priority"):
        llm.generate(prompts, greedy(4), use_tqdm=False, priority=[1])
