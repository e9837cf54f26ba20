"""Peak memory of a block of code, measured at the allocator level.

On an accelerator (CUDA, or an Ascend NPU through ``torch_npu``) the caching
allocator keeps the counts: ``current_bytes`` is what live tensors hold on the
device and ``peak_bytes`` its maximum since ``reset()``. Memory the allocator
has cached but not handed out, and the runtime's own context, are not counted.

On CPU there is no such statistic, so a ``TorchDispatchMode`` watches every
tensor that an aten operator returns and counts its *storage* once: views share
their base's storage and are not counted again, in-place results are not new
memory, and a weak-reference finalizer subtracts a storage's bytes when the
storage is freed. Storages resized in place (FSDP frees and re-allocates its
unsharded parameters that way) are followed too, including an empty storage
created before the tracker started that grows while it runs. What the CPU
tracker cannot see: scratch buffers a kernel allocates and frees internally, and tensors
created before it was entered unless passed to ``track()``.

    with MemoryTracker() as mem:
        loss = step()
    print(mem.peak_bytes)
"""

from __future__ import annotations

import threading
import weakref
from typing import Any, Iterable

import torch
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass
from torch.utils._pytree import tree_flatten

GiB = 1024**3


def _plain_tensors(obj: Any) -> list[torch.Tensor]:
    """The plain tensors inside ``obj`` (nested structures, tensor subclasses such as DTensor)."""
    out: list[torch.Tensor] = []
    for leaf in tree_flatten(obj)[0]:
        if not isinstance(leaf, torch.Tensor):
            continue
        if is_traceable_wrapper_subclass(leaf):
            names, _ = leaf.__tensor_flatten__()
            out += _plain_tensors([getattr(leaf, n) for n in names])
        else:
            out.append(leaf)
    return out


class _StorageCounter(TorchDispatchMode):
    """Counts the bytes of live CPU storages that were created (or registered) while active."""

    def __init__(self) -> None:
        super().__init__()
        self.current = 0
        self.peak = 0
        self._sizes: dict[int, int] = {}  # StorageImpl address -> bytes counted for it
        self._finalizers: dict[int, weakref.finalize] = {}
        # A storage's last reference may go in another thread (gloo's worker lets go of a finished
        # collective's buffers there), so its finalizer can run beside this thread's counting: the lock
        # keeps two updates of ``current`` from interleaving. Re-entrant: a finalizer may also run inside
        # ``_count`` (a garbage collection it sets off).
        self._lock = threading.RLock()

    def add(self, tensor: torch.Tensor) -> None:
        """Count ``tensor``'s storage (once; a resize since the last look is applied)."""
        if tensor.device.type == "cpu":
            self._count(tensor.untyped_storage())

    def _count(self, storage: torch.UntypedStorage) -> None:
        key = storage._cdata
        nbytes = storage.nbytes()
        with self._lock:
            if key not in self._sizes:
                # The storage's Python object lives exactly as long as the storage itself,
                # so its finalizer marks the moment the memory goes back to the allocator.
                self._finalizers[key] = weakref.finalize(storage, self._free, key)
                self._sizes[key] = 0
            self.current += nbytes - self._sizes[key]
            self._sizes[key] = nbytes
            self.peak = max(self.peak, self.current)

    def resized(self, storage: torch.UntypedStorage, before: int) -> None:
        """Follow ``storage``'s in-place resize from ``before`` bytes: a counted storage changes size,
        and an empty one that grows is new memory (FSDP re-allocating an unsharded parameter whose
        storage was created before the tracker started)."""
        if storage.device.type != "cpu":
            return
        if storage._cdata in self._sizes or (before == 0 and storage.nbytes() > 0):
            self._count(storage)

    def _free(self, key: int) -> None:
        with self._lock:
            self.current -= self._sizes.pop(key, 0)
            self._finalizers.pop(key, None)

    def counted(self, tensors: list[torch.Tensor]) -> int:
        """Bytes of the counted storages among ``tensors``' (each storage once)."""
        with self._lock:
            keys = {t.untyped_storage()._cdata for t in tensors if t.device.type == "cpu"}
            return sum(self._sizes.get(key, 0) for key in keys)

    def detach(self) -> None:
        """Stop following frees (the counts stay as they are)."""
        with self._lock:
            for fin in self._finalizers.values():
                fin.detach()
            self._finalizers.clear()
            self._sizes.clear()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        # A tensor subclass (DTensor) is seen here, before its own dispatch: count its local tensors,
        # not the wrapper, whose storage would claim the global shape.
        outputs = _plain_tensors(out)
        if not outputs:
            return out
        aliased = _aliasing_returns(func)
        if aliased is None:  # no reliable schema: an output sharing an input's storage is not new
            inputs = {t.untyped_storage()._cdata for t in _plain_tensors((args, kwargs)) if t.device.type == "cpu"}
        for tensor in outputs:
            if tensor.device.type != "cpu":
                continue
            key = tensor.untyped_storage()._cdata
            # Views and in-place results are not new memory, unless their storage is
            # one already counted (its size may have changed).
            is_alias = aliased if aliased is not None else key in inputs
            if key in self._sizes or not is_alias:
                self.add(tensor)
        return out


def _aliasing_returns(func: Any) -> bool | None:
    """True when every return of an aten op aliases an input (views, in-place, ``out=``), False when
    none does, None when mixed or not an aten op (then aliasing is checked on the storages)."""
    if getattr(func, "namespace", None) != "aten":
        return None
    flags = {r.alias_info is not None for r in func._schema.returns}
    return flags.pop() if len(flags) == 1 else None


class MemoryTracker:
    """Allocator-level current and peak memory of one device, usable as a context manager.

    ``device`` is ``"cpu"`` (the default), ``"cuda"``,
    ``"npu"``, or a ``torch.device``. On an accelerator, the counts cover every
    tensor on the device; on CPU they cover the storages created inside the
    ``with`` block plus those registered with ``track()``.
    """

    def __init__(self, device: str | torch.device = "cpu") -> None:
        self.device = torch.device(device)
        self._counter: _StorageCounter | None = None
        self._patched_resize: Any = None
        self._cpu_current = 0
        self._cpu_peak = 0

    # --- context manager ----------------------------------------------------

    def __enter__(self) -> "MemoryTracker":
        if self.device.type == "cpu":
            self._counter = _StorageCounter()
            self._patch_resize(self._counter)
            self._counter.__enter__()
        else:
            self._synchronize()
        self.reset()
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._counter is None:
            self._synchronize()
            return
        self._counter.__exit__(*exc)
        torch.UntypedStorage.resize_ = self._patched_resize
        self._cpu_current, self._cpu_peak = self._counter.current, self._counter.peak
        self._counter.detach()
        self._counter = None

    def _patch_resize(self, counter: _StorageCounter) -> None:
        # ``UntypedStorage.resize_`` does not go through the dispatcher, so it is wrapped
        # for the duration of the block.
        original = torch.UntypedStorage.resize_
        self._patched_resize = original

        def resize_(storage: torch.UntypedStorage, size: int) -> torch.UntypedStorage:
            before = storage.nbytes()
            result = original(storage, size)
            counter.resized(storage, before)
            return result

        torch.UntypedStorage.resize_ = resize_  # type: ignore[method-assign]

    # --- measurements ---------------------------------------------------------

    def reset(self) -> None:
        """Start a new peak from the current level."""
        if self._counter is not None:
            self._counter.peak = self._counter.current
        elif self.device.type == "cpu":
            self._cpu_peak = self._cpu_current
        else:
            _accelerator_call(self.device, "reset_peak_memory_stats")

    def track(self, *objects: Any) -> None:
        """Count tensors that already exist: tensors, modules (parameters, gradients, buffers), optimizers."""
        if self._counter is None:
            if self.device.type == "cpu":
                raise RuntimeError("MemoryTracker.track() must be called inside the 'with' block")
            return  # the device allocator already counts everything
        for tensor in _tensors_of(objects):
            self._counter.add(tensor)

    def counted_bytes(self, *objects: Any) -> int:
        """CPU only: the bytes of those storages behind ``objects``' tensors that this block created (or
        ``track()`` registered) and that are still live, each storage once. With the tensors autograd saved
        (``torch.autograd.graph.saved_tensors_hooks``) it is what a forward keeps for backward, unmoved by
        buffers another thread has yet to let go of (gloo's worker holds a finished collective's for a
        moment after the caller's wait returns, which ``current_bytes`` then includes)."""
        if self._counter is None:
            raise RuntimeError("MemoryTracker.counted_bytes() needs a CPU tracker, inside the 'with' block")
        return self._counter.counted(_tensors_of(objects))

    @property
    def current_bytes(self) -> int:
        """Bytes held by live tensors now."""
        if self._counter is not None:
            return self._counter.current
        if self.device.type == "cpu":
            return self._cpu_current
        return int(_accelerator_call(self.device, "memory_allocated"))

    @property
    def peak_bytes(self) -> int:
        """Highest ``current_bytes`` since the block was entered or ``reset()`` was called."""
        if self._counter is not None:
            return self._counter.peak
        if self.device.type == "cpu":
            return self._cpu_peak
        return int(_accelerator_call(self.device, "max_memory_allocated"))

    def _synchronize(self) -> None:
        module = getattr(torch, self.device.type, None)
        if module is not None and hasattr(module, "synchronize"):
            module.synchronize()


def _tensors_of(objects: Iterable[Any]) -> list[torch.Tensor]:
    out: list[torch.Tensor] = []
    for obj in objects:
        if isinstance(obj, torch.nn.Module):
            out += _plain_tensors(list(obj.parameters()) + list(obj.buffers()))
            out += _plain_tensors([p.grad for p in obj.parameters() if p.grad is not None])
        elif isinstance(obj, torch.optim.Optimizer):
            out += _plain_tensors([dict(state) for state in obj.state.values()])
        else:
            out += _plain_tensors(obj)
    return out


def _accelerator_call(device: torch.device, name: str) -> Any:
    """``torch.accelerator.<name>`` with a fall-back to ``torch.<device type>.<name>`` (e.g. torch_npu)."""
    try:
        return getattr(torch.accelerator, name)(device)
    except (AttributeError, RuntimeError):
        module = getattr(torch, device.type, None)
        if module is None or not hasattr(module, name):
            raise RuntimeError(f"no memory statistics for device {str(device)!r}") from None
        return getattr(module, name)(device)
