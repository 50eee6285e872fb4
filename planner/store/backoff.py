"""Exponential backoff with jitter, for the service's reconnects to a store that may be down.

The HTTP service keeps serving its last table while the store is away and reconnects in the
background (``service.registry``: its loading and watch loops sleep ``Backoff.delay``). The
delay is a pure function of the attempt number and a uniform random number, so it is tested
exactly; jitter spreads the reconnects of many workers so they do not hit a restarted Redis
at once. Single Redis commands are retried by redis-py's own ``Retry`` (``redis_backend``).
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from dataclasses import dataclass

from core.errors import UsageError


@dataclass(frozen=True)
class Backoff:
    """Exponential backoff: ``base * factor**attempt`` seconds, at most ``cap``, less jitter."""

    base: float = 0.1
    factor: float = 2.0
    cap: float = 30.0
    jitter: float = 0.5  # share of each delay that is random: 0 = none, 1 = "full jitter"

    def __post_init__(self) -> None:
        if not (self.base > 0 and self.factor >= 1 and self.cap >= self.base
                and 0 <= self.jitter <= 1):
            raise UsageError(f"backoff {self}: need base > 0, factor >= 1, cap >= base and "
                             "0 <= jitter <= 1")

    def ceiling(self, attempt: int) -> float:
        """The delay before retry ``attempt`` (0-based) without jitter."""
        if attempt < 0:
            raise UsageError(f"attempt {attempt} must be >= 0")
        try:
            return min(self.cap, self.base * self.factor ** attempt)
        except OverflowError:
            return self.cap

    def delay(self, attempt: int, u: float) -> float:
        """The delay before retry ``attempt``, given ``u`` drawn uniformly from [0, 1).

        It lies in ``(ceiling * (1 - jitter), ceiling]``; ``u = 0`` gives the ceiling.
        """
        if not 0 <= u < 1:
            raise UsageError(f"u = {u} must lie in [0, 1)")
        return self.ceiling(attempt) * (1 - self.jitter * u)

    def delays(self, attempts: int | None = None,
               rng: random.Random | None = None) -> Iterator[float]:
        """Successive delays (endless when ``attempts`` is None), drawn with ``rng``."""
        rng = rng or random.Random()
        attempt = 0
        while attempts is None or attempt < attempts:
            yield self.delay(attempt, rng.random())
            attempt += 1
