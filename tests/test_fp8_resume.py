"""Checkpoints under FP8 (``fp8``; models/ops/fp8.py) keep the high-precision weights and optimizer state, so:

- an FP8 run resumed from its checkpoint equals the uninterrupted FP8 run to the bit (dynamic scales are
  computed from the tensors each step: there is no scale history to save);
- FP8 switches on or off at a resume: a bf16 checkpoint continues in FP8 and an FP8 one in bf16, each step
  near the run that never switched;
- the checkpoint (model and optimizer entries: names, shapes, dtypes) and the merged HF directory are those of
  a run without FP8.

One process, FP8 emulated on the CPU (``fp8_emulate``), the CLI as a user runs it.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

pytest.importorskip("torchao", reason="FP8 needs torchao (pip install 'qwen3-pretrain[fp8]')")

from qwen3_pretrain.checkpoint.merge import merge_checkpoint  # noqa: E402
from tests._checkpoint_helpers import checkpoint_state, resume_from, step_dir  # noqa: E402
from tests._train_helpers import check_ok, make_corpus, run_train, step_records, write_config  # noqa: E402

pytestmark = pytest.mark.slow
STEPS, SAVE = 6, 3
FP8 = {"fp8": "tensorwise", "fp8_emulate": True}
# A switched run's steps after the switch against the run that never switched: one precision's rounding
# against the other's, over 3 steps (test_fp8.py measures the two curves within 0.2% over 30 steps).
SWITCH_RTOL = 0.02


def run(tmp: Path, name: str, data: Path, keys: dict, resume: Path | None = None) -> Path:
    out = tmp / name
    if resume is not None:
        resume_from(resume, SAVE, out)
    config = write_config(tmp / f"{name}.yaml", data, out, mixed_precision="bf16", total_steps=STEPS,
                          save_steps=SAVE, **keys)
    check_ok(run_train(config))
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    """bf16 and FP8 runs of 6 steps, each saving at step 3."""
    tmp = tmp_path_factory.mktemp("fp8_resume")
    data = make_corpus(tmp / "data", num_docs=100)
    return {"tmp": tmp, "data": data, "bf16": run(tmp, "bf16", data, {}), "fp8": run(tmp, "fp8", data, FP8)}


def losses_after(out: Path, step: int) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in step_records(out) if r["step"] > step}


def test_an_fp8_run_resumes_bit_exact(runs):
    resumed = run(runs["tmp"], "fp8_resumed", runs["data"], FP8, resume=runs["fp8"])
    got, want = step_records(resumed), step_records(runs["fp8"])
    want = [r for r in want if r["step"] > SAVE]
    assert [r["step"] for r in got if r["step"] > SAVE] == [4, 5, 6]
    for g, w in zip([r for r in got if r["step"] > SAVE], want, strict=True):
        assert (g["loss"], g["grad_norm"]) == (w["loss"], w["grad_norm"]), (g, w)


@pytest.mark.parametrize("switch", ["bf16 to fp8", "fp8 to bf16"])
def test_fp8_switches_on_or_off_at_a_resume(runs, switch):
    """The switched run loads the other precision's checkpoint (the same tensors) and continues: its losses
    are near the run that never switched, and not equal to it (the new precision is in force)."""
    source, keys, same = ("bf16", FP8, "fp8") if switch == "bf16 to fp8" else ("fp8", {}, "bf16")
    resumed = run(runs["tmp"], f"switched_from_{source}", runs["data"], keys, resume=runs[source])
    got, steady = losses_after(resumed, SAVE), losses_after(runs[source], SAVE)
    assert sorted(got) == [4, 5, 6] and all(math.isfinite(v) for v in got.values())
    for step, loss in got.items():
        assert abs(loss - steady[step]) <= SWITCH_RTOL * steady[step], (switch, got, steady)
    assert got != steady, switch


def test_checkpoint_and_merged_model_are_those_of_a_run_without_fp8(runs, tmp_path):
    """The FP8 run's checkpoint holds the entries of the bf16 run's (model and optimizer: names, shapes,
    dtypes; the weights fp32), and merge writes the same HF tensors' names, shapes and dtypes."""
    states = {name: checkpoint_state(step_dir(runs[name], SAVE), tmp_path) for name in ("bf16", "fp8")}
    for part in ("model", "optim"):
        layout = {name: {k: (tuple(v.shape), v.dtype) if torch.is_tensor(v) else type(v)
                         for k, v in states[name][part].items()} for name in states}
        assert layout["fp8"] == layout["bf16"], part
    assert all(v.dtype == torch.float32 for v in states["fp8"]["model"].values() if v.is_floating_point())
    merged = {}
    for name in ("bf16", "fp8"):
        out = merge_checkpoint(runs[name], tmp_path / f"hf_{name}", "qwen3-0.6b", progress=False).output_path
        tensors = {}
        for file in sorted(Path(out).glob("*.safetensors")):
            with safe_open(str(file), "pt") as f:
                tensors.update({k: (tuple(f.get_tensor(k).shape), f.get_tensor(k).dtype) for k in f.keys()})
        merged[name] = tensors
        assert (Path(out) / "config.json").is_file()
    assert merged["fp8"] == merged["bf16"] and merged["fp8"]
