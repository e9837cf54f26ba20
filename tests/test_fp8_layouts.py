"""FP8 (torchao's recipes, emulated on the CPU: ``fp8_emulate``) on every parallel layout equals one FP8
process, per step, on the same data and initial weights.

Every run trains 2 steps of a global batch of 4 one-sample micro-batches (each rank's micro-batch is one
sample, as each of the one process's is), so the FP8 casts see the same tensors in every layout: an
activation's tensorwise scale is its micro-batch's, a weight's is the whole weight's (torchao reduces the
maximum over the tp ranks of a DTensor; FSDP's FP8 all-gather casts the shards with the scale the engine
precomputes over the whole weight after each step). What differs is only the order of fp32 sums.

Why the tolerances are what they are (measured on an Intel Xeon, tensorwise, learning rate 3e-3; the
whole file takes about 3.5 minutes on 2 loaded cores, eight training launches):

- Step 1 (the same weights everywhere): dp 2 with FP8 all-gather, HSDP, pp 2 equal one process to the last
  digit; tp 2 within 1.2e-5 in the gradient norm (sums over the tp ranks in another order). Bound: 1e-5 in
  the loss, 1e-4 in the gradient norm. A missing or doubled gradient reduction moves the gradient norm by
  0.3 or more (tests/test_train_equivalence.py's probes); a cast with another scale than one process's
  moves it by about 5e-4 already at step 1 (cp 2 below), 5x the bound.
- Step 2: the first update already differs where an fp32 sum-order difference tipped an FP8 rounding (one
  e4m3 step is 1/8 relative, one e5m2 step of a gradient 1/4; Adam's first step moves every weight by about
  the learning rate whatever the gradient's size): measured 4e-3 in the gradient norm and 5e-6 in the loss
  under tp 2, equal under the others. Bound: 1e-4 in the loss, 2e-2 in the gradient norm (FP8 against fp32
  differs by 6e-3 there).
- cp 2 casts each rank's half of a sequence with that half's scale, so it is another draw of FP8's rounding
  from step 1: measured 1.7e-4 in the loss and 5e-4 in the gradient norm at step 1 (FP8 against fp32:
  8e-5 and 4e-3), 2.4e-2 in the gradient norm at step 2. Bound: 1e-3 in the loss, 5e-2 in the gradient norm,
  still 6x below a missing reduction.
"""

from __future__ import annotations

import functools

import pytest
import torch

pytest.importorskip("torchao", reason="FP8 needs torchao (pip install 'qwen3-pretrain[fp8]')")

from tests._train_helpers import (  # noqa: E402
    TINY_MODEL, check_ok, make_corpus, run_train, step_records, worst_relative_diff, write_config)

FP8 = ["fp8=tensorwise", "fp8_emulate=true", "batch_size=1"]
MOE_MODEL = dict(TINY_MODEL, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True)

# name -> (processes, model, overrides): a global batch of 4 one-sample micro-batches each
RUNS = {
    "single": (1, "dense", ["gradient_accumulation_steps=4"]),
    "fsdp2-fp8-all-gather": (2, "dense", ["gradient_accumulation_steps=2", "fp8_all_gather=true"]),
    # 2 replicas of 2 shards, weights gathered in FP8 once per step and kept (Megatron's accumulation)
    "hsdp-fp8-all-gather-kept": (4, "dense", ["dp_shard=2", "fp8_all_gather=true", "keep_params_gathered=true"]),
    "tp2-recompute": (2, "dense", ["tp=2", "gradient_accumulation_steps=4", "activation_checkpointing=full"]),
    "pp2": (2, "dense", ["pp=2", "gradient_accumulation_steps=4"]),
    "cp2": (2, "dense", ["cp=2", "gradient_accumulation_steps=4"]),
    # the balancing loss off: its figures depend on how a micro-batch's tokens group over ranks
    "moe-single": (1, "moe", ["gradient_accumulation_steps=4", "moe_aux_loss=none"]),
    "moe-ep2": (2, "moe", ["ep=2", "gradient_accumulation_steps=2", "moe_aux_loss=none"]),
}

STEP1 = (1e-5, 1e-4)  # (loss, gradient norm), relative
LATER = (1e-4, 2e-2)
OTHER_SCALES = (1e-3, 5e-2)  # cp: each rank's activations cast with its own scale


class Fp8Runs:
    def __init__(self, root) -> None:
        self.root = root
        self.corpus = make_corpus(root / "corpus")
        self.logs: dict[str, str] = {}

    @functools.cache
    def records(self, name: str) -> list[dict]:
        nproc, model, overrides = RUNS[name]
        out = self.root / name
        # the preset's seeded initialization, the same values whatever the layout
        cfg = write_config(self.root / f"{name}.yaml", self.corpus, out, total_steps=2,
                           model_overrides=MOE_MODEL if model == "moe" else dict(TINY_MODEL))
        proc = run_train(cfg, nproc, *FP8, *overrides, timeout=600)
        check_ok(proc)
        self.logs[name] = proc.stdout + proc.stderr
        return step_records(out)


@pytest.fixture(scope="module")
def fp8_runs(tmp_path_factory):
    return Fp8Runs(tmp_path_factory.mktemp("fp8_runs"))


def assert_close_per_step(got: list[dict], want: list[dict], first: tuple[float, float], later: tuple[float, float],
                          label: str) -> None:
    assert [r["step"] for r in got] == [r["step"] for r in want] == [1, 2], label
    for key, i in (("loss", 0), ("grad_norm", 1)):
        for step, bound in ((0, first[i]), (1, later[i])):
            diff = worst_relative_diff([got[step][key]], [want[step][key]])
            print(f"{label}: step {step + 1} relative {key} diff {diff:.2e} (bound {bound:.0e})")
            assert diff <= bound, f"{label}: step {step + 1} {key} {got[step][key]} vs {want[step][key]}"


@pytest.mark.distributed
@pytest.mark.parametrize("name", ["fsdp2-fp8-all-gather", "hsdp-fp8-all-gather-kept", "tp2-recompute", "pp2"])
def test_layout_equals_one_fp8_process(name, fp8_runs):
    assert_close_per_step(fp8_runs.records(name), fp8_runs.records("single"), STEP1, LATER, name)


@pytest.mark.distributed
def test_context_parallel_equals_one_fp8_process(fp8_runs):
    assert_close_per_step(fp8_runs.records("cp2"), fp8_runs.records("single"), OTHER_SCALES, OTHER_SCALES, "cp2")


@pytest.mark.distributed
def test_expert_parallel_equals_one_fp8_process(fp8_runs):
    """A MoE model: the attention projections and the experts' grouped matmuls (rowwise, emulated) in FP8,
    the experts split over 2 ranks."""
    assert_close_per_step(fp8_runs.records("moe-ep2"), fp8_runs.records("moe-single"), STEP1, LATER, "ep2")
    for name in ("moe-ep2", "moe-single"):
        assert "experts: fp8_rowwise_grouped_mm (emulated)" in fp8_runs.logs[name], name


def _fp8_stage(recipe: str):
    from qwen3_pretrain.models.ops.fp8 import Fp8Projections
    from qwen3_pretrain.models.qwen3.config import Qwen3Config
    from qwen3_pretrain.parallel.parallelize import PartSpec, build_stage

    cfg = Qwen3Config(**{**TINY_MODEL, "num_hidden_layers": 1})
    return build_stage(cfg, PartSpec(0, 1, range(1)), cfg.vocab_size, 64, fp8=Fp8Projections(recipe, emulate=True))


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_tensor_parallel_styles_follow_the_recipe(recipe):
    """On an accelerator mesh tensorwise projections take torchao's FP8 styles (same layouts); the row-wise
    recipes, and every recipe on a CPU mesh (gloo cannot move FP8 tensors), keep the plain ones."""
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel
    from torchao.float8.float8_tensor_parallel import Float8ColwiseParallel, Float8RowwiseParallel

    from qwen3_pretrain.parallel.fp8 import float8_tensor_parallel_plan

    model = _fp8_stage(recipe)
    plan = {"layers.0.attn.q_proj": ColwiseParallel(), "layers.0.mlp.down_proj": RowwiseParallel(output_layouts=Shard(1))}
    assert float8_tensor_parallel_plan(model, plan, "cpu") == plan
    got = float8_tensor_parallel_plan(model, plan, "cuda")
    if recipe != "tensorwise":
        assert got == plan
        return
    colwise, rowwise = got["layers.0.attn.q_proj"], got["layers.0.mlp.down_proj"]
    assert type(colwise) is Float8ColwiseParallel and type(rowwise) is Float8RowwiseParallel
    assert rowwise.output_layouts == (Shard(1),) and rowwise.use_local_output


def test_mxfp8_refuses_a_micro_batch_of_partial_blocks():
    from qwen3_pretrain.errors import ConfigError
    from qwen3_pretrain.parallel.fp8 import check_fp8_layout

    check_fp8_layout("mxfp8", 1, 64, 2)  # 32 tokens a rank
    check_fp8_layout("rowwise", 1, 48, 1)
    with pytest.raises(ConfigError, match=r"fp8 mxfp8: .* 24 tokens .*cp 2"):
        check_fp8_layout("mxfp8", 1, 48, 2)


def test_a_model_without_fp8_keeps_its_plan():
    """Without FP8 projections the plan passes through (no torchao import needed for it)."""
    from torch.distributed.tensor.parallel import ColwiseParallel

    from qwen3_pretrain.parallel.fp8 import float8_tensor_parallel_plan

    model = torch.nn.Module()
    model.proj = torch.nn.Linear(16, 16)
    plan = {"proj": ColwiseParallel()}
    assert float8_tensor_parallel_plan(model, plan, "cuda") == plan


def _tp_worker(rank: int, port: int, recipe: str, out_dir: str) -> None:
    import os

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    from qwen3_pretrain.parallel.fp8 import float8_tensor_parallel_plan

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    model, x = _tp_pair(recipe)
    plan = float8_tensor_parallel_plan(model, {"up": ColwiseParallel(), "down": RowwiseParallel()}, "cpu")
    parallelize_module(model, mesh, plan)
    y = model.down(model.up(x).relu())
    y.pow(2).sum().backward()
    from torch.distributed._functional_collectives import AsyncCollectiveTensor

    results = [y.detach(), *(m.weight.grad.full_tensor() for m in (model.up, model.down))]
    results = [t.wait() if isinstance(t, AsyncCollectiveTensor) else t for t in results]  # plain tensors to save
    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    dist.barrier()
    dist.destroy_process_group()
    os._exit(0)


def _tp_pair(recipe: str):
    """Two FP8 projections 64 -> 128 -> 64 (column- then row-parallel under tp) and 32 tokens, seeded."""
    from qwen3_pretrain.models.ops.fp8 import Fp8Projections

    torch.manual_seed(0)
    make = Fp8Projections(recipe, emulate=True)("layers.0.mlp.up_proj")
    model = torch.nn.Module()
    model.up, model.down = make(64, 128, bias=False), make(128, 64, bias=False)
    x = torch.randn(32, 64, generator=torch.Generator().manual_seed(1)) * torch.logspace(-1, 1, 64)
    return model, x


@pytest.mark.distributed
@pytest.mark.parametrize("recipe", ["rowwise", "mxfp8"])
def test_tensor_parallel_projections_cast_as_the_whole_ones(recipe, tmp_path):
    """Column- then row-parallel FP8 projections (the plain styles these recipes keep) over 2 gloo ranks equal
    the unsplit pair: the row-parallel projection's input is split along its contraction, yet its scales (per
    row, per block of 32) are computed over the whole rows (torchao's rules on the DTensor shards), so the
    casts are the same; a scale from a rank's half of a row would move the output by FP8's rounding, percents.
    Measured: equal, or within 5e-8 relative. (tensorwise: the tp2 training run above.)"""
    import torch.multiprocessing as mp

    from tests._train_helpers import free_port

    port = free_port()
    procs = [mp.get_context("spawn").Process(target=_tp_worker, args=(r, port, recipe, str(tmp_path))) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=120)
        if p.is_alive():
            p.kill()
    assert all(p.exitcode == 0 for p in procs), [p.exitcode for p in procs]
    model, x = _tp_pair(recipe)
    y = model.down(model.up(x).relu())
    y.pow(2).sum().backward()
    want = (y.detach(), model.up.weight.grad, model.down.weight.grad)
    for rank in range(2):
        for got, ref in zip(torch.load(tmp_path / f"rank{rank}.pt"), want):
            torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item())
