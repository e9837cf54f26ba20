"""A mixture-of-experts MLP in plain torch: a softmax top-k router and stacked experts, computed dropless.

A layer's tokens [T, H] go to the router, a projection to E logits (in fp32,
weight and input upcast for that one small matmul, as Megatron's fp32 router:
``Fp32Router``; or in the model's dtype, as transformers computes them),
turned into probabilities in fp32 over all experts; each token takes its
``top_k`` most probable experts, with those probabilities as weights
(renormalised to sum to one when the config says so). With aux-loss-free
balancing (DeepSeek-V3) a per-expert bias, a buffer the training engine
updates after each step from the global expert load (train/balance.py), is
added to the probabilities for choosing the ``top_k`` only: the weights stay
the unbiased probabilities. Without a capacity every
assignment is computed (no dropped token): the T * top_k (token, expert) pairs
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
projection for all experts (bf16, where the device has it; fp32 on CPUs where
it is the faster: ``cpu_grouped_fp32``), or ``ExpertLoop``, one matmul per
expert (exact in any dtype, any device).

With a capacity (``Capacity``, config ``moe_capacity_factor``) each expert
takes at most ``C = ceil(factor x pairs / E)`` of the pairs that chose it, the
ones with the largest routing weights, decided over the whole micro-batch (all
ranks that split its tokens) so that every layout drops the same pairs; a
dropped pair is left out of the dispatch and contributes nothing (its token
keeps its other experts and the residual). Each expert's run of rows may be
padded with zero rows (``pad_groups``): to a multiple of the grouped kernel's
alignment (on CUDA by default), or to the capacity (fixed shapes).

A layer built to report its routing returns, beside its output, what the
training engine's load-balancing losses and expert-load metrics need
(``RouterStats``: three small tensors); the model hands them to an observer
(``RouterObserver``) outside the layer, so the layer's code holds no
bookkeeping and compiles whole, and a layer recomputed in backward reports
nothing twice. The model itself holds no balancing state.
"""

from __future__ import annotations

import math
from typing import Callable, NamedTuple, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from qwen3_pretrain.models.ops.precision import fp32_logits
from qwen3_pretrain.models.ops.swiglu import swiglu

Linear = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
# The name of a MoE layer's aux-loss-free balancing bias (a buffer of ``MoE``): training checkpoints hold it
# as ``...mlp.expert_bias``; Qwen3-MoE's HF format has no such tensor, so merge leaves it out.
EXPERT_BIAS = "expert_bias"


class ExpertsKernel(Protocol):
    """Applies each expert's SwiGLU MLP to its run of ``tokens`` [N, H] (sorted by expert, ``counts`` [E]
    tokens each), scaled by each row's routing weight ``weights`` [N, 1] -> [N, H]:
    ``down_e(silu(gate_e x) * up_e x * w)``. ``align``: every run is padded with zero rows to a multiple of
    it before the experts compute (1: none); ``group_rows``: every run padded to exactly that many rows
    (then to ``align``: pad-to-capacity's fixed shapes). A padding row is zero, so its output is zero and
    adds nothing to any gradient; it is dropped before the result returns."""

    name: str
    align: int

    def __call__(self, tokens: torch.Tensor, counts: torch.Tensor, weights: torch.Tensor, gate: torch.Tensor,
                 up: torch.Tensor, down: torch.Tensor, group_rows: int | None = None) -> torch.Tensor: ...


class PaddedGroups(NamedTuple):
    """Runs of rows padded per expert (``pad_groups``): ``tokens`` [P, H] and ``weights`` [P, 1] with zero
    rows after each expert's own, ``sizes`` [E] the padded runs' lengths (each a multiple of the alignment;
    they sum to P), ``rows`` [N] where each original row went."""

    tokens: torch.Tensor
    weights: torch.Tensor
    sizes: torch.Tensor
    rows: torch.Tensor


def pad_groups(tokens: torch.Tensor, weights: torch.Tensor, counts: torch.Tensor, align: int,
               group_rows: int | None = None, sizes: list[int] | None = None,
               buckets: bool = False) -> PaddedGroups:
    """Each expert's run of ``tokens`` (``counts`` [E] rows each) padded with zero rows to a multiple of
    ``align``, or to ``group_rows`` rounded up to it, or to ``sizes`` [E] (padded lengths known on the
    host: the CPU's row buckets, ``bucket_rows``; the total is then their sum, no slack), or with
    ``buckets`` to the row buckets computed on the device (``bucket_sizes``: under compile, where a host
    read would break the graph). Otherwise computed on the device, no host read: the padded total is a bound
    known from the shapes (``N + E (align - 1)`` rounded up to ``align``; ``E group_rows`` for fixed groups;
    ``bucket_bound`` for buckets) and the last expert's run takes the slack, so every row the kernel reads
    belongs to a run (``torch._grouped_mm`` leaves rows past the last offset unwritten)."""
    num_rows, num_experts = tokens.shape[0], counts.numel()
    device = counts.device
    if sizes is not None:
        total = sum(sizes)
        sizes = torch.tensor(sizes, dtype=counts.dtype, device=device)
        starts = sizes.cumsum(0) - sizes
    elif group_rows is not None:
        step = -(-max(group_rows, 1) // align) * align
        sizes, total = torch.full_like(counts, step), num_experts * step
        # the padded starts as a product, not a cumsum of ``sizes``: inductor's rewrite of a cumsum of a
        # constant tensor fails when the constant is symbolic (a capacity read on the host under compile)
        starts = torch.arange(num_experts, device=device, dtype=counts.dtype) * step
    else:
        if buckets:
            sizes, total = bucket_sizes(counts), bucket_bound(num_rows, num_experts)
        else:
            sizes = (counts + align - 1) // align * align
            total = -(-(num_rows + num_experts * (align - 1)) // align) * align
        sizes = torch.cat([sizes[:-1], (total - sizes[:-1].sum()).view(1)])
        starts = sizes.cumsum(0) - sizes
    expert_of_row = torch.arange(num_experts, device=device).repeat_interleave(counts, output_size=num_rows)
    shift = starts - (counts.cumsum(0) - counts)  # padded start minus original start
    rows = torch.arange(num_rows, device=device) + shift[expert_of_row]
    # index_put, not index_copy: both write the runs into the zeros, but autograd's index_copy keeps its
    # source for backward (its formula reads the source's shape through the tensor), so the unpadded pairs
    # stayed alive beside the padded copy the kernel keeps, k (d h + d) bytes per token; index_put keeps
    # only ``rows``. Same values and gradients (the test pins both and what is kept).
    return PaddedGroups(tokens.new_zeros(total, tokens.shape[1]).index_put((rows,), tokens),
                        weights.new_zeros(total, 1).index_put((rows,), weights), sizes, rows)


def _padded_call(kernel, tokens, counts, weights, gate, up, down, group_rows=None):
    """An expert kernel's ``__call__``: its ``compute`` on the runs as they are, or on the runs padded
    (``pad_groups``: to the kernel's ``align``, or to ``group_rows``, or to the CPU's row buckets where the
    kernel has ``buckets``) with the padding rows' outputs left out."""
    buckets = getattr(kernel, "buckets", False) and group_rows is None
    on_device = getattr(kernel, "device_buckets", False) and group_rows is None
    if kernel.align > 1 or group_rows is not None or buckets or on_device:
        sizes = bucket_rows(counts) if buckets else None
        padded = pad_groups(tokens, weights, counts, kernel.align, group_rows, sizes, buckets=on_device)
        return kernel.compute(padded.tokens, padded.sizes, padded.weights, gate, up, down).index_select(
            0, padded.rows)
    return kernel.compute(tokens, counts, weights, gate, up, down)


class ExpertLoop:
    """One matmul per expert through ``linear`` (``F.linear``, or the fp32-upcasting one of
    models/ops/precision.py). Reads the counts on the host (a device sync per layer). Unpadded by default
    (``align`` 1): a matmul takes any number of rows."""

    name = "loop"

    def __init__(self, linear: Linear = F.linear, align: int = 1) -> None:
        self.linear, self.align = linear, align

    __call__ = _padded_call

    def compute(self, tokens, counts, weights, gate, up, down):
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
    operands (fp32 too on a CPU) with dimensions that are multiples of 8 (the expert hidden sizes of every Qwen3-MoE are).
    ``align``: each expert's run padded to a multiple of this many rows (``pad_groups``): on CUDA 8 by
    default, the bf16 kernel's alignment (16 or 32 for FP8 later), so no group starts off a 16-byte row
    boundary (an empty group stays empty; the last expert's run takes the slack up to the padded total); 1
    elsewhere (the CPU's kernel takes any runs). ``buckets``: each run padded to its row bucket
    (``bucket_rows``, counts read on the host: bf16 on a CPU, where that read costs nothing and the kernel
    keeps state per row count). ``device_buckets``: the same buckets computed on the device
    (``bucket_sizes``, the last run taking the slack up to ``bucket_bound``): bf16 on a CPU under compile."""

    name = "grouped_mm"

    def __init__(self, align: int = 1, buckets: bool = False, device_buckets: bool = False) -> None:
        self.align, self.buckets, self.device_buckets = align, buckets, device_buckets

    __call__ = _padded_call

    def compute(self, tokens, counts, weights, gate, up, down):
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


# Rows a bf16 ``torch._grouped_mm`` group is padded to a multiple of on CUDA (16-byte aligned row starts).
GROUPED_MM_ALIGN = 8
# On a CPU the bf16 ``torch._grouped_mm`` is one oneDNN matmul per group (``at::mm``), and oneDNN builds a
# primitive per shape, JIT-compiled AMX/AVX-512 kernels of about 0.6 MB each, kept by two caches: oneDNN's
# primitive cache and ideep's (torch's oneDNN wrapper) LRU cache, 1,024 entries each. Routing brings new row
# counts at every step (an expert block of 16 experts met 276 shapes in 20 iterations), so resident memory
# grew for as long as new counts came: +170 MiB over 20 iterations of one block. Capping both caches
# (ONEDNN_PRIMITIVE_CACHE_CAPACITY and LRU_CACHE_CAPACITY; either alone does not hold it) keeps it flat but
# compiles a kernel again at almost every group (about 1 ms each, 1.8x the block's time). So the row count
# is rounded up to a bucket of at most 1/16 of it (``bucket_rows``): 16 shapes per doubling of the count,
# a few dozen in all, met within the first steps; about 3% more expert rows on average, zero rows that
# add nothing to any value but may change the blocking of the weight gradients' sums (last bits).
# Figures: bench/README.md, "bf16 memory that grows step by step".
CPU_BUCKET_MIN = 16
CPU_BF16_BUCKETS = True  # bench/train_cpu.py's "-unpadded" variants turn it off to measure the difference


def bucket_rows(counts: torch.Tensor) -> list[int]:
    """Each group's row count ``counts`` [E] rounded up to its bucket: a multiple of the largest power of two
    that is at most 1/16 of it, and at least ``CPU_BUCKET_MIN`` (0 stays 0): 300 -> 304, 513 -> 544, 20 ->
    32. Read on the host, once per layer (a CPU tensor's values are there already: no wait)."""
    sizes = []
    for count in counts.tolist():
        step = max(CPU_BUCKET_MIN, 1 << max(count.bit_length() - 5, 0))
        sizes.append(-(-count // step) * step)
    return sizes


def bucket_sizes(counts: torch.Tensor) -> torch.Tensor:
    """``bucket_rows`` computed on the device (no host read; integer ops that compile): the largest power of
    two at most ``count`` by smearing its top bit down, over 16, at least ``CPU_BUCKET_MIN``."""
    top = counts
    for shift in (1, 2, 4, 8, 16, 32):
        top = top | (top >> shift)
    step = torch.clamp((top - (top >> 1)) >> 4, min=CPU_BUCKET_MIN)
    return (counts + step - 1) // step * step


def bucket_bound(num_rows: int, num_experts: int) -> int:
    """The most rows ``num_rows`` split into ``num_experts`` runs take in row buckets, rounded up to
    ``CPU_BUCKET_MIN``: a run of ``c`` rows gains at most ``max(CPU_BUCKET_MIN, c // 16) - 1`` (its bucket's
    step is a power of two at most ``c / 16``, or the minimum), so ``N + E (CPU_BUCKET_MIN - 1) + N // 16``.
    Every bucket is a multiple of ``CPU_BUCKET_MIN``, and so is the last run with the slack: its sizes are
    multiples of 16 in a bounded range, which oneDNN's caches hold after a few steps."""
    total = num_rows + num_experts * (CPU_BUCKET_MIN - 1) + num_rows // 16
    return -(-total // CPU_BUCKET_MIN) * CPU_BUCKET_MIN


def cpu_flags() -> frozenset[str]:
    """This machine's CPU feature flags (``/proc/cpuinfo``'s first ``flags`` line; empty where there is none)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def cpu_grouped_fp32(flags: frozenset[str] | None = None) -> bool:
    """Whether fp32 experts on this CPU run faster as ``torch._grouped_mm`` than as one matmul per expert: a
    rule keyed on CPU features, not a timing probe, so that every rank of a job (same machines) and every run
    choose alike whatever the load (the two kernels' fp32 results are also bitwise equal on the CPUs measured,
    tests/test_kernel_choice.py). Measured (bench/README.md, the expert block forward and backward): on Intel
    Xeons with AMX (``amx_bf16``) the grouped kernel is 1.35-2.6x faster in fp32; on an AMD EPYC with
    ``avx512_bf16`` (family 25, model 17) 1.08-1.13x at 8,192 rows and 1.33-1.51x at the test's shapes, 1 and
    2 threads. An earlier AMD EPYC figure, the loop 2.8x faster (0.21 vs 0.58 s), was not reproduced there.
    CPUs with neither flag keep the loop (not measured)."""
    found = cpu_flags() if flags is None else flags
    return "amx_bf16" in found or "avx512_bf16" in found


def experts_kernel(device_type: str, dtype: torch.dtype, linear: Linear = F.linear,
                   align: int | None = None, flags: frozenset[str] | None = None,
                   compiled: bool = False) -> ExpertsKernel:
    """The expert kernel for ``device_type`` computing in ``dtype``. ``torch._grouped_mm`` takes bf16 on CUDA
    (sm90 and newer; sm80 through a fallback) and on a CPU, where it is also faster than one matmul per expert
    in bf16; in fp32 on a CPU it is faster on some CPUs and slower on others (``cpu_grouped_fp32``, ``flags``
    the CPU's features, by default this machine's), and only where ``linear`` is the plain one (not the
    fp32-upcasting matmul of a CPU without native bf16); NPUs have their own grouped matmul in torch_npu, not
    used yet. Elsewhere one matmul per expert through ``linear``. ``align``: rows each expert's run is padded
    to a multiple of (``GroupedMM``); by default ``GROUPED_MM_ALIGN`` for the grouped kernel on CUDA, else 1,
    and in bf16 on a CPU each run rounded up to its row bucket (``bucket_rows``; under compile, whose graph
    would break at that host read, computed on the device: ``bucket_sizes``, the last run taking the slack
    up to ``bucket_bound``). Unbucketed, the compiled step met new group shapes at most groups of
    every step and oneDNN built a kernel for each: the tiny MoE's 642 expert products took 0.40-0.48 s
    compiled against 0.23-0.35 s eager, 134 distinct shapes a step against 65 (bench/README.md, the
    roofline against CPU training).
    ``compiled``: the layers run under ``torch.compile``, whose fake-tensor kernel of ``torch._grouped_mm``
    takes bf16 only (torch 2.13: 'Expected inputs of BF16 type'): fp32 experts keep the loop there."""
    if device_type in ("cuda", "cpu") and dtype == torch.bfloat16:
        bucketed = device_type == "cpu" and align is None and CPU_BF16_BUCKETS
        return GroupedMM(align if align is not None else GROUPED_MM_ALIGN if device_type == "cuda" else 1,
                         buckets=bucketed and not compiled, device_buckets=bucketed and compiled)
    if (device_type == "cpu" and dtype == torch.float32 and linear is F.linear and not compiled
            and cpu_grouped_fp32(flags)):
        return GroupedMM(align or 1)
    return ExpertLoop(linear, align or 1)


class ExpertsDispatch(Protocol):
    """Brings the (token, expert) pairs to ``experts`` and their outputs back: ``tokens`` [N, H] and their
    routing ``weights`` [N, 1] sorted by expert, ``counts`` [E] of them per expert (all ``E`` experts of the
    layer) -> [N, H], row for row. Without one, the layer's own experts compute them all (``GroupedExperts``);
    expert parallelism sends them to the ranks holding their experts (``parallel/expert_parallel.py``)."""

    def __call__(self, tokens: torch.Tensor, counts: torch.Tensor, weights: torch.Tensor,
                 experts: GroupedExperts, group_rows: int | None = None) -> torch.Tensor: ...


class RouterStats(NamedTuple):
    """One sparse layer's routing of one forward, as the balancing losses need it (docs/moe.md)."""

    counts: torch.Tensor  # [E] fp32: this rank's (token, slot) pairs per expert (no gradient)
    probs_sum: torch.Tensor  # [E] fp32: the router probabilities summed over this rank's tokens (with gradient)
    z_sum: torch.Tensor | None  # []: the squared log-sum-exps of the logits summed over the tokens, when asked
    dropped: torch.Tensor | None = None  # []: this rank's pairs dropped at the experts' capacity


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


class Capacity:
    """How many (token, expert) pairs each expert takes at most, and which it keeps (docs/moe.md, "Capacity and
    dropping").

    ``factor``: the capacity ``C = ceil(factor x pairs / E)``, pairs the ``top_k`` pairs of every token of the
    set it is decided over. ``gather``: concatenates a tensor over the ranks that split a micro-batch's
    tokens for the layer (dp x cp, and tp when ep borrows it: ``ParallelDims.token_mesh``), over which the
    decision is taken whole (scope "micro_batch", ``group_size`` ranks; parallel/expert_parallel.py:
    ``gather_over``); None for one rank or for scope "rank" (each rank decides over its own tokens,
    Megatron's way, which depends on the layout). An expert keeps the pairs whose routing weight
    is above the (C+1)-th largest of its pairs' weights over the set: at most C, the most probable, and the
    same set on any layout, since a pair's fate depends on the weights alone, not on where it was computed
    or in which order; pairs tied at that boundary weight drop together (so a tie never needs an order).
    ``pad``: every expert's run padded to its bound, ``group_rows``, for fixed shapes; ``senders``: the
    ranks whose pairs reach one copy of an expert (ep, or 1).
    """

    def __init__(self, factor: float, *, pad: bool = False,
                 gather: Callable[[torch.Tensor], torch.Tensor] | None = None, group_size: int = 1,
                 senders: int = 1) -> None:
        self.factor, self.pad, self.gather, self.senders = factor, pad, gather, senders
        self.group_size = group_size if gather is not None else 1

    def limit(self, num_pairs: int, num_experts: int) -> int:
        """C for a rank holding ``num_pairs`` pairs (every rank of the group holds as many)."""
        return math.ceil(self.factor * num_pairs * self.group_size / num_experts)

    def group_rows(self, num_tokens: int, num_pairs: int, num_experts: int) -> int | None:
        """The rows one copy of an expert can receive at most (pad-to-capacity's run length), None without
        ``pad``: C per deciding set (one for scope "micro_batch", one per sending rank for "rank"), and never
        more than the tokens of the sending ranks (a token takes an expert once)."""
        if not self.pad:
            return None
        sets = 1 if self.gather is not None else self.senders
        return min(self.limit(num_pairs, num_experts) * sets, num_tokens * self.senders)

    def kept_rows(self, counts: torch.Tensor, num_pairs: int) -> int:
        """How many of the ``num_pairs`` pairs the experts keep (``counts`` [E] each), read on the host (the
        one sync dropping adds; the dispatch under expert parallelism reads its splits anyway). The scale
        simulation plays it."""
        return int(counts.sum())

    @torch.no_grad()
    def keep(self, chosen: torch.Tensor, weights: torch.Tensor, num_experts: int) -> torch.Tensor:
        """Which of the pairs ``chosen`` [T, k] with routing ``weights`` [T, k] (fp32) each expert keeps:
        [T, k] bool."""
        experts, probs = chosen.reshape(-1), weights.detach().float().reshape(-1)
        limit = self.limit(experts.numel(), num_experts)
        every = torch.stack([experts.float(), probs], 1)  # expert ids below 2^24: exact in fp32
        if self.gather is not None:
            every = self.gather(every)  # [group_size x T x k, 2]: a few bytes per pair, not the hidden states
        bound = boundary_weights(every[:, 0].long(), every[:, 1], num_experts, limit)
        return (probs > bound[experts]).view_as(chosen)


def boundary_weights(experts: torch.Tensor, probs: torch.Tensor, num_experts: int, limit: int) -> torch.Tensor:
    """Each expert's (``limit`` + 1)-th largest weight among the pairs ``experts`` [M] / ``probs`` [M]; -1
    (below every weight) for an expert with at most ``limit`` pairs: [E]."""
    by_prob = probs.argsort(descending=True)
    by_expert = by_prob[experts[by_prob].argsort(stable=True)]  # expert ascending, weight descending
    counts = expert_counts(experts, num_experts)
    at = (counts.cumsum(0) - counts + limit).clamp(max=max(probs.numel() - 1, 0))
    return torch.where(counts > limit, probs[by_expert][at], -1.0)


class GroupedExperts(nn.Module):
    """``num_experts`` SwiGLU MLPs of ``hidden`` -> ``intermediate`` -> ``hidden``, stacked; ``dispatch``
    (set when the model is parallelized) when they live on several ranks; ``capacity``: how many pairs each
    expert takes (None: dropless, every pair computed)."""

    def __init__(self, num_experts: int, hidden: int, intermediate: int, kernel: ExpertsKernel,
                 capacity: Capacity | None = None) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.gate_proj = nn.Parameter(torch.empty(num_experts, intermediate, hidden))
        self.up_proj = nn.Parameter(torch.empty(num_experts, intermediate, hidden))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden, intermediate))
        self.kernel = kernel
        self.capacity = capacity
        self.dispatch: ExpertsDispatch | None = None

    def kept(self, chosen: torch.Tensor, weights: torch.Tensor) -> torch.Tensor | None:
        """Which pairs the experts take ([T, k] bool, ``Capacity.keep``), None when dropless."""
        return None if self.capacity is None else self.capacity.keep(chosen, weights, self.num_experts)

    def forward(self, x: torch.Tensor, chosen: torch.Tensor, weights: torch.Tensor,
                keep: torch.Tensor | None = None) -> torch.Tensor:
        """``x`` [T, H], ``chosen`` and ``weights`` [T, k] -> [T, H]: each token's weighted expert outputs;
        ``keep`` [T, k]: the pairs computed (``kept``), the others contributing nothing."""
        num_tokens, top_k = chosen.shape
        flat = chosen.reshape(-1)
        if keep is not None:  # a dropped pair sorts last, as if to an expert E, and is cut off
            flat = flat.masked_fill(~keep.reshape(-1), self.num_experts)
        order = flat.argsort(stable=True)  # (token, slot) pairs grouped by expert, tokens in order within each
        counts = expert_counts(flat, self.num_experts + (keep is not None))[:self.num_experts]
        if keep is not None:
            order = order[:self.capacity.kept_rows(counts, flat.numel())]
        pairs, pair_weights = x.index_select(0, order // top_k), weights.reshape(-1, 1)[order]
        rows = None if self.capacity is None else self.capacity.group_rows(
            num_tokens, flat.numel(), self.num_experts)
        if self.dispatch is not None:
            y = self.dispatch(pairs, counts, pair_weights, self, rows)
        else:
            y = self.kernel(pairs, counts, pair_weights, self.gate_proj, self.up_proj, self.down_proj, rows)
        if keep is not None:  # each kept pair's output to its (token, slot); a dropped one's stays zero
            # index_put keeps only ``order`` for backward (index_copy would keep ``y``, as in pad_groups)
            y = y.new_zeros(flat.numel(), y.shape[1]).index_put((order,), y)
            return y.view(num_tokens, top_k, -1).sum(1)
        # Back to (token, slot) order, then each token's k outputs summed.
        back = torch.empty_like(order).scatter_(0, order, torch.arange(order.numel(), device=order.device))
        return y[back].view(num_tokens, top_k, -1).sum(1)


class Fp32Router(nn.Linear):
    """The router's projection computed in fp32 whatever the dtype of its weight and input (both upcast for
    this one matmul, [T, H] x [H, E]; the logits stay fp32): a bf16 logit keeps 8 significant bits, and the
    top-k of 128 close logits rounded to them differs from the fp32 top-k for a few percent of the tokens
    (docs/moe.md). The gradients return in the weight's and the input's dtypes; backward keeps the inputs as
    they are (a MoE layer keeps its bf16 input for the experts anyway; an fp32 copy would add 4 H bytes per
    token and layer, 1.5 GiB per micro-batch of 4096 tokens in Qwen3-30B-A3B). Works on DTensors and under
    compile; its name and parameter are ``nn.Linear``'s, so plans, FSDP, checkpoints and HF files treat it as
    one."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32 and self.weight.dtype == torch.float32:
            return F.linear(x, self.weight)
        return fp32_logits(x, self.weight)


class MoE(nn.Module):
    """The sparse MLP: router ``gate`` (an ``nn.Linear`` of ``linear``'s class, as transformers names it, or
    ``Fp32Router`` where ``router_fp32``) and ``experts``.

    ``report``: ``forward`` returns (output, ``RouterStats``) instead of the output alone, with ``z_sum``
    where ``z_loss`` (the training engine's balancing losses read them: ``RouterObserver``).
    ``balanced``: a benchmark mode that routes token ``t``'s slot ``j`` to expert ``(t * top_k + j) mod E``
    (perfect balance, as published MoE throughput figures assume), weighted by the router's probabilities
    of those experts; the model then no longer computes what it was trained to.
    ``expert_bias``: the layer holds a per-expert bias [E] (fp32, a persistent buffer: saved in checkpoints,
    not in HF files) added to the probabilities for the top-k choice only (aux-loss-free balancing; the
    training engine updates it, train/balance.py); None without it.
    ``capacity``: each expert takes at most that many of its pairs (``Capacity``), None: dropless.
    """

    def __init__(self, hidden: int, num_experts: int, top_k: int, intermediate: int, norm_topk_prob: bool, *,
                 kernel: ExpertsKernel, linear: type[nn.Linear] = nn.Linear, report: bool = False,
                 z_loss: bool = False, balanced: bool = False, router_fp32: bool = False,
                 expert_bias: bool = False, capacity: Capacity | None = None) -> None:
        super().__init__()
        self.gate = (Fp32Router if router_fp32 else linear)(hidden, num_experts, bias=False)
        self.register_buffer(EXPERT_BIAS, torch.zeros(num_experts) if expert_bias else None)
        self.experts = GroupedExperts(num_experts, hidden, intermediate, kernel, capacity)
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
        elif self.expert_bias is not None:  # the bias chooses; the weights stay the router's probabilities
            chosen = (probs + self.expert_bias.float()).topk(self.top_k, dim=-1).indices
            weights = probs.gather(1, chosen)
        else:
            weights, chosen = probs.topk(self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        keep = self.experts.kept(chosen, weights)  # None when dropless (``capacity``: docs/moe.md)
        out = self.experts(x, chosen, weights.to(x.dtype), keep).view(shape)
        if not self.report:
            return out
        z_sum = logits.float().logsumexp(-1).pow(2).sum() if self.z_loss else None
        dropped = None if keep is None else (~keep).sum().float()
        return out, RouterStats(expert_counts(chosen, probs.shape[1]).float(), probs.sum(0), z_sum, dropped)

    def round_robin(self, num_tokens: int, num_experts: int, device: torch.device) -> torch.Tensor:
        slots = torch.arange(num_tokens * self.top_k, device=device).view(num_tokens, self.top_k)
        return slots % num_experts
