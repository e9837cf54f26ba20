"""What a simulated step is measured with: memory by category, collective bytes by axis and kind, and
the one stand-in a run without data needs (scalar reads).

``StepMemTracker`` is a ``TorchDispatchMode`` above ``FakeTensorMode``: it sees
every operator the engine issues on fake tensors, collectives included, and
does all three.
"""

from __future__ import annotations

import weakref
from collections import defaultdict

import torch
import torch.distributed as dist
from torch.distributed._tools.mem_tracker import MemTracker, _MemRefType
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._sharding_prop import ShardingPropagator
from torch.optim.optimizer import register_optimizer_step_pre_hook
from torch.utils._python_dispatch import TorchDispatchMode

from qwen3_pretrain.simulate.roofline.trace import TraceRecorder

CATEGORIES = {"PARAM": "parameters", "BUFFER": "parameters", "GRAD": "gradients",
              "OPT": "optimizer", "ACT": "activations", "TEMP": "temporaries", "OTH": "parameters"}


class StepMemTracker(MemTracker):
    """torch's ``MemTracker`` keeping only the whole-device peak by category.

    The stock tracker also snapshots every module's memory at each of its
    hooks and at each operator, which makes a step of a 36-layer model take
    minutes; here the hooks keep only what the categories need (parameters
    registered when first seen, the recomputation region of activation
    checkpointing, FSDP's gradients) and the peak is the device's alone.

    FSDP's gradients are tensors the stock tracker does not know as such:
    autograd's gradients of the *unsharded* parameters, the fp32 copies FSDP
    accumulates them in across micro-batches before the step's reduce-scatter,
    and the reduced shards it assigns to the sharded parameters. Created in
    backward, they would count as temporaries; ``_settle_grads`` files them as
    gradients at the next FSDP unit's hook (and before the optimizer step).
    It also files the units' gathered weights as parameters, which first
    appear in forward (as activations) and keep their storage afterwards.

    DTensor works out an operator's output shapes by running it once on
    example tensors of the global shape, in the active fake mode (the first
    time it meets each operator and shape; then it is cached). Those
    tensors are no device memory: the tracker ignores every operator issued
    while DTensor propagates (``_propagation``), so the first step's figures
    are the steady state's and one step is enough.
    """

    def __init__(self, comm: "CommCounter | None" = None, trace: "TraceRecorder | None" = None) -> None:
        super().__init__()
        self.comm = comm
        self.trace = trace  # the roofline's op trace (simulate/roofline), recorded from the same operators
        self._propagation = _Depth()
        self._grad_units: set[FSDPModule] = set()  # units whose backward may have left unfiled gradients
        self._units: weakref.WeakSet[FSDPModule] = weakref.WeakSet()  # every unit seen in backward
        self._settle_hook = None

    def __enter__(self) -> "StepMemTracker":
        # DTensor enters its ``_fake_mode_lock`` around every shape propagation: count the nesting there
        self._saved_lock = ShardingPropagator._fake_mode_lock
        ShardingPropagator._fake_mode_lock = self._propagation
        return super().__enter__()

    def __exit__(self, *args) -> None:
        ShardingPropagator._fake_mode_lock = self._saved_lock
        super().__exit__(*args)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        """MemTracker's, with its per-operator work cut to what the categories need; it also answers scalar
        reads and counts collectives (one mode instead of three: every operator crosses each mode)."""
        if DTensor in types:
            return NotImplemented  # let DTensor run its local operators, which this mode then sees
        if func is _SCALAR:
            return scalar_read(args[0])
        if self.comm is not None:
            self.comm.count(func, args)
        if func is _WAIT:
            # the fake kernel of wait_tensor returns a new tensor; eagerly it hands back its input
            return args[0]
        res = func(*args, **(kwargs or {}))
        if self._propagation.depth:
            return res
        if self.trace is not None:
            self.trace.record(func, args, kwargs, res)
        if self._in_opt:
            reftype = _MemRefType.OPT
        elif self._mod_tracker.is_bw and not self._in_ac:
            reftype = _MemRefType.TEMP
        else:
            reftype = _MemRefType.ACT
        for t in (res if isinstance(res, (tuple, list)) else (res,)):
            if isinstance(t, torch.Tensor):
                self._track(reftype, t)
        self._update_peak_stats(None)
        return res

    def _update_peak_stats(self, peak_state) -> None:
        for dev, snap in self._curr_mem_snap.items():
            if self._peak_mem.get(dev, 0) < snap["Total"]:
                self._peak_mem[dev] = snap["Total"]
                self._peak_mem_snap[dev] = dict(snap)

    def reset_peak(self) -> None:
        """Start a new peak from what is held now."""
        self._peak_mem = {dev: snap["Total"] for dev, snap in self._curr_mem_snap.items()}
        self._peak_mem_snap = {dev: dict(snap) for dev, snap in self._curr_mem_snap.items()}

    def _pre_fw_hook(self, module, inputs) -> None:
        if self._grad_units and isinstance(module, FSDPModule):
            self._settle_grads()
        if module not in self.memory_tracking:
            self._track_module_params_and_buffers(module, install_grad_hooks=True)
            self.memory_tracking[module] = True
        elif self._mod_tracker.is_bw and self._ac_mod is None:
            # A module run again during backward is recomputation (activation checkpointing).
            self._ac_mod = _weak(module)
            self._in_ac = True

    def _post_fw_hook(self, module, inputs, outputs) -> None:
        if self._mod_tracker.is_bw and self._ac_mod is not None and self._ac_mod() is module:
            self._ac_mod = None
            self._in_ac = False

    def _pre_bw_hook(self, module, args) -> None:
        if isinstance(module, FSDPModule):
            self._units.add(module)
            self._grad_units.add(module)
            self._settle_grads()

    def _post_bw_hook(self, module, args) -> None:
        if self._grad_units and isinstance(module, FSDPModule):
            self._settle_grads()

    def _settle_grads(self) -> None:
        """File the FSDP tensors of the units lately in backward; a unit is done once FSDP's post-backward
        has taken autograd's compute-dtype gradients (into the fp32 accumulation, or reduced them)."""
        for unit in list(self._grad_units):
            if self._file_unit(unit):
                self._grad_units.discard(unit)

    def _file_unit(self, unit: FSDPModule) -> bool:
        """Files ``unit``'s gathered weights as parameters and its gradients as gradients; True when its
        post-backward is over (a gradient exists and none awaits FSDP's upcast)."""
        held = waiting = False
        for param in _fsdp_params(unit):
            unsharded = getattr(param, "_unsharded_param", None)
            if unsharded is None:
                continue
            # the gathered weight: its storage is kept (emptied and refilled) from gather to gather
            self._update_and_maybe_create_winfos(unsharded, _MemRefType.PARAM)
            grad = unsharded.grad
            low = grad is not None and param.reduce_dtype is not None and grad.dtype != param.reduce_dtype
            for t in (grad, param.unsharded_accumulated_grad, param.sharded_param.grad):
                if t is not None:
                    self._update_and_maybe_create_winfos(t, _MemRefType.GRAD)
                    held |= t is not grad or not low
            waiting |= low
        return held and not waiting

    def _before_optimizer_step(self, *args) -> None:
        # the reduced shards of the last units, whose post-backward ran after the last module hook
        self._grad_units.update(self._units)
        self._settle_grads()

    def _register_global_optimizer_hook(self) -> None:
        super()._register_global_optimizer_hook()
        self._settle_hook = register_optimizer_step_pre_hook(self._before_optimizer_step)

    def _deregister_param_and_optimizer_hooks(self) -> None:
        super()._deregister_param_and_optimizer_hooks()
        if self._settle_hook is not None:
            self._settle_hook.remove()
            self._settle_hook = None

    def peak_by_category(self) -> dict[str, int]:
        """Bytes at the peak, summed into this project's categories, plus ``total``."""
        snap = next(iter(self._peak_mem_snap.values()), {})
        out = dict.fromkeys(sorted(set(CATEGORIES.values())), 0)
        for ref, nbytes in snap.items():
            if ref != "Total":
                out[CATEGORIES[ref.name]] += nbytes
        out["total"] = snap.get("Total", 0)
        return out


_WAIT = torch.ops._c10d_functional.wait_tensor.default


class _Depth:
    """A context manager that counts how deep it is entered."""

    def __init__(self) -> None:
        self.depth = 0

    def __enter__(self) -> None:
        self.depth += 1

    def __exit__(self, *exc) -> None:
        self.depth -= 1


def _weak(module):
    return weakref.ref(module)


def _fsdp_params(unit: FSDPModule) -> list:
    """FSDP2's records of the parameters of ``unit``'s own group (torch-internal: ``FSDPParam``, which holds
    the unsharded parameter and the accumulated gradient)."""
    group = unit._get_fsdp_state()._fsdp_param_group
    return list(group.fsdp_params) if group is not None else []


_c10d = torch.ops.c10d
_fn = torch.ops._c10d_functional


def _ring_bytes(kind: str, nbytes: int, n: int) -> float:
    """Bytes one rank sends in a ring implementation of ``kind`` over ``n`` ranks (``nbytes``: the full
    tensor for all-gather and all-reduce, the input for reduce-scatter and all-to-all, whose even split
    keeps ``1 / n`` of it on the rank)."""
    if n <= 1:
        return 0.0
    return {"all_gather": (n - 1) / n, "reduce_scatter": (n - 1) / n, "all_reduce": 2 * (n - 1) / n,
            "all_to_all": (n - 1) / n, "send": 1.0, "recv": 1.0, "broadcast": 1.0}[kind] * nbytes


def _nbytes(t) -> int:
    if isinstance(t, (list, tuple)):
        return sum(_nbytes(x) for x in t)
    return t.numel() * t.element_size()


class CommCounter:
    """Bytes each collective sends from this rank, by mesh axis (the process group's name) and kind.

    Under the fake process group collectives move nothing, but they are still
    issued, with their tensors and group: ``StepMemTracker`` hands every
    operator to ``count``, which counts the collectives. Ring
    algorithms' per-rank traffic is used (``_ring_bytes``), the convention of
    bus bandwidth (``plan/formulas.py``).
    """

    def __init__(self, axis_of_group: dict[str, str]) -> None:
        self.axis_of_group = axis_of_group
        self.bytes: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
        self.calls: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
        # (axis, kind, group size) -> [whole-buffer bytes, calls]: what the roofline prices with the planner's
        # link model (plan.formulas.collective_seconds takes the whole buffer and the group size)
        self.calls_by_size: dict[tuple[str, str, int], list[float]] = defaultdict(lambda: [0.0, 0])

    def reset(self) -> None:
        self.bytes.clear()
        self.calls.clear()
        self.calls_by_size.clear()

    def _add(self, group, kind: str, nbytes: int) -> None:
        if isinstance(group, str):
            name = group
            n = dist.distributed_c10d._resolve_process_group(group).size()
        else:
            if not isinstance(group, dist.ProcessGroup):  # the boxed form c10d operators take
                group = dist.ProcessGroup.unbox(group)
            name, n = group.group_name, group.size()
        # All-to-alls are expert parallelism's, whose group may be the very group FSDP shards over (ep equal
        # to dp_shard x cp), so the kind names the axis; but for a hybrid's Gated DeltaNet trading tokens for
        # heads over the cp group (parallel/context_parallel.py: ContextParallelHeads).
        axis = self.axis_of_group.get(name, "other")
        if kind == "all_to_all" and axis != "cp":
            axis = "ep"
        self.bytes[axis][kind] += _ring_bytes(kind, nbytes, n)
        self.calls[axis][kind] += 1
        entry = self.calls_by_size[(axis, kind, n)]
        entry[0] += nbytes
        entry[1] += 1

    def count(self, func, args) -> None:
        entry = _KINDS.get(func)
        if entry is not None:
            kind, tensor_arg, group_arg = entry
            # the functional all-gather takes this rank's shard and the group's size
            nbytes = _nbytes(args[0]) * args[1] if tensor_arg is None else _nbytes(args[tensor_arg])
            self._add(args[group_arg], kind, nbytes)


# op -> (kind, index of the tensor whose size defines the traffic, index of the group)
_KINDS = {
    _c10d._allgather_base_.default: ("all_gather", 0, 2),
    _c10d.allgather_.default: ("all_gather", 0, 2),
    _c10d._reduce_scatter_base_.default: ("reduce_scatter", 1, 2),
    _c10d.reduce_scatter_.default: ("reduce_scatter", 1, 2),
    _c10d.allreduce_.default: ("all_reduce", 0, 1),
    _c10d.alltoall_base_.default: ("all_to_all", 1, 2),
    _c10d.broadcast_.default: ("broadcast", 0, 1),
    _c10d.send.default: ("send", 0, 1),
    _c10d.recv_.default: ("recv", 0, 1),
    _fn.all_gather_into_tensor.default: ("all_gather", None, 2),
    _fn.reduce_scatter_tensor.default: ("reduce_scatter", 0, 3),
    _fn.all_reduce.default: ("all_reduce", 0, 2),
    _fn.all_to_all_single.default: ("all_to_all", 0, 3),
    _fn.all_reduce_.default: ("all_reduce", 0, 2),
}


def scalar_read(t: torch.Tensor):
    """What a fake tensor's value reads as (``.item()``, ``bool(t)``): a boolean reads False (no bad label,
    nothing non-finite), a number reads 1 (a loss, a gradient norm at the clipping threshold, the
    pipeline's vote that every stage knows its message shapes)."""
    return False if t.dtype == torch.bool else 1


_SCALAR = torch.ops.aten._local_scalar_dense.default


class ScalarReads(TorchDispatchMode):
    """``scalar_read`` for the engine's reads of tensor values outside the tracked step."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is _SCALAR:
            return scalar_read(args[0])
        return func(*args, **(kwargs or {}))
