"""Counting device-to-host syncs on a CPU, where none of them stalls anything.

``HostSyncCounter`` stands in for ``torch.cuda.set_sync_debug_mode``: it records every operation that, on an
accelerator, makes the host wait for the device's queue -- a scalar read (``.item()``, ``bool()``,
``float()``: ``aten._local_scalar_dense``), an op whose output size depends on the values (``nonzero``,
boolean-mask indexing, ``masked_select``, ``unique``, ``repeat_interleave`` without an output size,
``bincount``), ``equal``, and a whole tensor read by the host (``tolist``, ``numpy``; a blocking copy to
the CPU from another device). Each record names the innermost frame of this project that made it, so a
test failure says where a sync crept back.

On a CPU every tensor is the device's but those copied to the host on purpose: the output of ``.to("cpu",
copy=True)`` or ``.cpu()`` (on a device the copy that waits, counted) and whatever is computed from such
host tensors; reading those costs nothing.

Run as a script it trains a few steps of a config in this process and writes the syncs of the steady-state
steps (after warm-up) as JSON, one file per rank:
``python -m tests._host_syncs CONFIG OUT_DIR [--warmup 2] [--steps 2]``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import traceback
from collections import Counter
from pathlib import Path

import torch
import torch.utils._pytree as pytree
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten
# Ops that read values on the host whatever their arguments.
_READS = {aten._local_scalar_dense.default, aten.nonzero.default, aten.is_nonzero.default,
          aten.masked_select.default, aten.equal.default, aten._unique2.default, aten.unique_dim.default,
          aten.unique_consecutive.default, aten.bincount.default}
# Ops that read values on the host only for some arguments.
_MAYBE = {aten.index.Tensor, aten.index_put.default, aten.index_put_.default, aten.repeat_interleave.Tensor,
          aten._to_copy.default, aten.copy_.default}
_HOST_READ_METHODS = {torch.Tensor.tolist, torch.Tensor.numpy}
_PROJECT = os.sep + "qwen3_pretrain" + os.sep
_TORCH = os.path.dirname(torch.__file__) + os.sep


def _is_sync(func, args, kwargs) -> bool:
    if func in _READS:
        return True
    if func in (aten.index.Tensor, aten.index_put.default, aten.index_put_.default):
        return any(i is not None and i.dtype == torch.bool for i in args[1])
    if func is aten.repeat_interleave.Tensor:
        return kwargs.get("output_size") is None
    if func is aten._to_copy.default:
        return _to_host(kwargs) and args[0].device.type != "cpu"
    if func is aten.copy_.default:
        return args[0].device.type == "cpu" and args[1].device.type != "cpu" and not kwargs.get("non_blocking")
    return False


def _copy_to_cpu(args, kwargs) -> bool:
    """``Tensor.to(...)`` to the CPU with ``copy=True``: on a CPU, how a copy to the host is told from a move
    to the (CPU) device."""
    device = kwargs.get("device", next((a for a in args[1:] if isinstance(a, (str, torch.device))), None))
    return device is not None and torch.device(device).type == "cpu" and bool(kwargs.get("copy"))


def _to_host(kwargs: dict) -> bool:
    return kwargs.get("device") is not None and torch.device(kwargs["device"]).type == "cpu"


def _site() -> str:
    """``file:line function`` of the innermost frame of this project on the stack (else the innermost one
    outside torch and this module), the file relative to the package (else its name)."""
    frames = [f for f in traceback.extract_stack() if not f.filename.startswith(_TORCH) and f.filename != __file__]
    ours = [f for f in frames if _PROJECT in f.filename]
    f = (ours or frames)[-1]
    name = f.filename.rsplit(_PROJECT, 1)[-1] if ours else os.path.basename(f.filename)
    return f"{name}:{f.lineno} {f.name}"


def _drop_line(site: str) -> str:
    where, function = site.split(" ", 1)
    return f"{where.rsplit(':', 1)[0]} {function}"


class _Dispatch(TorchDispatchMode):
    def __init__(self, owner: HostSyncCounter) -> None:
        super().__init__()
        self.owner = owner

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        owner = self.owner
        tensors = [t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        on_host = any(owner.is_host(t) for t in tensors)
        if (func in _READS or func in _MAYBE) and not owner.inside_read and not on_host \
                and _is_sync(func, args, kwargs):
            owner.record(str(func.overloadpacket.__name__))
        out = func(*args, **kwargs)
        if on_host or (func is aten._to_copy.default and _to_host(kwargs) and args[0].device.type != "cpu"):
            for t in pytree.tree_leaves(out):
                if isinstance(t, torch.Tensor):
                    owner.add_host(t)
        return out


class _Function(TorchFunctionMode):
    def __init__(self, owner: HostSyncCounter) -> None:
        super().__init__()
        self.owner = owner

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        copy = func is torch.Tensor.cpu or (func is torch.Tensor.to and _copy_to_cpu(args, kwargs))
        if not (copy or func in _HOST_READ_METHODS) or self.owner.is_host(args[0]):
            return func(*args, **kwargs)
        self.owner.record(func.__name__)
        self.owner.inside_read = True  # the copy it makes on a device is this one sync
        try:
            out = func(*args, **kwargs)
        finally:
            self.owner.inside_read = False
        if copy:
            self.owner.add_host(out)
        return out


class HostSyncCounter:
    """``with HostSyncCounter() as syncs: ...``; then ``syncs.events`` [(op, site)] in order."""

    def __init__(self) -> None:
        self.events: list[tuple[str, str]] = []
        self.inside_read = False
        self._modes = (_Function(self), _Dispatch(self))
        # host tensors by storage, kept alive so that no device tensor takes over an address meanwhile
        self._host: dict[int, torch.Tensor] = {}

    def add_host(self, t: torch.Tensor) -> None:
        self._host[t.untyped_storage().data_ptr()] = t

    def is_host(self, t: torch.Tensor) -> bool:
        if not self._host or type(t) is not torch.Tensor or t.device.type != "cpu":
            return False
        try:
            return t.untyped_storage().data_ptr() in self._host
        except RuntimeError:  # a storage FSDP has freed: never one of ours
            return False

    def record(self, op: str) -> None:
        self.events.append((op, _site()))

    def by_site(self, lines: bool = False) -> Counter:
        """How many syncs each (op, place) made: ``op at file:line function``, or ``op at file function``."""
        return Counter(f"{op} at {site if lines else _drop_line(site)}" for op, site in self.events)

    def __enter__(self) -> HostSyncCounter:
        for mode in self._modes:
            mode.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        for mode in reversed(self._modes):
            mode.__exit__(*exc)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("config")
    parser.add_argument("out_dir")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=2)
    args = parser.parse_args(argv)
    from qwen3_pretrain.config.loader import load_config
    from qwen3_pretrain.train.config import TrainConfig
    from qwen3_pretrain.train.trainer import Trainer

    trainer = Trainer(load_config(TrainConfig, args.config, []))
    try:
        for _ in range(args.warmup):
            trainer.train_step()
        per_step = []
        for _ in range(args.steps):
            with HostSyncCounter() as syncs:
                trainer.train_step()
            per_step.append(dict(syncs.by_site(lines=True)))
        rank = trainer.launch.rank
    finally:
        trainer.close()
    Path(args.out_dir, f"rank_{rank}.json").write_text(json.dumps(per_step, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
