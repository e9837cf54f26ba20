"""Experiment trackers: Weights & Biases and SwanLab, optional extras (``pip install 'qwen3-pretrain[trackers]'``).

A tracker receives what TensorBoard receives (each step record's numeric
fields, as ``train/<key>``; evaluations as ``eval/<key>``) and the resolved
config at start. ``tracker_mode`` offline writes under
``output_path/<tracker>`` for a later ``wandb sync`` / ``swanlab sync``;
online sends as it goes. A tracker that is not installed, or cannot start
(no network, no login), is a warning: the run goes on without it. Only the
logging rank tracks.
"""

from __future__ import annotations

import importlib
import logging
from pathlib import Path

log = logging.getLogger("qwen3_pretrain.train")

TRACKERS = ("wandb", "swanlab")


def scalars(record: dict) -> dict[str, float] | None:
    """The record's numbers under TensorBoard's names, or None for a record TensorBoard does not get."""
    if "step" not in record:
        return None
    prefix = {None: "train", "eval": "eval"}.get(record.get("event"))
    if prefix is None:
        return None
    return {f"{prefix}/{k}": v for k, v in record.items()
            if isinstance(v, (int, float)) and not isinstance(v, bool) and k != "step"}


class Tracker:
    """One tracker's run; ``module`` is ``wandb`` or ``swanlab`` (both take ``init``/``log``/``finish``)."""

    def __init__(self, name: str, module, run) -> None:
        self.name, self.module, self.run = name, module, run

    def write(self, record: dict) -> None:
        values = scalars(record)
        if values and self.module is not None:  # None: it failed once, was named then, and is left out
            try:
                self.module.log(values, step=record["step"])
            except Exception as e:  # noqa: BLE001 - a tracker never stops the run
                log.warning("%s: could not log step %s (%s); going on without it", self.name, record["step"], e)
                self.module = None

    def close(self) -> None:
        if self.module is not None:
            try:
                self.module.finish()
            except Exception as e:  # noqa: BLE001
                log.warning("%s: finishing the run failed: %s", self.name, e)


def open_trackers(names: list[str], output_path: str, config: dict, project: str, run_name: str | None,
                  tags: list[str], mode: str) -> list[Tracker]:
    """The trackers that could start; a warning for each that could not."""
    opened = []
    for name in names:
        try:
            module = importlib.import_module(name)
        except ImportError:
            log.warning("tracker %s is not installed (pip install %s, or the package's 'trackers' extra); "
                        "going on without it", name, name)
            continue
        folder = Path(output_path) / name
        folder.mkdir(parents=True, exist_ok=True)
        try:
            if name == "wandb":
                run = module.init(project=project, name=run_name, tags=list(tags), config=config, dir=str(folder),
                                  mode=mode)
            else:
                run = module.init(project=project, experiment_name=run_name, tags=list(tags), config=config,
                                  logdir=str(folder), mode="offline" if mode == "offline" else "cloud")
        except Exception as e:  # noqa: BLE001 - no network, no login, a bad key: the run goes on
            log.warning("tracker %s could not start (%s); going on without it", name, e)
            continue
        log.info("tracking in %s (project %s, %s)", name, project, mode)
        opened.append(Tracker(name, module, run))
    return opened
