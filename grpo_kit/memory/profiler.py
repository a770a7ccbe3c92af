"""Measured memory per phase: CUDA allocator statistics on a GPU, resident set size on the CPU.

    prof = Profiler()                       # device: "cuda" when available, else "cpu"
    with prof:
        with prof.phase("forward"):
            loss = model(x).sum()
        with prof.phase("backward"):
            loss.backward()
    prof.table()                            # one row per phase (+ "total")

or ``result = profile(fn, *args, **kwargs)``: runs ``fn`` under a profiler; inside ``fn``, code
may open phases with ``grpo_kit.memory.phase("name")`` (a no-op when no profiler is active).

CUDA: each phase resets the peak statistics at its start and reads
``torch.cuda.max_memory_allocated`` / ``max_memory_reserved`` at its end; enclosing phases keep
their own running maximum, so nesting is exact. ``snapshot=True`` also records the allocator
history (``torch.cuda.memory._record_memory_history``) and keeps ``torch.cuda.memory._snapshot()``
(open it at https://pytorch.org/memory_viz); :func:`live_at_peak` reads from it what was allocated at the largest
moment of the history, grouped by the line that allocated it.

CPU: a daemon thread samples the process RSS (psutil) every ``interval`` seconds; a phase's peak
is the largest sample (or boundary reading) inside it. Short spikes between samples can be missed;
the RSS also counts memory the allocator keeps for reuse.
"""

from __future__ import annotations

import contextlib
import contextvars
import threading
import time
from dataclasses import dataclass, field

import pandas as pd
import psutil
import torch

from grpo_kit.memory.formulas import GiB

_ACTIVE: contextvars.ContextVar[Profiler | None] = contextvars.ContextVar("grpo_kit_memory_profiler", default=None)


def _rss() -> int:
    return psutil.Process().memory_info().rss


@dataclass
class _Phase:
    name: str
    start_s: float
    start: int
    peak: int
    peak_reserved: int = 0
    end: int | None = None
    end_s: float | None = None
    depth: int = 0


class _Sampler(threading.Thread):
    """Samples RSS into every open phase's running peak."""

    def __init__(self, prof: Profiler, interval: float):
        super().__init__(daemon=True, name="grpo_kit-rss-sampler")
        self.prof, self.interval = prof, interval
        self.stop_event = threading.Event()

    def run(self):
        while not self.stop_event.wait(self.interval):
            self.prof._observe(_rss())


@dataclass
class ProfileResult:
    """What :func:`profile` returns: ``fn``'s return value, the phase table, the snapshot."""

    value: object
    table: pd.DataFrame
    snapshot: dict | None = None
    device: str = "cpu"

    def peak_gib(self, phase: str = "total") -> float:
        row = self.table.loc[self.table["phase"] == phase]
        if row.empty:
            raise ValueError(f"phase={phase!r} not recorded; recorded: {list(self.table['phase'])}")
        return float(row["peak_GiB"].iloc[0])


@dataclass
class Profiler:
    """Peak memory per phase; see the module docstring. ``device``: ``"cpu"``, ``"cuda"`` or
    ``"cuda:N"`` (None: cuda when available)."""

    device: str | None = None
    interval: float = 0.002
    snapshot: bool = False
    max_entries: int = 100_000
    phases: list = field(default_factory=list)

    def __post_init__(self):
        if self.device is None:
            self.device = "cuda" if torch.cuda.is_available() else "cpu"
        if not isinstance(self.device, str) or not (self.device == "cpu" or self.device.startswith("cuda")):
            raise ValueError(f"device must be 'cpu', 'cuda' or 'cuda:N', got {self.device!r}")
        if self.device.startswith("cuda") and not torch.cuda.is_available():
            raise ValueError(f"device={self.device!r} but CUDA is not available")
        if not (isinstance(self.interval, (int, float)) and 0 < self.interval <= 1):
            raise ValueError(f"interval must be a number of seconds in (0, 1], got {self.interval!r}")
        self._open: list[_Phase] = []
        self._lock = threading.Lock()
        self._sampler: _Sampler | None = None
        self._token = None
        self._snapshot = None

    # ------------------------------------------------------------------ readings
    @property
    def cuda(self) -> bool:
        return self.device.startswith("cuda")

    def _now(self) -> int:
        if self.cuda:
            torch.cuda.synchronize(self.device)
            return torch.cuda.memory_allocated(self.device)
        return _rss()

    def _observe(self, value: int):
        with self._lock:
            for ph in self._open:
                ph.peak = max(ph.peak, value)

    def _fold_cuda_peak(self):
        """Fold the allocator's peak since the last reset into every open phase, then reset."""
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device)
        reserved = torch.cuda.max_memory_reserved(self.device)
        for ph in self._open:
            ph.peak = max(ph.peak, peak)
            ph.peak_reserved = max(ph.peak_reserved, reserved)
        torch.cuda.reset_peak_memory_stats(self.device)

    # ------------------------------------------------------------------ phases
    @contextlib.contextmanager
    def phase(self, name: str):
        """Measure the enclosed block as phase ``name`` (phases may nest)."""
        if not isinstance(name, str) or not name:
            raise ValueError(f"phase name must be a non-empty string, got {name!r}")
        if self.cuda:
            self._fold_cuda_peak()
        now = self._now()
        ph = _Phase(name=name, start_s=time.perf_counter(), start=now, peak=now, depth=len(self._open))
        with self._lock:
            self._open.append(ph)
        try:
            yield ph
        finally:
            if self.cuda:
                self._fold_cuda_peak()
            end = self._now()
            with self._lock:
                self._open.remove(ph)
            ph.end, ph.end_s = end, time.perf_counter()
            ph.peak = max(ph.peak, end)
            for outer in self._open:  # a sample may have landed only in the inner phase
                outer.peak = max(outer.peak, ph.peak)
            self.phases.append(ph)

    def __enter__(self):
        if self.cuda:
            torch.cuda.synchronize(self.device)
            if self.snapshot:
                torch.cuda.memory._record_memory_history(max_entries=self.max_entries)
        else:
            self._sampler = _Sampler(self, self.interval)
        self._total_cm = self.phase("total")
        self._total_cm.__enter__()
        if self._sampler is not None:
            self._sampler.start()
        self._token = _ACTIVE.set(self)
        return self

    def __exit__(self, *exc):
        _ACTIVE.reset(self._token)
        self._total_cm.__exit__(*exc)
        if self._sampler is not None:
            self._sampler.stop_event.set()
            self._sampler.join()
        if self.cuda and self.snapshot:
            self._snapshot = torch.cuda.memory._snapshot()
            torch.cuda.memory._record_memory_history(enabled=None)
        return False

    def memory_snapshot(self) -> dict | None:
        """The allocator snapshot (``snapshot=True`` on CUDA), else None."""
        return self._snapshot

    def table(self) -> pd.DataFrame:
        """One row per finished phase in start order: ``phase, depth, device, start_GiB, end_GiB,
        peak_GiB, peak_over_start_GiB, peak_reserved_GiB`` (CUDA only, else NaN), ``seconds``."""
        rows = []
        for ph in sorted(self.phases, key=lambda p: p.start_s):
            rows.append(
                dict(
                    phase=ph.name,
                    depth=ph.depth,
                    device=self.device,
                    start_GiB=ph.start / GiB,
                    end_GiB=ph.end / GiB,
                    peak_GiB=ph.peak / GiB,
                    peak_over_start_GiB=(ph.peak - ph.start) / GiB,
                    peak_reserved_GiB=ph.peak_reserved / GiB if self.cuda else float("nan"),
                    seconds=ph.end_s - ph.start_s,
                )
            )
        return pd.DataFrame(
            rows,
            columns=[
                "phase",
                "depth",
                "device",
                "start_GiB",
                "end_GiB",
                "peak_GiB",
                "peak_over_start_GiB",
                "peak_reserved_GiB",
                "seconds",
            ],
        )


# frames inside these (path fragments) are the allocator's machinery, not the code that asked for the memory
_MACHINERY = ("/torch/", "<frozen ", "<string>")


def _where(frames: list[dict] | None) -> str:
    """``file:line (function)`` of the innermost frame outside torch itself, the path from its package on (None:
    a block the history never saw allocated)."""
    if frames is None:  # a block the history did not see allocated (before the recording began)
        return "(allocated before the recording)"
    for f in frames:
        name = f.get("filename", "")
        if name and not any(m in name for m in _MACHINERY):
            short = name.split("site-packages/")[-1]
            for root in ("/grpo_kit/", "/bench/", "/tests/"):
                if root in short:
                    short = root.lstrip("/") + short.split(root, 1)[1]
                    break
            return f"{short}:{f.get('line', '?')} ({f.get('name', '?')})"
    return "(no Python frame outside torch)"


# a block freed but waiting on another stream: torch writes the first, its type hints name the second
_PENDING_FREE = ("active_pending_free", "active_awaiting_free")


def _live_at_end(snapshot: dict, device: int, free_action: str) -> dict[int, dict] | None:
    """``{address: {"size"}}`` of the blocks allocated when ``snapshot`` was taken (its ``segments``; a free still
    waiting on its stream counts as live where the history records completions), or None without segments."""
    if "segments" not in snapshot:
        return None
    states = ("active_allocated", *_PENDING_FREE) if free_action == "free_completed" else ("active_allocated",)
    return {
        b["address"]: {"size": b["size"]}
        for seg in snapshot["segments"]
        if seg.get("device", 0) == device
        for b in seg.get("blocks", [])
        if b.get("state") in states
    }


def live_at_peak(snapshot: dict, *, device: int = 0, top: int = 20) -> dict:
    """What the allocator had handed out at the largest moment of a recorded history (``snapshot``: the dict of
    ``torch.cuda.memory._snapshot()`` after ``_record_memory_history``, as :class:`Profiler` keeps it with
    ``snapshot=True``).

    Replays ``device_traces[device]``, ``alloc`` adding a block and its free removing it (``free_completed``, or
    ``free_requested`` in a history without completions). With the snapshot's ``segments`` (what torch writes) the
    replay runs backwards from the blocks live when the snapshot was taken, so the figures are absolute: blocks
    allocated before the recording began (or before a full ring buffer's first kept event) count too, under
    ``"(allocated before the recording)"``, and so do blocks of private memory pools, as the allocator
    sees them (an engine's pool that is unmapped in standby still counts). Without segments (a hand-made history)
    only the recorded allocations count: frees of earlier blocks are ignored.

    Returns ``{"peak_gib": live GiB at the peak, "event": the index of the event after which it was reached (-1,
    in the backward replay: before the first; 0 for an empty forward one), "events": the trace's length,
    "absolute": whether segments were read, "allocations": [{"where", "blocks", "gib"}, ...]}``, the live blocks at
    the peak grouped by :func:`_where` (the innermost frame outside torch), largest first, at most ``top`` groups.
    An empty history without segments gives ``peak_gib`` 0 and no allocations."""
    traces = snapshot.get("device_traces") or []
    events = traces[device] if device < len(traces) else []
    free_action = "free_completed" if any(e.get("action") == "free_completed" for e in events) else "free_requested"
    end = _live_at_end(snapshot, device, free_action)
    if end is None:
        peak_at, peak_blocks = _peak_blocks_forward(events, free_action)
    else:
        peak_at, peak_blocks = _peak_blocks_backward(events, free_action, end)
    groups: dict[str, list] = {}
    for blk in peak_blocks:
        g = groups.setdefault(_where(blk.get("frames", [])), [0, 0])  # None: made before the recording
        g[0] += 1
        g[1] += blk["size"]
    rows = sorted(
        ({"where": k, "blocks": n, "gib": round(b / GiB, 4)} for k, (n, b) in groups.items()), key=lambda r: -r["gib"]
    )
    peak = sum(b["size"] for b in peak_blocks)
    return {
        "peak_gib": round(peak / GiB, 4),
        "event": peak_at,
        "events": len(events),
        "absolute": end is not None,
        "allocations": rows[:top],
    }


def _peak_blocks_forward(events: list[dict], free_action: str) -> tuple[int, list[dict]]:
    """(event index, live blocks) at the largest total of the recorded allocations, replayed forwards."""
    live: dict[int, dict] = {}
    size = peak = peak_at = 0
    peak_blocks: list[dict] | None = []  # None: a new peak whose blocks are still the live ones
    for i, e in enumerate(events):
        action = e.get("action")
        if action == "alloc":
            live[e["addr"]] = e
            size += e["size"]
            if size > peak:  # the grouping is made once, at the end: keep the peak's blocks, not a copy per event
                peak, peak_at, peak_blocks = size, i, None
        elif action == free_action and e.get("addr") in live:
            if peak_blocks is None:  # the first free after a new peak: the peak's blocks are those live now
                peak_blocks = list(live.values())
            size -= live.pop(e["addr"])["size"]
    return peak_at, list(live.values()) if peak_blocks is None else peak_blocks


def _peak_blocks_backward(events: list[dict], free_action: str, end: dict[int, dict]) -> tuple[int, list[dict]]:
    """(event index, live blocks) at the largest total, replayed backwards from ``end``, the blocks live after
    the last event: undoing an ``alloc`` removes its block, undoing a free puts it back. A block carries the frames
    of the ``alloc`` that made it where the history has one, else ``frames`` None (made before the recording).
    The earliest of equal peaks."""
    made_by: dict[int, dict | None] = {}  # free event index -> the alloc event of its block, where recorded
    open_allocs: dict[int, dict] = {}
    for i, e in enumerate(events):
        if e.get("action") == "alloc":
            open_allocs[e["addr"]] = e
        elif e.get("action") == free_action:
            made_by[i] = open_allocs.pop(e.get("addr"), None)
    # the blocks live at the end: those still open were allocated inside the window
    at_end = {
        a: {"size": b["size"], "frames": (open_allocs[a].get("frames") or []) if a in open_allocs else None}
        for a, b in end.items()
    }

    def undo(live: dict, i: int) -> int:
        """``live``: the blocks after event i, made those before it; returns the change in bytes."""
        e, action = events[i], events[i].get("action")
        if action == "alloc":
            return -live.pop(e["addr"], {"size": 0})["size"]
        if action == free_action:
            alloc = made_by[i]
            live[e["addr"]] = {"size": e["size"], "frames": None if alloc is None else alloc.get("frames") or []}
            return e["size"]
        return 0

    live = dict(at_end)
    size = sum(b["size"] for b in live.values())
    peak, peak_at = size, len(events) - 1
    for i in range(len(events) - 1, -1, -1):
        size += undo(live, i)  # now the size before event i, i.e. after event i - 1
        if size >= peak:
            peak, peak_at = size, i - 1
    live = dict(at_end)  # again to the peak, now keeping the blocks
    for i in range(len(events) - 1, peak_at, -1):
        undo(live, i)
    return peak_at, list(live.values())


@contextlib.contextmanager
def phase(name: str):
    """Open phase ``name`` on the active :class:`Profiler` (the one :func:`profile` runs); a
    no-op when none is active, so library code can mark phases unconditionally."""
    prof = _ACTIVE.get()
    if prof is None:
        yield None
        return
    with prof.phase(name) as ph:
        yield ph


def profile(
    fn, *args, device: str | None = None, interval: float = 0.002, snapshot: bool = False, **kwargs
) -> ProfileResult:
    """Run ``fn(*args, **kwargs)`` and measure its memory: phase ``total`` plus any phases ``fn``
    opens with :func:`phase`. Returns a :class:`ProfileResult` (``.value``, ``.table``,
    ``.snapshot``). ``device``/``interval``/``snapshot`` as for :class:`Profiler`."""
    if not callable(fn):
        raise ValueError(f"fn must be callable, got {type(fn).__name__}")
    prof = Profiler(device=device, interval=interval, snapshot=snapshot)
    with prof:
        value = fn(*args, **kwargs)
    return ProfileResult(value=value, table=prof.table(), snapshot=prof.memory_snapshot(), device=prof.device)
