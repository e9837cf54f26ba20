"""Every device's elementwise kernels (models/ops/elementwise.py) against transformers' own expressions, values
and gradients, fp32 and bf16: ours bit for bit; CUDA's fused RMSNorm (its torch operator runs on the CPU too)
within its rounding; the NPU's wrappers on a stand-in of torch_npu that computes what its documentation says
(the operators themselves on an NPU: the ``device`` tests). Also: which kernels each device gets, that a model
built with them runs them, what they keep for backward, and that ours compile without a graph break."""

from __future__ import annotations

import itertools
import sys
import types

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor import DTensor
from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm
from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5RMSNorm, apply_rotary_pos_emb

from qwen3_pretrain.models.ops import elementwise as ew
from qwen3_pretrain.models.ops.elementwise import (CPU_KERNELS, CUDA_EAGER_KERNELS, NPU_KERNELS, ElementwiseKernels,
                                                   elementwise_kernels)
from qwen3_pretrain.models.ops.rope import rope_cos_sin
from qwen3_pretrain.models.qwen3.attention import SdpaAttention
from tests.test_lean_ops import saved_bytes

DTYPES = [torch.float32, torch.bfloat16]


# --- references: transformers' modules and functions -----------------------------------------------------------

def ref_norm(x, weight, eps, zero_centered=False):
    module = (Qwen3_5RMSNorm if zero_centered else Qwen3RMSNorm)(x.shape[-1], eps)
    return torch.func.functional_call(module, {"weight": weight}, (x,))


def ref_rope(x, cos, sin):
    return apply_rotary_pos_emb(x, x, cos[:, 0], sin[:, 0])[0]


def ref_swiglu(gate, up):
    return F.silu(gate) * up


def grads(fn, inputs, seed=1):
    """``fn``'s output and the gradients of <output, a fixed random direction> for each input."""
    leaves = [t.detach().clone().requires_grad_(True) for t in inputs]
    out = fn(*leaves)
    probe = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed))
    out.backward(probe.to(device=out.device, dtype=out.dtype))
    return out.detach(), [t.grad for t in leaves]


def inputs(shape, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=gen) * 2).to(dtype)


def norm_inputs(dtype, zero_centered):
    x = inputs((2, 17, 3, 64), dtype, 0)  # [batch, seq, heads, head_dim]: the q/k norms' shape
    w = 0.1 * inputs((64,), torch.float32, 1)
    return x, (w if zero_centered else 1 + w).to(dtype)


def rope_inputs(dtype, rotary):
    x = inputs((2, 17, 3, 64), dtype, 2).transpose(1, 2)  # [batch, heads, seq, head_dim], as attention has it
    positions = torch.cat([torch.arange(7), torch.arange(10)]).expand(2, 17)
    cos, sin = rope_cos_sin(positions, rotary, 10000.0, dtype)
    return x, cos, sin


def assert_equal_within(got, want, dtype, ulps_bf16=1):
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=2e-6, atol=2e-6)
    else:  # one bf16 rounding apart at most (2^-7 relative)
        torch.testing.assert_close(got.float(), want.float(), rtol=ulps_bf16 * 2 ** -7, atol=1e-2)


# --- the choice ----------------------------------------------------------------------------------------------

def test_each_device_gets_its_kernels():
    assert elementwise_kernels("cpu") == CPU_KERNELS == ElementwiseKernels()
    assert elementwise_kernels("cuda") == CUDA_EAGER_KERNELS
    assert elementwise_kernels("cuda", compiled=True) == CPU_KERNELS  # inductor fuses ours
    assert elementwise_kernels("npu") == NPU_KERNELS
    assert elementwise_kernels("npu", compiled=True) == NPU_KERNELS
    assert CUDA_EAGER_KERNELS.describe(zero_centered=True)["norms"] == "fused_zero_centered_rms_norm"
    assert NPU_KERNELS.describe() == {"norms": "npu_rms_norm", "rope": "npu_apply_rope", "swiglu": "npu_swiglu"}


@pytest.mark.parametrize("hybrid", [False, True], ids=["dense", "hybrid"])
def test_a_model_runs_the_kernels_it_was_built_with(tiny_config, hybrid):
    from qwen3_pretrain.models.qwen3.model import MLP, Attention, ModelOptions, Qwen3Model, RMSNorm

    cfg = tiny_config(**(HYBRID if hybrid else {}))
    model = Qwen3Model(cfg, ModelOptions(elementwise=CUDA_EAGER_KERNELS))
    norms = [m for m in model.modules() if isinstance(m, RMSNorm)]
    want = CUDA_EAGER_KERNELS.zero_centered_norm if hybrid else CUDA_EAGER_KERNELS.norm
    assert norms and all(m.kernel is want for m in norms)
    assert all(m.rope is CUDA_EAGER_KERNELS.rope for m in model.modules() if isinstance(m, Attention))
    assert all(m.swiglu is CUDA_EAGER_KERNELS.swiglu for m in model.modules() if isinstance(m, MLP))
    # and it computes what the model built with ours computes (fp32: the fused norm's sum order apart)
    ours = Qwen3Model(cfg)
    ours.load_state_dict(model.state_dict())
    ids = torch.randint(0, cfg.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(model(ids), ours(ids), rtol=1e-5, atol=1e-5)


# --- the start-up table, and the optimizer ---------------------------------------------------------------------------

HYBRID = dict(layer_types=["linear_attention", "full_attention"], partial_rotary_factor=0.25, linear_num_key_heads=2,
              linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8, linear_conv_kernel_dim=4,
              model_type="qwen3_5_text")
MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16)
# a hybrid MoE: its sparse layers' shared expert is an MLP with the model's SwiGLU
HYBRID_MOE = dict(HYBRID, model_type="qwen3_5_moe_text", shared_expert_intermediate_size=24, **MOE)


@pytest.mark.parametrize("device_type", ["cpu", "cuda", "npu"])
@pytest.mark.parametrize("kind", ["dense", "moe", "hybrid", "hybrid-moe"])
def test_the_kernel_table_names_what_the_engine_builds(tiny_config, device_type, kind):
    from qwen3_pretrain.models.ops.delta_rule import delta_rule_kernel
    from qwen3_pretrain.models.ops.moe import MoE
    from qwen3_pretrain.models.qwen3.model import MLP, RMSNorm, SparseMLP
    from qwen3_pretrain.parallel.parallelize import PartSpec, build_stage, choose_experts, describe_kernels, kernel_table

    cfg = tiny_config(**{"dense": {}, "moe": MOE, "hybrid": HYBRID, "hybrid-moe": HYBRID_MOE}[kind])
    kernels = elementwise_kernels(device_type)
    table = kernel_table(cfg, device_type, kernels, "bf16", optimizer="AdamW fused")
    stage = build_stage(cfg, PartSpec(0, 1, range(cfg.num_hidden_layers)), cfg.vocab_size, 64,
                        elementwise=kernels, experts=choose_experts(device_type, "bf16"),
                        delta_rule=delta_rule_kernel(device_type))
    assert {m.kernel.__name__ for m in stage.modules() if isinstance(m, RMSNorm)} == {table["norms"]}
    assert table["rope"] == kernels.rope.__name__
    mlps = {m.swiglu.__name__ for m in stage.modules() if isinstance(m, MLP)}  # the tiny MoE's layers: all sparse
    assert mlps == (set() if kind == "moe" else {table["swiglu"]})
    if kind == "hybrid-moe":  # the shared experts included
        assert any(m.shared_expert is not None for m in stage.modules() if isinstance(m, SparseMLP))
    assert ("experts" in table) == kind.endswith("moe") and ("delta rule" in table) == kind.startswith("hybrid")
    if kind.endswith("moe"):
        assert {m.experts.kernel.name for m in stage.modules() if isinstance(m, MoE)} == {table["experts"]}
    if kind.startswith("hybrid"):
        assert table["delta rule"] == "torch"  # flash-linear-attention is not installed here
    assert table["optimizer"] == "AdamW fused"
    line = describe_kernels(table)
    assert line.startswith("attention: ") and f"norms: {table['norms']}" in line


def test_npu_optimizer_is_fused_where_torch_npu_registers_the_kernel(monkeypatch):
    from qwen3_pretrain.hardware import optimizer_impl

    assert optimizer_impl("cpu") == optimizer_impl("cuda") == "fused"
    monkeypatch.delitem(sys.modules, "torch_npu", raising=False)
    assert optimizer_impl("npu") == "foreach"  # torch_npu not loaded: not on an NPU's machine
    monkeypatch.setitem(sys.modules, "torch_npu", types.ModuleType("torch_npu"))
    assert optimizer_impl("npu") == "foreach"  # this build has no NPU kernel for it
    real = torch._C._dispatch_has_kernel_for_dispatch_key
    monkeypatch.setattr(torch._C, "_dispatch_has_kernel_for_dispatch_key",
                        lambda op, key: key == "PrivateUse1" and op == "aten::_fused_adamw_" or real(op, key))
    assert optimizer_impl("npu") == "fused"


def test_the_optimizer_row_reads_the_built_optimizer():
    from qwen3_pretrain.train.optim import describe_optimizer

    params = [torch.nn.Parameter(torch.zeros(3))]
    assert describe_optimizer(torch.optim.AdamW(params, fused=True)) == "AdamW fused"
    assert describe_optimizer(torch.optim.AdamW(params)).startswith("AdamW foreach")


# --- ours: transformers' values bit for bit ------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("zero_centered", [False, True], ids=["norm", "zero-centred"])
def test_our_norms_equal_transformers(dtype, zero_centered):
    x, w = norm_inputs(dtype, zero_centered)
    kernel = CPU_KERNELS.zero_centered_norm if zero_centered else CPU_KERNELS.norm
    got = grads(lambda a, b: kernel(a, b, 1e-6), [x, w])
    want = grads(lambda a, b: ref_norm(a, b, 1e-6, zero_centered), [x, w])
    assert torch.equal(got[0], want[0]) and torch.equal(got[1][0], want[1][0])
    torch.testing.assert_close(got[1][1], want[1][1], rtol=1e-6, atol=1e-6)  # a sum over rows, any order


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rotary", [64, 16], ids=["full", "partial"])
def test_our_rope_equals_transformers(dtype, rotary):
    x, cos, sin = rope_inputs(dtype, rotary)
    got = grads(lambda a: CPU_KERNELS.rope(a, cos, sin), [x])
    want = grads(lambda a: ref_rope(a, cos, sin), [x])
    assert torch.equal(got[0], want[0]) and torch.equal(got[1][0], want[1][0])


# --- CUDA's fused RMSNorm (torch's operator, run here on the CPU) ------------------------------------------------

def rel_err(got, want):
    return ((got.double().cpu() - want.double().cpu()).norm() / want.double().cpu().norm()).item()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("zero_centered", [False, True], ids=["norm", "zero-centred"])
def test_cuda_fused_norms_equal_transformers_within_rounding(dtype, zero_centered):
    """fp32: transformers' values but for the order of fp32 sums. bf16: the forward is transformers'; the
    fused backward rounds once, at the end, where transformers' rounds each product to bf16: its gradients
    are as close to a float64 computation as transformers' own, or closer."""
    x, w = norm_inputs(dtype, zero_centered)
    kernel = CUDA_EAGER_KERNELS.zero_centered_norm if zero_centered else CUDA_EAGER_KERNELS.norm
    got = grads(lambda a, b: kernel(a, b, 1e-6), [x, w])
    want = grads(lambda a, b: ref_norm(a, b, 1e-6, zero_centered), [x, w])
    exact = grads(lambda a, b: ref_norm(a, b, 1e-6, zero_centered), [x.double(), w.double()])
    if dtype == torch.float32:
        for g, r in zip([got[0], *got[1]], [want[0], *want[1]]):
            torch.testing.assert_close(g, r, rtol=1e-5, atol=1e-5)
        return
    assert_equal_within(got[0], want[0], dtype)
    for g, r, e in zip(got[1], want[1], exact[1]):
        assert rel_err(g, e) <= 1.05 * rel_err(r, e), (rel_err(g, e), rel_err(r, e))


def test_cuda_fused_norm_normalizes_before_the_weight():
    """transformers casts the normalized value, then multiplies by the weight; torch's fused norm given the
    weight multiplies first (a quarter of bf16 values one unit apart): the kernel must not hand it over."""
    x, w = norm_inputs(torch.bfloat16, False)
    ref = ref_norm(x, w, 1e-6)
    assert torch.equal(CUDA_EAGER_KERNELS.norm(x, w, 1e-6), ref)
    assert not torch.equal(F.rms_norm(x, (64,), w, 1e-6), ref)


def test_cuda_fused_norm_keeps_what_ours_keeps():
    x, w = norm_inputs(torch.bfloat16, False)
    rows = x.numel() // x.shape[-1]
    assert saved_bytes(lambda a, b: CUDA_EAGER_KERNELS.norm(a, b, 1e-6), [x, w]) == rows * 4  # fp32 rstd
    assert saved_bytes(lambda a, b: CPU_KERNELS.norm(a, b, 1e-6), [x, w]) == rows * 4
    # the zero-centred form keeps the fp32 input: no more than ours
    x, w = norm_inputs(torch.bfloat16, True)
    fused = saved_bytes(lambda a, b: CUDA_EAGER_KERNELS.zero_centered_norm(a, b, 1e-6), [x, w])
    assert fused <= saved_bytes(lambda a, b: CPU_KERNELS.zero_centered_norm(a, b, 1e-6), [x, w])


# --- the NPU's wrappers, on a stand-in of torch_npu ---------------------------------------------------------------

def _stand_in_rms_norm(x, gamma, epsilon=1e-6):
    assert gamma.dtype == x.dtype, "torch_npu's gamma takes the input's dtype"
    xf = x.float()
    rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + epsilon)
    return (xf * rstd * gamma.float()).to(x.dtype), rstd


def _stand_in_rotary_mul(x, r1, r2, rotary_mode="half"):
    assert x.dim() == 4 and x.is_contiguous() and rotary_mode == "half"
    assert r1.shape[0] in (1, x.shape[0]) and r1.shape[1:] == (x.shape[1], 1, x.shape[3]), "BSND, cos BS1D"
    x1, x2 = x.chunk(2, dim=-1)
    return r1 * x + r2 * torch.cat((-x2, x1), dim=-1)


def _stand_in_swiglu(x, dim=-1):
    a, b = x.chunk(2, dim=dim)  # SiLU of the first half times the second
    return F.silu(a) * b


@pytest.fixture
def stand_in_torch_npu(monkeypatch):
    module = types.ModuleType("torch_npu")
    module.npu_rms_norm, module.npu_rotary_mul, module.npu_swiglu = (_stand_in_rms_norm, _stand_in_rotary_mul,
                                                                     _stand_in_swiglu)
    monkeypatch.setitem(sys.modules, "torch_npu", module)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("zero_centered", [False, True], ids=["norm", "zero-centred"])
def test_npu_norms_hand_torch_npu_what_transformers_computes(stand_in_torch_npu, dtype, zero_centered):
    x, w = norm_inputs(dtype, zero_centered)
    kernel = NPU_KERNELS.zero_centered_norm if zero_centered else NPU_KERNELS.norm
    got = grads(lambda a, b: kernel(a, b, 1e-6), [x, w])
    want = grads(lambda a, b: ref_norm(a, b, 1e-6, zero_centered), [x, w])
    assert_equal_within(got[0], want[0], dtype)
    assert_equal_within(got[1][0], want[1][0], dtype, ulps_bf16=2)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rotary", [64, 16], ids=["full", "partial"])
def test_npu_rope_and_its_backward_by_minus_sin(stand_in_torch_npu, dtype, rotary):
    x, cos, sin = rope_inputs(dtype, rotary)
    got = grads(lambda a: NPU_KERNELS.rope(a, cos, sin), [x])
    want = grads(lambda a: ref_rope(a, cos, sin), [x])
    assert torch.equal(got[0], want[0]) and torch.equal(got[1][0], want[1][0])
    # only cos and sin (its inputs) are kept, where torch_npu's own backward keeps x too
    assert saved_bytes(lambda a, c, s: NPU_KERNELS.rope(a, c, s), [x, cos, sin]) == 0


@pytest.mark.parametrize("dtype", DTYPES)
def test_npu_swiglu_gates_with_the_first_half(stand_in_torch_npu, dtype):
    gate, up = inputs((40, 96), dtype, 3), inputs((40, 96), dtype, 4)
    got, want = grads(NPU_KERNELS.swiglu, [gate, up]), grads(ref_swiglu, [gate, up])
    assert torch.equal(got[0], want[0])
    for a, b in zip(got[1], want[1]):
        assert torch.equal(a, b)


# --- the fused norms on DTensors (every norm's input under tp) ------------------------------------------------------

def _check_fused_norms_on_dtensors(rank: int, world_size: int) -> None:
    """Each fused norm on a DTensor split over the sequence (dim 1) or the q/k norms' heads (dim 2), its weight
    replicated, as sequence parallelism hands them over: the values and gradients of transformers' norm on
    the whole tensor. CUDA's backward runs torch's ``aten._fused_rms_norm_backward`` through its sharding rule
    (given here a CPU kernel: torch's reference formula); the NPU's run on a stand-in of torch_npu. Ours must
    not run (it would take any layout)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Partial, Replicate, Shard, distribute_tensor

    lib = torch.library.Library("aten", "IMPL")  # this spawned process's only: the operator as on a GPU
    from torch._decomp.decompositions import _fused_rms_norm_backward as reference

    lib.impl("_fused_rms_norm_backward", reference, "CPU")
    ew._fused_rms_norm_backward = lambda device_type: torch.ops.aten._fused_rms_norm_backward
    ew.rms_norm = ew.zero_centered_rms_norm = None  # a fallback to ours fails
    module = types.ModuleType("torch_npu")
    module.npu_rms_norm = _stand_in_rms_norm
    sys.modules["torch_npu"] = module
    mesh = init_device_mesh("cpu", (world_size,))
    # a layout the operator's rule would gather first (the normalized dim split) is not taken
    replicated = distribute_tensor(torch.ones(32), mesh, [Replicate()])
    assert not ew._rowwise(distribute_tensor(torch.ones(2, 8, 32), mesh, [Shard(2)]), replicated)
    assert ew._rowwise(distribute_tensor(torch.ones(2, 8, 32), mesh, [Shard(1)]), replicated)
    kernels = {"cuda": CUDA_EAGER_KERNELS, "npu": NPU_KERNELS}
    for (device, kernels_), zero_centered, dim in itertools.product(kernels.items(), [False, True], [1, 2]):
        x, w = (inputs((2, 8, 4, 32), torch.float32, 6), 0.1 * inputs((32,), torch.float32, 7))
        w = w if zero_centered else 1 + w
        want = grads(lambda a, b: ref_norm(a, b, 1e-6, zero_centered), [x, w])
        kernel = kernels_.zero_centered_norm if zero_centered else kernels_.norm
        dx = distribute_tensor(x, mesh, [Shard(dim)]).requires_grad_(True)
        dw = torch.nn.Parameter(distribute_tensor(w, mesh, [Replicate()]))
        out = kernel(dx, dw, 1e-6)
        assert isinstance(out, DTensor) and out.placements == (Shard(dim),), (device, out)
        probe = torch.randn(out.shape, generator=torch.Generator().manual_seed(1))  # grads()'s direction
        out.backward(distribute_tensor(probe, mesh, [Shard(dim)]))
        assert dw.grad.placements == (Partial(),), (device, dw.grad.placements)  # summed over tp later
        for got, ref in zip([out.full_tensor(), dx.grad.full_tensor(), dw.grad.full_tensor()],
                            [want[0], *want[1]]):
            torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5, msg=lambda m: f"{device} {dim}: {m}")


@pytest.mark.distributed
def test_fused_norms_take_sequence_parallel_dtensors_on_two_ranks():
    from test_loss import run_distributed

    run_distributed(2, _check_fused_norms_on_dtensors)


def _check_tp_model_with_device_kernels(rank: int, world_size: int) -> None:
    """A tiny dense and a hybrid (zero-centred norms, partial rotary, gated attention) model split over tp
    with each device's kernels (the norms fused, never ours: a fallback fails) against one process with ours:
    this rank's share of the residual stream and every parameter's gradient."""
    from torch.distributed.device_mesh import init_device_mesh

    from qwen3_pretrain.models.qwen3.config import Qwen3Config
    from qwen3_pretrain.models.qwen3.model import ModelOptions, ModelPart, Qwen3Model
    from qwen3_pretrain.parallel.tensor_parallel import apply_tensor_parallel

    lib = torch.library.Library("aten", "IMPL")  # as in _check_fused_norms_on_dtensors
    from torch._decomp.decompositions import _fused_rms_norm_backward as reference_backward

    lib.impl("_fused_rms_norm_backward", reference_backward, "CPU")
    ew._fused_rms_norm_backward = lambda device_type: torch.ops.aten._fused_rms_norm_backward
    ew.rms_norm = ew.zero_centered_rms_norm = None
    module = types.ModuleType("torch_npu")
    module.npu_rms_norm, module.npu_rotary_mul, module.npu_swiglu = (_stand_in_rms_norm, _stand_in_rotary_mul,
                                                                     _stand_in_swiglu)
    sys.modules["torch_npu"] = module
    mesh = init_device_mesh("cpu", (world_size,))
    small = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16, vocab_size=256, max_position_embeddings=256,
                 bos_token_id=0, eos_token_id=1)
    hybrid = dict(small, model_type="qwen3_5_text", layer_types=["full_attention"] * 2, partial_rotary_factor=0.25,
                  linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8)
    for fields, kernels in itertools.product([small, hybrid], [CUDA_EAGER_KERNELS, NPU_KERNELS]):
        cfg, part = Qwen3Config(**fields), ModelPart(head=False)
        torch.manual_seed(0)
        reference = Qwen3Model(cfg, ModelOptions(), part)
        with torch.no_grad():  # norms away from 1 (or 0)
            for param in reference.parameters():
                param.add_(0.1 * torch.randn_like(param))
        sharded = Qwen3Model(cfg, ModelOptions(elementwise=kernels), part)
        sharded.load_state_dict(reference.state_dict())
        apply_tensor_parallel(sharded, mesh)
        ids = torch.randint(0, cfg.vocab_size, (2, 16))
        positions = torch.arange(16).expand(2, 16)
        seq = slice(16 // world_size * rank, 16 // world_size * (rank + 1))
        out, want = sharded(ids, positions)[0], reference(ids, positions)[0][:, seq]
        torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
        (out ** 2).sum().backward()
        (want ** 2).sum().backward()
        for name, param in reference.named_parameters():
            grad = param.grad.clone()
            dist.all_reduce(grad)  # the sequence slices of all ranks
            got = sharded.get_parameter(name).grad
            got = got.full_tensor() if isinstance(got, DTensor) else got
            error = ((got - grad).abs().max() / grad.abs().max()).item()
            assert error < 1e-5, f"{kernels.norm.__name__} {name}: gradient differs by {error:.1e}"


@pytest.mark.distributed
def test_a_tp_model_with_the_devices_kernels_equals_one_process_with_ours():
    from test_loss import run_distributed

    run_distributed(2, _check_tp_model_with_device_kernels)


# --- compile -----------------------------------------------------------------------------------------------------

def test_our_kernels_compile_into_one_graph():
    """Under ``compile`` on CUDA inductor fuses ours: their autograd functions must trace without a break
    (``fullgraph``), forward and backward, and compute what they compute eagerly."""
    x, w = norm_inputs(torch.float32, False)
    _, cos, sin = rope_inputs(torch.float32, 64)

    def block(a, b):
        q = CPU_KERNELS.rope(CPU_KERNELS.norm(a, b, 1e-6).transpose(1, 2), cos, sin)
        return CPU_KERNELS.swiglu(q, q * 2) + CPU_KERNELS.zero_centered_norm(a, b, 1e-6).transpose(1, 2)

    torch._dynamo.reset()
    compiled = torch.compile(block, backend="aot_eager", fullgraph=True)
    got, want = grads(compiled, [x, w]), grads(block, [x, w])
    torch.testing.assert_close(got[0], want[0], rtol=0, atol=0)
    for a, b in zip(got[1], want[1]):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("hybrid", [False, True], ids=["dense", "hybrid-attention"])
def test_a_decoder_layer_with_its_kernels_compiles_into_one_graph(tiny_config, hybrid):
    """The kernels reached through the modules (``RMSNorm.kernel``, ``Attention.rope``, ``MLP.swiglu``) trace
    like the calls they replaced: a full-attention decoder layer is one graph, forward and backward."""
    from qwen3_pretrain.models.qwen3.model import DecoderLayer, ModelOptions

    cfg = tiny_config(**(HYBRID if hybrid else {}))
    layer = DecoderLayer(cfg, ModelOptions(), SdpaAttention(), index=1)  # layer 1: full attention in HYBRID
    x = inputs((2, 12, cfg.hidden_size), torch.float32, 5)
    cos, sin = rope_cos_sin(torch.arange(12).expand(2, 12), cfg.rotary_dim, cfg.rope_theta, torch.float32)
    torch._dynamo.reset()
    compiled = torch.compile(layer, backend="aot_eager", fullgraph=True)
    got, want = grads(lambda a: compiled(a, cos, sin), [x]), grads(lambda a: layer(a, cos, sin), [x])
    torch.testing.assert_close(got[0], want[0], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(got[1][0], want[1][0], rtol=1e-6, atol=1e-6)


# --- on the device (pytest -m device; QWEN3_PRETRAIN_TEST_DEVICE=cpu runs the CPU's) ------------------------------

@pytest.mark.device
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block", ["norm", "zero-centred", "rope", "partial-rope", "swiglu"])
def test_the_devices_kernels_equal_transformers_on_the_cpu(test_device, dtype, block):
    """The kernels the device gets, run there, against transformers' expressions in float64 on the CPU;
    the bound is the compute dtype's rounding (a wrong half order or layout is off by O(1))."""
    kernels = elementwise_kernels(test_device.type)
    if block in ("norm", "zero-centred"):
        zero = block == "zero-centred"
        args = list(norm_inputs(dtype, zero))
        run = lambda a, b: (kernels.zero_centered_norm if zero else kernels.norm)(a, b, 1e-6)  # noqa: E731
        ref = lambda a, b: ref_norm(a, b, 1e-6, zero)  # noqa: E731
    elif block.endswith("rope"):
        x, cos, sin = rope_inputs(dtype, 16 if block == "partial-rope" else 64)
        args = [x]
        run = lambda a: kernels.rope(a, cos.to(a.device), sin.to(a.device))  # noqa: E731
        ref = lambda a: ref_rope(a, cos.double(), sin.double())  # noqa: E731
    else:
        args, run, ref = [inputs((40, 96), dtype, 3), inputs((40, 96), dtype, 4)], kernels.swiglu, ref_swiglu
    got = grads(run, [a.to(test_device) for a in args])
    want = grads(ref, [a.double() for a in args])
    bound = 1e-5 if dtype == torch.float32 else 1e-2
    for g, r in zip([got[0], *got[1]], [want[0], *want[1]]):
        assert rel_err(g, r) < bound, (block, rel_err(g, r))


@pytest.mark.device
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hybrid", [False, True], ids=["dense", "hybrid"])
def test_a_model_with_the_devices_kernels_equals_a_float64_cpu_model(test_device, tiny_config, dtype, hybrid):
    """The whole model built with the device's kernels (q/k norms on the projections' views, RoPE on the
    transposed heads, the gated attention's partial rotary), run there, against the same weights in float64
    on the CPU with ours: logits and every parameter's gradient. The hybrid's layers are all attention: the
    delta rule's bf16 gradients are not this test's (tests/test_delta_rule_kernels.py)."""
    import copy

    from qwen3_pretrain.models.qwen3.model import ModelOptions, Qwen3Model
    from tests.test_device import REL_TOL, logits_and_grads
    from tests.test_model_parity import randomize

    cfg = tiny_config(**({**HYBRID, "layer_types": ["full_attention"] * 2} if hybrid else {}))
    model = Qwen3Model(cfg, ModelOptions(elementwise=elementwise_kernels(test_device.type)))
    randomize(model, seed=3)
    if hybrid:  # zero-centred norms: a scale of 1 + weight
        with torch.no_grad():
            for name, param in model.named_parameters():
                if name.endswith("norm.weight"):
                    param.sub_(1.0)
    gen = torch.Generator().manual_seed(4)
    ids = torch.randint(0, cfg.vocab_size, (2, 64), generator=gen)
    probe = torch.randn(2, 64, cfg.vocab_size, generator=gen)
    reference = Qwen3Model(cfg)
    reference.load_state_dict(model.state_dict())
    want, want_grads = logits_and_grads(copy.deepcopy(reference).double(), ids, probe.double())
    got, got_grads = logits_and_grads(model.to(device=test_device, dtype=dtype), ids.to(test_device),
                                      probe.to(test_device))
    assert rel_err(got, want) < REL_TOL[dtype], rel_err(got, want)
    worst = max(want_grads, key=lambda n: rel_err(got_grads[n], want_grads[n]))
    assert rel_err(got_grads[worst], want_grads[worst]) < REL_TOL[dtype], (worst, rel_err(got_grads[worst],
                                                                                         want_grads[worst]))
