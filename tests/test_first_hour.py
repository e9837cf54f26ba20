"""The first hour as a user: what the commands say, run as a user runs them (the CLI, torchrun with 2 processes).

Nothing happens without a word (a resume with nothing to train, a reshaped learning-rate schedule, a removed
checkpoint, a long start-up phase, a save), no scary warning comes from our own code, and every mistake ends
in one line that says what to change.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from qwen3_pretrain.cli import main as cli_main
from tests._train_helpers import child_env, free_port, make_corpus, write_config

REPO = Path(__file__).resolve().parents[1]
DUMP = REPO / "assets" / "enwiki-sample" / "enwiki-latest-pages-articles1.xml-p000000010p000030302-shortened.bz2"


def cli(*args: str, cwd: Path = REPO, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "qwen3_pretrain", *args], capture_output=True, text=True, cwd=cwd,
                          env=child_env(), timeout=timeout)


def torchrun(config: Path, *overrides: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free_port()),
           "-m", "qwen3_pretrain", "train", "--config", str(config), *overrides]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=child_env())


@pytest.fixture(scope="module")
def tp2_runs(tmp_path_factory):
    """A tp 2 run of 4 steps logged every 100 (saving at 2 and 4, keeping 1), the same command again (nothing
    left to train), then again with total_steps 6 (another schedule)."""
    root = tmp_path_factory.mktemp("first_hour")
    # peak_tflops None: as a user's config, the CPU's peak is measured (one rank probes, the other waits)
    config = write_config(root / "c.yaml", make_corpus(root / "data"), root / "out", tp=2, total_steps=4,
                          log_steps=100, save_steps=2, keep_last_n=1, peak_tflops=None)
    first = torchrun(config)
    again = torchrun(config)
    longer = torchrun(config, "total_steps=6")
    return root, first, again, longer


@pytest.mark.distributed
def test_a_run_says_what_it_does(tp2_runs):
    _, first, _, _ = tp2_runs
    out = first.stdout + first.stderr
    assert first.returncode == 0, out[-3000:]
    # the first steps are logged whatever log_steps is; start-up phases say when they start and end
    assert re.search(r"step 1/4 \| loss", out) and re.search(r"step 3/4 \| loss", out)
    assert "building the model (qwen3-0.6b preset with model_overrides head_dim=16" in out and "done in" in out
    assert re.search(r"MFU against a peak of \S+ TFLOP/s per device \(\S+ TFLOP/s measured on one core", out)
    # the test corpus was converted for seq_length 8192: said, and why it is fine
    assert re.search(r"INFO \S+ was converted for seq_length 8192; training at 64 \(fine: samples are packed at any "
                     r"length\)", out), out[-3000:]
    # a save says when it starts, then what it wrote; the checkpoint keep_last_n drops is named
    saving, saved = out.index("saving checkpoint"), out.index("saved checkpoint")
    assert saving < saved
    assert re.search(r"removed checkpoint \S+step_0000002 \(keep_last_n: 1\)", out)
    # no warning of torch's about the gradient norm's reductions (it is one all-reduce)
    assert "sequential all_reduce" not in out and "inconsistent results" not in out


@pytest.mark.distributed
def test_nothing_to_train_and_a_reshaped_schedule_are_said(tp2_runs):
    root, _, again, longer = tp2_runs
    assert again.returncode == 0
    assert "checkpoint step 4 >= total_steps 4: nothing to train; raise total_steps or use another output_path" \
        in again.stdout
    assert longer.returncode == 0, longer.stderr[-3000:]
    assert re.search(r"resuming with another learning-rate schedule \(total_steps 4 -> 6\): the lr of step 5 is "
                     r"\S+ \(the checkpoint's schedule: \S+\)", longer.stdout)
    assert "weights from step_0000004 (resumed)" in longer.stdout
    # a resumed run's model is built, then given the checkpoint's weights: its first line says so, not "random init"
    for run in (again, longer):
        building = next(line for line in run.stdout.splitlines() if "building the model (" in line)
        assert building.endswith("; weights from step_0000004, loaded next) ..."), building
    # parse-log: two runs that logged steps are one restart, not two (a start and a resume event)
    summary = cli("parse-log", "--log_path", str(root / "out" / "metrics.jsonl"), "--output_path",
                  str(root / "m.csv"))
    assert summary.returncode == 0 and "restarts: 1" in summary.stdout, summary.stdout


def test_the_first_compile_is_a_start_up_phase(tmp_path):
    """With compile: true the first step compiles the layers: said before it starts, with its time after."""
    config = write_config(tmp_path / "c.yaml", make_corpus(tmp_path / "data"), tmp_path / "out", total_steps=2,
                          compile=True)
    proc = cli("train", "--config", str(config), timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()

    def at(pattern: str) -> int:
        return next(i for i, line in enumerate(lines) if re.search(pattern, line))

    start = at(r"INFO compiling the model \(torch\.compile, during step 1\) \.\.\.$")
    assert at(r"INFO MFU against") < start < at(r"INFO done in [\d.]+ s: compiling the model$") < at(r"step 1/2 \|")
    assert sum("compiling the model" in line for line in lines) == 2, proc.stdout


def test_every_mistake_ends_in_one_line(tmp_path):
    """Each mistake as typed, the six in one process (tests/_cli_cases.py: cli.main once per case, its output
    caught; a process each cost ~2.5 s of imports, 15 s in all on the 2-core CI). A process of its own runs one
    of them (a train command's, which imports torch), so what an interpreter prints on start-up is seen too."""
    from tests._cli_cases import run_cases

    def one_line(code, stderr: str, message: str) -> None:
        assert code == 2, stderr[-2000:]
        lines = [line for line in stderr.splitlines() if line.strip() and not line.startswith("wiki2parquet:")]
        assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], stderr[-2000:]

    run = tmp_path / "run"
    (run / "step_0000002").mkdir(parents=True)
    (run / "step_0000002" / "meta.json").write_text("{}")
    (run / "latest").write_text("step_0000002")
    data_file = tmp_path / "data.bin"
    data_file.write_bytes(b"")
    mistakes = {
        "wiki2parquet": (["wiki2parquet", "--input", str(DUMP), "--output", "/proc/wiki.parquet"],
                         "--output /proc/wiki.parquet: cannot write there"),
        "generate": (["generate", "--model", str(run), "--prompt", "x"],
                     f"{run} is a training output_path (sharded checkpoints step_N/), not a HuggingFace model; "
                     "merge it"),
        "data_file": (["train", "--config", str(REPO / "examples" / "quickstart" / "pretrain_config.yaml"),
                       f"data_path={data_file}", "rank_size=1", "tp=1", "pp=1"],
                      f"data_path {data_file} is a file; give the folder"),
        "typo": (["train", "--config", str(REPO / "examples" / "pretrain_config.yaml"), "distributed_optimizer=Ture"],
                 "command line (distributed_optimizer=...): distributed_optimizer: expected true or false, got 'Ture'"),
        "config_name": (["convert", "--config", "pretrain_data_config.yaml"],
                        "config file 'pretrain_data_config.yaml' does not exist; did you mean "
                        "'examples/pretain_data_config.yaml'?"),
        "seq_length": (["train", "--config", str(REPO / "examples" / "quickstart" / "pretrain_config.yaml"),
                        "seq_length=100000", "rank_size=1", "tp=1", "pp=1"],
                       "lower seq_length to at most that, or raise max_position_embeddings"),
    }
    results = run_cases([(name, {}, argv) for name, (argv, _) in mistakes.items()], child_env(), cwd=REPO)
    for name, (_, message) in mistakes.items():
        code, _, stderr = results[name]
        one_line(code, stderr, message)
    alone = cli(*mistakes["typo"][0])  # a train command: torch and the engine's imports, in a fresh interpreter
    one_line(alone.returncode, alone.stderr, mistakes["typo"][1])


def help_in_process(command: str, capsys: pytest.CaptureFixture) -> str:
    """``qwen3-pretrain COMMAND --help``'s output, from the entry point called in this process (the same
    ``main`` and parser as the console script's; a process each would cost a second of imports)."""
    capsys.readouterr()
    with pytest.raises(SystemExit) as stop:
        cli_main([command, "--help"])
    assert stop.value.code in (0, None), command
    return capsys.readouterr().out


def test_one_command_line_convention(capsys, monkeypatch):
    """Long options take dashes or underscores everywhere; usage names the command as typed; help repeats no
    default; train and convert list their config keys."""
    plan = cli("plan", "--model", "qwen3-8b", "--seq_length", "4096", "--devices_per_node", "8", "--device", "h100")
    assert plan.returncode == 0, plan.stderr
    monkeypatch.setenv("COLUMNS", "100")  # argparse's width, the same in this process as in a child's
    train = cli("train", "--help")  # one as a process, as typed
    assert train.returncode == 0 and train.stdout.startswith("usage: qwen3-pretrain train "), train.stderr
    # the entry point sets THP_MEM_ALLOC_ENABLE for the command it runs: kept from this test session's environment
    monkeypatch.setenv("THP_MEM_ALLOC_ENABLE", os.environ.get("THP_MEM_ALLOC_ENABLE", "0"))
    usages = {command: help_in_process(command, capsys) for command in (
        "wiki2parquet", "convert", "train", "plan", "simulate", "merge", "parse-log", "generate", "commbench", "demo")}
    assert usages["train"] == train.stdout
    for command, usage in usages.items():
        assert usage.startswith(f"usage: qwen3-pretrain {command} "), command
        assert "(default: None)" not in usage, command
    for command, key in (("train", "gradient_checkpointing"), ("convert", "chunk_size")):
        assert re.search(rf"^  {key}$", usages[command], re.MULTILINE), command
