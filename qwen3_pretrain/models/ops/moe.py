"""A mixture-of-experts MLP in plain torch: a softmax top-k router and stacked experts, computed dropless.

A layer's tokens [T, H] go to the router, a projection to E logits in the
model's dtype, turned into probabilities in fp32 over all experts; each token
takes its ``top_k`` most probable experts, with those probabilities as weights
(renormalised to sum to one when the config says so). Every assignment is
computed (no capacity, no dropped token): the T * top_k (token, expert) pairs
are sorted by expert, each expert applies its SwiGLU MLP to its contiguous
run, and each token's outputs are weighted and summed back. This is
transformers' Qwen3-MoE block, computed grouped instead of one expert at a
time, with two changes that keep less for backward and change no value beyond
rounding: a pair's routing weight scales the expert's intermediate (``I``
wide) rather than its output (``H`` wide; the down projection is linear), and
the outputs return to their tokens by a gather and a sum over the ``top_k``
slots (which keeps only indices) rather than an ``index_add`` (which keeps its
source, a second ``T * top_k x H`` tensor).

The experts are stored stacked, ``gate_proj`` and ``up_proj`` [E, I, H] and
``down_proj`` [E, H, I] (each expert's matrices are its ``nn.Linear``
weights), so a grouped matmul takes them as they are and a checkpoint holds
three tensors per layer. How the experts compute is chosen when the model is
built (``ExpertsKernel``): ``GroupedMM``, one ``torch._grouped_mm`` per
projection for all experts (bf16, where the device has it), or ``ExpertLoop``,
one matmul per expert (exact in any dtype, any device).

A layer built to report its routing returns, beside its output, what the
training engine's load-balancing losses and expert-load metrics need
(``RouterStats``: three small tensors); the model hands them to an observer
(``RouterObserver``) outside the layer, so the layer's code holds no
bookkeeping and compiles whole, and a layer recomputed in backward reports
nothing twice. The model itself holds no balancing state.
"""

from __future__ import annotations

from typing import Callable, NamedTuple, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from qwen3_pretrain.models.ops.swiglu import swiglu

Linear = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


class ExpertsKernel(Protocol):
    """Applies each expert's SwiGLU MLP to its run of ``tokens`` [N, H] (sorted by expert, ``counts`` [E]
    tokens each), scaled by each row's routing weight ``weights`` [N, 1] -> [N, H]:
    ``down_e(silu(gate_e x) * up_e x * w)``."""

    name: str

    def __call__(self, tokens: torch.Tensor, counts: torch.Tensor, weights: torch.Tensor, gate: torch.Tensor,
                 up: torch.Tensor, down: torch.Tensor) -> torch.Tensor: ...


class ExpertLoop:
    """One matmul per expert through ``linear`` (``F.linear``, or the fp32-upcasting one of
    models/ops/precision.py). Reads the counts on the host (a device sync per layer)."""

    name = "loop"

    def __init__(self, linear: Linear = F.linear) -> None:
        self.linear = linear

    def __call__(self, tokens, counts, weights, gate, up, down):
        outs = []
        sizes = self.sizes(counts, tokens.shape[0])
        # Every expert's run, empty ones too: an expert parallel rank that receives no pair must still take
        # part in backward (its all-to-alls, its experts' zero gradients), so the output keeps the graph.
        for e, (run, w) in enumerate(zip(torch.split(tokens, sizes), torch.split(weights, sizes))):
            outs.append(self.linear(swiglu(self.linear(run, gate[e]), self.linear(run, up[e]), w), down[e]))
        return torch.cat(outs)

    def sizes(self, counts: torch.Tensor, num_tokens: int) -> list[int]:
        """Each expert's run length (of ``num_tokens`` in all), read on the host."""
        return counts.tolist()


class GroupedMM:
    """``torch._grouped_mm`` over all experts at once, one call per projection (no host sync). Needs bf16
    operands with dimensions that are multiples of 8 (the expert hidden sizes of every Qwen3-MoE are)."""

    name = "grouped_mm"

    def __call__(self, tokens, counts, weights, gate, up, down):
        offsets = counts.cumsum(0).to(torch.int32)
        h = swiglu(_grouped(tokens, gate, offsets), _grouped(tokens, up, offsets), weights)
        # Its backward needs a dense gradient (an expanded one has zero strides): hand it one.
        return _DenseGrad.apply(_grouped(h, down, offsets))


def _grouped(x: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """Rows ``offsets[e-1]:offsets[e]`` of ``x`` times ``weight[e]`` transposed (an ``nn.Linear`` each)."""
    return torch._grouped_mm(x, weight.transpose(-2, -1), offs=offsets)


class _DenseGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        return grad.contiguous()


def experts_kernel(device_type: str, dtype: torch.dtype, linear: Linear = F.linear) -> ExpertsKernel:
    """The expert kernel for ``device_type`` computing in ``dtype``. ``torch._grouped_mm`` takes bf16 on CUDA
    (sm90 and newer; sm80 through a fallback) and on a CPU, where it is also faster than one matmul per expert
    in bf16 but slower in fp32 (bench/README.md); NPUs have their own grouped matmul in torch_npu, not used
    yet. Elsewhere one matmul per expert through ``linear``."""
    if device_type in ("cuda", "cpu") and dtype == torch.bfloat16:
        return GroupedMM()
    return ExpertLoop(linear)


class ExpertsDispatch(Protocol):
    """Brings the (token, expert) pairs to ``experts`` and their outputs back: ``tokens`` [N, H] and their
    routing ``weights`` [N, 1] sorted by expert, ``counts`` [E] of them per expert (all ``E`` experts of the
    layer) -> [N, H], row for row. Without one, the layer's own experts compute them all (``GroupedExperts``);
    expert parallelism sends them to the ranks holding their experts (``parallel/expert_parallel.py``)."""

    def __call__(self, tokens: torch.Tensor, counts: torch.Tensor, weights: torch.Tensor,
                 experts: GroupedExperts) -> torch.Tensor: ...


class RouterStats(NamedTuple):
    """One sparse layer's routing of one forward, as the balancing losses need it (docs/moe.md)."""

    counts: torch.Tensor  # [E] fp32: this rank's (token, slot) pairs per expert (no gradient)
    probs_sum: torch.Tensor  # [E] fp32: the router probabilities summed over this rank's tokens (with gradient)
    z_sum: torch.Tensor | None  # []: the squared log-sum-exps of the logits summed over the tokens, when asked


class RouterObserver(Protocol):
    """Sees every sparse layer's routing in a forward with autograd on, outside the layer (the model's layer
    loop calls it); returns the layer's output ``out``, to which it may attach a gradient (a load-balancing
    loss's, through ``stats``' tensors) without changing its value. ``z_loss``: the layers report ``z_sum``."""

    z_loss: bool

    def __call__(self, layer: int, out: torch.Tensor, stats: RouterStats) -> torch.Tensor: ...


def expert_counts(chosen: torch.Tensor, num_experts: int) -> torch.Tensor:
    """How many of the (token, slot) pairs of ``chosen`` went to each expert: [E] (int64). A fixed-size
    result (unlike ``bincount``'s), so it also runs on fake tensors."""
    flat = chosen.reshape(-1)
    return flat.new_zeros(num_experts).scatter_add_(0, flat, torch.ones_like(flat))


class GroupedExperts(nn.Module):
    """``num_experts`` SwiGLU MLPs of ``hidden`` -> ``intermediate`` -> ``hidden``, stacked; ``dispatch``
    (set when the model is parallelized) when they live on several ranks."""

    def __init__(self, num_experts: int, hidden: int, intermediate: int, kernel: ExpertsKernel) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.gate_proj = nn.Parameter(torch.empty(num_experts, intermediate, hidden))
        self.up_proj = nn.Parameter(torch.empty(num_experts, intermediate, hidden))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden, intermediate))
        self.kernel = kernel
        self.dispatch: ExpertsDispatch | None = None

    def forward(self, x: torch.Tensor, chosen: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """``x`` [T, H], ``chosen`` and ``weights`` [T, k] -> [T, H]: each token's weighted expert outputs."""
        num_tokens, top_k = chosen.shape
        flat = chosen.reshape(-1)
        order = flat.argsort(stable=True)  # (token, slot) pairs grouped by expert, tokens in order within each
        counts = expert_counts(flat, self.num_experts)
        pairs, pair_weights = x.index_select(0, order // top_k), weights.reshape(-1, 1)[order]
        if self.dispatch is not None:
            y = self.dispatch(pairs, counts, pair_weights, self)
        else:
            y = self.kernel(pairs, counts, pair_weights, self.gate_proj, self.up_proj, self.down_proj)
        # Back to (token, slot) order, then each token's k outputs summed.
        back = torch.empty_like(order).scatter_(0, order, torch.arange(order.numel(), device=order.device))
        return y[back].view(num_tokens, top_k, -1).sum(1)


class MoE(nn.Module):
    """The sparse MLP: router ``gate`` (an ``nn.Linear`` of ``linear``'s class, as transformers names it)
    and ``experts``.

    ``report``: ``forward`` returns (output, ``RouterStats``) instead of the output alone, with ``z_sum``
    where ``z_loss`` (the training engine's balancing losses read them: ``RouterObserver``).
    ``balanced``: a benchmark mode that routes token ``t``'s slot ``j`` to expert ``(t * top_k + j) mod E``
    (perfect balance, as published MoE throughput figures assume), weighted by the router's probabilities
    of those experts; the model then no longer computes what it was trained to.
    """

    def __init__(self, hidden: int, num_experts: int, top_k: int, intermediate: int, norm_topk_prob: bool, *,
                 kernel: ExpertsKernel, linear: type[nn.Linear] = nn.Linear, report: bool = False,
                 z_loss: bool = False, balanced: bool = False) -> None:
        super().__init__()
        self.gate = linear(hidden, num_experts, bias=False)
        self.experts = GroupedExperts(num_experts, hidden, intermediate, kernel)
        self.top_k, self.norm_topk_prob = top_k, norm_topk_prob
        self.report, self.z_loss, self.balanced = report, z_loss, balanced

    def forward(self, x: torch.Tensor) -> torch.Tensor | tuple[torch.Tensor, RouterStats]:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        logits = self.gate(x)  # [T, E]
        probs = F.softmax(logits, dim=-1, dtype=torch.float32)
        if self.balanced:
            chosen = self.round_robin(x.shape[0], probs.shape[1], x.device)
            weights = probs.gather(1, chosen)
        else:
            weights, chosen = probs.topk(self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        out = self.experts(x, chosen, weights.to(x.dtype)).view(shape)
        if not self.report:
            return out
        z_sum = logits.float().logsumexp(-1).pow(2).sum() if self.z_loss else None
        return out, RouterStats(expert_counts(chosen, probs.shape[1]).float(), probs.sum(0), z_sum)

    def round_robin(self, num_tokens: int, num_experts: int, device: torch.device) -> torch.Tensor:
        slots = torch.arange(num_tokens * self.top_k, device=device).view(num_tokens, self.top_k)
        return slots % num_experts
