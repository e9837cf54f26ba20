"""The MoE router: its logits' precision (``moe_router_dtype``), Megatron's balancing scale
(``moe_aux_loss_scale: megatron``), aux-loss-free balancing (``moe_bias_update_rate``), the MTP layer's MoE in the
balancing loss, and the per-layer load figures.

Each is checked against an independent reference written here: an fp64 matmul, transformers' own router, the
formulas of Megatron-core's switch (global) aux loss and z-loss, the DeepSeek-V3 bias update, a one-process run.
The training runs (a few tiny steps each) check the bias under dp 2 and ep 2, its resume and its merge.
"""

from __future__ import annotations

import copy
import functools
import json
import logging

import pytest
import torch
import torch.nn.functional as F
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeConfig, Qwen3MoeTopKRouter

from qwen3_pretrain.analysis.parse_log import parse_metrics
from qwen3_pretrain.errors import ConfigError
from qwen3_pretrain.models.ops.moe import ExpertLoop, Fp32Router, MoE
from qwen3_pretrain.models.qwen3.config import Qwen3Config
from qwen3_pretrain.models.qwen3.model import ModelOptions, Qwen3Model
from qwen3_pretrain.train.balance import RouterBalance
from qwen3_pretrain.train.config import TrainConfig
from qwen3_pretrain.train.metrics import format_line
from qwen3_pretrain.config import from_dict
from tests._checkpoint_helpers import assert_identical_states, checkpoint_state, resume_from, step_dir
from tests._train_helpers import check_ok, make_corpus, run_train, step_records, write_config
from tests.test_model_parity import randomize
from tests.test_moe_balance import COEF, MOE, Z_COEF, assert_same_grads, lm_loss, microbatches, router_logits, \
    with_balance
from tests.test_moe_balance import moe_model  # noqa: F401 (a fixture)

# --- router precision -------------------------------------------------------------------------------------------

H, E, K, T = 64, 64, 8, 512  # wide enough that bf16 logits choose another top-8 for some tokens


def _routing(moe: MoE, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The (chosen experts, their weights) ``moe`` hands its experts for ``x``."""
    seen = []
    handle = moe.experts.register_forward_pre_hook(lambda mod, args: seen.append((args[1], args[2])))
    with torch.no_grad():
        moe(x)
    handle.remove()
    return seen[0]


def _bf16_moe(router_fp32: bool, seed: int = 0) -> tuple[MoE, torch.Tensor]:
    torch.manual_seed(seed)
    moe = MoE(H, E, K, 16, norm_topk_prob=True, kernel=ExpertLoop(), router_fp32=router_fp32)
    for p in moe.parameters():
        torch.nn.init.normal_(p, std=0.5)
    x = torch.randn(T, H)
    return moe.to(torch.bfloat16), x.to(torch.bfloat16)


def test_fp32_router_logits_are_an_fp32_matmul_of_the_bf16_operands():
    router = Fp32Router(H, E, bias=False).to(torch.bfloat16)
    x = torch.randn(T, H, dtype=torch.bfloat16, requires_grad=True)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        logits = router(x)
    assert saved and all(t.dtype == torch.bfloat16 for t in saved)  # no fp32 copy kept for backward
    want = (x.detach().double() @ router.weight.detach().double().T).float()
    assert logits.dtype == torch.float32
    torch.testing.assert_close(logits, want, rtol=1e-6, atol=1e-6)
    logits.sum().backward()  # the gradients return in the parameters' and inputs' dtypes
    assert router.weight.grad.dtype == torch.bfloat16 and x.grad.dtype == torch.bfloat16


def test_fp32_router_chooses_by_fp32_logits_and_bf16_router_as_transformers():
    fp32_moe, x = _bf16_moe(router_fp32=True)
    bf16_moe = copy.deepcopy(fp32_moe)
    bf16_moe.gate = torch.nn.Linear(H, E, bias=False, dtype=torch.bfloat16)
    bf16_moe.gate.weight = fp32_moe.gate.weight
    # fp32: the top-k of the softmax of an fp64 matmul (rounded to fp32), weights renormalised
    probs = (x.double() @ fp32_moe.gate.weight.double().T).float().softmax(-1)
    want_weights, want_chosen = probs.topk(K, dim=-1)
    chosen, weights = _routing(fp32_moe, x)
    assert torch.equal(chosen, want_chosen)
    torch.testing.assert_close(weights, (want_weights / want_weights.sum(-1, keepdim=True)).to(torch.bfloat16))
    # bf16: transformers' Qwen3-MoE router on the same weight, to the bit
    hf = Qwen3MoeTopKRouter(Qwen3MoeConfig(num_experts=E, num_experts_per_tok=K, hidden_size=H, norm_topk_prob=True))
    hf.weight = torch.nn.Parameter(fp32_moe.gate.weight.detach().clone())
    _, hf_weights, hf_chosen = hf(x)
    chosen_bf16, weights_bf16 = _routing(bf16_moe, x)
    assert torch.equal(chosen_bf16, hf_chosen) and torch.equal(weights_bf16, hf_weights)
    # the two differ (what the setting is for): some tokens get another set of experts
    differ = (chosen.sort(-1).values != chosen_bf16.sort(-1).values).any(-1).float().mean().item()
    print(f"\n[router] tokens with another top-{K} of {E} under bf16 logits: {100 * differ:.1f}%")
    assert differ > 0


def test_fp32_router_under_compile_equals_eager():
    moe, x = _bf16_moe(router_fp32=True, seed=1)
    torch._dynamo.reset()
    # dynamo's trace and AOTAutograd's graph are what the fp32 router must pass (the code generator adds nothing
    # router-specific); fullgraph: no graph break either
    compiled = torch.compile(copy.deepcopy(moe), backend="aot_eager", fullgraph=True)
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), moe(x), rtol=0, atol=0)


def test_training_config_builds_the_chosen_router(tmp_path):
    from qwen3_pretrain.parallel.parallelize import build_stage
    from qwen3_pretrain.models.ops.precision import Fp32Linear
    from qwen3_pretrain.parallel.parallelize import PartSpec

    cfg = Qwen3Config(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=8, vocab_size=64, num_experts=4, num_experts_per_tok=2,
                      moe_intermediate_size=16)
    # on a CPU that computes bf16 matmuls in fp32 (models/ops/precision.py) the bf16 router is the model's
    # Fp32Linear, whose logits are rounded back to bf16 as a native bf16 matmul's; the fp32 one stays fp32
    for fp32_matmul, fp32, cls in ((False, True, Fp32Router), (False, False, torch.nn.Linear),
                                   (True, True, Fp32Router), (True, False, Fp32Linear)):
        part = build_stage(cfg, PartSpec(0, 1, range(1)), 64, 64, fp32_matmul=fp32_matmul, moe_router_fp32=fp32)
        assert type(part.layers["0"].mlp.gate) is cls
    x = torch.randn(5, 32, dtype=torch.bfloat16)
    assert Fp32Linear(32, 4, bias=False).to(torch.bfloat16)(x).dtype == torch.bfloat16
    assert from_dict(TrainConfig, {"data_path": "x"}).moe_router_dtype == "fp32"


# --- router precision under tensor parallelism (2 gloo processes) ------------------------------------------------

def _tp_router(rank: int, world_size: int) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("tp",))
    for local_tokens in (False, True):
        _check_tp_router(mesh, local_tokens)


def _check_tp_router(mesh, local_tokens: bool) -> None:
    """A bf16 hybrid MoE with its MTP layer under tp 2, the MoE layers replicated (``local_tokens`` False) or
    on this rank's share of the sequence (the router's weight a replicated DTensor, its input a sequence
    shard): each router's logits, the MTP layer's too, are fp32 and equal an fp64 matmul of the rank's router
    input; the routers' weights get bf16 gradients; the MTP layer's routing reaches the balancing loss."""
    from qwen3_pretrain.models.qwen3.model import LossHead
    from qwen3_pretrain.parallel.tensor_parallel import apply_tensor_parallel, local_tensor

    cfg = Qwen3Config(**HYBRID_MOE)
    balance = RouterBalance(cfg, "global_batch", COEF, mtp=True)
    options = ModelOptions(router_observer=balance, moe_router_fp32=True, multi_token_prediction=True,
                           loss_head=LossHead())
    model = Qwen3Model(cfg, options).to(torch.bfloat16)
    apply_tensor_parallel(model, mesh, moe_local_tokens=local_tokens)
    captured = []
    for layer in (*model.layers.values(), *model.mtp.layers.values()):
        layer.mlp.gate.register_forward_hook(
            lambda mod, args, out: captured.append((local_tensor(args[0]), local_tensor(out), mod.weight)))
    balance.start_step(1)
    ids = torch.randint(0, cfg.vocab_size, (2, 8), generator=torch.Generator().manual_seed(0))
    main, mtp = model(ids, None, torch.roll(ids, -1, dims=1))  # hidden states (the loss head's input)
    (main.float().square().sum() + mtp.float().square().sum()).backward()
    assert len(captured) == 3
    for x, logits, weight in captured:
        want = (x.detach().double() @ local_tensor(weight).detach().double().T).float()
        assert logits.dtype == torch.float32
        torch.testing.assert_close(logits, want, rtol=1e-6, atol=1e-6)
        assert local_tensor(weight.grad).abs().sum() > 0 and weight.grad.dtype == torch.bfloat16
    load = balance.local_stats(torch.device("cpu"))[2:2 + 3 * cfg.num_experts].view(3, -1)
    assert (load.sum(1) > 0).all()  # the MTP layer's row counted too


@pytest.mark.distributed
def test_fp32_router_under_tensor_parallelism():
    from tests.test_loss import run_distributed

    run_distributed(2, _tp_router)


# --- Megatron's balancing scale -----------------------------------------------------------------------------------

def test_megatron_scale_is_megatrons_global_aux_loss_and_z_loss(moe_model):
    """Megatron-core, per MoE layer and micro-batch m (of M): the switch loss with the global batch's running
    counts, coef * E / (k T^2) * sum_e (sum_t p_te) * (counts_e so far / m), T the micro-batch's tokens; the
    z-loss coef_z * mean_t logsumexp^2; every layer's term added, the step's gradient averaged over M."""
    cfg, model = moe_model
    batches = microbatches(cfg, 3, seed=4)
    balance = RouterBalance(cfg, "global_batch", COEF, Z_COEF, scale="megatron")
    got, figures = with_balance(cfg, model, balance, batches)
    reference = copy.deepcopy(model)
    logits = router_logits(reference)
    num_experts, top_k, steps = cfg.num_experts, cfg.num_experts_per_tok, len(batches)
    running = torch.zeros(cfg.num_hidden_layers, num_experts)
    aux_logged = z_logged = 0.0
    for m, ids in enumerate(batches, start=1):
        logits.clear()
        out = reference(ids)
        aux = z = 0.0
        for layer, layer_logits in enumerate(logits):
            probs = layer_logits.float().softmax(-1)
            tokens = probs.shape[0]
            running[layer] += F.one_hot(probs.topk(top_k, -1).indices, num_experts).sum((0, 1)).float()
            averaged = running[layer].clone() / m  # a copy: the running counts change in place later
            aux = aux + (probs.sum(0) * averaged).sum() * num_experts / (top_k * tokens * tokens)
            z = z + layer_logits.float().logsumexp(-1).square().mean()
        aux_logged += aux.item() / steps
        z_logged += z.item() / steps
        ((lm_loss(out, ids) + COEF * aux + Z_COEF * z) / steps).backward()
    assert figures["moe_aux_loss"] == pytest.approx(aux_logged, rel=1e-6)
    assert figures["moe_z_loss"] == pytest.approx(z_logged, rel=1e-6)
    assert_same_grads(got, {n: p.grad for n, p in reference.named_parameters()})


def test_a_coefficient_converts_between_the_scales(moe_model):
    """docs/moe.md: megatron's coefficient c gives the gradient of mean_over_layers' c L / k (the z-loss's: c L)."""
    cfg, model = moe_model
    num_layers, top_k = cfg.num_hidden_layers, cfg.num_experts_per_tok
    batches = microbatches(cfg, 2, seed=5)
    megatron, _ = with_balance(cfg, model, RouterBalance(cfg, "global_batch", COEF, Z_COEF, scale="megatron"),
                               batches)
    converted, _ = with_balance(cfg, model, RouterBalance(cfg, "global_batch", COEF * num_layers / top_k,
                                                          Z_COEF * num_layers), batches)
    unconverted, _ = with_balance(cfg, model, RouterBalance(cfg, "global_batch", COEF, Z_COEF), batches)
    assert_same_grads(megatron, converted)
    router = "layers.0.mlp.gate.weight"
    assert (megatron[router] - unconverted[router]).abs().max() > 1e-4


def test_megatron_scale_refuses_the_pooled_micro_batch_loss():
    with pytest.raises(ConfigError, match="moe_aux_loss_scale megatron"):
        from_dict(TrainConfig, {"data_path": "x", "moe_aux_loss_scale": "megatron", "moe_aux_loss": "micro_batch"})
    assert from_dict(TrainConfig, {"data_path": "x", "conventions": "megatron"}).moe_aux_loss_scale == "megatron"
    assert from_dict(TrainConfig, {"data_path": "x"}).moe_aux_loss_scale == "mean_over_layers"
    with pytest.raises(ConfigError, match="moe_bias_update_rate"):
        from_dict(TrainConfig, {"data_path": "x", "moe_bias_update_rate": -1e-3})


# --- aux-loss-free balancing ----------------------------------------------------------------------------------------

def test_the_bias_chooses_and_the_probabilities_weigh():
    torch.manual_seed(2)
    moe = MoE(16, 8, 2, 8, norm_topk_prob=False, kernel=ExpertLoop(), expert_bias=True)
    x = torch.randn(32, 16)
    with torch.no_grad():
        moe.expert_bias.copy_(torch.tensor([0, 0, 0, 5.0, 0, 0, 5.0, 0]))  # experts 3 and 6 win every choice
    chosen, weights = _routing(moe, x)
    probs = F.linear(x, moe.gate.weight).softmax(-1)
    assert (chosen.sort(-1).values == torch.tensor([3, 6])).all()
    torch.testing.assert_close(weights, probs.gather(1, chosen))  # unbiased, not renormalised
    assert "expert_bias" in moe.state_dict()
    assert "expert_bias" not in MoE(16, 8, 2, 8, norm_topk_prob=False, kernel=ExpertLoop()).state_dict()


def test_the_bias_update_is_deepseeks_rule(tiny_config):
    cfg = tiny_config(**MOE)
    rate = 1e-3
    balance = RouterBalance(cfg, "none", 0.0, bias_rate=rate)
    model = Qwen3Model(cfg, ModelOptions(router_observer=balance, moe_expert_bias=True))
    balance.attach_biases([model])
    load = torch.randint(0, 20, (cfg.num_hidden_layers, cfg.num_experts)).double()
    balance.update_biases(torch.cat([torch.zeros(2, dtype=torch.float64), load.reshape(-1)]))
    for layer in range(cfg.num_hidden_layers):
        row = load[layer]
        step = [rate * ((1 if c < row.mean() else -1 if c > row.mean() else 0)) for c in row.tolist()]
        want = torch.tensor(step) - sum(step) / len(step)
        torch.testing.assert_close(model.layers[str(layer)].mlp.expert_bias, want.float(), rtol=0, atol=1e-9)


def test_the_bias_balances_a_skewed_router(tiny_config):
    """A router whose experts 0 and 1 every token prefers (their rows moved along the tokens' mean input; the
    router's weights then fixed): the bias alone spreads the load, from 3.2 times the mean to under 1.4."""
    cfg = tiny_config(**dict(MOE, num_hidden_layers=1))
    balance = RouterBalance(cfg, "none", 0.0, bias_rate=0.01)
    model = Qwen3Model(cfg, ModelOptions(router_observer=balance, moe_expert_bias=True))
    randomize(model, seed=3)
    ids = torch.randint(0, cfg.vocab_size, (4, 32), generator=torch.Generator().manual_seed(6))
    inputs = []
    handle = model.layers["0"].mlp.register_forward_pre_hook(lambda mod, args: inputs.append(args[0]))
    with torch.no_grad():
        model(ids)
        handle.remove()
        mean = inputs[0].reshape(-1, cfg.hidden_size).mean(0)
        model.layers["0"].mlp.gate.weight[:2] += mean / mean.norm() ** 2
    balance.attach_biases([model])
    load_max = []
    for _ in range(60):
        balance.start_step(1)
        model(ids)  # grad mode on: the observer counts
        reduced = balance.local_stats(torch.device("cpu"))
        figures = balance.step_figures(reduced)
        balance.update_biases(reduced)
        load_max.append(figures["moe_load_max"])
    print(f"\n[bias] load max/mean {load_max[0]:.2f} -> {load_max[-1]:.2f}")
    assert load_max[0] >= 3.0 and max(load_max[-10:]) <= 1.4
    assert figures["moe_idle_experts"] == 0 and figures["moe_expert_bias_max"] > 0


# --- the MTP layer's MoE in the balancing loss ---------------------------------------------------------------------

HYBRID_MOE = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                  vocab_size=64, model_type="qwen3_5_moe_text", layer_types=["linear_attention", "full_attention"],
                  linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8,
                  num_experts=8, num_experts_per_tok=2, moe_intermediate_size=16, shared_expert_intermediate_size=16,
                  mtp_num_hidden_layers=1, partial_rotary_factor=0.25)


def test_the_mtp_layers_moe_is_in_the_balancing_loss():
    """global_batch over the decoder's sparse layers and the MTP layer's (L = 3), one micro-batch: the objective
    LM + MTP loss + coef x aux, against autograd over the three routers' captured logits."""
    cfg = Qwen3Config(**HYBRID_MOE)
    base = Qwen3Model(cfg, ModelOptions(multi_token_prediction=True))
    randomize(base, seed=4)
    ids = microbatches(cfg, 1, seed=7)[0]
    nxt = torch.roll(ids, -1, dims=1)

    def objective(model):
        main, mtp = model(ids, None, nxt)
        return lm_loss(main, ids) + lm_loss(mtp[:, 1:], ids[:, 1:])

    balance = RouterBalance(cfg, "global_batch", COEF, mtp=True)
    ours = Qwen3Model(cfg, ModelOptions(router_observer=balance, multi_token_prediction=True))
    ours.load_state_dict(base.state_dict())
    balance.start_step(1)
    objective(ours).backward()
    figures = balance.step_figures(balance.local_stats(torch.device("cpu")))
    assert set(figures["moe_layer_load_max"]) == {"0", "1", "mtp.0"}

    reference = copy.deepcopy(base)
    captured = []
    gates = [layer.mlp.gate for layer in (*reference.layers.values(), *reference.mtp.layers.values())]
    for gate in gates:
        gate.register_forward_hook(lambda mod, args, out: captured.append(out))
    loss = objective(reference)
    aux = 0.0
    for layer_logits in captured:
        probs = layer_logits.float().softmax(-1)
        frequency = F.one_hot(probs.topk(2, -1).indices, 8).sum((0, 1)).float() / probs.shape[0]
        aux = aux + 8 * (frequency * probs.mean(0)).sum() / len(captured)
    assert len(captured) == 3
    (loss + COEF * aux).backward()
    assert figures["moe_aux_loss"] == pytest.approx(aux.item(), rel=1e-6)
    assert_same_grads({n: p.grad for n, p in ours.named_parameters()},
                      {n: p.grad for n, p in reference.named_parameters()})


# --- per-layer load figures -------------------------------------------------------------------------------------

def test_idle_experts_is_the_worst_layers_and_each_layer_is_recorded(tiny_config):
    cfg = tiny_config(**MOE)  # 3 sparse layers of 8 experts
    balance = RouterBalance(cfg, "global_batch", COEF)
    load = torch.tensor([[3.0] * 8, [12, 12, 0, 0, 0, 0, 0, 0], [6, 6, 6, 6, 0, 0, 0, 0]])
    figures = balance.step_figures(torch.cat([torch.tensor([2.5, 0.0]), load.reshape(-1), torch.zeros(1)]).double())
    assert figures["moe_idle_experts"] == 0.75  # layer 1's 6 of 8, not the mean over layers (11 / 24)
    assert figures["moe_load_max"] == 4.0
    assert figures["moe_layer_idle_experts"] == {"0": 0.0, "1": 0.75, "2": 0.5}
    assert figures["moe_layer_load_max"] == {"0": 1.0, "1": 4.0, "2": 2.0}
    record = {"step": 3, "total_steps": 9, "loss": 2.5, "lr": 1e-3, "grad_norm": 0.5, "tokens_per_sec": 10.0,
              "tokens_per_sec_per_device": 10.0, "step_time_s": 1.0, "mfu": 0.1, "eta_s": 6.0,
              "memory_gib": 1.0, **figures, "moe_aux_loss": 2.5}
    line = format_line(record)
    assert "| load 4.00 max/mean, 75% idle" in line


def test_the_log_line_still_parses(tmp_path, tiny_config):
    figures = RouterBalance(tiny_config(**MOE), "global_batch", COEF).step_figures(
        torch.cat([torch.tensor([2.5, 0.0]), torch.tensor([[3.0] * 8, [12, 12] + [0] * 6, [3.0] * 8]).reshape(-1),
                   torch.zeros(1)]))
    record = {"step": 3, "total_steps": 9, "loss": 2.5, "lr": 1e-3, "grad_norm": 0.5, "tokens_per_sec": 10.0,
              "tokens_per_sec_per_device": 10.0, "step_time_s": 1.0, "mfu": 0.1, "eta_s": 6.0,
              "memory_gib": 1.0, **figures}
    (tmp_path / "train.log").write_text(format_line(record) + "\n")
    row = parse_metrics(tmp_path / "train.log").rows[0]
    assert row["moe_aux_loss"] == 2.5 and row["moe_load_max"] == 4.0 and row["moe_idle_experts"] == 0.75
    (tmp_path / "metrics.jsonl").write_text(json.dumps(record) + "\n")
    row = parse_metrics(tmp_path / "metrics.jsonl").rows[0]
    assert row["moe_layer_idle_experts"] == {"0": 0.0, "1": 0.75, "2": 0.0}


# --- the bias in training: layouts, resume, merge (gloo processes) -------------------------------------------------

MOE_MODEL = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True)
# a large rate, so that the bias turns choices within a few steps; no balancing loss: the bias alone
SETUP = dict(total_steps=4, save_steps=2, moe_aux_loss="none", moe_bias_update_rate=0.02)
BIAS_RUNS = {"single": (1, ["batch_size=4"]), "dp2": (2, ["batch_size=2"]), "ep2": (2, ["batch_size=2", "ep=2"])}
KEYS = ("loss", "grad_norm", "moe_load_max", "moe_idle_experts", "moe_expert_bias_max")


class BiasRuns:
    def __init__(self, root) -> None:
        self.root, self.corpus = root, make_corpus(root / "corpus")

    def config(self, path, output_path, **overrides):
        from tests._train_helpers import TINY_MODEL

        return write_config(path, self.corpus, output_path, **{**SETUP, "model_overrides": {**TINY_MODEL, **MOE_MODEL},
                                                               **overrides})

    @functools.cache
    def output(self, name: str):
        nproc, overrides = BIAS_RUNS[name]
        run = self.root / name
        run.mkdir()
        check_ok(run_train(self.config(run / "c.yaml", run / "out"), nproc, *overrides, timeout=600))
        return run / "out"


@pytest.fixture(scope="module")
def bias_runs(tmp_path_factory):
    return BiasRuns(tmp_path_factory.mktemp("bias_runs"))


def _biases(state: dict) -> dict[str, torch.Tensor]:
    return {k: v for k, v in state["model"].items() if k.endswith("expert_bias")}


@pytest.mark.distributed
@pytest.mark.parametrize("layout", ["dp2", "ep2"])
def test_the_bias_trains_the_same_under_dp_and_ep(layout, bias_runs, tmp_path):
    want, got = step_records(bias_runs.output("single")), step_records(bias_runs.output(layout))
    assert want[-1]["moe_expert_bias_max"] > 0 and "moe_layer_load_max" in want[-1]
    for key in KEYS:
        for g, w in zip(got, want, strict=True):
            assert g[key] == pytest.approx(w[key], rel=1e-5, abs=1e-9), (layout, key, g["step"])
    mine = _biases(checkpoint_state(step_dir(bias_runs.output(layout), 4), tmp_path))
    theirs = _biases(checkpoint_state(step_dir(bias_runs.output("single"), 4), tmp_path))
    assert len(theirs) == 4 and any(v.abs().max() > 0 for v in theirs.values())
    assert sorted(mine) == sorted(theirs)
    for name, bias in theirs.items():  # sums of +-rate: the same bits whatever the layout
        assert torch.equal(mine[name], bias), name


def test_a_resume_with_the_bias_is_bit_exact(bias_runs, tmp_path):
    single = bias_runs.output("single")
    resume_from(single, 2, tmp_path / "out")
    check_ok(run_train(bias_runs.config(tmp_path / "c.yaml", tmp_path / "out"), 1, "batch_size=4"))
    want = [r for r in step_records(single) if r["step"] > 2]
    assert [[r[k] for k in KEYS] for r in step_records(tmp_path / "out")] == [[r[k] for k in KEYS] for r in want]
    assert_identical_states(checkpoint_state(step_dir(single, 4), tmp_path),
                            checkpoint_state(step_dir(tmp_path / "out", 4), tmp_path))


def test_the_bias_can_be_turned_on_and_off_at_a_resume(bias_runs, tmp_path):
    """Off for 2 steps, on (from zero) for step 3, off again for step 4: each resume loads what it needs."""
    out, logs = tmp_path / "out", {}
    for steps, rate in ((2, 0.0), (3, 0.02), (4, 0.0)):
        cfg = bias_runs.config(tmp_path / f"c{steps}.yaml", out, total_steps=steps, save_steps=steps,
                               moe_bias_update_rate=rate, batch_size=4)
        proc = run_train(cfg, 1)
        check_ok(proc)
        logs[steps] = proc.stdout + proc.stderr
        biases = _biases(checkpoint_state(step_dir(out, steps), tmp_path))
        assert len(biases) == (4 if rate else 0), steps
        assert all(b.abs().max() > 0 for b in biases.values())  # one update from zero: +-rate each
    assert "holds no MoE expert biases" in logs[3] and "resumed from" in logs[4]


def test_merge_leaves_the_bias_out(bias_runs, tmp_path, caplog):
    import transformers

    from qwen3_pretrain.checkpoint.merge import merge_checkpoint

    with caplog.at_level(logging.WARNING, logger="qwen3_pretrain.checkpoint"):
        merge_checkpoint(bias_runs.output("single"), tmp_path / "hf", "qwen3-0.6b", dtype=torch.float32,
                         progress=False)
    assert "aux-loss-free balancing biases" in caplog.text
    model, info = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
