"""The FLOP counts behind MFU and HFU (plan/flops.py) against torch's own count of a tiny model's forward and
backward (torch.utils.flop_counter), and the peak MFU divides by."""

from __future__ import annotations

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode, sdpa_backward_flop_count, sdpa_flop_count

from qwen3_pretrain.errors import ConfigError
from qwen3_pretrain.hardware import DEVICES, get_device, matmul_precision
from qwen3_pretrain.models.ops.gated_delta import CHUNK_SIZE, chunk_gated_delta_rule
from qwen3_pretrain.models.qwen3.config import Qwen3Config
from qwen3_pretrain.models.qwen3.model import ModelOptions, Qwen3Model
from qwen3_pretrain.plan.flops import model_layers, token_flops
from qwen3_pretrain.train.config import TrainConfig
from qwen3_pretrain.train.metrics import format_line, utilization

aten = torch.ops.aten
SEQ, BATCH = 64, 2
HYBRID = dict(model_type="qwen3_5_text", layer_types=["linear_attention", "full_attention"],
              partial_rotary_factor=0.25, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
              linear_value_head_dim=8, linear_conv_kernel_dim=4, mtp_num_hidden_layers=1)
MOE = dict(model_type="qwen3_moe", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
           norm_topk_prob=True)


def _sdpa_forward(q, k, v, *args, out_shape=None, **kwargs) -> int:
    return sdpa_flop_count(q, k, v)


def _sdpa_backward(grad, q, k, v, *args, out_shape=None, **kwargs) -> int:
    return sdpa_backward_flop_count(grad, q, k, v)


# torch counts its CUDA attention kernels by these formulas (the whole square) but not the CPU's kernel
CPU_ATTENTION = {aten._scaled_dot_product_flash_attention_for_cpu: _sdpa_forward,
                 aten._scaled_dot_product_flash_attention_for_cpu_backward: _sdpa_backward}


class ElementwiseDeltaRule:
    """A stand-in for the delta rule with no matmul, so the rest of a hybrid layer is counted alone (the
    rule's own matmuls: test_delta_rule_flops_are_the_kernels_matmuls)."""

    name = "elementwise"

    def __call__(self, q, k, v, g, beta, starts):
        return v * (beta * g.exp()).unsqueeze(-1)


def _counted(cfg: Qwen3Config, recompute: str, mtp: bool) -> dict[str, float]:
    """torch's FLOP count per token of one forward and backward, by operator."""
    torch.manual_seed(0)
    options = ModelOptions(recompute=recompute, multi_token_prediction=mtp,
                           delta_rule=ElementwiseDeltaRule() if cfg.is_hybrid else None)
    model = Qwen3Model(cfg, options)
    x = torch.randint(0, cfg.vocab_size, (BATCH, SEQ))
    with FlopCounterMode(display=False, custom_mapping=CPU_ATTENTION) as counter:
        out = model(x, mtp_input=x) if mtp else (model(x),)
        sum(o.float().sum() for o in out).backward()
    return {str(op): n / (BATCH * SEQ) for op, n in counter.get_flop_counts()["Global"].items()}


@pytest.mark.parametrize("recompute", ["none", "full", "selective", "mlp"])
@pytest.mark.parametrize("kind", ["dense", "moe", "hybrid_mtp"])
def test_flops_equal_torchs_count(tiny_config, kind, recompute):
    """Every matmul (projections, router, the routed experts, the convolution, the LM head, the MTP layer's
    fc, layer and second head pass) forward, backward and rerun by recompute, as torch counts them; attention's
    core as torch counts its kernels, over the whole square (its backward by flash's convention, which reruns
    the scores: not compared), and ours over the causal half of it."""
    cfg = tiny_config(**{"moe": MOE, "hybrid_mtp": HYBRID}.get(kind, {}))
    mtp = kind == "hybrid_mtp"
    counted = _counted(cfg, recompute, mtp)
    flops, layers = token_flops(cfg, SEQ, recompute, mtp), model_layers(cfg, SEQ, mtp)
    reruns_core = recompute in ("full", "selective")
    core = sum(layer.core for layer in layers) * (4 if reruns_core else 3)
    rule = sum(layer.rule for layer in layers) * (4 if reruns_core else 3)
    # torch's convolution backward ignores the groups of the depthwise convolution; its forward is exact
    conv = counted.pop("aten.convolution", 0.0)
    counted.pop("aten.convolution_backward", None)
    matmuls = sum(n for op, n in counted.items() if op in ("aten.mm", "aten.addmm", "aten.bmm"))
    conv_backward = conv / (2 if recompute == "full" else 1) * 2
    assert matmuls + conv + conv_backward == pytest.approx(flops.hardware - core - rule, rel=1e-12)
    attention_forward = counted["aten._scaled_dot_product_flash_attention_for_cpu"]
    assert attention_forward == sum(layer.core_square for layer in layers) * (2 if reruns_core else 1)
    assert sum(layer.core for layer in layers) == attention_forward / (2 if reruns_core else 1) / 2


@pytest.mark.parametrize("key_heads, value_heads, head_dim", [(2, 4, 8), (4, 8, 32)])
def test_delta_rule_flops_are_the_kernels_matmuls(tiny_config, key_heads, value_heads, head_dim):
    cfg = tiny_config(**dict(HYBRID, linear_num_key_heads=key_heads, linear_num_value_heads=value_heads,
                             linear_key_head_dim=head_dim, linear_value_head_dim=head_dim))
    seq = 128
    q, k = (torch.randn(1, seq, key_heads, head_dim) for _ in range(2))
    v = torch.randn(1, seq, value_heads, head_dim)
    g, beta = -torch.rand(1, seq, value_heads), torch.rand(1, seq, value_heads)
    with FlopCounterMode(display=False) as counter:
        chunk_gated_delta_rule(q, k, v, g, beta)
    assert counter.get_total_flops() / seq == cfg.linear_attention_flops_per_token(CHUNK_SIZE) / 3


def test_mtp_layer_counted_when_trained(tiny_config):
    cfg = tiny_config(**HYBRID)
    without, with_mtp = token_flops(cfg, SEQ), token_flops(cfg, SEQ, mtp=True)
    h, attention_layer = cfg.hidden_size, model_layers(cfg, SEQ)[1]
    assert with_mtp.model - without.model == pytest.approx(
        6 * 2 * h * h + attention_layer.training() + 6 * cfg.vocab_size * h)
    assert token_flops(tiny_config(), SEQ, mtp=True) == token_flops(tiny_config(), SEQ)  # no MTP layer


def test_record_and_line_show_mfu_and_hfu(tiny_config):
    flops = token_flops(tiny_config(), SEQ, "full")
    figures = utilization(flops, tokens_per_sec_per_device=1e6, peak_tflops=1.0)
    assert figures == pytest.approx({"mfu": flops.model / 1e6, "hfu": flops.hardware / 1e6,
                                     "mfu_full_square": flops.full_square / 1e6})
    assert figures["mfu"] < figures["mfu_full_square"] and figures["mfu"] < figures["hfu"]
    record = {"step": 3, "total_steps": 9, "loss": 2.0, "lr": 1e-4, "grad_norm": 1.0, "tokens_per_sec": 100.0,
              "tokens_per_sec_per_device": 100.0, "step_time_s": 1.0, "mfu": 0.412, "hfu": 0.549,
              "mfu_full_square": 0.47, "memory_gib": 1.0, "eta_s": 6.0}
    assert "| mfu 41.2% | hfu 54.9% | mem" in format_line(record)


def test_peak_follows_what_the_matmuls_run_in():
    assert matmul_precision("bf16", allow_tf32=True) == "bf16"
    assert matmul_precision("fp32") == "fp32"
    assert matmul_precision("fp32", allow_tf32=True, device_type="cuda") == "tf32"
    assert matmul_precision("fp32", allow_tf32=True, device_type="npu") == "fp32"
    h100, npu = get_device("h100"), get_device("910b3")
    assert (h100.peak_tflops_of("bf16"), h100.peak_tflops_of("tf32"), h100.peak_tflops_of("fp32")) == (
        989.0, 494.7, 67.0)
    assert npu.peak_tflops_of("tf32") == npu.peak_tflops_of("fp32") == 78.0  # Ascend has no TF32
    assert get_device("a100").compute_flops("tf32") == 156e12


def test_tf32_peaks_are_the_tensor_cores():
    """NVIDIA's tensor cores since Ampere run TF32 at half their dense bf16 rate (the datasheets' figures, some
    quoted with sparsity and halved here), well above the non-tensor-core fp32 peak; an fp32 figure entered
    as TF32 (as the L40S's 91.6 was) fails this."""
    cuda = [hw for hw in DEVICES.values() if hw.device_type == "cuda"]
    assert len(cuda) >= 10
    for hw in cuda:
        assert hw.tf32_peak_tflops == pytest.approx(hw.peak_tflops / 2, rel=0.02), hw.name
        assert hw.tf32_peak_tflops > 1.5 * hw.fp32_peak_tflops, hw.name
    assert get_device("l40s").peak_tflops_of("tf32") == 183.0


def test_allow_tf32_needs_fp32():
    with pytest.raises(ConfigError, match="allow_tf32 true needs mixed_precision fp32"):
        TrainConfig(allow_tf32=True).validate()
    TrainConfig(allow_tf32=True, mixed_precision="fp32").validate()


def test_the_planner_counts_the_delta_rule_at_the_kernel_chunk():
    """plan/flops.py keeps its own copy of the chunk (the planner starts without torch): equal to the kernel's."""
    from qwen3_pretrain.plan.flops import DELTA_RULE_CHUNK
    assert DELTA_RULE_CHUNK == CHUNK_SIZE
