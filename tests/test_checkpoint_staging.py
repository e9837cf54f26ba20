"""Asynchronous saves stage the state into host memory allocated once and reused: on a CPU (no page-locked
memory without an accelerator) ordinary memory, the checkpoints still holding each save's own values, and
the time training waited for the copy said on the save's log line and recorded for metrics.jsonl."""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

from qwen3_pretrain.checkpoint.layout import step_dir_name
from qwen3_pretrain.checkpoint.manager import Checkpointer


def _staged_storages(checkpointer: Checkpointer) -> list[int]:
    return sorted(s.data_ptr() for s in checkpointer._stager._state_dict_stager._cached_storage_mapping.values())


def test_async_saves_reuse_their_host_memory_and_keep_each_saves_values(world_of_one, tmp_path, caplog):
    model = nn.Linear(8, 4)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 8)).sum().backward()
    opt.step()
    records = []
    checkpointer = Checkpointer(tmp_path, [model], [opt], keep_last_n=0, async_save=True, record=records.append)
    options = checkpointer._stager._config
    assert not options.use_pinned_memory and not options.use_non_blocking_copy  # a CPU's parameters
    saved = {}
    with caplog.at_level(logging.INFO, logger="qwen3_pretrain.checkpoint"):
        for step in (1, 2):
            with torch.no_grad():
                model.weight.add_(1.0)
            saved[step] = model.weight.detach().clone()
            checkpointer.save(step, {"tokens_seen": step})
            with torch.no_grad():
                model.weight.add_(100.0)  # after the save returned: not in its checkpoint
            checkpointer.wait()
            if step == 1:
                first = _staged_storages(checkpointer)
    assert first and _staged_storages(checkpointer) == first  # the second save copied into the first's memory
    assert sum("training waited" in r.getMessage() for r in caplog.records) == 2
    want = [("checkpoint", step, step_dir_name(step)) for step in (1, 2)]
    assert [(r["event"], r["step"], r["path"]) for r in records] == want
    for record in records:  # the log line's figure, from the same measurement
        assert 0 <= record["training_waited_s"] <= record["save_s"]
        waited = f"training waited {record['training_waited_s']:.2f} s"
        line = f"saved checkpoint {tmp_path / record['path']} "
        assert any(r.getMessage().startswith(line) and waited in r.getMessage() for r in caplog.records)
    for step in (1, 2):
        checkpointer.load(tmp_path / step_dir_name(step))
        assert torch.equal(model.weight.detach(), saved[step])
    checkpointer.close()
