"""How long a step takes, learned online from the scheduler's own calls (no timer, no calibration run).

`StepCost` fits `seconds = a + b * tokens` over recent steps; `StepTimer` feeds it from the time between two
calls of the scheduler. The deadline-aware and fair strategies (`policies.py`) use it to size their steps, and
the scheduler core (`core.py`) to keep the batch tier's share of a step within what interactive work can bear.
"""

from __future__ import annotations

import statistics
from collections import deque
from typing import Any


class StepCost:
    """An online model of how long a step takes for its token count, `seconds = a + b * tokens`, fitted by
    least squares over the recent steps (older ones fade by `decay` per step).

    The scheduler has no timer of its own, but it knows when it is called: when the previous step left work
    behind, the engine steps again at once, so the time between two calls is the previous step's duration.
    That is all the deadline-aware policy needs to tell whether a waiting request can still make its TTFT
    deadline and how many tokens a step may carry without breaking a running request's TPOT target, on
    whatever machine and model it runs, with no calibration run."""

    def __init__(self, decay: float = 0.97) -> None:
        self.decay = decay
        self.n = self.sx = self.sxx = self.sy = self.sxy = 0.0

    def observe(self, tokens: int, seconds: float) -> None:
        d = self.decay
        self.n, self.sx, self.sxx = d * self.n + 1, d * self.sx + tokens, d * self.sxx + tokens * tokens
        self.sy, self.sxy = d * self.sy + seconds, d * self.sxy + tokens * seconds

    def fit(self) -> tuple[float, float] | None:
        """(a, b), or None before any step was seen. Steps that all carried the same number of tokens
        cannot separate the fixed cost from the per-token one: then the whole cost is put on the tokens
        (the next steps of another size correct it). Neither is ever negative."""
        if self.n < 1 or self.sx <= 0:
            return None
        det = self.n * self.sxx - self.sx * self.sx
        if det > 1e-9 * self.n * self.sxx:
            b = (self.n * self.sxy - self.sx * self.sy) / det
            a = (self.sy - b * self.sx) / self.n
            if a >= 0 and b > 0:
                return a, b
        return 0.0, max(self.sy / self.sx, 1e-9)

    def seconds(self, tokens: int) -> float:
        ab = self.fit()
        return 0.0 if ab is None else ab[0] + ab[1] * tokens

    def tokens_within(self, seconds: float) -> int | None:
        """The most tokens a step may carry and still take at most `seconds` (None: no model yet)."""
        ab = self.fit()
        return None if ab is None else max(int((seconds - ab[0]) / ab[1]), 0)


class SeqStepCost:
    """`seconds = a + b * tokens + c * sequences`, fitted online like `StepCost` (the batch tier's model, `core.py`).

    A step's cost is not in its tokens alone: each sequence in it also costs its sampling, its detokenizing and
    its output, which on a small model (or a fast device) outweigh its tokens' share of the forward. A decode adds a
    token *and* a sequence; a prompt chunk many tokens and one sequence. Fitted on tokens alone, a step of many
    decodes was predicted at a third of its real cost on the tests' tiny model, and the batch tier put three times
    the decodes it should have beside interactive ones. Where the steps seen cannot tell the two apart (all
    decodes), the whole per-item cost is put on the tokens; no coefficient is ever negative."""

    def __init__(self, decay: float = 0.97) -> None:
        self.decay = decay
        self.xx = [[0.0] * 3 for _ in range(3)]  # sums of x x^T, x = (1, tokens, sequences), fading by `decay`
        self.xy = [0.0] * 3
        self.tokens_only = StepCost(decay)  # the fallback

    def observe_step(self, tokens: int, seqs: int, seconds: float) -> None:
        d, x = self.decay, (1.0, float(tokens), float(seqs))
        for i in range(3):
            self.xy[i] = d * self.xy[i] + x[i] * seconds
            for j in range(3):
                self.xx[i][j] = d * self.xx[i][j] + x[i] * x[j]
        self.tokens_only.observe(tokens, seconds)

    def fit(self) -> tuple[float, float, float] | None:
        """(a, b, c), or None before any step was seen."""
        base = self.tokens_only.fit()
        if base is None:
            return None
        sol = _solve3(self.xx, self.xy)
        if sol is None or min(sol) < 0:
            return base[0], base[1], 0.0
        return sol[0], sol[1], sol[2]

    def seconds(self, tokens: int, seqs: int) -> float:
        f = self.fit()
        return 0.0 if f is None else f[0] + f[1] * tokens + f[2] * seqs


def _solve3(m: list[list[float]], v: list[float]) -> list[float] | None:
    """The solution of the 3x3 system m x = v (Gaussian elimination with partial pivoting); None when m is
    (nearly) singular: the steps seen do not tell tokens and sequences apart."""
    a = [row[:] + [v[i]] for i, row in enumerate(m)]
    scale = max(abs(a[i][i]) for i in range(3)) or 1.0
    for col in range(3):
        piv = max(range(col, 3), key=lambda r: abs(a[r][col]))
        if abs(a[piv][col]) < 1e-9 * scale:
            return None
        a[col], a[piv] = a[piv], a[col]
        for r in range(col + 1, 3):
            f = a[r][col] / a[col][col]
            for k in range(col, 4):
                a[r][k] -= f * a[col][k]
    x = [0.0] * 3
    for r in (2, 1, 0):
        x[r] = (a[r][3] - sum(a[r][k] * x[k] for k in range(r + 1, 3))) / a[r][r]
    return x


class StepTimer:
    """Feeds a `StepCost` from the scheduler's own calls: the time since the last call is the last step's
    duration, if that step left work behind (so the engine stepped again at once, with no idle gap in
    between). Its owner calls `observe` when a step begins and `planned` once it has planned its part.

    The step's tokens are read when the next step begins, not when `planned` is called: a policy plans one
    tier of a step and the batch tier may add to it afterwards (`core.py`), and the duration is the whole
    step's."""

    def __init__(self, cost: StepCost | SeqStepCost | None = None) -> None:
        self.cost = cost if cost is not None else StepCost()
        self.last: tuple[float, Any] | None = None  # the last step: when it was planned, and the `Step` itself

    def observe(self, s: Any) -> tuple[Any, float] | None:
        """`s`: the scheduler (anything with a `clock()`). Returns the step just timed and its seconds (None: it
        could not be timed)."""
        now = s.clock()
        timed = None
        if self.last is not None:
            t, step = self.last
            tokens = step.num_tokens
            if tokens and any(not it.request.finished for it in step.items) and now > t:
                if isinstance(self.cost, SeqStepCost):
                    self.cost.observe_step(tokens, len(step.items), now - t)
                else:
                    self.cost.observe(tokens, now - t)
                timed = step, now - t
        self.last = None
        return timed

    def planned(self, s: Any, step: Any) -> None:
        self.last = (s.clock(), step)


class DecodeShare:
    """What batch tokens cost an interactive decode step, measured on those very steps: the batch tier's share
    of them (`Scheduler.tier_budget`).

    A model fitted over every step (`SeqStepCost`) answers "what does a step of this size cost" well on
    average, but the batch tier needs one narrow thing: how much longer a step of `n` interactive decodes
    gets per batch token added. Fitted over steps that were mostly large batch-only ones, the model's fixed
    cost came out too high and its per-sequence cost too low, and the tier put twice the batch decodes it
    should have beside a lone interactive stream. So this measures it directly, with medians of the recent
    steps (a collector's pause or a burst of the event loop's work would drag a mean):
    - `ref(n)`: the time of a step of `n` interactive decodes with no batch tokens. Every `probe_every`-th such
      step, and the first ones of each `n`, take no batch tokens, to keep it current (the context grows, the
      machine's load changes);
    - `per_token`: (time - ref(n)) / batch tokens over the steps whose batch tokens were all decodes (a batch
      prompt's chunk costs less per token: mixed in, it made the estimate small and let ten times the batch
      decodes in afterwards). Never taken below `ref(n) / max_tokens_per_ref`, so that one fast step cannot
      open the gate wide.
    Then a step of `n` decodes may carry `(slowdown - 1) * ref(n) / per_token` batch tokens (decodes, or a
    prompt chunk of that many tokens, which costs less). Until a batch token has been timed, one is let in at a
    time: the first measurement."""

    def __init__(self, probe_every: int = 12, window: int = 15, max_tokens_per_ref: float = 100.0) -> None:
        self.probe_every = probe_every
        self.window = window
        self.max_tokens_per_ref = max_tokens_per_ref
        self._ref: dict[int, deque[float]] = {}
        self._per_token: deque[float] = deque(maxlen=window)
        self._since_probe = 0

    def ref(self, n: int) -> float | None:
        """The median time of the recent steps of `n` interactive decodes alone (None: none seen yet)."""
        times = self._ref.get(n)
        return statistics.median(times) if times and len(times) >= 3 else None

    @property
    def per_token(self) -> float | None:
        return statistics.median(self._per_token) if self._per_token else None

    def observe(self, n: int, batch_tokens: int, seconds: float) -> None:
        """A step of `n` interactive decodes and `batch_tokens` batch decodes took `seconds`."""
        if batch_tokens == 0:
            self._ref.setdefault(n, deque(maxlen=self.window)).append(seconds)
        elif (ref := self.ref(n)) is not None:
            self._per_token.append((seconds - ref) / batch_tokens)

    def budget(self, n: int, slowdown: float) -> int:
        """Batch tokens the next step of `n` interactive decodes may carry (0 in a probe step)."""
        ref = self.ref(n)
        self._since_probe += 1
        if ref is None or self._since_probe >= self.probe_every:
            self._since_probe = 0
            return 0
        per_token = self.per_token
        if per_token is None:
            return 1
        return int((slowdown - 1) * ref / max(per_token, ref / self.max_tokens_per_ref))
