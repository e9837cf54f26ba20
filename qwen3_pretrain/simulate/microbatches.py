"""A step of many micro-batches from two short simulations: the linear extrapolation ``simulate`` uses.

A step's op trace, collective calls and attention kernel calls are sums over
what it runs, and a step of ``m`` micro-batches runs, per rank:

* **gradient accumulation** (pp 1): micro-batch 1 (FSDP's accumulated gradients
  created), micro-batches 2 .. m - 1 (the same ops each: gather, forward,
  backward, accumulate), micro-batch ``m`` (the reduce-scatter), then the
  once-per-step work (gradient norm, the loss's all-reduce, the optimizer);
* **1F1B pipelines** (pp p): a warm-up of at most ``p - 1`` forwards, one
  forward-backward pair per further micro-batch (its forward, its backward and
  its sends and receives: the same ops each), the cool-down's backwards, and
  the once-per-step work.

So for ``a >= max(2, p)`` every count is affine in ``m``: ``x(m) = x(b) +
(m - b) (x(b) - x(a))`` with ``b = a + 1``, exactly (the fused regions of the
fusion model too: they close at each matmul, collective and phase change, which
bound every micro-batch's work). Two simulations of ``a`` and ``b``
micro-batches cost ``a + b`` micro-batches' work instead of ``m``: for
Megatron-Bridge's 64 micro-batches of Qwen3-8B 5 instead of 64. The peak of
held memory is the same at ``a``, ``b`` and ``m``: accumulation holds one
micro-batch's activations beside the accumulated gradients from the second
micro-batch on, and 1F1B holds at most ``p - s`` micro-batches' on stage ``s``
once ``m >= p``; but for what the step keeps per micro-batch (a MoE layer's
routing statistics for the step's balancing figures, bytes), so the peak is
extrapolated on the same line. The tests (tests/test_planner_figures.py)
compare the extrapolation with a whole simulated step, trace, bytes and peak:
equal (the fusion model keys each storage by an id held for its lifetime, not
by its address, which the allocator reuses inside a region: repeated simulations
of one step give the same bytes).

Not extrapolated (the whole step is simulated): GPipe (every micro-batch's
activations are held before the first backward, so the peak grows with ``m``),
the interleaved schedule (its rounds change with ``m``), and steps of at
most ``a + b`` micro-batches (no saving).
"""

from __future__ import annotations

import dataclasses
from collections import Counter

from qwen3_pretrain.simulate.roofline import OpTrace


def extrapolation_counts(num_microbatches: int, pp: int, schedule: str) -> tuple[int, int] | None:
    """The micro-batch counts ``(a, b)`` whose simulations stand for a step of ``num_microbatches``, or
    None where the whole step is simulated (module docstring)."""
    if pp > 1 and schedule != "1f1b":
        return None
    a = max(2, pp)
    b = a + 1
    return (a, b) if a + b < num_microbatches else None


def config_with_microbatches(cfg, pp: int, count: int):
    """``cfg`` with ``count`` micro-batches per step on each rank and the same micro-batch shape: the
    accumulation count at pp 1, the samples per rank (in micro-batches of ``pp_microbatch_size``) under a
    pipeline."""
    if pp == 1:
        return dataclasses.replace(cfg, gradient_accumulation_steps=count)
    return dataclasses.replace(cfg, batch_size=count * cfg.pp_microbatch_size, gradient_accumulation_steps=1)


def _line(x_a: float, x_b: float, f: float) -> float:
    return x_b + f * (x_b - x_a)


def _counter(a: Counter, b: Counter, f: float) -> Counter:
    out = Counter()
    for key in set(a) | set(b):
        value = _line(a.get(key, 0), b.get(key, 0), f)
        if value:
            out[key] = round(value) if isinstance(b.get(key, a.get(key)), int) else value
    return out


def _value(a, b, f: float):
    """One field of the trace: counters key by key, per-phase records field by field, numbers on the line."""
    if isinstance(b, Counter) or isinstance(a, Counter):
        return _counter(a or Counter(), b or Counter(), f)
    if isinstance(b, dict):
        return {key: _value(a.get(key), b.get(key), f) for key in set(a) | set(b)}
    if dataclasses.is_dataclass(b):
        a = a if a is not None else type(b)()
        return type(b)(**{x.name: _value(getattr(a, x.name), getattr(b, x.name), f) for x in dataclasses.fields(b)})
    value = _line(a or 0, b or 0, f)
    return round(value) if isinstance(b, int) else value


def extrapolate_trace(a: OpTrace, b: OpTrace, f: float) -> OpTrace:
    """The trace ``f`` micro-batches past ``b``, given ``a`` one micro-batch short of it: every count and
    byte figure on the line through the two."""
    return _value(a, b, f)


def extrapolate_comm_bytes(a: dict, b: dict, f: float) -> dict[str, dict[str, float]]:
    """{axis: {kind: bytes}} per step (``track.CommCounter.bytes``)."""
    return {axis: {kind: _line(a.get(axis, {}).get(kind, 0.0), b.get(axis, {}).get(kind, 0.0), f)
                   for kind in set(a.get(axis, {})) | set(b.get(axis, {}))}
            for axis in set(a) | set(b)}


def extrapolate_comm_calls(a: dict, b: dict, f: float) -> dict:
    """{(axis, kind, group size): (whole-buffer bytes, calls)} per step (``CommCounter.calls_by_size``)."""
    out = {}
    for key in set(a) | set(b):
        (bytes_a, calls_a), (bytes_b, calls_b) = a.get(key, (0.0, 0)), b.get(key, (0.0, 0))
        out[key] = (_line(bytes_a, bytes_b, f), round(_line(calls_a, calls_b, f)))
    return out
