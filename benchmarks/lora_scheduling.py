"""Does preferring resident LoRA adapters help the scheduler? A model-free simulation, seconds on a CPU.

    python benchmarks/lora_scheduling.py            # the table in docs/lora.md ("Which requests go first")

The real `Scheduler` and `IterationPolicy` run against a fake runner (every sampled token is 7, as in
tests/scheduler/harness.py): requests arrive at `rate` per step, each under one of `--adapters`
adapters picked at random (seeded), with prompts of 4-16 tokens and 8-32 output tokens. Two schedulers
see byte-identical arrivals:
- `fifo`: `Scheduler.prefer_resident_loras` switched off: the policy's order, with `Step.lora_fits`
  skipping whoever's adapter has no slot (the behaviour before the preference);
- `prefer`: the preference as shipped (resident adapters first; an aged request drains the resident
  adapter closest to done).
Reported per setting, mean over `--seeds` seeds: steps to finish everything (fewer: more throughput),
mean rows per busy step, and the mean and worst wait in steps from arrival to first scheduling.
"""

from __future__ import annotations

import argparse
import itertools
import random
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's conveyor, installed or not

from conveyor.config import EngineConfig
from conveyor.kv_cache import KVCacheManager
from conveyor.lora.request import LoRARequest
from conveyor.request import Request
from conveyor.sampling_params import SamplingParams
from conveyor.scheduler.core import Scheduler
from conveyor.scheduler.policies import make_policy


def simulate(prefer: bool, seed: int, rate: float, max_loras: int, adapters: int, seats: int, n: int,
             aging: int) -> tuple[int, float, float, int]:
    config = EngineConfig(model="unused", enable_lora=True, max_loras=max_loras, max_num_seqs=seats,
                          max_num_batched_tokens=256, block_size=4, priority_aging_steps=aging)
    kv = KVCacheManager(2048, 4, True)
    now = [0.0]
    sched = Scheduler(config, kv, make_policy(config), max_model_len=8192, clock=lambda: now[0])
    if not prefer:
        sched.prefer_resident_loras = lambda order, step: list(order)
    loras = [LoRARequest(f"a{i}", i + 1, f"/adapters/a{i}") for i in range(adapters)]
    rng = random.Random(seed)
    ids = itertools.count()
    arrived: dict[str, int] = {}
    first: dict[str, int] = {}
    sent, acc, steps, rows = 0, 0.0, 0, []
    while sent < n or sched.has_unfinished():
        acc += rate
        while acc >= 1 and sent < n:
            acc -= 1
            rid = f"r{next(ids)}"
            prompt = [100 + rng.randrange(50) for _ in range(rng.randint(4, 16))]
            sched.add(Request(rid, prompt, SamplingParams(max_tokens=rng.randint(8, 32), ignore_eos=True),
                              arrival_time=now[0], lora_request=rng.choice(loras)))
            arrived[rid] = steps
            sent += 1
        now[0] += 0.001
        step = sched.schedule()
        steps += 1
        for it in step.items:
            first.setdefault(it.request.request_id, steps)
        if step.items:
            rows.append(len(step.items))
        for req, _ in sched.update(step, [7] * sum(1 for it in step.items if it.samples)):
            if len(req.output_token_ids) >= req.max_tokens:
                sched.finish(req, "length")
    waits = [first[r] - arrived[r] for r in arrived]
    return steps, statistics.mean(rows), statistics.mean(waits), max(waits)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rates", default="2.0,1.0,0.6,0.3", help="arrivals per step")
    p.add_argument("--settings", default="1:6:16,2:6:16,3:6:8", help="max_loras:adapters:max_num_seqs, ...")
    p.add_argument("--requests", type=int, default=300)
    p.add_argument("--seeds", type=int, default=4)
    p.add_argument("--aging", type=int, default=32, help="priority_aging_steps (the preference's bound)")
    args = p.parse_args()
    print("| arrivals/step | max_loras | adapters | max_num_seqs | scheduler | steps | rows/step | mean wait | "
          "worst wait |")
    print("|---|---|---|---|---|---|---|---|---|")
    for rate in (float(x) for x in args.rates.split(",")):
        for setting in args.settings.split(","):
            ml, ad, seats = (int(x) for x in setting.split(":"))
            for prefer in (False, True):
                runs = [simulate(prefer, s, rate, ml, ad, seats, args.requests, args.aging) for s in range(args.seeds)]
                print(f"| {rate:g} | {ml} | {ad} | {seats} | {'prefer' if prefer else 'fifo'} | "
                      f"{statistics.mean(r[0] for r in runs):.0f} | {statistics.mean(r[1] for r in runs):.2f} | "
                      f"{statistics.mean(r[2] for r in runs):.0f} | {max(r[3] for r in runs)} |")


if __name__ == "__main__":
    main()
