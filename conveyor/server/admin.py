"""Admin routes: switch the batching strategy of a running server.

    curl -X POST localhost:8000/admin/scheduler -H 'Authorization: Bearer KEY' \\
         -d '{"scheduler": "NAME", "OPTION": VALUE}'

The body names a strategy registered in `conveyor/scheduler/policies.py` and, optionally, values for
that strategy's own options (its `PolicySpec.options`; the rest keep their values). The switch is a
typed command through the engine loop (`SetScheduler`), applied between two steps: every request in
flight stays where it is (waiting, running, its KV blocks) and carries on under the new strategy.
The answer comes once the engine has switched: {"scheduler", "options", "previous"}. A bad name or
option is a 400 that changes nothing. GET returns the running strategy and the registered ones.
These routes are checked like the API (`--api-key`). Nothing here names a strategy.
"""

from __future__ import annotations

from collections.abc import Callable

from fastapi import APIRouter
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from conveyor.scheduler.policies import POLICIES, coerce_options
from conveyor.server.async_engine import AsyncEngine, EngineDeadError
from conveyor.server.http import bad_request, engine_error


def install_admin_routes(router: APIRouter, aengine: AsyncEngine, read_body: Callable) -> None:
    """The routes on `router` (which checks the API key); `read_body(request)`: the request's JSON object
    (400/413 otherwise), as the API reads bodies."""

    @router.get("/admin/scheduler")
    async def get_scheduler(request: Request) -> Response:
        s = aengine.stats()
        return JSONResponse({"scheduler": s.scheduler, "switches": s.scheduler_switches,
                             "available": {name: {"summary": spec.summary, "options": [o.name for o in spec.options]}
                                           for name, spec in POLICIES.items()}})

    @router.post("/admin/scheduler")
    async def set_scheduler(request: Request) -> Response:
        data = await read_body(request)
        name = data.get("scheduler")
        if not isinstance(name, str):
            raise bad_request(f"'scheduler' must name a strategy: one of {', '.join(POLICIES)}", "scheduler")
        options = {k: v for k, v in data.items() if k != "scheduler"}
        try:
            coerce_options(name, options)  # checked here too, so a typo is a 400 before the engine sees it
        except ValueError as e:
            param = "scheduler" if name not in POLICIES else next((k for k in options if k in str(e)), None)
            raise bad_request(str(e), param) from None
        previous = aengine.stats().scheduler
        try:
            sw = await aengine.set_scheduler(name, options)
        except EngineDeadError as e:
            raise engine_error(e) from None
        if sw.error is not None:  # the engine refused a value (e.g. malformed tenant weights): nothing changed
            raise bad_request(sw.error.split(": ", 1)[-1])
        return JSONResponse({"scheduler": sw.name, "options": sw.options, "previous": previous})
