"""Pipeline parallelism with ``torch.distributed.pipelining``: stages and schedules."""

from __future__ import annotations

import functools
from typing import Callable

import torch
from torch import nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B

SCHEDULES = {"1f1b": Schedule1F1B, "gpipe": ScheduleGPipe, "interleaved": ScheduleInterleaved1F1B}
# a stage's compute as the schedules call it (the weight-gradient chunk in the schedules that split backward)
STAGE_COMPUTE = ("forward_one_chunk", "backward_one_chunk", "backward_weight_one_chunk")


class StageCompute:
    """Tells ``on(stage_index, True)`` where a local stage's compute begins and ``on(stage_index, False)`` where it
    ends: the schedule's calls of the stage's ``STAGE_COMPUTE`` methods and, on the last stage, of the loss.

    The wrappers are set on each stage instance (``install``), not on torch's classes, so other pipelines in the
    process are untouched; with ``on`` None (nobody times them: the simulation, tests) a call costs one
    attribute read. The trainer's observer sets ``on`` (``observe/phases.StageBusy.span``).
    """

    def __init__(self) -> None:
        self.on: Callable[[int, bool], None] | None = None

    def wrap(self, stage_index: int, fn: Callable) -> Callable:
        @functools.wraps(fn)
        def timed(*args, **kwargs):
            on = self.on
            if on is None:
                return fn(*args, **kwargs)
            on(stage_index, True)
            try:
                return fn(*args, **kwargs)
            finally:
                on(stage_index, False)
        return timed

    def install(self, stage: PipelineStage) -> None:
        for name in STAGE_COMPUTE:
            if hasattr(stage, name):
                setattr(stage, name, self.wrap(stage.stage_index, getattr(stage, name)))


def build_schedule(parts: list[nn.Module], stage_indices: list[int], num_stages: int, device: torch.device,
                   pp_group, schedule: str, num_microbatches: int,
                   loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
                   example_io: list[tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]] | None = None,
                   compute: StageCompute | None = None):
    """One ``PipelineStage`` per local part, driven by the chosen schedule.

    ``example_io``: per local part, example (inputs, outputs) of its messages. Without it the
    stages exchange their shapes at the first step; with it they skip that exchange (the
    simulation, whose process group carries no data, needs this).

    ``compute``: told where each local stage's compute begins and ends (the loss counts as the last stage's:
    the schedule computes it outside the stage's forward).

    Gradients are not rescaled by the schedule (``scale_grads=False``): the
    loss of each micro-batch is already normalized by the tokens of the whole
    global batch, so summing micro-batch gradients gives the global batch's.
    """
    io = example_io or [(None, None)] * len(parts)
    stages = [PipelineStage(part, idx, num_stages, device, input_args=inputs, output_args=outputs, group=pp_group)
              for part, idx, (inputs, outputs) in zip(parts, stage_indices, io)]
    if compute is not None:
        for stage in stages:
            compute.install(stage)
        if stages[-1].is_last:
            loss_fn = compute.wrap(stages[-1].stage_index, loss_fn)
    cls = SCHEDULES[schedule]
    if schedule == "interleaved":
        return cls(stages, n_microbatches=num_microbatches, loss_fn=loss_fn, scale_grads=False)
    return cls(stages[0], n_microbatches=num_microbatches, loss_fn=loss_fn, scale_grads=False)
