"""``plan`` where people decide: the memory margin, near-ties, what each row is limited by, FSDP traffic that
cannot hide, the config's keys kept fixed, the time to train, and FP8 (memory, bytes, FLOPs, refusals) against
hand computations on a small model."""

from __future__ import annotations

import dataclasses
import json

import pytest

from qwen3_pretrain.errors import UserError
from qwen3_pretrain.hardware import get_device, with_overrides
from qwen3_pretrain.models.qwen3.config import Qwen3Config, get_preset
from qwen3_pretrain.plan import fp8 as FP8
from qwen3_pretrain.plan import memory as M
from qwen3_pretrain.plan import step as S
from qwen3_pretrain.plan.cli import evaluate, main as plan_main, parse_tokens
from qwen3_pretrain.plan.layout import Cluster, LayerKind, Layout, stage_shapes
from qwen3_pretrain.plan.memory import GiB, predict_memory
from qwen3_pretrain.plan.step import predict_step

# hidden 256, 2 layers: attention q 256x256, k and v 256x128, o 256x256; MLP gate and up 256x512, down 512x256
SMALL = Qwen3Config(vocab_size=1024, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=4096)
PROJECTIONS = 256 * 256 + 2 * 256 * 128 + 256 * 256 + 2 * 256 * 512 + 512 * 256  # 589,824 per layer


def _json_rows(capsys, argv: list[str]) -> list[dict]:
    assert plan_main(argv + ["--json"]) == 0
    return json.loads(capsys.readouterr().out)


# --- ranking: memory margin and near-ties ------------------------------------------------------------------


def test_a_row_inside_the_memory_margin_ranks_after_one_with_headroom():
    """The faster layout (no recompute) at 99% of the device's memory must not win over a slower one with
    room to spare; without a margin it does."""
    cfg = get_preset("qwen3-0.6b")
    fast = Layout(dp=8, seq_length=4096, activation_checkpointing="none", micro_batch_size=2)
    slow = fast.replace(activation_checkpointing="full")
    hw = get_device("h100")
    fast_total = predict_memory(cfg, fast, runtime_reserved_bytes=hw.runtime_reserved_gib * GiB).total
    tight = with_overrides(hw, memory_gib=fast_total / GiB / 0.99)
    ranked = evaluate(cfg, [fast, slow], tight, Cluster(1, 8), memory_margin=0.05)
    speed = {lay.activation_checkpointing: predict_step(cfg, lay, tight).tokens_per_sec_per_device for lay in (fast, slow)}
    assert speed["none"] > speed["full"]
    assert [c.layout.activation_checkpointing for c in ranked] == ["full", "none"]
    assert ranked[1].fits and not ranked[1].headroom and ranked[0].headroom
    assert [c.layout.activation_checkpointing for c in evaluate(cfg, [fast, slow], tight, Cluster(1, 8),
                                                                memory_margin=0.0)] == ["none", "full"]


def test_near_ties_are_said_and_flagged(capsys):
    argv = ["--model", "qwen3-0.6b", "--device", "h100", "--seq-length", "4096", "--top", "12"]
    rows = _json_rows(capsys, argv)
    best = rows[0]["tokens_per_sec_per_device"]
    expected = 0
    for row in rows:  # leading rows alike on memory and within 5% of the best
        if row["fits_with_margin"] != rows[0]["fits_with_margin"] or row["tokens_per_sec_per_device"] < 0.95 * best:
            break
        expected += 1
    assert expected > 1, "this case has near-ties"
    assert [r["within_noise_of_best"] for r in rows] == [i < expected for i in range(len(rows))]
    assert plan_main(argv) == 0
    assert f"near-tie: rows 1-{expected} are within 5% of row 1's predicted tokens/s" in capsys.readouterr().out
    with pytest.raises(UserError, match="--tie-tolerance"):
        plan_main(argv + ["--tie-tolerance", "1.5"])


def test_the_output_says_what_it_rests_on_and_prints_the_best_rows_config(capsys):
    assert plan_main(["--model", "qwen3-8b", "--device", "h100", "--seq-length", "8192", "--dp", "8",
                      "--micro-batch-size", "1", "--activation-checkpointing", "mlp"]) == 0
    out = capsys.readouterr().out
    assert "rests on: compute at 0.35 of the 989 TFLOP/s bf16 peak" in out
    assert "datasheet figures, not measured" in out and "not modelled:" in out
    assert "limit: the largest term" in out and "row 1's FSDP traffic:" in out
    block = out.split("row 1 as training config keys")[1].splitlines()[1:]
    keys = dict(line.strip().split(": ", 1) for line in block if ": " in line)
    assert keys["tp"] == "1" and keys["activation_checkpointing"] == "mlp" and keys["rank_size"] == "8"


# --- the config's keys are fixed ------------------------------------------------------------------------


def test_a_config_fixes_recompute_even_when_it_leaves_it_to_the_default(tmp_path, capsys):
    """A config without gradient_checkpointing / activation_checkpointing trains without recompute (the
    engine's default): every row says none (the search tried all four before)."""
    conf = tmp_path / "c.yaml"
    conf.write_text("model_name: qwen3-0.6b\nrank_size: 8\nseq_length: 4096\n")
    rows = _json_rows(capsys, ["--config", str(conf), "--top", "50"])
    assert {r["activation_checkpointing"] for r in rows} == {"none"}
    conf.write_text("model_name: qwen3-0.6b\nrank_size: 8\nseq_length: 4096\nactivation_checkpointing: selective\n")
    rows = _json_rows(capsys, ["--config", str(conf), "--top", "50"])
    assert {r["activation_checkpointing"] for r in rows} == {"selective"}
    # the flag still wins over the file, and without a config recompute is searched
    rows = _json_rows(capsys, ["--config", str(conf), "--activation-checkpointing", "full", "--top", "50"])
    assert {r["activation_checkpointing"] for r in rows} == {"full"}
    rows = _json_rows(capsys, ["--model", "qwen3-0.6b", "--seq-length", "4096", "--top", "200"])
    assert len({r["activation_checkpointing"] for r in rows}) > 1


def test_a_config_fixes_the_moe_capacity_and_fp8(tmp_path, capsys):
    conf = tmp_path / "c.yaml"
    conf.write_text("model_name: qwen3-30b-a3b\nrank_size: 16\nseq_length: 4096\nep: 8\nbatch_size: 1\n"
                    "moe_capacity_factor: 1.25\nfp8: tensorwise\nfp8_all_gather: true\n")
    rows = _json_rows(capsys, ["--config", str(conf), "--nodes", "2", "--top", "5"])
    assert rows and all(r["moe_rank_load"] == 1.25 and r["fp8"] == "tensorwise" and r["fp8_all_gather"]
                        for r in rows)
    assert rows[0]["config"]["moe_capacity_factor"] == 1.25 and rows[0]["config"]["fp8"] == "tensorwise"
    from qwen3_pretrain.config.loader import from_dict
    from qwen3_pretrain.train.config import TrainConfig

    loaded = from_dict(TrainConfig, {"model_name": "qwen3-30b-a3b", "data_path": str(tmp_path),
                                     "output_path": str(tmp_path / "out"), **rows[0]["config"]}, source="plan row")
    assert (loaded.fp8, loaded.fp8_all_gather, loaded.moe_capacity_factor) == ("tensorwise", True, 1.25)
    conf.write_text("model_name: qwen3-0.6b\nrank_size: 8\nfp8: off\n")  # YAML's unquoted off
    assert all(r["fp8"] == "off" for r in _json_rows(capsys, ["--config", str(conf), "--top", "3"]))


# --- time to train --------------------------------------------------------------------------------------


def test_time_to_train_by_hand(capsys):
    assert parse_tokens("1T") == 1e12 and parse_tokens("300B") == 3e11 and parse_tokens("2.5e12") == 2.5e12
    assert parse_tokens("15m") == 15e6
    for bad in ("lots", "-1T", "0"):
        with pytest.raises(UserError, match="--tokens"):
            parse_tokens(bad)
    argv = ["--model", "qwen3-8b", "--device", "h100", "--seq-length", "8192", "--dp", "8", "--micro-batch-size",
            "1", "--activation-checkpointing", "mlp", "--tokens", "1T"]
    (row, *_) = _json_rows(capsys, argv)
    # 1e12 tokens / (8 devices x tokens/s each) / 86,400 s per day
    by_hand = 1e12 / (8 * row["tokens_per_sec_per_device"]) / 86400
    assert row["days_for_tokens"] == pytest.approx(by_hand, rel=1e-3)
    assert plan_main(argv) == 0
    assert f"{by_hand:,.1f} days" in capsys.readouterr().out


# --- the step's breakdown and FSDP's exposed traffic ---------------------------------------------------------


@pytest.mark.parametrize("layout, device", [
    (Layout(dp=8, seq_length=4096, gradient_accumulation_steps=4), "h100"),
    (Layout(tp=2, pp=2, dp=2, seq_length=4096, micro_batch_size=4, activation_checkpointing="full"), "h100"),
    (Layout(tp=4, dp=2, seq_length=4096), "910b"),
    (Layout(dp=2, seq_length=1024), "cpu"),
])
def test_the_breakdown_adds_up_to_the_step(layout, device):
    est = predict_step(get_preset("qwen3-1.7b"), layout, get_device(device), Cluster(1, layout.world_size))
    assert sum(est.breakdown.values()) == pytest.approx(est.step_time_s, rel=1e-9)
    assert set(est.breakdown) == set(S.BREAKDOWN) and est.bottleneck in S.BREAKDOWN
    assert all(v >= 0 for v in est.breakdown.values())


def test_fsdp_collectives_hide_only_behind_the_compute_in_flight():
    """By hand: 4 micro-batches of 1 s (forward 1/3, backward 2/3 without recompute), 0.4 s of gathers
    (0.05 s before each forward and each backward), 2 s of reductions all behind the last backward."""
    lay = Layout(dp=8, gradient_accumulation_steps=4, activation_checkpointing="none")
    assert lay.accumulates_unsharded
    exposed = S._dp_exposed(lay, 0, 1.0, 0.4, 2.0, first=0.01, last=0.02)
    assert exposed == pytest.approx(0.05 + 2.0 - 2 / 3 + 0.01 + 0.02)
    # reduced every micro-batch: 0.5 s each behind its own backward, hidden
    every = lay.replace(reduce_grads_every_microbatch=True)
    assert S._dp_exposed(every, 0, 1.0, 0.4, 2.0, 0.01, 0.02) == pytest.approx(0.03)
    # under pipelining the schedule reduces after the stage's last backward: stage 0 hides none of it,
    # stage 1 one backward's worth
    piped = Layout(pp=2, dp=4, micro_batch_size=4, activation_checkpointing="none")
    assert S._dp_exposed(piped, 0, 1.0, 0.4, 2.0, 0.01, 0.02) == pytest.approx(2.0 + 0.01)
    assert S._dp_exposed(piped, 1, 1.0, 0.4, 2.0, 0.01, 0.02) == pytest.approx(2.0 - 2 / 3 + 0.01)
    # gathers beyond the compute are exposed too
    assert S._dp_exposed(every, 0, 1.0, 8.0, 0.0, 0.0, 0.0) == pytest.approx(4 * ((1 - 1 / 3) + (1 - 2 / 3)))


def test_a_cpu_hides_none_of_fsdps_collectives():
    """A CPU waits for each of FSDP's gloo calls on the thread that computes (the roofline's
    ``overlaps_collectives``): its exposed dp time is every gather and reduction, where an accelerator with
    the same figures hides some behind compute."""
    lay = Layout(dp=2, seq_length=1024, activation_checkpointing="none")
    cpu = get_device("cpu")
    hiding = dataclasses.replace(cpu, overlaps_collectives=True)
    est, hidden = predict_step(SMALL, lay, cpu, Cluster(1, 2)), predict_step(SMALL, lay, hiding, Cluster(1, 2))
    assert est.comm_time_s["dp"] > hidden.comm_time_s["dp"] > 0
    assert est.step_time_s - hidden.step_time_s == pytest.approx(est.comm_time_s["dp"] - hidden.comm_time_s["dp"])


def test_cross_node_fsdp_with_accumulation_is_not_assumed_hidden():
    """Qwen3-8B sharded over 4 nodes' 32 H100s with 8 micro-batches: the fp32 gradients reduce-scatter over
    the network behind one micro-batch's backward, so part of them shows in the step."""
    cfg, hw = get_preset("qwen3-8b"), get_device("h100")
    lay = Layout(dp=32, seq_length=4096, gradient_accumulation_steps=8, activation_checkpointing="full")
    est = predict_step(cfg, lay, hw, Cluster(4, 8))
    assert est.comm_time_s["dp"] > 0.1 * est.dp_total_s > 0
    assert est.step_time_s >= est.breakdown["matmul"] + est.comm_time_s["dp"]


# --- FP8 --------------------------------------------------------------------------------------------------


def test_fp8_flops_casts_and_weights_by_hand():
    lay = Layout(seq_length=1024, activation_checkpointing="none", fp8="tensorwise", compile=True)
    kind = LayerKind()
    assert FP8.fp8_weight_params(SMALL, lay, kind) == PROJECTIONS
    assert FP8.fp8_weight_params(SMALL, lay.replace(tp=2), kind) == PROJECTIONS / 2
    assert FP8.fp8_flops_per_token(SMALL, lay, kind) == 6 * PROJECTIONS
    # full recompute reruns every projection's forward but the down projection's
    full = lay.replace(activation_checkpointing="full")
    assert FP8.fp8_flops_per_token(SMALL, full, kind) == 8 * PROJECTIONS - 2 * 512 * 256
    assert FP8.fp8_flops_per_token(SMALL, lay.replace(fp8="rowwise_with_gw_hp"), kind) == 4 * PROJECTIONS
    assert FP8.fp8_flops_per_token(SMALL, lay.replace(fp8="off"), kind) == 0
    # casts: 2 (in + out) elements per linear and token; inputs sum to 2,048, outputs to 2,048; 3 B compiled
    assert FP8.cast_bytes_per_token(SMALL, lay, kind) == 3 * (2 * 2048 + 2 * 2048)
    assert FP8.cast_bytes_per_token(SMALL, lay.replace(compile=False), kind) == 5 * (2 * 2048 + 2 * 2048)
    # the FP8 copy of the computing layer (and one fp32 scale per weight tensor) beside its bf16 weights;
    # with FP8 all-gather two gathered layers at 1 byte a weight in place of 2
    shape = stage_shapes(SMALL, lay)[0]
    assert FP8.gathered_weight_delta(SMALL, lay, shape, 2) == PROJECTIONS + 4 * 7
    gathered = lay.replace(dp=4, fp8_all_gather=True)
    assert FP8.gathered_weight_delta(SMALL, gathered, stage_shapes(SMALL, gathered)[0], 2) == 2 * (-PROJECTIONS + 28)


def test_fp8_memory_moments_by_hand():
    lay = Layout(dp=4, seq_length=1024, activation_checkpointing="none")
    shape = stage_shapes(SMALL, lay)[0]
    for fp8, gather, delta in (("tensorwise", False, PROJECTIONS + 28), ("tensorwise", True, 2 * (28 - PROJECTIONS)),
                               ("rowwise", False, PROJECTIONS + sum(4 * (i + o) for i, o in (
                                   (256, 256), (256, 128), (256, 128), (256, 256), (256, 512), (256, 512),
                                   (512, 256))))):
        on = lay.replace(fp8=fp8, fp8_all_gather=gather)
        before, after = M._moments(SMALL, on, shape), M._moments(SMALL, on, shape)
        M._fp8_weights(after, SMALL, on, shape)
        assert after["layer backward"]["parameters"] - before["layer backward"]["parameters"] == delta
        assert after["optimizer step"] == before["optimizer step"]


def test_fp8_all_gather_moves_one_byte_per_projection_weight():
    """FSDP over 4 ranks, one micro-batch: the first layer gathered twice (forward, backward), the last once
    (it keeps its weights for its backward, right after the loss); the projections at 1 byte instead of 2
    saves 3 gathers x 589,824 bytes of buffer, 3/4 of it on the bus, less the one all-reduce of the 14
    weights' scales (4 bytes each, 2 x 3/4 of it on the bus)."""
    lay = Layout(dp=4, seq_length=1024, activation_checkpointing="none", fp8="tensorwise")
    hw, cluster = get_device("h100"), Cluster(1, 4)
    plain = predict_step(SMALL, lay, hw, cluster).comm_bytes_per_axis["dp"]
    low = predict_step(SMALL, lay.replace(fp8_all_gather=True), hw, cluster).comm_bytes_per_axis["dp"]
    assert plain - low == pytest.approx(3 * PROJECTIONS * 3 / 4 - 4 * 7 * 2 * 2 * 3 / 4)


def test_fp8_is_faster_for_qwen3_8b_on_h100_and_casts_show_as_bandwidth():
    cfg, hw, cluster = get_preset("qwen3-8b"), get_device("h100"), Cluster(1, 8)
    lay = Layout(dp=8, seq_length=8192, activation_checkpointing="mlp", compile=True)
    bf16 = predict_step(cfg, lay, hw, cluster)
    fp8 = predict_step(cfg, lay.replace(fp8="tensorwise", fp8_all_gather=True), hw, cluster)
    assert 1.1 < fp8.tokens_per_sec_per_device / bf16.tokens_per_sec_per_device < 1.5
    assert fp8.breakdown["bandwidth"] > bf16.breakdown["bandwidth"]
    assert fp8.mfu > bf16.mfu  # MFU stays against the bf16 peak, as the training log reports it


@pytest.mark.parametrize("device", ["910b", "a100", "cpu"])
def test_fp8_is_refused_without_fp8_matmuls(device, capsys):
    with pytest.raises(UserError, match=rf"fp8 tensorwise: the {device} has no FP8 matmuls"):
        plan_main(["--model", "qwen3-0.6b", "--device", device, "--fp8", "tensorwise"])


def test_mxfp8_needs_blackwell(capsys):
    with pytest.raises(UserError, match="h100 has no MXFP8"):
        plan_main(["--model", "qwen3-0.6b", "--device", "h100", "--fp8", "mxfp8"])
    assert _json_rows(capsys, ["--model", "qwen3-0.6b", "--device", "b200", "--fp8", "mxfp8", "--top", "1"])


def test_fp8_layout_checks():
    with pytest.raises(UserError, match="fp8_all_gather|FP8 all-gather"):
        Layout(fp8="rowwise", fp8_all_gather=True)
    with pytest.raises(UserError, match="mixed_precision bf16"):
        Layout(fp8="tensorwise", mixed_precision="fp32")
    with pytest.raises(UserError, match="fp8"):
        dataclasses.replace(Layout(), fp8="e4m3")


# --- ranking with the roofline ------------------------------------------------------------------------------


def test_the_efficiency_is_fitted_to_a_roofline_prediction(tmp_path, capsys):
    """A roofline file holding what this planner predicts at efficiency 0.5 for one layout fits back to 0.5,
    and the table says it rests on it; the eager/compiled parts are picked by the layout's compile."""
    from qwen3_pretrain.plan.cli import fit_efficiency, read_roofline

    cfg, cluster = get_preset("qwen3-8b"), Cluster(1, 8)
    hw = get_device("h100")
    lay = Layout(tp=2, dp=4, seq_length=4096, micro_batch_size=2, activation_checkpointing="full", compile=True)
    target = predict_step(cfg, lay, with_overrides(hw, compute_efficiency=0.5), cluster).step_time_s
    path = tmp_path / "roofline.json"
    path.write_text(json.dumps({"layouts": [
        {"layout": {"tp": 2, "pp": 1, "cp": 1, "dp": 4, "batch_size": 2, "seq_length": 4096,
                    "activation_checkpointing": "full", "compile": True},
         "roofline": {"eager": {"step_time_s": target * 2}, "compiled": {"step_time_s": target}}}]}))
    records = read_roofline(str(path))
    assert records[0][1] == pytest.approx(target)
    efficiency, words = fit_efficiency(cfg, hw, cluster, Layout(seq_length=4096), records)
    assert efficiency == pytest.approx(0.5, rel=1e-4) and "tp 2 pp 1 cp 1 dp 4" in words
    assert predict_step(cfg, lay, hw, cluster).breakdown["host"] == 0  # not host-bound: the fit is defined
    assert plan_main(["--model", "qwen3-8b", "--device", "h100", "--seq-length", "4096", "--roofline",
                      str(path)]) == 0
    assert "rests on: compute at 0.50 of the 989 TFLOP/s bf16 peak (fitted to the roofline's step time" in \
        capsys.readouterr().out
    path.write_text(json.dumps({"ranks": []}))
    with pytest.raises(UserError, match="no record with a 'layout'"):
        plan_main(["--model", "qwen3-8b", "--roofline", str(path)])


def test_fp8_routed_experts_by_hand():
    """A MoE layer's routed experts run rowwise FP8 grouped matmuls under every recipe (6 FLOPs per weight
    and pair, ``top_k`` pairs a token; the weight gradient in FP8 even under rowwise_with_gw_hp, whose
    high-precision weight gradient is the projections'); FP8 all-gather does not cover them."""
    moe = dataclasses.replace(SMALL, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=128)
    kind = LayerKind(sparse=True)
    assert moe.is_sparse_layer(0)
    lay = Layout(dp=4, ep=2, seq_length=1024, activation_checkpointing="none", fp8="tensorwise")
    experts = 3 * 256 * 128  # one expert's gate, up and down
    assert FP8.expert_recipe(lay) == "rowwise" and FP8.expert_recipe(lay.replace(fp8="mxfp8")) == "mxfp8"
    assert FP8.fp8_expert_flops_per_token(moe, lay, kind) == 6 * 2 * experts
    assert FP8.fp8_expert_flops_per_token(moe, lay.replace(fp8="rowwise_with_gw_hp"), kind) == 6 * 2 * experts
    attention = 256 * 256 + 2 * 256 * 128 + 256 * 256
    assert FP8.fp8_flops_per_token(moe, lay, kind) == 6 * attention + 6 * 2 * experts
    assert FP8.fp8_weight_params(moe, lay, kind) == attention + 8 / 2 * experts
    assert FP8.fp8_weight_params(moe, lay, kind, FP8.GATHERED_IN_FP8) == attention
    ag = lay.replace(fp8_all_gather=True)
    shape = stage_shapes(moe, ag)[0]
    # two layers' attention at 1 byte, plus the experts' FP8 copy (and one fp32 scale per FP8 linear, 7)
    assert FP8.gathered_weight_delta(moe, ag, shape, 2) == 2 * (-attention + 4 * 7) + 8 / 2 * experts


def test_simulates_json_is_fitted_at_the_plans_own_layout(tmp_path, capsys):
    """``simulate --json``'s ranks carry the roofline's eager and compiled steps; the slowest rank's is fitted
    at the layout the plan's flags fix."""
    from qwen3_pretrain.plan.cli import fit_efficiency, read_roofline

    cfg, cluster, hw = get_preset("qwen3-8b"), Cluster(1, 8), get_device("h100")
    lay = Layout(tp=2, dp=4, seq_length=4096, micro_batch_size=2, activation_checkpointing="full", compile=True)
    target = predict_step(cfg, lay, with_overrides(hw, compute_efficiency=0.45), cluster).step_time_s
    path = tmp_path / "simulate.json"
    ranks = [{"rank": r, "roofline": {"eager": {"step_s": 9.0}, "compiled": {"step_s": target * (1 - r / 10)}}}
             for r in range(2)]
    path.write_text(json.dumps({"ranks": ranks, "comm_bytes_per_step": {}}))
    records = read_roofline(str(path), compile=True)
    assert records == [({}, pytest.approx(target))]
    fixed = {"tp": 2, "pp": 1, "cp": 1, "micro_batch_size": 2, "activation_checkpointing": "full"}
    efficiency, _ = fit_efficiency(cfg, hw, cluster, Layout(seq_length=4096, compile=True), records, fixed)
    assert efficiency == pytest.approx(0.45, rel=1e-4)
    assert plan_main(["--model", "qwen3-8b", "--seq-length", "4096", "--tp", "2", "--pp", "1", "--cp", "1",
                      "--micro-batch-size", "2", "--activation-checkpointing", "full", "--compile", "--roofline",
                      str(path)]) == 0
    assert "compute at 0.45 of the 989" in capsys.readouterr().out


@pytest.mark.parametrize("flag", ["--nodes", "--devices-per-node", "--seq-length", "--global-batch-size", "--top"])
@pytest.mark.parametrize("value", ["0", "-2", "two"])
def test_counts_must_be_positive_whole_numbers(flag, value, capsys):
    """``--nodes 0`` used to plan for one node without a word: a count below 1 is refused, naming the flag."""
    with pytest.raises(SystemExit) as exit_info:
        plan_main(["--model", "qwen3-8b", "--device", "h100", flag, value])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert f"argument {flag}: must be a positive whole number, got {value!r}" in err and "Traceback" not in err
