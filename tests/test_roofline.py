"""The roofline (simulate/roofline): single ops recorded and priced against figures worked out by hand here,
the compile fusion model on a known sequence, and simulate's priced output."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
import torch.nn.functional as F

from qwen3_pretrain.hardware import GB, get_device, measured_cpu
from qwen3_pretrain.simulate.roofline import OpTrace, RecordingMode, price

H100 = get_device("h100")
BW = 3350e9 * 0.85  # the H100's memory bandwidth x its bandwidth efficiency, written out


def meta(*shape, dtype=torch.bfloat16):
    return torch.empty(*shape, dtype=dtype, device="meta")


def test_bf16_matmul_on_h100_is_2mnk_over_throughput():
    a, b = meta(4096, 2048), meta(2048, 8192)
    with RecordingMode() as rec:
        a @ b
    assert dict(rec.trace.matmuls) == {("forward", "bfloat16", 4096, 8192, 2048, 1): 1}
    expected = 2 * 4096 * 8192 * 2048 / (989e12 * 0.75)  # large shape: the full efficiency
    assert price(rec.trace, H100).matmul == pytest.approx(expected, rel=1e-9)


def test_skinny_matmul_is_priced_lower_than_its_flops_alone():
    a, b = meta(64, 4096), meta(4096, 4096)
    with RecordingMode() as rec:
        a @ b
    at_peak = 2 * 64 * 4096 * 4096 / (989e12 * 0.75)
    assert price(rec.trace, H100).matmul > 1.5 * at_peak


def test_elementwise_add_is_bytes_over_bandwidth():
    x, y = meta(512, 512, dtype=torch.float32), meta(512, 512, dtype=torch.float32)
    with RecordingMode() as rec:
        x + y
    moved = 3 * 512 * 512 * 4  # two reads, one write
    assert rec.trace.memory["forward"].eager_bytes == moved
    assert price(rec.trace, H100).elementwise == pytest.approx(moved / BW)
    # an accelerator computes asynchronously: the host's time per op counts where the device does not cover it
    launch = H100.launch_latency_us * 1e-6
    assert launch > moved / BW
    assert price(rec.trace, H100).host == pytest.approx(launch - moved / BW)
    assert price(rec.trace, H100).step == pytest.approx(launch)


def test_causal_sdpa_records_the_fused_kernel_and_prices_half_the_square():
    q = torch.randn(1, 2, 128, 64, dtype=torch.bfloat16, requires_grad=True)
    with RecordingMode() as rec:
        F.scaled_dot_product_attention(q, q, q, is_causal=True).sum().backward()
    keys = sorted(rec.trace.attention)
    assert [(k[0], k[1], k[3:]) for k in keys] == [
        ("backward", "flash_backward", (1, 2, 128, 128, 64, True)), ("forward", "flash", (1, 2, 128, 128, 64, True))]
    # a FLOP-bound call priced by hand: b 1, 32 heads, 8192 x 8192, head_dim 128, causal, forward
    trace = OpTrace()
    trace.attention[("forward", "flash", "bfloat16", 1, 32, 8192, 8192, 128, True)] = 1
    flops = 4 * 32 * 8192 * 8192 * 128 / 2
    assert price(trace, H100).attention == pytest.approx(flops / (989e12 * 0.5))
    trace.attention[("backward", "flash_backward", "bfloat16", 1, 32, 8192, 8192, 128, True)] = 1
    assert price(trace, H100).attention == pytest.approx(3.5 * flops / (989e12 * 0.5))


def test_collectives_use_the_link_model_and_fsdp_overlap():
    # tp: an all-reduce of 1 GB over 4 ranks on NVLink, 10 calls, waited on by the compute: all exposed
    comm = {("tp", "all_reduce", 4): (10e9, 10)}
    per_call = 1e9 * 2 * 3 / 4 / (360 * GB) + 10e-6
    b = price(OpTrace(), H100, comm=comm)
    assert b.communication == pytest.approx(10 * per_call)
    # dp: FSDP's all-gathers behind compute, all but the first
    trace = OpTrace()
    trace.matmuls[("forward", "bfloat16", 8192, 8192, 8192, 1)] = 100  # ~1.5 s of compute
    gather = 1e9 * 7 / 8 / (360 * GB) + 10e-6
    b = price(trace, H100, comm={("dp", "all_gather", 8): (10e9, 10)})
    assert b.communication_total == pytest.approx(10 * gather)
    assert b.communication == pytest.approx(gather)
    # across nodes (45 GB/s) the gathers outlast the compute: the excess is exposed
    b = price(trace, H100, comm={("dp", "all_gather", 8): (1000e9, 10)}, intra={"dp": False})
    gather = 100e9 * 7 / 8 / (45 * GB) + 25e-6
    assert b.communication == pytest.approx(gather + (9 * gather - b.compute))  # the first, and the rest's excess



def test_a_cpu_waits_for_every_dp_collective():
    # a CPU has no side streams: FSDP2 waits for each gloo call on the computing thread, so the dp gathers
    # count whole however much compute there is (an H100 hides all but the first, above)
    trace = OpTrace()
    trace.matmuls[("forward", "bfloat16", 1024, 1024, 1024, 1)] = 100
    cpu = measured_cpu(1.0, 1.0, 20.0, 30.0, intra_node_gbps=1.0, intra_node_latency_us=300.0)
    assert not cpu.overlaps_collectives and H100.overlaps_collectives
    gather = 4e6 * 1 / 2 / 1e9 + 300e-6  # 4 MB over 2 ranks: half the buffer crosses the link, plus latency
    b = price(trace, cpu, comm={("dp", "all_gather", 2): (40e6, 10)})
    assert b.compute == pytest.approx(100 * 2 * 1024**3 / 1e12)  # 0.21 s: enough to hide 10 gathers on a GPU
    assert b.communication == pytest.approx(b.communication_total) == pytest.approx(10 * gather)
    assert b.step == pytest.approx(b.compute + 10 * gather + b.host)

def test_stragglers_stretch_a_multi_rank_step_by_the_measured_share():
    # a CPU whose ranks wait, at their collectives, 10% of their own time between them for the last rank:
    # the step gains 10% of its compute and host time, in its own term; one process has no collectives and
    # waits for no one; an accelerator's share is 0 (not modelled)
    trace = OpTrace()
    trace.matmuls[("forward", "bfloat16", 1024, 1024, 1024, 1)] = 100
    trace.host_ops["aten::mm"] = 100
    cpu = measured_cpu(1.0, 1.0, 20.0, 30.0, intra_node_gbps=1.0, intra_node_latency_us=300.0,
                       straggler_share=0.1)
    comm = {("dp", "all_gather", 2): (40e6, 10)}
    alone = price(trace, dataclasses.replace(cpu, straggler_share=0.0), comm=comm)
    b = price(trace, cpu, comm=comm)
    assert b.host == pytest.approx(100 * 30e-6) and b.compute == pytest.approx(100 * 2 * 1024**3 / 1e12)
    assert b.waiting == pytest.approx(0.1 * (b.compute + b.host))
    assert b.step == pytest.approx(alone.step + b.waiting) and alone.waiting == 0
    assert price(trace, cpu).waiting == 0  # no collective
    assert price(trace, cpu, comm={("dp", "all_gather", 2): (0, 0)}).waiting == 0  # none called
    assert H100.straggler_share == 0 and price(trace, H100, comm=comm).waiting == 0


def test_a_cpu_step_pays_its_counted_page_faults():
    # a real CPU step's counted minor page faults and released pages at the CPU's measured costs, a term of
    # its own in the step; an uncounted trace (fake tensors) or an accelerator (0 us, a caching allocator)
    # pays none
    trace = OpTrace()
    trace.matmuls[("forward", "bfloat16", 1024, 1024, 1024, 1)] = 10
    cpu = measured_cpu(1.0, 1.0, 20.0, 30.0, page_fault_us=1.5, page_release_us=0.25)
    uncounted = price(trace, cpu)
    trace.page_faults, trace.pages_released = 20_000, 8_000
    b = price(trace, cpu)
    assert uncounted.page_faults == 0 and b.page_faults == pytest.approx(20_000 * 1.5e-6 + 8_000 * 0.25e-6)
    assert b.step == pytest.approx(uncounted.step + 0.032)
    assert H100.page_fault_us == 0 and price(trace, H100).page_faults == 0
    # transparent huge pages among the faults, each at its own cost: 100 of the 20,000 are huge pages (one
    # fault each); the released pages stay 4 KiB ones (the trim releases huge pages split)
    huge = measured_cpu(1.0, 1.0, 20.0, 30.0, page_fault_us=1.5, page_release_us=0.25, huge_page_fault_us=130.0)
    trace.huge_page_faults = 100
    expected = (19_900 * 1.5 + 100 * 130.0 + 8_000 * 0.25) * 1e-6
    assert price(trace, huge).page_faults == pytest.approx(expected)
    # a huge page's cost unmeasured: its faults at a 4 KiB page's, as before huge pages were told apart
    assert price(trace, cpu).page_faults == pytest.approx((20_000 * 1.5 + 8_000 * 0.25) * 1e-6)
    # a huge count beyond what the step counted (the machine's count over its ranks) is cut to the step's
    trace.huge_page_faults = 30_000
    assert price(trace, huge).page_faults == pytest.approx((20_000 * 130.0 + 8_000 * 0.25) * 1e-6)


def test_fusion_model_prices_a_compiled_region_by_its_inputs_and_outputs():
    w = meta(4096, 4096)
    x0 = meta(4096, 4096)
    with RecordingMode() as rec:
        x = x0 @ w
        y = x0 @ w
        z = x * torch.sigmoid(x) * y  # three elementwise ops between two matmuls
        z @ w
    mem = rec.trace.memory["forward"]
    size = 4096 * 4096 * 2
    assert mem.ops == 3 and mem.regions == 1
    assert mem.eager_bytes == 8 * size  # sigmoid 2, each mul 3
    assert mem.fused_bytes == 3 * size  # reads x and y, writes z once
    assert price(rec.trace, H100, compiled=True).elementwise == pytest.approx(3 * size / BW)
    assert price(rec.trace, H100).elementwise == pytest.approx(8 * size / BW)


def test_phases_and_a_real_cpu_step_priced_with_measured_figures():
    lin = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.GELU(), torch.nn.Linear(64, 64))
    opt = torch.optim.AdamW(lin.parameters())
    with RecordingMode() as rec:
        x = torch.utils.checkpoint.checkpoint(lin, torch.randn(8, 64, requires_grad=True), use_reentrant=False)
        x.sum().backward()
        opt.step()
    ops = rec.trace.host_ops
    assert ops["forward"] and ops["backward"] and ops["recompute"] and ops["optimizer"]
    cpu = measured_cpu(1.0, 0.5, 20.0, 5.0)
    b = price(rec.trace, cpu)
    assert b.host == pytest.approx(sum(ops.values()) * 5e-6)  # a CPU's host time adds to its compute
    assert b.step == pytest.approx(b.matmul + b.elementwise + b.host)


SIM = ["--nodes", "1", "--devices-per-node", "4", "model_name=qwen3-8b",
       'model_overrides={"num_hidden_layers": 2, "hidden_size": 128, "intermediate_size": 256, '
       '"num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32, "vocab_size": 1000}',
       "tp=2", "seq_length=64", "batch_size=2", "activation_checkpointing=full"]


@pytest.mark.parametrize("device, kernel", [("h100", "flash"), ("910b", "npu_fusion")])
def test_simulate_json_carries_the_priced_step_on_the_named_device(device, kernel, capsys):
    from qwen3_pretrain.simulate.cli import main

    assert main(["--json", "--ranks", "0", "--device", device, *SIM]) == 0
    rank = json.loads(capsys.readouterr().out)["ranks"][0]
    assert set(rank["attention_kernels_per_step"]) == {kernel}  # the engine built with the device's kernels
    roof = rank["roofline"]
    assert roof["device"] == device
    for mode in ("eager", "compiled"):
        b = roof[mode]["breakdown_s"]
        assert b["matmul"] > 0 and b["elementwise"] > 0 and b["communication"] > 0
        assert b["step"] == pytest.approx(sum(b[k] for k in ("matmul", "attention", "elementwise", "communication",
                                                             "host", "bubble")), abs=1e-5)
    assert roof["trace"]["host_ops"]["recompute"] > 0  # full recompute reruns the forward in backward
    assert roof["compiled"]["step_s"] < roof["eager"]["step_s"]


def test_simulate_rejects_an_unknown_device(capsys):
    from qwen3_pretrain.errors import UserError
    from qwen3_pretrain.simulate.cli import main

    with pytest.raises(UserError, match="h100"):
        main(["--device", "h1000", *SIM])


@pytest.mark.parametrize("device", ["910b", "a100"])
def test_simulate_refuses_fp8_on_a_device_without_fp8(device):
    """The run would be refused there at start; the simulation says so instead of pricing a missing peak."""
    from qwen3_pretrain.errors import UserError
    from qwen3_pretrain.simulate.cli import main

    with pytest.raises(UserError, match=f"fp8: tensorwise cannot be simulated on {device}"):
        main(["--device", device, *SIM, "fp8=tensorwise"])


# --- per-device attention, grouped matmuls per group, the compiled scope, matmuls into buffers ----------------


def test_attention_is_priced_at_the_devices_own_efficiency():
    import dataclasses

    trace = OpTrace()
    trace.attention[("forward", "flash", "bfloat16", 1, 32, 8192, 8192, 128, True)] = 1
    flops = 4 * 32 * 8192 * 8192 * 128 / 2
    assert H100.attention_efficiency == 0.5  # FlashAttention's share on accelerators
    slow = dataclasses.replace(H100, attention_efficiency=0.02)  # a CPU's flash kernel, say
    assert price(trace, slow).attention == pytest.approx(flops / (989e12 * 0.02))
    cpu = measured_cpu(1.0, 0.5, 20.0, 5.0, attention_tflops=0.03)
    assert cpu.attention_efficiency == pytest.approx(0.03)  # the measured rate over the bf16 peak of 1 TFLOP/s
    assert price(trace, cpu).attention == pytest.approx(flops / 0.03e12)


def test_grouped_matmul_is_recorded_and_priced_per_group():
    x, g = torch.randn(64, 32, dtype=torch.bfloat16), torch.randn(64, 16, dtype=torch.bfloat16)
    w = torch.randn(4, 16, 32, dtype=torch.bfloat16)
    offs = torch.tensor([16, 32, 48, 64], dtype=torch.int32)
    with RecordingMode() as rec:
        torch._grouped_mm(x, w.transpose(-2, -1), offs=offs)  # 4 groups of 16 rows: [16, 32] @ [32, 16]
        torch._grouped_mm(g.t(), x, offs=offs)  # weight gradient: [16, 16 of 64] @ [16 of 64, 32] per group
    assert dict(rec.trace.matmuls) == {("forward", "bfloat16", 16, 16, 32, 4): 1,
                                       ("forward", "bfloat16", 16, 32, 16, 4): 1}
    assert rec.trace.matmul_flops() == 2 * (2 * 64 * 16 * 32)
    # a FLOP-bound grouped call by hand: 8 groups of [512, 4096] @ [4096, 2048]; one group's smallest side is
    # 512 (class share 0.85 on an accelerator), and the device's grouped share applies on top
    import dataclasses

    trace = OpTrace()
    trace.matmuls[("forward", "bfloat16", 512, 2048, 4096, 8)] = 1
    flops = 2 * 512 * 2048 * 4096 * 8
    assert price(trace, H100).matmul == pytest.approx(flops / (989e12 * 0.75 * 0.85))
    looped = dataclasses.replace(H100, grouped_matmul_share=0.25)
    assert price(trace, looped).matmul == pytest.approx(flops / (989e12 * 0.75 * 0.85 * 0.25))
    # per-device shape classes: a device whose products under 1024 on a side reach a tenth
    tiny = dataclasses.replace(H100, matmul_shape_classes=((1024, 0.1),))
    assert price(trace, tiny).matmul == pytest.approx(flops / (989e12 * 0.75 * 0.1))


def test_fp32_matmuls_take_the_devices_fp32_shape_classes():
    trace = OpTrace()
    trace.matmuls[("forward", "float32", 1024, 64, 64, 1)] = 10
    cpu = measured_cpu(1.0, 0.5, 1e6, 5.0, shape_classes=((128, 0.2),), fp32_shape_classes=((128, 0.4),))
    assert price(trace, cpu).matmul == pytest.approx(10 * 2 * 1024 * 64 * 64 / (0.5e12 * 0.4))
    trace = OpTrace()
    trace.matmuls[("forward", "bfloat16", 1024, 64, 64, 1)] = 10
    assert price(trace, cpu).matmul == pytest.approx(10 * 2 * 1024 * 64 * 64 / (1.0e12 * 0.2))


class _Gate(torch.nn.Module):
    def forward(self, x, y):
        return x * torch.sigmoid(x) * y


def test_only_the_compiled_scope_is_fused():
    """The module compile would compile fuses its ops (reads x and y, writes z once); the add after it, outside
    the compiled scope, runs eager under compile too: its bytes count one op at a time."""
    w, x0 = meta(4096, 4096), meta(4096, 4096)
    gate = _Gate()
    with RecordingMode() as rec:
        rec.recorder.mark_compiled([gate])
        x = x0 @ w
        y = x0 @ w
        z = gate(x, y)  # sigmoid, mul, mul: inside
        out = z + y  # outside
        out.sum()  # outside
    mem, size = rec.trace.memory["forward"], 4096 * 4096 * 2
    assert mem.ops == 5 and mem.regions == 1
    assert mem.fused_bytes == 3 * size  # the gate: reads x, y, writes z
    assert mem.outside_bytes == 3 * size + size + 2  # the add: 2 reads 1 write; the sum reads out, writes 2 bytes
    assert mem.eager_bytes == 8 * size + mem.outside_bytes
    assert rec.trace.outside_ops["forward"] == 4 and rec.trace.outside_kernels == 2  # the two matmuls too
    assert price(rec.trace, H100, compiled=True).elementwise == pytest.approx((3 * size + 4 * size + 2) / BW)
    # host under compile: the gate's fused region at the compiled launch cost, the 4 outside ops eager
    host = 1 * H100.compiled_launch_us * 1e-6 + 4 * H100.launch_latency_us * 1e-6
    cpu_like = dataclasses_replace(H100, device_type="cpu")
    assert price(rec.trace, cpu_like, compiled=True).host == pytest.approx(host)


def dataclasses_replace(hw, **changes):
    import dataclasses

    return dataclasses.replace(hw, **changes)


class _Sin(torch.nn.Module):
    def forward(self, y):
        return y.sin()


def test_backward_of_the_compiled_scope_is_in_it():
    """The backward ops of the nodes a compiled module's forward created are in the scope (sin's backward:
    cos and mul); those of the eager op before it (mul's backward: one mul) and the autograd root are not."""
    gate = _Sin()
    x = torch.randn(64, requires_grad=True)
    with RecordingMode() as rec:
        rec.recorder.mark_compiled([gate])
        gate(x * 2).sum().backward()
    trace = rec.trace
    assert trace.outside_ops["forward"] == 3  # x * 2, the sum and backward()'s seed (ones_like); sin inside
    inside_backward = trace.host_ops["backward"] - trace.outside_ops["backward"]
    assert inside_backward == 2, (dict(trace.host_ops), dict(trace.outside_ops))  # cos, mul of SinBackward


def test_the_decoder_layers_are_the_default_compiled_scope_of_simulate():
    from qwen3_pretrain.simulate.roofline import TraceRecorder

    assert TraceRecorder().scope == "layers" and RecordingMode().recorder.scope is None


def test_matmuls_written_into_buffers_count_as_matmuls():
    a, b = torch.randn(32, 16), torch.randn(16, 8)
    out, bias = torch.empty(32, 8), torch.zeros(32, 8)
    a3, b3, out3 = torch.randn(2, 32, 16), torch.randn(2, 16, 8), torch.zeros(2, 32, 8)
    with RecordingMode() as rec:
        torch.mm(a, b, out=out)
        bias.addmm_(a, b)
        torch.addmm(bias, a, b, out=out)
        torch.bmm(a3, b3, out=out3)
        out3.baddbmm_(a3, b3)
    assert dict(rec.trace.matmuls) == {("forward", "float32", 32, 8, 16, 1): 3, ("forward", "float32", 64, 8, 16, 1): 2}
    assert rec.trace.matmul_flops() == 3 * 2 * 32 * 8 * 16 + 2 * 2 * 64 * 8 * 16
    assert rec.trace.memory["forward"].ops == 0  # no memory-bound bytes for them


def test_memory_bound_bytes_are_kept_by_kernel_size_and_priced_on_a_bandwidth_curve():
    """A CPU streams a cache-sized working set faster than a memory-sized one: each op (eager) or fused region
    (compiled) is priced at the rate of its own size on the device's curve, worked out by hand here."""
    from qwen3_pretrain.simulate.roofline.trace import NEVER, bucket_bytes, size_bucket

    assert (size_bucket(1), size_bucket(2), size_bucket(3), size_bucket(4), size_bucket(5)) == (0, 1, 2, 2, 3)
    assert bucket_bytes(22) == pytest.approx(2**21.5)
    small, large = meta(256, 512, dtype=torch.float32), meta(2048, 2048, dtype=torch.float32)
    with RecordingMode() as rec:
        small + small  # 3 x 0.5 MiB = 1.5 MiB moved: bucket 21, (1, 2] MiB
        large * 2.0  # 2 x 16 MiB = 32 MiB: bucket 25
    mem = rec.trace.memory["forward"]
    s, l_ = 3 * 256 * 512 * 4, 2 * 2048 * 2048 * 4
    # (how, size bucket, reuse bucket): the inputs were touched by no recorded kernel before (NEVER), the
    # writes go to the caches (0); compiled, no matmul splits them: one fused region of both, which reads
    # ``small`` once (33 MiB, bucket 26)
    half, sixteen = 256 * 512 * 4, 2048 * 2048 * 4
    assert dict(mem.sizes) == {("eager", 21, NEVER, "fp32"): 2 * half, ("eager", 21, 0, "fp32"): half,
                               ("eager", 25, NEVER, "fp32"): sixteen, ("eager", 25, 0, "fp32"): sixteen,
                               ("fused", 26, NEVER, "fused"): half + sixteen, ("fused", 26, 0, "fused"): half + sixteen}
    # the curve: 40 GB/s up to 1 MiB, 10 GB/s from 16 MiB, linear in log size between
    MiB = 2**20
    hw = measured_cpu(1.0, 1.0, 5.0, 1.0, bandwidth_curve=((1 * MiB, 40.0), (16 * MiB, 10.0)))
    assert hw.bandwidth_at(0.5 * MiB) == pytest.approx(40e9) and hw.bandwidth_at(64 * MiB) == pytest.approx(10e9)
    assert hw.bandwidth_at(4 * MiB) == pytest.approx(25e9)  # log2 4 / log2 16 = half way
    rate_small = 40 + (10 - 40) * 0.5 / 4  # bucket 21 priced at 2^20.5 bytes: half an octave above 1 MiB
    expected = s / (rate_small * 1e9) + l_ / 10e9  # bucket 25 (2^24.5 bytes) beyond the last point
    assert price(rec.trace, hw).elementwise == pytest.approx(expected)  # no cache size: every byte on the curve
    # without a curve every byte at the one figure (5 GB/s, efficiency 1 on a measured CPU), as before
    flat = measured_cpu(1.0, 1.0, 5.0, 1.0)
    assert price(rec.trace, flat).elementwise == pytest.approx((s + l_) / 5e9)
    # an accelerator keeps its one HBM figure: no curve in the table
    assert H100.bandwidth_curve == () and H100.bandwidth_at(1) == pytest.approx(BW)


def test_fused_regions_are_sized_by_their_own_bytes():
    """Under compile a region's bytes (what it reads from outside and writes out) go to the bucket of that
    total, not of its ops one by one; the ops outside the compiled scope keep their own sizes."""
    w, x0 = meta(1024, 1024), meta(1024, 1024)
    with RecordingMode() as rec:
        x = x0 @ w
        z = x * torch.sigmoid(x) * x  # reads x (2 MiB), writes z (2 MiB): one region of 4 MiB
        z @ w
    mem = rec.trace.memory["forward"]
    size = 1024 * 1024 * 2
    # 4 MiB: bucket 22 holds (2, 4] MiB; x was written by the matmul just before (reuse: its own 2 MiB)
    assert mem.sizes[("fused", 22, 21, "fused")] == size and mem.sizes[("fused", 22, 0, "fused")] == size
    assert sum(v for (how, *_), v in mem.sizes.items() if how == "eager") == mem.eager_bytes
    hw = measured_cpu(1.0, 1.0, 5.0, 1.0, bandwidth_curve=((2**22, 20.0),))  # one point: held everywhere
    assert price(rec.trace, hw, compiled=True).elementwise == pytest.approx(2 * size / 20e9)


def test_reads_stream_from_memory_once_the_traffic_since_their_last_touch_outgrows_the_caches():
    """The reuse distance of a read (bytes any recorded kernel touched since the tensor's last touch, plus its
    own) against the device's ``cache_bytes``: within it the read is priced on the curve at the op's size,
    beyond it at the streaming end; writes on the curve. Worked out by hand."""
    from qwen3_pretrain.simulate.roofline.trace import NEVER

    MiB = 2**20
    x, big = meta(MiB // 4, dtype=torch.float32), meta(4 * MiB, dtype=torch.float32)  # 1 MiB, 16 MiB
    with RecordingMode() as rec:
        y = x + 1  # reads x (never touched), writes y
        y * 2  # reads y right after: distance 1 MiB (its own bytes), bucket 20
        big.neg()  # 16 MiB read, 16 MiB written
        y * 3  # y again: 1 (the product) + 32 (neg) + 1 (itself) MiB since, bucket 26
    sizes = rec.trace.memory["forward"].sizes
    assert (sizes[("eager", 21, 20, "fp32")], sizes[("eager", 21, 26, "fp32")], sizes[("eager", 21, NEVER, "fp32")]) \
        == (MiB, MiB, MiB)
    hw = measured_cpu(1.0, 1.0, 5.0, 1.0, bandwidth_curve=((MiB, 40.0), (64 * MiB, 10.0)), cache_bytes=8 * MiB)
    at_2mib = (40 - 30 * 0.5 / 6) * 1e9  # ops moving 2 MiB (bucket 21, priced at 2^20.5 bytes)
    at_32mib = (40 - 30 * 4.5 / 6) * 1e9  # the neg's 32 MiB (bucket 25, 2^24.5 bytes)
    streaming = 10e9
    expected = (MiB / streaming + MiB / at_2mib  # x + 1: x from memory, y written
                + 2 * MiB / at_2mib  # y * 2: y from the caches, the product written
                + 16 * MiB / streaming + 16 * MiB / at_32mib  # neg
                + MiB / streaming + MiB / at_2mib)  # y * 3: y from memory again
    assert price(rec.trace, hw).elementwise == pytest.approx(expected)


def test_memory_bound_ops_are_classed_by_what_they_do_and_dtype():
    """``op_class``: routing's gathers and sorts are ``index``; copies ``copy`` or, into another dtype,
    ``cast``; arithmetic with a bf16 operand ``bf16``, a transcendental of one ``bf16_math``, of fp32
    ``fp32_math`` (in place too); other fp32 arithmetic in place ``inplace``; the rest ``fp32``. The class is
    kept with the bytes."""
    x16, x32, idx = meta(64, 32), meta(64, 32, dtype=torch.float32), torch.empty(64, dtype=torch.int64, device="meta")
    sq16 = meta(32, 32)
    with RecordingMode() as rec:
        x16.index_select(0, idx)
        x32.sort(dim=-1)
        x16 + x16
        torch.nn.functional.silu(x16)
        x32 * x32
        x32.mul_(2.0)
        x32.exp_()
        torch.exp(x32)
        x32.to(torch.bfloat16)
        x16.clone()
        x16.t().contiguous()
        torch.ops.aten.silu_backward(sq16, sq16.t())
        x32.t() * x32.t()
        torch.nn.functional.conv1d(meta(1, 8, 16), meta(8, 1, 4), groups=8)
    classes = {}
    for (how, _, _, cls), nbytes in rec.trace.memory["forward"].sizes.items():
        if how == "eager":
            classes[cls] = classes.get(cls, 0) + nbytes
    half, full = 64 * 32 * 2, 64 * 32 * 4
    assert classes == {"index": (2 * half + 64 * 8) + (2 * full + 64 * 32 * 8),  # sort writes int64 indices too
                       "bf16": 3 * half, "bf16_math": 2 * half, "fp32": 3 * full, "inplace": 2 * full,
                       "fp32_math": 2 * full + 2 * full,  # exp in place and into a new tensor alike
                       "cast": full + half, "copy": 2 * half, "strided": 2 * half + 3 * full,
                       "strided_math": 3 * 32 * 32 * 2, "conv": (8 * 16 + 8 * 4 + 8 * 13) * 2}


def test_gathers_and_scatters_move_the_elements_they_index_not_the_whole_tensor():
    """The loss's gather of the target logits reads one element per index from a [tokens, vocab] tensor, and
    its backward's scatter add writes as many: priced by those bytes (and the index), not the vocabulary's."""
    tokens, vocab = 64, 4096
    logits, target = meta(tokens, vocab, dtype=torch.float32), torch.empty(tokens, 1, dtype=torch.int64, device="meta")
    grad, ones = meta(tokens, vocab, dtype=torch.float32), meta(tokens, 1, dtype=torch.float32)
    with RecordingMode() as rec:
        logits.gather(1, target)
        grad.scatter_add_(1, target, ones)
    mem = rec.trace.memory["forward"]
    gather = tokens * 4 + tokens * 8 + tokens * 4  # the indexed logits, the index, the output
    scatter = tokens * 4 + tokens * 8 + tokens * 4 + tokens * 4  # grad's indexed elements read, index, src, written
    assert mem.eager_bytes == gather + scatter


def test_each_op_class_is_priced_on_its_own_curve_where_the_device_has_one():
    """``Hardware.class_curves``: an op of a class with its own curve streams at that curve's rate, the others
    (and compiled regions) at ``bandwidth_curve``'s; accelerators have none. Worked out by hand."""
    MiB = 2**20
    a16, a32 = meta(MiB // 2), meta(MiB // 4, dtype=torch.float32)  # 1 MiB each
    with RecordingMode() as rec:
        a16 + a16  # bf16: 3 MiB moved
        a32 * a32  # fp32: 3 MiB moved
    flat_curve = ((MiB, 30.0),)  # one point: held at every size
    hw = measured_cpu(1.0, 1.0, 5.0, 1.0, bandwidth_curve=flat_curve, class_curves=(("bf16", ((MiB, 10.0),)),))
    assert hw.bandwidth_at(MiB, "bf16") == pytest.approx(10e9) and hw.bandwidth_at(MiB, "fp32") == pytest.approx(30e9)
    assert hw.bandwidth_at(MiB) == pytest.approx(30e9)
    assert price(rec.trace, hw).elementwise == pytest.approx(3 * MiB / 10e9 + 3 * MiB / 30e9)
    # compiled: one fused region (each input read once: 2 MiB, both outputs written: 2 MiB) on the one curve, or
    # its ops' arithmetic at their classes' fastest rates where that is longer, as here (the bf16 add's 10 GB/s)
    assert price(rec.trace, hw, compiled=True).elementwise == pytest.approx(3 * MiB / 10e9 + 3 * MiB / 30e9)
    assert H100.class_curves == () and H100.bandwidth_at(MiB, "bf16") == pytest.approx(BW)


def test_a_fused_region_costs_at_least_its_ops_arithmetic_where_the_device_has_class_curves():
    """Fusion saves a region's traffic between its ops, not their arithmetic: on a device with class curves (a
    CPU's) the compiled regions of a phase take the longer of their traffic and their ops' bytes one at a time,
    each at its class's fastest rate; an accelerator (no class curves) pays the traffic only. By hand."""
    MiB = 2**20
    x, y = meta(MiB // 4, dtype=torch.float32), meta(MiB // 4, dtype=torch.float32)  # 1 MiB each
    with RecordingMode() as rec:
        z = x * y
        z * z  # one region: reads x and y, writes the last product; z stays inside
    mem = rec.trace.memory["forward"]
    assert mem.regions == 1 and dict(mem.fused_ops) == {"fp32": 6 * MiB}  # 3 MiB per op, one at a time
    traffic = 3 * MiB / 30e9
    for peak, expected in ((20.0, 6 * MiB / 20e9), (120.0, traffic)):  # arithmetic longer / traffic longer
        curve = ((MiB, peak), (64 * MiB, 5.0))  # the class's fastest point is its cached one
        hw = measured_cpu(1.0, 1.0, 5.0, 1.0, bandwidth_curve=((MiB, 30.0),), class_curves=(("fp32", curve),))
        assert hw.class_peak("fp32") == pytest.approx(peak * 1e9)
        assert price(rec.trace, hw, compiled=True).elementwise == pytest.approx(expected)
    assert H100.class_peak("fp32") is None
    assert price(rec.trace, H100, compiled=True).elementwise == pytest.approx(3 * MiB / BW)


def test_a_triangular_solve_is_priced_by_its_flops_and_splits_the_fused_regions():
    """``linalg_solve_triangular`` (the Gated DeltaNet's chunk inverse): ``n^2 k`` FLOPs a system at the
    device's measured solve rate, else as a matmul of the smallest shape class; under compile a kernel of its
    own between two fused regions, not memory-bound bytes. By hand."""
    a, b = meta(8, 64, 64, dtype=torch.float32), meta(8, 64, 32, dtype=torch.float32)
    c = meta(8, 32, 64, dtype=torch.float32)
    with RecordingMode() as rec:
        y = b * 2  # region 1
        x = torch.linalg.solve_triangular(a, y, upper=False)  # 8 systems of 64 x 64, 32 right-hand sides
        torch.linalg.solve_triangular(a, c, upper=False, left=False)  # X A = C: C's 32 rows are the sides
        x + 1  # region 2
    trace = rec.trace
    assert dict(trace.solves) == {("forward", "float32", 8, 64, 32): 2}
    assert trace.memory["forward"].regions == 2 and trace.memory["forward"].ops == 2
    flops = 2 * 8 * 64 * 64 * 32
    assert trace.solve_flops() == flops
    cpu = measured_cpu(1.0, 0.5, 5.0, 1.0, solve_tflops=0.01)
    assert price(trace, cpu).matmul == pytest.approx(flops / 0.01e12)
    # no measured rate: a matmul of the fp32 peak in the smallest shape class, or the bytes (the systems, the
    # right-hand sides, the results) at memory bandwidth where longer, as on the H100 at these small sizes
    moved = 2 * 4 * 8 * (64 * 64 + 2 * 64 * 32)
    share = H100.shape_classes("float32")[0][1]
    compute = flops / (H100.fp32_peak_tflops * 1e12 * H100.matmul_efficiency * share)
    assert moved / BW > compute
    assert price(trace, H100).matmul == pytest.approx(moved / BW)
    faster = dataclasses.replace(H100, memory_bandwidth_gbps=H100.memory_bandwidth_gbps * 100)
    assert price(trace, faster).matmul == pytest.approx(compute)
    # compiled, each solve a kernel of its own beside the two regions: 4 launches
    launch = measured_cpu(1.0, 0.5, 5.0, 1.0, compiled_launch_us=10.0)
    assert price(trace, launch, compiled=True).host == pytest.approx(4 * 10e-6)
    # batch dims broadcast: one set of right-hand sides against 8 systems is 8 solves
    with RecordingMode() as rec:
        torch.linalg.solve_triangular(a, meta(64, 32, dtype=torch.float32), upper=False)
    assert dict(rec.trace.solves) == {("forward", "float32", 8, 64, 32): 1}


def test_a_convolution_under_compile_is_a_kernel_of_its_own_on_its_class_curve():
    """Inductor calls a convolution as an extern kernel: it splits the fused regions around it and is priced
    on the conv class's curve, not fused into its neighbours. Worked out by hand."""
    x, w = meta(1, 8, 64), meta(8, 1, 4)  # bf16: 1 KiB in, 64 B of weights
    with RecordingMode() as rec:
        y = x * 2  # region 1: reads x, writes y
        z = torch.nn.functional.conv1d(y, w, groups=8)  # its own: reads y and w, writes z [1, 8, 61]
        z + 1  # region 2
    mem = rec.trace.memory["forward"]
    assert mem.regions == 3
    conv = 8 * 64 * 2 + 8 * 4 * 2 + 8 * 61 * 2
    assert sum(v for (how, _, _, cls), v in mem.sizes.items() if how == "fused" and cls == "conv") == conv
    hw = measured_cpu(1.0, 1.0, 5.0, 1.0, bandwidth_curve=((1024, 20.0),), class_curves=(("conv", ((1024, 1.0),)),))
    others = mem.fused_bytes - conv
    assert price(rec.trace, hw, compiled=True).elementwise == pytest.approx(conv / 1e9 + others / 20e9)
