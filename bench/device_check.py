"""One call that spends a device slot well (run it as ``bash bench/device_check.sh``).

    bash bench/device_check.sh OUTDIR            # one GPU or NPU: at most --budget seconds (default 480)
    bash bench/device_check.sh --cpu OUTDIR      # the same stages on a CPU with tiny sizes (~2 minutes)

Stages, most valuable first: ``env`` (torch, CUDA/CANN, device, memory) -> ``tests`` (pytest -m device)
-> ``convert`` (the bundled Wikipedia sample) -> ``train_resume`` (a small Qwen3 through fit() under
torchrun: stopped by SIGTERM and resumed, killed by SIGKILL and resumed; every loss must equal an
uninterrupted run's) -> ``merge`` (both runs' last checkpoints; the weights must be equal) ->
``parse_log`` -> ``bench_data`` -> ``throughput/<variant>`` (Qwen3-1.7B and 0.6B, seq 8192 and 4096,
bf16, full activation checkpointing, eager and compiled), started while the budget allows -> ``fp8/dense``
and ``fp8/moe`` (bf16 against ``fp8 tensorwise``, compiled, at Qwen3-8B's and Qwen3-30B-A3B's layer sizes:
tokens/s ratio ``speedup`` and last-step ``loss_rel_diff`` against the goals 1.25x and 1%; on the CPU the
emulated FP8 run alone; ``--only bench_data,fp8`` runs them without the rest).

OUTDIR/summary.json is rewritten (atomically) after every stage: ``{"stages": [{"name", "ok",
"seconds", ...figures}], "not_run": [{"name", "reason"}], ...}``, so a slot cut short still reports
what ran. A stage gets a timeout from what is left of the budget; a failed stage records its error
and the end of its log, and the next stage runs (one that needs a failed stage is listed in not_run).
The ``multi/`` stages (``device_check_multi.py``: tp 2, pp 2, cp 2, FSDP 2, ep 2, document masks, async save,
compiled, each against one device) run where torch sees two or more devices, and with ``--cpu`` as two gloo
processes; with one device they are listed in ``skipped``, which is no failure.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from device_check_stages import CPU_SIZES, DEVICE_SIZES, Context, StageFailed, stages  # noqa: E402

# Kept free at the end of the budget: the last summary write and the exit.
RESERVE_S = 5.0
# The default budget's addition on a machine with two or more devices: the multi/ stages' 15 short training
# launches, two of them compiling.
MULTI_DEVICE_S = 540.0


class Summary:
    """OUTDIR/summary.json, rewritten whole after every change so a reader never sees half a file."""

    def __init__(self, path: Path, header: dict) -> None:
        self.path, self.started = path, time.monotonic()
        self.data = {**header, "started_utc": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
                     "finished": False, "stages": [], "not_run": [], "skipped": []}
        self.write()

    def add(self, key: str, record: dict) -> None:
        self.data[key].append(record)
        self.write()

    def finish(self) -> bool:
        stages = self.data["stages"]
        self.data["finished"] = True
        ran_ok = bool(stages) and all(s["ok"] for s in stages)
        self.data["all_ok"] = ran_ok and not self.data["not_run"]
        self.write()
        return ran_ok

    def write(self) -> None:
        self.data["elapsed_s"] = round(time.monotonic() - self.started, 1)
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_text(json.dumps(self.data, indent=1) + "\n")
        os.replace(tmp, self.path)


@dataclass
class Budget:
    end: float
    multi_device_s: float = 0.0  # added once env has found two or more devices (the multi/ stages)

    def left(self) -> float:
        return self.end - time.monotonic() - RESERVE_S


def run_stage(stage, ctx: Context, timeout: float) -> dict:
    start = time.monotonic()
    try:
        if stage.name in ctx.injected:
            figures = ctx.inject(stage.name, start + timeout)
        else:
            figures = stage.run(ctx, start + timeout)
        result = {"ok": True, **(figures or {})}
    except StageFailed as exc:
        result = {"ok": False, "error": exc.message, **exc.figures, "tail": exc.tail}
    except Exception as exc:  # a defect of the check itself: recorded like any failure, the next stage still runs
        result = {"ok": False, "error": f"{type(exc).__name__}: {exc}", "tail": traceback.format_exc()[-3000:]}
    return {"name": stage.name, "ok": result.pop("ok"), "seconds": round(time.monotonic() - start, 1),
            "timeout_s": round(timeout), **result}


def why_not(stage, ctx: Context, failed: set[str], budget: Budget, selected: list[str] | None) -> str | None:
    """The reason a stage is not started, or None."""
    if selected is not None and not any(stage.name == s or stage.name.startswith(s + "/") for s in selected):
        return "not selected (--only)"
    missing = [n for n in stage.needs if n in failed]
    if missing:
        return f"needs {', '.join(missing)}, which failed or did not run"
    if stage.skip is not None and stage.skip(ctx) is not None:
        return stage.skip(ctx)
    if budget.left() < stage.start_if_s:
        return f"{max(budget.left(), 0):.0f} s of the budget left; the stage needs about {stage.start_if_s:.0f} s"
    return None


def run_all(ctx: Context, budget: Budget, summary: Summary, selected: list[str] | None) -> None:
    failed: set[str] = set()
    for stage in stages(ctx):
        reason = why_not(stage, ctx, failed, budget, selected)
        if reason is not None and stage.skip is not None and reason == stage.skip(ctx):
            summary.add("skipped", {"name": stage.name, "reason": reason})  # not for this machine: no failure
            continue
        if reason is not None:
            failed.add(stage.name)
            if selected is None or reason != "not selected (--only)":
                summary.add("not_run", {"name": stage.name, "reason": reason})
            continue
        timeout = max(1.0, min(ctx.caps.get(stage.name, stage.cap_s), budget.left()))
        record = run_stage(stage, ctx, timeout)
        if stage.name == "env" and ctx.device_count >= 2 and budget.multi_device_s:
            budget.end += budget.multi_device_s
            summary.data["budget_s"] = summary.data.get("budget_s", 0) + budget.multi_device_s
        summary.add("stages", record)
        if not record["ok"]:
            failed.add(stage.name)
        shown = {k: v for k, v in record.items() if k not in ("name", "ok", "seconds", "timeout_s", "tail")}
        print(f"[{summary.data['elapsed_s']:6.1f} s] {stage.name}: {'ok' if record['ok'] else 'FAILED'} "
              f"in {record['seconds']} s {json.dumps(shown)[:400]}", flush=True)


def key_values(items: list[str], what: str) -> dict[str, str]:
    pairs = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep:
            raise SystemExit(f"error: {what} takes STAGE=VALUE, got {item!r}")
        pairs[key] = value
    return pairs


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="bench/device_check.sh", description=__doc__.splitlines()[0])
    parser.add_argument("outdir", type=Path, help="folder for summary.json and every stage's files (created)")
    parser.add_argument("--cpu", action="store_true", help="run every stage on the CPU with tiny sizes")
    parser.add_argument("--work", type=Path, help="folder for the bulky files: data, checkpoints, merged models, "
                                                  "compiled kernels (default: a new temporary folder)")
    parser.add_argument("--budget", type=float, help="seconds for all stages (default: 480 on a device, plus "
                                                     f"{MULTI_DEVICE_S:.0f} where torch sees two or more; 300 --cpu)")
    parser.add_argument("--only", help="comma-separated stages to run (a prefix such as 'throughput' selects all "
                                       "its variants); env always runs")
    parser.add_argument("--timeout", action="append", default=[], metavar="STAGE=SECONDS",
                        help="override one stage's timeout (repeatable)")
    parser.add_argument("--inject", action="append", default=[], metavar="STAGE=fail|hang",
                        help="replace a stage by a failing or hanging command (to test this script)")
    args = parser.parse_args(argv)
    args.timeout = {k: float(v) for k, v in key_values(args.timeout, "--timeout").items()}
    args.inject = key_values(args.inject, "--inject")
    bad = [v for v in args.inject.values() if v not in ("fail", "hang")]
    if bad:
        parser.error(f"--inject takes fail or hang, got {bad[0]!r}")
    return args


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    out = args.outdir.resolve()
    out.mkdir(parents=True, exist_ok=True)
    # OUTDIR keeps only small files (summary, logs, configs), so it can be copied off a device machine whole.
    work = (args.work or Path(tempfile.mkdtemp(prefix="device_check_"))).resolve()
    work.mkdir(parents=True, exist_ok=True)
    shutil.rmtree(work / "inductor_cache", ignore_errors=True)  # may hold a kernel half-written by a killed run
    mode = "cpu" if args.cpu else "device"
    budget_s = args.budget or (300.0 if args.cpu else 480.0)
    ctx = Context(mode=mode, out=out, work=work, sizes=CPU_SIZES if args.cpu else DEVICE_SIZES, python=sys.executable,
                  injected=args.inject, caps=args.timeout)
    summary = Summary(out / "summary.json", {"mode": mode, "budget_s": budget_s, "python": sys.executable,
                                             "work": str(work)})
    selected = None if args.only is None else ["env", *args.only.split(",")]
    print(f"device check ({mode}), budget {budget_s:.0f} s -> {out / 'summary.json'}", flush=True)
    extra = MULTI_DEVICE_S if args.budget is None and not args.cpu else 0.0
    run_all(ctx, Budget(time.monotonic() + budget_s, extra), summary, selected)
    ok = summary.finish()
    print(f"device check done in {summary.data['elapsed_s']} s: "
          f"{sum(s['ok'] for s in summary.data['stages'])}/{len(summary.data['stages'])} stages ok, "
          f"{len(summary.data['not_run'])} not run, {len(summary.data['skipped'])} skipped; {out / 'summary.json'}",
          flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
