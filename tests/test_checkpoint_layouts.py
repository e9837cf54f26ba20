"""Resume under another layout with a vocabulary that tp does not divide, bit-exact resume under tp and
pp (1f1b, interleaved), and the check that a checkpoint holds the model being trained.

The vocabulary is 513: tp 2 pads the embedding to 514 rows, tp 1 keeps 513, so every resume between tp 1
and tp 2 has to re-pad or trim the rows of the weights and of their AdamW moments. The runs form one
chain from a one-process reference (fp32, global batch 4 in every layout), each resuming from a
checkpoint of an earlier one; each is started once, when a test first needs it.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests._checkpoint_helpers import assert_identical_states, checkpoint_state, records, resume_from, step_dir
from tests._train_helpers import TINY_MODEL, check_ok, make_corpus, run_train, write_config

VOCAB = 513
TOTAL = 8
LAYOUTS = {  # processes, overrides; each gives a global batch of 4 samples
    "one process": (1, ["gradient_accumulation_steps=2"]),
    "tp2": (2, ["tp=2", "gradient_accumulation_steps=2"]),
    "pp2": (2, ["pp=2", "gradient_accumulation_steps=2"]),
    "pp2 interleaved": (2, ["pp=2", "pp_schedule=interleaved", "gradient_accumulation_steps=2"]),
    "dp2": (2, []),
    "dp4 shard2": (4, ["batch_size=1", "dp_shard=2"]),  # HSDP: 2 replicas of 2 shards
    "dp4 shard4": (4, ["batch_size=1", "dp_shard=4"]),
}
# run -> (layout, (run, step) it resumes from, save_steps); the steps saved are the ones later runs need
RUNS = {
    "reference": ("one process", None, 2),
    "tp1->tp2": ("tp2", ("reference", 2), 1),
    "tp2->tp1": ("one process", ("tp1->tp2", 4), 0),
    "tp2->pp2": ("pp2", ("tp1->tp2", 3), 1),  # 514 rows trimmed; the last stage's tied head reads the embedding
    "pp2->tp2": ("tp2", ("tp2->pp2", 6), 0),  # a checkpoint holding the tied weight twice, 513 rows padded
    "tp2->dp2": ("dp2", ("tp1->tp2", 3), 5),  # trimmed into FSDP's uneven shards (257 + 256 rows)
    "dp2->one process": ("one process", ("tp2->dp2", 5), 0),
    "tp1->pp2 interleaved": ("pp2 interleaved", ("reference", 2), 5),
    "tp1->dp4 shard2": ("dp4 shard2", ("reference", 2), 5),
    "dp4 shard2->shard4": ("dp4 shard4", ("tp1->dp4 shard2", 5), 0),  # the same ranks, another dp_shard
    # the same layout again, from a checkpoint the run above wrote on its way: tp 2, and pp 2 interleaved (two
    # stages per rank, so a rank's checkpoint holds several stages' parts; a superset of plain pp 2's one)
    "tp2 again": ("tp2", ("tp1->tp2", 5), 0),
    "pp2 interleaved again": ("pp2 interleaved", ("tp1->pp2 interleaved", 5), 0),
}
# Relative tolerance of losses, gradient norms and tensors (relative to the tensor's largest value)
# between layouts: fp32 sums in another order differ by < 1e-6 here. Probe: resuming tp 1 -> tp 2 with
# the AdamW moments of the vocabulary rows zeroed moved the loss of the second resumed step by 2e-3.
RTOL = 1e-5


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return make_corpus(tmp_path_factory.mktemp("corpus"))


@pytest.fixture(scope="module")
def run(corpus, tmp_path_factory):
    """``run(name)`` -> output_path of RUNS[name], trained (with the runs it resumes from) on first use."""
    root = tmp_path_factory.mktemp("runs")
    done: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in done:
            layout, source, save_steps = RUNS[name]
            out = root / name.replace(" ", "_").replace(">", "")
            if source is not None:
                resume_from(get(source[0]), source[1], out)
            cfg = write_config(root / f"{out.name}.yaml", corpus, out, total_steps=TOTAL, save_steps=save_steps,
                               keep_last_n=0, model_overrides=dict(TINY_MODEL, vocab_size=VOCAB))
            nproc, overrides = LAYOUTS[layout]
            proc = run_train(cfg, nproc, *overrides, timeout=900)  # generous: a busy machine is slow
            check_ok(proc)
            if source is not None:
                assert f"at step {source[1]}" in proc.stdout, proc.stdout[-2000:]
            done[name] = out
        return done[name]

    return get


def _meta(output_path: Path, step: int) -> dict:
    return json.loads((step_dir(output_path, step) / "meta.json").read_text())


def _assert_close(got: float | torch.Tensor, want: float | torch.Tensor, what: str) -> None:
    got, want = torch.as_tensor(got, dtype=torch.float64), torch.as_tensor(want, dtype=torch.float64)
    scale = want.abs().max().item() if want.numel() else 0.0
    error = (got - want).abs().max().item() if want.numel() else 0.0
    assert error <= RTOL * scale, f"{what}: max error {error:.3g} > {RTOL} x {scale:.3g}"


def _assert_same_rows(got: dict, want: dict) -> None:
    """``got`` (any tp, pp) holds ``want``'s values (one process, tp 1) up to RTOL: its vocabulary tensors
    and their moments in the first VOCAB rows and zeros after; a pipeline's tied head as the embedding."""
    for part in ("model", "optim"):
        assert set(want[part]) <= set(got[part]), (part, set(want[part]) - set(got[part]))
        for key, value in got[part].items():
            ref_key = key if key in want[part] else key.replace("lm_head.", "embed_tokens.")
            assert ref_key in want[part], f"{part}.{key} is not in the reference checkpoint"
            ref = want[part][ref_key]
            if not isinstance(value, torch.Tensor):
                assert value == ref, (part, key, value, ref)
            elif ("embed_tokens." in key or "lm_head." in key) and value.dim() == 2:
                assert value.shape[1:] == ref.shape[1:] and value.shape[0] >= VOCAB, (key, value.shape)
                _assert_close(value[:VOCAB], ref[:VOCAB], f"{part}.{key}[:{VOCAB}]")
                assert not value[VOCAB:].any(), f"{part}.{key}: padding rows are not zero"
            else:
                assert value.shape == ref.shape, (key, value.shape, ref.shape)
                _assert_close(value, ref, f"{part}.{key}")


RESHARDS = ["tp1->tp2", "tp2->tp1", "tp2->pp2", "pp2->tp2", "tp2->dp2", "dp2->one process", "tp1->pp2 interleaved",
            "tp1->dp4 shard2", "dp4 shard2->shard4"]


@pytest.mark.distributed
@pytest.mark.parametrize("name", RESHARDS)
def test_resume_under_another_layout_with_a_vocabulary_tp_does_not_divide(name, run, tmp_path):
    """Losses and gradient norms of every resumed step, the final weights and AdamW state, and the
    data position equal the uninterrupted one-process run's."""
    reference, out = run("reference"), run(name)
    want = {step: (loss, norm) for step, loss, norm in records(reference)}
    got = records(out)
    start = RUNS[name][1][1]
    assert [step for step, _, _ in got] == list(range(start + 1, TOTAL + 1)), got
    for step, loss, norm in got:
        _assert_close(loss, want[step][0], f"loss at step {step}")
        _assert_close(norm, want[step][1], f"grad_norm at step {step}")
    _assert_same_rows(checkpoint_state(step_dir(out, TOTAL), tmp_path),
                      checkpoint_state(step_dir(reference, TOTAL), tmp_path))
    for key in ("step", "tokens_seen", "data"):
        assert _meta(out, TOTAL)[key] == _meta(reference, TOTAL)[key], key


@pytest.mark.distributed
@pytest.mark.parametrize("name, uninterrupted", [("tp2 again", "tp1->tp2"),
                                                  ("pp2 interleaved again", "tp1->pp2 interleaved")])
def test_resume_in_the_same_layout_is_bit_exact(name, uninterrupted, run, tmp_path):
    """Stopped and resumed in the same layout, a run logs the same loss and gradient norm at every step
    (float equality) and ends with the same bytes of weights and optimizer state as without the stop."""
    full, resumed = run(uninterrupted), run(name)
    got = records(resumed)
    assert len(got) == TOTAL - RUNS[name][1][1] > 0, got
    assert got == records(full)[-len(got):]
    assert_identical_states(checkpoint_state(step_dir(full, TOTAL), tmp_path),
                            checkpoint_state(step_dir(resumed, TOTAL), tmp_path))
    assert _meta(resumed, TOTAL)["data"] == _meta(full, TOTAL)["data"]


@pytest.mark.parametrize("key, value", [("hidden_size", 96), ("num_hidden_layers", 6)])
def test_resume_into_another_model_names_the_differing_key(key, value, run, corpus, tmp_path):
    out = tmp_path / "out"
    resume_from(run("reference"), 2, out)
    model = dict(TINY_MODEL, vocab_size=VOCAB, **{key: value})
    proc = run_train(write_config(tmp_path / "c.yaml", corpus, out, total_steps=TOTAL, model_overrides=model))
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert (f"{step_dir(out, 2)} holds a different model ({key} {TINY_MODEL[key]} vs {value}); use another "
            "output_path or the matching model config") in proc.stderr, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
    assert not (out / "metrics.jsonl").exists() or not records(out), "training started"
