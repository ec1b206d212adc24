"""Clocks: the engine's one time base. Live serving uses the wall clock; the
simulator injects a VirtualClock that the simulated executor advances by each
iteration's profiled cost, so the same engine code runs in both."""

from __future__ import annotations

import time


class WallClock:
    def now(self) -> float:
        return time.monotonic()


class VirtualClock:
    def __init__(self, start: float = 0.0) -> None:
        self._now = start

    def now(self) -> float:
        return self._now

    def advance(self, seconds: float) -> None:
        if seconds < 0:
            raise ValueError(f"a clock cannot go back ({seconds} s)")
        self._now += seconds
