"""Loss, learning rate and throughput against step, as one PNG.

Uses matplotlib's object API with the Agg canvas, not ``pyplot``: no display is
needed and no global backend is switched under a caller that already uses one.
"""

from __future__ import annotations

import math
import os
from typing import Any

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from qwen3_pretrain.analysis.report import ParsedLog, atomic_output


# (column, y-axis label) of each panel, top to bottom
PANELS = (("loss", "loss"), ("lr", "learning rate"), ("tokens_per_sec", "tokens/s"))


def _series(rows: list[dict[str, Any]], key: str) -> list[float]:
    # nan leaves a gap in the line; inf would stretch the axis to nothing useful
    values = [row.get(key) for row in rows]
    return [v if isinstance(v, (int, float)) and math.isfinite(v) else math.nan for v in values]


def _mark_nonfinite(ax: Any, rows: list[dict[str, Any]], key: str) -> None:
    # A nan/inf loss is the event a user looks for, yet the line just has a gap there.
    bad = [row["step"] for row in rows if isinstance(row.get(key), float) and not math.isfinite(row[key])]
    if bad:
        y = [0.05] * len(bad)  # in axes coordinates: near the bottom whatever the data range
        ax.plot(bad, y, "x", color="tab:red", transform=ax.get_xaxis_transform(), label="nan/inf")
        ax.legend(loc="upper right")


def plot_metrics(parsed: ParsedLog, path: str | os.PathLike, dpi: int = 100) -> None:
    """Write a PNG with one panel per metric (shared step axis) and restarts as dashed lines."""
    fig = Figure(figsize=(10, 8), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(len(PANELS), 1, sharex=True)
    steps = [row["step"] for row in parsed.rows]
    marker = "." if len(steps) <= 300 else None  # else a point between two gaps is invisible
    for ax, (key, label) in zip(axes, PANELS):
        ax.plot(steps, _series(parsed.rows, key), linewidth=1.0, marker=marker, markersize=3)
        _mark_nonfinite(ax, parsed.rows, key)
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
        for i, step in enumerate(parsed.restart_steps):
            ax.axvline(step, color="tab:red", linestyle="--", linewidth=0.8, label="restart" if i == 0 else None)
    if parsed.restart_steps:
        axes[0].legend(loc="upper right")
    axes[-1].set_xlabel("step")
    restarts = f", {parsed.num_restarts} restart(s)" if parsed.num_restarts else ""
    fig.suptitle(f"{len(steps)} logged steps ({steps[0]}..{steps[-1]}){restarts}")
    with atomic_output(path) as tmp:
        fig.savefig(tmp, format="png", dpi=dpi)
