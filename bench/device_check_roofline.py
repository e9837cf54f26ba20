"""The roofline's price of a device check throughput run's step, beside the step the run measured
(called by ``bench/device_check_stages.py``'s throughput stages, after the run).

    python bench/device_check_roofline.py --config RUN/config.yaml \
        (--device-name "NVIDIA H100 80GB HBM3" | --cpu) --out roofline.json

``simulate`` plays the run's own config (one rank, the same model, sequence, batch, recompute and compile
flag) on fake tensors, builds the engine as for the device and prices its op trace
(``simulate/roofline``): on a device with the device table's figures for the name torch reported
(``hardware.device_by_reported_name``), on ``--cpu`` with this CPU's figures measured by a short probe
(``simulate.probe.measure_cpu``, about 15 s with its bandwidth curves at load 4). Writes the predicted step
eager and compiled with their breakdowns as JSON (the stage sets the run's mode beside its measured step: the
ratio predicted / measured); a device the table does not know gets ``{"skipped": why}``. The eager and
compiled runs of one shape share one simulation (the stage keeps this file per shape).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from qwen3_pretrain.config.loader import load_config
from qwen3_pretrain.hardware import device_by_reported_name
from qwen3_pretrain.simulate.run import make_world, simulate_ranks
from qwen3_pretrain.train.config import TrainConfig


def cpu_hardware(cfg: TrainConfig):
    """This CPU's device from a short probe (``CpuProbe.hardware``): matmul peaks, the tiny-product class,
    the run's own causal attention and the autograd chain's per-op host cost. Not calibrated per model as
    bench/roofline_cpu.py is (no engine-step host cost, no grouped-expert rate): a sanity check of the
    stage's plumbing on the CPU, the comparison that matters is a device's."""
    from qwen3_pretrain.simulate.probe import measure_cpu
    from qwen3_pretrain.train.model_source import resolve_model

    m = resolve_model(cfg).config
    attention = (cfg.batch_size, m.num_attention_heads, m.num_key_value_heads, cfg.seq_length, m.head_dim)
    return measure_cpu(min_seconds=0.01, memory_mib=32, attention=attention).hardware()


def predict(config: Path, device_name: str | None) -> dict:
    """The run's step priced eager and compiled (the run's ``compile`` picks which one it is compared with)."""
    # the engine is simulated eager: the compiled price is the fusion model on the same trace
    cfg = load_config(TrainConfig, config, ["compile=false"])
    hardware = cpu_hardware(cfg) if device_name is None else device_by_reported_name(device_name)
    if hardware is None:
        return {"skipped": f"the device table has no entry reported as {device_name!r} (hardware.DEVICES)"}
    start = time.perf_counter()
    result = simulate_ranks(make_world(cfg, 1, hardware=hardware), [0], jobs=1)[0]
    modes = {mode: {"predicted_step_s": e["step_s"], "predicted_mfu": e["mfu"], "breakdown_s": e["breakdown_s"]}
             for mode, e in ((m, result.roofline[m]) for m in ("eager", "compiled"))}
    return {"device": hardware.name, "modes": modes, "simulate_s": round(time.perf_counter() - start, 1)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", type=Path, required=True)
    parser.add_argument("--device-name", help="what torch reports for the device (the env stage's device_name)")
    parser.add_argument("--cpu", action="store_true", help="price with this CPU's probed figures")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    figures = predict(args.config, None if args.cpu else args.device_name)
    args.out.write_text(json.dumps(figures, indent=1) + "\n")
    if "modes" in figures:
        print(f"roofline on {figures['device']}: predicted " + ", ".join(
            f"{mode} {e['predicted_step_s']:.4f} s" for mode, e in figures["modes"].items()) + " per step")
    else:
        print(f"roofline: {figures['skipped']}")


if __name__ == "__main__":
    main()
