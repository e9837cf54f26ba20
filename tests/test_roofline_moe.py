"""The roofline's byte counts of gathers (the embedding lookup and its kin) and of the MoE experts' padded
groups, against figures worked out by hand."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from qwen3_pretrain.simulate.roofline import RecordingMode


def meta(*shape, dtype=torch.bfloat16):
    return torch.empty(*shape, dtype=dtype, device="meta")


def index(n: int) -> torch.Tensor:
    return torch.zeros(n, dtype=torch.int64, device="meta")


def recorded_bytes(fn) -> int:
    with RecordingMode() as rec:
        fn()
    return rec.trace.memory["forward"].eager_bytes


def test_row_gathers_move_the_rows_they_gather_not_the_whole_table():
    """An embedding lookup of 128 tokens in a 4,096 x 64 bf16 table reads 128 rows of 128 bytes, the int64
    index and writes 128 rows: 16 KiB + 1 KiB + 16 KiB, not the 512 KiB table. ``index_select`` and advanced
    indexing alike (along dim 1: 4,096 rows x 8 columns gathered); ``take`` one element per index."""
    table, idx = meta(4096, 64), index(128)
    rows = 128 * 64 * 2
    assert recorded_bytes(lambda: F.embedding(idx, table)) == rows + 128 * 8 + rows
    assert recorded_bytes(lambda: table.index_select(0, idx)) == rows + 128 * 8 + rows
    assert recorded_bytes(lambda: table[idx]) == rows + 128 * 8 + rows
    cols, idx8, idx100 = 4096 * 8 * 2, index(8), index(100)
    assert recorded_bytes(lambda: table.index_select(1, idx8)) == cols + 8 * 8 + cols
    assert recorded_bytes(lambda: table.take(idx100)) == 100 * 2 + 100 * 8 + 100 * 2


def test_embedding_backward_writes_the_whole_table_it_zero_fills():
    """``embedding_dense_backward`` reads the 128 rows' gradient and the index and writes the [4,096, 64]
    gradient of the table (zero-filled, then the rows added): 16 KiB + 1 KiB + 512 KiB."""
    grad, idx = meta(128, 64), index(128)
    nbytes = recorded_bytes(lambda: torch.ops.aten.embedding_dense_backward(grad, idx, 4096, -1, False))
    assert nbytes == 128 * 64 * 2 + 128 * 8 + 4096 * 64 * 2


# --- the compiled CPU experts' row buckets ----------------------------------------------------------------------

def test_device_buckets_are_the_host_buckets_and_the_bound_holds():
    """``bucket_sizes`` (on the device, for compiled steps) equals ``bucket_rows`` (read on the host, eager)
    count for count; ``bucket_bound`` holds every split of the rows, at the worst cases too (17 rows -> 32,
    257 -> 272: a bucket's whole step less one each), and is a multiple of ``CPU_BUCKET_MIN``."""
    from qwen3_pretrain.models.ops.moe import CPU_BUCKET_MIN, bucket_bound, bucket_rows, bucket_sizes

    counts = torch.arange(0, 70000)
    assert bucket_sizes(counts).tolist() == bucket_rows(counts)
    gen = torch.Generator().manual_seed(0)
    splits = [torch.full((16,), 17), torch.full((16,), 257), torch.full((8,), 4097), torch.zeros(16, dtype=torch.long)]
    splits += [torch.multinomial(torch.rand(16, generator=gen), 8192, replacement=True, generator=gen).bincount(
        minlength=16) for _ in range(50)]
    for c in splits:
        n, e = int(c.sum()), c.numel()
        bound = bucket_bound(n, e)
        assert sum(bucket_rows(c)) <= bound and bound % CPU_BUCKET_MIN == 0
    assert bucket_bound(16 * 17, 16) == 544  # 272 + 16 x 15 + 17 = 529, rounded up to a multiple of 16
    assert sum(bucket_rows(torch.full((16,), 17))) == 16 * 32 <= 544


def _block_inputs(counts: list[int], hidden: int = 64, width: int = 32):
    torch.manual_seed(0)
    n, e = sum(counts), len(counts)
    leaves = (torch.randn(n, hidden), torch.rand(n, 1), torch.randn(e, width, hidden), torch.randn(e, width, hidden),
              torch.randn(e, hidden, width))
    return torch.tensor(counts), [t.to(torch.bfloat16).requires_grad_() for t in leaves]


def _run(fn, counts, leaves):
    x, w, gate, up, down = leaves
    y = fn(x, counts, w, gate, up, down)
    return [y, *torch.autograd.grad(y.float().square().sum(), leaves)]


def test_compiled_cpu_experts_compute_on_bucketed_groups_with_the_same_values():
    """A CPU's bf16 experts under compile pad their groups to the row buckets on the device: the grouped
    products see the bucketed row counts (the last group the slack up to the bound), so oneDNN meets the few
    bucket shapes rather than a new shape per group and step; the outputs and all five gradients are bitwise
    those of the unpadded groups at these sizes (zero rows add nothing; in a larger group the padding can
    change how the weight gradients' sums are blocked, their last bit: one bf16 ulp, seen at 1,533 rows, as
    with the eager buckets), and the padding compiles into one graph (no host read)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from qwen3_pretrain.models.ops import moe as M

    compiled, eager = M.experts_kernel("cpu", torch.bfloat16, compiled=True), M.experts_kernel("cpu", torch.bfloat16)
    assert compiled.device_buckets and not compiled.buckets and eager.buckets and not eager.device_buckets
    sizes = [0, 300, 17, 33, 100, 50, 60, 40]
    counts, leaves = _block_inputs(sizes)

    class Groups(TorchDispatchMode):
        seen: list = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func is torch.ops.aten._grouped_mm.default and args[1].dim() == 3:
                offs = (kwargs or {}).get("offs", args[2] if len(args) > 2 else None)
                ends = [0] + offs.tolist()
                self.seen.append([b - a for a, b in zip(ends, ends[1:])])
            return func(*args, **(kwargs or {}))

    with Groups():
        padded = _run(compiled, counts, leaves)
    buckets = [0, 304, 32, 48, 112, 64, 64, 48]
    bound = M.bucket_bound(sum(sizes), len(sizes))
    assert Groups.seen[0] == buckets[:-1] + [bound - sum(buckets[:-1])]
    reference = _run(M.GroupedMM(1), counts, leaves)
    for a, b in zip(padded, reference):
        assert torch.equal(a, b)
    torch._dynamo.reset()
    graphed = _run(torch.compile(lambda *a: compiled(*a), fullgraph=True), counts, leaves)
    for a, b in zip(graphed, reference):  # inductor's fused SwiGLU rounds once where eager rounds per op
        torch.testing.assert_close(a.float(), b.float(), rtol=0.02, atol=0.02 * b.float().abs().max().item())


def test_the_planner_pads_compiled_cpu_experts_to_the_kernels_bound():
    """The planner's padded rows per routed token for a compiled CPU bf16 layout are the kernel's bound:
    2,048 tokens x top-4 = 8,192 pairs over 16 experts pad to at most 8,192 + 16 x 15 + 512 rows."""
    from qwen3_pretrain.models.ops.moe import bucket_bound
    from qwen3_pretrain.models.qwen3.config import Qwen3Config
    from qwen3_pretrain.plan import layers as L
    from qwen3_pretrain.plan.layout import Layout

    cfg = Qwen3Config(hidden_size=256, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      head_dim=64, intermediate_size=512, vocab_size=1024, num_experts=16, num_experts_per_tok=4,
                      moe_intermediate_size=128, norm_topk_prob=True)
    layout = Layout(micro_batch_size=1, seq_length=2048, activation_checkpointing="none", device_type="cpu",
                    compile=True)
    assert L.moe_cpu_device_buckets(layout) and not L.moe_cpu_buckets(layout) and L.moe_groups_padded(layout)
    assert layout.moe_tokens == 2048 and layout.moe_rank_load == 1
    assert L.moe_padded_rows_per_token(cfg, layout) * 2048 == 8192 + 16 * 15 + 512 == bucket_bound(8192, 16)
    assert not L.moe_cpu_device_buckets(Layout(device_type="cpu", compile=True, mixed_precision="fp32"))
