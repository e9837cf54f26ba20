"""Facts about this machine's software and accelerator, as one JSON object (the ``env`` stage of
``bench/device_check.sh``). Run in its own process, so a driver that hangs is bounded by the stage's timeout.

    python bench/device_check_env.py --device auto|cpu --out FACTS.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def command_output(cmd: list[str], timeout: float = 20) -> str | None:
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return proc.stdout.strip() if proc.returncode == 0 else None


def fact(get):
    """One optional fact; its failure is recorded instead of failing the stage (and so the device run)."""
    try:
        return get()
    except Exception as exc:
        return f"unavailable: {type(exc).__name__}: {exc}"


def version_text(version) -> str:
    return str(version) if isinstance(version, int) else ".".join(map(str, version))


def software() -> dict:
    import torch

    facts = {"python": platform.python_version(), "platform": platform.platform(), "torch": torch.__version__,
             "cuda_build": torch.version.cuda, "commit": command_output(["git", "rev-parse", "HEAD"])}
    if torch.cuda.is_available():
        facts["cudnn"] = fact(torch.backends.cudnn.version)
        facts["nccl"] = fact(lambda: version_text(torch.cuda.nccl.version()))
        facts["driver"] = command_output(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"])
    try:
        import torch_npu
    except ImportError:
        return facts
    facts["torch_npu"] = getattr(torch_npu, "__version__", "?")
    facts["cann"] = fact(cann_version)
    return facts


def cann_version() -> str | None:
    """The CANN toolkit's version, from the version file of the toolkit the environment points at."""
    home = os.environ.get("ASCEND_TOOLKIT_HOME") or os.environ.get("ASCEND_HOME_PATH")
    for base in filter(None, [home, "/usr/local/Ascend/ascend-toolkit/latest"]):
        for name in ("version.cfg", "compiler/version.info"):
            path = Path(base) / name
            if path.is_file():
                lines = [line for line in path.read_text(errors="replace").splitlines() if "version" in line.lower()]
                return lines[0].strip() if lines else None
    return None


def visible_accelerators() -> tuple[str, int]:
    """(kind, count) of the accelerators this process may use, as torch counts them: CUDA first, then an
    Ascend NPU, as ``device: auto`` picks. torch honours CUDA_VISIBLE_DEVICES / ASCEND_RT_VISIBLE_DEVICES and
    sees a MIG slice as one device, where ``nvidia-smi -L`` lists every GPU of the node and a line more for
    each MIG slice."""
    import torch

    if torch.cuda.is_available():
        return "cuda", torch.cuda.device_count()
    from qwen3_pretrain.parallel.env import _npu_available

    if _npu_available():
        return "npu", torch.npu.device_count()
    return "cpu", 0


def accelerator(device) -> dict:
    import torch

    module = getattr(torch, device.type)
    props = module.get_device_properties(device)
    facts = {"device_name": module.get_device_name(device), "device_count": visible_accelerators()[1],
             "memory_gib": round(props.total_memory / 2**30, 2)}
    if device.type == "cuda":
        facts["capability"] = fact(lambda: version_text(torch.cuda.get_device_capability(device)))
        facts["bf16_supported"] = fact(torch.cuda.is_bf16_supported)
    return facts


def host_cpu() -> dict:
    info = Path("/proc/cpuinfo")
    lines = info.read_text().splitlines() if info.is_file() else []
    model = next((line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")),
                 platform.processor())
    return {"device_name": model, "cpu_cores": os.cpu_count()}


def peak(device) -> dict:
    """What the engine will use as the peak for MFU on this device (and where it comes from)."""
    from qwen3_pretrain.train.metrics import device_peak_tflops

    if device.type == "cpu":  # measured by each run at its start, in the dtype it multiplies in
        return {}
    try:
        value, source = device_peak_tflops(device, None)
    except Exception as exc:  # the figure is informative; its failure must not hide the other facts
        return {"peak_tflops_error": f"{type(exc).__name__}: {exc}"}
    return {"peak_tflops": value if value == value else None, "peak_source": source}


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=["auto", "cpu"], default="auto")
    parser.add_argument("--out", type=Path, required=True, help="JSON file to write")
    args = parser.parse_args(argv)
    from qwen3_pretrain.parallel.env import pick_device

    facts = software()
    device = pick_device(args.device, 0)
    facts["device_type"] = device.type
    facts.update(host_cpu() if device.type == "cpu" else accelerator(device))
    facts.update(peak(device))
    args.out.write_text(json.dumps(facts, indent=1) + "\n")
    print(json.dumps(facts))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
