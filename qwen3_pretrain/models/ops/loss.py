"""LM head + cross-entropy in chunks of tokens, vocab-parallel under tensor parallelism.

Full fp32 logits for batch 4 x seq 8192 x vocab 151,936 take 20 GB per device.
``fused_linear_cross_entropy`` never holds more than one chunk of them: for
each chunk of tokens the forward pass computes the logits, the loss *and* the
gradients (softmax - one-hot) at once, folds them into the gradients of the
hidden states and of the head's weight, and drops the chunk. Backward then only
scales the stored gradients by the incoming gradient of the loss. What a chunk
needs is ``chunk_tokens x V_local`` fp32 logits, whatever the inputs' dtype
(bf16 matmuls write into and read from the same bytes): 2.5 GB for 4096
tokens of Qwen3's vocab, divided by tp.

Under tensor parallelism each rank holds rows ``vocab_start … vocab_start +
V_local`` of the head. Per token, the max logit (MAX), the sum of exponentials
and the target logit (SUM, contributed by the one rank that owns the target id)
are all-reduced over ``tp_group``; each rank's gradient of the hidden states is
a partial sum over its vocab rows, so it is all-reduced once at the end. The
gradient of the weight stays local, like the weight.

``ChunkedLMHead`` is the ``nn.Linear`` the engine builds as a stage's ``lm_head``: plain
logits without labels, the fused loss sum with them; it understands a weight
that is a DTensor sharded over the vocab on a 1-D tensor-parallel mesh.
``TiedLMHead`` does the same with the embedding's weight, for a tied model
whose embedding and head are on the same pipeline stage.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from qwen3_pretrain.errors import UserError
from qwen3_pretrain.models.ops.precision import LOW_PRECISION, fp32_linear

# A label the loss skips (no token to predict there), as PyTorch's cross-entropy default.
IGNORE_INDEX = -100


@dataclass(frozen=True)
class _Options:
    ignore_index: int
    chunk_tokens: int
    tp_group: dist.ProcessGroup | None
    vocab_start: int
    valid_vocab: int | None
    compute_grads: bool
    fp32_matmul: bool
    check_labels: bool


def fused_linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    *,
    ignore_index: int = -100,
    chunk_tokens: int = 4096,
    tp_group: dist.ProcessGroup | None = None,
    vocab_start: int = 0,
    valid_vocab: int | None = None,
    fp32_matmul: bool = False,
    check_labels: bool = True,
) -> torch.Tensor:
    """Sum over non-ignored tokens of ``cross_entropy(hidden @ weight.T, labels)``.

    ``hidden`` [..., H] (bf16, fp16, fp32 or fp64), ``weight`` [V_local, H] the
    rows ``vocab_start … vocab_start + V_local`` of the head (the whole head
    when ``tp_group`` is None), ``labels`` [...] global token ids or
    ``ignore_index``. Logits are computed in the inputs' dtype, softmax and loss
    in fp32 (fp64 for fp64 inputs), which is also the dtype of the returned
    scalar. Global ids ``>= valid_vocab`` are padding rows of the head and never
    predicted. Returns a sum so the caller can divide by the number of valid
    tokens over all micro-batches and data-parallel ranks. Under autocast the
    inputs are cast to the autocast dtype first, as ``F.linear`` would. With
    ``fp32_matmul`` and bf16/fp16 inputs, the matmuls run on fp32 copies of
    the inputs and the logits' gradient stays fp32 (for CPUs without native
    bf16, see ``models/ops/precision.py``); the gradients are returned in the
    inputs' dtypes.

    With ``check_labels``, a label that is neither a token id below
    ``valid_vocab`` (in the head) nor ``ignore_index`` is a UserError, found
    with one read of the device. A model's heads (below) are built without the
    check: training's token ids are checked on the host where the batch is made
    (data/reader.py), so its loss makes the device wait for nothing (unchecked,
    such a label has no target logit).
    """
    hidden, weight = _autocast_inputs(hidden, weight)
    _check_inputs(hidden, weight, labels, chunk_tokens, valid_vocab)
    opts = _Options(ignore_index, chunk_tokens, tp_group, vocab_start, valid_vocab, torch.is_grad_enabled(),
                    fp32_matmul and hidden.dtype in LOW_PRECISION, check_labels)
    return _FusedLinearCrossEntropy.apply(hidden, weight, labels, opts)


def _autocast_inputs(hidden: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    device = hidden.device.type
    if not torch.is_autocast_enabled(device):
        return hidden, weight
    dtype = torch.get_autocast_dtype(device)
    return hidden.to(dtype), weight.to(dtype)


def _check_inputs(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                  chunk_tokens: int, valid_vocab: int | None) -> None:
    if weight.dim() != 2 or weight.shape[1] != hidden.shape[-1]:
        raise UserError(f"LM head weight has shape {tuple(weight.shape)}, expected [vocab, {hidden.shape[-1]}] "
                        f"to match hidden states of shape {tuple(hidden.shape)}")
    if weight.shape[0] == 0:
        raise UserError("this rank's shard of the LM head has no vocab rows: pad the vocab to a multiple of tp")
    if hidden.dtype != weight.dtype:
        raise UserError(f"hidden states are {hidden.dtype} but the LM head weight is {weight.dtype}: "
                        "cast one of them (or run under autocast)")
    if labels.shape != hidden.shape[:-1] or labels.is_floating_point():
        raise UserError(f"labels must be integer ids of shape {tuple(hidden.shape[:-1])}, "
                        f"got {labels.dtype} of shape {tuple(labels.shape)}")
    if chunk_tokens < 1:
        raise UserError(f"chunk_tokens must be at least 1, got {chunk_tokens}")
    if valid_vocab is not None and valid_vocab < 1:
        raise UserError(f"valid_vocab must be at least 1, got {valid_vocab}")


class _FusedLinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                opts: _Options) -> torch.Tensor:
        input_dtype = weight.dtype
        if opts.fp32_matmul:  # temporaries; the gradients return in the inputs' dtype
            hidden, weight = hidden.float(), weight.float()
        flat_hidden = hidden.reshape(-1, hidden.shape[-1])  # [N, H]
        flat_labels = labels.reshape(-1).long()  # [N]
        num_tokens = flat_labels.numel()
        compute = torch.promote_types(hidden.dtype, torch.float32)
        # Gradients are computed only when autograd will ask for them (not in eval).
        grad_hidden = _zeros_if(opts.compute_grads and ctx.needs_input_grad[0], flat_hidden.shape, hidden,
                                input_dtype)
        want_weight_grad = opts.compute_grads and ctx.needs_input_grad[1]
        loss = torch.zeros((), dtype=compute, device=hidden.device)
        unmatched = torch.zeros(num_tokens if opts.check_labels else 0, dtype=torch.bool, device=hidden.device)
        scratch = _Scratch(min(opts.chunk_tokens, num_tokens), weight, compute,
                           num_chunks=-(-num_tokens // opts.chunk_tokens))
        # Autocast already happened in the caller; inside, every dtype is chosen explicitly.
        with torch.autocast(hidden.device.type, enabled=False):
            # A fixed chunk order keeps the fp32 accumulations deterministic.
            for start in range(0, num_tokens, opts.chunk_tokens):
                end = min(start + opts.chunk_tokens, num_tokens)
                chunk_grad_hidden = None if grad_hidden is None else grad_hidden[start:end]
                loss += _chunk(flat_hidden[start:end], weight, flat_labels[start:end], opts, scratch,
                               chunk_grad_hidden, want_weight_grad, unmatched[start:end])
        if opts.check_labels:
            _check_labels(flat_labels, unmatched, opts)
        if grad_hidden is not None and opts.tp_group is not None:
            dist.all_reduce(grad_hidden, group=opts.tp_group)  # sum of the vocab shards' partials
        grad_weight = scratch.weight_grad_result().to(input_dtype) if want_weight_grad else None
        ctx.save_for_backward(None if grad_hidden is None else grad_hidden.view(hidden.shape), grad_weight)
        return loss

    @staticmethod
    def backward(ctx, grad_loss: torch.Tensor):
        grad_hidden, grad_weight = ctx.saved_tensors
        return (
            None if grad_hidden is None else grad_hidden * grad_loss,
            None if grad_weight is None else grad_weight * grad_loss,
            None,
            None,
        )


def _zeros_if(needed: bool, shape: torch.Size, like: torch.Tensor,
              dtype: torch.dtype | None = None) -> torch.Tensor | None:
    return torch.zeros(shape, dtype=dtype or like.dtype, device=like.device) if needed else None


class _Scratch:
    """The fp32 logits buffer [chunk_tokens, V_local] that every chunk reuses, and the weight's gradient.

    A fresh multi-GB tensor per chunk costs as much in page faults as the
    softmax itself on CPU; a GPU's caching allocator would not mind either way.
    With bf16 (fp16) inputs the matmul's output and the logits' gradient in that
    dtype live in the same buffer's bytes (``low_view``), converted in place
    (``_upcast_in_place``, ``_downcast_in_place``): a chunk keeps ``n x V_local``
    fp32 logits and nothing else of that size (it kept a separate bf16 buffer,
    half as large again, before; the arithmetic is the same to the bit).

    The weight's gradient over several chunks in bf16 is the fp32 sum of the
    chunks' bf16 products, rounded once. Each chunk's product is written into the
    buffer's bytes that the chunk's bf16 gradient leaves free (``spare_view``),
    so beside the logits the loss holds, with two chunks, only the first chunk's
    product, to which the second is added by one bf16 addition (computed in fp32,
    rounded once: the same bits); with three or more, only the fp32 sum, rounded
    once the logits are gone. (It held a bf16 product buffer and the fp32 sum
    before: 1.5x the weight in fp32 bytes, the same arithmetic.)
    """

    def __init__(self, rows: int, weight: torch.Tensor, compute: torch.dtype, num_chunks: int = 1) -> None:
        shape = (rows, weight.shape[0])
        self.logits = torch.empty(shape, dtype=compute, device=weight.device)  # softmax math
        self.compute = compute
        self.low_dtype = weight.dtype  # the matmuls' dtype: the inputs'
        self.same_dtype = weight.dtype == compute
        assert self.same_dtype or compute.itemsize == 2 * weight.dtype.itemsize, (compute, weight.dtype)
        self.num_chunks = num_chunks
        # [V_local, H] in the inputs' dtype: the gradient (one chunk), the first chunk's product (two chunks)
        self.weight_grad: torch.Tensor | None = None
        # the running sum over three or more chunks in the compute dtype, when the inputs are in a lower one
        self.weight_sum: torch.Tensor | None = None

    def low_view(self, rows: int, upper: bool) -> torch.Tensor:
        """[rows, V_local] in the inputs' dtype over the bytes of the buffer's first ``rows`` rows:
        their upper half (the matmul's output, before the upcast) or lower half (the logits'
        gradient, after the downcast). Both are contiguous, so the matmuls see a plain matrix."""
        flat = self.logits[:rows].view(self.low_dtype).view(-1)  # 2 x rows x V_local elements
        size = rows * self.logits.shape[1]
        return (flat[size:] if upper else flat[:size]).view(rows, -1)

    def spare_view(self, rows: int, shape: torch.Size) -> torch.Tensor:
        """``shape`` in the inputs' dtype over the buffer's bytes after a ``rows``-row chunk's bf16 gradient
        (``low_view(rows, upper=False)``), whose fp32 logits are spent by then; a new tensor where the
        buffer has too few such bytes (a chunk of fewer tokens than the hidden size)."""
        flat = self.logits.view(self.low_dtype).view(-1)
        start, size = rows * self.logits.shape[1], shape.numel()
        if start + size > flat.numel():
            return torch.empty(shape, dtype=self.low_dtype, device=self.logits.device)
        return flat[start:start + size].view(shape)

    def add_weight_grad(self, grad_logits: torch.Tensor, hidden: torch.Tensor) -> None:
        """Add one chunk's ``grad_logits.T @ hidden`` to the weight's gradient. With one chunk the
        matmul's output is the gradient: no fp32 sum, no rounding pass."""
        if self.weight_grad is None and self.weight_sum is None and (self.same_dtype or self.num_chunks <= 2):
            self.weight_grad = torch.mm(grad_logits.T, hidden)
        elif self.same_dtype:  # fp32 / fp64 inputs: accumulate in place
            self.weight_grad.addmm_(grad_logits.T, hidden)
        else:
            shape = torch.Size((grad_logits.shape[1], hidden.shape[1]))
            product = torch.mm(grad_logits.T, hidden, out=self.spare_view(len(grad_logits), shape))
            if self.weight_grad is not None:  # the second of two: fp32 sum of the two, rounded once
                self.weight_grad.add_(product)
            elif self.weight_sum is None:
                self.weight_sum = product.to(self.compute)
            else:
                self.weight_sum += product

    def weight_grad_result(self) -> torch.Tensor:
        """The weight's gradient in the inputs' dtype (an fp32 sum is rounded once, after the logits are freed)."""
        if self.weight_sum is not None:
            self.logits = None
            self.weight_grad, self.weight_sum = self.weight_sum.to(self.low_dtype), None
        return self.weight_grad


def _chunk(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, opts: _Options, scratch: _Scratch,
           grad_hidden: torch.Tensor | None, grad_weight: bool, unmatched: torch.Tensor) -> torch.Tensor:
    """Loss sum of one chunk of n tokens; writes its gradient of the hidden states into ``grad_hidden``
    and, with ``grad_weight``, adds its gradient of the weight to ``scratch``.

    ``unmatched`` [n] (empty without ``check_labels``) is set where a non-ignored
    label is owned by no rank (an id outside the vocabulary), for ``_check_labels``.
    """
    logits, num_local = _chunk_logits(hidden, weight, opts, scratch)  # [n, V_local], fp32 or fp64
    valid = labels != opts.ignore_index  # [n]
    local_ids = labels - opts.vocab_start
    owned = valid & (local_ids >= 0) & (local_ids < num_local)
    local_ids = torch.where(owned, local_ids, 0)[:, None]  # [n, 1], in range for gather/scatter
    row_max = logits.amax(dim=-1)  # [n]
    _all_reduce(row_max, dist.ReduceOp.MAX, opts.tp_group)
    target = torch.where(owned, logits.gather(1, local_ids).squeeze(1), 0.0)
    probs = logits.sub_(row_max[:, None]).exp_()  # in place: unnormalized softmax
    stats = torch.stack([probs.sum(dim=-1), target, owned.to(probs.dtype)])  # [3, n]
    _all_reduce(stats, dist.ReduceOp.SUM, opts.tp_group)
    sum_exp, target, num_owners = stats
    if opts.check_labels:
        unmatched.copy_(valid & (num_owners != 1))
    if grad_hidden is not None or grad_weight:
        # d loss / d logits = softmax - one-hot, zero on ignored tokens
        probs.mul_(torch.where(valid, sum_exp.reciprocal(), 0.0)[:, None])
        grad_logits = probs.scatter_add_(1, local_ids, -owned.to(probs.dtype)[:, None])
        if not scratch.same_dtype:
            grad_logits = _downcast_in_place(grad_logits, scratch.low_view(len(labels), upper=False))
        if grad_hidden is not None:
            if grad_hidden.dtype == grad_logits.dtype:  # [n, H], partial over the vocab shards
                torch.mm(grad_logits, weight, out=grad_hidden)
            else:  # fp32_matmul: fp32 products, returned in the inputs' dtype
                grad_hidden.copy_(grad_logits @ weight)
        if grad_weight:
            scratch.add_weight_grad(grad_logits, hidden)
    return torch.where(valid, row_max + sum_exp.log() - target, 0.0).sum()


def _chunk_logits(hidden: torch.Tensor, weight: torch.Tensor, opts: _Options,
                  scratch: _Scratch) -> tuple[torch.Tensor, int]:
    """(logits [n, V_local] in fp32 (fp64) with padding ids at -inf, number of local non-padding ids)."""
    n = hidden.shape[0]
    if scratch.same_dtype:
        logits = torch.mm(hidden, weight.T, out=scratch.logits[:n])
    else:  # the matmul in the inputs' dtype into the upper half of the fp32 rows' bytes, then upcast there
        logits = _upcast_in_place(torch.mm(hidden, weight.T, out=scratch.low_view(n, upper=True)),
                                  scratch.logits[:n])
    num_local = weight.shape[0]
    if opts.valid_vocab is not None:
        num_local = min(max(opts.valid_vocab - opts.vocab_start, 0), num_local)
        logits[:, num_local:] = float("-inf")
    return logits, num_local


# Rows converted through a separate temporary at the one end where a row's source and destination
# overlap: one row (0.3 MiB of a 151,936 vocab in bf16) for log2(n) + 1 copy calls per conversion.
_TAIL_ROWS = 1


def _upcast_in_place(low: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """``out.copy_(low)`` where ``low`` [n, V] (2-byte elements) is the upper half of ``out``'s [n, V]
    fp32 bytes. Rows ``a … b`` are copied in one call once their fp32 bytes end before ``low``'s row
    ``a`` (``2b <= n + a``), so no call reads what it writes and every row it overwrites was converted
    before: rows 0 … n/2, then n/2 … 3n/4, …, log2(n) calls; the last row, whose fp32 bytes cover
    its own source, through a copy of it."""
    n, start = low.shape[0], 0
    while n - start > 0:
        end = (n + start) // 2
        if end - start < _TAIL_ROWS:
            out[start:].copy_(low[start:].clone())
            break
        out[start:end].copy_(low[start:end])
        start = end
    return out


def _downcast_in_place(high: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """``out.copy_(high)`` where ``out`` [n, V] (2-byte elements) is the lower half of ``high``'s [n, V]
    fp32 bytes. Rows ``a … b`` are copied in one call once their 2-byte bytes end before ``high``'s
    row ``a`` (``b <= 2a``), overwriting only fp32 rows below ``a``, converted before: the first
    row through a temporary, then rows 1 … 2, 2 … 4, 4 … 8, …, doubling."""
    n = high.shape[0]
    start = min(n, _TAIL_ROWS)
    out[:start].copy_(high[:start].to(out.dtype))
    while start < n:
        end = min(2 * start, n)
        out[start:end].copy_(high[start:end])
        start = end
    return out


def _all_reduce(tensor: torch.Tensor, op: dist.ReduceOp, group: dist.ProcessGroup | None) -> None:
    if group is not None:
        dist.all_reduce(tensor, op=op, group=group)


def _check_labels(labels: torch.Tensor, unmatched: torch.Tensor, opts: _Options) -> None:
    """Raise the UserError of the labels owned by no rank, naming the first (the call's one host read)."""
    if labels.numel() == 0:
        return
    first = labels.gather(0, unmatched.to(torch.uint8).argmax().reshape(1))  # labels[0] when none is bad
    count, first = torch.cat([unmatched.sum().reshape(1), first]).tolist()
    if not count:
        return
    limit = f"below valid_vocab={opts.valid_vocab}" if opts.valid_vocab is not None else "in the LM head's vocab"
    raise UserError(f"{count} label(s) are not token ids {limit} nor ignore_index={opts.ignore_index} "
                    f"(first: {first}): check that the data was tokenized for this model's vocab_size")


class _FusedLossHead:
    """``forward`` shared by the two heads below: ``self.weight``, ``chunk_tokens``, ``valid_vocab``, ``ignore_index``,
    ``check_labels``."""

    weight: torch.Tensor
    chunk_tokens: int
    valid_vocab: int | None
    ignore_index: int
    fp32_matmul: bool  # multiply bf16 in fp32 (CPUs without native bf16, see models/ops/precision.py)
    # Off by default: a model's head serves training, whose token ids are checked where the batch is made
    # (data/reader.py), and the check would make every loss call wait for the device.
    check_labels: bool

    def forward(self, h: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        """Logits without ``labels``; with them, the loss sum (``check_labels``: see fused_linear_cross_entropy)."""
        if labels is None:
            return fp32_linear(h, self.weight) if self.fp32_matmul else F.linear(h, self.weight)
        weight, tp_group, vocab_start = _local_vocab_shard(self.weight)
        return fused_linear_cross_entropy(
            _full(h), weight, _full(labels), ignore_index=self.ignore_index, chunk_tokens=self.chunk_tokens,
            tp_group=tp_group, vocab_start=vocab_start, valid_vocab=self.valid_vocab, fp32_matmul=self.fp32_matmul,
            check_labels=self.check_labels,
        )


class ChunkedLMHead(_FusedLossHead, nn.Linear):
    """The LM head as an ``nn.Linear`` whose loss never materializes the full logits.

    ``forward(h)`` returns plain logits (generation, evaluation); ``forward(h,
    labels)`` returns ``fused_linear_cross_entropy``'s loss sum. ``weight`` may
    be a DTensor sharded over the vocab (``Shard(0)``, even or not) on a 1-D
    tensor-parallel mesh; ``h`` (and ``labels``) may be DTensors too,
    e.g. sequence-parallel ``Shard(1)``: they are gathered to the full tensor
    first, so without DTensors ``h`` must be the same on every tp rank.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = False, *,
                 chunk_tokens: int = 4096, valid_vocab: int | None = None, ignore_index: int = -100,
                 fp32_matmul: bool = False, check_labels: bool = False, device: torch.device | str | None = None,
                 dtype: torch.dtype | None = None) -> None:
        if bias:
            raise UserError("ChunkedLMHead has no bias: Qwen3's LM head has none")
        super().__init__(in_features, out_features, bias=False, device=device, dtype=dtype)
        self.chunk_tokens = chunk_tokens  # tokens per chunk: its logits take chunk_tokens x V_local x 4 B
        self.valid_vocab = valid_vocab  # real vocab size when the head is padded to a multiple of tp
        self.ignore_index = ignore_index
        self.fp32_matmul, self.check_labels = fp32_matmul, check_labels

    @classmethod
    def from_linear(cls, linear: nn.Linear, *, chunk_tokens: int = 4096, valid_vocab: int | None = None,
                    ignore_index: int = -100, fp32_matmul: bool = False, check_labels: bool = False) -> ChunkedLMHead:
        """A head sharing ``linear``'s weight Parameter (same object), so parameter names and ties survive."""
        if linear.bias is not None:
            raise UserError("cannot build a ChunkedLMHead from a Linear with a bias: Qwen3's LM head has none")
        head = cls(linear.in_features, linear.out_features, chunk_tokens=chunk_tokens, valid_vocab=valid_vocab,
                   ignore_index=ignore_index, fp32_matmul=fp32_matmul, check_labels=check_labels, device="meta")
        head.weight = linear.weight
        return head

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, chunk_tokens={self.chunk_tokens}, valid_vocab={self.valid_vocab}"


class TiedLMHead(_FusedLossHead, nn.Module):
    """A tied LM head on the embedding's stage: no parameter of its own, it applies the embedding's.

    ``weight`` is looked up on the embedding at each call, so it is whatever the
    parallel wrappers made of it at that moment (a tp-sharded DTensor, FSDP's
    gathered weight inside a step), and autograd adds the head's gradient to the
    embedding's. The embedding is referenced, not registered, so the model's
    parameters and state dict hold the tied weight once (as ``embed_tokens.weight``).
    """

    def __init__(self, embedding: nn.Module, *, chunk_tokens: int = 4096, valid_vocab: int | None = None,
                 ignore_index: int = -100, fp32_matmul: bool = False, check_labels: bool = False) -> None:
        super().__init__()
        self.tie_to(embedding)
        self.chunk_tokens, self.valid_vocab, self.ignore_index = chunk_tokens, valid_vocab, ignore_index
        self.fp32_matmul, self.check_labels = fp32_matmul, check_labels

    def tie_to(self, embedding: nn.Module) -> None:
        """Apply ``embedding``'s weight from now on (tensor parallelism replaces the embedding module)."""
        self._embedding = (embedding,)  # a tuple: not a submodule

    @property
    def weight(self) -> torch.Tensor:
        return self._embedding[0].weight

    def extra_repr(self) -> str:
        return f"tied to the embedding, chunk_tokens={self.chunk_tokens}, valid_vocab={self.valid_vocab}"


def _full(tensor: torch.Tensor) -> torch.Tensor:
    """The whole tensor on every rank. Differentiable: the gradient of a sharded
    DTensor is then the local slice of the (replicated) full gradient."""
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def _local_vocab_shard(weight: torch.Tensor) -> tuple[torch.Tensor, dist.ProcessGroup | None, int]:
    """(local rows, tp group or None, global id of the first local row) of the head's weight."""
    if not isinstance(weight, DTensor):
        return weight, None, 0
    mesh = weight.device_mesh
    if mesh.ndim != 1 or not weight.placements[0].is_shard(0):
        raise UserError(f"the LM head weight must be sharded on dim 0 (vocab) over a 1-D tp mesh, "
                        f"got placements {weight.placements} on a {mesh.ndim}-D mesh")
    local = weight.to_local()
    # Shard(0) splits like torch.chunk: ceil(vocab / tp) rows per rank, the last ranks shorter.
    vocab = weight.shape[0]
    rows_per_rank = -(-vocab // mesh.size())
    vocab_start = min(mesh.get_local_rank() * rows_per_rank, vocab)
    assert local.shape[0] == min(rows_per_rank, vocab - vocab_start), "unexpected Shard(0) layout"
    return local, mesh.get_group(), vocab_start
