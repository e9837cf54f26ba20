"""What one training step runs on this rank: forward/backward over the rank's micro-batches (pipelined or
not), the global gradient norm, the loss's one reduction and the optimizer step, on the rank's share of the
model (``RankModel``: train/rank_model.py; the run's layout: train/parallelism.py).

The ``Trainer`` adds data, checkpoints, logging and the loop around it;
``qwen3-pretrain simulate`` runs the same engine on fake tensors to measure
memory and communication at a scale no machine here has.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule

from qwen3_pretrain.data.reader import BadToken
from qwen3_pretrain.parallel.grads import clip_grads, global_grad_norm
from qwen3_pretrain.train.optim import set_lr
# The run's layout and the model's parts, under the names this module has always offered
from qwen3_pretrain.train.parallelism import Parallelism, engine_layout, resolve_parallelism  # noqa: F401
from qwen3_pretrain.train.rank_model import Batch, RankModel, mtp_targets  # noqa: F401


@dataclass(frozen=True)
class StepResult:
    """One optimizer step, as every rank sees it."""

    loss: float  # the global batch's mean token loss
    grad_norm: float
    skipped: bool  # a non-finite loss or gradient norm: the weights were not updated
    flagged: bool  # some rank raised the step's flag (a stop request)
    # further figures of the step: a MoE model's balancing loss and expert load (moe_*), the
    # multi-token-prediction loss (mtp_loss)
    figures: dict[str, float] = field(default_factory=dict)


class Engine(RankModel):
    """This rank's share of every training step, on its share of the model (built by ``RankModel``, whose
    arguments it takes)."""

    # --- one step -------------------------------------------------------------------

    def step(self, batches: list[Batch], lr: float, flag: bool = False, bad_token: BadToken | None = None,
             mark: Callable[[str], None] = lambda phase: None) -> StepResult:
        """One optimizer step over this rank's micro-batches: forward and backward, the global gradient norm,
        the loss's reduction (which also tells every rank whether any raised ``flag`` or was handed a
        ``bad_token`` with its batch), and the update at ``lr``, skipped where the loss or the norm is not
        finite. The step's figures reach the host in one copy, between backward and the update that needs
        them (nothing else in a step waits for the device). ``mark`` is called where each phase ends
        (``forward_backward``, ``reduce``, ``optimizer``: the trainer's observer times them)."""
        if self.balance is not None:
            self.balance.start_step(len(batches) if self.dims.pp == 1 else self.num_microbatches)
        self.mtp_sum.zero_()
        local = self.forward_backward(batches)
        mark("forward_backward")
        norm = self.grad_norm()
        extra = self.balance.local_stats(self.device) if self.balance is not None else None
        if self.mtp_weight:  # the MTP loss rides along the loss's one all-reduce, first of the extras
            extra = torch.cat([self.mtp_sum.reshape(1).float()] + ([extra.float()] if extra is not None else []))
        host = self._read(self.reduce(local, flag, extra, bad_token is not None), norm, bad_token)
        loss, grad_norm = host[0].item() / self.dims.tp, host[-1].item()
        skipped = not (math.isfinite(loss) and math.isfinite(grad_norm))
        mark("reduce")
        self.optimizer_step(lr, None if skipped else grad_norm)
        mark("optimizer")
        figures, rest = {}, host[3:-1]
        if self.mtp_weight:
            # the extras are divided by the tp copies of MoE figures; the MTP sum, like the loss, by tp
            copies = 1 if self.dims.moe_tokens_split_by_tp else self.dims.tp
            figures["mtp_loss"] = rest[0].item() * copies / self.dims.tp
            rest = rest[1:]
        if self.balance is not None:
            figures.update(self.balance.step_figures(rest))
            if not skipped:  # the aux-loss-free biases follow the step's load, as the weights its update
                self.balance.update_biases(rest)
        return StepResult(loss - self.mtp_weight * figures.get("mtp_loss", 0.0), grad_norm, skipped,
                          bool(host[1] > 0), figures)

    def reduce(self, local: torch.Tensor, flag: bool = False, extra: torch.Tensor | None = None,
               bad: bool = False) -> torch.Tensor:
        """On the device, in one all-reduce over every rank: [the loss's token sum (the global mean token loss
        times tp: nonzero on the last stage only, replicated over tp), how many ranks raised ``flag``, how many
        were handed a batch with a token id outside the vocabulary (``bad``), the sum of ``extra`` (the MTP and
        MoE figures, each counted once: divided by the tp ranks when they hold the same, not when each MoE
        layer runs on its tp rank's share of the tokens)]."""
        parts = [local.detach().float().reshape(1), torch.full((1,), float(flag), device=self.device),
                 torch.full((1,), float(bad), device=self.device)]
        reduced = torch.cat(parts + ([extra.float()] if extra is not None else []))
        dist.all_reduce(reduced)
        if extra is None:
            return reduced
        copies = 1 if self.dims.moe_tokens_split_by_tp else self.dims.tp
        return torch.cat([reduced[:3], reduced[3:] / copies])

    def _read(self, reduced: torch.Tensor, norm: torch.Tensor | None = None,
              bad_token: BadToken | None = None) -> torch.Tensor:
        """``reduced``, then the gradient norm, copied to the host in one read (a copy on a CPU too: what is
        read from it is never device memory). When any rank was handed a token id outside the vocabulary,
        every rank raises the same UserError, before the update the step would spoil."""
        norm = norm if norm is not None else torch.zeros((), device=self.device)
        host = torch.cat([reduced.double(), norm.reshape(1).double()]).to("cpu", copy=True)
        if bool(host[2] > 0):
            raise self._first_bad_token(bad_token).error(self.source.config.vocab_size)
        return host

    def _first_bad_token(self, mine: BadToken | None) -> BadToken:
        """The global batch's first bad token, the same on every rank: each rank's record in a row of its own,
        summed over the ranks (a second collective, taken only by a step that stops)."""
        rows = torch.zeros((dist.get_world_size(), 2), dtype=torch.long, device=self.device)
        if mine is not None:
            rows[dist.get_rank()] = torch.tensor([mine.sample + 1, mine.token])  # + 1: row 0 means no record
        dist.all_reduce(rows)
        return min((BadToken(sample - 1, token) for sample, token in rows.tolist() if sample > 0),
                   key=lambda found: found.sample)

    def evaluate(self, batches: list[Batch], bad_token: BadToken | None = None) -> float:
        """The global mean token loss over ``batches`` (one global batch), without backward; ``bad_token``
        as for ``step``."""
        reduced = self.reduce(self.eval_loss(batches), bad=bad_token is not None)
        return self._read(reduced, bad_token=bad_token)[0].item() / self.dims.tp

    def forward_backward(self, batches: list[Batch]) -> torch.Tensor:
        """Sum over this rank's micro-batches of the scaled loss (zero where the rank holds no head)."""
        if self.dims.pp > 1:
            return self.run_pipeline(self.schedule.step, batches)
        total = torch.zeros((), device=self.device)
        part = self.parts[0]
        for i, mb in enumerate(batches):
            last = i == len(batches) - 1
            part.set_requires_gradient_sync(self.cfg.reduce_grads_every_microbatch or last)
            if self.cfg.keep_params_gathered:
                # Megatron's accumulation: gathered once at the first forward, freed after the last backward
                # (the pipeline schedule does the same for its stages)
                part.set_reshard_after_backward(last)
            loss = self.micro_batch_loss(part, mb)
            loss.backward()
            total += loss.detach()
        return total

    def run_pipeline(self, run, batches: list[Batch]) -> torch.Tensor:
        """One pass of the schedule (``step`` or ``eval``) over this rank's micro-batches, re-cut into
        pipeline micro-batches; returns the sum of the scaled losses (zero off the last stage)."""
        inputs = torch.cat([self.tokens(mb, "input_ids") for mb in batches])
        labels = torch.cat([self.tokens(mb, "labels") for mb in batches])
        mtp = self.mtp_weight > 0
        losses: list[torch.Tensor] = []
        args: tuple[torch.Tensor, ...] = ()
        if self.has_first:  # per-document positions enter with the ids and travel with the hidden states
            args = (inputs, torch.cat([self.positions(mb) for mb in batches])) if self.uses_positions else (inputs,)
            if mtp:  # the next tokens, embedded by the first stage, travel beside the hidden states
                args += (labels,)
        if mtp:
            labels = torch.stack([labels, torch.cat([self.mtp_labels(mb) for mb in batches])], dim=-1)
        kwargs = {"target": labels, "losses": losses} if self.has_last else {}
        run(*args, return_outputs=False, **kwargs)
        total = torch.zeros((), device=self.device)
        for loss in losses:
            total += loss.detach()
        return total

    @torch.no_grad()
    def eval_loss(self, batches: list[Batch]) -> torch.Tensor:
        """This rank's scaled loss over ``batches`` without backward."""
        if self.dims.pp > 1:
            return self.run_pipeline(self.schedule.eval, batches)
        local = torch.zeros((), device=self.device)
        for mb in batches:  # the LM loss alone
            hidden = self.parts[0](self.tokens(mb, "input_ids"), self.positions(mb))
            local += self.loss_fn(hidden, self.tokens(mb, "labels"))
        return local

    def reshard(self) -> None:
        """Without a backward pass, units kept gathered after forward (the embedding of a tied head, every
        unit with keep_params_gathered) stay gathered: give the memory back, and let checkpoints see the
        sharded parameters."""
        for part in self.parts:
            for module in part.modules():
                if isinstance(module, FSDPModule):
                    module.reshard()

    def grad_norm(self) -> torch.Tensor:
        """The global gradient norm, after a tied head's and embedding's gradients are summed."""
        if self.tied is not None:
            self.tied.sync_grads()
        return global_grad_norm(self.norm_params, self.dims.world_size // self.dims.pp)

    def optimizer_step(self, lr: float, grad_norm: float | None) -> None:
        """Clip to ``grad_norm`` and step; ``None`` skips the update. Gradients are dropped either way."""
        if grad_norm is not None:
            clip_grads(self.params, self.cfg.clip_grad, grad_norm)
            for opt in self.optimizers:
                set_lr(opt, lr)
                opt.step()
            self.refresh_fp8_scales()
        for opt in self.optimizers:
            opt.zero_grad(set_to_none=True)
