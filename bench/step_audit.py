"""Step-bytes audit: what the engine's compiled decode step reads, against the floor, from its optimized HLO.

    python -m sluice.bench.step_audit                                  # SmolLM2-135M, Llama-3.2-1B, Llama-3-8B; bf16, f32
    python -m sluice.bench.step_audit --models smollm2-135m --dtypes bfloat16 --rows 64 --context 1024
    JAX_PLATFORMS=cpu python -m sluice.bench.step_audit --target h100 --dtypes bfloat16   # XLA:GPU's, no GPU needed
    JAX_PLATFORMS=cpu python -m sluice.bench.step_audit --target h100 --models llama-3-8b --dtypes bfloat16 \
        --mixed-tokens 1024 4096 --context 1024                          # the mixed steps' copies instead

A decode step must read its weights once (as `model.roofline.StepCost` counts them) and the batch's K/V
once: `rows` sequences of `context` tokens, the most the compiled step can attend to (the audit's pool holds
that and a spare page). The model is abstract (shapes only: nothing is in memory but the pool), so full-size
models compile in seconds on a CPU. One decode bucket is compiled for this machine's backend, and its HLO text
is checked for:
- copies: a buffer the size of a weight or of the K/V pool (whole, or one layer of it) written from such an
  array, such as a layer of the stacked weights sliced out under `lax.scan` at every layer. The pool's in-place
  update is not one;
- upcasts: a `convert` of a bf16/f16 weight or pool to f32 (matmuls in f32, or the array written out twice);
- unfused projections: matmuls against weights that multiply the same input (q, k and v; gate and up);
- a copy of the pool: temporaries (`compiled.memory_analysis()`) as large as the whole K/V pool, which XLA
  allocates when it cannot update the donated pool in place (openxla/xla#45912: an update whose input a loop
  reads again). Each step would then write the pool out, and a server's pool, most of the free memory, would
  not fit twice. The first H200 run's XLA warned that the 8B decode programs needed 109 GiB for a 44 GiB pool.
It counts the kernels the step launches (`launches`): each costs the host microseconds to launch, unless the
step runs as a CUDA graph, and the device a gap between kernels, a large share of a small batch's step.
It also sets XLA's `compiled.cost_analysis()["bytes accessed"]` against the floor. That figure counts a while
loop's body once, whatever its trip count (checked on this backend): the floor is then counted the same way, a
stack the layer loop reads a layer at a time counting one layer. Custom calls count nothing (the attention
kernels, the CPU's quantized matmuls), and the CPU counts the pool's in-place update as the whole pool read
and written, so the ratio is a coarse signal; the three checks are the precise ones.
The HLO is the backend's: a CPU run shows what XLA's CPU compiler makes of the step, a GPU run the GPU's.
`--target h100` compiles for an abstract H100 on any machine (XLA:GPU without a device: jax's CUDA plugin
installed, `JAX_PLATFORMS=cpu`; `make check-gpu-image` sets it up), its description in `bench/targets/`.
Such a compile cannot autotune, so its GEMM tilings are XLA's defaults, not the device's choice; what the
audit reads (which buffers are written, copied or converted, and the control flow) does not depend on them.

`--mixed-tokens` audits the engine's mixed steps instead (prefill pieces and decode rows, at those token buckets,
for a server of `--max-num-seqs` sequences): every kernel, classed as `bench.device_profile` classes a trace's,
with the bytes it moves (its output, or an in-place update's rows, and what it reads of its operands, padding
included), and each copy-class kernel (copies, transposes, gathers, scatters, slices) with the time it would take
at `--bandwidth`: where a trace's "copy" time goes. The kernels' shapes are the bucket's, whatever its split into
decode rows and prefill pieces.

Host syncs and a copy of the pool are audited on the engine's multi-step decode call (model and sampler,
`num_decode_steps` steps, the program that runs at saturation): its conditionals, and its while loops of unknown
trip count. XLA:GPU runs each by copying its predicate to the host and waiting there for the device
(`ConditionalThunk`, `WhileThunk`), unless it captured it in a command buffer (CUDA graph), which the HLO does not
show. After each sync the device waits for the host's next launches; and where a call's kernels are launched on the
thread that makes the call (XLA's stream-executor client), that thread blocks until the device has caught up, so
the call returns only when the device is nearly done and the host cannot prepare the next call meanwhile
(overlapped scheduling).
"""

from __future__ import annotations

import argparse
import functools
import re
import sys
from collections import Counter, defaultdict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from sluice.batching.config import EngineConfig
from sluice.batching.device_step import Bucket
from sluice.batching.model_runner import ModelRunner
from sluice.batching.sampler import SAMPLER_BRANCHES, resolve_sampler_branches
from sluice.bench import device_profile
from sluice.bench.engine_check import MODELS
from sluice.model.config import ModelConfig
from sluice.model.llama import LAYER_LOOPS, LAYER_PARAMS, LINEAR_WEIGHTS, Llama, resolve_layer_loop
from sluice.model.quantize import quantize_model
from sluice.model.roofline import StepCost, kv_bytes_per_token

PAGE_SIZE = 16
TARGETS = {"h100": Path(__file__).parent / "targets" / "h100_sxm.txtpb"}
WIDE = ("f32", "f64")
NARROW = ("bf16", "f16")
# Instructions that write no buffer of their own: views, tuples, and control flow (their bodies are audited).
NO_BUFFER = ("parameter", "get-tuple-element", "tuple", "bitcast", "constant", "while", "conditional", "call",
             "after-all", "opt-barrier")
IN_PLACE = ("scatter", "dynamic-update-slice")
KNOWN_TRIP_COUNT = r'"known_trip_count":\{"n":"(\d+)"'
SELECTING = ("gather", "dynamic-slice", "slice")
# What a fusion's description names (`_ops`): the opcodes that move, select or multiply data.
MOVING = ("concatenate", "copy", "custom-call", "dot", "dynamic-slice", "dynamic-update-slice", "gather", "pad",
          "reduce", "reverse", "scatter", "slice", "sort", "transpose")


# --- HLO text ------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Instr:
    """One HLO instruction: `dims` None for a tuple, whose elements' (dtype, dims) are `leaves`; `args` the raw
    text between the opcode's parentheses."""

    name: str
    dtype: str
    dims: tuple[int, ...] | None
    op: str
    operands: tuple[str, ...]
    args: str
    attrs: str
    leaves: tuple[tuple[str, tuple[int, ...]], ...] = ()

    @property
    def type(self) -> str:
        return f"{self.dtype}{list(self.dims or ())}"

    @property
    def nbytes(self) -> int:
        """The bytes of its value (a tuple's elements together)."""
        leaves = self.leaves if self.dims is None else ((self.dtype, self.dims),)
        return int(sum(_itemsize(dtype) * np.prod(dims, dtype=np.int64) for dtype, dims in leaves))

    def attr(self, pattern: str) -> str | None:
        found = re.search(pattern, self.attrs)
        return found.group(1) if found else None


@dataclass
class Computation:
    """An HLO computation. `caller`: for a fused computation, the (computation, fusion instruction) that runs it
    (XLA gives each fusion its own); None for one whose instructions run as kernels of their own (the entry, a
    loop body). `trips`: how often it runs per step (a loop body: its known trip count, times its loop's)."""

    name: str
    instrs: dict[str, Instr] = field(default_factory=dict)
    root: str = ""
    caller: tuple[Computation, Instr] | None = None
    trips: int = 1


def _closing(text: str, start: int) -> int:
    """The index of the parenthesis that closes the one at `start`."""
    depth = 0
    for i in range(start, len(text)):
        depth += {"(": 1, ")": -1}.get(text[i], 0)
        if depth == 0:
            return i
    raise ValueError(f"unbalanced parentheses in {text!r}")


def _itemsize(dtype: str) -> float:
    """Bytes per element of an HLO element type (`bf16`: 2, `f8e4m3fn`: 1, `s4`: 0.5, `pred`: 1)."""
    bits = re.match(r"[a-z]+?(\d+)", dtype)
    return int(bits.group(1)) / 8 if bits else 1


def _shapes(text: str) -> tuple[tuple[str, tuple[int, ...]], ...]:
    """The (dtype, dims) of each array type in an HLO type's text (a tuple's elements, in order)."""
    return tuple((dtype, tuple(int(d) for d in dims.split(",") if d))
                 for dtype, dims in re.findall(r"(\w+)\[([\d,]*)\]", text))


def _instr(name: str, rest: str) -> Instr:
    """`rest`: what follows `%name = ` on an instruction's line."""
    if rest.startswith("("):
        closing = _closing(rest, 0)
        dtype, dims, leaves, rest = "tuple", None, _shapes(rest[:closing]), rest[closing + 2:]
    else:
        type_text, rest = rest.split(" ", 1)
        ((dtype, dims),), leaves = _shapes(type_text), ()
    op = re.match(r"[\w\-]+", rest).group(0)
    end = _closing(rest, len(op))
    args = rest[len(op) + 1:end]
    return Instr(name, dtype, dims, op, tuple(re.findall(r"%([^\s,)]+)", args)), args, rest[end + 1:], leaves)


def parse_hlo(text: str) -> dict[str, Computation]:
    """`compiled.as_text()` -> its computations by name, each knowing its caller and how often it runs."""
    computations: dict[str, Computation] = {}
    current = None
    for line in text.splitlines():
        if header := re.match(r"(?:ENTRY )?%(\S+) \(.*\{$", line):
            current = computations[header.group(1)] = Computation(header.group(1))
        elif current is not None and (found := re.match(r"\s+(ROOT )?%(\S+) = (.*)$", line)):
            root, name, rest = found.groups()
            current.instrs[name] = _instr(name, rest)
            current.root = name if root else current.root
        elif line == "}":
            current = None
    # The text lists callees before their callers, the entry last: walk it backwards, callers first.
    for comp in reversed(list(computations.values())):
        for instr in comp.instrs.values():
            trips = comp.trips * int(instr.attr(KNOWN_TRIP_COUNT) or 1)
            for name in re.findall(r"%([^\s,}]+)", instr.attrs):  # fusions, loops, calls, branches, reducers
                if (callee := computations.get(name)) is not None:
                    callee.trips = trips
                    callee.caller = (comp, instr) if instr.op == "fusion" else None
    return computations


def _scope(comp: Computation) -> Computation:
    """The computation whose kernels run `comp`'s code (itself unless fused)."""
    while comp.caller is not None:
        comp = comp.caller[0]
    return comp


def _where(comp: Computation, instr: Instr, per: str = "step") -> str:
    scope = _scope(comp)
    kernel = comp.caller[1].name if comp.caller else instr.name
    times = f", {scope.trips}x per {per}" if scope.trips > 1 else ""
    return f"%{kernel} in {scope.name}{times}"


def _fused(computations: dict[str, Computation], instr: Instr) -> Computation | None:
    """A fusion's fused computation; None for another instruction."""
    return computations[instr.attr(r"calls=%([^\s,]+)")] if instr.op == "fusion" else None


def _root(computations: dict[str, Computation], instr: Instr) -> Instr:
    """What a kernel's output is: a fusion's root, else the instruction itself."""
    body = _fused(computations, instr)
    return instr if body is None else body.instrs[body.root]


def _in_place(computations: dict[str, Computation], instr: Instr) -> bool:
    """An update of its first operand's buffer (a scatter or dynamic-update-slice, or a fusion ending in one)."""
    return _root(computations, instr).op in IN_PLACE


# --- What must be read once ----------------------------------------------------------------------------------

@dataclass(frozen=True)
class StoredArray:
    """An array the step must read once: a weight (`shape` of its values as stored; `nbytes` with its scales when
    quantized) or the K/V pool; stacked `[num_layers, ...]` when `stacked`."""

    name: str
    shape: tuple[int, ...]
    nbytes: int
    stacked: bool


@dataclass(frozen=True)
class Match:
    """An array the size of `array`, or of one layer of it (`layer`)."""

    array: StoredArray
    layer: bool

    def __str__(self) -> str:
        return f"{self.array.name}[layer]" if self.layer else self.array.name


def _prefix_products(dims: Sequence[int]) -> set[int]:
    return set(np.cumprod([d for d in dims if d > 1], dtype=np.int64).tolist())


def _orientation(dims: tuple[int, ...], shape: tuple[int, ...]) -> int | None:
    """0 if an array of `dims` can be one of `shape` with adjacent axes merged or split (as XLA's bitcasts do:
    one's prefix products contain the other's), 1 if one of its transpose, else None."""
    if np.prod(dims, dtype=np.int64) != np.prod(shape, dtype=np.int64):
        return None
    own = _prefix_products(dims)
    fits = [own <= other or other <= own for other in map(_prefix_products, (shape, shape[::-1]))]
    return fits.index(True) if any(fits) else None


def matches(arrays: Sequence[StoredArray], dims: tuple[int, ...] | None) -> list[Match]:
    """The arrays, or layers of stacked ones, that an HLO value of `dims` (None: a tuple) can hold, those as
    stored before those transposed."""
    if dims is None:
        return []
    found = [(orientation, Match(a, layer)) for a in arrays for layer in ((False, True) if a.stacked else (False,))
             if (orientation := _orientation(dims, a.shape[1:] if layer else a.shape)) is not None]
    return [match for _, match in sorted(found, key=lambda f: f[0])]


def _named(found: Sequence[Match]) -> str:
    return " or ".join(map(str, found))


# --- The three checks ----------------------------------------------------------------------------------------

def copies(computations: dict[str, Computation], arrays: Sequence[StoredArray]) -> list[str]:
    """Buffers the size of a stored array written from one, by instructions that run as kernels of their own (a
    fused computation's inner values are never buffers), in-place updates excepted."""
    found = []
    for comp in computations.values():
        if comp.caller is not None:
            continue
        for instr in comp.instrs.values():
            if instr.op in NO_BUFFER or _in_place(computations, instr) or not (written := matches(arrays, instr.dims)):
                continue
            if any(matches(arrays, comp.instrs[o].dims) for o in instr.operands):
                found.append(f"{_where(comp, instr)}: {instr.op} writes {instr.type}, a copy of {_named(written)}")
    return found


def upcasts(computations: dict[str, Computation], arrays: Sequence[StoredArray]) -> list[str]:
    """`convert`s of a bf16/f16 stored array to f32, fused or not (but not fused into a gather or slice)."""
    found = []
    for comp in computations.values():
        for instr in comp.instrs.values():
            if instr.op != "convert" or instr.dtype not in WIDE or not (converted := matches(arrays, instr.dims)):
                continue
            source = comp.instrs[instr.operands[0]]
            users = [u for u in comp.instrs.values() if instr.name in u.operands]
            # Fused into a gather or slice, only the rows it selects are converted (an embedding lookup).
            selects = comp.caller is not None and users and all(u.op in SELECTING for u in users)
            if source.dtype in NARROW and not selects:
                found.append(f"{_where(comp, instr)}: convert {source.type} -> {instr.dtype}, {_named(converted)}")
    return found


@dataclass(frozen=True)
class Projection:
    """A matmul against a weight: the computation whose kernels run it, the weights (or layers of them) of its
    weight operand's shape, and its other operand's value (`input`)."""

    scope: Computation
    weights: tuple[Match, ...]
    input: str

    def __str__(self) -> str:
        return f"{_named(self.weights)} x{self.scope.trips}" if self.scope.trips > 1 else _named(self.weights)


def _value(comp: Computation, name: str) -> str:
    """A value as a string equal for equal values: a buffer's name, or the fused expression that computes it
    from buffers (so two fusions that each recompute the same input, such as a norm, agree)."""
    instr = comp.instrs[name]
    if instr.op == "bitcast":
        return _value(comp, instr.operands[0])
    if comp.caller is None:
        return name
    if instr.op == "parameter":
        outer, fusion = comp.caller
        return _value(outer, fusion.operands[int(instr.args)])
    inputs = ", ".join(_value(comp, o) for o in instr.operands)
    return f"{instr.op}:{instr.type}({inputs or instr.args})"


def projections(computations: dict[str, Computation], weights: Sequence[StoredArray]) -> list[Projection]:
    """Dots and custom calls (a GPU's cuBLAS gemm, the CPU's quantized kernels) whose first two operands are a
    weight-sized array and another, in the order of the HLO text."""
    found = []
    for comp in computations.values():
        for instr in comp.instrs.values():
            if instr.op not in ("dot", "custom-call"):
                continue
            pair = [(comp.instrs[o], matches(weights, comp.instrs[o].dims)) for o in instr.operands[:2]]
            if len(pair) == 2 and bool(pair[0][1]) != bool(pair[1][1]):
                (other, _), (_, weight) = sorted(pair, key=lambda operand: bool(operand[1]))
                found.append(Projection(_scope(comp), tuple(weight), _value(comp, other.name)))
    return found


def unfused(found: Sequence[Projection]) -> list[str]:
    """Groups of projections that multiply the same input in the same computation: each could be one matmul."""
    groups: dict[tuple[str, str], list[str]] = defaultdict(list)
    for p in found:
        groups[(p.scope.name, p.input)].append(_named(p.weights))
    return [f"{scope}: {len(names)} matmuls of one input ({', '.join(names)}), fusable into one"
            for (scope, _), names in groups.items() if len(names) > 1]


def host_syncs(computations: dict[str, Computation]) -> list[str]:
    """Conditionals, and while loops of unknown trip count, wherever they run (inside a branch too: a sync when it
    is taken), with how often per call (see the module docstring)."""
    found = []
    for comp in computations.values():
        for instr in comp.instrs.values():
            if instr.op == "conditional" or instr.op == "while" and instr.attr(KNOWN_TRIP_COUNT) is None:
                loop = ", at every iteration" if instr.op == "while" else ""
                found.append(f"{_where(comp, instr, 'call')}: {instr.op}{loop}")
    return found


# --- What each kernel moves ----------------------------------------------------------------------------------

def _run_as_kernels(computations: dict[str, Computation], comp: Computation, times: int = 1
                    ) -> Iterator[tuple[Computation, Instr, int]]:
    """The instructions of `comp` that launch kernels, each with how often per step (`times` per run of `comp`):
    each that writes a buffer (a fusion, a custom call, a copy, ...), and what it runs as kernels of their own: a
    loop's body and condition at every known trip, a call, a conditional (the read of its branch index) and its
    largest branch."""
    for instr in comp.instrs.values():
        called = [computations[name] for name in re.findall(r"%([^\s,}]+)", instr.attrs) if name in computations]
        if instr.op == "while":
            trips = times * int(instr.attr(KNOWN_TRIP_COUNT) or 1)
            for callee in called:
                yield from _run_as_kernels(computations, callee, trips)
        elif instr.op == "conditional":
            yield comp, instr, times
            branches = [list(_run_as_kernels(computations, callee, times)) for callee in called]
            yield from max(branches, key=lambda kernels: sum(t for *_, t in kernels), default=[])
        elif instr.op == "call":
            for callee in called:
                yield from _run_as_kernels(computations, callee, times)
        elif instr.op not in NO_BUFFER:
            yield comp, instr, times


def _entry(computations: dict[str, Computation]) -> Computation:
    return list(computations.values())[-1]  # the text lists the entry last


@dataclass(frozen=True)
class Kernel:
    """A kernel of a step: its HLO instruction's name (a trace's `hlo_op`), what it computes (`ops`), its output's
    type, its class as `bench.device_profile` classes a traced kernel, the bytes it moves at each run
    (`_moved_bytes`) and its runs per step."""

    name: str
    ops: str
    type: str
    op_class: str
    nbytes: int
    runs: int


def _source(comp: Computation, name: str) -> Instr:
    """The instruction whose value `name` is, through bitcasts."""
    instr = comp.instrs[name]
    return _source(comp, instr.operands[0]) if instr.op == "bitcast" else instr


def _users(comp: Computation, name: str) -> list[Instr]:
    """The instructions that read `name`'s value, through bitcasts."""
    found = []
    for instr in comp.instrs.values():
        if name in instr.operands:
            found += _users(comp, instr.name) if instr.op == "bitcast" else [instr]
    return found


def _update_bytes(comp: Computation, update: Instr) -> int:
    """What an in-place update (`IN_PLACE`) writes: its updates (a scatter's third operand, a
    dynamic-update-slice's second)."""
    return comp.instrs[update.operands[2 if update.op == "scatter" else 1]].nbytes


def _parameter(body: Computation, index: int) -> Instr:
    return next(i for i in body.instrs.values() if i.op == "parameter" and int(i.args) == index)


def _readers(body: Computation, name: str) -> list[Instr]:
    """The fused instructions that read `name`'s value, through bitcasts and the elementwise ops over it (a convert,
    a scale): a loop kernel computes those only at the elements its later instructions take, so a slice after a
    scale still reads only its share."""
    found, size = [], np.prod(body.instrs[name].dims or (), dtype=np.int64)
    for user in _users(body, name):
        elementwise = (user.op not in MOVING and user.op not in NO_BUFFER and user.op != "broadcast"
                       and user.dims is not None and np.prod(user.dims, dtype=np.int64) == size)
        found += _readers(body, user.name) if elementwise else [user]
    return found


def _taken(operand: Instr, readers: Sequence[Instr]) -> int:
    """What `readers` read of `operand`: all of it, or what they take where they only slice or gather from it (their
    elements, at the operand's bytes each)."""
    if readers and operand.dims is not None and all(r.op in SELECTING for r in readers):
        elements = sum(np.prod(r.dims or (), dtype=np.int64) for r in readers)
        return min(operand.nbytes, int(elements * _itemsize(operand.dtype)))
    return operand.nbytes


def _moved_bytes(computations: dict[str, Computation], comp: Computation, instr: Instr) -> int:
    """What a kernel of `comp` writes and reads at one run, as its static shapes give it (padding rows included):
    its output, or for an in-place update (a scatter or dynamic-update-slice, or a fusion ending in one) its
    updates, the buffer it updates being neither read nor written whole; and its operands, or what it takes of
    those it only slices or gathers from."""
    body, root, in_place = _fused(computations, instr), _root(computations, instr), _in_place(computations, instr)
    scope = comp if body is None else body
    written = min(_update_bytes(scope, root), instr.nbytes) if in_place else instr.nbytes
    read = 0
    for index, name in enumerate(instr.operands):
        # Inside a fusion, an operand is its parameter, read by the fused instructions that use it.
        value = comp.instrs[name] if body is None else _parameter(body, index)
        if in_place and _source(scope, value.name) is _source(scope, root.operands[0]):
            continue
        read += _taken(comp.instrs[name], [instr] if body is None else _readers(body, value.name))
    return written + read


def _custom_call_target(computations: dict[str, Computation], instr: Instr) -> str:
    """The target of a custom call, or of the one a fusion wraps (the Mosaic kernels sit in one); else ""."""
    if (body := _fused(computations, instr)) is not None:
        return next(filter(None, (_custom_call_target(computations, i) for i in body.instrs.values())), "")
    if instr.op == "custom-call":
        return instr.attr(r'custom_call_target="([^"]+)"') or ""
    return ""


def _ops(computations: dict[str, Computation], instr: Instr) -> str:
    """An unfused instruction's opcode, or a fusion's root and the opcodes in it that move or multiply data (then
    "elementwise" if it has others)."""
    if (body := _fused(computations, instr)) is None:
        return instr.op
    inside = {i.op for i in body.instrs.values()}
    named = sorted(inside & set(MOVING)) + (["elementwise"] if inside - set(MOVING) - set(NO_BUFFER) else [])
    return f"{_root(computations, instr).op} fusion: {', '.join(named)}"


def step_kernels(computations: dict[str, Computation]) -> list[Kernel]:
    """Every kernel of a step (`_run_as_kernels`), with its class as a trace classes it: by its instruction's
    name and, for a custom call (fused or not), its target (a Mosaic kernel's fusion is named as a slice's)."""
    found = []
    for comp, instr, runs in _run_as_kernels(computations, _entry(computations)):
        op_class = device_profile.op_class(_custom_call_target(computations, instr), instr.name)
        found.append(Kernel(instr.name, _ops(computations, instr), instr.type, op_class,
                            _moved_bytes(computations, comp, instr), runs))
    return found


# --- The audit -----------------------------------------------------------------------------------------------

def launches(computations: dict[str, Computation]) -> int:
    """The kernels a step launches (`_run_as_kernels`). Each launch costs the host a few microseconds unless the
    step is captured in a CUDA graph, and the device a gap between kernels (bench/RESULTS.md)."""
    return sum(times for _, _, times in _run_as_kernels(computations, _entry(computations)))


def pool_copy(compiled: jax.stages.Compiled, pool_bytes: int) -> list[str]:
    """A finding when the program's temporaries could hold the whole K/V pool of `pool_bytes` (module docstring).
    The pool must be much larger than the step's activations (a few rows over a short context are not)."""
    analysis = compiled.memory_analysis()
    temp = 0 if analysis is None else analysis.temp_size_in_bytes
    if pool_bytes == 0 or temp < pool_bytes:
        return []
    return [f"temporaries of {temp / 1e6:,.1f} MB, as large as the K/V pool ({pool_bytes / 1e6:,.1f} MB): a copy of it"]


def bytes_accessed(compiled: jax.stages.Compiled) -> float | None:
    """From `cost_analysis()`: a dict (older jax gave a list of one dict per program); None where there is none
    (a program compiled without a device)."""
    cost = compiled.cost_analysis()
    return None if cost is None else (cost[0] if isinstance(cost, list) else cost)["bytes accessed"]


@functools.cache
def cost_counts_loop_once() -> bool:
    """Whether this backend's cost analysis counts a while loop's body once: about the same bytes for a scan of
    2 matmuls and of 4."""
    def scan(ws: jax.Array, x: jax.Array) -> jax.Array:
        return jax.lax.scan(lambda x, w: (x @ w, None), x, ws)[0]

    def cost(n: int) -> float:
        ws = jax.ShapeDtypeStruct((n, 256, 256), jnp.float32)
        return bytes_accessed(jax.jit(scan).lower(ws, jax.ShapeDtypeStruct((8, 256), jnp.float32)).compile())

    return cost(4) < 1.5 * cost(2)


def counted_floor(floor_bytes: int, found: Sequence[Projection]) -> int:
    """`floor_bytes` as the cost analysis counts it: where it counts a loop body once, a stacked weight that the
    loop multiplies a layer at a time counts one layer."""
    if not cost_counts_loop_once():
        return floor_bytes
    per_layer = {m.array: p.scope.trips for p in found for m in p.weights if m.layer}
    return floor_bytes - sum(w.nbytes - w.nbytes // trips for w, trips in per_layer.items())


@dataclass(frozen=True)
class StepAudit:
    """One compiled step's bytes against its floor, and what its HLO shows (see the module docstring). Each
    projection and finding is a line of text; a projection says how often it runs per step."""

    label: str
    floor_bytes: int
    counted_floor_bytes: int
    cost_bytes: float | None
    projections: tuple[str, ...]
    copies: tuple[str, ...]
    upcasts: tuple[str, ...]
    unfused: tuple[str, ...]
    launches: int

    @property
    def ratio(self) -> float | None:
        """Cost-analysis bytes over the floor, both counted the same way (None without a cost analysis)."""
        return None if self.cost_bytes is None else self.cost_bytes / self.counted_floor_bytes

    @property
    def clean(self) -> bool:
        return not (self.copies or self.upcasts or self.unfused)

    def findings(self) -> list[str]:
        return ([f"copy: {f}" for f in self.copies] + [f"upcast: {f}" for f in self.upcasts]
                + [f"unfused: {f}" for f in self.unfused])


def audit(label: str, compiled: jax.stages.Compiled, weights: Sequence[StoredArray], floor_bytes: int,
          pool: Sequence[StoredArray] = (), pool_bytes: int = 0) -> StepAudit:
    """Audits a compiled program that multiplies by `weights`, reads `pool` (K/V arrays; `pool_bytes` in all) and
    must read at least `floor_bytes` (counted as this machine's cost analysis counts, where it has one: a
    program compiled without its device has none)."""
    computations = parse_hlo(compiled.as_text())
    found = projections(computations, weights)
    cost = bytes_accessed(compiled)
    counted = floor_bytes if cost is None else counted_floor(floor_bytes, found)
    return StepAudit(label, floor_bytes, counted, cost,
                     tuple(map(str, found)),
                     tuple(copies(computations, [*weights, *pool]) + pool_copy(compiled, pool_bytes)),
                     tuple(upcasts(computations, [*weights, *pool])), tuple(unfused(found)), launches(computations))


def target_device(name: str) -> jax.Device:
    """A compile-only device of `TARGETS` (XLA:GPU without a GPU): needs jax's CUDA plugin, and JAX_PLATFORMS=cpu
    where the machine has no GPU."""
    from jax.experimental import topologies

    try:
        topology = topologies.get_topology_desc(name, "cuda", target_config=TARGETS[name].read_text(),
                                                topology="1x1x1")
    except Exception as error:  # noqa: BLE001 - one line for the command line, whatever the plugin's state
        raise SystemExit(f"--target {name} needs jax's CUDA plugin (pip install jax-cuda12-plugin=="
                         f"{jax.__version__} jax-cuda12-pjrt=={jax.__version__}) and, without a GPU, "
                         f"JAX_PLATFORMS=cpu: {type(error).__name__}: {error}") from error
    return topology.devices[0]


def placed(shapes, device: jax.Device | None):
    """`shapes` (ShapeDtypeStructs) on `device` (None: as they are)."""
    if device is None:
        return shapes
    at = jax.sharding.SingleDeviceSharding(device)
    return jax.tree.map(lambda x: x.update(sharding=at), shapes)


def for_device(choice: str, on_gpu: str, device: jax.Device | None) -> str:
    """An engine flag's value for a target device: "auto" becomes the GPU's choice `on_gpu` for a GPU target (the
    flags resolve "auto" for this machine's backend)."""
    return on_gpu if choice == "auto" and device is not None and device.platform == "gpu" else choice


def _compile(runner: ModelRunner, bucket: Bucket, device: jax.Device | None) -> jax.stages.Compiled:
    """The runner's program for `bucket`, compiled for `device` (None: this machine's), its sampler (if it has one)
    as for greedy rows. With `compile_decode_step` and `compile_mixed_step`, the one place that uses the runner's
    private names."""
    plan = runner._plan([])  # padding rows: greedy
    lowering = runner._lowering(bucket, plan)  # lower(packing, *shapes)
    packing, *shapes = lowering.args
    return functools.partial(lowering.func, packing, *placed(shapes, device))().compile()


def compile_decode_step(runner: ModelRunner, rows: int, num_steps: int = 1, device: jax.Device | None = None
                        ) -> jax.stages.Compiled:
    """The runner's decode program for `rows` sequences: one step (the model to logits; the sampler is a call of its
    own), or a multi-step call (model and sampler, `num_steps` <= the runner's `num_decode_steps`)."""
    return _compile(runner, runner._decode_bucket(rows, num_steps), device)


def compile_mixed_step(runner: ModelRunner, num_tokens: int, device: jax.Device | None = None
                       ) -> tuple[Bucket, jax.stages.Compiled]:
    """The runner's mixed step (prefill pieces and decode rows, the model to logits) of the token bucket of
    `num_tokens`, and that bucket."""
    bucket = runner._mixed_bucket(num_tokens, speculative=False)
    return bucket, _compile(runner, bucket, device)


def abstract_runner(config: ModelConfig, dtype: str, rows: int, context: int, quantization: str = "none",
                    layer_loop: str = "auto", num_decode_steps: int = 1, sampler_branches: str = "auto",
                    device: jax.Device | None = None, num_tokens: int = 0) -> ModelRunner:
    """A runner of `rows` sequences of up to `context` tokens for an abstract model of `config` in `dtype` (its
    weights `quantization`: "none", "int8", "int4"; its layers run by `layer_loop`; its sampler's branches
    decided by `sampler_branches`), as the engine makes one for `device` (None: this machine's): only its pool is
    in memory, on this machine. For a GPU target, the attention is the Mosaic kernel (a custom call, which the audit
    does not read). `num_tokens`: it also runs mixed steps of up to that many tokens; its pool then holds that
    many tokens (a pool of every sequence's context would not fit a CPU's memory at a server's sequence counts;
    the pool's size changes only the shape its kernels update in place)."""
    layer_loop = resolve_layer_loop(for_device(layer_loop, "unrolled", device))
    on_gpu = device is not None and device.platform == "gpu"
    layout = "channel" if on_gpu else None  # as a GPU's engine stores int8 (`model.quantize.default_layout`)

    def make() -> Llama:
        model = quantize_model(Llama(config, dtype=jnp.dtype(dtype), rngs=nnx.Rngs(0)), quantization, layout)
        if layer_loop == "unrolled":
            model.unstack_layers()
        return model

    # A spare page, so that the pool's shape is unlike any weight's (its page count is no power of two).
    pool_tokens = num_tokens or rows * -(-context // PAGE_SIZE) * PAGE_SIZE
    return ModelRunner(nnx.eval_shape(make), num_pages=-(-pool_tokens // PAGE_SIZE) + 1, page_size=PAGE_SIZE,
                       max_model_len=context, max_num_seqs=rows,
                       max_num_batched_tokens=max(rows, PAGE_SIZE, num_tokens),
                       num_decode_steps=num_decode_steps, layer_loop=layer_loop,
                       sampler_branches=for_device(sampler_branches, "host", device),
                       attention_backend=for_device("auto", "pallas-mosaic", device))


@dataclass(frozen=True)
class DecodeCall:
    """What the engine's multi-step decode call shows: its host syncs, and a copy of the pool (if any)."""

    syncs: list[str]
    pool_copy: list[str]


def audit_decode_call(config: ModelConfig, dtype: str, num_steps: int, rows: int = 8, context: int = 256,
                      layer_loop: str = "auto", sampler_branches: str = "auto", device: jax.Device | None = None
                      ) -> DecodeCall:
    """The engine's multi-step decode call of `num_steps` steps (as `audit_decode_step`'s) for greedy rows, its
    sampler's branches decided as `sampler_branches` says."""
    runner = abstract_runner(config, dtype, rows, context, layer_loop=layer_loop, num_decode_steps=num_steps,
                             sampler_branches=sampler_branches, device=device)
    compiled = compile_decode_step(runner, rows, num_steps, device)
    return DecodeCall(host_syncs(parse_hlo(compiled.as_text())), pool_copy(compiled, pool_bytes(runner)))


def pool_bytes(runner: ModelRunner) -> int:
    return sum(x.nbytes for x in jax.tree.leaves(runner.kv_cache))


def pool_arrays(runner: ModelRunner) -> list[StoredArray]:
    """The K/V pool as a stored array, a stack of layers (K's: V's are alike)."""
    k_pages = jax.tree.leaves(runner.kv_cache[0])[0]
    return [StoredArray("K/V pool", tuple(k_pages.shape), k_pages.nbytes, True)]


def audit_decode_step(config: ModelConfig, dtype: str, rows: int = 8, context: int = 256,
                      quantization: str = "none", layer_loop: str = "auto", device: jax.Device | None = None
                      ) -> StepAudit:
    """The engine's decode step for `rows` sequences of up to `context` tokens (`abstract_runner`), compiled for
    `device` (None: this machine's)."""
    runner = abstract_runner(config, dtype, rows, context, quantization, layer_loop, device=device)
    pages_per_seq = -(-context // PAGE_SIZE)
    # A layer parameter stored one array per layer (a tuple) counts as its stack: a layer of it is one array.
    arrays = {str(path[0]): var.get_value() for path, var in nnx.to_flat_state(runner.state)}
    shape = lambda x: (len(x), *x[0].shape) if isinstance(x, tuple) else tuple(x.shape)
    nbytes = lambda name: sum(x.size * x.dtype.itemsize for part, value in arrays.items()
                              if part in (name, f"{name}_scale", f"{name}_min") for x in jax.tree.leaves(value))
    weights = [StoredArray(name, shape(x), nbytes(name), name in LAYER_PARAMS)
               for name, x in arrays.items() if name in LINEAR_WEIGHTS]
    model = nnx.merge(runner.graphdef, runner.state)
    floor = (int(StepCost.of(config, model, dtype).weight_bytes)
             + int(kv_bytes_per_token(config, dtype)) * rows * pages_per_seq * PAGE_SIZE)
    quantized = "" if quantization == "none" else f" {quantization}"
    loop = "unrolled" if model.layers_unstacked else "scan"
    return audit(f"{dtype}{quantized}, {loop}, {rows} rows x {context} tokens",
                 compile_decode_step(runner, rows, device=device), weights, floor, pool_arrays(runner),
                 pool_bytes(runner))


@dataclass(frozen=True)
class MixedStep:
    """A compiled mixed step's kernels (`step_kernels`), and its copies of the pool (`copies`), if any."""

    label: str
    kernels: tuple[Kernel, ...]
    pool_copies: tuple[str, ...]

    def of_class(self, op_class: str) -> list[Kernel]:
        return [k for k in self.kernels if k.op_class == op_class]


def audit_mixed_step(config: ModelConfig, dtype: str, num_tokens: int, rows: int = 1024, context: int = 1024,
                     layer_loop: str = "auto", device: jax.Device | None = None) -> MixedStep:
    """The engine's mixed step of `num_tokens` tokens (prefill pieces and decode rows) for a server of `rows`
    sequences of up to `context` tokens (`abstract_runner`), compiled for `device` (None: this machine's). Its
    kernels' shapes are the bucket's, whatever the split of its tokens into decode rows and prefill pieces."""
    runner = abstract_runner(config, dtype, rows, context, layer_loop=layer_loop, device=device, num_tokens=num_tokens)
    bucket, compiled = compile_mixed_step(runner, num_tokens, device)
    computations = parse_hlo(compiled.as_text())
    loop = "unrolled" if nnx.merge(runner.graphdef, runner.state).layers_unstacked else "scan"
    label = (f"{dtype}, {loop}, {bucket.num_tokens} tokens in {bucket.num_attn_seqs} attention rows of up to "
             f"{bucket.max_q_len} queries, {bucket.num_rows} sampled rows")
    return MixedStep(label, tuple(step_kernels(computations)), tuple(copies(computations, pool_arrays(runner))))


# --- Command line --------------------------------------------------------------------------------------------

def table(audits: Sequence[tuple[str, StepAudit]]) -> str:
    """A markdown table, one row per (model, audit), then each audit's findings."""
    mb = lambda n: "n/a" if n is None else f"{n / 1e6:,.1f}"
    lines = ["| model | step | floor MB | floor as counted MB | cost analysis MB | ratio | projections per step "
             "| copies | upcasts | unfused | kernels |", "|---|---|---:|---:|---:|---:|---|---:|---:|---:|---:|"]
    for model, a in audits:
        counted = Counter(a.projections)  # an unrolled step lists each layer's
        listed = "; ".join(p if n == 1 else f"{p} x{n}" for p, n in counted.items())
        lines.append(f"| {model} | {a.label} | {mb(a.floor_bytes)} | {mb(a.counted_floor_bytes)} | "
                     f"{mb(a.cost_bytes)} | {'n/a' if a.ratio is None else f'{a.ratio:.2f}'} | {listed} | {len(a.copies)} | "
                     f"{len(a.upcasts)} | {len(a.unfused)} | {a.launches:,} |")
    for model, a in audits:
        if not a.clean:
            lines += ["", f"{model}, {a.label}:", *(f"- {f}" for f in a.findings())]
    return "\n".join(lines)


def _grouped(kernels: Sequence[Kernel]) -> list[tuple[Kernel, int]]:
    """Kernels alike but for their names' numbers (a layer's of an unrolled step), each once with its runs per step
    in all, most bytes per step first."""
    runs: Counter = Counter()
    first: dict[tuple, Kernel] = {}
    for k in kernels:
        key = (re.sub(r"\.\d+$", "", k.name), k.ops, k.type, k.nbytes)
        first.setdefault(key, k)
        runs[key] += k.runs
    return sorted(((first[key], n) for key, n in runs.items()), key=lambda kn: -kn[0].nbytes * kn[1])


def mixed_table(steps: Sequence[tuple[str, MixedStep]], bandwidth: float) -> str:
    """Per mixed step: its kernels by class, then its copy-class kernels, with the bytes each moves and its time were
    it to move them at `bandwidth` bytes/s (a floor: a scatter or gather of short rows runs well below it)."""
    at = f"ms at {bandwidth / 1e12:g} TB/s"
    lines = []
    for model, step in steps:
        lines += ["", f"{model}, {step.label}:", "", f"| class | kernels per step | MB per step | {at} |",
                  "|---|---:|---:|---:|"]
        for op_class in device_profile.CLASSES:
            kernels = step.of_class(op_class)
            moved = sum(k.nbytes * k.runs for k in kernels)
            # The attention kernels' operands are the whole pool, of which they read the rows' pages.
            mb, ms = f"{moved / 1e6:,.1f}", f"{moved / bandwidth * 1e3:.2f}"
            if op_class == "attention":
                mb = ms = "n/a"
            lines.append(f"| {op_class} | {sum(k.runs for k in kernels):,} | {mb} | {ms} |")
        lines += ["", f"| copy-class kernel | what | output | per step | MB each | {at} |",
                  "|---|---|---|---:|---:|---:|"]
        for k, runs in _grouped(step.of_class("copy")):
            lines.append(f"| {k.name} | {k.ops} | {k.type} | {runs} | {k.nbytes / 1e6:,.1f} | "
                         f"{k.nbytes * runs / bandwidth * 1e3:.3f} |")
        lines += ["", f"Copies of the pool: {'; '.join(step.pool_copies) or 'none'}."]
    return "\n".join(lines[1:])


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", choices=sorted(MODELS),
                        default=["smollm2-135m", "llama-3.2-1b", "llama-3-8b"])
    parser.add_argument("--dtypes", nargs="+", choices=("bfloat16", "float16", "float32"),
                        default=["bfloat16", "float32"])
    parser.add_argument("--quantization", default="none", choices=("none", "int8", "int4"))
    parser.add_argument("--layer-loop", default="auto", choices=LAYER_LOOPS)
    parser.add_argument("--rows", type=int, default=8, help="sequences in the decode step")
    parser.add_argument("--context", type=int, default=256, help="tokens each sequence may attend to")
    parser.add_argument("--decode-steps", type=int, default=EngineConfig.num_decode_steps,
                        help="decode steps per call of the multi-step call whose host syncs are audited")
    parser.add_argument("--sampler-branches", default="auto", choices=SAMPLER_BRANCHES,
                        help="who decides the sampler's branches in the audited decode call (as the engine's flag)")
    parser.add_argument("--mixed-tokens", type=int, nargs="+", metavar="N",
                        help="audit the mixed steps of these token buckets (prefill pieces and decode rows) instead: "
                             "each kernel that copies, transposes, gathers or scatters, with its bytes")
    parser.add_argument("--max-num-seqs", type=int, default=1024,
                        help="the server's sequences, for the mixed steps (the H200's sustained run's)")
    parser.add_argument("--bandwidth", type=float, default=4.0, help="TB/s the mixed steps' bytes are timed at")
    parser.add_argument("--target", choices=sorted(TARGETS),
                        help="compile for this device, without it (XLA:GPU: jax's CUDA plugin; module docstring)")
    parser.add_argument("--out", type=Path, help="also write the report (markdown) to this file")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    device = target_device(args.target) if args.target else None
    command = f"$ python -m sluice.bench.step_audit {' '.join(sys.argv[1:] if argv is None else argv)}"
    where = (f"an abstract {device.device_kind} (XLA:GPU compiled without a device)" if device is not None
             else f"{jax.devices()[0].device_kind} ({jax.default_backend()})")
    if args.mixed_tokens:
        steps = [(model, audit_mixed_step(MODELS[model], dtype, tokens, args.max_num_seqs, args.context,
                                          args.layer_loop, device))
                 for model in args.models for dtype in args.dtypes for tokens in args.mixed_tokens]
        return report(f"Mixed steps on {where}, jax {jax.__version__}, for a server of {args.max_num_seqs} "
                      f"sequences of {args.context} tokens.\n\n{mixed_table(steps, args.bandwidth * 1e12)}\n\n"
                      f"{command}", args.out)
    audits = [(model, audit_decode_step(MODELS[model], dtype, args.rows, args.context, args.quantization,
                                        args.layer_loop, device))
              for model in args.models for dtype in args.dtypes]
    loops = ("no cost analysis (a compile without a device has none)" if audits[0][1].cost_bytes is None
             else f"its cost analysis counts a loop body {'once' if cost_counts_loop_once() else 'at every iteration'}")
    # The sampler and the loop around the model make the syncs, whatever the model: the smallest one's call (the
    # quickest to compile) shows them.
    smallest = min(args.models, key=lambda name: MODELS[name].num_layers * MODELS[name].hidden_size)
    call = audit_decode_call(MODELS[smallest], args.dtypes[0], args.decode_steps, args.rows, args.context,
                             args.layer_loop, args.sampler_branches, device)
    branches = resolve_sampler_branches(for_device(args.sampler_branches, "host", device))
    text = (f"Decode-step bytes on {where}, jax {jax.__version__}; {loops}.\n\n{table(audits)}\n\n"
            f"Host syncs in the decode call of {args.decode_steps} steps ({smallest}, {args.dtypes[0]}, "
            f"{args.rows} greedy rows, the sampler's branches decided by the "
            f"{branches}): {len(call.syncs)} in its program"
            + "".join(f"\n- {f}" for f in call.syncs)
            + f"\n\nA copy of the pool in that call: {'; '.join(call.pool_copy) or 'none'}.\n\n{command}")
    return report(text, args.out)


def report(text: str, out: Path | None) -> int:
    """Prints the report, and writes it to `out` if given."""
    print(text)
    if out is not None:
        out.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
