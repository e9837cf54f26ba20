"""The initial value of every parameter, as a pure function of (name, shape, config, seed) that draws any
block of a parameter on its own: a sharded or pipelined model fills each rank's slice with what the
one-process model holds, each rank drawing about its own share (``parallel/parallelize.py::materialize``)."""

from __future__ import annotations

import math

import torch

from qwen3_pretrain.models.qwen3.config import Qwen3Config
from qwen3_pretrain.models.qwen3.gated_deltanet import GatedDeltaNet, conv_init_bound

# The weights of norms (a scale per channel): initialized to one (zero where zero-centred), never decayed.
_NORM_SUFFIXES = ("norm.weight", "pre_fc_norm_embedding.weight", "pre_fc_norm_hidden.weight")


def is_norm_weight(name: str) -> bool:
    return name.endswith(_NORM_SUFFIXES)


# Random init draws each parameter, seen as a matrix [prod(shape[:-1]), shape[-1]], in tiles of at most this
# many rows x columns, each from a generator of its own, so that a rank draws only the tiles its slice touches:
# few rows for FSDP's thin row slices, 256 columns so that a row-parallel weight's column slice (tp up to 16 of
# a 4096-wide input) is whole tiles.
INIT_TILE = (128, 256)


def init_param(name: str, shape: tuple[int, ...], cfg: Qwen3Config, seed: int,
               slices: tuple[slice, ...] | None = None) -> torch.Tensor:
    """The initial value of parameter ``name`` of (whole) ``shape``, or of its block ``slices`` (one slice
    per dim, no steps): a pure function of (name, shape, config, seed), whatever block is asked for.

    Each tile (``INIT_TILE``) draws from a generator seeded by (seed, name,
    tile index), so a sharded or pipelined model initializes each rank's slice
    to exactly what the single-process model holds, whatever the parallel
    layout, while each rank draws only (about) its own slice. Draws are on the
    CPU, so a run on an accelerator starts from the same weights as on a CPU.
    Norms start at one (a hybrid's zero-centred norms at zero, their scale
    being 1 + weight); matrices are normal(0, initializer_range), with the
    projections that write into the residual stream (o_proj, down_proj, the
    experts' down_proj, Gated DeltaNet's out_proj) scaled down by
    sqrt(2 * num_layers) so the residual's variance does not grow with depth.
    Gated DeltaNet's decay parameters start as Megatron-core's Gated DeltaNet
    does (``A`` uniform in [1, 16], its default ``A_init_range``; ``dt_bias``
    one); the releases' own initialisation is not published. transformers'
    modules draw ``A`` from [0, 16] instead ([0.01, 16] in its later
    versions, away from log 0). We keep Megatron's floor: every head then
    decays by at least ``softplus(a + 1)`` per token at the start, none
    starts near ``A = 0`` (a head that never forgets), and a run from scratch
    starts as a Megatron run of the same model does. Its convolution starts
    as PyTorch's default.
    """
    if not shape:
        return init_param(name, (1,), cfg, seed).reshape(())
    slices = slices if slices is not None else tuple(slice(0, n) for n in shape)
    block = tuple(len(range(n)[s]) for n, s in zip(shape, slices))
    if is_norm_weight(name):  # zero-centred norms (1 + weight) start at 0; the gated norm at 1
        zero = cfg.is_hybrid and not name.endswith("linear_attn.norm.weight")
        return torch.zeros(block) if zero else torch.ones(block)
    if name.endswith("dt_bias"):
        return torch.ones(block)
    if math.prod(block) == 0:
        return torch.empty(block)
    return _draw_tiles(shape, slices, _param_seed(seed, name), _tile_sampler(name, shape, cfg)).reshape(block)


def _tile_sampler(name: str, shape: tuple[int, ...], cfg: Qwen3Config):
    """How parameter ``name`` draws one tile: (tile shape, generator) -> values."""
    if name.endswith("A_log"):
        return lambda size, gen: GatedDeltaNet.init_a_log(math.prod(size), gen).view(size)
    if name.endswith("conv1d.weight"):
        bound = conv_init_bound(shape[-1])
        return lambda size, gen: torch.empty(size).uniform_(-bound, bound, generator=gen)
    std = cfg.initializer_range
    if name.endswith(("o_proj.weight", "down_proj.weight", "experts.down_proj", "out_proj.weight")):
        std /= math.sqrt(2 * cfg.num_hidden_layers)
    return lambda size, gen: torch.empty(size).normal_(0.0, std, generator=gen)


def _draw_tiles(shape: tuple[int, ...], slices: tuple[slice, ...], base_seed: int, sample) -> torch.Tensor:
    """The block ``slices`` of a parameter of ``shape``, drawn tile by tile: the tiles covering the block's
    rows and columns of the matrix view, then cut to the block (flattened to [block rows, block columns])."""
    rows, cols = math.prod(shape[:-1]), shape[-1]
    tile_rows, tile_cols = INIT_TILE
    # the matrix view's rows the block holds, in the block's order
    row_ids = torch.arange(rows).view(shape[:-1])[slices[:-1]].reshape(-1)
    first, last = int(row_ids[0]), int(row_ids[-1])
    c0, c1, _ = slices[-1].indices(cols)
    t0, t1 = first // tile_rows, last // tile_rows + 1
    u0, u1 = c0 // tile_cols, -(-c1 // tile_cols)
    top, left = t0 * tile_rows, u0 * tile_cols
    drawn = torch.empty(min(t1 * tile_rows, rows) - top, min(u1 * tile_cols, cols) - left)
    col_tiles = -(-cols // tile_cols)
    for t in range(t0, t1):
        r = slice(t * tile_rows - top, min((t + 1) * tile_rows, rows) - top)
        for u in range(u0, u1):
            c = slice(u * tile_cols - left, min((u + 1) * tile_cols, cols) - left)
            # tiles of one parameter take consecutive seeds: none of them repeats another
            gen = torch.Generator().manual_seed((base_seed + t * col_tiles + u) % 2**32)
            drawn[r, c] = sample((r.stop - r.start, c.stop - c.start), gen)
    picked = drawn[first - top:last - top + 1] if last - first + 1 == len(row_ids) else drawn[row_ids - top]
    return picked[:, c0 - left:c1 - left]


def _param_seed(seed: int, name: str) -> int:
    """The first tile's seed: 32 bits, all torch's CPU generator keeps of a seed (mt19937's). The tiles of
    one parameter never share a seed; two parameters' runs of seeds may overlap, repeating tiles between
    them: about tiles^2 / 2^33 repeated tiles in a model (7 of Qwen3-8B's 250,000, about 100 of a 30B
    model's), as many as with a hash per tile. Harmless to training (a repeated tile sits elsewhere in
    another matrix, so it gets other gradients)."""
    value = (seed * 1_000_003 + _stable_hash(name)) % 2**64
    return (value ^ (value >> 32)) % 2**32


def _stable_hash(text: str) -> int:
    """A hash that is the same in every process (Python's ``hash`` is salted per process). FNV-1a's prime,
    but an offset basis one digit short of FNV-1a's (14695981039346656037): not FNV-1a, and kept so, since
    the weights every seed gives depend on it."""
    value = 1469598103934665603
    for byte in text.encode():
        value = ((value ^ byte) * 1099511628211) % (2**64)
    return value
