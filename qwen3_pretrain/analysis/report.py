"""What a parsed run turns into: the summary a user reads first, and the CSV.

Both are computed from ``ParsedLog`` (see ``parse_log`` for segments, restarts
and warm-up). Output files are written under a temporary name and moved into
place, so an interrupted or failed write never leaves a half-written file.
"""

from __future__ import annotations

import contextlib
import csv
import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

from qwen3_pretrain.errors import UserError
from qwen3_pretrain.fsutil import atomic_path

KNOWN_COLUMNS = (
    "step", "total_steps", "loss", "lr", "grad_norm", "tokens_per_sec", "tokens_per_sec_per_device",
    "step_time_s", "mfu", "hfu", "mfu_full_square", "memory_gib", "eta_s", "tokens_seen", "skipped", "eval_loss",
    "eval_ppl",
)  # fmt: skip


@dataclass
class Summary:
    """What a user checks first after (or during) a run; means exclude warm-up records."""

    num_steps: int
    first_step: int
    last_step: int
    final_loss: float
    min_loss: float | None  # over finite losses
    min_loss_step: int | None
    mean_tokens_per_sec: float | None
    mean_tokens_per_sec_per_device: float | None
    mean_mfu: float | None  # fraction
    peak_memory_gib: float | None
    num_restarts: int
    num_warmup_excluded: int
    skipped_steps: list[int]
    nonfinite_steps: list[int]  # loss or grad_norm is nan/inf
    evals: list[dict[str, Any]] = field(default_factory=list)  # held-out evaluations by step



@dataclass
class ParsedLog:
    """Step rows of one run, later segments winning, plus where it restarted."""

    source: str  # "log" or "jsonl"
    rows: list[dict[str, Any]]  # one per logged step, sorted by step
    warmup_steps: set[int]  # steps whose row is the first record of its segment
    restart_steps: list[int]  # per restart: the step it resumed from, else its first logged step
    num_restarts: int
    num_ignored: int  # damaged step records (log) or unreadable lines (jsonl)
    evals: list[dict[str, Any]] = field(default_factory=list)  # held-out evaluations, sorted by step

    def csv_rows(self) -> list[dict[str, Any]]:
        """The step rows with each evaluation's ``eval_loss``/``eval_ppl`` on the row of its step (a row of
        its own when that step was not logged)."""
        rows = {r["step"]: dict(r) for r in self.rows}
        for ev in self.evals:
            rows.setdefault(ev["step"], {"step": ev["step"]}).update(ev)
        return [rows[s] for s in sorted(rows)]


def _finite(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _mean(rows: list[dict[str, Any]], key: str) -> float | None:
    values = [r[key] for r in rows if _finite(r.get(key))]
    return sum(values) / len(values) if values else None


def summarize(parsed: ParsedLog) -> Summary:
    """Summary numbers of a parsed run (``parse_log``'s docstring defines warm-up and restarts)."""
    rows = parsed.rows
    steady = [r for r in rows if r["step"] not in parsed.warmup_steps] or rows
    finite = [r for r in rows if _finite(r.get("loss"))]
    best = min(finite, key=lambda r: r["loss"]) if finite else None
    memory = [r["memory_gib"] for r in rows if _finite(r.get("memory_gib"))]
    return Summary(
        num_steps=len(rows),
        first_step=rows[0]["step"],
        last_step=rows[-1]["step"],
        final_loss=rows[-1].get("loss", math.nan),
        min_loss=best["loss"] if best else None,
        min_loss_step=best["step"] if best else None,
        mean_tokens_per_sec=_mean(steady, "tokens_per_sec"),
        mean_tokens_per_sec_per_device=_mean(steady, "tokens_per_sec_per_device"),
        mean_mfu=_mean(steady, "mfu"),
        peak_memory_gib=max(memory) if memory else None,
        num_restarts=parsed.num_restarts,
        num_warmup_excluded=len(rows) - len(steady),
        skipped_steps=[r["step"] for r in rows if r.get("skipped")],
        nonfinite_steps=[r["step"] for r in rows if any(k in r and not _finite(r[k]) for k in ("loss", "grad_norm"))],
        evals=list(parsed.evals),
    )


def _fmt(value: float | None, spec: str, unit: str = "") -> str:
    return "n/a" if value is None else f"{value:{spec}}{unit}"


def _steps(steps: list[int]) -> str:
    shown = ", ".join(map(str, steps[:10])) + (", ..." if len(steps) > 10 else "")
    return f"{len(steps)}" + (f" ({shown})" if steps else "")


def format_summary(s: Summary) -> str:
    """The summary as a few human-readable lines."""
    mfu_percent = None if s.mean_mfu is None else s.mean_mfu * 100
    best = f"{s.min_loss:.4f} at step {s.min_loss_step}" if s.min_loss is not None else "n/a (no finite loss)"
    return "\n".join([
        f"steps logged: {s.num_steps} ({s.first_step}..{s.last_step}); restarts: {s.num_restarts}",
        f"final loss: {s.final_loss:.4f}; min loss: {best}",
        f"mean tokens/s: {_fmt(s.mean_tokens_per_sec, '.1f')} "
        f"({_fmt(s.mean_tokens_per_sec_per_device, '.1f')} per device), mean MFU: {_fmt(mfu_percent, '.1f', '%')} "
        f"(excluding {s.num_warmup_excluded} warm-up record(s): the first of each run segment)",
        f"peak memory: {_fmt(s.peak_memory_gib, '.1f', ' GiB')}",
        f"skipped steps: {_steps(s.skipped_steps)}; nan/inf loss or grad_norm: {_steps(s.nonfinite_steps)}",
        *_eval_line(s.evals),
    ])  # fmt: skip


def _eval_line(evals: list[dict[str, Any]]) -> list[str]:
    if not evals:
        return []
    last = evals[-1]
    best = min((e for e in evals if _finite(e["eval_loss"])), key=lambda e: e["eval_loss"], default=None)
    best_text = f"{best['eval_loss']:.4f} at step {best['step']}" if best else "n/a"
    return [f"held-out eval: {len(evals)} evaluation(s); last {last['eval_loss']:.4f} at step {last['step']}; "
            f"best {best_text}"]


def csv_columns(rows: list[dict[str, Any]]) -> list[str]:
    """Union of the rows' fields: known columns in ``KNOWN_COLUMNS`` order, then extras as first seen."""
    seen = dict.fromkeys(key for row in rows for key in row)
    return [c for c in KNOWN_COLUMNS if c in seen] + [c for c in seen if c not in KNOWN_COLUMNS]


def _cell(value: Any) -> Any:
    if value is None:
        return ""
    if isinstance(value, bool):
        return int(value)
    return json.dumps(value) if isinstance(value, (dict, list)) else value


@contextlib.contextmanager
def atomic_output(path: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary name beside ``path``; move it to ``path`` only when the block succeeds."""
    path = Path(path)
    try:
        with atomic_path(path) as tmp:
            yield tmp
    except OSError as exc:
        reason = exc.strerror or str(exc)
        raise UserError(f"cannot write {path}: {reason}; check that {path.parent} exists and is writable") from exc


def write_csv(rows: list[dict[str, Any]], path: str | os.PathLike) -> list[str]:
    """Write one CSV row per step (floats at full precision, flags as 0/1); return the header."""
    columns = csv_columns(rows)
    with atomic_output(path) as tmp, open(tmp, "w", newline="", encoding="utf-8") as f:
        writer = csv.writer(f)
        writer.writerow(columns)
        writer.writerows([_cell(row.get(c)) for c in columns] for row in rows)
    return columns
