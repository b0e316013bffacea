"""`conveyor batch run INPUT.jsonl -o OUTPUT.jsonl`: a Batch API file run in this process (vLLM's `run-batch`).

The engine is built here, with the same flags as `conveyor serve`, and every line goes through the same code a
server's batch runs it with (`BatchLines`: each line through the endpoint its `url` names, over the same
`ServingContext`), so a file gives the same answers offline as through `/v1/batches` (greedy sampling: the same
text). Lines may name any endpoint batches serve. One output file, in input order, holds every line's answer,
refused lines included (vLLM's shape; the server splits them into output and error files). At most
`--max-inflight` lines are in the engine at once; a progress bar on stderr counts lines.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from pathlib import Path
from typing import Any

# Parsing `conveyor batch run`'s flags imports nothing heavy (the CLI's rule); the engine and the serving code are
# imported when the file runs.


def add_run_args(p: argparse.ArgumentParser) -> None:
    """`conveyor batch run`'s own flags (the engine's are added beside them)."""
    p.add_argument("input", help="the batch file: JSONL, one {custom_id, method, url, body} request per line")
    p.add_argument("-o", "--output-file", required=True, help="where the answers go (JSONL, in input order)")
    p.add_argument("--served-model-name", default=None,
                   help="the model name lines may give in their body's 'model' (default: the --model value)")
    p.add_argument("--max-inflight", type=int, default=None,
                   help="lines in the engine at once (default: 2 x --max-num-seqs)")
    p.add_argument("--chat-template", default=None, help="a chat template to use instead of the tokenizer's "
                   "(as `conveyor serve --chat-template`)")
    p.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bar")


def run_batch_file(args: argparse.Namespace) -> int:
    """Run `args.input` into `args.output_file`; 0 once every line has its answer."""
    from conveyor.engine.args import engine_config_from_args
    from conveyor.pooling import default_pooling
    from conveyor.server.api_server import make_client
    from conveyor.server.async_engine import AsyncEngine
    from conveyor.server.batch.lines import BatchLines
    from conveyor.server.serving import ServingContext, ServingOptions
    from conveyor.server.tools import load_chat_template
    from conveyor.startup import loading_progress

    src = Path(args.input)
    if not src.is_file():
        raise ValueError(f"no such batch file: {src}")
    cfg = engine_config_from_args(args, {"kv_cache_populate": True}, served_model_name=args.served_model_name)
    options = ServingOptions(chat_template=load_chat_template(args.chat_template), pooling=default_pooling(cfg.model))
    with loading_progress(f"Loading {cfg.model}", enabled=args.progress):
        client = make_client(cfg, "thread")
        aengine = AsyncEngine(client, max_queued_requests=None)
        ctx = ServingContext(aengine, [client.info.model_name], options)
    inflight = args.max_inflight or 2 * cfg.max_num_seqs
    t0 = time.monotonic()
    counts = asyncio.run(_run(aengine, BatchLines(ctx), src, Path(args.output_file), inflight, args.progress))
    print(f"{counts[0]} lines answered, {counts[1]} refused or failed, in {time.monotonic() - t0:.1f} s: "
          f"{args.output_file}", file=sys.stderr)
    return 0


async def _run(aengine: Any, lines: Any, src: Path, dst: Path, max_inflight: int, progress: bool) -> tuple[int, int]:
    from conveyor.server.batch.lines import Deferred, parse_line
    from conveyor.server.batch.runner import iter_lines

    await aengine.start()
    total = sum(1 for _ in iter_lines(src))
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=total, desc="Batch lines", unit="line", dynamic_ncols=True)
    never = asyncio.Event()  # offline, nothing cancels a line
    slots = asyncio.Semaphore(max_inflight)
    done: dict[int, str] = {}  # answers waiting for the lines before them
    order: list[int] = []
    ok = failed = 0
    tasks: set[asyncio.Task] = set()
    errors: list[BaseException] = []
    tmp = dst.with_name(dst.name + ".part")

    async def one(number: int, raw: str) -> None:
        nonlocal ok, failed
        try:
            line = parse_line(number, raw, None)
            try:
                result = await lines.run(line.url or "/v1/completions", line, None, never)
            except Deferred as e:  # the engine died: nothing more will be answered
                errors.append(RuntimeError(f"the engine stopped: {e}"))
                return
            done[number] = result.text
            ok += result.ok
            failed += not result.ok
            if bar is not None:
                bar.update(1)
        finally:
            slots.release()

    try:
        with open(tmp, "w", encoding="utf-8") as out:
            written = 0
            for number, raw in iter_lines(src):
                await slots.acquire()
                order.append(number)
                task = asyncio.get_running_loop().create_task(one(number, raw))
                tasks.add(task)
                task.add_done_callback(tasks.discard)
                written = _flush(out, order, done, written)
                if errors:
                    raise errors[0]
            while tasks:
                await asyncio.wait(set(tasks), return_when=asyncio.FIRST_COMPLETED)
                if errors:
                    raise errors[0]
                written = _flush(out, order, done, written)
            written = _flush(out, order, done, written)
        tmp.replace(dst)
    finally:
        for t in tasks:
            t.cancel()
        if bar is not None:
            bar.close()
        await aengine.stop()
    return ok, failed


def _flush(out, order: list[int], done: dict[int, str], written: int) -> int:
    """Write the answers that are next in input order; returns how many lines are written."""
    while written < len(order) and order[written] in done:
        out.write(done.pop(order[written]) + "\n")
        written += 1
    return written
