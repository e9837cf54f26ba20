"""The profiler on a schedule, and the CUDA allocator's memory snapshots.

Profiler: ``profile_steps`` "A-B" traces steps A to B (inclusive) once;
``profile_every`` N traces ``profile_window`` steps ending at every N-th step.
Each window writes one Chrome/Perfetto trace per rank,
``output_path/profile/step_<A>-<B>/rank<r>.trace.json`` (opened by
chrome://tracing, ui.perfetto.dev, or TensorBoard's profiler plugin). While a
window runs, named ranges mark our phases (``phase:data`` ...), each pipeline
stage's forward (``stage <i> forward``) and each decoder layer's forward
(``layer <i>``); the hooks that set the layer and stage ranges are added when
a window opens and removed when it closes, so steps outside a window pay
nothing. On an NPU, ``torch_npu``'s profiler takes the same calls where the
installed ``torch_npu`` provides ``torch_npu.profiler.profile``.

Memory snapshots (CUDA only): with ``memory_snapshot_steps`` N > 0 the
allocator records its history (every allocation with its Python stack) for
the first N steps and dumps it to ``output_path/memory/rank<r>_steps1-<N>.pickle``;
whenever a step runs out of memory, a snapshot is dumped to
``output_path/memory/rank<r>_oom_step<S>.pickle`` and its path added to the
error. Both open in https://pytorch.org/memory_viz.
"""

from __future__ import annotations

import logging
from contextlib import contextmanager
from pathlib import Path

import torch
from torch import nn


log = logging.getLogger("qwen3_pretrain.train")

PROFILE_DIR, MEMORY_DIR = "profile", "memory"
HISTORY_ENTRIES = 100_000  # allocations kept in the allocator's history ring


def window_of(step: int, steps: tuple[int, int] | None, every: int, window: int) -> tuple[int, int] | None:
    """The profiling window (first, last step) that ``step`` falls in, or None."""
    if steps is not None and steps[0] <= step <= steps[1]:
        return steps
    if every > 0:
        last = -(-step // every) * every  # the next multiple of every, at or after step
        if last - window < step <= last:
            return max(1, last - window + 1), last
    return None


class Profiler:
    """Opens a ``torch.profiler`` window at its first step and writes the trace at its last."""

    def __init__(self, output_path: str, rank: int, device: torch.device, parts: list[nn.Module],
                 stage_indices: list[int], steps: tuple[int, int] | None, every: int, window: int) -> None:
        self.dir = Path(output_path) / PROFILE_DIR
        self.rank, self.device, self.parts, self.stage_indices = rank, device, parts, stage_indices
        self.steps, self.every, self.window = steps, every, window
        self.active = None  # (profiler, window, hook handles)
        self.open_range = None

    @property
    def enabled(self) -> bool:
        return self.steps is not None or self.every > 0

    def begin(self, step: int) -> None:
        if self.active is None:
            window = window_of(step, self.steps, self.every, self.window)
            if window is not None and window[0] == step:
                self.active = (self._profiler(), window, self._hooks())
                self.active[0].__enter__()

    def end(self, step: int) -> Path | None:
        self.phase_range(None)
        if self.active is None or self.active[1][1] != step:
            return None
        profiler, (first, last), hooks = self.active
        self.active = None
        for handle in hooks:
            handle.remove()
        profiler.__exit__(None, None, None)
        path = self.dir / f"step_{first}-{last}" / f"rank{self.rank}.trace.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        profiler.export_chrome_trace(str(path))
        log.info("rank %d: profile of steps %d-%d written to %s", self.rank, first, last, path)
        return path

    def phase_range(self, phase: str | None) -> None:
        """Close the open phase range, open ``phase``'s (while a window runs)."""
        if self.open_range is not None:
            self.open_range.__exit__(None, None, None)
            self.open_range = None
        if phase is not None and self.active is not None:
            self.open_range = torch.profiler.record_function(f"phase:{phase}")
            self.open_range.__enter__()

    def _profiler(self):
        activities = [torch.profiler.ProfilerActivity.CPU]
        if self.device.type == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        if self.device.type == "npu":
            try:
                import torch_npu
                return torch_npu.profiler.profile(record_shapes=True, with_stack=False)
            except (ImportError, AttributeError):
                pass
        return torch.profiler.profile(activities=activities, record_shapes=True)

    def _hooks(self) -> list:
        """Forward hooks that open and close a named range around each stage and each decoder layer."""
        handles = []
        for part, idx in zip(self.parts, self.stage_indices):
            handles += _range_hooks(part, f"stage {idx} forward")
            layers = getattr(part, "layers", None)
            for name, layer in (layers.items() if layers is not None else ()):
                handles += _range_hooks(layer, f"layer {name}")
        return handles


def _range_hooks(module: nn.Module, name: str) -> list:
    stack = []

    def enter(*_):
        stack.append(torch.profiler.record_function(name))
        stack[-1].__enter__()

    def leave(*_):
        if stack:
            stack.pop().__exit__(None, None, None)

    return [module.register_forward_pre_hook(enter), module.register_forward_hook(leave)]


class MemorySnapshots:
    """The CUDA allocator's history for the first ``steps`` steps, and a snapshot on out-of-memory.
    ``memory``: ``torch.cuda.memory`` (a stand-in in tests); nothing happens on other devices."""

    def __init__(self, output_path: str, rank: int, device: torch.device, steps: int, memory=None) -> None:
        self.dir = Path(output_path) / MEMORY_DIR
        self.rank, self.steps = rank, steps
        self.memory = memory if memory is not None else (torch.cuda.memory if device.type == "cuda" else None)
        self.recording = False
        if self.memory is not None and steps > 0:
            self.memory._record_memory_history(max_entries=HISTORY_ENTRIES)
            self.recording = True

    def end(self, step: int) -> Path | None:
        if not self.recording or step < self.steps:
            return None
        path = self._dump(f"rank{self.rank}_steps1-{step}.pickle")
        self.memory._record_memory_history(enabled=None)
        self.recording = False
        log.info("rank %d: allocator history of steps 1-%d written to %s (open at https://pytorch.org/memory_viz)",
                 self.rank, step, path)
        return path

    def _dump(self, name: str) -> Path:
        self.dir.mkdir(parents=True, exist_ok=True)
        path = self.dir / name
        self.memory._dump_snapshot(str(path))
        return path

    @contextmanager
    def on_oom(self, step: int):
        """Re-raise an out-of-memory error with the path of the snapshot taken when it happened."""
        try:
            yield
        except torch.OutOfMemoryError as e:
            if self.memory is None:
                raise
            try:
                path = self._dump(f"rank{self.rank}_oom_step{step}.pickle")
            except Exception as dump_error:  # noqa: BLE001 - the original error matters more
                raise torch.OutOfMemoryError(f"{e}\n(no memory snapshot: {dump_error})") from e
            raise torch.OutOfMemoryError(f"{e}\nmemory snapshot at the error: {path} (open at "
                                         "https://pytorch.org/memory_viz)") from e
