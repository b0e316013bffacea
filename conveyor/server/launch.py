"""Starting `conveyor serve`: bind, answer at once, load the engine behind a "loading" answer, then serve.

A model takes from a second to minutes to come up (weights, a first kernel compile, faulting the KV
pool in). A load balancer or a Kubernetes probe that gets no HTTP answer in that time (a connection
that hangs) cannot tell a loading server from a stuck one, and a person running the README's `curl`
sees it hang. So the socket is bound and uvicorn serves from the first second: `LoadingApp` answers
every request itself while the engine loads in the background (`/health`: 503 with
`{"status": "loading", "phase": ...}`; every API route: 503 in OpenAI's error shape, code
`loading`, with `Retry-After`), then hands every request to the real app once it is up.

This module imports neither torch nor the engine: those are imported by the loading thread, after
the port already answers.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import logging
import signal
import socket
import time
from collections.abc import Callable
from typing import Any

import uvicorn
from starlette.responses import JSONResponse, Response

from conveyor import startup
from conveyor.server.args import KEEP_ALIVE_S, RETRY_AFTER_S, ServerArgs
from conveyor.server.threads import in_daemon_thread

log = logging.getLogger("conveyor.server")


class LoadingApp:
    """An ASGI app that answers "loading" until `load()` (run in a worker thread) returns the real app.

    `load` builds the real app (FastAPI) and its engine; the engine-loop rules hold as before:
    `build_app`'s thread client builds the model in the thread that will step it. The real app's
    lifespan (its engine loop's start and stop) is entered here once it is built, on the event loop.
    `on_failure` is called (on the event loop) when the load raises; `error` keeps the exception;
    `on_ready` once the real app serves."""

    def __init__(self, load: Callable[[], Any], on_failure: Callable[[BaseException], None] | None = None,
                 progress: startup.StartupProgress = startup.progress,
                 on_ready: Callable[[], None] | None = None) -> None:
        self.load = load
        self.on_failure = on_failure
        self.on_ready = on_ready
        self.progress = progress
        self.inner: Any = None  # the real app, once it is up
        self.error: BaseException | None = None
        self.started = time.monotonic()
        self.ready_s: float | None = None  # seconds from this object's creation to ready
        self._inner_lifespan: Any = None
        self._task: asyncio.Task | None = None

    @property
    def ready(self) -> bool:
        return self.inner is not None

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] == "lifespan":
            await self._lifespan(receive, send)
            return
        inner = self.inner
        if inner is not None:
            await inner(scope, receive, send)
        elif scope["type"] == "http":
            await self._loading_response(scope["path"])(scope, receive, send)
        elif scope["type"] == "websocket":
            await send({"type": "websocket.close", "code": 1013})  # "try again later"

    def status(self) -> dict[str, Any]:
        """What `/health` says while the server is not ready."""
        now = time.monotonic()
        if self.error is not None:
            return {"status": "failed", "error": f"{type(self.error).__name__}: {self.error}"[:500],
                    "elapsed_s": round(now - self.started, 3)}
        ph = self.progress.current()
        return {"status": "loading", "phase": ph.name, "detail": ph.detail,
                "phase_elapsed_s": round(now - max(ph.started, self.started), 3),
                "elapsed_s": round(now - self.started, 3)}

    def _loading_response(self, path: str) -> Response:
        status = self.status()
        headers = {"Retry-After": str(RETRY_AFTER_S)}
        if path == "/health":
            return JSONResponse(status, status_code=503, headers=headers)
        if path == "/version":
            import conveyor

            return JSONResponse({"version": conveyor.__version__})
        if path == "/metrics":  # a scrape during startup sees that the server is up and not ready yet
            text = ("# HELP conveyor:server_ready 1 once the engine is loaded and requests are served.\n"
                    "# TYPE conveyor:server_ready gauge\nconveyor:server_ready 0.0\n"
                    "# HELP conveyor:startup_elapsed_seconds Seconds since the server started loading.\n"
                    "# TYPE conveyor:startup_elapsed_seconds gauge\n"
                    f"conveyor:startup_elapsed_seconds {status['elapsed_s']}\n")
            return Response(text, media_type="text/plain; version=0.0.4; charset=utf-8")
        if status["status"] == "failed":
            message, code = f"the engine failed to load: {status['error']}", "engine_dead"
        else:
            message = (f"the server is still loading the model ({status['phase']}, {status['elapsed_s']:.0f} s so "
                       f"far); retry in a few seconds")
            code = "loading"
        body = {"error": {"message": message, "type": "service_unavailable", "param": None, "code": code}}
        return JSONResponse(body, status_code=503, headers=headers)

    async def _lifespan(self, receive: Callable, send: Callable) -> None:
        await receive()  # lifespan.startup
        self._task = asyncio.get_running_loop().create_task(self._load())
        await send({"type": "lifespan.startup.complete"})
        await receive()  # lifespan.shutdown
        if not self._task.done():
            # the load thread cannot be interrupted; it is left to finish (or die with the process)
            self._task.cancel()
        if self._inner_lifespan is not None:
            try:
                await self._inner_lifespan.__aexit__(None, None, None)
            except Exception:  # noqa: BLE001 - the shutdown is still reported as done
                log.exception("error while stopping the engine")
        await send({"type": "lifespan.shutdown.complete"})

    async def _load(self) -> None:
        try:
            inner = await in_daemon_thread(self.load, name="conveyor-load")
            self.progress.set(startup.STARTING, "the engine loop")
            ctx = inner.router.lifespan_context(inner)
            await ctx.__aenter__()
        except asyncio.CancelledError:
            raise
        except BaseException as e:  # noqa: BLE001 - reported by /health and by run_server
            self.error = e
            log.error("the engine failed to load: %s", e, exc_info=not isinstance(e, ValueError))
            if self.on_failure is not None:
                self.on_failure(e)
            return
        self._inner_lifespan = ctx
        self.ready_s = time.monotonic() - self.started
        metrics = getattr(inner.state, "metrics", None)
        if metrics is not None:
            from prometheus_client import Gauge

            Gauge("conveyor:server_ready", "1 once the engine is loaded and requests are served.",
                  registry=metrics.registry).set(1)
            Gauge("conveyor:startup_seconds", "Seconds from the server's start to ready (engine loaded).",
                  registry=metrics.registry).set(self.ready_s)
        self.inner = inner
        log.info("ready in %.1f s: serving requests", self.ready_s)
        if self.on_ready is not None:
            self.on_ready()


class GracefulServer(uvicorn.Server):
    """uvicorn, plus a drain on SIGTERM or a first SIGINT, and an exit at once on a second SIGINT.

    uvicorn alone stops accepting connections at the first signal (a client then gets "connection
    refused", and a load balancer's probe cannot tell a server that drains from one that is gone),
    waits `timeout_graceful_shutdown` for open connections and cancels them mid-body. Here the first
    signal starts a drain instead: the socket stays open, new requests get 503 `draining` with
    `Retry-After` and `/health` 503 `draining`, and requests in flight get `grace_s` seconds to finish;
    what is left then ends with a clear error (`server_shutdown`: a 503, or an error event and
    [DONE] in a stream; its blocks are freed), and only then does uvicorn shut down (its own timeout
    is a little longer, so it only ever has finished responses to wait for) and the process exits 0.
    A second SIGINT exits at once (`forced`). A stop without a signal (`should_exit` set by code: a
    failed load, a crash loop, tests) still gives in-flight requests `grace_s`, then aborts them with
    finish_reason "abort". `app`: the FastAPI app, or a `LoadingApp` (whose real app may not be up yet
    when the shutdown comes: then there is nothing to drain).
    """

    def __init__(self, app: Any, grace_s: float, **config_kw) -> None:
        config_kw.setdefault("timeout_keep_alive", KEEP_ALIVE_S)
        super().__init__(uvicorn.Config(app, timeout_graceful_shutdown=grace_s + 2.0, lifespan="on", **config_kw))
        self._app = app
        self.grace_s = grace_s
        self.draining = False  # a signal came: the drain runs (or ran)
        self.drained = False  # the drain is over: in-flight requests finished or were ended
        self.forced = False  # a second SIGINT: exit at once
        self.exit_code = 0  # what `run_server` returns when the server stops by itself (a crash loop: 1)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._drain_task: asyncio.Task | None = None

    @property
    def app_state(self) -> Any:
        """The real app's state, or None while a `LoadingApp` is still loading."""
        inner = self._app.inner if isinstance(self._app, LoadingApp) else self._app
        return None if inner is None else inner.state

    @property
    def aengine(self) -> Any:
        state = self.app_state
        return None if state is None else getattr(state, "engine", None)

    @property
    def drainable(self) -> Any:
        """What drains on a signal: the app's `drainable` (the replicas' ingress) or its engine. It has
        `drain()`, `in_flight` and `end_in_flight(why)`."""
        state = self.app_state
        return None if state is None else getattr(state, "drainable", None) or getattr(state, "engine", None)

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().startup(sockets=sockets)

    def handle_exit(self, sig: int, frame: Any) -> None:
        """The signal handler (main thread, between two bytecodes of the event loop's thread)."""
        self._captured_signals.append(sig)
        if self.draining or self.should_exit:
            if sig == signal.SIGINT:  # a second Ctrl-C: now
                log.warning("second interrupt: exiting now, without waiting for requests in flight")
                self.forced = self.force_exit = self.should_exit = True
            return
        if self.drainable is None or self._loop is None:  # still loading: nothing in flight to drain
            self.should_exit = True
            return
        self.draining = True
        self._loop.call_soon_threadsafe(self._start_drain)

    def _start_drain(self) -> None:
        self._drain_task = asyncio.ensure_future(self._drain())

    async def _drain(self) -> None:
        target = self.drainable
        target.drain()
        log.info("shutting down: draining %d request(s) in flight, for up to %g s (--shutdown-timeout); new "
                 "requests get 503 draining", target.in_flight, self.grace_s)
        deadline = time.monotonic() + self.grace_s
        while target.in_flight and time.monotonic() < deadline and not self.force_exit:
            await asyncio.sleep(0.05)
        if target.in_flight:
            target.end_in_flight(f"the server is shutting down, and the request did not finish within "
                                 f"--shutdown-timeout ({self.grace_s:g} s)")
        self.drained = True
        self.should_exit = True

    async def shutdown(self, *args, **kwargs) -> None:
        state = self.app_state
        if state is None or self.force_exit:  # still loading, or a forced exit: nothing to wait for
            await super().shutdown(*args, **kwargs)
            return
        dashboard = getattr(state, "dashboard", None)
        if dashboard is not None:
            dashboard.close()  # dashboard streams never end by themselves
        if self.drained or self.aengine is None:
            await super().shutdown(*args, **kwargs)
            return
        drain = asyncio.ensure_future(self.aengine.abort_all_after(self.grace_s))
        try:
            await super().shutdown(*args, **kwargs)
        finally:
            drain.cancel()


def bind_listen_socket(host: str, port: int) -> socket.socket:
    """Bind the server's address before the slow part of startup (loading weights, starting replicas).

    Binding late leaves the port free for the tens of seconds a model or a Ray cluster takes to come
    up, and Ray's own processes open sockets on ports the kernel picks in that window: the server
    then died at the very end with "address already in use". Binding first also makes a taken
    port fail in a second instead of after the load, and `--port 0` picks a free one. The socket is
    not inheritable, so neither the engine process nor Ray's workers hold it open after we exit."""
    family, _, _, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn: TIME_WAIT leftovers do not block
    try:
        sock.bind(addr)
    except OSError as e:  # a ValueError: the CLI reports it in one line, as it does a bad flag
        sock.close()
        raise ValueError(f"cannot listen on {host}:{port}: {e.strerror} (another server there? pick --port)") from None
    # the real port, which `--port 0` only tells here (and scripts that start a server read it from this line)
    bound = sock.getsockname()[1]
    log.info("bound %s:%d; serving there (/health says \"loading\" until the engine is up)", host, bound)
    return sock


def run_server(args: argparse.Namespace) -> int:
    """Serve until SIGTERM/SIGINT; in-flight requests get `--shutdown-timeout` seconds, then exit 0 (130 after a
    second SIGINT; 1 when the engine died in a crash loop: `--max-engine-restarts`).

    The engine loads behind a `LoadingApp`, except with `--engine-loop inline`, whose engine is
    stepped on the event loop's thread and so is built there, before serving (the naive design)."""
    from conveyor.engine.args import engine_config_from_args

    if getattr(args, "log_level", "WARNING").upper() == "WARNING":  # the CLI default: a server logs at INFO
        logging.getLogger("conveyor").setLevel(logging.INFO)
    cfg = engine_config_from_args(args, {"kv_cache_populate": True}, served_model_name=args.served_model_name)
    sargs = ServerArgs.from_namespace(args)
    sock = bind_listen_socket(sargs.host, sargs.port)

    def load() -> Any:
        startup.phase(startup.STARTING, "importing the engine")
        from conveyor.server.api_server import build_app

        return build_app(cfg, sargs)

    server: GracefulServer | None = None

    def failed(_: BaseException) -> None:
        if server is not None:
            server.should_exit = True

    def freeze() -> None:
        log.info("%d objects of the loaded server frozen out of the garbage collector's full passes",
                 startup.freeze_startup_heap())

    def gave_up(why: str) -> None:  # a crash loop: exit non-zero, so that a supervisor sees it
        log.critical("exiting with code 1: %s", why)
        server.exit_code = 1
        server.should_exit = True

    def refreeze() -> None:  # a new engine in this process (thread loop): the restart unfroze the heap to free the old
        if not gc.get_freeze_count():
            freeze()

    def ready() -> None:
        freeze()
        aengine = server.aengine
        aengine.on_restarted = refreeze
        aengine.on_give_up = gave_up

    if sargs.engine_loop == "inline":
        app: Any = load()
        freeze()
    else:
        app = LoadingApp(load, on_failure=failed, on_ready=ready)
    server = GracefulServer(app, sargs.shutdown_timeout, host=sargs.host, port=sargs.port,
                            log_level=sargs.uvicorn_log_level, access_log=False,
                            timeout_keep_alive=sargs.timeout_keep_alive)
    # uvicorn re-raises the signal it caught once its graceful shutdown is done; with these no-op
    # handlers in place underneath its own, that re-raise is swallowed and we return 0.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: None)
    startup.dump_stacks_on_sigusr1()  # `kill -USR1 PID` writes every thread's stack to the log (a stuck server)
    with sock:
        server.run(sockets=[sock])
    if isinstance(app, LoadingApp) and app.error is not None:
        raise app.error  # a ValueError (bad model path, flags) becomes the CLI's one-line error, exit 2
    if server.forced:
        return 130  # as a shell reports a process ended by Ctrl-C
    return server.exit_code if server.started else 1
