"""One entry point, ``qwen3-pretrain <command>``, for every stage of the pipeline.

Each subcommand lives in the package that owns its stage and is imported only
when it is run, so ``qwen3-pretrain plan`` does not pay for importing the
training engine. A subcommand is a function ``main(argv: list[str]) -> int``.
"""

from __future__ import annotations

import importlib
import json
import os
import signal
import sys
import time

from qwen3_pretrain.errors import UserError

# name -> ("module:function", one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "wiki2parquet": ("qwen3_pretrain.convert.wiki:main", "Wikipedia dump or wikiextractor output -> parquet"),
    "convert": ("qwen3_pretrain.convert.run:main", "parquet -> tokenized, sharded Megatron indexed dataset"),
    "train": ("qwen3_pretrain.train.trainer:main", "pre-train with TP x PP x DP (torchrun, mpirun or one process)"),
    "merge": ("qwen3_pretrain.checkpoint.merge:main", "merge a sharded checkpoint into one HuggingFace model"),
    "parse-log": ("qwen3_pretrain.analysis.parse_log:main", "training log or metrics.jsonl -> CSV (+ PNG plot)"),
    "plan": ("qwen3_pretrain.plan.cli:main", "predict memory and throughput per parallel layout"),
    "simulate": ("qwen3_pretrain.simulate.cli:main", "run the engine at full size on fake tensors: memory and comm per rank"),
    "commbench": ("qwen3_pretrain.plan.commbench:main", "measure collective latency and bandwidth per mesh axis"),
    "generate": ("qwen3_pretrain.models.qwen3.generate:main", "continue a prompt with a (merged) HF model directory"),
    "demo": ("qwen3_pretrain.models.qwen3.demo:main", "tiny random Qwen3 -> HF format -> reload -> logits checksum"),
}


# Set for every command before it imports torch; a value already in the environment wins.
# THP_MEM_ALLOC_ENABLE: torch's CPU allocator asks the kernel for transparent huge pages for buffers of
# 2 MB and more (honoured when /sys/kernel/mm/transparent_hugepage/enabled is "always" or "madvise").
# Training on a CPU allocates hundreds of MB afresh every step (the loss's logits, FSDP's gathered
# weights and casts); with 4 KiB pages their page faults cost about as much as the arithmetic
# (bench/README.md has the figures). It affects host memory only, never an accelerator's.
PROCESS_ENV_DEFAULTS = {"THP_MEM_ALLOC_ENABLE": "1"}


def apply_process_env_defaults() -> None:
    """Put ``PROCESS_ENV_DEFAULTS`` into the environment (torch reads them once, at its first allocation)."""
    for key, value in PROCESS_ENV_DEFAULTS.items():
        os.environ.setdefault(key, value)


def _usage() -> str:
    lines = ["usage: qwen3-pretrain <command> [options]", "", "commands:"]
    width = max(len(n) for n in COMMANDS)
    lines += [f"  {name:<{width}}  {help_}" for name, (_, help_) in COMMANDS.items()]
    lines += ["", "Run 'qwen3-pretrain <command> --help' for the options of one command; --version for the version."]
    return "\n".join(lines)


def run_command(target: str, argv: list[str]) -> int:
    """Call ``module:function`` with ``argv``; the project's user errors become one line on stderr.

    Any other exception (torch, DTensor, safetensors, a bug) propagates with its traceback: its cause
    is in there, and a one-line ``str()`` of it would hide where it came from.
    """
    module_name, func_name = target.split(":")
    apply_process_env_defaults()
    try:
        func = getattr(importlib.import_module(module_name), func_name)
        return int(func(argv) or 0)
    except UserError as exc:
        if os.environ.get("QWEN3_PRETRAIN_DEBUG"):
            raise
        report_error(f"error: {exc}")
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


# A rank other than 0 prints its error this many seconds late. When every rank fails alike (a config error),
# rank 0 has printed it and exited by then, and the launcher (torchrun, mpirun) has stopped the others: the
# user reads the message once. A rank that fails alone still prints it, late.
ECHO_DELAY_S = 3.0
_RANK_VARIABLES = ("RANK", "OMPI_COMM_WORLD_RANK", "SLURM_PROCID")  # torchrun, mpirun, srun


def _launch_rank() -> int:
    for name in _RANK_VARIABLES:
        value = os.environ.get(name, "")
        if value.isdigit():
            return int(value)
    return 0


def report_error(message: str) -> None:
    """Show a user error once per launch: in torchrun's failure summary (its error file, read by the agent:
    the summary's root cause names the message instead of "<N/A>"), and on stderr, at once on rank 0 and
    ``ECHO_DELAY_S`` late on the others."""
    error_file = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if error_file:
        record = {"message": {"message": message,
                              "extraInfo": {"py_callstack": message, "timestamp": str(int(time.time()))}}}
        try:
            with open(error_file, "w") as f:
                json.dump(record, f)
        except OSError:
            pass  # the summary then says <N/A>; stderr still has the message
    if _launch_rank() != 0:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)  # a launcher stopping this rank stops it now
        time.sleep(ECHO_DELAY_S)
    print(message, file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(_usage())
        return 0 if argv else 2
    if argv[0] in ("-V", "--version"):
        from qwen3_pretrain import __version__

        print(f"qwen3-pretrain {__version__}")
        return 0
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        from qwen3_pretrain.config.loader import nearest

        hint = nearest(name, COMMANDS)
        print(f"error: unknown command {name!r}" + (f"; did you mean {hint!r}?" if hint else ""), file=sys.stderr)
        print(_usage(), file=sys.stderr)
        return 2
    return run_command(COMMANDS[name][0], rest)


if __name__ == "__main__":
    sys.exit(main())
