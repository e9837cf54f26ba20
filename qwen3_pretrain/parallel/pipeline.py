"""Pipeline parallelism with ``torch.distributed.pipelining``: stages and schedules."""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B

SCHEDULES = {"1f1b": Schedule1F1B, "gpipe": ScheduleGPipe, "interleaved": ScheduleInterleaved1F1B}


def build_schedule(parts: list[nn.Module], stage_indices: list[int], num_stages: int, device: torch.device,
                   pp_group, schedule: str, num_microbatches: int,
                   loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
                   example_io: list[tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]] | None = None):
    """One ``PipelineStage`` per local part, driven by the chosen schedule.

    ``example_io``: per local part, example (inputs, outputs) of its messages. Without it the
    stages exchange their shapes at the first step; with it they skip that exchange (the
    simulation, whose process group carries no data, needs this).

    Gradients are not rescaled by the schedule (``scale_grads=False``): the
    loss of each micro-batch is already normalized by the tokens of the whole
    global batch, so summing micro-batch gradients gives the global batch's.
    """
    io = example_io or [(None, None)] * len(parts)
    stages = [PipelineStage(part, idx, num_stages, device, input_args=inputs, output_args=outputs, group=pp_group)
              for part, idx, (inputs, outputs) in zip(parts, stage_indices, io)]
    cls = SCHEDULES[schedule]
    if schedule == "interleaved":
        return cls(stages, n_microbatches=num_microbatches, loss_fn=loss_fn, scale_grads=False)
    return cls(stages[0], n_microbatches=num_microbatches, loss_fn=loss_fn, scale_grads=False)
