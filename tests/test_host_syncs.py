"""Device-to-host syncs per steady-state training step, counted with a stand-in on the CPU
(tests/_host_syncs.py), so that none creeps back into the step unnoticed.

What a step may read on the host: its figures (loss, gradient norm, the stop flag, whether a rank's batch
held a token id outside the vocabulary, the MoE and MTP figures), in one copy between backward and the optimizer step, which needs the loss and the norm
to skip a non-finite update and to clip. Beyond that, only what a kernel chosen for the run needs: one matmul
per expert (the fp32 experts' kernel, ``ExpertLoop``) reads each MoE layer's token counts; the bf16 grouped
GEMM reads nothing on an accelerator (on a CPU, where nothing waits, its row buckets read the counts); flash-linear-attention's Gated DeltaNet kernel reads a micro-batch's document offsets
once (below, with a stand-in kernel: the CPU runs ours, which reads nothing).
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch

from qwen3_pretrain.models.ops.delta_rule import FlaDeltaRule
from qwen3_pretrain.models.ops.gated_delta import chunk_gated_delta_rule
from qwen3_pretrain.models.ops.moe import cpu_grouped_fp32
from tests._host_syncs import HostSyncCounter, _drop_line
from qwen3_pretrain.data.synthetic import write_synthetic_dataset
from tests._train_helpers import (TINY_MODEL, check_ok, child_env, free_port, make_corpus, ranks_launch, run_train,
                                  write_config)

STEP_READ = "to at train/engine.py _read"  # the step's figures, one copy
MOE = dict(TINY_MODEL, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True)
HYBRID = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
              linear_key_head_dim=16, linear_value_head_dim=16, vocab_size=512, mtp_num_hidden_layers=1,
              layer_types=["linear_attention", "full_attention"] * 2)
MOE_SETUP = dict(model_overrides=MOE, moe_aux_loss_coef=0.1, moe_z_loss_coef=0.01)
# name -> (processes, config overrides, the syncs of one step). Two micro-batches per rank each.
RUNS = {
    "dense": (1, {}, {STEP_READ: 1}),
    "dense-dp2": (2, {"batch_size": 1}, {STEP_READ: 1}),
    "dense-pp2": (2, {"pp": 2}, {STEP_READ: 1}),  # the pipeline schedule's loss calls and messages
    # on an accelerator the bf16 grouped GEMM reads nothing; on a CPU (here) its row buckets read each layer's
    # token counts, 4 MoE layers x 2 micro-batches (models/ops/moe.py bucket_rows: the host is the device)
    "moe-bf16-grouped-gemm": (1, dict(MOE_SETUP, mixed_precision="bf16"),
                              {STEP_READ: 1, "tolist at models/ops/moe.py bucket_rows": 8}),
    # 4 MoE layers x 2 micro-batches of the expert loop's token counts; none where fp32 experts run grouped
    # (CPUs with AMX or avx512_bf16, models/ops/moe.py cpu_grouped_fp32)
    "moe-fp32-experts": (1, MOE_SETUP, {STEP_READ: 1} if cpu_grouped_fp32() else
                         {STEP_READ: 1, "tolist at models/ops/moe.py sizes": 8}),
    # Gated DeltaNet on packed documents, the MTP layer trained, every layer recomputed
    "hybrid-mtp-recompute": (1, dict(model_name="qwen3.5-0.8b", model_overrides=HYBRID, document_mask=True,
                                     mtp_loss_weight=0.3, activation_checkpointing="full"), {STEP_READ: 1}),
}


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    return make_corpus(tmp_path_factory.mktemp("syncs") / "corpus")


def _syncs_per_step(tmp_path: Path, corpus: Path, nproc: int, overrides: dict) -> list[list[Counter]]:
    """Per rank, per counted step: how many syncs each place made (two warm-up steps, then two counted)."""
    config = write_config(tmp_path / "c.yaml", corpus, tmp_path / "out", total_steps=10,
                          gradient_accumulation_steps=2, **overrides)
    script = ["-m", "tests._host_syncs", str(config), str(tmp_path)]
    launch = [sys.executable] if nproc == 1 else ranks_launch(nproc) + [sys.executable]
    check_ok(subprocess.run(launch + script, capture_output=True, text=True, timeout=600, env=child_env(),
                            cwd=Path(__file__).resolve().parents[1]))
    ranks = []
    for rank in range(nproc):
        steps = json.loads((tmp_path / f"rank_{rank}.json").read_text())
        ranks.append([Counter({_without_line(key): n for key, n in step.items()}) for step in steps])
    return ranks


def _without_line(key: str) -> str:
    op, site = key.split(" at ", 1)
    return f"{op} at {_drop_line(site)}"


@pytest.mark.parametrize("name", list(RUNS))
def test_a_steady_state_step_reads_the_device_once(tmp_path, corpus, name):
    nproc, overrides, want = RUNS[name]
    for rank, steps in enumerate(_syncs_per_step(tmp_path, corpus, nproc, overrides)):
        for got in steps:
            assert got == Counter(want), f"rank {rank}: {dict(got)}"


def test_a_token_outside_the_vocabulary_stops_training_with_its_id(tmp_path):
    """Checked on the host where the batch is made (data/reader.py), where the ids already are: on the device an
    input id would fail in the embedding (a device assert on CUDA) before anything could name it. The step
    that carries the record stops with it, through the CLI's message (no traceback)."""
    # the manifest claims the model's vocabulary; every document holds an id beyond it
    docs = [np.where(np.arange(40) == 5, 600, (7 + np.arange(40)) % 500) for _ in range(20)]
    corpus = tmp_path / "corpus"
    write_synthetic_dataset(corpus, docs, eod_id=511, vocab_size=512)
    proc = run_train(write_config(tmp_path / "c.yaml", corpus, tmp_path / "out", total_steps=2))
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0 and "Traceback" not in out, out[-3000:]
    assert "of the training data holds token id 600, not in [0, 512) (the model's vocab_size)" in out, out[-3000:]


_BAD_TOKEN_STEP = """
import sys, torch
import torch.distributed as dist
from qwen3_pretrain.config.loader import load_config
from qwen3_pretrain.data.reader import GlobalBatchLoader
from qwen3_pretrain.errors import UserError
from qwen3_pretrain.train.config import TrainConfig
from qwen3_pretrain.train.trainer import Trainer

class OneBadLabel:  # the training data, with an id no input carries as sample BAD's last label
    def __init__(self, data, bad):
        self.data, self.bad, self.seed, self.seq_length = data, bad, data.seed, data.seq_length
    def __getitem__(self, index):
        sample = self.data[index]
        if index == self.bad:
            sample["labels"][-1] = 600
        return sample

trainer = Trainer(load_config(TrainConfig, sys.argv[1], []))
engine, rank = trainer.engine, dist.get_rank()
loader = GlobalBatchLoader(OneBadLabel(trainer.train_data, int(sys.argv[2])), engine.global_batch, rank,
                           dist.get_world_size(), trainer.cfg.batch_size, vocab_size=512)
batches = next(loader)
local = lambda p: p.detach().to_local() if hasattr(p, "to_local") else p.detach()
before = [local(p).clone() for p in engine.params]
try:
    engine.step(batches, 1e-3, bad_token=loader.bad_token)
    report = f"rank {rank} stepped"
except UserError as exc:
    unchanged = all(torch.equal(a, local(p)) for a, p in zip(before, engine.params))
    held = loader.bad_token is not None
    report = f"rank {rank} raised: {exc} | held a bad id: {held} | weights unchanged: {unchanged}"
# one write of the whole line: two ranks' prints (text, then its newline) interleaved on the shared pipe
sys.stdout.write(report + "\\n")
sys.stdout.flush()
trainer.close()
"""


def test_a_token_outside_the_vocabulary_on_one_rank_stops_every_rank_with_its_id(tmp_path, corpus):
    """Only dp rank 1's share of the step holds the bad id (the last label of the global batch's last sample):
    both ranks end, with the same message, before the update."""
    config = write_config(tmp_path / "c.yaml", corpus, tmp_path / "out", batch_size=1, gradient_accumulation_steps=2)
    script = tmp_path / "bad_token_step.py"
    script.write_text(_BAD_TOKEN_STEP)
    last = 1 * 2 * 2 - 1  # global batch: batch_size x dp x accumulation
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
                           str(free_port()), str(script), str(config), str(last)], capture_output=True, text=True,
                          timeout=600, env=child_env(), cwd=Path(__file__).resolve().parents[1])
    out = proc.stdout + proc.stderr
    message = (f"raised: sample {last} of the training data holds token id 600, not in [0, 512) (the model's "
               "vocab_size)")
    for rank, held in ((0, False), (1, True)):
        line = next((x for x in proc.stdout.splitlines() if x.startswith(f"rank {rank} ")), "")
        assert message in line and f"held a bad id: {held} | weights unchanged: True" in line, out[-4000:]


def test_the_counter_sees_each_kind_of_read():
    x = torch.arange(6.0)
    with HostSyncCounter() as syncs:
        x.sum().item()
        bool(x[0])
        x.tolist()
        x[x > 2]
        (x > 2).nonzero()
        host = x.to("cpu", copy=True)  # the one counted copy; what follows reads the host's copy
        host.tolist()
        float(host.max())
        x.cumsum(0)  # no read
    ops = [op for op, _ in syncs.events]
    assert ops == ["_local_scalar_dense", "_local_scalar_dense", "tolist", "index", "nonzero", "to"]
    assert all(site.startswith("test_host_syncs.py:") for _, site in syncs.events)


# --- flash-linear-attention's offsets: once per micro-batch --------------------------------------------------------

def _fla_stand_in(calls: list[torch.Tensor]):
    """flash-linear-attention's chunk_gated_delta_rule in its variable-length mode, computed by ours: records
    the offsets it is handed."""
    def chunk(q, k, v, g, beta, *, cu_seqlens, use_qk_l2norm_in_kernel):
        calls.append(cu_seqlens)
        starts = torch.zeros(q.shape[:2], dtype=torch.bool, device=q.device)
        starts[0, cu_seqlens[:-1].long()] = True
        return chunk_gated_delta_rule(q, k, v, g, beta, starts=starts, use_qk_l2norm=use_qk_l2norm_in_kernel)[0], None
    return chunk


def test_fla_offsets_are_found_once_per_micro_batch_for_every_layer_and_the_recompute(tiny_config):
    from qwen3_pretrain.models.qwen3.model import ModelOptions, Qwen3Model

    cfg = tiny_config(layer_types=["linear_attention", "full_attention"] * 2, num_hidden_layers=4,
                      partial_rotary_factor=0.25, linear_num_key_heads=2, linear_num_value_heads=4,
                      linear_key_head_dim=8, linear_value_head_dim=8, linear_conv_kernel_dim=4,
                      model_type="qwen3_5_text")
    calls: list[torch.Tensor] = []
    fla = Qwen3Model(cfg, ModelOptions(delta_rule=FlaDeltaRule(_fla_stand_in(calls)), document_mask=True,
                                       recompute="full"))
    ours = Qwen3Model(cfg, ModelOptions(document_mask=True))
    ours.load_state_dict(fla.state_dict())
    gen = torch.Generator().manual_seed(0)
    for cut in (5, 9):  # two micro-batches, documents cut in other places
        ids = torch.randint(0, cfg.vocab_size, (2, 16), generator=gen)
        positions = torch.cat([torch.arange(cut), torch.arange(16 - cut)]).repeat(2, 1)
        calls.clear()
        with HostSyncCounter() as syncs:
            out = fla(ids, positions)
            out.square().sum().backward()
        offsets = [n for site, n in syncs.by_site().items() if "models/ops/delta_rule.py" in site]
        assert offsets == [1], syncs.by_site()
        assert len(calls) == 4 and all(t is calls[0] for t in calls)  # 2 layers, forward and recompute
        assert calls[0].tolist() == [0, cut, 16, 16 + cut, 32]
        torch.testing.assert_close(out, ours(ids, positions), rtol=1e-5, atol=1e-5)


def test_fla_offsets_of_whole_rows_need_no_read():
    kernel = FlaDeltaRule(chunk=lambda *a, **k: None)
    with HostSyncCounter() as syncs:
        first, again = kernel.offsets(None, 2, 8, torch.device("cpu")), kernel.offsets(None, 2, 8, torch.device("cpu"))
    assert syncs.events == [] and first is again and first.tolist() == [0, 8, 16]
