"""The load-balancing loss of a mixture-of-experts model, its router z-loss, and the expert-load statistics.

A ``RouterBalance`` watches every MoE layer's routing in a training step (the
model calls it: ``ModelOptions.router_observer``): each sparse layer returns its
routing as three small tensors (``RouterStats``) beside its output, and the
model's layer loop, eager and outside any recompute, hands them here, so the
bookkeeping never enters a compiled layer and runs once per forward however
the layer is recomputed. It never adds a term to the loss the engine
back-propagates: each term's gradient with respect to the router's probability
sums (or squared log-sum-exps) is known in closed form, so it is handed to the
layer's backward directly, attached to the layer's output by an identity
function (``_Attach``). That works wherever the layer runs: on any pipeline
stage, in any micro-batch.

Notation, for sparse layer l of L (the multi-token-prediction layer's MoE
included where it is trained, as Megatron counts it), micro-batch m of M in the step (a *global*
micro-batch: the samples all data-parallel ranks process in their m-th forward,
cut over the context-parallel ranks), E experts, top-k routing:
  N_m             the micro-batch's tokens;
  c_{l,e}^(m)     how many of its tokens chose expert e (sum over e: k N_m);
  p_{l,t,e}       token t's router probability of expert e (softmax over all E);
  P_{l,e}^(m)     = (1/N_m) sum_t p_{l,t,e}.

global_batch (Qiu et al. 2025, Qwen's recipe). The frequencies are counted over
every rank of the micro-batch (all-reduced over dp x cp) and accumulated over
the step's micro-batches so far:
  f_{l,e}^(m) = sum_{j<=m} c_{l,e}^(j) / sum_{j<=m} N_j
  aux = (1/M) sum_m (1/L) sum_l E sum_e f_{l,e}^(m) P_{l,e}^(m)
A rank's share of P is its tokens' probability sum over N_m, and the data-parallel
gradient reduction sums the shares, so the gradient does not depend on the layout
(the same global micro-batches in the same order give the same aux and gradient).

micro_batch (transformers' load_balancing_loss_func). Per rank and micro-batch, with
all sparse layers pooled as one batch of L N tokens (N: the rank's tokens):
  aux_{r,m} = E sum_e (sum_l c_{l,e} / (L N)) (sum_l sum_t p_{l,t,e} / (L N))
  aux = mean over the R = dp x cp ranks and the M micro-batches of aux_{r,m}.

Both equal k for a perfectly balanced router. The objective is the language-model
loss plus ``coef * aux``; the logged ``loss`` stays the language-model loss and
``moe_aux_loss`` is ``aux``. The z-loss (ST-MoE), with its own coefficient:
  z = (1/M) sum_m (1/L) sum_l (1/N_m) sum_t (logsumexp_e logits_{l,t,e})^2.

Scale (``moe_aux_loss_scale``). ``mean_over_layers`` (above: transformers' scale,
a mean over the layers) or ``megatron``: Megatron-core's, whose layers each add
their own term, the balancing one normalised by k (its switch / global aux
loss), the z-loss not averaged:
  aux = (1/M) sum_m sum_l (E/k) sum_e f_{l,e}^(m) P_{l,e}^(m)      (L at balance)
  z   = (1/M) sum_m sum_l (1/N_m) sum_t (logsumexp_e logits_{l,t,e})^2
so at one coefficient each layer's balancing gradient is L/k times the
mean_over_layers one's, its z-loss gradient L times (global_batch only: the
micro_batch loss pools the layers, which Megatron never does).

Aux-loss-free balancing (DeepSeek-V3; ``bias_rate`` > 0): each MoE layer holds a
per-expert bias b_l that only steers its top-k choice (models/ops/moe.py). After
each optimizer step, from the step's global load c_l (tokens per expert summed
over every rank and micro-batch, the figure the step reduces anyway):
  b_l += rate * (s - mean_e s),   s = sign(mean_e c_{l,e} - c_{l,e})
(an under-loaded expert's bias rises; the centring keeps the biases' sum at 0
and changes no choice). Every rank adds the same values to the same fp32
buffer, so the biases stay identical on every rank; they are saved with the
model's state and resume exactly.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Callable

import torch

from qwen3_pretrain.models.ops.moe import RouterStats
from qwen3_pretrain.models.qwen3.config import Qwen3Config
from qwen3_pretrain.models.qwen3.model import Qwen3Model, routed_layers

AUX_LOSSES = ("global_batch", "micro_batch", "none")
AUX_LOSS_SCALES = ("mean_over_layers", "megatron")


class _Attach(torch.autograd.Function):
    """``out`` unchanged; in backward, the balancing terms' gradients go to the layer's probability sums
    (``probs_grad()``, called when backward gets there: micro_batch's needs every layer's counts) and its
    sum of squared log-sum-exps (``z_grad``)."""

    @staticmethod
    def forward(ctx, out, probs_sum, z_sum, probs_grad: Callable[[], torch.Tensor] | None,
                z_grad: torch.Tensor | None):
        ctx.probs_grad, ctx.z_grad = probs_grad, z_grad
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad):
        probs_grad = ctx.probs_grad() if ctx.probs_grad is not None else None
        return grad, probs_grad, ctx.z_grad, None, None


class RouterBalance:
    """One rank's balancing terms and expert counts over one step (``start_step`` ... ``local_stats``).

    ``group_size``: R, the ranks that split a micro-batch's tokens (dp x cp); ``reduce``: sums a tensor in
    place over them (None when R is 1). ``coef``/``z_coef``: the terms' weights in the objective; ``scale``:
    their scale over the layers (``AUX_LOSS_SCALES``); ``mtp``: the multi-token-prediction layer is trained
    (its MoE counts as one more layer); ``bias_rate``: the aux-loss-free balancing biases' step (0: none;
    ``attach_biases`` hands over the model parts' buffers).
    """

    def __init__(self, cfg: Qwen3Config, mode: str, coef: float, z_coef: float = 0.0, group_size: int = 1,
                 reduce: Callable[[torch.Tensor], None] | None = None, *, scale: str = "mean_over_layers",
                 mtp: bool = False, bias_rate: float = 0.0) -> None:
        if mode not in AUX_LOSSES:
            raise ValueError(f"moe_aux_loss must be one of {AUX_LOSSES}, not {mode!r}")
        if scale not in AUX_LOSS_SCALES or (scale == "megatron" and mode == "micro_batch"):
            raise ValueError(f"moe_aux_loss_scale {scale!r} is not one of {AUX_LOSS_SCALES} or does not go "
                             f"with moe_aux_loss {mode!r}")
        self.mode, self.coef, self.z_coef = mode, coef, z_coef
        self.z_loss = z_coef > 0  # the layers report their squared log-sum-exps (RouterObserver)
        self.sparse_layers = routed_layers(cfg, mtp)
        self.row = {layer: j for j, layer in enumerate(self.sparse_layers)}
        # each layer's name in the per-layer figures: its index, or mtp.<i> for the MTP layer's
        self.labels = [str(i) if i < cfg.num_hidden_layers else f"mtp.{i - cfg.num_hidden_layers}"
                       for i in self.sparse_layers]
        self.num_layers, self.num_experts, self.top_k = len(self.sparse_layers), cfg.num_experts, \
            cfg.num_experts_per_tok
        # each layer's weight in the balancing term and in the z-loss (module docstring: Scale)
        self.aux_layer_weight = 1.0 / (self.top_k if scale == "megatron" else self.num_layers)
        self.z_layer_weight = 1.0 if scale == "megatron" else 1.0 / self.num_layers
        self.group_size, self.reduce = group_size, reduce
        self.attaches = (mode != "none" and coef > 0) or z_coef > 0
        self.bias_rate = bias_rate
        self.biases: dict[int, torch.Tensor] = {}  # layer -> its MoE's expert_bias buffer, on this rank
        self.start_step(1)

    def start_step(self, num_microbatches: int) -> None:
        self.num_microbatches = num_microbatches
        self.load: torch.Tensor | None = None  # [L, E] tokens per expert on this rank this step
        self.aux = self.z = 0.0  # this rank's shares of the step's terms (tensors once a layer ran)
        self.dropped = 0.0  # pairs this rank's layers dropped at the experts' capacity (moe_capacity_factor)
        self.seen: dict[int, int] = defaultdict(int)  # layer -> micro-batches it has run
        self.running: dict[int, torch.Tensor] = {}  # layer -> [E + 1] counts and tokens so far (global_batch)
        self.pooled: dict[int, torch.Tensor] = {}  # micro-batch -> [2, E] pooled counts, probability sums
        self.tokens: dict[int, torch.Tensor] = {}  # micro-batch -> this rank's tokens (micro_batch)

    # --- the observer the model calls ------------------------------------------------------------------------

    def __call__(self, layer: int, out: torch.Tensor, stats: RouterStats) -> torch.Tensor:
        probs_grad, z_grad = self._record(layer, stats)
        if not self.attaches:
            return out
        return _Attach.apply(out, stats.probs_sum if probs_grad is not None else None,
                             stats.z_sum if self.z_loss else None, probs_grad, z_grad)

    @torch.no_grad()
    def _record(self, layer: int, stats: RouterStats) -> tuple[Callable[[], torch.Tensor] | None,
                                                              torch.Tensor | None]:
        """Counts the layer's routing into the step's figures; returns the gradients its backward hands to
        the probability sums (a function: read in backward) and to the sum of squared log-sum-exps."""
        counts, probs_sum = stats.counts, stats.probs_sum.detach()
        if self.load is None:
            self.load = torch.zeros(self.num_layers, self.num_experts, device=counts.device)
        self.load[self.row[layer]] += counts
        if stats.dropped is not None:
            self.dropped = self.dropped + stats.dropped
        m = self.seen[layer]
        self.seen[layer] += 1
        # this rank's tokens, from its (token, slot) pairs: a device value, not a host read
        local_tokens = counts.sum() / self.top_k
        tokens = local_tokens * self.group_size  # N_m: every rank holds as many of the micro-batch's tokens
        probs_grad = None
        if self.mode == "global_batch":
            probs_grad = self._global_batch(layer, counts, probs_sum, tokens,
                                            self.aux_layer_weight / self.num_microbatches)
        elif self.mode == "micro_batch":
            probs_grad = self._micro_batch(m, counts, probs_sum, local_tokens)
        z_grad = None
        if self.z_loss:
            scale = self.z_layer_weight / self.num_microbatches
            self.z = self.z + stats.z_sum.detach() * scale / tokens
            z_grad = self.z_coef * scale / tokens
        return (probs_grad if self.coef > 0 else None), z_grad

    def _global_batch(self, layer: int, counts: torch.Tensor, probs_sum: torch.Tensor, tokens: torch.Tensor,
                      scale: float) -> Callable[[], torch.Tensor]:
        counts = counts.clone()
        if self.reduce is not None:
            self.reduce(counts)
        running = self.running.get(layer)
        if running is None:
            running = self.running[layer] = torch.zeros(self.num_experts + 1, device=counts.device)
        running[:-1] += counts
        running[-1] += tokens
        weights = self.num_experts * (running[:-1] / running[-1]) / tokens  # d aux_l^(m) / d probs_sum
        self.aux = self.aux + (weights * probs_sum).sum() * scale
        grad = weights * (self.coef * scale)
        return lambda: grad

    def _micro_batch(self, m: int, counts: torch.Tensor, probs_sum: torch.Tensor,
                     local_tokens: torch.Tensor) -> Callable[[], torch.Tensor]:
        pooled = self.pooled.get(m)
        if pooled is None:
            pooled = self.pooled[m] = torch.zeros(2, self.num_experts, device=counts.device)
        pooled[0] += counts
        pooled[1] += probs_sum
        self.tokens[m] = local_tokens
        rows = self.num_layers * local_tokens
        scale = self.coef / (self.num_microbatches * self.group_size)
        # read in backward, once every layer of the micro-batch has added its counts
        return lambda: pooled[0] * (scale * self.num_experts / rows ** 2)

    # --- the step's figures ----------------------------------------------------------------------------------

    def local_stats(self, device: torch.device) -> torch.Tensor:
        """This rank's [aux share, z share, tokens per expert (L x E), pairs dropped], for one sum over all
        ranks."""
        aux = self.aux
        if self.mode == "micro_batch":
            for m, pooled in self.pooled.items():
                rows = self.num_layers * self.tokens[m]
                aux = aux + self.num_experts * (pooled[0] * pooled[1]).sum() / rows ** 2 / (
                    self.num_microbatches * self.group_size)
        load = self.load if self.load is not None else torch.zeros(self.num_layers, self.num_experts)
        head = torch.stack([torch.as_tensor(aux, dtype=torch.float32), torch.as_tensor(self.z, dtype=torch.float32)])
        # last: the dropped pairs; made on the device when still a number (dropless), not copied there
        dropped = (torch.full((1,), float(self.dropped), device=device) if isinstance(self.dropped, (int, float))
                   else self.dropped.reshape(1).to(device, torch.float32))
        return torch.cat([head.to(device), load.to(device).reshape(-1), dropped])

    def step_load(self, reduced: torch.Tensor) -> torch.Tensor:
        """The step's tokens per expert [L, E], summed over every rank, from the sum of their ``local_stats``."""
        return reduced[2:2 + self.num_layers * self.num_experts].view(self.num_layers, self.num_experts)

    def step_figures(self, reduced: torch.Tensor) -> dict[str, float | dict[str, float]]:
        """The logged figures from the sum of every rank's ``local_stats`` (each counted once): the worst
        layer's in the log line, each layer's (by ``labels``) in metrics.jsonl."""
        load = self.step_load(reduced)
        per_layer_mean = load.sum(1, keepdim=True) / self.num_experts
        # each layer's busiest expert over its mean load (1 = perfect balance), its fraction of idle experts
        load_max = (load / per_layer_mean.clamp(min=1e-9)).amax(1).tolist()
        idle = (load == 0).double().mean(1).tolist()
        figures: dict[str, float | dict[str, float]] = {
            "moe_load_max": max(load_max), "moe_idle_experts": max(idle),
            "moe_layer_load_max": dict(zip(self.labels, load_max)),
            "moe_layer_idle_experts": dict(zip(self.labels, idle))}
        if reduced[-1] > 0:  # the fraction of the step's (token, expert) pairs dropped at the capacity
            figures["moe_dropped"] = (reduced[-1] / load.sum().clamp(min=1)).item()
        if self.mode != "none":
            figures["moe_aux_loss"] = reduced[0].item()
        if self.z_coef > 0:
            figures["moe_z_loss"] = reduced[1].item()
        if self.biases:  # the largest bias of this rank's layers (the same on every rank holding them)
            figures["moe_expert_bias_max"] = torch.stack([b.abs().max() for b in self.biases.values()]).max().item()
        return figures

    # --- aux-loss-free balancing -----------------------------------------------------------------------------

    def attach_biases(self, parts: list[Qwen3Model]) -> None:
        """Take the expert-bias buffers of this rank's model ``parts`` (where the layers hold them) and start
        them at zero (a resume then loads the saved ones into the same buffers)."""
        if self.bias_rate <= 0:
            return
        for part in parts:
            for layer, mlp in part.routed_mlps().items():
                if mlp.expert_bias is not None:
                    with torch.no_grad():
                        mlp.expert_bias.zero_()
                    self.biases[layer] = mlp.expert_bias

    @torch.no_grad()
    def update_biases(self, reduced: torch.Tensor) -> None:
        """After an optimizer step: move each of this rank's layers' biases toward balance from the step's
        global load (in ``reduced``, the sum of every rank's ``local_stats``; module docstring)."""
        if not self.biases:
            return
        load = self.step_load(reduced).double()
        for layer, bias in self.biases.items():
            row = load[self.row[layer]]
            step = torch.sign(row.mean() - row)
            bias.add_((self.bias_rate * (step - step.mean())).to(bias.device, bias.dtype))
