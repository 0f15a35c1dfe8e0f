"""Lanes of work that overlap: compute, host -> GPU, GPU -> host, disk, CPU attention.

On CUDA each copy lane is its own stream and ordering between lanes is by events; on
a machine without CUDA every lane runs inline on the CPU (the same code, in order),
which is what the CPU tests exercise. The tracer records every operation per lane
for the Chrome/Perfetto trace and the per-lane busy times.
"""

from __future__ import annotations

import contextlib
import json
import re
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch

from offload.io.atomic import atomic_write

LANES = (
    "compute", "h2d", "h2d_kv", "d2h", "disk", "cpu_attn", "cpu_copy", "host_wait", "allreduce",
)  # fmt: skip
LANES += ("cpu_expert",)  # a mixture of experts' experts computed on the CPU
# lanes that share one physical link: their union is the link's busy time
LINKS = {"pcie_h2d": ("h2d", "h2d_kv")}


@dataclass
class _Span:
    lane: str
    name: str
    start: float | torch.cuda.Event
    end: float | torch.cuda.Event
    nbytes: int = 0


@dataclass
class Tracer:
    """Collects spans; device spans hold CUDA events resolved when the step ends."""

    enabled: bool = False
    # with tracing asked for (`enabled` at construction): one step traced in `every`
    # (`next_step`), the others run untraced (and replay CUDA graphs where they can)
    every: int = 1
    spans: list[_Span] = field(default_factory=list)
    _base_event: torch.cuda.Event | None = None
    _base_time: float = 0.0
    _asked: bool = False
    _steps: int = 0

    def __post_init__(self) -> None:
        self._asked = self.enabled

    @property
    def asked(self) -> bool:
        """Whether a trace was asked for (some steps record spans)."""
        return self._asked

    def next_step(self) -> None:
        """A step starts: sampled tracing records one step in `every` (from the first)."""
        if self._asked and self.every > 1:
            self.enabled = self._steps % self.every == 0
            self._steps += 1

    def begin(self, cuda: bool) -> None:
        self._base_time = time.perf_counter()
        if cuda and self.enabled:
            self._base_event = torch.cuda.Event(enable_timing=True)
            self._base_event.record()

    def host_span(
        self,
        lane: str,
        name: str,
        start: float | torch.cuda.Event,
        end: float | torch.cuda.Event,
        nbytes: int = 0,
    ) -> None:
        """A span timed by the caller: host seconds, or CUDA events on a stream."""
        if self.enabled:
            self.spans.append(_Span(lane, name, start, end, nbytes))

    def resolved(self) -> list[tuple[str, str, float, float, int]]:
        """(lane, name, start s, end s, bytes) relative to begin(); syncs the device once."""
        out = []
        if any(isinstance(s.start, torch.cuda.Event) for s in self.spans):
            torch.cuda.synchronize()
        for s in self.spans:
            if isinstance(s.start, torch.cuda.Event):
                assert self._base_event is not None
                start = self._base_event.elapsed_time(s.start) / 1e3
                end = self._base_event.elapsed_time(s.end) / 1e3
            else:
                start, end = s.start - self._base_time, s.end - self._base_time
            out.append((s.lane, s.name, start, end, s.nbytes))
        return out

    def write_chrome(
        self, path: Path, spans: list[tuple[str, str, float, float, int]] | None = None
    ) -> None:
        """The spans (by default this step's) as a Chrome/Perfetto trace."""
        lanes = {lane: i for i, lane in enumerate(LANES)}
        events = [
            {
                "name": name,
                "ph": "X",
                "pid": 0,
                "tid": lanes[lane],
                "ts": start * 1e6,
                "dur": max(end - start, 0) * 1e6,
                "args": {"bytes": nbytes},
            }
            for lane, name, start, end, nbytes in (self.resolved() if spans is None else spans)
        ]
        events += [
            {"name": "thread_name", "ph": "M", "pid": 0, "tid": i, "args": {"name": lane}}
            for lane, i in lanes.items()
        ]
        # as every report the run writes: atomically, its missing folders made (the rule
        # `check_writable` judges the path by before the run)
        atomic_write(path, json.dumps({"traceEvents": events}))


def read_chrome(path: Path) -> list[tuple[str, str, float, float, int]]:
    """The spans (lane, name, start s, end s, bytes) of a trace `Tracer.write_chrome` wrote."""
    events = json.loads(path.read_text())["traceEvents"]
    lanes = {e["tid"]: e["args"]["name"] for e in events if e.get("ph") == "M"}
    return [
        (
            lanes.get(e["tid"], str(e["tid"])),
            e["name"],
            e["ts"] / 1e6,
            (e["ts"] + e["dur"]) / 1e6,
            e.get("args", {}).get("bytes", 0),
        )
        for e in events
        if e.get("ph") == "X"
    ]


def layer_timeline(spans: list[tuple[str, str, float, float, int]]) -> dict:
    """Per layer of one step: when its weights crossed, its compute ran, its KV loads
    and disk reads ran, and how long the host thread blocked on its blocks."""
    per: dict[int, dict[str, list[tuple[float, float]]]] = {}
    for lane, name, start, end, _ in spans:
        m = re.search(r"L(\d+) ", name + " ") or re.search(r"layer\.(\d+)", name)
        if m is None:
            continue
        per.setdefault(int(m.group(1)), {}).setdefault(lane, []).append((start, end))
    lanes = ("h2d", "compute", "h2d_kv", "disk", "host_wait")
    rows = []
    for layer in sorted(per):
        cells = [f"L{layer:<3d}"]
        for lane in lanes:
            got = per[layer].get(lane, [])
            if not got:
                cells.append(f"{lane} -")
                continue
            first, last = min(s for s, _ in got), max(e for _, e in got)
            busy = sum(e - s for s, e in got)
            cells.append(f"{lane} {first * 1e3:7.1f}-{last * 1e3:7.1f} ({busy * 1e3:5.1f})")
        rows.append("  ".join(cells))
    return {"legend": "lane first start-last end (sum of spans)", "rows": rows}


def busy_seconds(spans: list[tuple[str, str, float, float, int]]) -> dict[str, dict[str, float]]:
    """Per lane, and per shared link (LINKS): busy time (union of its spans) and bytes moved."""
    out = {}
    groups = {lane: (lane,) for lane in LANES} | LINKS
    for lane, members in groups.items():
        intervals = sorted((s, e) for ln, _, s, e, _ in spans if ln in members)
        busy, cur_s, cur_e = 0.0, None, None
        for s, e in intervals:
            if cur_e is None or s > cur_e:
                if cur_e is not None:
                    busy += cur_e - cur_s
                cur_s, cur_e = s, e
            else:
                cur_e = max(cur_e, e)
        if cur_e is not None:
            busy += cur_e - cur_s
        nbytes = sum(b for ln, _, _, _, b in spans if ln in members)
        out[lane] = {"busy_s": busy, "bytes": nbytes}
    return out


class Lanes:
    """Streams for the copy lanes on CUDA; inline execution elsewhere."""

    def __init__(self, device: torch.device, tracer: Tracer) -> None:
        self.device = device
        self.cuda = device.type == "cuda"
        self.tracer = tracer
        self.h2d = torch.cuda.Stream(device) if self.cuda else None
        # KV loads are traced as their own lane but share the weights' stream: the copy
        # engine drains one stream's queue before it turns to another's, so the order
        # of copies on one stream is the only order there is (a layer's KV loads go
        # before the next layer's weights: `KVManager.load_layer`). On a stream of
        # their own they waited for a whole queued weight copy (BLOOM-176B, H100 and
        # H200; docs/executor.md)
        self.h2d_kv = self.h2d
        self.d2h = torch.cuda.Stream(device) if self.cuda else None
        self._copy_lanes = {"h2d": self.h2d, "h2d_kv": self.h2d_kv, "d2h": self.d2h}
        # the device by number: `torch.cuda.current_stream` resolves a torch.device
        # through several Python calls (about 800 a decode step of Llama-3.1-8B with
        # two micro-batches of off-GPU KV, H100 profile; docs/executor.md)
        self._index = None
        if self.cuda:
            self._index = device.index if device.index is not None else torch.cuda.current_device()

    def stream(self, lane: str):
        if not self.cuda:
            return None
        if lane == "compute":  # whichever is current (a graph capture's, during one)
            return torch.cuda.current_stream(self._index)
        return self._copy_lanes[lane]

    @contextlib.contextmanager
    def on(self, lane: str, name: str = "", nbytes: int = 0) -> Iterator[None]:
        """Run the enclosed work on `lane`'s stream (traced when tracing is on)."""
        if lane == "compute" and self.cuda and not self.tracer.enabled:
            yield  # already the current stream: switching to it costs host time, nothing else
            return
        stream = self.stream(lane)
        if stream is None:
            start = time.perf_counter()
            yield
            self.tracer.host_span(lane, name, start, time.perf_counter(), nbytes)
            return
        with torch.cuda.stream(stream):
            start_ev = end_ev = None
            if self.tracer.enabled:
                start_ev = torch.cuda.Event(enable_timing=True)
                start_ev.record(stream)
            yield
            if start_ev is not None:
                end_ev = torch.cuda.Event(enable_timing=True)
                end_ev.record(stream)
                self.tracer.spans.append(_Span(lane, name, start_ev, end_ev, nbytes))

    def keep(self, tensor: torch.Tensor, lane: str) -> None:
        """Tell the CUDA allocator that `lane` still reads tensor: its memory is not
        reused by another stream's allocations until that work is done."""
        stream = self.stream(lane)
        if stream is not None:
            tensor.record_stream(stream)

    def record(self, lane: str) -> torch.cuda.Event | None:
        stream = self.stream(lane)
        if stream is None:
            return None
        event = torch.cuda.Event()
        event.record(stream)
        return event

    def wait(self, lane: str, event: torch.cuda.Event | None) -> None:
        """Make `lane` wait for event (GPU-side; the host does not block)."""
        stream = self.stream(lane)
        if stream is not None and event is not None:
            stream.wait_event(event)

    @contextlib.contextmanager
    def blocked(self, name: str) -> Iterator[None]:
        """The host thread blocks in the enclosed code (waiting for a worker's future):
        traced on the host_wait lane, where a stall of the launch thread shows."""
        start = time.perf_counter()
        yield
        self.tracer.host_span("host_wait", name, start, time.perf_counter())

    def host_wait(self, event: torch.cuda.Event | None) -> None:
        """Block the host until one event completes (never a device-wide sync)."""
        if event is not None:
            event.synchronize()
