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
