"""The checkpoint format's versions hold what a saved tensor means: golden checkpoints of each model family,
written by the trainer's own save path (``Checkpointer``) at a fixed seed and committed under
``tests/golden_checkpoints/``, load with today's code to the logits they were written with (so a change to a
saved tensor's layout fails here unless the family's version is bumped with a conversion); an old-layout hybrid
checkpoint (the Gated DeltaNet's [q | k | v] rows in the HF files' order) converts on resume and on merge, its
optimizer states too; a layout newer than this code reads, or one without a conversion, is refused with both
versions named and no traceback through the CLI.

Regenerate the goldens (only after bumping a family's version and adding its conversion, checkpoint/versions.py):
``python -m tests.test_checkpoint_format``.
"""

from __future__ import annotations

import json
import shutil
from unittest import mock
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file
from torch.distributed.checkpoint.state_dict import get_model_state_dict

from qwen3_pretrain.checkpoint import manager, versions
from qwen3_pretrain.checkpoint.layout import META_FILE, step_dir_name
from qwen3_pretrain.checkpoint.manager import Checkpointer
from qwen3_pretrain.checkpoint.merge import merge_checkpoint
from qwen3_pretrain.cli import run_command
from qwen3_pretrain.errors import UserError
from qwen3_pretrain.models.qwen3.config import Qwen3Config
from qwen3_pretrain.models.qwen3.hf_io import load_hf_model
from qwen3_pretrain.models.qwen3.model import ModelOptions, Qwen3Model

GOLDEN = Path(__file__).resolve().parent / "golden_checkpoints"
SEED = 1234
# fp32 on CPUs of other vector widths (AVX2, AVX-512, AMX) reorders sums: a few ulps of the logits' scale. A
# scrambled layout moves them by percents (the regrouped Gated DeltaNet rows read in the old order: 7e-2).
RTOL = 1e-5

_BASE = dict(vocab_size=16, hidden_size=8, intermediate_size=12, num_hidden_layers=2, num_attention_heads=2,
             num_key_value_heads=1, head_dim=4, max_position_embeddings=64, tie_word_embeddings=False,
             bos_token_id=0, eos_token_id=1, rms_norm_eps=1e-6)
_LINEAR = dict(layer_types=["linear_attention", "full_attention"], linear_num_key_heads=2,
               linear_num_value_heads=4, linear_key_head_dim=2, linear_value_head_dim=2, linear_conv_kernel_dim=4,
               partial_rotary_factor=0.5)
_MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=4)
# One per family, the hybrid MoE Qwen3-Next's fused projections with a multi-token-prediction layer (Qwen3.5's
# four projections in the plain hybrid), so both Gated DeltaNet layouts are held.
FAMILIES = {
    "dense": dict(_BASE),
    "moe": dict(_BASE, **_MOE, model_type="qwen3_moe"),
    "hybrid": dict(_BASE, **_LINEAR, model_type="qwen3_5_text"),
    "hybrid_moe": dict(_BASE, **_LINEAR, **_MOE, shared_expert_intermediate_size=6, model_type="qwen3_next",
                       mtp_num_hidden_layers=1),
}


def build(name: str) -> Qwen3Model:
    cfg = Qwen3Config(**FAMILIES[name])
    return Qwen3Model(cfg, ModelOptions(multi_token_prediction=cfg.mtp_num_hidden_layers > 0))


def randomize(model: Qwen3Model, seed: int) -> None:
    """Every parameter drawn (norm weights and decay parameters too), so that no row equals another and any
    reordering of a tensor's rows shows in the logits."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, param in sorted(model.named_parameters()):
            param.copy_(torch.randn(param.shape, generator=gen) * (0.1 if param.dim() == 1 else 0.4)
                        + (1.0 if param.dim() == 1 else 0.0))


def inputs(model: Qwen3Model) -> tuple[torch.Tensor, torch.Tensor | None]:
    gen = torch.Generator().manual_seed(SEED + 1)
    ids = torch.randint(0, model.config.vocab_size, (1, 8), generator=gen)
    mtp = torch.randint(0, model.config.vocab_size, (1, 8), generator=gen) if model.mtp is not None else None
    return ids, mtp


def logits(model: Qwen3Model) -> dict[str, torch.Tensor]:
    ids, mtp = inputs(model)
    with torch.no_grad():
        out = model(ids, mtp_input=mtp) if mtp is not None else model(ids)
    return {"logits": out[0], "mtp_logits": out[1]} if isinstance(out, tuple) else {"logits": out}


class ModelOnly(Checkpointer):
    """The trainer's checkpointer without the optimizer's state: the goldens hold the weights alone (the
    optimizer's entries, one pickled record per parameter and hyper-parameter, are most of a tiny model's
    checkpoint; its states follow their parameters' layout, tested with old-layout checkpoints below)."""

    def _part_state_dicts(self):
        return [(get_model_state_dict(part), {}) for part in self.parts]

    def load(self, path: Path) -> dict:
        with mock.patch.object(manager, "set_optimizer_state_dict", lambda *args, **kwargs: None):
            return super().load(path)


def save(model: Qwen3Model, optimizer: torch.optim.Optimizer | None, root: Path, step: int = 0) -> Path:
    """``model`` (with ``optimizer``'s state unless None) as the trainer saves it (collective over the world of
    one), under ``root``."""
    kind = Checkpointer if optimizer is not None else ModelOnly
    kind(root, [model], [optimizer or torch.optim.AdamW(model.parameters())], keep_last_n=0).save(
        step, {"model_name": None, "model_config": model.config.to_hf_dict()})
    return root / step_dir_name(step)


def load(name: str, root: Path, step: int = 0, optimizer: bool = True
         ) -> tuple[Qwen3Model, torch.optim.Optimizer | None]:
    model = build(name)
    opt = torch.optim.AdamW(model.parameters())
    (Checkpointer if optimizer else ModelOnly)(root, [model], [opt], keep_last_n=0).load(root / step_dir_name(step))
    return model, opt


def close(got: torch.Tensor, want: torch.Tensor) -> bool:
    return bool((got - want).abs().max() <= RTOL * want.abs().max())


def write_goldens() -> None:
    """Write every family's golden checkpoint (a world of one, model weights only: no optimizer step)."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        for name in FAMILIES:
            root = GOLDEN / name
            shutil.rmtree(root, ignore_errors=True)
            model = build(name)
            randomize(model, SEED)
            path = save(model, None, root)
            shutil.rmtree(path / "rng")  # the random state is not the layout's (and a load without it is fine)
            save_file(logits(model), root / "logits.safetensors")
            (root / "golden.json").write_text(json.dumps(
                {"family": name, "tensor_layout": versions.LAYOUT_VERSIONS[name], "seed": SEED,
                 "torch": torch.__version__}, indent=1) + "\n")
    finally:
        dist.destroy_process_group()


def _golden(name: str) -> dict:
    return json.loads((GOLDEN / name / "golden.json").read_text())


@pytest.mark.parametrize("name", FAMILIES)
def test_golden_is_of_todays_version_or_converts_to_it(name):
    """A bumped version with neither regenerated goldens nor a conversion from the golden's version fails
    here, by name (and in the load below, by the refusal)."""
    golden = _golden(name)
    meta = json.loads((GOLDEN / name / step_dir_name(0) / META_FILE).read_text())
    assert meta[versions.LAYOUT_KEY] == {"family": name, "version": golden["tensor_layout"]}
    current = versions.LAYOUT_VERSIONS[name]
    missing = [v for v in range(golden["tensor_layout"], current)
               if not any(name in c.families and c.version == v for c in versions.CHANGES)]
    assert not missing, (f"{name}: layout version {current}, golden written at {golden['tensor_layout']}, no "
                         f"conversion from {missing}: add one (checkpoint/versions.py) or regenerate the goldens")


@pytest.mark.parametrize("name", FAMILIES)
def test_golden_checkpoint_resumes_to_its_logits(name, world_of_one):
    model, _ = load(name, GOLDEN / name, optimizer=False)
    want = load_file(GOLDEN / name / "logits.safetensors")
    got = logits(model)
    assert sorted(got) == sorted(want)
    for key in want:
        diff = (got[key] - want[key]).abs().max().item()
        assert close(got[key], want[key]), (f"{name}: {key} differ by {diff:.3g} from the golden checkpoint's: "
                                            "a saved tensor's layout changed without a version bump?")


@pytest.mark.parametrize("name", FAMILIES)
def test_golden_checkpoint_merges_to_its_logits(name, tmp_path):
    """The HF export of the golden (merge, then the HF reader) computes the same: the files' layout held too."""
    merge_checkpoint(GOLDEN / name, tmp_path / "hf", "tiny", step=0, dtype=torch.float32, progress=False)
    model = load_hf_model(tmp_path / "hf", mtp=FAMILIES[name].get("mtp_num_hidden_layers", 0) > 0)
    want = load_file(GOLDEN / name / "logits.safetensors")
    got = logits(model)
    for key in want:
        assert close(got[key], want[key]), (name, key, (got[key] - want[key]).abs().max().item())


def test_family_is_read_off_the_parameter_names():
    assert {name: versions.family(dict(build(name).named_parameters())) for name in FAMILIES} == \
        {name: name for name in FAMILIES}
    # pipeline stages' families (a save gathers one word per rank): a stage of Gated DeltaNet layers only
    # and one of MoE layers make a hybrid MoE
    assert versions.family(["hybrid", "moe"]) == "hybrid_moe" and versions.family(["dense", "dense"]) == "dense"


def _trained(name: str) -> tuple[Qwen3Model, torch.optim.Optimizer]:
    """A model after one AdamW step: every optimizer state present and none equal to another's rows."""
    model = build(name)
    randomize(model, SEED + 7)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ids, mtp = inputs(model)
    out = model(ids, mtp_input=mtp) if mtp is not None else model(ids)
    sum(o.square().sum() for o in (out if isinstance(out, tuple) else (out,))).backward()
    optimizer.step()
    return model, optimizer


def _write_old_layout(model: Qwen3Model, optimizer: torch.optim.Optimizer, root: Path, version: int = 1) -> Path:
    """Checkpoint ``model`` as this code wrote it at layout ``version`` (before the regrouping: the Gated
    DeltaNet's rows in the HF order, by the conversion's inverse, for weights and optimizer states; meta.json
    marked as that layout, as a user marks such a checkpoint, which records none), leaving ``model`` and
    ``optimizer`` as they were."""
    fam = versions.family(dict(model.named_parameters()))
    undo = versions.INVERSES[(fam, version)]
    changed = {name: p for name, p in model.named_parameters() if versions.CHANGES[0].applies(name)}
    assert changed  # conv1d in both layouts, Qwen3.5's in_proj_qkv too
    kept = {}
    with torch.no_grad():
        for name, param in changed.items():
            tensors = [param] + [t for t in optimizer.state[param].values() if t.shape == param.shape]
            kept[name] = [t.clone() for t in tensors]
            for t in tensors:
                t.copy_(undo(model.config, name, t))
    path = save(model, optimizer, root)
    with torch.no_grad():
        for name, param in changed.items():
            tensors = [param] + [t for t in optimizer.state[param].values() if t.shape == param.shape]
            for t, original in zip(tensors, kept[name]):
                t.copy_(original)
    meta = json.loads((path / META_FILE).read_text())
    meta[versions.LAYOUT_KEY] = {"family": fam, "version": version}
    (path / META_FILE).write_text(json.dumps(meta))
    return path


@pytest.mark.parametrize("name", ["hybrid", "hybrid_moe"])
def test_old_layout_hybrid_checkpoint_resumes_converted(name, tmp_path, world_of_one, caplog, monkeypatch):
    model, optimizer = _trained(name)
    _write_old_layout(model, optimizer, tmp_path / "old")
    want = logits(model)["logits"]
    with monkeypatch.context() as patch:  # read as before the conversion existed: other logits
        patch.setattr(manager, "conversion", lambda meta, names, path: versions.Conversion(name, 2, [], None))
        scrambled, _ = load(name, tmp_path / "old")
    diff = (logits(scrambled)["logits"] - want).abs().max().item()
    print(f"\n[{name}] old layout read unconverted: logits off by {diff:.3g} (scale {want.abs().max():.3g})")
    assert not close(logits(scrambled)["logits"], want)
    with caplog.at_level("INFO", logger="qwen3_pretrain.checkpoint"):
        loaded, loaded_opt = load(name, tmp_path / "old")
    assert f"from {name} tensor layout 1 to 2" in caplog.text
    assert close(logits(loaded)["logits"], want)
    for (pname, param), (_, again) in zip(model.named_parameters(), loaded.named_parameters()):
        assert torch.equal(param, again), pname
        for key, value in optimizer.state[param].items():
            assert torch.equal(loaded_opt.state[again][key], value), (pname, key)


@pytest.mark.parametrize("name", ["hybrid", "hybrid_moe"])
def test_old_layout_hybrid_checkpoint_merges_converted(name, tmp_path, world_of_one):
    model, optimizer = _trained(name)
    _write_old_layout(model, optimizer, tmp_path / "old")
    merge_checkpoint(tmp_path / "old", tmp_path / "hf", "tiny", dtype=torch.float32, progress=False)
    merged = load_hf_model(tmp_path / "hf", mtp=model.mtp is not None)
    assert close(logits(merged)["logits"], logits(model)["logits"])


@pytest.mark.parametrize("name", ["hybrid", "hybrid_moe"])
def test_an_unrecorded_hybrid_checkpoint_is_read_as_the_layout_written_last(name, tmp_path, world_of_one, caplog):
    """A hybrid checkpoint from before layouts were recorded was most likely written in layout 2 (the
    regrouped rows, 54ac416 until the record began): read unconverted, with a warning saying how to mark a
    layout-1 one. Converting it as layout 1 would scramble its Gated DeltaNet rows."""
    model, optimizer = _trained(name)
    path = save(model, optimizer, tmp_path / "run")
    meta = json.loads((path / META_FILE).read_text())
    del meta[versions.LAYOUT_KEY]
    (path / META_FILE).write_text(json.dumps(meta))
    with caplog.at_level("INFO", logger="qwen3_pretrain.checkpoint"):
        loaded, _ = load(name, tmp_path / "run")
    assert "records no tensor_layout" in caplog.text and "converting" not in caplog.text
    for (pname, param), (_, again) in zip(model.named_parameters(), loaded.named_parameters()):
        assert torch.equal(param, again), pname


def _with_layout(src: Path, dst: Path, record) -> Path:
    shutil.copytree(src, dst)
    meta_path = dst / step_dir_name(0) / META_FILE
    meta = json.loads(meta_path.read_text())
    meta[versions.LAYOUT_KEY] = record
    meta_path.write_text(json.dumps(meta))
    return dst


def test_a_newer_layout_is_refused_naming_both_versions(tmp_path, world_of_one, capsys):
    root = _with_layout(GOLDEN / "hybrid", tmp_path / "run", {"family": "hybrid", "version": 99})
    with pytest.raises(UserError, match=r"hybrid tensor layout is version 99.*reads \(version 2\)"):
        load("hybrid", root, optimizer=False)
    code = run_command("qwen3_pretrain.checkpoint.merge:main", ["--no_progress", "--model_name", "tiny",
                       "--input_path", str(root), "--output_path", str(tmp_path / "hf")])
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err, err
    assert "version 99" in err and "version 2" in err and not (tmp_path / "hf").exists()


def test_a_layout_without_conversion_is_refused(tmp_path, world_of_one, monkeypatch):
    monkeypatch.setitem(versions.LAYOUT_VERSIONS, "dense", 2)  # a bump with no conversion added
    with pytest.raises(UserError, match=r"dense tensor layout is version 1, this qwen3-pretrain's is version 2"):
        load("dense", GOLDEN / "dense", optimizer=False)


def test_a_layout_record_of_another_family_is_refused(tmp_path, world_of_one):
    root = _with_layout(GOLDEN / "dense", tmp_path / "run", {"family": "hybrid", "version": 2})
    with pytest.raises(UserError, match="names family 'hybrid', but the checkpoint's tensors are a dense"):
        load("dense", root, optimizer=False)


def test_every_save_records_the_families_version(tmp_path, world_of_one):
    for name in ("dense", "hybrid_moe"):
        model = build(name)
        path = save(model, torch.optim.AdamW(model.parameters()), tmp_path / name)
        meta = json.loads((path / META_FILE).read_text())
        assert meta[versions.LAYOUT_KEY] == {"family": name, "version": versions.LAYOUT_VERSIONS[name]}
        assert meta["format_version"] == versions.FORMAT_VERSION


# A hybrid the trainer runs in a few seconds: 2 key heads, so tp 2 splits the Gated DeltaNet's rows by heads.
TRAIN_HYBRID = dict(vocab_size=512, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, head_dim=8, linear_num_key_heads=2, linear_num_value_heads=4,
                    linear_key_head_dim=8, linear_value_head_dim=8, linear_conv_kernel_dim=4,
                    layer_types=["linear_attention", "full_attention"], partial_rotary_factor=0.25,
                    model_type="qwen3_5_text", tie_word_embeddings=True, max_position_embeddings=256,
                    bos_token_id=0, eos_token_id=1)


def _old_layout_copy(checkpoint: Path, root: Path, scratch: Path) -> None:
    """``checkpoint`` (a trainer's, today's layout) rewritten as layout 1 into output_path ``root``: every
    regrouped weight and optimizer state put back in the HF rows' order, DCP files rewritten with torch's own
    converters, meta.json marked as layout 1, the random states copied."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save, torch_save_to_dcp

    meta = json.loads((checkpoint / META_FILE).read_text())
    config = Qwen3Config.from_hf_dict(meta["model_config"])
    meta[versions.LAYOUT_KEY] = dict(meta[versions.LAYOUT_KEY], version=1)
    dcp_to_torch_save(checkpoint, scratch / "state.pt")
    state = torch.load(scratch / "state.pt", weights_only=False)
    for part, entries in state.items():
        for key, value in entries.items():
            name = key if part == "model" else key.partition(".")[2].rpartition(".")[0]
            if (isinstance(value, torch.Tensor) and versions.CHANGES[0].applies(name)
                    and value.shape == state["model"][name].shape):
                entries[key] = versions.INVERSES[("hybrid", 1)](config, name, value)
    torch.save(state, scratch / "old.pt")
    target = root / checkpoint.name
    torch_save_to_dcp(scratch / "old.pt", target)
    (target / META_FILE).write_text(json.dumps(meta))
    shutil.copytree(checkpoint / "rng", target / "rng")
    (root / "latest").write_text(checkpoint.name + "\n")


@pytest.mark.distributed
def test_old_layout_hybrid_checkpoint_resumes_under_tp_and_dp_as_the_current_one(tmp_path):
    """The trainer's resume under tp 2 (the regrouped rows split by heads over the ranks: DTensor shards of the
    weights and of AdamW's states) and under dp 2 (FSDP's row shards) from a layout-1 checkpoint continues
    exactly as from the same checkpoint in today's layout."""
    from qwen3_pretrain.models.qwen3.hf_io import save_hf_model
    from tests._checkpoint_helpers import resume_from
    from tests._train_helpers import check_ok, make_corpus, run_train, step_records, write_config

    init = Qwen3Model(Qwen3Config(**TRAIN_HYBRID))
    randomize(init, SEED)
    save_hf_model(init, tmp_path / "init", dtype=torch.float32)
    config = write_config(tmp_path / "c.yaml", make_corpus(tmp_path / "corpus"), tmp_path / "first",
                          model_name="tiny-hybrid", model_path=str(tmp_path / "init"), model_overrides={},
                          document_mask=True, total_steps=2, save_steps=2)
    check_ok(run_train(config, 1))
    resume_from(tmp_path / "first", 2, tmp_path / "new")
    (tmp_path / "scratch").mkdir()
    _old_layout_copy(tmp_path / "first" / step_dir_name(2), tmp_path / "old", tmp_path / "scratch")
    for layout in (["tp=2"], []):  # tp 2; dp 2, the weights and states sharded by FSDP
        records = {}
        for out in ("new", "old"):
            run = tmp_path / f"{out}-{'-'.join(layout) or 'dp=2'}"
            shutil.copytree(tmp_path / out, run)
            check_ok(run_train(config, 2, *layout, f"output_path={run}", "total_steps=4"))
            records[out] = [(r["step"], r["loss"], r["grad_norm"]) for r in step_records(run)]
        assert [r[0] for r in records["old"]] == [3, 4], layout
        assert records["old"] == records["new"], layout


@pytest.mark.distributed
def test_resuming_a_newer_layout_stops_the_trainer_with_one_line(tmp_path):
    """``qwen3-pretrain train`` resuming a checkpoint of a layout newer than it reads: exit 2, the message
    naming both versions, no traceback, and no step taken."""
    from tests._train_helpers import check_ok, make_corpus, run_train, write_config

    config = write_config(tmp_path / "c.yaml", make_corpus(tmp_path / "corpus"), tmp_path / "out",
                          total_steps=1, save_steps=1)
    check_ok(run_train(config, 1))
    meta_path = tmp_path / "out" / step_dir_name(1) / META_FILE
    meta = json.loads(meta_path.read_text())
    assert meta[versions.LAYOUT_KEY] == {"family": "dense", "version": 1}
    meta_path.write_text(json.dumps(dict(meta, **{versions.LAYOUT_KEY: {"family": "dense", "version": 7}})))
    proc = run_train(config, 1, "total_steps=2")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert "its dense tensor layout is version 7" in proc.stderr and "(version 1)" in proc.stderr
    assert not (tmp_path / "out" / step_dir_name(2)).exists()


if __name__ == "__main__":
    write_goldens()
