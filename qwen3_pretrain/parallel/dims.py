"""Parallel degrees, their validation against the model and the world, and the device mesh.

The mesh has five axes, outermost first: ``pp`` (pipeline stages), then the
data-parallel ranks split into ``dp_replicate`` x ``dp_shard``, then ``cp``
(context parallelism: ranks that split each sequence, parallel/context_parallel.py),
then ``tp`` innermost so tensor-parallel peers, which talk every layer, sit on the
same node, with the cp peers, which gather keys and values every layer, next.

The cp ranks hold the same weights and see different tokens, like dp ranks:
FSDP shards over dp_shard x cp (one flattened axis), so their gradients are
summed and their optimizer state sharded with the dp ranks'.

FSDP shards parameters, gradients and optimizer state over the ``dp_shard``
ranks and keeps ``dp_replicate`` copies of those shards (FSDP2's hybrid
sharding, HSDP): weights are gathered and gradients reduce-scattered inside a
shard group, and the shards' gradients all-reduced across the replicas. By
default every dp rank shards with the distributed optimizer (one group) and
every dp rank holds a full replica without it; ``dp_shard`` between the two,
e.g. the dp ranks of one node, keeps the per-layer traffic on the node's links
and sends only one all-reduce of the gradient shards across nodes.

Expert parallelism (``ep``) is not an axis of its own: it borrows ranks of
``dp_shard`` x ``cp`` x ``tp``, which see different tokens (under tp a MoE
layer then runs on each tp rank's share of the sequence instead of all of it),
so the ``ep`` ranks of a group can hold different experts and send each other
the tokens routed to them. That flattened axis unfolds into ``efsdp`` x ``ep``
(``expert_meshes``): a MoE layer's experts are split over ``ep`` and each
rank's share is sharded by FSDP over ``efsdp`` (with ``dp_replicate`` copies
under HSDP), while the rest of the model shards over ``dp_shard`` x ``cp``
and splits over ``tp`` as before.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from qwen3_pretrain.errors import UserError
from qwen3_pretrain.models.qwen3.config import Qwen3Config

if TYPE_CHECKING:  # torch only where a mesh is built: the planner uses the degrees without it
    from torch.distributed.device_mesh import DeviceMesh

# The mesh's axes, outermost first (the module docstring says why in this order).
AXES = ("pp", "dp_replicate", "dp_shard", "cp", "tp")


@dataclass(frozen=True, kw_only=True)
class ParallelDims:
    """The degrees of every mesh axis, resolved for a world (``resolve`` checks them and fills in the
    data-parallel ones), and the mesh's vocabulary: its shape, a rank's coordinates, its dp rank, its
    pipeline stage."""

    world_size: int
    tp: int = 1
    pp: int = 1
    cp: int = 1
    dp_shard: int = 1  # data-parallel ranks that shard together (FSDP's group, with the cp ranks)
    distributed_optimizer: bool = True
    ep: int = 1  # expert parallelism, borrowed from dp_shard x cp x tp

    @classmethod
    def resolve(cls, *, world_size: int, tp: int = 1, pp: int = 1, cp: int = 1, distributed_optimizer: bool = True,
                dp_shard: int | None = None, ep: int = 1) -> ParallelDims:
        """The degrees of a ``world_size``-rank launch: dp is what tp x pp x cp leave; ``dp_shard`` (the
        config's; None: every dp rank with the distributed optimizer, 1 without) must divide it; ``ep`` must
        divide ``dp_shard`` x cp x tp, the ranks it borrows."""
        if world_size % (tp * pp * cp):
            raise UserError(f"tp x pp x cp = {tp} x {pp} x {cp} = {tp * pp * cp} does not divide the {world_size} "
                            "launched processes; choose tp, pp and cp whose product divides it")
        dp = world_size // (tp * pp * cp)
        if dp_shard is not None and dp % dp_shard:
            raise UserError(f"dp_shard = {dp_shard} does not divide the data-parallel degree dp = {dp} "
                            f"({world_size} processes / (tp {tp} x pp {pp} x cp {cp})); choose a dp_shard that "
                            f"divides {dp}, e.g. the dp ranks of one node")
        if dp_shard is None:
            dp_shard = dp if distributed_optimizer else 1
        lendable = dp_shard * cp * tp
        if ep < 1:
            raise UserError(f"ep must be >= 1 (1: no expert parallelism), got {ep}")
        if lendable % ep:
            if not distributed_optimizer:
                fix = ("; without the distributed optimizer the dp ranks hold replicas and lend nothing: turn "
                       "distributed_optimizer on")
            elif dp_shard < dp:
                fix = f"; under HSDP only the dp_shard {dp_shard} ranks of a replica lend: raise dp_shard"
            else:
                fix = ""
            raise UserError(f"ep = {ep} does not divide dp_shard x cp x tp = {dp_shard} x {cp} x {tp} = {lendable}, "
                            f"the ranks expert parallelism borrows (they see different tokens); choose an ep that "
                            f"divides {lendable}{fix}")
        return cls(world_size=world_size, tp=tp, pp=pp, cp=cp, dp_shard=dp_shard,
                   distributed_optimizer=distributed_optimizer, ep=ep)

    @property
    def dp(self) -> int:
        return self.world_size // (self.tp * self.pp * self.cp)

    @property
    def dp_replicate(self) -> int:
        return self.dp // self.dp_shard

    @property
    def shape(self) -> dict[str, int]:
        """Each axis's size, outermost first."""
        return {"pp": self.pp, "dp_replicate": self.dp_replicate, "dp_shard": self.dp_shard, "cp": self.cp,
                "tp": self.tp}

    def coords(self, rank: int) -> dict[str, int]:
        """The mesh coordinates of ``rank`` (the mesh is row-major over ``AXES``)."""
        out, rest = {}, rank
        for axis in reversed(AXES):
            out[axis] = rest % self.shape[axis]
            rest //= self.shape[axis]
        return {axis: out[axis] for axis in AXES}

    def dp_rank(self, rank: int) -> int:
        """Which of the dp data shards ``rank`` reads (its replica's shard groups in order)."""
        c = self.coords(rank)
        return c["dp_replicate"] * self.dp_shard + c["dp_shard"]

    def is_last_stage_lead(self, rank: int) -> bool:
        """The rank that speaks for the run (logs, metrics): the first rank of the last pipeline stage,
        which holds the loss."""
        c = self.coords(rank)
        return c["pp"] == self.pp - 1 and not any(c[a] for a in AXES if a != "pp")

    def first_rank_of_stages(self) -> list[int]:
        """One rank per pipeline stage: the first of each."""
        per_stage = self.world_size // self.pp
        return [s * per_stage for s in range(self.pp)]

    def dp_mesh(self, mesh: DeviceMesh) -> DeviceMesh:
        """The mesh FSDP shards over: 1-D (shard) when every dp rank shards, else 2-D (replicate, shard); the
        shard axis takes in the cp ranks (without the distributed optimizer, the cp ranks alone shard)."""
        from torch.distributed.device_mesh import DeviceMesh

        replicate = not (self.dp_replicate == 1 and self.distributed_optimizer)
        if self.cp == 1:
            return mesh["dp_replicate", "dp_shard"] if replicate else mesh["dp_shard"]
        # torch deprecates slicing a flattened axis from the root mesh: keep the flattened mesh and join
        # it to the replicate axis
        shard = mesh["dp_shard", "cp"]._flatten("dp_shard_cp")
        return DeviceMesh._concatenate([mesh["dp_replicate"], shard]) if replicate else shard

    @property
    def moe_tokens_split_by_tp(self) -> bool:
        """Whether a MoE layer runs on each tp rank's share of the sequence (ep borrows the tp ranks) rather
        than on the whole sequence, gathered, the same on every tp rank."""
        return self.ep > 1 and self.tp > 1

    def expert_meshes(self, mesh: DeviceMesh) -> tuple[DeviceMesh, DeviceMesh]:
        """(ep mesh, the mesh FSDP shards each rank's experts over) for ep > 1: ``dp_shard`` x ``cp`` x ``tp``
        flattened and unfolded into ``efsdp`` x ``ep``, ep innermost (an ep group is the nearest ranks);
        under HSDP the experts' shards are replicated over ``dp_replicate`` like the rest."""
        from torch.distributed.device_mesh import DeviceMesh

        axes = [a for a, n in (("dp_shard", self.dp_shard), ("cp", self.cp), ("tp", self.tp)) if n > 1]
        if len(axes) > 1:
            lent = mesh[tuple(axes)]._flatten("_".join(axes))
        else:
            lent = mesh[axes[0] if axes else "dp_shard"]
        sparse = lent._unflatten(0, (self.dp_shard * self.cp * self.tp // self.ep, self.ep), ("efsdp", "ep"))
        replicate = not (self.dp_replicate == 1 and self.distributed_optimizer)
        fsdp = DeviceMesh._concatenate([mesh["dp_replicate"], sparse["efsdp"]]) if replicate else sparse["efsdp"]
        return sparse["ep"], fsdp

    @property
    def token_ranks(self) -> int:
        """How many ranks split one micro-batch's tokens between them for a MoE layer: dp x cp, and tp when
        the layer runs on each tp rank's share (``moe_tokens_split_by_tp``)."""
        return self.dp * self.cp * (self.tp if self.moe_tokens_split_by_tp else 1)

    def token_mesh(self, mesh: DeviceMesh) -> DeviceMesh:
        """The ranks of ``token_ranks`` as one axis: a MoE layer counts its experts' tokens over them."""
        if self.moe_tokens_split_by_tp:
            return mesh["dp_replicate", "dp_shard", "cp", "tp"]._flatten("dp_cp_tp")
        return mesh["dp_replicate", "dp_shard", "cp"]._flatten("dp_cp")

    def validate(self, cfg: Qwen3Config, num_stages: int) -> None:
        """The checks against the model: tp splits its heads, the stages its layers, ep its experts."""
        check_model_split(cfg, self.tp, num_stages, self.cp)
        check_expert_split(cfg, self.ep)

    def build_mesh(self, device_type: str) -> DeviceMesh:
        from torch.distributed.device_mesh import init_device_mesh

        return init_device_mesh(device_type, tuple(self.shape.values()), mesh_dim_names=AXES)


def sequence_split_problem(seq_length: int, cp: int, tp: int) -> str | None:
    """Why ``seq_length`` cannot be split over ``cp`` and ``tp`` (None when it can): each cp rank holds two
    equal chunks of every sequence (``2 cp`` chunks), and sequence parallelism splits a rank's share
    (``seq_length / cp`` tokens) evenly over the tp ranks between the layers."""
    if cp > 1 and seq_length % (2 * cp):
        return (f"seq_length {seq_length} is not a multiple of 2 x cp = {2 * cp} (each cp rank holds two equal "
                "chunks of every sequence); choose a seq_length, cp or tp that fits")
    if (seq_length // cp) % tp:
        share = f"seq_length / cp = {seq_length} / {cp} = {seq_length // cp}" if cp > 1 else f"seq_length {seq_length}"
        return (f"{share} is not a multiple of tp = {tp} (sequence parallelism splits each rank's tokens evenly "
                "over the tp ranks); choose a seq_length, cp or tp that fits")
    return None


def unsupported_combination(*, compile: bool, tp: int, cp: int, ep: int, recompute: str,
                            keep_params_gathered: bool, distributed_optimizer: bool) -> str | None:
    """Why the engine refuses these settings together (None when it takes them): the training config raises
    it, the planner leaves such layouts out of its search."""
    if compile and tp > 1 and recompute == "selective":
        return ("compile with tp > 1 and activation_checkpointing selective: torch 2.13 cannot compile the "
                "attention kernel's recompute beside tensor-parallel tensors (docs/training.md); use "
                "activation_checkpointing full, mlp or none, or compile false")
    if compile and cp > 1:
        # Traced, cp's collectives compile without a graph break, and dense and MoE models then train like
        # one eager process, but a hybrid's compiled Gated DeltaNet layers under cp 2 do not (torch 2.13).
        return ("compile with cp > 1: a hybrid model's Gated DeltaNet layers compiled under context parallelism "
                "compute other values than eager ones with torch 2.13 (3e-4 relative in the loss at cp 2; dense "
                "and MoE models agree), so compiling is not offered with cp yet (docs/training.md); set compile "
                "false or cp 1")
    if keep_params_gathered and not distributed_optimizer:
        return ("keep_params_gathered keeps the sharded weights gathered through a step, but distributed_optimizer "
                "is false (the weights are whole replicas): set distributed_optimizer true, or drop "
                "keep_params_gathered")
    return None


def padded_vocab_size(vocab_size: int, tp: int) -> int:
    """The vocabulary padded to a multiple of tp (the padding rows are masked in the loss and stripped on export)."""
    return -(-vocab_size // tp) * tp


def valid_tp_degrees(cfg: Qwen3Config) -> list[int]:
    """tp degrees that split query and key/value heads evenly (no KV-head replication), and a hybrid's Gated
    DeltaNet key heads."""
    return [t for t in range(1, cfg.num_key_value_heads + 1)
            if cfg.num_key_value_heads % t == 0 and cfg.num_attention_heads % t == 0
            and not (cfg.num_linear_layers and cfg.linear_num_key_heads % t)]


def check_expert_split(cfg: Qwen3Config, ep: int) -> None:
    """Raise UserError when ``ep`` cannot split the experts of ``cfg`` (the engine and the planner ask)."""
    if ep > 1 and not cfg.is_moe:
        raise UserError(f"ep = {ep} splits the experts of a mixture-of-experts model, but this model has none "
                        "(num_experts 0); set ep to 1")
    if ep > 1 and cfg.num_experts % ep:
        raise UserError(f"ep = {ep} does not divide num_experts = {cfg.num_experts}; choose an ep that divides "
                        f"{cfg.num_experts}")


def check_model_split(cfg: Qwen3Config, tp: int, num_stages: int, cp: int = 1) -> None:
    """Raise UserError when ``tp`` cannot split the heads, ``num_stages`` pipeline stages the layers of
    ``cfg``, or ``tp x cp`` a hybrid's Gated DeltaNet heads (the engine and the planner ask the same question)."""
    if cfg.num_linear_layers and cfg.linear_num_key_heads % (tp * cp):
        degrees = f"tp x cp = {tp} x {cp}" if cp > 1 else f"tp = {tp}"
        choose = f"tp among {', '.join(map(str, valid_tp_degrees(cfg)))}" if cp == 1 else \
            f"tp and cp whose product divides {cfg.linear_num_key_heads}"
        raise UserError(f"{degrees} does not divide linear_num_key_heads = {cfg.linear_num_key_heads} (each rank "
                        "runs its share of the Gated DeltaNet layers' heads, over the whole sequence under context "
                        f"parallelism); choose {choose}")
    for name in ("num_attention_heads", "num_key_value_heads"):
        if getattr(cfg, name) % tp:
            raise UserError(f"tp = {tp} does not divide {name} = {getattr(cfg, name)}; choose tp among "
                            f"{', '.join(map(str, valid_tp_degrees(cfg)))}")
    if cfg.num_hidden_layers < num_stages:
        raise UserError(f"{num_stages} pipeline stages need at least as many layers, but the model has "
                        f"num_hidden_layers = {cfg.num_hidden_layers}; lower pp (or pp_virtual_stages)")


def stage_layer_ranges(num_layers: int, num_stages: int) -> list[range]:
    """Contiguous, as-even-as-possible layer ranges; earlier stages take the remainder (the last
    stage also carries the LM head and loss)."""
    base, extra = divmod(num_layers, num_stages)
    ranges, start = [], 0
    for s in range(num_stages):
        n = base + (1 if s < extra else 0)
        ranges.append(range(start, start + n))
        start += n
    return ranges
