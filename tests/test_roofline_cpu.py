"""The CPU's own roofline numbers (``simulate.probe``) and the CPU roofline bench's profiler categories.

Speed itself is measured in bench/roofline_cpu.py (predicted against measured step time); here only what a
user of the probe relies on: every figure positive and finite, in plausible ranges, and the bench's table
sorting torch.profiler's events into the categories the prediction has.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from qwen3_pretrain.simulate.probe import CpuProbe, linear_tflops, measure_cpu, minor_faults, seconds_per_call
from test_loss import run_distributed

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def probe() -> CpuProbe:
    return measure_cpu(shapes=[(256, 64, 128)], threads=1, square=256, skinny=(512, 64, 64), min_seconds=0.005,
                       memory_mib=16, grouped=[(256, 4, 64, 64)], group_counts=[[100, 50, 0, 110], [64, 64, 64]],
                       attention=(1, 4, 2, 128, 32), curve_mib=(0.25, 1.0), solves=[("float32", 4, 16, 16)])


def test_probe_figures_are_positive_and_plausible(probe):
    assert probe.threads == 1
    assert set(probe.matmul_tflops) == {(d, c) for d in ("fp32", "bf16")
                                        for c in ("square", "skinny", "tiny", "256x64x128")} | {
        ("bf16", "grouped 256x4x64x64"), ("bf16", "attention")}
    # below 100 TFLOP/s on one core of any CPU; no lower bound but zero (a loaded machine can be very slow)
    assert all(0 < v < 100 and math.isfinite(v) for v in probe.matmul_tflops.values()), probe.matmul_tflops
    assert set(probe.memory_gbps) == {"copy", "add_fp32", "add_bf16"}
    assert all(0 < v < 10_000 for v in probe.memory_gbps.values()), probe.memory_gbps
    assert probe.bandwidth_gbps == probe.memory_gbps["add_fp32"]
    assert 0.05 < probe.op_latency_us < 10_000
    assert 0.05 < probe.autograd_op_latency_us < 100_000
    assert set(probe.bandwidth_by_size) == {"copy", "add_bf16", "mul_fp32", "cast", "index", "mul_inplace",
                                            "silu_bf16", "exp_fp32", "strided", "strided_silu_bf16",
                                            "conv_bf16"}
    assert probe.curve_mib == (0.25, 1.0)
    assert all(len(v) == 2 and all(0 < x < 10_000 for x in v) for v in probe.bandwidth_by_size.values())
    # a fresh page's fault and release: about 1 and 0.25 us; 0 where the platform cannot measure them
    assert 0 <= probe.page_release_us < 1000 and 0 <= probe.page_fault_us < 1000
    # a huge page's fault: 110-200 us there; 0 where the kernel gave none
    assert 0 <= probe.huge_page_fault_us < 100_000
    assert probe.hardware().huge_page_fault_us == probe.huge_page_fault_us
    assert 0 < probe.solve_tflops < 100 and probe.hardware().solve_tflops == probe.solve_tflops
    assert measure_cpu(threads=1, square=64, skinny=(64, 64, 64), min_seconds=0.001, memory_mib=1,
                       curve_mib=()).solve_tflops is None  # none asked: a solve priced as a tiny matmul
    assert len(probe.rows()) == 1 + len(probe.matmul_tflops) + len(probe.memory_gbps) + 11 + 1 + 1 + (
        1 if probe.page_fault_us else 0) + (1 if probe.huge_page_fault_us else 0)


def test_probe_restores_the_thread_count():
    before = torch.get_num_threads()
    measure_cpu(threads=1, square=64, skinny=(64, 64, 64), min_seconds=0.001, memory_mib=1)
    assert torch.get_num_threads() == before


def test_timer_counts_the_work_of_a_call():
    """A call that does twice the work takes about twice as long (the timer divides by the calls it made)."""
    a = torch.randn(256, 256)
    ratios, threads = [], torch.get_num_threads()
    # One thread, as the probe runs: with two, a core taken by another process stalls every product on
    # OpenMP's slowest thread, and wall-time windows differ by far more than 2x.
    torch.set_num_threads(1)
    try:
        for _ in range(5):  # a shared machine may preempt one window: one attempt in bounds shows the division
            one = seconds_per_call(lambda: a @ a, min_seconds=0.01)
            two = seconds_per_call(lambda: (a @ a, a @ a), min_seconds=0.01)
            ratios.append(two / one)
            if 1.2 < ratios[-1] < 3.5:
                break
    finally:
        torch.set_num_threads(threads)
    assert 1.2 < ratios[-1] < 3.5, ratios
    # three products per linear layer, each 2 m k n FLOPs
    assert linear_tflops(64, 64, 64, torch.float32, 0.002) > 0


def test_profiler_categories_of_the_bench(monkeypatch):
    monkeypatch.syspath_prepend(str(REPO / "bench"))
    from roofline_cpu import CATEGORIES, op_category, profiled_categories

    assert op_category("aten::mm") == "matmul"
    assert op_category("aten::_scaled_dot_product_flash_attention_for_cpu_backward") == "attention"
    assert op_category("gloo:all_reduce") == "communication"
    assert op_category("c10d::allreduce_") == "communication"
    assert op_category("aten::mul") == "elementwise"
    assert op_category("## Call CompiledFxGraph abc ##") == "elementwise"
    assert op_category("Optimizer.step#AdamW.step") == "other"
    x, w = torch.randn(64, 64), torch.randn(64, 64)
    seconds = profiled_categories(lambda: (x @ w).relu().sum())
    assert set(seconds) == {*CATEGORIES, "wall", "ops", "collective_s", "cpu_s", "collectives", "faults",
                            "huge_faults"}
    assert seconds["ops"]["aten::mm"][1] == 1  # per event name: self seconds and calls
    assert seconds["matmul"] > 0 and seconds["elementwise"] > 0 and seconds["communication"] == 0
    assert op_category("aten::linalg_solve_triangular") == "matmul"  # priced with the matmuls


def test_median_links_keep_per_kind_the_fit_whose_price_of_its_message_is_the_median(monkeypatch):
    """Per collective kind, the run whose fitted link prices the kind's message at the median of the runs'
    prices, that run's bandwidth and latency together (not the median of each figure on its own)."""
    monkeypatch.syspath_prepend(str(REPO / "bench"))
    from roofline_cpu import median_links

    def fit(kind, gbps, latency_us):
        return {"axis": "tp", "kind": kind, "ranks": 2, "bytes": 2**20, "gbps": gbps, "latency_us": latency_us}

    # all-gather of 1 MiB on 2 ranks moves half of it: 0.5 MiB / bandwidth + latency
    runs = [[fit("all_gather", 1.0, 100.0), fit("all_reduce", 1.0, 5000.0)],  # 0.62 ms; 6.05 ms
            [fit("all_gather", 0.1, 10.0), fit("all_reduce", 2.0, 100.0)],  # 5.25 ms; 0.62 ms
            [fit("all_gather", 10.0, 1000.0), fit("all_reduce", 0.5, 200.0)]]  # 1.05 ms; 2.30 ms
    assert median_links(runs) == [runs[2][0], runs[2][1]]
    assert median_links([[], []]) == [] and median_links([]) == []


def test_profiled_steps_take_each_categorys_median_and_the_middle_steps_details(monkeypatch):
    """Several profiled steps: each category, the wall and the CPU time at their median over the steps, each
    independently; the per-op times and collectives of the middle step (the same step on every rank)."""
    monkeypatch.syspath_prepend(str(REPO / "bench"))
    import roofline_cpu
    from roofline_cpu import CATEGORIES

    runs = iter([{**dict.fromkeys(CATEGORIES, 0.0), "matmul": m, "other": o, "wall": w, "collective_s": 0.0,
                  "cpu_s": w, "ops": {"aten::mm": (m, i)}, "collectives": [("all_reduce", 8, i, i + 1)],
                  "faults": 10 * (i + 1), "huge_faults": 3 - i}
                 for i, (m, o, w) in enumerate(((0.5, 0.9, 2.0), (0.3, 0.1, 1.0), (0.4, 0.2, 3.0)))])
    monkeypatch.setattr(roofline_cpu, "profiled_categories", lambda step: next(runs))
    out = roofline_cpu.profiled_steps(lambda: None, 3)
    assert (out["matmul"], out["other"], out["wall"], out["cpu_s"]) == (0.4, 0.2, 2.0, 2.0)
    assert (out["faults"], out["huge_faults"]) == (20, 2)
    assert out["ops"] == {"aten::mm": (0.3, 1)} and out["collectives"] == [("all_reduce", 8, 1, 2)]
    assert out["repeats"] == 3


def test_bench_recorder_counts_matmuls_into_buffers_and_the_probe_device_prices_them(monkeypatch):
    """The fused loss writes its head's matmuls into buffers (mm.out, addmm_): the bench's recorder (the
    roofline's, with collectives counted) takes them as matmuls, and the probe's device prices them at the
    rate the probe measured for their sizes."""
    monkeypatch.syspath_prepend(str(REPO / "bench"))
    from roofline_cpu import StepRecorder

    from qwen3_pretrain.simulate.roofline import price

    a, b, out = torch.randn(256, 128), torch.randn(128, 384), torch.empty(256, 384)
    with StepRecorder() as recorder:  # without a trainer: no mesh, no collectives
        torch.mm(a, b, out=out)
        out.addmm_(a, b)
        torch.mm(a, b)
    assert sum(recorder.trace.matmuls.values()) == 3, recorder.trace.matmuls
    probe = _probe({("fp32", "256x128x384"): 0.01})
    breakdown = price(recorder.trace, probe.hardware(recorder.trace))
    # 3 x 2 x 256 x 128 x 384 FLOPs at the 0.01 TFLOP/s measured for these sizes
    assert breakdown.matmul == pytest.approx(3 * 2 * 256 * 128 * 384 / 0.01e12, rel=1e-6)


def _probe(rates: dict, **kw) -> CpuProbe:
    base = {("fp32", "skinny"): 1.0, ("bf16", "skinny"): 2.0, ("fp32", "tiny"): 0.25, ("bf16", "tiny"): 0.1}
    return CpuProbe("test", 1, {**base, **rates}, {"copy": 10.0, "add_fp32": 20.0, "add_bf16": 10.0}, 1.0, 2.0, **kw)


def test_probe_device_classes_grouped_attention_and_host():
    """Each figure of ``CpuProbe.hardware`` against the probe's numbers, worked out by hand."""
    from qwen3_pretrain.simulate.roofline import OpTrace, price

    probe = _probe({("bf16", "grouped 512x16x256x256"): 0.5, ("bf16", "attention"): 0.04}, engine_op_us=100.0,
                   engine_compiled_us=20.0)
    hw = probe.hardware()  # no trace: the skinny rates are the peaks
    assert (hw.peak_tflops, hw.fp32_peak_tflops) == (2.0, 1.0)
    assert hw.shape_classes("bfloat16") == ((128, 0.05),) and hw.shape_classes("float32") == ((128, 0.25),)
    assert hw.grouped_matmul_share == pytest.approx(0.25) and hw.attention_efficiency == pytest.approx(0.02)
    assert (hw.launch_latency_us, hw.compiled_launch_us) == (100.0, 20.0)
    assert hw.memory_bandwidth_gbps == 20.0 and hw.intra_node_gbps == 5.0
    trace = OpTrace()
    trace.matmuls[("forward", "float32", 1024, 64, 64, 1)] = 2  # the delta rule's chunk products: tiny class
    trace.matmuls[("forward", "bfloat16", 512, 256, 256, 16)] = 1  # 16 experts' groups of 512 rows
    trace.attention[("forward", "flash", "bfloat16", 4, 4, 512, 512, 64, True)] = 1
    b = price(trace, hw)
    assert b.matmul == pytest.approx(2 * 2 * 1024 * 64 * 64 / 0.25e12 + 2 * 512 * 256 * 256 * 16 / 0.5e12)
    assert b.attention == pytest.approx(4 * 4 * 4 * 512 * 512 * 64 / 2 / 0.04e12)
    assert b.host == pytest.approx(0)  # no op recorded: host counts recorded ops
    # without the training step's own figure the autograd chain's stands in
    assert _probe({}).hardware().launch_latency_us == 2.0


def test_probe_device_bandwidth_curve_is_the_median_kind_per_size():
    """``CpuProbe.hardware``'s curve: per working set, the median of the kernels' rates, at that many bytes."""
    curve = {"copy": [30.0, 8.0], "add_bf16": [10.0, 6.0], "mul_fp32": [40.0, 7.0], "cast": [20.0, 3.0]}
    hw = _probe({}, bandwidth_by_size=curve, curve_mib=(0.5, 128.0)).hardware()
    assert hw.bandwidth_curve == ((0.5 * 2**20, 25.0), (128 * 2**20, 6.5))
    assert hw.cache_bytes == 0.5 * 2**20  # the largest size 1.5x faster than the streaming end
    from qwen3_pretrain.simulate.probe import cache_bytes

    assert cache_bytes(((1, 30.0), (2, 20.0), (4, 15.0), (8, 14.0), (16, 10.0))) == 4
    assert cache_bytes(((1, 12.0), (16, 10.0))) == 0 and cache_bytes(((1, 30.0),)) == 0
    assert hw.memory_bandwidth_gbps == 20.0  # the streaming add stays the flat figure (matmuls' memory bound)
    assert _probe({}).hardware().bandwidth_curve == ()  # unmeasured: no curve, every op at the flat figure


def test_probe_device_has_a_curve_per_op_class_and_the_index_kind_stays_out_of_the_median():
    """Each op class on the curve of the kind that times it (fp32 arithmetic: the multiply, bf16: the bf16
    add, copies, casts, index: the row gather); the one curve (compiled regions) stays the median of the four
    streaming kinds, the gather aside."""
    curve = {"copy": [30.0, 8.0], "add_bf16": [10.0, 6.0], "mul_fp32": [40.0, 7.0], "cast": [20.0, 3.0],
             "index": [2.0, 1.0]}
    hw = _probe({}, bandwidth_by_size=curve, curve_mib=(0.5, 128.0)).hardware()
    assert hw.bandwidth_curve == ((0.5 * 2**20, 25.0), (128 * 2**20, 6.5))
    MiB = 2**20
    assert dict(hw.class_curves) == {"fp32": ((0.5 * MiB, 40.0), (128 * MiB, 7.0)),
                                     "bf16": ((0.5 * MiB, 10.0), (128 * MiB, 6.0)),
                                     "copy": ((0.5 * MiB, 30.0), (128 * MiB, 8.0)),
                                     "cast": ((0.5 * MiB, 20.0), (128 * MiB, 3.0)),
                                     "index": ((0.5 * MiB, 2.0), (128 * MiB, 1.0))}
    assert hw.bandwidth_at(128 * MiB, "index") == pytest.approx(1e9)


def test_grouped_probe_times_routing_group_sizes():
    """The expert kernel timed at uneven group sizes (a routing's, padding included: the operands grow to
    the largest sum) and at equal groups without them; both positive. That uneven groups are slower on a
    CPU is a speed figure: bench/roofline_cpu.py measures it."""
    from qwen3_pretrain.simulate.probe import grouped_tflops

    assert grouped_tflops(128, 4, 32, 32, min_seconds=0.002) > 0
    assert grouped_tflops(128, 4, 32, 32, min_seconds=0.002, counts=[[10, 100, 0, 50], [40, 40, 40, 40]]) > 0
    assert grouped_tflops(64, 2, 32, 32, min_seconds=0.002, counts=[[8, 56]], dtype=torch.float32) > 0


def test_bench_recorder_keeps_the_routings_group_sizes(monkeypatch):
    """The bench's recorder reads each grouped matmul's offsets on a real step (the forward and input
    gradient's row split), the distinct ones, for the probe."""
    monkeypatch.syspath_prepend(str(REPO / "bench"))
    from roofline_cpu import StepRecorder

    x, w = torch.randn(12, 16, dtype=torch.bfloat16), torch.randn(3, 8, 16, dtype=torch.bfloat16)
    with StepRecorder() as recorder:
        torch._grouped_mm(x, w.transpose(-2, -1), offs=torch.tensor([2, 9, 12], dtype=torch.int32))
        torch._grouped_mm(x, w.transpose(-2, -1), offs=torch.tensor([2, 9, 12], dtype=torch.int32))
        torch._grouped_mm(x, w.transpose(-2, -1), offs=torch.tensor([0, 4, 12], dtype=torch.int32))
    assert recorder.group_counts == [[2, 7, 3], [0, 4, 8]]
    assert sum(recorder.trace.matmuls.values()) == 3


def test_bench_recorder_counts_the_page_faults_of_the_op_that_touches_fresh_memory(monkeypatch):
    """The bench's recorder gives each op the minor page faults taken while it ran, by the profiler's category
    of the op: a fill of a fresh 8 MiB mapping (glibc maps a buffer of 8 MiB afresh until a larger one was
    freed) is an elementwise op's faults, about a page each; a matmul into warm memory takes almost none."""
    import mmap

    monkeypatch.syspath_prepend(str(REPO / "bench"))
    from roofline_cpu import StepRecorder

    if not hasattr(mmap, "MADV_NOHUGEPAGE") or not minor_faults():
        pytest.skip("no minor fault count or no madvise here")
    region = mmap.mmap(-1, 8 * 2**20, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        region.madvise(mmap.MADV_NOHUGEPAGE)
    except OSError:
        region.close()
        pytest.skip("this kernel has no transparent huge pages to decline")
    fresh = torch.frombuffer(region, dtype=torch.float32)
    a, out = torch.randn(64, 64), torch.empty(64, 64)
    torch.mm(a, a, out=out)
    with StepRecorder() as recorder:
        fresh.fill_(1.0)
        torch.mm(a, a, out=out)
    del fresh
    region.close()
    assert recorder.faults["elementwise"] >= 2048 * 0.9  # 8 MiB of 4 KiB pages
    assert recorder.faults["matmul"] < 64
    # their seconds per category at a probe's costs, a category's huge pages (the machine's count over the
    # ranks that recorded) at the huge page's cost
    from qwen3_pretrain.simulate.probe import CpuProbe

    probe = CpuProbe(cpu="x", threads=1, matmul_tflops={}, memory_gbps={}, op_latency_us=1.0,
                     autograd_op_latency_us=1.0, page_fault_us=1.0, huge_page_fault_us=100.0)
    recorder.faults.clear()
    recorder.faults.update(elementwise=3000, matmul=10)
    recorder.huge_faults.clear()
    recorder.huge_faults.update(elementwise=40, other=6)
    seconds = recorder.fault_seconds(probe, ranks=2)
    assert seconds["elementwise"] == pytest.approx((2980 * 1.0 + 20 * 100.0) * 1e-6)
    assert seconds["matmul"] == pytest.approx(10e-6) and "other" not in seconds


def test_page_costs_of_a_fresh_page_are_measured_where_linux_counts_them():
    """``page_costs``: a fresh 4 KiB page's first touch beyond a second, and its release, microseconds: both
    above 0 where the kernel counts minor faults and lets a mapping decline huge pages (0.7-1.8 and 0.2-0.3
    us on a 2-core EPYC), and below a millisecond; a huge page's fault above a small page's wherever a mapping
    that asks for huge pages gets them (110-200 us there; 2.5 ms for memory fresh to a VM)."""
    from qwen3_pretrain.simulate.probe import page_costs

    costs = page_costs(mib=8)
    if (costs.fault_us, costs.release_us) == (0.0, 0.0) and not minor_faults():
        pytest.skip("no minor fault count here")
    assert 0 < costs.fault_us < 1000 and 0 < costs.release_us < 1000
    if _huge_pages_given() < 1:
        pytest.skip("the kernel gives a mapping no huge page here (THP off, or memory fragmented)")
    assert costs.fault_us < costs.huge_fault_us < 100_000


def _huge_pages_given(mib: int = 18) -> int:
    """The transparent huge pages a fresh mapping of ``mib`` MiB that asks for them got at its first fill (this
    process's ``AnonHugePages`` growth); -1 where the kernel does not say or takes no such advice."""
    import mmap

    from qwen3_pretrain.simulate.probe import HUGE_PAGE, huge_resident_bytes

    if huge_resident_bytes() is None or not hasattr(mmap, "MADV_HUGEPAGE"):
        return -1
    region = mmap.mmap(-1, mib * 2**20, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        region.madvise(mmap.MADV_HUGEPAGE)
        view = torch.frombuffer(region, dtype=torch.float32)
        before = huge_resident_bytes()
        view.fill_(1.0)
        grown = huge_resident_bytes() - before
        del view
    except OSError:
        return -1
    finally:
        region.close()
    return grown // HUGE_PAGE


def test_huge_pages_a_mapping_gets_are_counted_by_the_machine():
    """A fill of a fresh mapping that asks for huge pages: the machine's huge-page count (``thp_fault_alloc``)
    grows by at least the huge pages this process's AnonHugePages grew by (another process's may add)."""
    from qwen3_pretrain.simulate.probe import huge_page_faults

    before = huge_page_faults()
    given = _huge_pages_given()
    if given < 1 or not before:
        pytest.skip("no huge page given, or the kernel counts none")
    assert huge_page_faults() - before >= given


def test_profiler_view_spreads_the_priced_faults_and_gives_their_release_to_the_time_outside_ops(monkeypatch):
    """The bench's view of the prediction per profiler category: a page's fault lands in the op that touched
    it first (spread as the recorded step's faults fell), its release outside every op."""
    monkeypatch.syspath_prepend(str(REPO / "bench"))
    from roofline_cpu import profiler_view

    result = {"predicted": {"matmul": 0.1, "attention": 0.0, "elementwise": 0.2, "communication": 0.0,
                            "host": 0.0, "page_faults": 0.04, "page_release": 0.01,
                            "op_counts": {"matmul": 1, "attention": 0, "elementwise": 1, "communication": 0}},
              "host_calibration": {"outside_share": 0.5}, "fault_split": {"elementwise": 3, "matmul": 1, "other": 0}}
    view = profiler_view(result)
    assert view["other"] == pytest.approx(0.01)  # the releases (malloc_trim after the step)
    assert view["elementwise"] == pytest.approx(0.2 + 0.03 * 3 / 4)
    assert view["matmul"] == pytest.approx(0.1 + 0.03 / 4)
    # the profiled steps' own faults, where counted, are what the categories hold
    result["predicted"]["profiled_page_faults"] = 0.08
    view = profiler_view(result)
    assert view["elementwise"] == pytest.approx(0.2 + 0.08 * 3 / 4) and view["other"] == pytest.approx(0.01)


def test_probe_device_takes_the_measured_link_and_prices_a_collective_with_it():
    """A multi-process run's link measured on its own group (``link_figures``: bus bandwidth and latency)
    becomes the device's intra-node link; a step's all-reduces priced with the planner's ring model on it,
    worked out by hand; unmeasured, half the copy bandwidth and the table's latency."""
    from qwen3_pretrain.simulate.roofline import OpTrace, price

    hw = _probe({}, link_gbps=2.0, link_latency_us=80.0).hardware()
    assert (hw.intra_node_gbps, hw.intra_node_latency_us) == (2.0, 80.0)
    comm = {("tp", "all_reduce", 2): (10 * 2**20, 10)}  # ten all-reduces of 1 MiB over 2 ranks
    # per call: bytes x 2 (n - 1) / n / bus bandwidth + latency
    expected = 10 * (2**20 * 1.0 / 2e9 + 80e-6)
    assert price(OpTrace(), hw, comm=comm).communication == pytest.approx(expected)
    unmeasured = _probe({}).hardware()
    assert (unmeasured.intra_node_gbps, unmeasured.intra_node_latency_us) == (5.0, 50.0)


def test_a_collective_kind_measured_on_its_own_is_priced_on_its_own_link():
    """Gloo reduces on the CPU, so a run's kinds are measured each on its own (``CpuProbe.links``): a
    reduce-scatter priced at its own figures, an all-gather at the run's main link, worked out by hand;
    across nodes the kind's figures do not apply."""
    from qwen3_pretrain.simulate.roofline import OpTrace, price

    hw = _probe({}, link_gbps=2.0, link_latency_us=80.0, links={"reduce_scatter": (0.5, 300.0)}).hardware()
    assert hw.collective_links == (("reduce_scatter", 0.5, 300.0),)
    gather = {("tp", "all_gather", 2): (10 * 2**20, 10)}  # ten all-gathers of 1 MiB over 2 ranks
    scatter = {("tp", "reduce_scatter", 2): (10 * 2**20, 10)}
    # per call: bytes x (n - 1) / n / bus bandwidth + latency, on each kind's link
    assert price(OpTrace(), hw, comm=gather).communication == pytest.approx(10 * (2**20 / 2 / 2e9 + 80e-6))
    assert price(OpTrace(), hw, comm=scatter).communication == pytest.approx(10 * (2**20 / 2 / 0.5e9 + 300e-6))
    assert price(OpTrace(), hw, comm={**gather, **scatter}).communication == pytest.approx(
        price(OpTrace(), hw, comm=gather).communication + price(OpTrace(), hw, comm=scatter).communication)
    across = price(OpTrace(), hw, comm=scatter, intra={"tp": False}).communication
    assert across == pytest.approx(10 * (2**20 / 2 / (hw.inter_node_gbps * 1e9) + hw.inter_node_latency_us * 1e-6))


def test_link_figures_fit_the_ring_model_to_two_timed_sizes(monkeypatch):
    """``link_figures`` fits the planner's ring model (bus bandwidth, latency) to a kind's two timed sizes:
    its latency is the 4 KiB call's time, and the model gives back the step's message's timed time; a message
    under 4 KiB is timed at its own size for the latency, one under 64 KiB at 64 KiB for the bandwidth; the
    statistic reaches the timing."""
    import qwen3_pretrain.simulate.probe as probe
    from qwen3_pretrain.plan.formulas import bus_bandwidth_factor, collective_seconds

    timed = []

    def fake(group, kind, nbytes, dtype, iters, statistic):  # a link of 300 us and 1 GB/s
        timed.append((kind, nbytes, statistic))
        return 300e-6 + nbytes * bus_bandwidth_factor(kind, 2) / 1e9

    class Group:
        def size(self):
            return 2

    monkeypatch.setattr(probe, "collective_seconds_measured", fake)
    gbps, latency = probe.link_figures(Group(), "reduce_scatter", 2**20, statistic="mean")
    assert timed == [("reduce_scatter", 4096, "mean"), ("reduce_scatter", 2**20, "mean")]
    assert latency * 1e-6 == pytest.approx(fake(None, "reduce_scatter", 4096, None, 0, ""))
    assert collective_seconds("reduce_scatter", 2**20, 2, gbps * 1e9, latency * 1e-6) == pytest.approx(
        fake(None, "reduce_scatter", 2**20, None, 0, ""))
    timed.clear()
    gbps, latency = probe.link_figures(Group(), "all_reduce", 1024)
    assert timed == [("all_reduce", 1024, "median"), ("all_reduce", 65536, "median")]
    assert latency * 1e-6 == pytest.approx(fake(None, "all_reduce", 1024, None, 0, ""))
    assert collective_seconds("all_reduce", 65536, 2, gbps * 1e9, latency * 1e-6) == pytest.approx(
        fake(None, "all_reduce", 65536, None, 0, ""))


def _straggle(rank: int, world_size: int, out: str) -> None:
    from qwen3_pretrain.simulate.probe import straggler_share

    if rank == 1:  # this rank computes each product twice: it takes twice as long for the same work
        mm = torch.mm
        torch.mm = lambda *a, **k: (mm(*a, **k), mm(*a, **k))[1]
    Path(out, f"{rank}.txt").write_text(str(straggler_share(None, 0.02, repeats=8)))


@pytest.mark.distributed
def test_straggler_share_is_what_the_faster_rank_waits_over_both_ranks_time(tmp_path):
    """Two gloo processes run the same work, one at half speed: the faster waits as long as it worked (t),
    the slower not at all, over 3 t of their own time: a share of 1/3 (0.24 read beside a full test suite,
    where the slower rank gets more of a core while the faster waits), the same on both ranks; no wait
    would read 0, the wait over the faster rank's own time 1."""
    run_distributed(2, _straggle, str(tmp_path))
    shares = [float((tmp_path / f"{r}.txt").read_text()) for r in range(2)]
    assert shares[0] == shares[1]
    assert 0.15 < shares[0] < 0.45


def test_collective_clock_gives_a_collectives_wait_to_communication(monkeypatch, tmp_path):
    """The bench's clock times torch.distributed's Python collectives whole (call and wait: on gloo the wait is
    no op, so the profiler put it outside every op) and names a profiler range after them; restored after."""
    import torch.distributed as dist

    monkeypatch.syspath_prepend(str(REPO / "bench"))
    from roofline_cpu import CollectiveClock, profiled_categories

    before = dist.all_reduce
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        x = torch.ones(1024)
        seconds = profiled_categories(lambda: (dist.all_reduce(x), dist.all_reduce(x)))
        assert [c[:2] for c in seconds["collectives"]] == [("all_reduce", 4096)] * 2
        assert all(c[3] >= c[2] for c in seconds["collectives"])  # entry and exit on the wall clock
        assert seconds["collective_s"] > 0 and seconds["communication"] > 0
        assert any("c10d collective" in name for name in seconds["ops"])
        with CollectiveClock() as clock:
            dist.all_reduce(x)
        assert len(clock.calls) == 1
    finally:
        dist.destroy_process_group()
    assert dist.all_reduce is before


def test_collective_split_into_waiting_for_the_other_rank_and_transfer(monkeypatch):
    """Two ranks' calls on the shared wall clock: rank 1 enters 3 s after rank 0 and both leave at 5 s: rank 0
    waited 3 s for it, each transferred 2 s; a second call entered together, 1 s each."""
    monkeypatch.syspath_prepend(str(REPO / "bench"))
    from roofline_cpu import collective_split

    ranks = [{"profiled": {"collectives": [("all_reduce", 8, 0.0, 5.0), ("all_gather_single", 8, 6.0, 7.0)]}},
             {"profiled": {"collectives": [("all_reduce", 8, 3.0, 5.0), ("all_gather_single", 8, 6.0, 7.0)]}}]
    assert collective_split(ranks) == [{"skew_s": 3.0, "transfer_s": 3.0, "calls": 2},
                                       {"skew_s": 0.0, "transfer_s": 3.0, "calls": 2}]


def _run_row(step_s, predicted_s, cells, outside_share=1.0):
    """A bench result of one rank whose profiler view is ``cells`` {category: (profiled, predicted)}: the
    prediction's host term 0, so that ``profiler_view`` gives each category's predicted seconds unchanged."""
    from roofline_cpu import CATEGORIES

    cells = {cat: cells.get(cat, (0.0, 0.0)) for cat in CATEGORIES}
    predicted = {cat: cells[cat][1] for cat in CATEGORIES if cat != "other"}
    predicted.update(step_s=predicted_s, host=0.0, op_counts=dict.fromkeys(predicted, 1))
    return [{"step_s": step_s, "predicted": predicted, "profiled": {cat: v[0] for cat, v in cells.items()},
             "host_calibration": {"outside_share": outside_share}}]


def test_rounds_median_each_cell_and_the_tally_counts_the_targets_and_the_reproducible_cells(monkeypatch, tmp_path):
    """Several rounds of a variant: each figure's median over the rounds on its own, the profiled seconds' max
    over min per category; the tally: steps within 25%, cells within 30% (both under 5 ms agree; a 1-process
    communication cell not counted), and which cells reproduce within 30% over the rounds."""
    monkeypatch.syspath_prepend(str(REPO / "bench"))
    from roofline_cpu import load_rounds, summarize, tally

    rounds = [{"a-eager-1p": _run_row(1.0, 0.9, {"matmul": (0.50, 0.45), "elementwise": (0.10, 0.20),
                                                  "communication": (0.001, 0.0)}),
               "a-eager-tp2": _run_row(1.0, 0.70, {"matmul": (0.30, 0.30), "communication": (0.10, 0.12)})},
              {"a-eager-1p": _run_row(1.2, 1.0, {"matmul": (0.60, 0.50), "elementwise": (0.30, 0.25),
                                                  "communication": (0.004, 0.0)})},
              {"a-eager-1p": _run_row(1.1, 1.4, {"matmul": (0.55, 0.48), "elementwise": (0.20, 0.21),
                                                  "communication": (0.002, 0.0)})}]
    # one file of an older bench (a single round, no "rounds" key) and one of two rounds
    (tmp_path / "one.json").write_text(json.dumps(rounds[0]))
    (tmp_path / "two.json").write_text(json.dumps({"rounds": rounds[1:]}))
    assert load_rounds([str(tmp_path / "one.json"), str(tmp_path / "two.json")]) == rounds
    summary = summarize(rounds)
    assert list(summary) == ["a-eager-1p", "a-eager-tp2"]
    one = summary["a-eager-1p"]
    assert (one["runs"], one["step_s"], one["predicted_s"]) == (3, 1.1, 1.0)
    assert one["cells"]["matmul"] == (0.55, 0.48) and one["cells"]["elementwise"] == (0.20, 0.21)
    assert one["spread"]["matmul"] == pytest.approx(0.60 / 0.50)
    assert one["spread"]["elementwise"] == pytest.approx(3.0)
    assert one["spread"]["communication"] == 1.0  # every run under 5 ms
    assert summary["a-eager-tp2"]["runs"] == 1 and summary["a-eager-tp2"]["spread"]["matmul"] is None
    t = tally(summary)
    assert t["steps"] == [1, 2]  # 1.0 / 1.1 within 25%, 0.70 not
    assert t["cells"]["matmul"] == [2, 2]  # 0.48 of 0.55: 13% off
    assert t["cells"]["elementwise"] == [2, 2]  # tp2: both 0 (under 5 ms)
    assert t["cells"]["communication"] == [1, 1]  # the 1-process cell not counted; 0.12 of 0.10: 20%
    # reproducible: elementwise of 1p moved 3x; tp2 ran once (nothing to compare), counted in neither
    assert t["reproducible"]["elementwise"] == [0, 0] and t["reproducible"]["matmul"] == [1, 1]
    # one round: a cell 35% off disagrees
    single = tally({"a-eager-1p": summarize([rounds[0]])["a-eager-1p"]})
    assert single["cells"]["elementwise"] == [0, 1] and single["cells"]["matmul"] == [1, 1]
