"""Start-up time of one rank: building its part of the model on the meta device (stage, tp, ep, FSDP) and
materializing its shards from random init, before and after init by tiles.

    python bench/startup.py                      # both models, old init then the tiled one on 1 and 2 threads
    python bench/startup.py --model qwen3-8b --threads 4

Each case plays rank 0 of a layout on torch's fake process group (no other
process exists; nothing is sent) and fills real CPU tensors:

* Qwen3-8B-shaped, tp 4 x pp 2 (8 ranks): rank 0 holds stage 0 (the
  embedding, layers 0-17) split over tp, about 1.1 B parameters;
* Qwen3-30B-A3B-shaped, ep 8 x pp 4 (32 ranks, dp 8): rank 0 holds stage 0
  (the embedding, layers 0-11) with 16 of each layer's 128 experts and FSDP's
  eighth of the rest, about 0.95 B parameters (the whole ep 8 rank of the
  48-layer model, 3.8 B fp32 parameters, does not fit this machine's memory
  beside the others' work; start-up scales with the layers a rank holds).

"old" is the init before tiles, kept here only for this comparison: every
parameter drawn whole from one generator, then sliced, one parameter at a
time (what each rank did). "tiled" is ``materialize`` with the package's
``init_param``: each rank draws only the tiles its slices touch, on
``--threads`` threads.
"""

from __future__ import annotations

import argparse
import math
import time
import warnings

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
from torch.testing._internal.distributed.fake_pg import FakeStore

from qwen3_pretrain.models.qwen3.config import Qwen3Config, get_preset
from qwen3_pretrain.models.qwen3.gated_deltanet import GatedDeltaNet, conv_init_bound
from qwen3_pretrain.models.qwen3.init import _stable_hash, is_norm_weight
from qwen3_pretrain.parallel.dims import ParallelDims, stage_layer_ranges
from qwen3_pretrain.parallel.parallelize import PartSpec, build_stage, choose_experts, materialize, parallelize_stage
from qwen3_pretrain.train.model_source import ModelSource

# model -> (world size, degrees): rank 0 of each
LAYOUTS = {"qwen3-8b": (8, dict(tp=4, pp=2)), "qwen3-30b-a3b": (32, dict(pp=4, ep=8))}


def old_init_param(name: str, shape: tuple[int, ...], cfg: Qwen3Config, seed: int) -> torch.Tensor:
    """The init before tiles (for the comparison only): the whole parameter from one generator."""
    if is_norm_weight(name):
        zero = cfg.is_hybrid and not name.endswith("linear_attn.norm.weight")
        return torch.zeros(shape) if zero else torch.ones(shape)
    if name.endswith("dt_bias"):
        return torch.ones(shape)
    gen = torch.Generator().manual_seed((seed * 1_000_003 + _stable_hash(name)) % (2**63))
    if name.endswith("A_log"):
        return GatedDeltaNet.init_a_log(shape[0], gen)
    if name.endswith("conv1d.weight"):
        bound = conv_init_bound(shape[-1])
        return torch.empty(shape).uniform_(-bound, bound, generator=gen)
    std = cfg.initializer_range
    if name.endswith(("o_proj.weight", "down_proj.weight", "experts.down_proj", "out_proj.weight")):
        std /= math.sqrt(2 * cfg.num_hidden_layers)
    return torch.empty(shape).normal_(0.0, std, generator=gen)


@torch.no_grad()
def old_materialize(model: torch.nn.Module, cfg: Qwen3Config, seed: int) -> None:
    """The materialize before tiles: each owned slice cut from the whole parameter, one at a time."""
    model.to_empty(device=torch.device("cpu"))
    for name, param in model.named_parameters():
        local = param.to_local() if isinstance(param, DTensor) else param
        if local.numel() == 0:
            continue
        shape, offset = compute_local_shape_and_global_offset(param.shape, param.device_mesh, param.placements)
        slices = tuple(slice(o, o + n) for o, n in zip(offset, shape))
        local.copy_(old_init_param(name, tuple(param.shape), cfg, seed)[slices])


def build_rank0(cfg: Qwen3Config, world: int, degrees: dict) -> torch.nn.Module:
    """Rank 0's stage as the engine builds it (fp32 master weights, FSDP over dp, experts over ep)."""
    dims = ParallelDims.resolve(world_size=world, **degrees)
    mesh = dims.build_mesh("cpu")
    layers = stage_layer_ranges(cfg.num_hidden_layers, dims.pp)[0]
    part = build_stage(cfg, PartSpec(0, dims.pp, layers), cfg.vocab_size, 4096,
                       experts=choose_experts("cpu", "bf16") if cfg.is_moe else None)
    parallelize_stage(part, mesh, dims.dp_mesh(mesh), "bf16",
                      expert_meshes=dims.expert_meshes(mesh) if dims.ep > 1 else None)
    return part


def run_case(model: str, how: str, threads: int) -> dict:
    world, degrees = LAYOUTS[model]
    cfg = get_preset(model)
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    try:
        start = time.perf_counter()
        part = build_rank0(cfg, world, degrees)
        built = time.perf_counter()
        if how == "old":
            old_materialize(part, cfg, seed=0)
        else:
            materialize(part, torch.device("cpu"), ModelSource(cfg, None, "").tensor_source(cfg.vocab_size, 0),
                        threads=threads)
        done = time.perf_counter()
        numel = sum(p.to_local().numel() for p in part.parameters())
        del part
    finally:
        dist.destroy_process_group()
    return {"model": model, "init": how, "threads": threads if how != "old" else 1, "params_b": numel / 1e9,
            "build_s": built - start, "materialize_s": done - built}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=sorted(LAYOUTS), action="append", help="default: both")
    parser.add_argument("--threads", type=int, action="append", help="threads of the tiled init (default: 1, 2)")
    parser.add_argument("--skip-old", action="store_true", help="only the tiled init")
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    print(f"torch {torch.__version__}, {torch.get_num_threads()} intra-op thread(s)")
    print(f"{'model':<15}{'init':<7}{'threads':>8}{'params/rank':>13}{'build s':>9}{'materialize s':>15}")
    for model in args.model or sorted(LAYOUTS):
        cases = ([] if args.skip_old else [("old", 1)]) + [("tiled", t) for t in args.threads or [1, 2]]
        for how, threads in cases:
            r = run_case(model, how, threads)
            print(f"{r['model']:<15}{r['init']:<7}{r['threads']:>8}{r['params_b']:>11.2f} B{r['build_s']:>9.1f}"
                  f"{r['materialize_s']:>15.1f}", flush=True)


if __name__ == "__main__":
    torch.set_num_threads(1)  # one per rank, as under torchrun
    main()
