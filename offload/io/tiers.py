"""The three tiers and the accounting of bytes held in each."""

from __future__ import annotations

import enum
import threading


class Tier(enum.Enum):
    GPU = "gpu"
    CPU = "cpu"
    DISK = "disk"


class MemoryLedger:
    """Bytes in use and peak bytes per tier; thread-safe. The engine reads it for reports."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._used = dict.fromkeys(Tier, 0)
        self._peak = dict.fromkeys(Tier, 0)

    def add(self, tier: Tier, nbytes: int) -> None:
        with self._lock:
            self._used[tier] += nbytes
            self._peak[tier] = max(self._peak[tier], self._used[tier])

    def release(self, tier: Tier, nbytes: int) -> None:
        with self._lock:
            assert self._used[tier] >= nbytes, (
                f"releasing {nbytes} B but {tier} holds {self._used[tier]}"
            )
            self._used[tier] -= nbytes

    def used(self, tier: Tier) -> int:
        return self._used[tier]

    def peak(self, tier: Tier) -> int:
        return self._peak[tier]

    def snapshot(self) -> dict[str, dict[str, int]]:
        with self._lock:
            return {t.value: {"used": self._used[t], "peak": self._peak[t]} for t in Tier}
