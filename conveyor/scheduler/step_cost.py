"""How long a step takes, learned online from the scheduler's own calls (no timer, no calibration run).

`StepCost` fits `seconds = a + b * tokens` over recent steps; `StepTimer` feeds it from the time between two
calls of the scheduler. The deadline-aware and fair strategies (`policies.py`) use it to size their steps, and
the scheduler core (`core.py`) to keep the batch tier's share of a step within what interactive work can bear.
"""

from __future__ import annotations

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


class StepTimer:
    """Feeds a `StepCost` from the scheduler's own calls: the time since the last call is the last step's
    duration, if that step left work behind (so the engine stepped again at once, with no idle gap in
    between). Its owner calls `observe` when a step begins and `planned` once it has planned its part.

    The step's tokens are read when the next step begins, not when `planned` is called: a policy plans one
    tier of a step and the batch tier may add to it afterwards (`core.py`), and the duration is the whole
    step's."""

    def __init__(self) -> None:
        self.cost = StepCost()
        self.last: tuple[float, Any] | None = None  # the last step: when it was planned, and the `Step` itself

    def observe(self, s: Any) -> None:
        """`s`: the scheduler (anything with a `clock()`)."""
        now = s.clock()
        if self.last is not None:
            t, step = self.last
            tokens = step.num_tokens
            if tokens and any(not it.request.finished for it in step.items) and now > t:
                self.cost.observe(tokens, now - t)
        self.last = None

    def planned(self, s: Any, step: Any) -> None:
        self.last = (s.clock(), step)
