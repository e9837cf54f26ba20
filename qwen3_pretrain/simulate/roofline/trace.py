"""The op trace of a training step: every aten operator the engine dispatches, aggregated as it goes.

A step of Qwen3-8B dispatches some 10^5 operators per rank; storing each would
double the simulation's time and memory, so ``OpTrace`` keeps what pricing
needs, summed on the fly:

* **matmuls** (``mm``, ``addmm``, ``bmm``, ``baddbmm``, their ``out=`` and
  in-place forms, which the fused loss's head writes into buffers,
  ``_grouped_mm``, ``_scaled_mm``): calls by (phase, dtype, m, n, k, groups),
  FLOPs ``2 m n k groups`` per call; ``m`` is the output's rows (batches folded
  in), ``k`` the contracted size; a grouped matmul keeps one group's sizes
  (rows per group, or the contracted size per group for the weight gradient,
  the groups of equal size: a fake tensor has no offsets to read) and its
  group count;
* **triangular solves** (``linalg_solve_triangular``, the Gated DeltaNet's
  chunk inverse): calls by (phase, dtype, batch, n, k), ``n^2 k`` FLOPs per
  system; under compile a kernel of its own, like a matmul;
* **attention** (SDPA's fused kernels, forward and backward): calls by (phase,
  kernel, dtype, batch, heads, q_len, kv_len, head_dim, causal). SDPA's math
  kernel decomposes into ``bmm`` and softmax before dispatch and lands in the
  two other categories, with its whole square and its probabilities' traffic;
* **memory-bound ops** (everything else that launches a kernel: elementwise,
  copies, casts, reductions, norms, the optimizer's foreach ops): per phase the
  bytes read and written one op at a time (eager), and as compile would fuse
  them (below), with the op and fused-region counts the host term needs, and
  the same bytes by the size of the kernel that moves them (a power-of-two
  bucket per op or fused region: a CPU streams a cache-sized working set
  faster than a memory-sized one), and the compiled scope's ops one at a time
  by op class (``MemoryOps.fused_ops``: the per-element work a fused kernel
  still does);
* **collectives** are not kept here: ``track.CommCounter`` counts them.

Views and other metadata-only ops (their results alias an input), ``empty``
and the collectives' ``wait_tensor`` launch nothing and are skipped.

**Compiled scope**: ``compile: true`` compiles the decoder layers
(``parallel/parallelize.py: compile_layer``); the embedding, the final norm, the
loss, the optimizer and FSDP's copies and hooks outside them stay eager. The
recorder's ``scope`` names what runs compiled: ``"layers"`` (the default of
``TraceRecorder``, what simulate prices: every ``DecoderLayer``, the
multi-token-prediction layers' too; where the engine compiles a layer's parts
instead, under expert parallelism or a tensor-parallel full recompute, the few
norms and residual adds joining them are counted as compiled), given modules
(``mark_compiled``: a real compiled model's compiled modules), or None (the
whole step: ``RecordingMode``'s default). Ops inside a scoped module's forward (a
recompute's too) and inside the backward of the autograd nodes that forward
created (told by the autograd sequence numbers handed out meanwhile) are in the
scope; the others are counted apart (``MemoryOps.outside_bytes``,
``OpTrace.outside_ops``) and priced eager under compile.

Phases: ``optimizer`` while a ``torch.optim`` step runs (global optimizer step
hooks); ``backward`` inside autograd's engine, ``recompute`` there while grad
mode is on (activation checkpointing reruns the forward under grad mode;
backward kernels run with it off); ``forward`` otherwise (FSDP's copies
around its all-gathers included).

**Fusion model** (priced when the config compiles): a maximal run of
consecutive memory-bound ops between two ops of another kind (matmul,
attention, collective, triangular solve, convolution: a convolution is a
kernel of its own) is one fused region, which reads each storage it did not
produce once and writes each storage it produced that no later op of the
region reads. Inductor does not fuse across matmuls or collectives, and fuses
a pointwise chain and its reductions into few kernels; the model
under-counts a region's writes where an intermediate is also saved for
backward (the partitioner writes those) and over-counts where inductor splits a
region. Fusion saves the traffic, not the arithmetic: the region's ops still
compute every element (``MemoryOps.fused_ops``, which a CPU's pricing
charges). It needs no graph: the same trace prices eager and compiled.

``TraceRecorder`` is the recording itself, callable from a dispatch mode that
already exists (``track.StepMemTracker`` on fake tensors); ``RecordingMode``
is a standalone ``TorchDispatchMode`` that records a real (non-fake) step:

    with RecordingMode() as rec:
        train_step()
    breakdown = price(rec.trace, hardware)
"""

from __future__ import annotations

import bisect
import itertools
import math
import weakref
from collections import Counter
from dataclasses import dataclass, field

import torch
from torch.distributed.tensor import DTensor
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook
from torch.utils._python_dispatch import TorchDispatchMode

PHASES = ("forward", "backward", "recompute", "optimizer")

aten = torch.ops.aten
_MATMULS = {aten.mm.default, aten.addmm.default, aten.bmm.default, aten.baddbmm.default,
            aten.mm.out, aten.addmm.out, aten.addmm_.default, aten.bmm.out, aten.baddbmm.out, aten.baddbmm_.default}
# matmuls whose first argument is the added term (the products are its second and third)
_ADDED = {aten.addmm.default, aten.baddbmm.default, aten.addmm.out, aten.addmm_.default, aten.baddbmm.out,
          aten.baddbmm_.default}
# the overloads (``.default``), which dispatch sees, not the packets
_GROUPED = {getattr(getattr(aten, name, None), "default", None) for name in ("_grouped_mm", "_scaled_grouped_mm")} - {None}
_SCALED = {aten._scaled_mm.default} if hasattr(aten, "_scaled_mm") else set()
# triangular solves: compute-bound, a kernel of their own under compile too (inductor calls the library's)
_SOLVES = {aten.linalg_solve_triangular.default, aten.linalg_solve_triangular.out}


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
# launch nothing: ``_unsafe_view`` is a view whose schema does not say so (reshape's after a copy)
_SKIP_NAMES = ("empty", "wait_tensor", "_local_scalar_dense", "set_", "resize_", "record_stream", "_unsafe_view")


@dataclass
class MemoryOps:
    """One phase's memory-bound ops: bytes moved one op at a time and as fused regions, and the counts."""

    eager_bytes: float = 0.0
    fused_bytes: float = 0.0  # the compiled scope's fused regions
    ops: int = 0
    regions: int = 0
    outside_bytes: float = 0.0  # ops outside the compiled scope, one at a time (in ``eager_bytes`` too)
    # the compiled scope's memory-bound ops one at a time, by op class (``op_class``) -> bytes: the work a fused
    # kernel still does per element (convolutions aside), priced at each class's fastest rate on a device with
    # class curves (``pricing.memory_seconds``)
    fused_ops: Counter = field(default_factory=Counter)
    # the same bytes by how many one kernel moves: (how, size bucket, reuse bucket, op class) -> bytes,
    # ``how`` "eager" (every op), "fused" (each fused region's total) or "outside"; size bucket
    # ``size_bucket``: a device whose bandwidth depends on the working set (a CPU's caches,
    # ``Hardware.bandwidth_curve``) prices each at its own rate; reuse bucket: the traffic since the read
    # tensor's last touch (0 for writes); op class ``op_class`` (``FUSED`` for a fused region)
    sizes: Counter = field(default_factory=Counter)


@dataclass
class OpTrace:
    """A step's ops, aggregated (module docstring). ``scale(f)`` stands for ``f`` such steps."""

    matmuls: Counter = field(default_factory=Counter)  # (phase, dtype, m, n, k, groups) -> calls
    # triangular solves (``linalg_solve_triangular``): (phase, dtype, batch, n, k) -> calls, a batch of n x n
    # systems against k right-hand sides each, n^2 k FLOPs a system
    solves: Counter = field(default_factory=Counter)
    attention: Counter = field(default_factory=Counter)  # (phase, kernel, dtype, b, h, sq, skv, d, causal) -> calls
    memory: dict[str, MemoryOps] = field(default_factory=lambda: {p: MemoryOps() for p in PHASES})
    host_ops: Counter = field(default_factory=Counter)  # phase -> every op that launches work (matmuls too)
    # phase -> the ops of ``host_ops`` outside the compiled scope (collectives aside): eager under compile too
    outside_ops: Counter = field(default_factory=Counter)
    outside_kernels: int = 0  # matmul, solve and attention calls outside the compiled scope
    # the step's minor page faults (first touches of pages its allocator took from the OS) and the 4 KiB pages
    # it handed back, where counted on a real CPU step (getrusage; the resident memory ``malloc_trim`` drops);
    # 0: none counted (fake tensors take none; an accelerator's tensors come from its caching allocator)
    page_faults: int = 0
    pages_released: int = 0
    # of the faults, the transparent huge pages (2 MiB) faulted in: each one of ``page_faults``
    huge_page_faults: int = 0

    def matmul_flops(self) -> float:
        return sum(2.0 * m * n * k * g * calls for (_, _, m, n, k, g), calls in self.matmuls.items())

    def solve_flops(self) -> float:
        return sum(float(b) * n * n * k * calls for (_, _, b, n, k), calls in self.solves.items())

    def to_json(self) -> dict:
        return {"matmul_calls": sum(self.matmuls.values()), "matmul_tflop": round(self.matmul_flops() / 1e12, 3),
                "solve_calls": sum(self.solves.values()), "solve_tflop": round(self.solve_flops() / 1e12, 3),
                "attention_calls": sum(self.attention.values()),
                "memory_ops": {p: {**{k: v for k, v in vars(m).items() if k not in ("sizes", "fused_ops")},
                                   "fused_op_bytes": dict(m.fused_ops)} for p, m in self.memory.items()},
                "host_ops": dict(self.host_ops),
                "outside_compiled_ops": dict(self.outside_ops)}


def size_bucket(nbytes: float) -> int:
    """The bucket of a kernel that moves ``nbytes``: ``b`` holds (2^(b-1), 2^b] bytes (``bucket_bytes``)."""
    return max(0, (int(nbytes) - 1).bit_length())


NEVER = 127  # the reuse bucket of a read no recorded kernel's touch precedes

# Op classes of the memory-bound ops (``op_class``), each with its own bandwidth curve where a device has one
# (``Hardware.class_curves``): a CPU streams them at different rates per byte
INDEX, CAST, COPY, STRIDED, STRIDED_MATH, CONV, INPLACE, BF16, BF16_MATH, FP32_MATH, FP32 = (
    "index", "cast", "copy", "strided", "strided_math", "conv", "inplace", "bf16", "bf16_math", "fp32_math", "fp32")
# convolutions (the hybrid's short causal conv, depthwise): not a matmul in the trace, priced by their bytes
_CONV_OPS = frozenset(("convolution", "convolution_backward", "_convolution", "mkldnn_convolution",
                       "_conv_depthwise2d", "conv1d", "slow_conv_dilated2d"))
FUSED = "fused"  # a compiled region's kernels (inductor computes in fp32 registers whatever it loads)
_INDEX_OPS = frozenset((
    "index", "index_select", "index_add", "index_add_", "index_put", "index_put_", "_index_put_impl_", "index_copy",
    "index_copy_", "index_fill", "index_fill_", "gather", "scatter", "scatter_", "scatter_add", "scatter_add_",
    "scatter_reduce", "scatter_reduce_", "sort", "argsort", "topk", "embedding", "embedding_dense_backward",
    "masked_select", "masked_scatter", "masked_scatter_", "nonzero", "cumsum", "searchsorted", "bincount",
    "histc", "_unique2", "unique_consecutive", "repeat_interleave", "take", "put_", "_embedding_bag"))
_COPY_OPS = frozenset(("copy_", "_to_copy", "clone", "cat", "stack", "_foreach_copy_", "fill_", "zero_", "zeros_like",
                       "full", "zeros", "ones", "constant_pad_nd", "split_with_sizes_copy", "_copy_from_and_resize"))
# transcendental functions and softmax: a vectorized polynomial per element, several times an add's work
_MATH_OPS = frozenset((
    "exp", "exp_", "silu", "silu_", "silu_backward", "sigmoid", "sigmoid_", "sigmoid_backward", "tanh", "tanh_",
    "tanh_backward", "log", "log_", "softplus", "softplus_backward", "gelu", "gelu_backward", "erf", "_softmax",
    "_softmax_backward_data", "_log_softmax", "_log_softmax_backward_data", "logsumexp", "log1p", "expm1"))
_LOW = (torch.bfloat16, torch.float16)


def op_class(name: str, ins: list, outs: list) -> str:
    """The class of a memory-bound op for its bandwidth: ``index`` (gathers, scatters, sorts, routing's row
    moves: one row or element at a time), ``conv`` (a convolution, forward or backward), ``strided_math``
    (a transcendental function or softmax of bf16 or fp16 reading a non-contiguous tensor: one element at a
    time, no vector code), ``strided`` (any other op reading a non-contiguous tensor of more than one
    element: a transpose's ``contiguous``, arithmetic on a transposed view), ``cast`` (a copy into another
    dtype), ``copy`` (a copy, fill or concatenation in one dtype), ``bf16_math`` (a transcendental function
    or softmax of a bf16 or fp16 tensor), ``bf16`` (other arithmetic with a bf16 or fp16 operand: a CPU
    converts it through fp32 and back), ``fp32_math`` (a transcendental function or softmax of fp32
    tensors, in place or not: the loss's exponential of its fp32 logits, on a CPU 3-5x an fp32 multiply's
    time per byte), ``inplace`` (other fp32 arithmetic that writes its first operand: each cache line read
    is written back without a second fetch; the optimizer's) and ``fp32`` (the rest)."""
    if name in _INDEX_OPS:
        return INDEX
    if name in _CONV_OPS:
        return CONV
    if any(t.numel() > 1 and not t.is_contiguous() for t in ins):
        low = any(t.dtype in _LOW for t in ins + outs)
        return STRIDED_MATH if name in _MATH_OPS and low else STRIDED
    if name in _COPY_OPS:
        dtypes = {t.dtype for t in ins + outs if t.is_floating_point()}
        return CAST if len(dtypes) > 1 else COPY
    if any(t.dtype in _LOW for t in ins + outs):
        return BF16_MATH if name in _MATH_OPS else BF16
    if name in _MATH_OPS:
        return FP32_MATH
    return INPLACE if name.endswith("_") else FP32


# Gathers whose output holds exactly the source elements they read (one per index, whole rows for the row
# gathers): ``gather``, the embedding lookup, ``index_select``, advanced indexing (``x[idx]``), ``take``
_GATHERS = frozenset(("gather", "embedding", "index_select", "index", "take"))


def _touched(name: str, args: tuple, outs: list) -> tuple[torch.Tensor | None, int]:
    """(tensor, bytes) where an index op touches fewer of a tensor's bytes than it holds: a gather reads as
    many of its source's elements as it writes (one per index; ``embedding``, ``index_select``, ``index`` and
    ``take`` as many as their output holds: the rows gathered x a row's bytes, an embedding lookup of 8,192
    tokens reading 8,192 rows of a 151,936-row table), a scatter or index add reads and writes as many of its
    destination's as its source has; (None, 0) for the other ops (every byte of every operand).
    ``embedding_dense_backward`` keeps its whole output: it zero-fills the [vocab, hidden] gradient before
    adding the rows into it, so the table's bytes are written."""
    args = tuple(a._local_tensor if isinstance(a, DTensor) else a for a in args)
    if name in _GATHERS and outs and isinstance(args[0], torch.Tensor):
        return args[0], outs[0].numel() * args[0].element_size()
    if name.startswith(("scatter", "index_add")) and len(args) > 3:
        source = args[3] if isinstance(args[3], torch.Tensor) else args[2]  # a scattered scalar: the index's count
        return args[0], source.numel() * args[0].element_size()
    if name in ("index_put", "index_put_", "_index_put_impl_") and len(args) > 2:
        return args[0], args[2].numel() * args[0].element_size()
    return None, 0


def bucket_bytes(bucket: int) -> float:
    """The size a bucket's kernels are priced at: the geometric middle of its range, 2^(b - 1/2) bytes."""
    return 2.0 ** (bucket - 0.5)


_STORAGE_IDS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_NEXT_STORAGE_ID = itertools.count()


def _storage_key(t: torch.Tensor) -> int:
    """One id per storage for the storage's lifetime. Not its address: the allocator hands a freed
    address to the next tensor within the same fused region, which made the fused bytes of two identical
    steps differ by 0.5-4%. torch keeps one Python object per storage (real and fake), so a weak map from
    it is stable while the storage lives and forgets it when freed."""
    try:
        storage = t.untyped_storage()
    except (RuntimeError, NotImplementedError):
        return id(t)
    key = _STORAGE_IDS.get(storage)
    if key is None:
        key = _STORAGE_IDS[storage] = next(_NEXT_STORAGE_ID)
    return key


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _same_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``a`` is a view of ``b``'s storage (an in-place index op returns its destination)."""
    return _storage_key(a) == _storage_key(b)


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
_LAST = 2**64  # above every autograd sequence number
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

    def __init__(self, scope: str | None = "layers") -> None:
        self.trace = OpTrace()
        self.in_optimizer = False
        self.scope = scope  # "layers", None or "modules" (module docstring, "Compiled scope")
        self._region_reads: dict[int, int] = {}  # storage -> bytes, read from outside the open region
        self._region_reuse: dict[int, int] = {}  # storage -> its reuse bucket at the region's first read of it
        self._clock = 0  # bytes every recorded kernel has touched so far (reads and writes)
        self._last: dict[int, int] = {}  # storage -> ``_clock`` after its last touch
        self._region_writes: dict[int, int] = {}  # storage -> bytes, produced in the open region
        self._region_phase = "forward"
        self._hooks: list = []
        self._scoped = scope is not None  # else the whole step is the compiled scope
        self._scope_depth = 0  # compiled modules whose forward is running
        self._scope_start: list[int] = []  # the autograd sequence number at each open forward's start
        self._scope_ranges: list[tuple[int, int]] = []  # [start, end) of the nodes the scope's forwards made
        self._module_hooks: list = []

    def _enter(self, *_) -> None:
        self._scope_depth += 1
        self._scope_start.append(torch._C._autograd._get_sequence_nr())

    def _leave(self, *_) -> None:
        self._scope_depth -= 1
        start = self._scope_start.pop()
        end = torch._C._autograd._get_sequence_nr()
        if end > start and self._scope_depth == 0:
            self._scope_ranges.append((start, end))

    def mark_compiled(self, modules) -> None:
        """Name the modules that run compiled, instead of the decoder layers (module docstring, "Compiled
        scope")."""
        self.scope, self._scoped = "modules", True
        for module in modules:
            self._module_hooks += [module.register_forward_pre_hook(self._enter),
                                   module.register_forward_hook(self._leave, always_call=True)]

    def in_compiled_scope(self) -> bool:
        """Whether the op being recorded runs inside the compiled scope."""
        if not self._scoped or self._scope_depth:
            return True
        node = torch._C._current_autograd_node()
        if node is None:
            return False
        seq = node._sequence_nr()
        i = bisect.bisect_right(self._scope_ranges, (seq, _LAST)) - 1  # the last range starting at or before seq
        return i >= 0 and seq < self._scope_ranges[i][1]

    def install(self) -> None:
        """Optimizer step hooks that mark the optimizer phase."""

        def pre(*_):
            self.in_optimizer = True

        def post(*_):
            self.in_optimizer = False

        self._hooks = [register_optimizer_step_pre_hook(pre), register_optimizer_step_post_hook(post)]
        if self.scope == "layers":
            from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook

            from qwen3_pretrain.models.qwen3.model import DecoderLayer

            def enter(module, *_):
                if isinstance(module, DecoderLayer):
                    self._enter()

            def leave(module, *_):
                if isinstance(module, DecoderLayer):
                    self._leave()

            self._hooks += [register_module_forward_pre_hook(enter),
                            register_module_forward_hook(leave, always_call=True)]

    def remove(self) -> None:
        self.close_region()
        for h in self._hooks + self._module_hooks:
            h.remove()
        self._hooks = []
        self._module_hooks = []

    def reset(self) -> None:
        self.close_region()
        self.trace = OpTrace()
        self._clock = 0
        self._last = {}
        self._scope_ranges = []

    def phase(self) -> str:
        if self.in_optimizer:
            return "optimizer"
        if torch._C._current_graph_task_id() != -1:
            return "recompute" if torch.is_grad_enabled() else "backward"
        return "forward"

    def close_region(self) -> None:
        if self._region_writes or self._region_reads:
            mem = self.trace.memory[self._region_phase]
            written = sum(self._region_writes.values())
            moved = sum(self._region_reads.values()) + written
            mem.fused_bytes += moved
            bucket = size_bucket(moved)
            for key, nbytes in self._region_reads.items():
                mem.sizes[("fused", bucket, self._region_reuse[key], FUSED)] += nbytes
            mem.sizes[("fused", bucket, 0, FUSED)] += written
            mem.regions += 1
            self._region_reads.clear()
            self._region_reuse.clear()
            self._region_writes.clear()

    def record(self, func, args, kwargs, out) -> None:
        name = func.__name__.split(".")[0]
        if _is_view(func) or name in _SKIP_NAMES or name.startswith("empty") or func.namespace == "prim":
            return  # prim ops (``prim.device``, asked by the pipeline schedule) launch no kernel
        phase = self.phase()
        trace = self.trace
        namespace = func.namespace
        if namespace in ("c10d", "_c10d_functional"):
            self.close_region()
            trace.host_ops[phase] += 1
            return
        trace.host_ops[phase] += 1
        inside = self.in_compiled_scope()
        if not inside:
            trace.outside_ops[phase] += 1
        ins = _tensors(args, [])
        if kwargs:
            _tensors(list(kwargs.values()), ins)
        outs = _tensors(out, [])
        for i in _written_arguments(func):  # in-place and out= ops (foreach, fused AdamW) write these
            if i < len(args):
                _tensors(args[i], outs)
        if self._kernel(func, args, kwargs or {}, out, phase):  # a kernel of its own: ends the open fused region
            self.close_region()
            trace.outside_kernels += not inside
            self._touch(ins + outs)
            return
        mem = trace.memory[phase]
        mem.ops += 1
        big, part = _touched(name, args, outs) if name in _INDEX_OPS else (None, 0)

        def nbytes(t: torch.Tensor) -> int:
            return part if t is big or (big is not None and _same_storage(t, big)) else _nbytes(t)

        read = sum(nbytes(t) for t in ins)
        moved = read + sum(nbytes(t) for t in outs)
        mem.eager_bytes += moved
        bucket = size_bucket(moved)
        reuse = [(t, self._reuse(t)) for t in ins]  # before this op touches them
        in_reuse = {_storage_key(t): r for t, r in reuse}
        cls = op_class(name, ins, outs)
        for how in ("eager",) if inside else ("eager", "outside"):
            for t, r in reuse:
                mem.sizes[(how, bucket, r, cls)] += nbytes(t)
            mem.sizes[(how, bucket, 0, cls)] += moved - read
        self._touch(ins + outs)
        if not inside:  # eager under compile too: ends the open fused region
            self.close_region()
            mem.outside_bytes += moved
            return
        if cls == CONV:  # inductor calls the convolution as its own kernel: a region of its own, on its class
            self.close_region()
            for t, r in reuse:
                mem.sizes[("fused", bucket, r, CONV)] += nbytes(t)
            mem.sizes[("fused", bucket, 0, CONV)] += moved - read
            mem.fused_bytes += moved
            mem.regions += 1
            return
        mem.fused_ops[cls] += moved
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
                reads[key] = nbytes(t)
                self._region_reuse[key] = in_reuse[key]
        for key, t in zip(out_keys, outs):
            writes[key] = max(writes.get(key, 0), nbytes(t))

    def _reuse(self, t: torch.Tensor) -> int:
        """The reuse bucket of reading ``t`` now: ``size_bucket`` of the bytes touched since its storage's
        last touch plus its own (0 for none between: an in-place op's output read again), ``NEVER`` where
        no recorded kernel touched it (a parameter or a tensor from before the recording)."""
        last = self._last.get(_storage_key(t))
        return NEVER if last is None else size_bucket(self._clock - last + _nbytes(t))

    def _touch(self, tensors: list) -> None:
        for t in tensors:
            self._clock += _nbytes(t)
            self._last[_storage_key(t)] = self._clock

    def _matmul(self, func, args, out, phase: str) -> None:
        if func in _ADDED:
            a, b = args[1], args[2]
        else:
            a, b = args[0], args[1]
        if isinstance(a, DTensor):
            a, b = a._local_tensor, b._local_tensor
        dtype = str(a.dtype).replace("torch.", "")
        groups = 1
        offs = args[2] if len(args) > 2 else None
        offs = offs if isinstance(offs, torch.Tensor) else None
        if func in _GROUPED and a.dim() == 2 and b.dim() == 2:  # weight gradient: k split into groups
            groups = offs.shape[0] if offs is not None else 1
            m, k, n = a.shape[0], a.shape[1] // groups, b.shape[1]
        else:
            o = out[0] if isinstance(out, (tuple, list)) else out
            n = o.shape[-1]
            m = o.numel() // max(n, 1)
            k = a.shape[-1]
            if func in _GROUPED:  # rows split into groups (2-D input, 3-D weights) or a batch of groups
                groups = b.shape[0] if b.dim() == 3 else (a.shape[0] if a.dim() == 3 else 1)
                m //= max(groups, 1)
        self.trace.matmuls[(phase, dtype, int(m), int(n), int(k), int(groups))] += 1

    def _kernel(self, func, args, kwargs, out, phase: str) -> bool:
        """Record ``func`` where it is a matmul, a triangular solve or a fused attention call; whether it was."""
        if func in _MATMULS or func in _GROUPED or func in _SCALED:
            self._matmul(func, args, out, phase)
        elif func in _SOLVES:
            self._solve(func, args, kwargs, phase)
        elif func in _ATTENTION:
            self._attention(_ATTENTION[func], func, args, kwargs, phase)
        else:
            return False
        return True

    def _solve(self, func, args, kwargs, phase: str) -> None:
        a, b = (x._local_tensor if isinstance(x, DTensor) else x for x in args[:2])
        n = int(a.shape[-1])
        left = _argument(func, args, kwargs, "left")
        k = int(b.shape[-1] if left in (None, True) else b.shape[-2])  # right: X A = B, B's rows
        batch = math.prod(torch.broadcast_shapes(a.shape[:-2], b.shape[:-2]))  # the batch dims broadcast
        self.trace.solves[(phase, str(b.dtype).replace("torch.", ""), int(batch), n, k)] += 1

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
    eager step (dynamo disabled) and price it as compiled (``price(..., compiled=True)``), naming what runs
    compiled (``scope``, or ``recorder.mark_compiled``; default: the whole step)."""

    def __init__(self, scope: str | None = None) -> None:
        super().__init__()
        self.recorder = TraceRecorder(scope)

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
