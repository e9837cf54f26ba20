"""Every rank's figures at a logged step, gathered in one small collective, and the slowest rank named.

Each rank contributes one row of floats (its step time, its phases, under
pp its stages' busy and idle time, its device health; NaN where it has no
figure, dropped again after the gather) to one ``all_gather`` of
``world x len(KEYS)`` values: on an accelerator that is also the logged
step's one wait for the device.

Every rank's step takes the same wall time: the step's collectives make the
fast ranks wait for the slow one, inside ``forward_backward`` or ``reduce``.
What tells the ranks apart is their local work, the phases with no
collective in them: ``data`` (the loader) and ``optimizer`` (the update of
the rank's own shard). The slowest rank is the one with the most local time;
its excess is over the median of the other ranks'. A rank slowed inside forward or
backward alone (a throttled device under FSDP) spreads its delay over every
rank's waits and is not named here: its device health and the profiler show
it. A rank that is slowest in ``REPEATS`` logged steps in a row gets a
warning: a rank whose host is loaded or whose device is throttled holds every
other rank up by that much at each step.
"""

from __future__ import annotations

import logging
import math
import statistics

import torch
import torch.distributed as dist

from qwen3_pretrain.train.observe.health import FIELDS
from qwen3_pretrain.train.observe.phases import BETWEEN_STEPS, PHASES, PIPELINE, field

log = logging.getLogger("qwen3_pretrain.train")

KEYS = ("step_time_s",) + tuple(field(p) for p in PHASES + BETWEEN_STEPS + PIPELINE) + tuple(FIELDS)
# logged steps in a row with the same slowest rank before the warning
REPEATS = 3
# below this excess over the other ranks' median (seconds, and share of the step time) no rank is called slow
MIN_EXCESS_S, MIN_EXCESS_SHARE = 1e-3, 0.02


def gather_rows(mine: dict[str, float], device: torch.device, group=None) -> list[dict]:
    """Every rank's row (``{"rank": r, key: value, ...}``, keys of ``KEYS`` it reported), in rank order."""
    vector = torch.tensor([float(mine.get(k, math.nan)) for k in KEYS], dtype=torch.float64)
    world = dist.get_world_size(group) if dist.is_initialized() else 1
    if world == 1:
        rows = [vector]
    else:
        local = vector.to(device)
        rows = [torch.empty_like(local) for _ in range(world)]
        dist.all_gather(rows, local, group=group)
    table = torch.stack(rows).cpu().tolist()
    return [{"rank": r, **{k: v for k, v in zip(KEYS, values) if not math.isnan(v)}}
            for r, values in enumerate(table)]


class Stragglers:
    """The slowest rank of each logged step, and how many logged steps in a row it has been the slowest."""

    def __init__(self) -> None:
        self.last_rank, self.in_a_row = None, 0

    def observe(self, rows: list[dict], warn: bool = True) -> dict:
        """The record's ``slowest_rank``, ``slowest_excess_s`` (its local time over the median of the other ranks') and
        ``slowest_in_a_row``; nothing with one rank or when no rank stands out."""
        local = (field("data"), field("optimizer"))
        times = [(r[local[0]] + r[local[1]], r["rank"]) for r in rows if all(k in r for k in local)]
        if len(times) < 2:
            return {}
        slowest, rank = max(times)
        excess = slowest - statistics.median(t for t, r in times if r != rank)
        step = statistics.median(r.get("step_time_s", 0.0) for r in rows)
        if excess < max(MIN_EXCESS_S, MIN_EXCESS_SHARE * step):
            self.last_rank, self.in_a_row = None, 0
            return {}
        self.in_a_row = self.in_a_row + 1 if rank == self.last_rank else 1
        self.last_rank = rank
        if self.in_a_row == REPEATS and warn:
            log.warning("rank %d has been the slowest in %d logged steps in a row (%.3g s more local work, data and "
                        "optimizer, than the other ranks' median, %.0f%% of a step): check its host's load, its "
                        "device's health and clocks (docs/monitoring.md, 'Uneven')", rank, REPEATS, excess,
                        100 * excess / max(step, 1e-9))
        return {"slowest_rank": rank, "slowest_excess_s": excess, "slowest_in_a_row": self.in_a_row}


def format_slowest(r: dict) -> str:
    """`` | slowest r1 +0.35 s``."""
    if "slowest_rank" not in r:
        return ""
    return f" | slowest r{r['slowest_rank']} +{r['slowest_excess_s']:.3g} s"
