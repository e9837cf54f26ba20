"""Process start-up: who launched us (nothing, torchrun, mpirun or srun), which device, and the process group.

torchrun exports RANK/WORLD_SIZE/LOCAL_RANK/MASTER_ADDR/MASTER_PORT. OpenMPI's
mpirun exports OMPI_COMM_WORLD_{RANK,SIZE,LOCAL_RANK}; the rendezvous address
then comes from the config (``master_addr``/``master_port``), as in the
reference workflow. Slurm's ``srun`` with one task per device exports
SLURM_PROCID/SLURM_LOCALID and, for a job step (not for the batch script
itself, which also sees SLURM_NTASKS), SLURM_STEP_NUM_TASKS; the rendezvous
host is then MASTER_ADDR if exported, else ``master_addr`` unless that is
the loopback default and the step spans several nodes (then its first node). Without a launcher we run as a world of one.
"""

from __future__ import annotations

import datetime
import os
import re
import socket
from dataclasses import dataclass

import torch
import torch.distributed as dist

from qwen3_pretrain.errors import UserError


@dataclass(frozen=True)
class LaunchInfo:
    rank: int
    world_size: int
    local_rank: int
    launcher: str  # "none" | "torchrun" | "mpirun" | "srun"


def detect_launch(master_addr: str = "127.0.0.1", master_port: int = 29500) -> LaunchInfo:
    """Read rank/world from the launcher's environment and export what ``env://`` init needs."""
    env = os.environ
    if "OMPI_COMM_WORLD_RANK" in env and "RANK" not in env:
        info = LaunchInfo(int(env["OMPI_COMM_WORLD_RANK"]), int(env["OMPI_COMM_WORLD_SIZE"]),
                          int(env.get("OMPI_COMM_WORLD_LOCAL_RANK", 0)), "mpirun")
    elif "RANK" in env and "WORLD_SIZE" in env:
        info = LaunchInfo(int(env["RANK"]), int(env["WORLD_SIZE"]), int(env.get("LOCAL_RANK", 0)), "torchrun")
    elif "SLURM_STEP_NUM_TASKS" in env and "SLURM_PROCID" in env:
        info = LaunchInfo(int(env["SLURM_PROCID"]), int(env["SLURM_STEP_NUM_TASKS"]),
                          int(env.get("SLURM_LOCALID", 0)), "srun")
        # Across nodes a loopback master_addr (the default) cannot be right: rank 0 runs on the first node.
        if ("MASTER_ADDR" not in env and int(env.get("SLURM_STEP_NUM_NODES", 1)) > 1
                and master_addr in ("127.0.0.1", "localhost")):
            master_addr = first_host(env.get("SLURM_STEP_NODELIST", "")) or master_addr
    else:
        info = LaunchInfo(0, 1, 0, "none")
    env.setdefault("MASTER_ADDR", master_addr if info.launcher != "none" else "127.0.0.1")
    if "MASTER_PORT" not in env:
        env["MASTER_PORT"] = str(master_port if info.launcher != "none" else free_port())
    env["RANK"], env["WORLD_SIZE"], env["LOCAL_RANK"] = str(info.rank), str(info.world_size), str(info.local_rank)
    return info


def first_host(nodelist: str) -> str | None:
    """The first host of a Slurm node list: ``node[03-05,9],gpu1`` -> ``node03``."""
    head = re.match(r"([^,\[]*)(?:\[([^\]]*)\]([^,]*))?", nodelist.strip())
    if head is None or not (head.group(1) or head.group(2)):
        return None
    prefix, ranges, suffix = head.group(1), head.group(2), head.group(3) or ""
    return prefix + (re.split(r"[-,]", ranges)[0] if ranges else "") + suffix


def free_port() -> int:
    """A TCP port on the loopback interface that nothing listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def pick_device(kind: str, local_rank: int) -> torch.device:
    """``auto`` prefers CUDA, then an Ascend NPU (torch_npu), then the CPU."""
    if kind == "auto":
        if torch.cuda.is_available():
            kind = "cuda"
        elif _npu_available():
            kind = "npu"
        else:
            kind = "cpu"
    if kind == "cpu":
        return torch.device("cpu")
    if kind == "cuda" and not torch.cuda.is_available():
        raise UserError("device: cuda was asked for but torch.cuda.is_available() is False; use device: auto or cpu")
    if kind == "npu" and not _npu_available():
        raise UserError("device: npu was asked for but torch_npu is not installed or sees no NPU")
    module = getattr(torch, kind)
    module.set_device(local_rank % module.device_count())
    return torch.device(kind, local_rank % module.device_count())


def _npu_available() -> bool:
    try:
        import torch_npu  # noqa: F401  (registers torch.npu)
    except ImportError:
        return False
    return bool(torch.npu.is_available())


BACKENDS = {"cpu": "gloo", "cuda": "nccl", "npu": "hccl"}


def init_process_group(info: LaunchInfo, device: torch.device, timeout_s: int, init_timeout_s: int) -> None:
    """Join the process group; an unreachable rendezvous is a clear error, not a hang."""
    if dist.is_initialized():
        return
    backend = BACKENDS[device.type]
    timeout = datetime.timedelta(seconds=timeout_s)
    addr, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    # Under torchrun the agent hosts the store and outlives restarts: a restarted worker must not
    # read the addresses its dead predecessors published, so every attempt gets its own key prefix.
    agent_store = info.launcher == "torchrun" and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    try:
        store = dist.TCPStore(addr, port, info.world_size, is_master=info.rank == 0 and not agent_store,
                              timeout=datetime.timedelta(seconds=init_timeout_s), wait_for_workers=False)
    except (RuntimeError, OSError) as exc:
        raise UserError(f"could not reach the rendezvous at {addr}:{port} within {init_timeout_s} s ({exc}); "
                        "check master_addr/master_port and that rank 0 is running") from None
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    store = dist.PrefixStore(f"qwen3_pretrain/attempt_{attempt}", store)
    dist.init_process_group(backend, store=store, rank=info.rank, world_size=info.world_size,
                            timeout=timeout, device_id=device if device.type != "cpu" else None)


def destroy() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
