"""``compile: true`` is clean, asserted through dynamo's own counters so that a regression fails: for a dense, a
Qwen3-MoE and a hybrid (Qwen3.5-MoE: Gated DeltaNet, gated attention, a shared expert, the MTP layer, document
starts) tiny model, under each recompute mode, no graph break and one compiled graph per layer kind (the layers
of a kind share their code: no recompile per layer), and the compiled model computes what the eager one does
(fp32, loss and gradient norm within 1e-5 relative, the balancing losses' figures too). Under expert
parallelism (ep 2, two gloo processes) a compiled training run equals an eager one-process run."""

from __future__ import annotations

import copy
import re

import pytest
import torch
import torch.nn.functional as F
from torch._dynamo.utils import counters

from qwen3_pretrain.models.qwen3.config import Qwen3Config
from qwen3_pretrain.models.qwen3.model import ModelOptions, Qwen3Model
from qwen3_pretrain.parallel.parallelize import compile_stage_layers
from qwen3_pretrain.train.balance import RouterBalance
from qwen3_pretrain.train.compile_report import compile_summary
from tests._train_helpers import check_ok, make_corpus, run_train, step_records, worst_relative_diff, write_config

DENSE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
             head_dim=16, vocab_size=256, max_position_embeddings=256, tie_word_embeddings=False, bos_token_id=0,
             eos_token_id=1)
# layer 0 dense, the others sparse: two layer kinds
MOE = dict(DENSE, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True,
           mlp_only_layers=[0])
HYBRID = dict(DENSE, model_type="qwen3_5_moe_text", layer_types=["linear_attention", "full_attention"] * 2,
              linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
              num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48,
              mtp_num_hidden_layers=1, rope_theta=1e6, partial_rotary_factor=0.25)
MODELS = {"dense": DENSE, "moe": MOE, "hybrid": HYBRID}
RTOL = 1e-5


def _build(cfg: Qwen3Config, recompute: str) -> tuple[Qwen3Model, RouterBalance | None]:
    balance = RouterBalance(cfg, "global_batch", 0.3, 0.05, mtp=cfg.is_hybrid) if cfg.is_moe else None
    options = ModelOptions(recompute=recompute, router_observer=balance, document_mask=cfg.is_hybrid,
                           multi_token_prediction=cfg.is_hybrid)
    return Qwen3Model(cfg, options), balance


def _step(model: Qwen3Model, balance: RouterBalance | None, ids: torch.Tensor, positions: torch.Tensor):
    """(loss, gradient norm, balancing figures) of one forward and backward."""
    model.zero_grad()
    if balance is not None:
        balance.start_step(1)
    out = model(ids, positions, mtp_input=ids) if model.mtp is not None else model(ids, positions)
    logits = out if isinstance(out, tuple) else (out,)  # the main head's, and the MTP layer's (one token on)
    loss = sum(F.cross_entropy(o[:, :-1 - k].flatten(0, 1).float(), ids[:, 1 + k:].flatten())
               for k, o in enumerate(logits))
    loss.backward()
    norm = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in model.parameters() if p.grad is not None]))
    figures = balance.step_figures(balance.local_stats(torch.device("cpu"))) if balance is not None else {}
    return loss.item(), norm.item(), figures


def _layer_kinds(model: Qwen3Model) -> int:
    layers = [*model.layers.values(), *(model.mtp.layers.values() if model.mtp is not None else ())]
    return len({(layer.linear, type(layer.mlp), layer.reports_routing) for layer in layers})


@pytest.mark.slow
@pytest.mark.parametrize("name, recompute", [("dense", "selective"), ("moe", "none"), ("moe", "full"),
                                             ("hybrid", "mlp"), ("hybrid", "full")])
def test_compiled_layers_have_no_graph_break_and_one_graph_per_kind(name, recompute):
    cfg = Qwen3Config(**MODELS[name])
    eager, eager_balance = _build(cfg, recompute)  # initialized as training starts (init_weights)
    compiled, balance = _build(cfg, recompute)
    compiled.load_state_dict(eager.state_dict())
    torch._dynamo.reset()
    counters.clear()
    compile_stage_layers(compiled, tensor_parallel=False)
    gen = torch.Generator().manual_seed(0)
    positions = torch.cat([torch.arange(20), torch.arange(12)]).repeat(2, 1)  # two documents per row
    for _ in range(2):  # the second step must reuse the first one's code
        ids = torch.randint(0, cfg.vocab_size, (2, 32), generator=gen)
        want, got = _step(eager, eager_balance, ids, positions), _step(compiled, balance, ids, positions)
        for w, g in zip(want[:2], got[:2]):
            assert abs(g - w) <= RTOL * abs(w), (got, want)
        for key, value in want[2].items():
            assert got[2][key] == pytest.approx(value, rel=RTOL, abs=1e-7), key
    summary = compile_summary()
    kinds = _layer_kinds(compiled)
    print(name, recompute, summary.line())
    assert summary.graph_breaks == 0, summary.break_reasons
    assert summary.graphs == kinds, summary.line()
    assert summary.recompiles == kinds - 1, summary.line()  # one compile per further layer kind, not per layer


@pytest.mark.slow
@pytest.mark.distributed
def test_compiled_expert_parallel_training_equals_one_eager_process(tmp_path):
    """ep 2 over two processes, the layers compiled, the dispatch's all-to-alls and host-read split sizes
    traced inside them: the loss, gradient norm and balancing losses of one eager process, within 1e-5."""
    model = dict(MOE, vocab_size=512, tie_word_embeddings=True)
    setup = dict(model_overrides=model, total_steps=2, save_steps=0, moe_aux_loss_coef=0.1, moe_z_loss_coef=0.01)
    corpus = make_corpus(tmp_path / "corpus")
    runs = {}
    for label, nproc, overrides in (("eager", 1, ["batch_size=4"]),
                                    ("compiled-ep2", 2, ["batch_size=2", "ep=2", "compile=true"])):
        config = write_config(tmp_path / f"{label}.yaml", corpus, tmp_path / label, **setup)
        proc = run_train(config, nproc, *overrides, timeout=900)
        check_ok(proc)
        runs[label] = (step_records(tmp_path / label), proc.stdout + proc.stderr)
    (want, _), (got, log) = runs["eager"], runs["compiled-ep2"]
    for key in ("loss", "grad_norm", "moe_aux_loss", "moe_z_loss"):
        worst = worst_relative_diff([r[key] for r in got], [r[key] for r in want])
        assert worst <= RTOL, f"{key} differs by {worst:.2e}"
    line = re.search(r"compiled (\d+) graphs? in \d+ frames?: (\d+) graph breaks?, (\d+) recompiles?", log)
    assert line is not None, log[-3000:]
    # the dense layer whole; the sparse layers' attention, norms and experts (an FSDP unit of their own) each
    # compiled apart, the router between them eager: one graph each, shared by the layers
    assert (int(line[1]), int(line[2]), int(line[3])) == (4, 0, 0), line[0]


def test_the_compile_line_names_a_graph_break():
    """The log line after the first compiled step counts a break and says dynamo's reason for it."""
    torch._dynamo.reset()
    counters.clear()

    @torch.compile(backend="eager")
    def broken(x):
        x = x + 1
        torch._dynamo.graph_break()
        return x * 2

    broken(torch.ones(3))
    summary = compile_summary()
    assert summary.graph_breaks == 1 and summary.graphs == 2, summary.line()
    assert re.search(r"compiled 2 graphs in \d+ frames?: 1 graph break, 0 recompiles; graph breaks \(run eager\): "
                     r".+", summary.line()), summary.line()
