"""Random init drawn per tile: any slice of a parameter equals that slice of the whole (so every layout
starts from the one-process model's weights, each rank drawing about its own share), the whole equals an
independent tile-by-tile reference, and the values have the intended distribution."""

from __future__ import annotations

import math
import threading

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor.debug import _clear_sharding_prop_cache
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
from torch.testing._internal.distributed.fake_pg import FakeStore

from qwen3_pretrain.models.qwen3 import init as init_module
from qwen3_pretrain.models.qwen3.config import Qwen3Config, get_preset
from qwen3_pretrain.models.qwen3.init import init_param
from qwen3_pretrain.models.qwen3.model import Qwen3Model
from qwen3_pretrain.parallel import parallelize
from qwen3_pretrain.parallel.dims import ParallelDims, stage_layer_ranges
from qwen3_pretrain.parallel.parallelize import PartSpec, build_stage, materialize, parallelize_stage
from qwen3_pretrain.train.model_source import ModelSource

DENSE = dict(vocab_size=512, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, tie_word_embeddings=False)
# Qwen3.5-MoE-shaped: Gated DeltaNet (A_log, dt_bias, convolution, gated norm), zero-centred norms, experts
# and a shared expert
HYBRID_MOE = dict(model_type="qwen3_5_moe_text", vocab_size=512, hidden_size=64, num_hidden_layers=4,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=16, linear_num_key_heads=2,
                  linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16, tie_word_embeddings=True,
                  layer_types=["linear_attention", "full_attention"] * 2, partial_rotary_factor=0.25, num_experts=4,
                  num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48)


def first_seed(seed: int, name: str) -> int:
    """The seed of a parameter's first tile, the rule written out here so that a silent change to it fails:
    a 64-bit FNV-1a-style hash of the name's UTF-8 bytes (FNV's prime 0x100000001b3; the offset basis is
    1469598103934665603, one digit short of FNV-1a's 14695981039346656037, kept since the weights a seed gives
    depend on it), plus seed * 1,000,003, mod 2**64; then its high and low 32-bit halves xor-ed."""
    value = 1469598103934665603
    for byte in name.encode("utf-8"):
        value = ((value ^ byte) * 0x100000001B3) & 0xFFFFFFFFFFFFFFFF
    value = (value + seed * 1_000_003) & 0xFFFFFFFFFFFFFFFF
    return (value >> 32) ^ (value & 0xFFFFFFFF)


def test_the_first_seed_of_a_parameter_is_pinned():
    assert first_seed(0, "embed_tokens.weight") == 3873163234
    assert first_seed(5, "layers.0.mlp.up_proj.weight") == 469977542


def reference_init(name: str, shape: tuple[int, ...], seed: int, std: float) -> torch.Tensor:
    """The whole normal(0, std) parameter as the scheme defines it, written without init_param's slicing:
    the matrix view [prod(shape[:-1]), shape[-1]] cut into INIT_TILE tiles in row-major order, tile k drawn
    contiguously from a CPU generator seeded with (the parameter's first seed + k) mod 2**32."""
    tile_rows, tile_cols = init_module.INIT_TILE
    rows, cols = math.prod(shape[:-1]), shape[-1]
    first = first_seed(seed, name)
    out = torch.empty(rows, cols)
    k = 0
    for r in range(0, rows, tile_rows):
        for c in range(0, cols, tile_cols):
            tile = out[r:r + tile_rows, c:c + tile_cols]
            gen = torch.Generator().manual_seed((first + k) % 2**32)
            tile.copy_(torch.empty(tile.shape).normal_(0.0, std, generator=gen))
            k += 1
    return out.view(shape)


def random_slices(shape: tuple[int, ...], gen: torch.Generator) -> tuple[slice, ...]:
    out = []
    for n in shape:
        a = int(torch.randint(0, n, (1,), generator=gen))
        out.append(slice(a, int(torch.randint(a + 1, n + 1, (1,), generator=gen))))
    return tuple(out)


@pytest.mark.parametrize("name, shape", [("layers.0.mlp.up_proj.weight", (300, 700)),
                                         ("layers.1.mlp.experts.down_proj", (3, 130, 300)),
                                         ("embed_tokens.weight", (1000, 64))])
def test_whole_parameter_equals_the_tile_by_tile_reference(name, shape):
    cfg = get_preset("qwen3-0.6b")
    std = cfg.initializer_range / (math.sqrt(2 * cfg.num_hidden_layers) if "down_proj" in name else 1)
    assert torch.equal(init_param(name, shape, cfg, 5), reference_init(name, shape, 5, std))


@pytest.mark.parametrize("name, shape", [("layers.0.attn.o_proj.weight", (520, 1100)),
                                         ("layers.2.mlp.experts.gate_proj", (4, 200, 300)),
                                         ("layers.0.linear_attn.conv1d.weight", (400, 1, 4)),
                                         ("layers.0.linear_attn.A_log", (300,))])
def test_any_slice_equals_the_slice_of_the_whole(name, shape):
    """Slices starting and ending inside tiles, on every dim (a middle dim of a 3-D parameter too)."""
    cfg = Qwen3Config(**HYBRID_MOE)
    whole = init_param(name, shape, cfg, 11)
    gen = torch.Generator().manual_seed(0)
    for _ in range(25):
        slices = random_slices(shape, gen)
        assert torch.equal(init_param(name, shape, cfg, 11, slices), whole[slices]), slices


def test_the_distribution_is_the_intended_one():
    """normal(0, initializer_range), the residual projections scaled by 1/sqrt(2 layers); A uniform in
    [1, 16]; the convolution uniform within PyTorch's default bound; a different seed, other values."""
    cfg = get_preset("qwen3-8b")
    up = init_param("layers.0.mlp.up_proj.weight", (1024, 2048), cfg, 0)
    down = init_param("layers.0.mlp.down_proj.weight", (1024, 2048), cfg, 0)
    # 2M samples: the sample std is within 0.2% of the true one, the mean within 6e-5 (4 sigma)
    assert up.std().item() == pytest.approx(0.02, rel=2e-3)
    assert abs(up.mean().item()) < 6e-5
    assert down.std().item() == pytest.approx(0.02 / math.sqrt(2 * 36), rel=2e-3)
    # the tiles are not copies of one another: two neighbouring tiles are uncorrelated
    rows, cols = init_module.INIT_TILE
    a, b = up[:rows, :cols].flatten(), up[:rows, cols:2 * cols].flatten()
    assert abs(torch.corrcoef(torch.stack([a, b]))[0, 1].item()) < 0.02
    a_log = init_param("layers.0.linear_attn.A_log", (65536,), cfg, 0).exp()
    assert 1 <= a_log.min() and a_log.max() <= 16 and a_log.mean().item() == pytest.approx(8.5, rel=0.02)
    conv = init_param("layers.0.linear_attn.conv1d.weight", (4096, 1, 4), cfg, 0)
    assert conv.abs().max() <= 0.5 and conv.std().item() == pytest.approx(0.5 / math.sqrt(3), rel=0.02)
    assert not torch.equal(init_param("layers.0.mlp.up_proj.weight", (64, 64), cfg, 1), up[:64, :64])


def _shards(cfg: Qwen3Config, world: int, rank: int, threads: int, **degrees) -> dict[str, tuple]:
    """Every stage of ``rank`` of a ``world``-rank layout, built as the engine does on a fake process group,
    materialized from random init: name -> (local values, global slices)."""
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    try:
        dims = ParallelDims.resolve(world_size=world, **degrees)
        mesh = dims.build_mesh("cpu")
        pp_rank, pp = mesh.get_local_rank("pp"), dims.pp
        source = ModelSource(cfg, None, "random init").tensor_source(cfg.vocab_size, seed=3)
        shards = {}
        part = build_stage(cfg, PartSpec(pp_rank, pp, stage_layer_ranges(cfg.num_hidden_layers, pp)[pp_rank]),
                           cfg.vocab_size, 64)
        parallelize_stage(part, mesh, dims.dp_mesh(mesh), "fp32",
                          expert_meshes=dims.expert_meshes(mesh) if dims.ep > 1 else None)
        materialize(part, torch.device("cpu"), source, threads=threads)
        for name, param in part.named_parameters():
            if param.to_local().numel() == 0:  # an FSDP rank past the end of a short dim 0
                continue
            shape, offset = compute_local_shape_and_global_offset(param.shape, param.device_mesh, param.placements)
            slices = tuple(slice(o, o + n) for o, n in zip(offset, shape))
            shards[name] = (param.to_local().detach().clone(), slices)
        return shards
    finally:
        dist.destroy_process_group()
        _clear_sharding_prop_cache()  # its cached decisions name this world's meshes, whose groups are gone


@pytest.mark.parametrize("model, world, degrees", [
    ("dense", 4, dict(tp=2)),  # tp 2 x dp 2: row- and column-parallel slices, then FSDP's rows
    ("dense", 4, dict(pp=2)),  # pp 2 x dp 2
    ("dense", 8, dict(tp=2, pp=2)),
    ("hybrid-moe", 4, dict(ep=2)),  # experts over ep 2, FSDP over the rest
    ("hybrid-moe", 4, dict(tp=2)),  # Gated DeltaNet's heads split over tp
])
def test_every_rank_holds_the_one_process_values(model, world, degrees, monkeypatch):
    """Each rank's shards, materialized in chunks on two threads, equal the same slices of the eager
    one-process model (``init_weights``). Small tiles and chunks, so that the slices cut through them."""
    monkeypatch.setattr(init_module, "INIT_TILE", (8, 16))
    monkeypatch.setattr(parallelize, "INIT_TILE", (8, 16))
    monkeypatch.setattr(parallelize, "_CHUNK_ELEMENTS", 2000)
    cfg = Qwen3Config(**(DENSE if model == "dense" else HYBRID_MOE))
    one = Qwen3Model(cfg)
    one.init_weights(3)
    want = dict(one.named_parameters())
    seen = set()
    for rank in range(world):
        for name, (local, slices) in _shards(cfg, world, rank, threads=2, **degrees).items():
            assert torch.equal(local, want[name].detach()[slices]), (rank, name, slices)
            seen.add(name)
    assert seen == set(want)


def test_progress_counts_every_element_once():
    cfg = Qwen3Config(**DENSE)
    with torch.device("meta"):
        model = Qwen3Model(cfg)
    calls = []
    materialize(model, torch.device("cpu"), lambda name, shape, slices: init_param(name, shape, cfg, 0, slices),
                threads=2, progress=lambda done, total: calls.append((done, total)))
    total = sum(p.numel() for p in model.parameters())
    assert calls[-1] == (total, total)
    assert all(a[0] < b[0] for a, b in zip(calls, calls[1:]))


def test_each_materializing_thread_works_on_the_ranks_device(monkeypatch):
    """A fresh thread's current device is device 0: each thread of materialize makes the rank's its own
    (a meta device numbered 1 stands in for an accelerator; the call is recorded, not made)."""
    cfg = Qwen3Config(**DENSE)
    with torch.device("meta"):
        model = Qwen3Model(cfg)
    calls = []
    monkeypatch.setattr(torch.accelerator, "set_device_index",
                        lambda index: calls.append((threading.current_thread().name, index)))
    materialize(model, torch.device("meta", 1), lambda name, shape, slices: init_param(name, shape, cfg, 0, slices),
                threads=2)
    assert calls and {index for _, index in calls} == {1}  # one call per thread the pool started
    assert all(name != threading.main_thread().name for name, _ in calls)


def test_the_trainer_says_how_far_materializing_is(caplog):
    """Every few seconds (here: every call), not once finished (the phase's 'done in' says that)."""
    from qwen3_pretrain.train.trainer import _progress_logger

    progress = _progress_logger("materializing this rank's parameters", every_s=0.0)
    with caplog.at_level("INFO", logger="qwen3_pretrain.train"):
        progress(380_000_000, 1_020_000_000)
        progress(1_020_000_000, 1_020_000_000)
    assert [r.getMessage() for r in caplog.records] == ["materializing this rank's parameters: 37% (0.38 of 1.02 B)"]


def test_a_hf_directory_is_read_in_chunks_on_several_threads(tmp_path, monkeypatch):
    """The same path with the files' values: each chunk reads its rows, from four threads at once (the
    reader opens its files on first use, possibly in two threads at the same time)."""
    from qwen3_pretrain import save_hf_model
    from qwen3_pretrain.models.qwen3.hf_io import HFCheckpointReader

    monkeypatch.setattr(parallelize, "_CHUNK_ELEMENTS", 1000)
    # untied: to_empty from the meta device unties a plain head (the engine's tied head has no weight of its own)
    cfg = Qwen3Config(**dict(HYBRID_MOE, tie_word_embeddings=False))
    saved = Qwen3Model(cfg)
    saved.init_weights(9)
    save_hf_model(saved, tmp_path / "hf", dtype=torch.float32, max_shard_size="200KB")
    with torch.device("meta"):
        model = Qwen3Model(cfg)
    reader = HFCheckpointReader(tmp_path / "hf")
    materialize(model, torch.device("cpu"), ModelSource(cfg, reader, "").tensor_source(cfg.vocab_size, 0), threads=4)
    want = dict(saved.named_parameters())
    for name, param in model.named_parameters():
        assert torch.equal(param, want[name]), name
