"""Where device time goes: a `jax.profiler` trace of a piece of work, summed by program and op class.

    with DeviceTrace() as trace:
        run_some_steps()
    summary = trace.summary()        # busy and span seconds, seconds per (program, op class), the longest kernels

XLA tags each kernel it runs with its HLO instruction (`hlo_op`) and program (`hlo_module`): on a GPU the kernels
on the device's streams, on a CPU the thunks on the client's threads. Those events are the device's work; their
union over the traced window is the busy time, and the window less that is the time the device waited (for the
host, on an engine). The window is an annotation on the host's timeline, and kernels are cut to it: an engine
dispatches ahead, so a whole call of kernels may run before or after the host's steps in it (the first H200 run,
uncut, counted 19-23% more busy time than wall time). Each event's class comes from its kernel and instruction
names: matmuls (cuBLAS/cuDNN/XLA gemms, dots), attention (the Pallas kernels and Sluice's CPU kernels), copies
(copy, transpose, slicing updates, gathers and scatters, memcpy/memset), reductions and elementwise fusions
(norms, rotary, activations, the sampler's math), and other. Control-flow thunks (a while loop around the layers)
hold their body's kernels, so they are left out of the sums, not out of the busy time.
"""

from __future__ import annotations

import glob
import re
import tempfile
from collections import defaultdict
from contextlib import contextmanager
from dataclasses import dataclass, field, replace

import jax
from jax.profiler import ProfileData

CLASSES = ("matmul", "attention", "copy", "fusion", "other")
_PATTERNS = (
    ("matmul", re.compile(r"gemm|xmma|nvjet|cutlass|cublas|cudnn|matmul|\bdot|convolution|ynn", re.I)),
    ("attention", re.compile(r"attention|attend|paged|mosaic|pallas", re.I)),
    ("copy", re.compile(r"copy|transpose|dynamic[-_]update|dynamic[-_]slice|gather|scatter|memcpy|memset|concat",
                        re.I)),
    ("fusion", re.compile(r"fusion|reduce|convert|add|multiply|exp|rsqrt|select|compare|iota|broadcast", re.I)),
)
_CONTROL_FLOW = re.compile(r"^(while|conditional|call)(\.|$)")
_TRACED, _WINDOW = "sluice-traced", "sluice-traced-window"
TOP_OPS = 24  # the longest kernels a summary names


def op_class(kernel: str, hlo_op: str) -> str:
    """The class of one kernel (its name on the device, e.g. `sm90_xmma_gemm_bf16...`) running `hlo_op`."""
    for name, pattern in _PATTERNS:
        if pattern.search(kernel) or pattern.search(hlo_op):
            return name
    return "other"


@dataclass(frozen=True)
class DeviceEvent:
    """One kernel (or CPU thunk) run: nanoseconds from the trace's start, and what XLA ran."""

    start_ns: float
    duration_ns: float
    kernel: str
    hlo_op: str
    program: str


@dataclass
class ProfileSummary:
    """A traced window: its wall time, the device's busy time in it (union of kernel intervals), and seconds per
    (program, op class) and per op class. `steps` (set by the caller) turns them into per-step figures."""

    span_s: float
    busy_s: float
    by_program: dict[str, dict[str, float]] = field(default_factory=dict)
    by_class: dict[str, float] = field(default_factory=dict)
    top_ops: list[dict] = field(default_factory=list)  # the longest kernels: class, kernel, hlo_op, runs, seconds

    @property
    def busy_share(self) -> float:
        return self.busy_s / self.span_s if self.span_s > 0 else 0.0

    def as_dict(self, steps: int = 1) -> dict:
        """Figures in milliseconds per step (`steps` steps in the window)."""
        ms = lambda s: 1e3 * s / max(steps, 1)
        return dict(steps=steps, span_ms=ms(self.span_s), busy_ms=ms(self.busy_s), busy_share=self.busy_share,
                    by_class_ms={k: ms(v) for k, v in self.by_class.items()},
                    by_program_ms={p: {k: ms(v) for k, v in c.items()} for p, c in self.by_program.items()},
                    top_ops=[dict(op_class=op["op_class"], kernel=op["kernel"], hlo_op=op["hlo_op"],
                                  runs=op["runs"] / max(steps, 1), ms=ms(op["seconds"])) for op in self.top_ops])


def device_events(profile: ProfileData) -> list[DeviceEvent]:
    """The events that carry an `hlo_op`: from the GPU planes when there are any, else from the host's."""
    planes = [p for p in profile.planes if p.name.startswith("/device:GPU")]
    planes = planes or [p for p in profile.planes if p.name.startswith("/host:CPU")]
    events = []
    for plane in planes:
        for line in plane.lines:
            for event in line.events:
                stats = dict(event.stats)
                if "hlo_op" in stats:
                    events.append(DeviceEvent(event.start_ns, event.duration_ns, event.name, str(stats["hlo_op"]),
                                              str(stats.get("hlo_module", "?"))))
    return events


def summarize(events: list[DeviceEvent], window_ns: tuple[float, float]) -> ProfileSummary:
    """Busy time (interval union) in the window [start, stop), and the class sums without control-flow events, of
    the events cut to the window."""
    lo, hi = window_ns
    cut = [replace(e, start_ns=max(e.start_ns, lo),
                   duration_ns=min(e.start_ns + e.duration_ns, hi) - max(e.start_ns, lo)) for e in events]
    cut = [e for e in cut if e.duration_ns > 0]
    busy, end = 0.0, float("-inf")
    for e in sorted(cut, key=lambda e: e.start_ns):
        stop = e.start_ns + e.duration_ns
        if stop > end:
            busy += stop - max(e.start_ns, end)
            end = stop
    by_program: dict[str, dict[str, float]] = defaultdict(lambda: dict.fromkeys(CLASSES, 0.0))
    by_class = dict.fromkeys(CLASSES, 0.0)
    by_op: dict[tuple[str, str, str], list] = defaultdict(lambda: [0, 0.0])
    for e in cut:
        if _CONTROL_FLOW.match(e.hlo_op):
            continue
        cls = op_class(e.kernel, e.hlo_op)
        by_program[e.program][cls] += e.duration_ns * 1e-9
        by_class[cls] += e.duration_ns * 1e-9
        op = by_op[(cls, e.kernel, e.hlo_op)]
        op[0] += 1
        op[1] += e.duration_ns * 1e-9
    longest = sorted(by_op.items(), key=lambda kv: -kv[1][1])[:TOP_OPS]
    top_ops = [dict(op_class=cls, kernel=kernel, hlo_op=hlo_op, runs=runs, seconds=seconds)
               for (cls, kernel, hlo_op), (runs, seconds) in longest]
    return ProfileSummary((hi - lo) * 1e-9, busy * 1e-9, dict(by_program), by_class, top_ops)


def window_of(profile: ProfileData) -> tuple[float, float] | None:
    """[start, stop) of the traced window's annotation on the host's timeline, in the kernels' clock: the one
    `DeviceTrace.window` opened, else the whole traced block's."""
    spans = {}
    for plane in profile.planes:
        if plane.name.startswith("/host:CPU"):
            for line in plane.lines:
                for event in line.events:
                    if event.name in (_TRACED, _WINDOW):
                        spans[event.name] = (event.start_ns, event.start_ns + event.duration_ns)
    return spans.get(_WINDOW, spans.get(_TRACED))


class DeviceTrace:
    """A context manager that traces what runs inside it; `summary()` afterwards. The window is the time inside it
    (the tracer's start and stop outside), or the part of it in `window()`: kernels that ran before or after it are
    cut off. On a GPU, XLA runs command buffers (CUDA graphs) op by op while it traces, unless
    `--xla_enable_command_buffers_during_profiling` (`CommandBufferThunk`): a window may launch its kernels
    otherwise than an untraced run, and not always op by op (on the H200, traced, the engine's dispatch took 1.95 ms
    a step with XLA's default buffers and 4.91 without them)."""

    def __enter__(self) -> DeviceTrace:
        self._dir = tempfile.TemporaryDirectory(prefix="sluice-trace-")
        options = jax.profiler.ProfileOptions()
        options.python_tracer_level = 0  # tracing every Python call would slow the host work being measured
        jax.profiler.start_trace(self._dir.name, profiler_options=options)
        self._annotation = jax.profiler.TraceAnnotation(_TRACED)
        self._annotation.__enter__()
        return self

    @contextmanager
    def window(self):
        """The part of the traced block to measure. An engine needs one: the calls it had dispatched run on while
        the tracer starts, so the block's first step collects a call that ran before the block, and its tokens
        would count without their device time (`bench.engine_check.profiled_decode`)."""
        with jax.profiler.TraceAnnotation(_WINDOW):
            yield

    def __exit__(self, *exc) -> None:
        self._annotation.__exit__(*exc)
        jax.profiler.stop_trace()
        paths = glob.glob(f"{self._dir.name}/**/*.xplane.pb", recursive=True)
        profile = ProfileData.from_file(paths[0]) if paths else None
        self._events = device_events(profile) if profile else []
        self._window = (window_of(profile) if profile else None) or (0.0, 0.0)
        self._dir.cleanup()

    def summary(self) -> ProfileSummary:
        return summarize(self._events, self._window)
