"""A progress display that suits where it goes: tqdm's bar on a terminal; elsewhere (a
log file, a pipe, CI) a plain line every few seconds and one at the end, since a bar
redrawn with carriage returns makes one unreadable line of a log. Every bar offload
draws is one of these: loading, writing the weight store, a job, `LLM.generate`."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any, TextIO, TypeVar

from offload.core.outputs import GenerationStats

PLAIN_EVERY_S = 5.0  # between plain lines: a log stays readable, a stall shows within seconds
TICK_S = 1.0  # between a bar's redraws within an item (a decode step calls `tick`)


T = TypeVar("T")


def is_terminal(stream: Any) -> bool:
    isatty = getattr(stream, "isatty", None)
    return bool(isatty and isatty())


class Progress:
    """`done` of `total` items, with a short status after them. bar_factory: a tqdm-like
    class to draw with (vLLM's `use_tqdm` may be one), wherever the stream goes; clock:
    seconds, for the plain lines' spacing (tests pass their own)."""

    def __init__(
        self,
        total: int,
        desc: str,
        unit: str = "req",
        initial: int = 0,
        stream: TextIO | None = None,
        every_s: float | None = None,
        clock: Callable[[], float] | None = None,
        bar_factory: Callable[..., Any] | None = None,
    ) -> None:
        self.stream = stream if stream is not None else sys.stderr
        self.total, self.desc, self.unit = total, desc, unit
        self.done, self.status = initial, ""
        self.every_s = PLAIN_EVERY_S if every_s is None else every_s
        self.clock = clock or time.monotonic
        self.started = self.last_line = self.last_tick = self.clock()
        self.bar = None
        if bar_factory is not None or is_terminal(self.stream):
            where = {} if bar_factory is not None else {"file": self.stream}  # (a factory's own)
            if bar_factory is None:
                from tqdm import tqdm as bar_factory
            self.bar = bar_factory(
                total=total, initial=initial, desc=desc, unit=unit, dynamic_ncols=True, **where
            )

    def update(self, done: int | None = None, status: str | None = None) -> None:
        self.done = self.done if done is None else done
        self.status = self.status if status is None else status
        if self.bar is not None:
            self.bar.n = self.done
            self.bar.set_postfix_str(self.status, refresh=True)
        elif self.clock() - self.last_line >= self.every_s:
            self._line()

    def tick(self, status: Callable[[], str]) -> None:
        """Within an item (a decode step): a new status at most once a `TICK_S` on a bar,
        once a plain line's spacing elsewhere; else only a clock read, so a step may call
        it."""
        now = self.clock()
        if now - self.last_tick < (TICK_S if self.bar is not None else self.every_s):
            return
        self.last_tick = now
        self.update(status=status())

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        else:
            self._line()

    def _line(self) -> None:
        self.last_line = now = self.clock()
        share = f" ({100 * self.done / self.total:.0f}%)" if self.total else ""
        status = f", {self.status}" if self.status else ""
        print(
            f"{self.desc}: {self.done}/{self.total}{share}{status}, {now - self.started:.0f} s",
            file=self.stream,
            flush=True,
        )


def tracked(items: Iterable[T], total: int, desc: str, unit: str) -> Iterator[T]:
    """The items, with a `Progress` of how many have been taken."""
    bar = Progress(total, desc, unit)
    try:
        for done, item in enumerate(items, 1):
            yield item
            bar.update(done)
    finally:
        bar.close()


class PromptsBar(Progress):
    """`LLM.generate`'s and `chat`'s bar (vLLM's `use_tqdm`): prompts done, and the
    call's tokens and rate."""

    def __init__(
        self, total: int, stats: GenerationStats, bar_factory: Callable[..., Any] | None = None
    ) -> None:
        super().__init__(total, "Processed prompts", "prompt", bar_factory=bar_factory)
        self.stats, self.tokens0, self.seconds0 = stats, stats.generated_tokens, stats.seconds
        self.steps = 0

    def on_batch(self, done: int) -> None:
        tokens = self.stats.generated_tokens - self.tokens0
        seconds = self.stats.seconds - self.seconds0
        self.update(done, f"{tokens} tok, {tokens / max(seconds, 1e-9):.1f} tok/s")

    def on_step(self) -> None:
        """A decode step: within a block, the tokens so far and the step rate (the
        stats' seconds are counted at a block's end: the clock here is the bar's)."""
        self.steps += 1
        self.tick(self._within_block)

    def _within_block(self) -> str:
        tokens = self.stats.generated_tokens - self.tokens0
        seconds = max(self.clock() - self.started, 1e-9)
        return f"{tokens} tok, {self.steps / seconds:.2f} steps/s"
