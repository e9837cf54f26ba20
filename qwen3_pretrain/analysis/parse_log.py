"""Read a training log (``nohup`` output of ``tools/train.py``) or ``metrics.jsonl``; the CLI.

A step record of the human log looks like ``EXAMPLE_LINE``: ``name value``
fields separated by `` | ``. Known names are typed and renamed (``step 0.80 s``
-> ``step_time_s``, ``mfu 41.2%`` -> ``mfu`` 0.412, ``eta 1d02h`` -> ``eta_s``);
unknown ones are kept as extra columns, so a newer engine's fields still reach
the CSV. Everything else in the file (warnings, tracebacks, tqdm bars, other
ranks' output) is ignored. When another process's output is spliced into a
record, the record is kept up to the first field that no longer parses: a
damaged value is dropped, never guessed.

Restarts: a *segment* begins at each ``run start:`` line (``{"event": "start"}``
in jsonl), at a ``resumed from ... at step N`` line that follows records of the
current segment, and at a step that goes backward without either. Rows are
keyed by step and a later segment replaces an earlier one, so the steps re-done
after a resume win. Restarts = segments that logged a step - 1.

Warm-up: the first record of each segment carries start-up, compilation and
allocator warm-up, so it is left out of the mean throughput and MFU (all
records are used when every one of them is a first one). The summary and the
CSV are made in ``report``, the PNG in ``plot``.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import re
from decimal import Decimal
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable

from qwen3_pretrain.analysis.report import ParsedLog, format_summary, summarize, write_csv
from qwen3_pretrain.config.args import CommandParser
from qwen3_pretrain.errors import MissingFileError, UserError

EXAMPLE_LINE = (
    "2026-12-02 14:05:31 INFO step 100/100000 | loss 2.3412 | lr 1.00e-05 | grad_norm 0.91 | "
    "tokens/s 732 (91.5/device) | step 0.80 s | mfu 41.2% | hfu 54.9% | mem 42.0 GiB | eta 22h13m"
)
# A MoE model's records go on with ``| aux 8.0123 | load 1.42 max/mean, 0% idle`` (and ``| z 3.2`` with a
# z-loss, ``| routing forced (benchmark)`` in the benchmark mode).

_NUM = r"[-+]?(?:\d+\.?\d*(?:[eE][-+]?\d+)?|\.\d+(?:[eE][-+]?\d+)?|[nN]a[nN]|[iI]nf)"
# The timestamp/level prefix belongs to the record it introduces: when two lines
# are glued together it must not end up in the previous record's last value.
_RECORD = re.compile(r"(?:\d{4}-\d\d-\d\d[ T][\d:.,]+\s+(?:[A-Z]+\s+)?)?\bstep (\d+)/(\d+)\s*\|")
_START = re.compile(r"\brun start:")
_EVAL = re.compile(rf"\beval at step (\d+) \| loss ({_NUM})(?: \| ppl ({_NUM}))?")
_RESUME = re.compile(r"\bresumed from \S+ at step (\d+)")
_NUM_FIELD = re.compile(rf"([A-Za-z_][\w/]*(?: [A-Za-z_][\w/]*)*)\s+((?:{_NUM}).*)")
_TEXT_FIELD = re.compile(r"([A-Za-z_][\w/]*)\s+(\S.*)")
_FLAG = re.compile(r"[A-Za-z_]\w*")
_GIB_PER_UNIT = {"GiB": 1.0, "MiB": 2.0**-10, "TiB": 2.0**10, "GB": 1e9 / 2**30, "MB": 1e6 / 2**30}


def _tokens_per_sec(m: re.Match) -> dict[str, float]:
    per_device = {"tokens_per_sec_per_device": float(m[2])} if m[2] else {}
    return {"tokens_per_sec": float(m[1]), **per_device}


def _eta_seconds(m: re.Match) -> dict[str, int | None]:
    if m[0] == "?":  # the engine's "not known yet"
        return {"eta_s": None}
    days, hours, minutes, seconds = (int(g or 0) for g in m.groups())
    return {"eta_s": ((days * 24 + hours) * 60 + minutes) * 60 + seconds}


def _fraction(m: re.Match) -> float:
    return float(Decimal(m[1]) / (100 if m[2] else 1))


# the observer's fields (train/observe): "time data 0.01 fb 0.7 reduce 0.05 opt 0.04 s" (phases, named as in
# metrics.jsonl: time_<phase>_s; under pp "busy 0.5 idle 0.2" after fb: time_pp_busy_s, time_pp_idle_s),
# "slowest r1 +0.35 s", "health util 45%@r3 temp 81C@r1 ..." (each figure's worst rank: health_<figure> and
# health_<figure>_rank)
_PHASE_NAMES = {"data": "data", "fb": "forward_backward", "reduce": "reduce", "opt": "optimizer",
                "ckpt": "checkpoint", "eval": "eval", "busy": "pp_busy", "idle": "pp_idle"}
_HEALTH_NAMES = {"util": "util_pct", "mem": "mem_used_gib", "reserved": "mem_reserved_gib", "power": "power_w",
                 "temp": "temp_c", "clock": "sm_clock_mhz", "cpu": "cpu_util_pct", "rss": "rss_gib"}
_PHASE_ITEM = re.compile(rf"([a-z]+) ({_NUM})")
_HEALTH_ITEM = re.compile(rf"([a-z]+) ({_NUM})(?:%|C|W|MHz|GiB)@r(\d+)")


def _phases(m: re.Match) -> dict[str, float] | None:
    items = _PHASE_ITEM.findall(m[1])
    if not items or any(name not in _PHASE_NAMES for name, _ in items):
        return None
    return {f"time_{_PHASE_NAMES[name]}_s": float(value) for name, value in items}


def _health(m: re.Match) -> dict[str, float]:
    row: dict[str, float] = {}
    for name, value, rank in _HEALTH_ITEM.findall(m[0]):
        key = f"health_{_HEALTH_NAMES.get(name, name)}"
        row[key], row[key + "_rank"] = float(value), int(rank)
    return row


def _memory(m: re.Match) -> dict[str, float]:
    unit = _GIB_PER_UNIT[m[3]]
    reserved = {"memory_reserved_gib": float(m[2]) * unit} if m[2] else {}
    return {"memory_gib": float(m[1]) * unit, **reserved}


# name in the log -> (pattern its whole value must match, columns from the match)
_KNOWN: dict[str, tuple[re.Pattern, Callable[[re.Match], dict[str, Any]]]] = {
    name: (re.compile(pattern), columns)
    for name, pattern, columns in [
        ("loss", f"({_NUM})", lambda m: {"loss": float(m[1])}),
        ("lr", f"({_NUM})", lambda m: {"lr": float(m[1])}),
        ("grad_norm", f"({_NUM})", lambda m: {"grad_norm": float(m[1])}),
        ("tokens/s", rf"({_NUM})(?:\s*\(({_NUM})/device\))?", _tokens_per_sec),
        ("step", rf"({_NUM})\s*(ms|s)", lambda m: {"step_time_s": float(m[1]) / (1000.0 if m[2] == "ms" else 1.0)}),
        # The log shows a percentage; the CSV, like metrics.jsonl, holds a fraction
        # (divided in decimal so that 41.2% is written 0.412, not 0.41200000000000003).
        ("mfu", rf"({_NUM})\s*(%?)", lambda m: {"mfu": _fraction(m)}),
        ("hfu", rf"({_NUM})\s*(%?)", lambda m: {"hfu": _fraction(m)}),  # MFU with recompute, logged beside it
        # peak allocated, or allocated/reserved (accelerators since reserved was logged): "mem 41.2/44.0 GiB"
        ("mem", rf"({_NUM})(?:\s*/\s*({_NUM}))?\s*(GiB|MiB|TiB|GB|MB)", _memory),
        ("eta", r"\?|(?=\d)(?:(\d+)d)?(?:(\d+)h)?(?:(\d+)m)?(?:(\d+)s)?", _eta_seconds),
        # a MoE model's balancing losses and expert load, named as in metrics.jsonl
        ("aux", f"({_NUM})", lambda m: {"moe_aux_loss": float(m[1])}),
        ("z", f"({_NUM})", lambda m: {"moe_z_loss": float(m[1])}),
        ("load", rf"({_NUM}) max/mean, ({_NUM})% idle",
         lambda m: {"moe_load_max": float(m[1]), "moe_idle_experts": float(Decimal(m[2]) / 100)}),
        ("dropped", rf"({_NUM})%", lambda m: {"moe_dropped": float(Decimal(m[1]) / 100)}),
        ("routing", r"forced \(benchmark\)", lambda m: {"moe_force_balance": True}),
        ("time", rf"((?:[a-z]+ {_NUM} ?)+) s", _phases),
        ("slowest", rf"r(\d+) \+({_NUM}) s", lambda m: {"slowest_rank": int(m[1]), "slowest_excess_s": float(m[2])}),
        ("health", rf"(?:[a-z]+ {_NUM}(?:%|C|W|MHz|GiB)@r\d+ ?)+", _health),
    ]
}


def _scalar(value: str) -> Any:
    if re.fullmatch(r"[-+]?\d+", value):
        return int(value)
    return float(value) if re.fullmatch(_NUM, value) else value


def _parse_known(name: str, value: str) -> dict | None:
    pattern, columns = _KNOWN[name]
    m = pattern.fullmatch(value)
    return columns(m) if m else None


def _parse_field(part: str) -> dict | None:
    """Columns for one ``name value`` (or bare flag) field; None when it does not parse."""
    name, _, value = part.partition(" ")
    if name in _KNOWN:  # the common case, without the generic patterns
        return _parse_known(name, value.strip())
    m = _NUM_FIELD.fullmatch(part) or _TEXT_FIELD.fullmatch(part)
    if m:
        return {re.sub(r"\W+", "_", m[1]).strip("_").lower(): _scalar(m[2].strip())}
    return {part.lower(): True} if _FLAG.fullmatch(part) else None  # e.g. "skipped"


def _parse_record(step: str, total: str, text: str) -> dict | None:
    row: dict[str, Any] = {"step": int(step), "total_steps": int(total)}
    for part in text.split("|"):
        fields = _parse_field(part.strip())
        if fields is None:
            break  # the rest is another process's output
        row.update(fields)
    return row if "loss" in row else None


@dataclass
class _Collector:
    """Builds rows keyed by step from records and (re)start events, in file order."""

    rows: dict[int, dict[str, Any]] = field(default_factory=dict)
    row_segment: dict[int, int] = field(default_factory=dict)
    first_steps: list[int | None] = field(default_factory=list)  # first step logged per segment
    resume_steps: list[int | None] = field(default_factory=list)
    last_step: int | None = None
    num_ignored: int = 0
    evals: dict[int, dict[str, Any]] = field(default_factory=dict)  # by step; a later run's wins

    def start(self) -> None:
        self.first_steps.append(None)
        self.resume_steps.append(None)
        self.last_step = None

    def resume(self, step: int | None) -> None:
        if not self.first_steps or self.first_steps[-1] is not None:
            self.start()
        self.resume_steps[-1] = step

    def record(self, row: dict[str, Any]) -> None:
        step = row["step"]
        if not self.first_steps or (self.last_step is not None and step < self.last_step):
            self.start()
        segment = len(self.first_steps) - 1
        row["skipped"] = bool(row.get("skipped", False))
        if self.row_segment.get(step) == segment:
            self.rows[step].update(row)  # printed twice by one run: the copies complete each other
        else:
            self.rows[step], self.row_segment[step] = row, segment
        if self.first_steps[segment] is None:
            self.first_steps[segment] = step
        self.last_step = step

    def evaluation(self, step: int, loss: float, ppl: float | None) -> None:
        self.evals[step] = {"step": step, "eval_loss": loss, **({"eval_ppl": ppl} if ppl is not None else {})}

    def result(self, source: str) -> ParsedLog:
        firsts = list(enumerate(self.first_steps))
        restarts = [r if r is not None else s for r, s in zip(self.resume_steps[1:], self.first_steps[1:])]
        return ParsedLog(
            source=source,
            rows=[self.rows[s] for s in sorted(self.rows)],
            warmup_steps={s for i, s in firsts if s is not None and self.row_segment[s] == i},
            restart_steps=[s for s in restarts if s is not None],  # a segment that logged nothing has no place
            # a run that logged no step (nothing left to train) restarted nothing that the rows show
            num_restarts=max(sum(s is not None for s in self.first_steps) - 1, 0),
            num_ignored=self.num_ignored,
            evals=[self.evals[s] for s in sorted(self.evals)],
        )


def _line_events(line: str) -> list[tuple[int, str, Any]]:
    """(position, kind, payload) of each start, resume and step record on one line, in order."""
    events: list[tuple[int, str, Any]] = []
    if "run start:" in line or "resumed from" in line:  # rare: skip the regexes on most lines
        events += [(m.start(), "start", None) for m in _START.finditer(line)]
        events += [(m.start(), "resume", int(m[1])) for m in _RESUME.finditer(line)]
    if "eval at step" in line:
        events += [(m.start(), "eval", (int(m[1]), float(m[2]), float(m[3]) if m[3] else None))
                   for m in _EVAL.finditer(line)]
    records = list(_RECORD.finditer(line))
    for m, nxt in zip(records, records[1:] + [None]):
        text = line[m.end() : nxt.start() if nxt else len(line)]
        events.append((m.start(), "record", _parse_record(m[1], m[2], text)))
    return sorted(events, key=lambda e: e[0])


def _feed_log(lines: Iterable[str], sink: _Collector) -> None:
    for line in lines:
        if "step" not in line and "run start:" not in line:  # ("eval at step" holds "step")
            continue
        for _, kind, payload in _line_events(line):
            if kind == "start":
                sink.start()
            elif kind == "resume":
                sink.resume(payload)
            elif kind == "eval":
                sink.evaluation(*payload)
            elif payload is None:
                sink.num_ignored += 1
            else:
                sink.record(payload)


def _json_object(line: str) -> dict | None:
    try:
        obj = json.loads(line)
    except json.JSONDecodeError:
        return None  # e.g. the last line of a run killed mid-write
    return obj if isinstance(obj, dict) else None


def _feed_jsonl(lines: Iterable[str], sink: _Collector) -> None:
    for line in lines:
        obj = _json_object(line) if line.strip() else {}
        if obj is None:
            sink.num_ignored += 1
        elif obj.get("event") == "start":
            sink.start()
            if isinstance(obj.get("step"), int) and obj["step"] > 0:  # a start at step N > 0 resumes from N
                sink.resume(obj["step"])
        elif obj.get("event") == "resume":
            sink.resume(obj["step"] if isinstance(obj.get("step"), int) else None)
        elif obj.get("event") == "eval" and isinstance(obj.get("step"), int) \
                and isinstance(obj.get("eval_loss"), (int, float)):
            ppl = obj.get("eval_ppl")
            sink.evaluation(obj["step"], float(obj["eval_loss"]), float(ppl) if isinstance(ppl, (int, float)) else None)
        elif "event" not in obj and isinstance(obj.get("step"), int):
            sink.record(obj)


def _input_path(path: str | os.PathLike) -> Path:
    path = Path(path)
    if path.is_dir() and (path / "metrics.jsonl").is_file():
        return path / "metrics.jsonl"
    if path.is_dir():
        raise UserError(f"{path} is a directory without metrics.jsonl; pass the training log file (e.g. pretrain.log)")
    if not path.is_file():
        raise MissingFileError(f"{path} does not exist; pass the training log (e.g. pretrain.log) or metrics.jsonl")
    return path


def parse_metrics(path: str | os.PathLike) -> ParsedLog:
    """Read a training log or ``metrics.jsonl`` (detected by extension or a JSON object on the first line)."""
    path = _input_path(path)
    sink = _Collector()
    with open(path, encoding="utf-8", errors="replace") as f:  # universal newlines split tqdm's \r too
        first = next((line for line in f if line.strip()), "")
        source = "jsonl" if path.suffix == ".jsonl" or _json_object(first) is not None else "log"
        (_feed_jsonl if source == "jsonl" else _feed_log)(itertools.chain([first], f), sink)
    if not sink.rows and source == "log":
        raise UserError(
            f"{path}: no training step lines ('step N/M | loss ...') were found; expected lines like '{EXAMPLE_LINE}'"
        )
    if not sink.rows:
        raise UserError(f"{path}: no step records (JSON objects with an integer 'step' and no 'event') were found")
    return sink.result(source)


def _arg_parser() -> argparse.ArgumentParser:
    p = CommandParser(
        "parse-log",
        description="Training log (nohup output) or metrics.jsonl -> one CSV row per logged step, a summary "
        "and optionally a PNG plot. Steps re-done after a resume replace the earlier ones.",
    )
    p.add_argument("--log_path", "--log-path", dest="log_path", required=True,
                   help="the training log (e.g. pretrain.log), a metrics.jsonl, or a run directory holding one")
    p.add_argument("--output_path", "--output-path", dest="output_path",
                   help="CSV file to write (e.g. train_metrics.csv); without it only the summary is printed")
    p.add_argument("--plot", help="PNG file to write with loss, learning rate and tokens/s against step")
    return p  # fmt: skip


def _check_not_input(output: str | None, log_path: Path) -> None:
    if output and Path(output).exists() and Path(output).resolve() == log_path.resolve():
        raise UserError(f"output {output} is the input log itself; choose another output path")


def main(argv: list[str]) -> int:
    """``qwen3-pretrain parse-log`` / ``tools/parse_train_log.py``."""
    args = _arg_parser().parse_args(argv)
    log_path = _input_path(args.log_path)
    for output in (args.output_path, args.plot):
        _check_not_input(output, log_path)
    parsed = parse_metrics(log_path)
    written = []
    if args.output_path:
        columns = write_csv(parsed.csv_rows(), args.output_path)
        written.append(f"wrote {args.output_path} ({len(parsed.rows)} rows, {len(columns)} columns)")
    if args.plot:
        from qwen3_pretrain.analysis.plot import plot_metrics  # matplotlib only when asked for

        plot_metrics(parsed, args.plot)
        written.append(f"wrote {args.plot}")
    ignored = f"; {parsed.num_ignored} damaged record(s) ignored" if parsed.num_ignored else ""
    print(f"read {log_path} ({'metrics.jsonl' if parsed.source == 'jsonl' else 'training log'}{ignored})")
    print(format_summary(summarize(parsed)))
    for line in written:
        print(line)
    return 0
