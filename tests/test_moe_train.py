"""Training a Qwen3-MoE model: layouts that process the same global micro-batches in the same order give the
same loss, balancing loss and gradient norm (moe_aux_loss global_batch, fp32); bf16 with recompute trains;
a resume after kill -9 is bit-exact and a resume under another layout continues; the expert-load figures
reach metrics.jsonl, the log line and parse-log's CSV."""

from __future__ import annotations

import csv
import functools
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import load_file

from qwen3_pretrain import load_hf_model, save_hf_model
from qwen3_pretrain.models.qwen3.config import Qwen3Config
from qwen3_pretrain.models.qwen3.model import Qwen3Model

from tests._checkpoint_helpers import (assert_identical_states, checkpoint_state, kill_then_resume, resume_from,
                                       step_dir)
from tests._train_helpers import (TINY_MODEL, check_ok, child_env, make_corpus, run_train, step_records, worst_relative_diff,
                                  write_config)

MOE_MODEL = dict(TINY_MODEL, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True)
# a large balancing coefficient and a z-loss, so that a wrong balancing gradient moves the weights visibly
SETUP = dict(model_overrides=MOE_MODEL, total_steps=4, save_steps=2, moe_aux_loss_coef=0.1, moe_z_loss_coef=0.01)
KEYS = ("step", "loss", "grad_norm", "moe_aux_loss", "moe_z_loss", "moe_load_max", "moe_idle_experts")
TOL = 1e-5  # relative, loss / moe_aux_loss / moe_z_loss / grad_norm: the bar (measured: <= 2e-6)

# name -> (processes, overrides). Global batch 4 in one micro-batch: one process, dp 2 (sharded or
# replicated optimizer), tp 2, cp 2. Two micro-batches of 2: one process accumulating, pp 2.
RUNS = {
    "single": (1, ["batch_size=4"]),
    "dp2": (2, ["batch_size=2"]),
    "dp2-replicated": (2, ["batch_size=2", "distributed_optimizer=false"]),
    # expert parallelism: ep 2 over dp 2, over cp 2, over tp 2 (the MoE layers on each tp rank's share of
    # the sequence); ep 4 over dp 2 x tp 2 (ep 4 over dp 4 trains in test_resume_across_expert_parallel_degrees,
    # held to the one-process run there)
    "ep2": (2, ["batch_size=2", "ep=2"]),
    "ep2-cp2": (2, ["cp=2", "batch_size=4", "ep=2"]),
    "ep2-tp2": (4, ["tp=2", "batch_size=2", "ep=2"]),
    "ep4-tp2": (4, ["tp=2", "batch_size=2", "ep=4"]),
    "ep2-dp4": (4, ["batch_size=1", "ep=2"]),  # each rank's experts FSDP-sharded over the 2 ranks ep leaves
    "ep2-hsdp": (4, ["batch_size=1", "dp_shard=2", "ep=2"]),  # 2 replicas of 2 shards, ep within a replica
    # dp 2 x pp 2 with two micro-batches per rank: the global micro-batches hold samples (0, 2) and (1, 3),
    # which no single process forms, so ep 2 there is checked against the same layout without ep, and
    # against one process without the balancing loss (whose figures depend on that grouping)
    "dp2-pp2": (4, ["pp=2", "batch_size=2", "pp_microbatch_size=1"]),
    "ep2-pp2": (4, ["pp=2", "batch_size=2", "pp_microbatch_size=1", "ep=2"]),
    "ep2-pp2-noaux": (4, ["pp=2", "batch_size=2", "pp_microbatch_size=1", "ep=2", "moe_aux_loss=none"]),
    "single-noaux": (1, ["batch_size=4", "moe_aux_loss=none"]),
    "tp2": (2, ["tp=2", "batch_size=4"]),
    "cp2": (2, ["cp=2", "batch_size=4"]),
    "single-accumulate": (1, ["batch_size=2", "gradient_accumulation_steps=2"]),
    "pp2": (2, ["pp=2", "batch_size=4", "pp_microbatch_size=2"]),
    "pp2-recompute": (2, ["pp=2", "batch_size=4", "pp_microbatch_size=2", "activation_checkpointing=full"]),
    "ep2-pp2-interleaved-bf16": (4, ["pp=2", "pp_schedule=interleaved", "pp_virtual_stages=2", "batch_size=2",
                                     "pp_microbatch_size=1", "ep=2", "mixed_precision=bf16",
                                     "activation_checkpointing=full", "total_steps=8", "save_steps=0"]),
    "bf16-recompute": (1, ["batch_size=2", "gradient_accumulation_steps=2", "mixed_precision=bf16",
                           "activation_checkpointing=full", "total_steps=8", "save_steps=0"]),
}


class MoeRuns:
    def __init__(self, root) -> None:
        self.root = root
        self.corpus = make_corpus(root / "corpus")

    def config(self, path, output_path, **overrides):
        return write_config(path, self.corpus, output_path, **{**SETUP, **overrides})

    @functools.cache
    def output(self, name: str):
        nproc, overrides = RUNS[name]
        run = self.root / name
        run.mkdir()
        proc = run_train(self.config(run / "c.yaml", run / "out"), nproc, *overrides, timeout=600)
        check_ok(proc)
        (run / "stdout.log").write_text(proc.stdout)
        return run / "out"

    def records(self, name: str) -> list[dict]:
        return step_records(self.output(name))


@pytest.fixture(scope="module")
def moe_runs(tmp_path_factory):
    return MoeRuns(tmp_path_factory.mktemp("moe_runs"))


def assert_same_moe_training(got: list[dict], want: list[dict], label: str) -> None:
    assert [r["step"] for r in got] == [r["step"] for r in want], label
    for key in ("loss", "moe_aux_loss", "moe_z_loss", "grad_norm"):
        if key not in want[0]:  # moe_aux_loss: none logs no balancing loss
            assert key not in got[0], label
            continue
        worst = worst_relative_diff([r[key] for r in got], [r[key] for r in want])
        print(f"{label}: max relative {key} diff {worst:.2e}")
        assert worst <= TOL, f"{label}: {key} differs by {worst:.2e}: {[r[key] for r in got]} vs " \
                             f"{[r[key] for r in want]}"


@pytest.mark.distributed
@pytest.mark.parametrize("name,reference", [("dp2", "single"), ("dp2-replicated", "single"), ("tp2", "single"),
                                            ("ep2", "single"), ("ep2-cp2", "single"), ("ep2-tp2", "single"),
                                            ("ep4-tp2", "single"),
                                            ("ep2-dp4", "single"), ("ep2-hsdp", "single"), ("ep2-pp2", "dp2-pp2"),
                                            ("ep2-pp2-noaux", "single-noaux"),
                                            ("cp2", "single"), ("pp2", "single-accumulate"),
                                            ("pp2-recompute", "single-accumulate")])
def test_layout_gives_the_same_moe_training(name, reference, moe_runs):
    """Measured: within 1.7e-6 (the gradient norms under tp 2), 1e-6 for the rest. Probes: counting the expert
    frequencies per rank (no all-reduce over dp x cp) moved dp 2's loss by 3.1e-4 over 4 steps; counting the
    pipeline schedule's own shape-finding forward as a micro-batch moved pp 2's moe_aux_loss by 0.5; a dispatch
    that raises fails every ep case (the path is taken); summing the MoE figures over tp as copies when ep
    borrows tp halved ep 2 x tp 2's moe_aux_loss."""
    assert_same_moe_training(moe_runs.records(name), moe_runs.records(reference), f"{name} vs {reference}")


def test_accumulation_counts_earlier_micro_batches(moe_runs):
    """global_batch accumulates the frequencies over a step's micro-batches: two micro-batches of 2 are not
    one of 4 (the second sees both), yet both start from the same loss."""
    one, two = moe_runs.records("single"), moe_runs.records("single-accumulate")
    assert one[0]["loss"] == pytest.approx(two[0]["loss"], rel=1e-6)
    assert one[0]["moe_aux_loss"] != pytest.approx(two[0]["moe_aux_loss"], rel=1e-6)


@pytest.mark.parametrize("name", ["bf16-recompute", pytest.param("ep2-pp2-interleaved-bf16",
                                                                  marks=pytest.mark.distributed)])
def test_bf16_with_recompute_trains(name, moe_runs):
    """One process; and ep 2 x interleaved pp 2 (the grouped kernel on each rank's experts)."""
    records = moe_runs.records(name)
    assert all(r["loss"] == r["loss"] and r["grad_norm"] == r["grad_norm"] for r in records)  # no NaN
    assert records[-1]["loss"] < records[0]["loss"]
    assert all(1.0 <= r["moe_load_max"] <= MOE_MODEL["num_experts"] for r in records)


def test_figures_reach_the_log_line_and_parse_log(moe_runs, tmp_path):
    out = moe_runs.output("single")
    stdout = (out.parent / "stdout.log").read_text()
    start = next(l for l in stdout.splitlines() if "run start" in l)
    assert " params, " in start and " active | " in start, start  # total and active parameters
    line = next(l for l in stdout.splitlines() if "step 1/4" in l)
    first = moe_runs.records("single")[0]
    assert f"aux {first['moe_aux_loss']:.4f} | z {first['moe_z_loss']:.4g} | load {first['moe_load_max']:.2f} " \
           "max/mean" in line, line
    from qwen3_pretrain.analysis.parse_log import main as parse_log

    (tmp_path / "train.log").write_text(stdout)
    assert parse_log(["--log_path", str(tmp_path / "train.log"), "--output_path", str(tmp_path / "steps.csv")]) == 0
    rows = list(csv.DictReader(open(tmp_path / "steps.csv")))
    assert float(rows[0]["moe_aux_loss"]) == pytest.approx(first["moe_aux_loss"], abs=1e-4)
    assert float(rows[0]["moe_load_max"]) == pytest.approx(first["moe_load_max"], abs=1e-2)
    assert float(rows[0]["moe_idle_experts"]) == pytest.approx(first["moe_idle_experts"], abs=1e-2)


def test_kill_9_then_resume_is_bit_exact(moe_runs, tmp_path):
    total = 12
    ref, out = tmp_path / "ref", tmp_path / "out"
    check_ok(run_train(moe_runs.config(tmp_path / "r.yaml", ref, total_steps=total), 1, "batch_size=2"))
    cfg = moe_runs.config(tmp_path / "c.yaml", out, total_steps=total, batch_size=2)
    proc = kill_then_resume(cfg, out, 4, total)
    assert "resumed from" in proc.stdout
    assert [[r[k] for k in KEYS] for r in step_records(out)] == [[r[k] for k in KEYS] for r in step_records(ref)]
    assert_identical_states(checkpoint_state(step_dir(ref, total), tmp_path),
                            checkpoint_state(step_dir(out, total), tmp_path))


@pytest.mark.distributed
def test_resume_under_another_layout(moe_runs, tmp_path):
    """dp 2's checkpoint of step 2 resumed by one process trains steps 3-4 as the one-process run did."""
    resume_from(moe_runs.output("dp2"), 2, tmp_path / "out")
    check_ok(run_train(moe_runs.config(tmp_path / "c.yaml", tmp_path / "out"), 1, "batch_size=4"))
    want = [r for r in moe_runs.records("single") if r["step"] > 2]
    assert_same_moe_training(step_records(tmp_path / "out"), want, "dp 2 -> one process resume")


@pytest.mark.distributed
@pytest.mark.parametrize("layout", ["pp2", "ep2-pp2"])
def test_merge_loads_in_transformers(layout, moe_runs, tmp_path):
    """The final checkpoint of pp 2, and of ep 2 x pp 2 (experts split over ranks), merges into a directory
    transformers' Qwen3MoeForCausalLM loads with no missing or unexpected key, each expert under its own
    name, computing the training model's logits."""
    out = moe_runs.output(layout)
    merged = tmp_path / "merged"
    check_ok(subprocess.run([sys.executable, "-m", "qwen3_pretrain", "merge", "--input_path", str(out),
                             "--output_path", str(merged), "--model_name", "qwen3-0.6b", "--dtype", "fp32"],
                            capture_output=True, text=True, env=child_env(), timeout=120))
    hf, info = transformers.AutoModelForCausalLM.from_pretrained(merged, dtype=torch.float32,
                                                                 output_loading_info=True)
    assert type(hf).__name__ == "Qwen3MoeForCausalLM"
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    state = checkpoint_state(step_dir(out, 4), tmp_path)["model"]
    written = {}
    for file in merged.glob("*.safetensors"):
        written.update(load_file(str(file)))
    # expert 5 of layer 2, as transformers names it, is row 5 of the stacked training tensor
    assert torch.equal(written["model.layers.2.mlp.experts.5.down_proj.weight"],
                       state["layers.2.mlp.experts.down_proj"][5])
    state.setdefault("lm_head.weight", state["embed_tokens.weight"])  # the plain model names the tie twice
    model = Qwen3Model(Qwen3Config(**MOE_MODEL))
    model.load_state_dict(state, strict=True)
    tokens = torch.randint(0, 500, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        diff = (hf(tokens).logits - model(tokens)).abs().max().item()
    print(f"merged MoE model vs training model: max abs logits diff {diff:.2e}")
    assert diff <= 1e-5


@pytest.mark.distributed
def test_continue_from_what_transformers_writes(moe_runs, tmp_path):
    """A directory written by transformers' save_pretrained (one tensor per expert, as the released
    checkpoints; the packed form is read in tests/test_moe_parity.py) and the same weights written by
    save_hf_model continue training identically under pp 2, each stage reading its own layers."""
    torch.manual_seed(3)
    config = transformers.Qwen3MoeConfig(**{k: v for k, v in MOE_MODEL.items()}, decoder_sparse_step=1,
                                         mlp_only_layers=[], max_position_embeddings=4096)
    by_transformers = tmp_path / "by_transformers"
    transformers.Qwen3MoeForCausalLM(config).save_pretrained(by_transformers)
    by_us = tmp_path / "by_us"
    save_hf_model(load_hf_model(by_transformers), by_us, dtype=torch.float32)
    runs = []
    for source in (by_transformers, by_us):
        cfg = moe_runs.config(tmp_path / f"{source.name}.yaml", tmp_path / f"out_{source.name}", total_steps=2,
                              save_steps=0, model_name="tiny-moe", model_path=str(source), model_overrides={})
        proc = run_train(cfg, 2, "pp=2", "batch_size=4", "pp_microbatch_size=2")
        check_ok(proc)
        assert "(continued pre-training)" in proc.stdout
        runs.append([[r[k] for k in KEYS] for r in step_records(tmp_path / f"out_{source.name}")])
    assert runs[0] == runs[1]


@pytest.mark.distributed
def test_the_quickstart_moe_example_trains(moe_runs, tmp_path):
    """examples/quickstart/pretrain_moe_config.yaml as written (dp 2 x pp 2 on 4 processes, bf16, the
    global-batch loss), on the test corpus for 6 steps: the loss falls and the MoE figures are logged. (Measured
    on the 2-core CPU: 11.96 -> 10.12 in 6 steps, ~2 s a step; 12 steps reached 7.07 in twice the time.)"""
    repo = Path(__file__).resolve().parents[1]
    out = tmp_path / "out"
    # the test corpus is synthetic (no tokenizer to check it against)
    proc = run_train(repo / "examples/quickstart/pretrain_moe_config.yaml", 4, f"data_path={moe_runs.corpus}",
                     f"output_path={out}", "tokenizer_path=null", "total_steps=6", "save_steps=0",
                     "warmup_steps=2", timeout=600)
    check_ok(proc)
    records = step_records(out)
    assert records[-1]["loss"] < records[0]["loss"] - 1.0, [r["loss"] for r in records]
    assert all(r["moe_aux_loss"] >= 1.0 and 1.0 <= r["moe_load_max"] <= 4.0 for r in records)


@pytest.mark.distributed
def test_resume_across_expert_parallel_degrees(moe_runs, tmp_path):
    """ep 2 -> one process -> ep 4: each resume continues as the uninterrupted one-process run does (the
    experts are saved whole under their names, each rank reads its own). The uninterrupted runs are the
    module's "single" and "ep2" (4 steps, saved at 2 and 4); the one-process run saves every step, so that
    ep 4 resumes from its step 3."""
    total = SETUP["total_steps"]
    want, ep2 = moe_runs.records("single"), moe_runs.output("ep2")
    assert_same_moe_training(step_records(ep2), want, "ep 2")
    one = tmp_path / "one"
    resume_from(ep2, 2, one)
    check_ok(run_train(moe_runs.config(tmp_path / "b.yaml", one, save_steps=1), 1, "batch_size=4"))
    assert_same_moe_training(step_records(one), want[2:], "ep 2 -> one process")
    ep4 = tmp_path / "ep4"
    resume_from(one, total - 1, ep4)
    check_ok(run_train(moe_runs.config(tmp_path / "c.yaml", ep4), 4, "batch_size=1", "ep=4"))
    assert_same_moe_training(step_records(ep4), want[total - 1:], "one process -> ep 4")


@pytest.mark.distributed
def test_kill_9_under_expert_parallelism_then_resume_is_bit_exact(moe_runs, tmp_path):
    total = 8
    ref, out = tmp_path / "ref", tmp_path / "out"
    check_ok(run_train(moe_runs.config(tmp_path / "r.yaml", ref, total_steps=total), 2, "batch_size=2", "ep=2"))
    cfg = moe_runs.config(tmp_path / "c.yaml", out, total_steps=total, batch_size=2, ep=2)
    proc = kill_then_resume(cfg, out, 3, total, 2)
    assert "resumed from" in proc.stdout
    assert [[r[k] for k in KEYS] for r in step_records(out)] == [[r[k] for k in KEYS] for r in step_records(ref)]
    assert_identical_states(checkpoint_state(step_dir(ref, total), tmp_path),
                            checkpoint_state(step_dir(out, total), tmp_path))
