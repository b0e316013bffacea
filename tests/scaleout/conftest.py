"""Shared by the Ray tests: the probe that skips them where Ray cannot start, the `serve --replicas 2` process
driver, and the servers themselves, started once for the package (each start brings up a local Ray
instance and two replicas: about 20 s on two cores, so the two modules share them).

`test_ray_serve.py`'s SIGTERM test stops the prefix-routed server; it runs last in its module, and
`test_lora_replicas.py` (which sorts first) uses the least-loaded one.
"""

from __future__ import annotations

import importlib.util
import signal
import subprocess
import sys
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.lora.peft_adapters import ALL_PROJECTIONS, make_adapter

from ..server.conftest import API_KEY, MODEL, bound_url, popen_server, server_output

SECOND_KEY = "test-key-2"


def _ray_probe() -> str | None:
    """Why Ray cannot run here, or None."""
    if importlib.util.find_spec("ray") is None or importlib.util.find_spec("ray.serve") is None:
        return "Ray Serve is not installed; pip install 'conveyor[ray]'"
    code = "import ray; ray.init(include_dashboard=False, num_cpus=1); ray.shutdown()"
    try:
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=180)
    except subprocess.TimeoutExpired:
        return "a local Ray instance did not start within 180 s"
    return None if r.returncode == 0 else f"a local Ray instance cannot start here: {r.stderr[-500:]}"


@pytest.fixture(scope="package")
def ray_ok() -> None:
    why = _ray_probe()
    if why:
        print(f"\nskipping the Ray Serve tests: {why}")
        pytest.skip(why)


class ReplicatedServer:
    """`conveyor serve --replicas 2` in its own process (and its own local Ray instance)."""

    def __init__(self, tiny_llama, router: str, api_key: bool | str = False, extra: tuple[str, ...] = ()) -> None:
        """`api_key`: True for `--api-key API_KEY`, or the flag's value (`k1,k2`: several keys)."""
        keys = API_KEY if api_key is True else api_key
        self.proc = popen_server([
            sys.executable, "-m", "conveyor", "serve", "--replicas", "2", "--router", router, "--replica-cpus", "1",
            "--model", str(tiny_llama), "--served-model-name", MODEL, "--dtype", "float32", "--port", "0",
            "--kv-cache-memory", "0.01", "--max-model-len", "512", "--disable-log-requests",
            "--uvicorn-log-level", "warning", *(["--api-key", keys] if keys else []), *extra])
        self.headers = {"Authorization": f"Bearer {keys.split(',')[0]}"} if keys else {}
        self.url = bound_url(self.proc)  # bound before Ray starts
        deadline = time.monotonic() + 240
        while True:
            assert self.proc.poll() is None, server_output(self.proc)[-5000:]
            try:
                if self.health().get("status") == "ok":
                    break
            except (httpx.TransportError, ValueError):
                pass
            assert time.monotonic() < deadline, "replicas did not come up:\n" + server_output(self.proc)[-5000:]
            time.sleep(0.5)

    def health(self) -> dict:
        return httpx.get(self.url + "/health", timeout=10).json()

    def client(self):
        import openai

        return openai.OpenAI(base_url=self.url + "/v1", api_key=API_KEY if self.headers else "none", max_retries=0,
                             timeout=120)

    def metrics_by_replica(self) -> dict[str, dict[str, float]]:
        """/metrics as {replica: {sample name: value summed over its other labels}}."""
        out: dict[str, dict[str, float]] = {}
        for fam in text_string_to_metric_families(httpx.get(self.url + "/metrics", timeout=30).text):
            for s in fam.samples:
                if "replica" in s.labels and "reason" not in s.labels:
                    d = out.setdefault(s.labels["replica"], {})
                    d[s.name] = d.get(s.name, 0.0) + s.value
        return out

    def prefix_counts(self) -> tuple[float, float]:
        """(prefix-cache hits, queries) summed over the replicas, since they started."""
        m = self.metrics_by_replica()
        return (sum(d.get("conveyor:prefix_cache_hits_total", 0.0) for d in m.values()),
                sum(d.get("conveyor:prefix_cache_queries_total", 0.0) for d in m.values()))

    def hit_rate(self, since: tuple[float, float] = (0.0, 0.0)) -> float:
        """The prefix-cache hit rate of the traffic after `since` (a `prefix_counts()` taken before it)."""
        hits, queries = self.prefix_counts()
        return (hits - since[0]) / (queries - since[1])

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


@pytest.fixture(scope="package")
def prefix_server(ray_ok, tiny_llama):
    """Two API keys (API_KEY first) and the tenant from a header: the ingress must keep both rules as the single
    server does (`test_every_key_and_the_tenant_header_pass_the_ingress`)."""
    s = ReplicatedServer(tiny_llama, "prefix", api_key=f"{API_KEY},{SECOND_KEY}",
                         extra=("--tenant-key", "header:x-tenant"))
    yield s
    s.close()


@pytest.fixture(scope="package")
def adapter_dirs(tiny_llama, tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("replica-adapters")
    specs = {"a": (4, ALL_PROJECTIONS), "b": (8, ["q_proj", "v_proj", "down_proj"]), "c": (2, ["gate_proj"]),
             "wide": (32, ["q_proj"])}
    return {n: str(make_adapter(tiny_llama, root / n, r, t, seed=70 + i)) for i, (n, (r, t)) in
            enumerate(specs.items())}


@pytest.fixture(scope="package")
def least_loaded_server(ray_ok, tiny_llama, adapter_dirs):
    """Least-loaded routing (consecutive requests alternate replicas), the API key, two adapters at startup and
    runtime adapter updates: the LoRA tests' server, and the prefix router's baseline for the hit rate."""
    s = ReplicatedServer(tiny_llama, "least-loaded", api_key=True, extra=(
        "--enable-lora", "--max-loras", "2", "--lora-modules", f"a={adapter_dirs['a']}", f"b={adapter_dirs['b']}",
        "--allow-runtime-lora-updating"))
    yield s
    s.close()
