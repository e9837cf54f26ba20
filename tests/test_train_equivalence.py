"""Every parallel layout trains to the same per-step losses as one process (fp32, same data and init),
and one process matches an independent plain-PyTorch training loop."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from qwen3_pretrain.data.reader import GlobalBatchLoader, PackedDataset
from qwen3_pretrain.models.qwen3 import Qwen3Config, Qwen3Model
from qwen3_pretrain.train.config import TrainConfig
from qwen3_pretrain.train.optim import lr_at
from tests._train_helpers import TINY_MODEL, check_ok, losses, make_corpus, run_train, write_config

GLOBAL_BATCH = 4
RTOL = 1e-4


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return make_corpus(tmp_path_factory.mktemp("corpus"))


@pytest.fixture(scope="module")
def reference(corpus, tmp_path_factory):
    """The single-process run: batch 2 x accumulation 2 = global batch 4."""
    tmp = tmp_path_factory.mktemp("single")
    cfg = write_config(tmp / "c.yaml", corpus, tmp / "out", gradient_accumulation_steps=2)
    check_ok(run_train(cfg, 1))
    return losses(tmp / "out")


def plain_loop_losses(corpus, steps: int = 5) -> list[float]:
    """Independent reference: the plain model, full logits, F.cross_entropy, torch AdamW."""
    cfg = TrainConfig(model_name="qwen3-0.6b", data_path=str(corpus), seq_length=64, batch_size=4, total_steps=steps,
                      learning_rate=3e-3, warmup_steps=1, mixed_precision="fp32", seed=7)
    torch.manual_seed(0)
    model = Qwen3Model(Qwen3Config(**TINY_MODEL))
    model.init_weights(cfg.seed)
    decay = [p for n, p in model.named_parameters() if not (n.endswith("norm.weight") or "embed" in n)]
    rest = [p for n, p in model.named_parameters() if n.endswith("norm.weight") or "embed" in n]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": cfg.weight_decay}, {"params": rest, "weight_decay": 0}],
                            lr=cfg.learning_rate, betas=(cfg.adam_beta1, cfg.adam_beta2), eps=cfg.adam_eps)
    loader = GlobalBatchLoader(PackedDataset(corpus, 64, seed=cfg.seed), GLOBAL_BATCH, 0, 1, GLOBAL_BATCH)
    out = []
    for step in range(steps):
        (batch,) = next(loader)
        logits = model(batch["input_ids"])
        loss = F.cross_entropy(logits.float().flatten(0, 1), batch["labels"].flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.clip_grad)
        for group in opt.param_groups:
            group["lr"] = lr_at(step, cfg)
        opt.step()
        opt.zero_grad()
        out.append(loss.item())
    return out


def assert_close(got: list[float], want: list[float], rtol: float = RTOL) -> None:
    assert len(got) == len(want), (got, want)
    worst = max(abs(g - w) / abs(w) for g, w in zip(got, want))
    print(f"max relative loss diff {worst:.2e}")
    assert worst <= rtol, f"losses differ: {got} vs {want}"


def test_single_process_matches_plain_pytorch_loop(reference, corpus):
    assert_close(reference, plain_loop_losses(corpus), rtol=1e-5)
    assert reference[-1] < reference[0], "the loss should fall on a learnable corpus"


LAYOUTS = {
    "tp2": (2, ["tp=2", "gradient_accumulation_steps=2"]),
    "pp2-1f1b": (2, ["pp=2", "gradient_accumulation_steps=2"]),
    "pp2-interleaved": (2, ["pp=2", "pp_schedule=interleaved", "gradient_accumulation_steps=2"]),
    "pp2-gpipe": (2, ["pp=2", "pp_schedule=gpipe", "gradient_accumulation_steps=2"]),
    "dp2-distributed-optimizer": (2, ["distributed_optimizer=true"]),
    "dp2-replicated": (2, ["distributed_optimizer=false"]),
    "dp2-reduce-every-microbatch": (2, ["batch_size=1", "gradient_accumulation_steps=2",
                                        "reduce_grads_every_microbatch=true"]),
    "tp2-pp2-dp2": (8, ["tp=2", "pp=2", "batch_size=2"]),
}


@pytest.mark.distributed
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_layout_matches_single_process(name, reference, corpus, tmp_path):
    nproc, overrides = LAYOUTS[name]
    cfg = write_config(tmp_path / "c.yaml", corpus, tmp_path / "out")
    check_ok(run_train(cfg, nproc, *overrides))
    assert_close(losses(tmp_path / "out"), reference)


@pytest.mark.distributed
def test_held_out_evaluation_is_the_same_under_a_pipeline(corpus, tmp_path):
    evals, trains = [], []
    for name, nproc, extra in (("single", 1, []), ("pp2", 2, ["pp=2"])):
        out = tmp_path / name
        cfg = write_config(tmp_path / f"{name}.yaml", corpus, out, total_steps=3, eval_steps=1, valid_fraction=0.1,
                           eval_iters=2)
        check_ok(run_train(cfg, nproc, *extra))
        records = [json.loads(l) for l in (out / "metrics.jsonl").read_text().splitlines()]
        evals.append([r["eval_loss"] for r in records if r.get("event") == "eval"])
        trains.append(losses(out))
    assert len(evals[0]) == 3 and len(trains[0]) == 3
    assert_close(evals[1], evals[0])
    assert_close(trains[1], trains[0])  # training after each evaluation goes on alike


@pytest.mark.distributed
def test_per_document_positions_and_mask_travel_through_the_pipeline(reference, corpus, tmp_path):
    """document_mask (per-document RoPE positions and attention) under pp: later stages get the positions
    with the hidden states, so every layout matches one process with the same setting."""
    runs = {}
    for name, nproc, extra in (("single", 1, ["gradient_accumulation_steps=2"]),
                               ("pp2-interleaved", 2, ["pp=2", "pp_schedule=interleaved",
                                                       "gradient_accumulation_steps=2"]),
                               ("tp2-pp2", 4, ["tp=2", "pp=2", "gradient_accumulation_steps=2"])):
        cfg = write_config(tmp_path / f"{name}.yaml", corpus, tmp_path / name, document_mask=True)
        check_ok(run_train(cfg, nproc, *extra))
        runs[name] = losses(tmp_path / name)
    assert max(abs(a - b) / abs(b) for a, b in zip(runs["single"], reference)) > 1e-3  # the mask matters here
    assert_close(runs["pp2-interleaved"], runs["single"])
    assert_close(runs["tp2-pp2"], runs["single"])


@pytest.mark.distributed
def test_compiled_layers_train_like_eager_ones(corpus, tmp_path):
    """compile: true gives the eager per-step losses (pp 2 with full recompute, one process per stage)."""
    runs = {}
    for name, extra in (("eager", []), ("compiled", ["compile=true"])):
        cfg = write_config(tmp_path / f"{name}.yaml", corpus, tmp_path / name, total_steps=3)
        check_ok(run_train(cfg, 2, "pp=2", "activation_checkpointing=full", *extra, timeout=600))
        runs[name] = losses(tmp_path / name)
    assert_close(runs["compiled"], runs["eager"], rtol=1e-5)
