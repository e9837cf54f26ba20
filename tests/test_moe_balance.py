"""The load-balancing losses give the gradients of their formulas (docs/moe.md), checked against independent
implementations: transformers' ``load_balancing_loss_func`` for ``micro_batch``, and the ``global_batch`` and
z-loss formulas written out with autograd over router logits captured by hooks. One process; the layouts are
tests/test_moe_train.py's."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

from qwen3_pretrain.models.qwen3.model import ModelOptions, Qwen3Model
from qwen3_pretrain.train.balance import RouterBalance
from tests.test_model_parity import randomize

MOE = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=16, norm_topk_prob=True,
           num_hidden_layers=3)
COEF, Z_COEF = 0.3, 0.05  # large, so that a wrong balancing gradient shows well above rounding


def microbatches(cfg, num: int, seed: int = 0) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, cfg.vocab_size, (2, 12), generator=gen) for _ in range(num)]


def lm_loss(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))


def with_balance(cfg, model: Qwen3Model, balance: RouterBalance, batches, recompute: str = "none"):
    """Our path: the model built with the balance as its router observer; only the LM loss back-propagates."""
    ours = Qwen3Model(cfg, ModelOptions(router_observer=balance, recompute=recompute))
    ours.load_state_dict(model.state_dict())
    balance.start_step(len(batches))
    for ids in batches:
        (lm_loss(ours(ids), ids) / len(batches)).backward()
    stats = balance.local_stats(torch.device("cpu"))
    return {n: p.grad for n, p in ours.named_parameters()}, balance.step_figures(stats)


def router_logits(model: Qwen3Model) -> list[torch.Tensor]:
    """Filled on each forward with every sparse layer's router logits, in layer order."""
    captured: list[torch.Tensor] = []
    for layer in model.layers.values():
        if hasattr(layer.mlp, "gate"):
            layer.mlp.gate.register_forward_hook(lambda mod, args, out: captured.append(out))
    return captured


def assert_same_grads(got: dict, want: dict) -> None:
    for name, grad in want.items():
        scale = grad.abs().max().item()
        diff = (got[name] - grad).abs().max().item()
        assert diff <= 1e-5 * scale + 1e-9, f"{name}: gradient differs by {diff:.3g} (scale {scale:.3g})"


@pytest.fixture
def moe_model(tiny_config):
    cfg = tiny_config(**MOE)
    model = Qwen3Model(cfg)
    randomize(model, seed=1)
    return cfg, model


def test_micro_batch_is_transformers_loss(moe_model):
    """Objective: mean over micro-batches of (LM loss + coef x transformers' aux loss of that micro-batch)."""
    cfg, model = moe_model
    batches = microbatches(cfg, 2)
    got, figures = with_balance(cfg, model, RouterBalance(cfg, "micro_batch", COEF), batches)
    reference = copy.deepcopy(model)
    logits = router_logits(reference)
    aux_values = []
    for ids in batches:
        logits.clear()
        out = reference(ids)
        aux = load_balancing_loss_func(tuple(logits), cfg.num_experts, cfg.num_experts_per_tok)
        aux_values.append(aux.item())
        ((lm_loss(out, ids) + COEF * aux) / len(batches)).backward()
    assert figures["moe_aux_loss"] == pytest.approx(sum(aux_values) / len(aux_values), rel=1e-6)
    assert_same_grads(got, {n: p.grad for n, p in reference.named_parameters()})


@pytest.mark.parametrize("recompute", ["none", "full", "mlp"])
def test_global_batch_and_z_loss_are_their_formulas(moe_model, recompute):
    """aux = (1/M) sum_m (1/L) sum_l E sum_e f_{l,e}^(m) P_{l,e}^(m), with f counted over the micro-batches so
    far; z = (1/M) sum_m (1/L) sum_l mean_t logsumexp^2. Recomputing the layers in backward reads the first
    forward's frequencies back (a recompute that counted again would change f)."""
    cfg, model = moe_model
    batches = microbatches(cfg, 3, seed=2)
    balance = RouterBalance(cfg, "global_batch", COEF, Z_COEF)
    got, figures = with_balance(cfg, model, balance, batches, recompute)
    reference = copy.deepcopy(model)
    logits = router_logits(reference)
    num_layers, num_experts, top_k, m_total = len(logits) or 3, cfg.num_experts, cfg.num_experts_per_tok, len(batches)
    counts = torch.zeros(cfg.num_hidden_layers, num_experts)
    tokens = 0
    aux_total = z_total = 0.0
    for ids in batches:
        logits.clear()
        out = reference(ids)
        tokens += logits[0].shape[0]
        aux = z = 0.0
        for layer, layer_logits in enumerate(logits):
            probs = layer_logits.float().softmax(-1)
            chosen = probs.topk(top_k, dim=-1).indices
            counts[layer] += F.one_hot(chosen, num_experts).sum((0, 1)).float()
            frequency = counts[layer] / tokens
            aux = aux + num_experts * (frequency * probs.mean(0)).sum() / num_layers
            z = z + layer_logits.float().logsumexp(-1).pow(2).mean() / num_layers
        aux_total += aux.item() / m_total
        z_total += z.item() / m_total
        ((lm_loss(out, ids) + COEF * aux + Z_COEF * z) / m_total).backward()
    assert figures["moe_aux_loss"] == pytest.approx(aux_total, rel=1e-6)
    assert figures["moe_z_loss"] == pytest.approx(z_total, rel=1e-6)
    assert_same_grads(got, {n: p.grad for n, p in reference.named_parameters()})


def test_the_balancing_gradient_reaches_the_router(moe_model):
    """Probe of the tests above: the loss changes the routers' gradients, and not the last layer's experts' (the
    gradient reaches the earlier layers through the routers' inputs)."""
    cfg, model = moe_model
    batches = microbatches(cfg, 1, seed=3)
    with_loss, _ = with_balance(cfg, model, RouterBalance(cfg, "global_batch", COEF), batches)
    without, figures = with_balance(cfg, model, RouterBalance(cfg, "none", COEF), batches)
    router = "layers.0.mlp.gate.weight"
    assert (with_loss[router] - without[router]).abs().max() > 1e-4
    assert torch.equal(with_loss["layers.2.mlp.experts.up_proj"], without["layers.2.mlp.experts.up_proj"])
    assert "moe_aux_loss" not in figures and figures["moe_load_max"] >= 1.0


def test_forced_balance_spreads_tokens_evenly(tiny_config):
    cfg = tiny_config(**MOE)
    balance = RouterBalance(cfg, "global_batch", COEF)
    model = Qwen3Model(cfg, ModelOptions(router_observer=balance, moe_force_balance=True))
    balance.start_step(1)
    ids = microbatches(cfg, 1)[0]  # 24 tokens x 2 slots over 8 experts: 6 each
    lm_loss(model(ids), ids).backward()
    figures = balance.step_figures(balance.local_stats(torch.device("cpu")))
    assert figures["moe_load_max"] == 1.0 and figures["moe_idle_experts"] == 0.0
