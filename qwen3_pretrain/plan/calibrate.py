"""Measured figures that replace the device table's in a plan: the compute efficiency fitted to a
roofline's predicted step times (``--roofline``), and the links commbench measured (``--commbench``)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from qwen3_pretrain.errors import MissingFileError, UserError
from qwen3_pretrain.hardware import Hardware, with_overrides
from qwen3_pretrain.models.qwen3.config import Qwen3Config
from qwen3_pretrain.plan.layout import Cluster, Layout
from qwen3_pretrain.plan.step import predict_step

ROOFLINE_LAYOUT_KEYS = ("tp", "pp", "cp", "ep", "dp", "batch_size", "gradient_accumulation_steps", "seq_length",
                        "activation_checkpointing", "compile", "distributed_optimizer", "dp_shard",
                        "keep_params_gathered", "pp_microbatch_size", "fp8", "fp8_all_gather")


def read_roofline(path: str, compile: bool = False) -> list[tuple[dict[str, Any], float]]:
    """(layout keys, predicted step seconds) of each record of a roofline JSON: an object or a list of objects
    (or an object's ``layouts`` list), each with ``layout`` (or ``config``: plan's row keys, ``rank_size`` or
    ``dp`` for the data-parallel degree) and ``step_time_s`` (or ``step_s``), at the top or under
    ``roofline``; where the record has ``eager`` and ``compiled`` parts, the one of the layout's ``compile``.
    Or what ``simulate --json`` prints: its ranks' ``roofline`` parts, the slowest rank's step (the step ends
    with it), of the layout the plan's own flags and ``--config`` fix (empty keys here), eager or compiled as
    ``compile``."""
    if not os.path.isfile(path):
        raise MissingFileError(f"--roofline file {path!r} does not exist")
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise UserError(f"{path}: not JSON; --roofline reads the roofline's predicted step times") from None
    out: list[tuple[dict[str, Any], float]] = []
    if isinstance(data, dict) and isinstance(data.get("ranks"), list):  # simulate --json
        mode = "compiled" if compile else "eager"
        steps = [r["roofline"][mode].get("step_s") for r in data["ranks"]
                 if isinstance(r, dict) and isinstance(r.get("roofline"), dict)
                 and isinstance(r["roofline"].get(mode), dict)]
        steps = [x for x in steps if isinstance(x, (int, float)) and x > 0]
        if steps:
            return [({}, float(max(steps)))]
    records = data if isinstance(data, list) else data.get("layouts", [data]) if isinstance(data, dict) else []
    for record in records:
        if not isinstance(record, dict):
            continue
        keys = record.get("layout") or record.get("config")
        if not isinstance(keys, dict):
            continue
        part = record.get("roofline", record)
        if isinstance(part, dict) and ("eager" in part or "compiled" in part):
            part = part.get("compiled" if keys.get("compile") else "eager") or {}
        seconds = part.get("step_time_s", part.get("step_s")) if isinstance(part, dict) else None
        if isinstance(seconds, (int, float)) and seconds > 0:
            out.append(({k: keys[k] for k in (*ROOFLINE_LAYOUT_KEYS, "rank_size") if k in keys}, float(seconds)))
    if not out:
        raise UserError(f"{path}: no record with a 'layout' (or 'config') and a 'step_time_s' (docs/planner.md, "
                        "'Ranking with the roofline')")
    return out


def fit_efficiency(cfg: Qwen3Config, hw: Hardware, cluster: Cluster, base: Layout,
                   records: list[tuple[dict[str, Any], float]], fixed: dict[str, Any] | None = None
                   ) -> tuple[float, str]:
    """The compute efficiency at which this planner's step time of each record's layout equals the
    roofline's (bisection: the step time falls as the efficiency rises), averaged over the records; and a
    line saying so. A record the planner cannot reach at any efficiency (its other terms alone are longer)
    takes the highest, 1."""
    fitted, described = [], []
    for keys, seconds in records:
        if not keys:  # simulate's own JSON: the layout the plan's flags and config fix
            keys = {{"micro_batch_size": "batch_size"}.get(k, k): v for k, v in (fixed or {}).items()}
        layout = base.replace(**{name: keys[key] for key, name in (
            ("tp", "tp"), ("pp", "pp"), ("cp", "cp"), ("ep", "ep"), ("batch_size", "micro_batch_size"),
            ("gradient_accumulation_steps", "gradient_accumulation_steps"), ("seq_length", "seq_length"),
            ("activation_checkpointing", "activation_checkpointing"), ("compile", "compile"),
            ("distributed_optimizer", "distributed_optimizer"), ("dp_shard", "dp_shard"),
            ("keep_params_gathered", "keep_params_gathered"), ("pp_microbatch_size", "pp_microbatch_size"),
            ("fp8", "fp8"), ("fp8_all_gather", "fp8_all_gather")) if key in keys and keys[key] is not None})
        dp = keys.get("dp") or cluster.devices // (layout.tp * layout.pp * layout.cp)
        layout = layout.replace(dp=dp)

        def step(efficiency: float) -> float:
            return predict_step(cfg, layout, with_overrides(hw, compute_efficiency=efficiency), cluster).step_time_s

        low, high = 1e-3, 1.0
        reachable = step(high) < seconds
        if not reachable:
            low = high
        for _ in range(50 if reachable else 0):
            mid = (low + high) / 2
            low, high = (mid, high) if step(mid) > seconds else (low, mid)
        fitted.append(low)
        described.append(f"tp {layout.tp} pp {layout.pp} cp {layout.cp} dp {dp}: {seconds:g} s"
                         + ("" if reachable else " (shorter than this planner's at any efficiency: 1 taken)"))
    efficiency = sum(fitted) / len(fitted)
    return efficiency, (f"fitted to the roofline's step time of {'; '.join(described)} (--roofline); "
                        f"per layout {', '.join(f'{e:.3f}' for e in fitted)}")


def read_commbench(path: str) -> dict[str, float]:
    """Measured link figures from a commbench JSON: its ``summary`` (GB/s and microseconds)."""
    if not os.path.isfile(path):
        raise MissingFileError(f"--commbench file {path!r} does not exist; write one with "
                               "'qwen3-pretrain commbench --json FILE'")
    try:
        summary = json.loads(Path(path).read_text(encoding="utf-8"))["summary"]
    except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError):
        raise UserError(f"{path}: not a commbench JSON (expected an object with a 'summary'); write one with "
                        "'qwen3-pretrain commbench --json FILE'") from None
    keys = ("intra_node_gbps", "inter_node_gbps", "intra_node_latency_us", "inter_node_latency_us")
    return {k: float(summary[k]) for k in keys if summary.get(k) is not None}
