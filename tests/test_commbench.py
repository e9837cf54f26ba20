"""commbench: two gloo processes time every collective on a tp axis; plan reads the result."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from qwen3_pretrain.cli import run_command
from qwen3_pretrain.plan.commbench import axis_meshes, parse_sizes, summarize
from qwen3_pretrain.plan.formulas import bus_bandwidth_factor

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.distributed
def test_two_gloo_processes_measure_the_tp_axis_and_plan_reads_it(tmp_path, capsys):
    out_json = tmp_path / "bench.json"
    proc = subprocess.run([sys.executable, "-m", "qwen3_pretrain", "commbench", "--nproc", "2", "--tp", "2",
                           "--sizes", "1KB,16KB", "--iters", "2", "--json", str(out_json)],
                          capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    assert "tp     2 intra all_reduce" in proc.stdout
    report = json.loads(out_json.read_text())
    assert report["world_size"] == 2 and report["backend"] == "gloo" and report["mesh"] == {"pp": 1, "dp": 1, "tp": 2}
    rows = report["axes"]["tp"]["results"]
    assert {(r["op"], r["bytes"]) for r in rows} == {(op, size) for op in ("all_reduce", "all_gather",
                                                                        "reduce_scatter", "p2p")
                                                     for size in (1024, 16384)}
    for r in rows:
        assert r["time_us"] > 0
        assert r["algbw_gbps"] == pytest.approx(r["bytes"] / (r["time_us"] * 1e-6) / 1e9, rel=0.01)
        assert r["busbw_gbps"] == pytest.approx(r["algbw_gbps"] * bus_bandwidth_factor(r["op"], 2), rel=0.01)
    assert report["summary"]["intra_node_gbps"] > 0 and report["summary"]["inter_node_gbps"] is None

    assert run_command("qwen3_pretrain.plan.cli:main", ["--model", "qwen3-0.6b", "--device", "cpu",
                                                        "--devices-per-node", "2", "--commbench", str(out_json),
                                                        "--top", "1"]) == 0
    bw = report["summary"]["intra_node_gbps"]
    assert f"links {bw:g} GB/s intra" in capsys.readouterr().out


def test_the_timed_groups_are_the_training_meshs():
    """tp, dp and pp are ParallelDims' groups: tp innermost, then the dp ranks (FSDP's group), pp outermost."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=5, world_size=8)
    try:
        meshes = axis_meshes(8, tp=2, pp=2, device_type="cpu")
        assert {a: dist.get_process_group_ranks(m.get_group()) for a, m in meshes.items()} == \
            {"tp": [4, 5], "dp": [5, 7], "pp": [1, 5]}
    finally:
        dist.destroy_process_group()


def test_sizes_parse_in_binary_units():
    assert parse_sizes("1KB, 64KB,1MB,16MB,512") == [1024, 65536, 1 << 20, 16 << 20, 512]
    with pytest.raises(ValueError, match="not a size"):
        parse_sizes("1XB")


def test_summary_takes_largest_messages_for_bandwidth_and_smallest_for_latency():
    axes = {"tp": {"intra_node": True, "results": [
        {"bytes": 1024, "time_us": 10.0, "busbw_gbps": 0.1},
        {"bytes": 1 << 20, "time_us": 100.0, "busbw_gbps": 9.0},
        {"bytes": 1 << 20, "time_us": 120.0, "busbw_gbps": 7.0}]},
        "dp": {"intra_node": False, "results": [{"bytes": 1024, "time_us": 50.0, "busbw_gbps": 0.02}]}}
    assert summarize(axes) == {"intra_node_gbps": 8.0, "intra_node_latency_us": 10.0,
                               "inter_node_gbps": 0.02, "inter_node_latency_us": 50.0}


@pytest.mark.parametrize("argv, words", [
    (["--nproc", "2", "--tp", "3"], "does not divide --nproc 2"),
    (["--ops", "all_reduce,broadcast"], "unknown operation(s) broadcast"),
    (["--sizes", "big"], "not a size"),
])
def test_bad_arguments_are_one_line_errors(argv, words, capsys):
    assert run_command("qwen3_pretrain.plan.commbench:main", argv) == 2
    assert words in capsys.readouterr().err
