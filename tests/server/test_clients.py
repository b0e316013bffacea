"""The client libraries people build agents with, against one real `conveyor serve` on SmolLM2-135M.

One server process for the whole module (the shipped tools template, the hermes parser, its own response
store), driven by the `openai` SDK (and the examples in README.md, docs/responses.md and
docs/tools-and-embeddings.md, run as written), the OpenAI Agents SDK (its Responses model and its Chat
Completions model), langchain-openai, litellm, instructor and pydantic-ai. Where the 135M model's judgement
would decide a check (whether to call a tool, whether to answer in JSON), the request forces the path (a
named tool choice, a schema), so each check proves the protocol and cannot pass or fail by the model's luck.

Nothing may leave the machine: every library gets the local server's URL, their telemetry and tracing are
off, and for the module's duration a connection or name lookup for anything but loopback raises (and fails
the module at teardown).
"""

from __future__ import annotations

import contextlib
import importlib
import io
import json
import math
import os
import re
import socket
import sys
import time
from pathlib import Path

# before any of the libraries is imported: no cost-map download (litellm), no tracing (Agents SDK, langsmith)
os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
os.environ.setdefault("OPENAI_AGENTS_DISABLE_TRACING", "1")
os.environ.setdefault("LANGCHAIN_TRACING_V2", "false")
os.environ.setdefault("LANGSMITH_TRACING", "false")

import httpx  # noqa: E402
import pytest  # noqa: E402
from pydantic import BaseModel, Field  # noqa: E402

from tests.conftest import needs_smollm2  # noqa: E402

from .conftest import bound_url, popen_server, server_output  # noqa: E402

pytestmark = [needs_smollm2, pytest.mark.slow,
              # the libraries' own TypedDicts (litellm's, pydantic-ai's), seen by this pydantic: not ours to fix
              pytest.mark.filterwarnings("ignore:Item.* using the `ReadOnly` qualifier:UserWarning")]

MODEL = "smollm2-135m"
ROOT = Path(__file__).resolve().parents[2]
LOOPBACK = {"127.0.0.1", "::1", "localhost"}
WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 24}},
                   "required": ["city"]}}}
QUESTION = "What is the capital of France?"
CLIENT_LIBRARIES = ("openai", "agents", "langchain_openai", "litellm", "instructor", "pydantic_ai")


class City(BaseModel):
    city: str = Field(max_length=24)
    country: str = Field(max_length=24)


@pytest.fixture(scope="module", autouse=True)
def no_network():
    """Connections and name lookups for anything but loopback raise, and are counted: none may happen."""
    attempts: list = []
    real_connect, real_getaddrinfo = socket.socket.connect, socket.getaddrinfo

    def connect(self, address):
        if self.family in (socket.AF_INET, socket.AF_INET6) and address[0] not in LOOPBACK:
            attempts.append(address)
            raise OSError(f"the client tests must not reach {address}")
        return real_connect(self, address)

    def getaddrinfo(host, *args, **kw):
        if host not in LOOPBACK and host is not None:
            attempts.append(host)
            raise socket.gaierror(f"the client tests must not look up {host}")
        return real_getaddrinfo(host, *args, **kw)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(socket.socket, "connect", connect)
        mp.setattr(socket, "getaddrinfo", getaddrinfo)
        yield attempts
    assert not attempts, f"a client tried to reach the network: {attempts}"


@pytest.fixture(scope="module")
def url(tmp_path_factory) -> str:
    cmd = [sys.executable, "-m", "conveyor", "serve", "--model", MODEL, "--port", "0", "--kv-cache-memory", "0.25",
           "--max-model-len", "2048", "--chat-template", "smollm2-tools", "--enable-auto-tool-choice",
           "--tool-call-parser", "hermes", "--responses-dir", str(tmp_path_factory.mktemp("responses")),
           "--shutdown-timeout", "1", "--disable-log-requests"]
    proc = popen_server(cmd, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    try:
        for name in CLIENT_LIBRARIES:  # seconds each: imported while the server loads its model
            importlib.import_module(name)
        base = bound_url(proc)
        deadline = time.monotonic() + 300
        while True:
            assert proc.poll() is None, server_output(proc)[-5000:]
            try:
                if httpx.get(base + "/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "the server did not get ready:\n" + server_output(proc)[-5000:]
            time.sleep(0.1)
        yield base
    finally:
        proc.terminate()
        proc.wait(60)
    assert "Traceback" not in server_output(proc), server_output(proc)[-5000:]


@pytest.fixture(scope="module")
def client(url):
    import openai

    with openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=120) as c:
        yield c


def async_client(url: str):
    """An AsyncOpenAI for one event loop (its connections belong to the loop that opened them)."""
    import openai

    return openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=120)


# --- the documentation's examples, run as written -------------------------------------------------------
def python_blocks(path: Path, marker: str) -> list[str]:
    """The ```python blocks of `path` that contain `marker`."""
    blocks = re.findall(r"```python\n(.*?)```", path.read_text(), flags=re.S)
    found = [b for b in blocks if marker in b]
    assert found, f"no python block of {path.name} contains {marker!r}"
    return found


def expected_lines(code: str) -> list[str]:
    """What a block says it prints: `print(...)  # text`, or a `# text` line right after a print."""
    lines = code.splitlines()
    out = []
    for i, line in enumerate(lines):
        if not line.lstrip().startswith("print("):
            continue
        inline = re.search(r"\)\s+# (.+)$", line)
        if inline:
            out.append(inline.group(1))
        elif i + 1 < len(lines) and lines[i + 1].startswith("# "):
            out.append(lines[i + 1][2:])
    return out


def run_block(code: str, url: str, **names) -> tuple[list[str], dict]:
    """Run a documentation block against the test server: (the lines it printed, its namespace)."""
    code = code.replace("http://127.0.0.1:8000/v1", url + "/v1").replace('api_key="secret"', 'api_key="none"')
    out = io.StringIO()
    namespace = {"__name__": "doc_example", **names}
    with contextlib.redirect_stdout(out):
        exec(compile(code, "<doc example>", "exec"), namespace)
    printed = out.getvalue().splitlines()
    want = expected_lines(code)
    assert [line for line in printed if line in want] == want, (printed, want)
    return printed, namespace


def test_the_responses_doc_runs_as_written(url):
    blocks = python_blocks(ROOT / "docs" / "responses.md", "client.responses")
    _, ns = run_block(blocks[0], url)
    r2 = ns["r2"]
    assert r2.previous_response_id.startswith("resp_")
    assert r2.usage.input_tokens_details.cached_tokens > 0  # the prefix cache served the stored turn
    agents_block = python_blocks(ROOT / "docs" / "responses.md", "Runner.run_sync")[0]
    _, ns = run_block(agents_block, url)
    assert all(r.response_id.startswith("resp_") for r in ns["result"].raw_responses)  # the Responses API
    assert ns["result"].context_wrapper.usage.input_tokens_details.cached_tokens > 0


def test_the_tool_calling_doc_and_the_readme_run_as_written(url, client):
    """docs/tools-and-embeddings.md's example: the named and the required calls are the compact objects the
    docs show (objects closed by default), not a ramble to max_tokens."""
    block = python_blocks(ROOT / "docs" / "tools-and-embeddings.md", "tool_choice=\"required\"")[0]
    _, ns = run_block(block, url)
    assert ns["named"].choices[0].finish_reason == "tool_calls"
    for marker in ("client.responses.create", "tool_choice=\"required\", temperature=0", "Runner.run_sync"):
        run_block(python_blocks(ROOT / "README.md", marker)[0], url, client=client)


# --- the openai SDK and the OpenAI Agents SDK -------------------------------------------------------------
def test_openai_sdk_streams_and_continues(client):
    kw = {"model": MODEL, "temperature": 0, "max_output_tokens": 24}
    with client.responses.stream(input=QUESTION, **kw) as stream:
        events = list(stream)
        final = stream.get_final_response()
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert events[0].type == "response.created" and events[-1].type == "response.completed"
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == final.output_text
    raw = [e.type for e in client.responses.create(input=QUESTION, stream=True, **kw)]
    assert raw == [e.type for e in events]
    more = client.responses.create(input="And of Germany?", previous_response_id=final.id, **kw)
    assert more.usage.input_tokens_details.cached_tokens >= final.usage.input_tokens // 16 * 16
    assert [i.type for i in client.responses.input_items.list(more.id)] == ["message"] * 3


def test_agents_sdk_responses_model_streams_calls_and_returns_structured_output(url):
    import asyncio

    from agents import Agent, ModelSettings, OpenAIProvider, OpenAIResponsesModel, RunConfig, Runner, function_tool
    from openai.types.responses import ResponseTextDeltaEvent

    async def streamed() -> tuple[str, str]:
        agent = Agent(name="a", instructions="Answer in one sentence.",
                      model=OpenAIResponsesModel(model=MODEL, openai_client=async_client(url)),
                      model_settings=ModelSettings(temperature=0, max_tokens=40))
        run = Runner.run_streamed(agent, QUESTION)
        deltas = [e.data.delta async for e in run.stream_events()
                  if e.type == "raw_response_event" and isinstance(e.data, ResponseTextDeltaEvent)]
        return "".join(deltas), run.final_output

    async def streamed_call() -> tuple[list[str], str]:  # the function_call item's events, through the SDK
        agent = Agent(name="w", instructions="Use the tool.", tools=[get_weather],
                      tool_use_behavior="stop_on_first_tool",
                      model=OpenAIResponsesModel(model=MODEL, openai_client=async_client(url)),
                      model_settings=ModelSettings(tool_choice="get_weather", temperature=0, max_tokens=60))
        run = Runner.run_streamed(agent, "What's the weather in Paris?")
        kinds = [e.data.type async for e in run.stream_events() if e.type == "raw_response_event"]
        return kinds, run.final_output

    calls = []

    @function_tool
    def get_weather(city: str) -> str:
        """Current weather in a city."""
        calls.append(city)
        return f"18 C in {city}"

    text, final = asyncio.run(streamed())
    assert text == final and final
    kinds, final = asyncio.run(streamed_call())
    assert "response.function_call_arguments.delta" in kinds and kinds[-1] == "response.completed"
    assert len(calls) == 1 and final == f"18 C in {calls[0]}"
    # a model given by name, as most agents are: the SDK's default provider picks its Responses model
    agent = Agent(name="s", instructions="Answer in JSON.", output_type=City, model=MODEL,
                  model_settings=ModelSettings(temperature=0, max_tokens=60))
    result = Runner.run_sync(agent, QUESTION, run_config=RunConfig(
        model_provider=OpenAIProvider(openai_client=async_client(url))))
    assert isinstance(result.final_output, City)  # a strict json_schema text.format
    assert [r.response_id[:5] for r in result.raw_responses] == ["resp_"]


def test_agents_sdk_chat_completions_model_calls_a_tool(url):
    from agents import Agent, ModelSettings, OpenAIChatCompletionsModel, Runner, function_tool

    calls = []

    @function_tool
    def get_weather(city: str) -> str:
        """Current weather in a city."""
        calls.append(city)
        return f"18 C in {city}"

    agent = Agent(name="w", instructions="Use the tool.", tools=[get_weather], tool_use_behavior="stop_on_first_tool",
                  model=OpenAIChatCompletionsModel(model=MODEL, openai_client=async_client(url)),
                  model_settings=ModelSettings(tool_choice="get_weather", temperature=0, max_tokens=60))
    result = Runner.run_sync(agent, "What's the weather in Paris?")
    assert len(calls) == 1 and result.final_output == f"18 C in {calls[0]}"


# --- langchain-openai -------------------------------------------------------------------------------------
def test_langchain_openai(url):
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI, OpenAIEmbeddings

    kw = {"model": MODEL, "base_url": url + "/v1", "api_key": "none", "temperature": 0, "max_retries": 0}
    llm = ChatOpenAI(max_tokens=24, **kw)
    whole = llm.invoke(QUESTION)
    assert whole.content and "".join(c.content for c in llm.stream(QUESTION)) == whole.content

    @tool
    def get_weather(city: str) -> str:
        """Current weather in a city."""
        return "sunny"

    msg = ChatOpenAI(max_tokens=60, **kw).bind_tools([get_weather], tool_choice="get_weather").invoke("Paris weather?")
    assert [c["name"] for c in msg.tool_calls] == ["get_weather"] and isinstance(msg.tool_calls[0]["args"]["city"], str)
    for method in ("json_schema", "function_calling"):
        out = ChatOpenAI(max_tokens=60, **kw).with_structured_output(City, method=method).invoke(QUESTION)
        assert isinstance(out, City), method
    on_responses = ChatOpenAI(max_tokens=24, use_responses_api=True, **kw)
    responses = on_responses.invoke(QUESTION)
    assert responses.response_metadata["id"].startswith("resp_") and responses.text
    assert "".join(c.text for c in on_responses.stream(QUESTION)) == responses.text
    # check_embedding_ctx_length=False: no tiktoken (whose encodings it would download)
    vectors = OpenAIEmbeddings(model=MODEL, base_url=url + "/v1", api_key="none", check_embedding_ctx_length=False,
                               max_retries=0).embed_documents(["hello world", "a cat sat on the mat"])
    assert len(vectors) == 2 and all(len(v) == 576 and math.isclose(math.hypot(*v), 1.0, rel_tol=1e-3)
                                     for v in vectors)


# --- litellm ----------------------------------------------------------------------------------------------
def test_litellm(url):
    import litellm

    litellm.telemetry = False
    litellm.callbacks, litellm.success_callback, litellm.failure_callback = [], [], []
    kw = {"model": f"openai/{MODEL}", "api_base": url + "/v1", "api_key": "none"}
    messages = [{"role": "user", "content": QUESTION}]
    whole = litellm.completion(messages=messages, max_tokens=24, temperature=0, **kw)
    text = whole.choices[0].message.content
    assert text and whole.usage.completion_tokens > 0
    chunks = litellm.completion(messages=messages, max_tokens=24, temperature=0, stream=True, **kw)
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == text
    tools = litellm.completion(messages=[{"role": "user", "content": "Paris weather?"}], tools=[WEATHER_TOOL],
                               tool_choice={"type": "function", "function": {"name": "get_weather"}}, max_tokens=60,
                               temperature=0, **kw)
    call = tools.choices[0].message.tool_calls[0]
    assert call.function.name == "get_weather" and set(json.loads(call.function.arguments)) == {"city"}
    r = litellm.responses(input=QUESTION, max_output_tokens=24, temperature=0, **kw)
    assert r.id.startswith("resp_") and r.output[0].content[0].text
    e = litellm.embedding(input=["hello world"], **kw)
    assert len(e.data[0]["embedding"]) == 576


# --- instructor -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("mode", ["TOOLS", "JSON_SCHEMA", "RESPONSES_TOOLS"])
def test_instructor(url, mode):
    import instructor
    import openai

    ic = instructor.from_openai(openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0),
                                mode=getattr(instructor.Mode, mode))
    out = ic.chat.completions.create(model=MODEL, response_model=City, messages=[{"role": "user", "content": QUESTION}],
                                     max_tokens=60, temperature=0, max_retries=0)
    assert isinstance(out, City)


# --- pydantic-ai ------------------------------------------------------------------------------------------
def test_pydantic_ai_structured_output_and_a_called_tool(url):
    from pydantic_ai import Agent, RunContext
    from pydantic_ai.models.openai import OpenAIChatModel, OpenAIResponsesModel
    from pydantic_ai.providers.openai import OpenAIProvider

    provider = OpenAIProvider(base_url=url + "/v1", api_key="none")
    settings = {"temperature": 0, "max_tokens": 80}
    for model in (OpenAIChatModel(MODEL, provider=provider), OpenAIResponsesModel(MODEL, provider=provider)):
        assert isinstance(Agent(model, output_type=City, model_settings=settings).run_sync(QUESTION).output, City)
    calls = []

    def first_step_calls_the_tool(ctx: RunContext) -> dict:  # forced on the first request only, or it would loop
        return {**settings, "tool_choice": ["get_weather"] if ctx.run_step <= 1 else "none"}

    agent = Agent(OpenAIChatModel(MODEL, provider=provider), model_settings=first_step_calls_the_tool)

    @agent.tool_plain
    def get_weather(city: str) -> str:
        """Current weather in a city."""
        calls.append(city)
        return f"18 C in {city}"

    result = agent.run_sync("What's the weather in Paris?")
    assert len(calls) == 1 and isinstance(result.output, str)
    returns = [p for m in result.all_messages() for p in m.parts if p.part_kind == "tool-return"]
    assert [p.content for p in returns] == [f"18 C in {calls[0]}"]
