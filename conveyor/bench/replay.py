"""`conveyor bench replay RESULTS.json`: a finished comparison, played back in the live dashboard's views.

The lab keeps every step of its saturation runs (`compact_steps`), so a comparison can be watched
after the fact: `/dashboard?replay=<strategy>` plays one strategy's run through the dashboard's
own page at its recorded pace (`&speed=2` plays it twice as fast). `/dashboard/compare` puts all
of them side by side, started together. Nothing is recomputed; the browser only redraws what the
engine recorded.
"""

from __future__ import annotations

import json

from fastapi import FastAPI
from starlette.responses import HTMLResponse, JSONResponse

from conveyor.server.dashboard import dashboard_html


def replay_runs(results: dict) -> dict[str, dict]:
    """{strategy: {"setup", "steps"}} from a `bench compare` results file, in the dashboard's step format."""
    out = {}
    setup = results.get("setup", {})
    for run in results.get("runs", []):
        steps = run.get("steps")
        if not steps:
            continue
        meta = run.get("meta", {})
        name = meta.get("strategy") or "run"
        cfg = meta.get("engine_config", {})
        seen: set[int] = set()
        rows = []
        for i, s in enumerate(steps):
            ids = s["ids"]
            if "rt" in s:
                items = [[r, n, p] for r, n, p in zip(ids, s["rt"], s["rp"])]
            else:  # older results: a request's first step is its prompt (exact unless the prompt was chunked)
                items = [[r, 0, int(r not in seen)] for r in ids]
            seen.update(ids)
            rows.append([i, round(1000 * s["t"], 1), round(1000 * s["d"], 2), s["tok"], s["pf"], s.get("running", 0),
                         s.get("waiting", 0), s.get("kv_blocks", 0), items, s.get("pre", [])])
        out[name] = {
            "setup": {"model": setup.get("model", "?"), "strategy": name, "summary": meta.get("label", ""),
                      "knobs": {k: v for k, v in cfg.items() if k != "scheduler"},
                      "kv_blocks": setup.get("num_kv_blocks", 0), "kv_tokens": 0},
            "steps": rows,
        }
    return out


_COMPARE = """<!doctype html><html><head><meta charset="utf-8"><title>conveyor · replay</title>
<style>body{{margin:0;background:#0f1419;display:grid;grid-template-columns:1fr 1fr;gap:4px}}
iframe{{width:100%;height:50vh;border:0}}</style></head><body>{frames}</body></html>"""


def build_replay_app(results_path: str) -> FastAPI:
    with open(results_path) as f:
        runs = replay_runs(json.load(f))
    if not runs:
        raise ValueError(f"{results_path} has no recorded steps (the lab keeps them for its saturation runs)")
    app = FastAPI(title="conveyor replay", docs_url=None, redoc_url=None, openapi_url=None)

    @app.get("/dashboard")
    async def page() -> HTMLResponse:
        return HTMLResponse(dashboard_html())

    @app.get("/dashboard/compare")
    async def compare(speed: float = 1.0) -> HTMLResponse:
        frames = "".join(f'<iframe src="/dashboard?replay={name}&speed={speed}"></iframe>' for name in runs)
        return HTMLResponse(_COMPARE.format(frames=frames))

    @app.get("/dashboard/replay/{name}.json")
    async def data(name: str) -> JSONResponse:
        if name not in runs:
            return JSONResponse({"error": {"message": f"no run named {name!r}; have {sorted(runs)}",
                                           "type": "invalid_request_error", "param": "name", "code": None}},
                                status_code=404)
        return JSONResponse(runs[name])

    @app.get("/")
    async def index() -> HTMLResponse:
        links = "".join(f'<li><a href="/dashboard?replay={n}">{n}</a></li>' for n in runs)
        return HTMLResponse(f'<p><a href="/dashboard/compare">all side by side</a></p><ul>{links}</ul>')

    return app
