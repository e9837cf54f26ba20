"""The predicted-MFU table of docs/planner.md ("Predicted MFU from the op trace"), from ``simulate`` at each
layout's real micro-batch count: Qwen3-8B at the reference layout (8 x 910B, tp 4 pp 2, seq 8192, full
recompute), at torchtitan's (8 x H100, FSDP, seq 8192) and Megatron-Bridge's (16 x H100, tp 1 dp 16, seq
4096, 64 micro-batches), Qwen3-30B-A3B at ep 8 and 16, Qwen3.5-9B at its reference layout (8 x 910B,
64 pipeline micro-batches).

Each case simulates one rank per pipeline stage (the slowest stage sets the step; MoE: rank 0 played as
the heaviest ep rank, at twice the mean routing). A step of more micro-batches than the two shorter steps
it can be extrapolated from (``simulate/microbatches.py``: 2 and 3 under accumulation, p and p + 1 under
1F1B; exact, tests/test_planner_figures.py) is simulated that way, so 64 micro-batches cost 5. Per mode
(eager, compiled): step time, MFU, HFU, the breakdown (matmul / attention / elementwise / exposed
communication / host / pipeline bubble) and what reaching ``--target`` MFU (Megatron's 52%) would take,
computed from the breakdown (``reach``): the step it needs, and whether dropping the overheads (exposed
communication, host, bubble) gets there or by how much the compute itself must shrink beyond that; for
pipelines also the bubble at twice the micro-batches and interleaved (v = 2).

    PYTHONPATH=. python bench/planner_figures.py [--only ref8b,bridge] [--jobs 2] [--json out.json] \
        [--traces DIR [--reprice]]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import pickle
import time
from dataclasses import dataclass
from pathlib import Path

from qwen3_pretrain.config.loader import load_config
from qwen3_pretrain.plan.formulas import megatron_bubble_ratio
from qwen3_pretrain.simulate.run import make_world, roofline_report, simulate_ranks
from qwen3_pretrain.train.config import TrainConfig

TARGET_MFU = 0.52  # Megatron-LM's reported MFU for dense GPT models of this size on H100


@dataclass(frozen=True)
class Case:
    name: str
    title: str  # the table's layout column
    config: str
    overrides: tuple[str, ...]
    device: str
    devices_per_node: int
    ranks: str = "stages"  # "stages": the first rank of each stage; else one rank
    moe_imbalance: float = 1.0


DENSE_8B = "examples/pretrain_config.yaml"
CASES = (
    Case("ref8b", "Qwen3-8B reference: 8 x 910B (2 nodes x 4), tp 4 x pp 2, seq 8192, batch 4, full recompute",
         DENSE_8B, ("model_path=",), "910b", 4),
    Case("titan", "torchtitan's: Qwen3-8B, 8 x H100 FSDP (dp 8), seq 8192, batch 1, selective recompute",
         DENSE_8B, ("model_path=", "tp=1", "pp=1", "rank_size=8", "batch_size=1",
                    "activation_checkpointing=selective"), "h100", 8),
    Case("bridge", "Megatron-Bridge's: Qwen3-8B, 16 x H100, tp 1 x dp 16, seq 4096, micro-batch 1 x 64, no "
                   "recompute, weights kept gathered, bf16 gradients (the planner's choice)",
         DENSE_8B, ("model_path=", "tp=1", "pp=1", "rank_size=16", "batch_size=1", "seq_length=4096",
                    "gradient_checkpointing=false", "gradient_accumulation_steps=64", "keep_params_gathered=true",
                    "grad_reduce_dtype=bf16"), "h100", 8),
    Case("bridge_fsdp", "the same with FSDP gathering per micro-batch, fp32 gradients (ZeRO-3)",
         DENSE_8B, ("model_path=", "tp=1", "pp=1", "rank_size=16", "batch_size=1", "seq_length=4096",
                    "gradient_checkpointing=false", "gradient_accumulation_steps=64"), "h100", 8),
    Case("moe_ep8", "Qwen3-30B-A3B: 16 x H100, dp 16, ep 8, seq 4096, batch 2 x 8, full recompute",
         "examples/qwen3_30b_a3b_16xh100.yaml", ("model_path=",), "h100", 8, "0", 2.0),
    Case("moe_ep16", "Qwen3-30B-A3B as above at ep 16 (the expert group spans both nodes)",
         "examples/qwen3_30b_a3b_16xh100.yaml", ("model_path=", "ep=16"), "h100", 8, "0", 2.0),
    Case("qwen35", "Qwen3.5-9B reference: 8 x 910B (2 nodes x 4), tp 2 x pp 2 x dp 2, seq 4096, 64 micro-batches, "
                   "selective recompute",
         "examples/qwen3.5_9b_8x910b.yaml", ("model_path=",), "910b", 4),
)


def reach(breakdown: dict, mfu: float, target: float = TARGET_MFU) -> dict:
    """What a priced step needs to reach ``target`` MFU: MFU scales as 1 / step, so the step must fall to
    ``step x mfu / target``; the overheads (exposed communication, host, bubble) go first, then compute."""
    step = breakdown["step"]
    compute = breakdown["matmul"] + breakdown["attention"] + breakdown["elementwise"]
    overheads = {k: breakdown[k] for k in ("communication", "host", "bubble") if breakdown[k] > 0}
    need = step * mfu / target
    out = {"target_step_s": need, "gap_s": step - need, "compute_s": compute, "overheads_s": overheads,
           "compute_only_mfu": mfu * step / compute if compute else 0.0}
    if step <= need:
        out["verdict"] = "reached"
    elif compute <= need:
        out["verdict"] = "overheads"
        out["overheads_cut"] = (step - need) / sum(overheads.values())
    else:
        out["verdict"] = "compute"
        out["compute_cut"] = (compute - need) / compute
    return out


def reach_text(r: dict, bubble_alternatives: dict | None = None) -> str:
    names = {"communication": "exposed comm", "host": "host", "bubble": "bubble"}
    parts = ", ".join(f"{names[k]} {v:.3f}" for k, v in r["overheads_s"].items())
    if r["verdict"] == "reached":
        text = f"reached: {r['target_step_s']:.3f} s would do"
    elif r["verdict"] == "overheads":
        text = (f"a {r['target_step_s']:.3f} s step: {r['overheads_cut']:.1%} of the overheads ({parts}) gone; "
                f"compute alone is {r['compute_only_mfu']:.1%}")
    else:
        gone = f" ({parts})" if parts else ""
        text = (f"a {r['target_step_s']:.3f} s step: every overhead gone{gone} and the compute ({r['compute_s']:.3f} "
                f"s, {r['compute_only_mfu']:.1%} MFU alone) {r['compute_cut']:.1%} shorter")
    if bubble_alternatives:
        text += "; bubble " + ", ".join(f"{k} {v:.3f} s" for k, v in bubble_alternatives.items())
    return text


def bubble_alternatives(world, breakdown: dict) -> dict:
    """The bubble of this step at twice the micro-batches and with 2 virtual stages per rank."""
    layout = world.layout
    if layout.pp == 1 or breakdown["bubble"] == 0:
        return {}
    p, m, v = layout.pp, layout.num_microbatches, layout.stages_per_rank
    base = megatron_bubble_ratio(p, m, v)
    return {f"at {2 * m} micro-batches": breakdown["bubble"] * megatron_bubble_ratio(p, 2 * m, v) / base,
            "interleaved v 2": breakdown["bubble"] * megatron_bubble_ratio(p, m, 2 * v) / base}


def case_world(case: Case):
    cfg = load_config(TrainConfig, case.config, list(case.overrides))
    return make_world(cfg, cfg.rank_size, moe_imbalance=case.moe_imbalance, hardware=case.device,
                      devices_per_node=case.devices_per_node)


def run_case(case: Case, jobs: int, traces: Path | None = None, reprice: bool = False) -> dict:
    """Simulate ``case`` (or, with ``reprice``, load its traces from ``traces``) and price it with the current
    roofline; ``traces``: a folder where each case's simulated ranks are kept (pickled ``RankResult``s)."""
    world = case_world(case)
    ranks = world.dims.first_rank_of_stages() if case.ranks == "stages" else [int(case.ranks)]
    start = time.perf_counter()
    kept = traces / f"{case.name}.pickle" if traces else None
    if reprice:
        results = [dataclasses.replace(r, roofline=roofline_report(world, r.trace, r.comm_calls))
                   for r in pickle.loads(kept.read_bytes())]
    else:
        results = simulate_ranks(world, ranks, jobs=jobs)
        if kept:
            kept.parent.mkdir(parents=True, exist_ok=True)
            kept.write_bytes(pickle.dumps(results))
    seconds = time.perf_counter() - start
    slowest = max(results, key=lambda r: r.roofline["eager"]["step_s"] + r.roofline["compiled"]["step_s"])
    modes = {}
    for mode in ("eager", "compiled"):
        e = slowest.roofline[mode]
        b = e["breakdown_s"]
        modes[mode] = {**{k: e[k] for k in ("step_s", "tokens_per_s_per_device", "mfu", "hfu")}, "breakdown_s": b,
                       "reach": reach(b, e["mfu"]), "bubble_alternatives": bubble_alternatives(world, b)}
    return {"case": case.name, "title": case.title, "device": case.device, "rank": slowest.rank,
            "stage": slowest.coords["pp"], "microbatches": world.layout.num_microbatches,
            "simulated_microbatches": list(slowest.extrapolated_from or (world.layout.num_microbatches,)),
            "peak_gib": round(slowest.peak["total"] / 2**30, 2), "seconds": round(seconds, 1),
            "command": command(case, world.dims.world_size), **modes}


def command(case: Case, world_size: int) -> str:
    """The ``simulate`` command line of the case (the routing skew has no flag: ``make_world``'s argument)."""
    nodes = world_size // case.devices_per_node
    overrides = " ".join(o for o in case.overrides if o != "model_path=")
    skew = f"  (heaviest ep rank at {case.moe_imbalance:g}x the mean: make_world(moe_imbalance=...))" \
        if case.moe_imbalance != 1 else ""
    return (f"qwen3-pretrain simulate --config {case.config} --device {case.device} --nodes {nodes} "
            f"--devices-per-node {case.devices_per_node} --ranks {case.ranks} {overrides}".strip() + skew)


def markdown(rows: list[dict]) -> str:
    lines = ["| layout | micro-batches (simulated) | eager: step, MFU, HFU | compiled: step, MFU, HFU | "
             "eager breakdown | compiled breakdown | eager: what 52% needs | compiled: what 52% needs |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        cells = [f"{r['title']} (stage {r['stage']})" if r["stage"] else r["title"],
                 f"{r['microbatches']} ({', '.join(map(str, r['simulated_microbatches']))})"]
        for mode in ("eager", "compiled"):
            e = r[mode]
            cells.append(f"{e['step_s']:.3f} s, {e['mfu']:.1%}, {e['hfu']:.1%}")
        for mode in ("eager", "compiled"):
            b = r[mode]["breakdown_s"]
            cells.append(" / ".join(f"{b[k]:.3f}" for k in ("matmul", "attention", "elementwise", "communication",
                                                            "host", "bubble")))
        for mode in ("eager", "compiled"):
            cells.append(reach_text(r[mode]["reach"], r[mode]["bubble_alternatives"]))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", help="comma-separated case names: " + ", ".join(c.name for c in CASES))
    parser.add_argument("--jobs", type=int, default=2, help="simulations at once (one process each)")
    parser.add_argument("--json", help="also write the rows as JSON to this file")
    parser.add_argument("--traces", type=Path, help="keep each case's simulated ranks (op traces) in this folder")
    parser.add_argument("--reprice", action="store_true", help="price the traces kept in --traces again (after a "
                        "change to the pricing, not to the recording) instead of simulating")
    args = parser.parse_args()
    if args.reprice and not args.traces:
        parser.error("--reprice needs --traces")
    chosen = [c for c in CASES if not args.only or c.name in args.only.split(",")]
    rows = []
    for case in chosen:
        rows.append(run_case(case, args.jobs, args.traces, args.reprice))
        print(f"{case.name}: {rows[-1]['seconds']} s, eager {rows[-1]['eager']['mfu']:.1%}, compiled "
              f"{rows[-1]['compiled']['mfu']:.1%}", flush=True)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(rows, f, indent=1)
    print(markdown(rows))
    print("\nCommands:\n" + "\n".join(f"  {r['case']}: {r['command']}" for r in rows))


if __name__ == "__main__":
    main()
