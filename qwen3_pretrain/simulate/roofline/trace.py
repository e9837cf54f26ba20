"""The op trace of a training step: every aten operator the engine dispatches, aggregated as it goes.

A step of Qwen3-8B dispatches some 10^5 operators per rank; storing each would
double the simulation's time and memory, so ``OpTrace`` keeps what pricing
needs, summed on the fly:

* **matmuls** (``mm``, ``addmm``, ``bmm``, ``baddbmm``, ``_grouped_mm``,
  ``_scaled_mm``): calls by (phase, dtype, m, n, k, groups), FLOPs ``2 m n k``
  per call; ``m`` is the output's rows (batches folded in), ``k`` the contracted
  size, ``groups`` a grouped matmul's group count (its rows per group set the
  shape class);
* **attention** (SDPA's fused kernels, forward and backward): calls by (phase,
  kernel, dtype, batch, heads, q_len, kv_len, head_dim, causal). SDPA's math
  kernel decomposes into ``bmm`` and softmax before dispatch and lands in the
  two other categories, with its whole square and its probabilities' traffic;
* **memory-bound ops** (everything else that launches a kernel: elementwise,
  copies, casts, reductions, norms, the optimizer's foreach ops): per phase the
  bytes read and written one op at a time (eager), and as compile would fuse
  them (below), with the op and fused-region counts the host term needs;
* **collectives** are not kept here: ``track.CommCounter`` counts them.

Views and other metadata-only ops (their results alias an input), ``empty``
and the collectives' ``wait_tensor`` launch nothing and are skipped.

Phases: ``optimizer`` while a ``torch.optim`` step runs (global optimizer step
hooks); ``backward`` inside autograd's engine, ``recompute`` there while grad
mode is on (activation checkpointing reruns the forward under grad mode;
backward kernels run with it off); ``forward`` otherwise (FSDP's copies
around its all-gathers included).

**Fusion model** (priced when the config compiles): a maximal run of
consecutive memory-bound ops between two ops of another kind (matmul,
attention, collective) is one fused region, which reads each storage it did not
produce once and writes each storage it produced that no later op of the
region reads. Inductor does not fuse across matmuls or collectives, and fuses
a pointwise chain and its reductions into few kernels; the model
under-counts a region's writes where an intermediate is also saved for
backward (the partitioner writes those) and over-counts where inductor splits a
region. It needs no graph: the same trace prices eager and compiled.

``TraceRecorder`` is the recording itself, callable from a dispatch mode that
already exists (``track.StepMemTracker`` on fake tensors); ``RecordingMode``
is a standalone ``TorchDispatchMode`` that records a real (non-fake) step:

    with RecordingMode() as rec:
        train_step()
    breakdown = price(rec.trace, hardware)
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import torch
from torch.distributed.tensor import DTensor
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook
from torch.utils._python_dispatch import TorchDispatchMode

PHASES = ("forward", "backward", "recompute", "optimizer")

aten = torch.ops.aten
_MATMULS = {aten.mm.default, aten.addmm.default, aten.bmm.default, aten.baddbmm.default}
_GROUPED = {getattr(aten, "_grouped_mm", None), getattr(aten, "_scaled_grouped_mm", None)} - {None}
_SCALED = {aten._scaled_mm.default} if hasattr(aten, "_scaled_mm") else set()


def _attention_ops() -> dict:
    """SDPA's fused kernels -> (kernel, is backward)."""
    out = {}
    for name, kernel in (("_scaled_dot_product_flash_attention", "flash"),
                         ("_scaled_dot_product_flash_attention_for_cpu", "flash"),
                         ("_scaled_dot_product_efficient_attention", "efficient"),
                         ("_scaled_dot_product_cudnn_attention", "cudnn"),
                         ("_flash_attention_forward", "flash"), ("_efficient_attention_forward", "efficient")):
        for suffix, backward in (("", False), ("_backward", True)):
            full = name.replace("_forward", "_backward") if name.endswith("_forward") and backward else (
                name if name.endswith("_forward") else name + suffix)
            op = getattr(aten, full, None)
            if op is not None:
                out[op.default] = (kernel, backward)
    return out


_ATTENTION = _attention_ops()
_SKIP_NAMES = ("empty", "wait_tensor", "_local_scalar_dense", "set_", "resize_", "record_stream")


@dataclass
class MemoryOps:
    """One phase's memory-bound ops: bytes moved one op at a time and as fused regions, and the counts."""

    eager_bytes: float = 0.0
    fused_bytes: float = 0.0
    ops: int = 0
    regions: int = 0


@dataclass
class OpTrace:
    """A step's ops, aggregated (module docstring). ``scale(f)`` stands for ``f`` such steps."""

    matmuls: Counter = field(default_factory=Counter)  # (phase, dtype, m, n, k, groups) -> calls
    attention: Counter = field(default_factory=Counter)  # (phase, kernel, dtype, b, h, sq, skv, d, causal) -> calls
    memory: dict[str, MemoryOps] = field(default_factory=lambda: {p: MemoryOps() for p in PHASES})
    host_ops: Counter = field(default_factory=Counter)  # phase -> every op that launches work (matmuls too)

    def matmul_flops(self) -> float:
        return sum(2.0 * m * n * k * calls for (_, _, m, n, k, _), calls in self.matmuls.items())

    def to_json(self) -> dict:
        return {"matmul_calls": sum(self.matmuls.values()), "matmul_tflop": round(self.matmul_flops() / 1e12, 3),
                "attention_calls": sum(self.attention.values()),
                "memory_ops": {p: vars(m) for p, m in self.memory.items()}, "host_ops": dict(self.host_ops)}


def _storage_key(t: torch.Tensor) -> int:
    try:
        return t.untyped_storage()._cdata
    except (RuntimeError, NotImplementedError):
        return id(t)


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _tensors(obj, out: list) -> list:
    if isinstance(obj, torch.Tensor):
        if isinstance(obj, DTensor):
            out.append(obj._local_tensor)
        else:
            out.append(obj)
    elif isinstance(obj, (list, tuple)):
        for x in obj:
            _tensors(x, out)
    return out


def _is_view(func) -> bool:
    """Whether ``func``'s results alias an input without writing it (views, ``detach``, ``t``...)."""
    cached = _VIEWS.get(func)
    if cached is None:
        rets = func._schema.returns
        cached = bool(rets) and all(r.alias_info is not None and not r.alias_info.is_write for r in rets)
        _VIEWS[func] = cached
    return cached


_VIEWS: dict = {}
_WRITTEN: dict = {}


def _written_arguments(func) -> tuple[int, ...]:
    """Positions of the arguments ``func`` writes (``Tensor(a!)``) and does not return (returned ones are
    already counted as outputs)."""
    cached = _WRITTEN.get(func)
    if cached is None:
        returned = {r.alias_info.before_set and next(iter(r.alias_info.before_set)) for r in func._schema.returns
                    if r.alias_info is not None}
        cached = tuple(i for i, a in enumerate(func._schema.arguments)
                       if a.alias_info is not None and a.alias_info.is_write
                       and next(iter(a.alias_info.before_set), None) not in returned)
        _WRITTEN[func] = cached
    return cached


class TraceRecorder:
    """Records ops into ``trace`` (module docstring); ``record`` is called with each op's result."""

    def __init__(self) -> None:
        self.trace = OpTrace()
        self.in_optimizer = False
        self._region_reads: dict[int, int] = {}  # storage -> bytes, read from outside the open region
        self._region_writes: dict[int, int] = {}  # storage -> bytes, produced in the open region
        self._region_phase = "forward"
        self._hooks: list = []

    def install(self) -> None:
        """Optimizer step hooks that mark the optimizer phase."""

        def pre(*_):
            self.in_optimizer = True

        def post(*_):
            self.in_optimizer = False

        self._hooks = [register_optimizer_step_pre_hook(pre), register_optimizer_step_post_hook(post)]

    def remove(self) -> None:
        self.close_region()
        for h in self._hooks:
            h.remove()
        self._hooks = []

    def reset(self) -> None:
        self.close_region()
        self.trace = OpTrace()

    def phase(self) -> str:
        if self.in_optimizer:
            return "optimizer"
        if torch._C._current_graph_task_id() != -1:
            return "recompute" if torch.is_grad_enabled() else "backward"
        return "forward"

    def close_region(self) -> None:
        if self._region_writes or self._region_reads:
            mem = self.trace.memory[self._region_phase]
            mem.fused_bytes += sum(self._region_reads.values()) + sum(self._region_writes.values())
            mem.regions += 1
            self._region_reads.clear()
            self._region_writes.clear()

    def record(self, func, args, kwargs, out) -> None:
        name = func.__name__.split(".")[0]
        if _is_view(func) or name in _SKIP_NAMES or name.startswith("empty"):
            return
        phase = self.phase()
        trace = self.trace
        namespace = func.namespace
        if namespace in ("c10d", "_c10d_functional"):
            self.close_region()
            trace.host_ops[phase] += 1
            return
        trace.host_ops[phase] += 1
        if func in _MATMULS or func in _GROUPED or func in _SCALED:
            self.close_region()
            self._matmul(func, args, out, phase)
            return
        attention = _ATTENTION.get(func)
        if attention is not None:
            self.close_region()
            self._attention(attention, func, args, kwargs or {}, phase)
            return
        ins = _tensors(args, [])
        if kwargs:
            _tensors(list(kwargs.values()), ins)
        outs = _tensors(out, [])
        for i in _written_arguments(func):  # in-place and out= ops (foreach, fused AdamW) write these
            if i < len(args):
                _tensors(args[i], outs)
        mem = trace.memory[phase]
        mem.ops += 1
        mem.eager_bytes += sum(_nbytes(t) for t in ins) + sum(_nbytes(t) for t in outs)
        if phase != self._region_phase:
            self.close_region()
            self._region_phase = phase
        reads, writes = self._region_reads, self._region_writes
        out_keys = [_storage_key(t) for t in outs]
        for t in ins:
            key = _storage_key(t)
            if key in writes:
                if key not in out_keys:
                    writes[key] = 0  # produced and consumed inside the region: never written out
            elif key not in reads:
                reads[key] = _nbytes(t)
        for key, t in zip(out_keys, outs):
            writes[key] = max(writes.get(key, 0), _nbytes(t))

    def _matmul(self, func, args, out, phase: str) -> None:
        if func in (aten.addmm.default, aten.baddbmm.default):
            a, b = args[1], args[2]
        else:
            a, b = args[0], args[1]
        if isinstance(a, DTensor):
            a, b = a._local_tensor, b._local_tensor
        dtype = str(a.dtype).replace("torch.", "")
        groups = 1
        if func in _GROUPED and a.dim() == 2 and b.dim() == 2:  # weight gradient: k split into groups
            m, k, n = a.shape[0], a.shape[1], b.shape[1]
            offs = args[2] if len(args) > 2 else None
            groups = offs.shape[0] if isinstance(offs, torch.Tensor) else 1
        else:
            o = out[0] if isinstance(out, (tuple, list)) else out
            n = o.shape[-1]
            m = o.numel() // max(n, 1)
            k = a.shape[-1]
            if func in _GROUPED:
                groups = b.shape[0] if b.dim() == 3 else 1
        self.trace.matmuls[(phase, dtype, int(m), int(n), int(k), int(groups))] += 1

    def _attention(self, kind, func, args, kwargs, phase: str) -> None:
        kernel, backward = kind
        q, k = (args[1], args[2]) if backward else (args[0], args[1])  # backward: (grad_out, query, key, ...)
        causal = _argument(func, args, kwargs, "is_causal")
        b, h, sq, d = (int(x) for x in q.shape)
        skv = int(k.shape[-2])
        self.trace.attention[(phase, kernel + ("_backward" if backward else ""),
                              str(q.dtype).replace("torch.", ""), b, h, sq, skv, d, bool(causal))] += 1


def _argument(func, args, kwargs, name: str):
    """The value ``func`` was called with for its argument ``name`` (None where it has none)."""
    if name in kwargs:
        return kwargs[name]
    for i, arg in enumerate(func._schema.arguments):
        if arg.name == name:
            return args[i] if i < len(args) else arg.default_value
    return None


class RecordingMode(TorchDispatchMode):
    """``TraceRecorder`` as a dispatch mode of its own, for a real (or fake) step outside ``simulate``.
    Records the ops eager PyTorch dispatches: a compiled region's kernels are not aten ops, so record the
    eager step and price it as compiled (``price(..., compiled=True)``)."""

    def __init__(self) -> None:
        super().__init__()
        self.recorder = TraceRecorder()

    @property
    def trace(self) -> OpTrace:
        return self.recorder.trace

    def __enter__(self):
        self.recorder.install()
        return super().__enter__()

    def __exit__(self, *exc):
        self.recorder.remove()
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if DTensor in types:
            return NotImplemented
        out = func(*args, **(kwargs or {}))
        self.recorder.record(func, args, kwargs, out)
        return out
