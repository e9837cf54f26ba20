"""Who launched us (nothing, torchrun, mpirun or srun): rank, world, and where the rendezvous is.

torchrun exports RANK/WORLD_SIZE/LOCAL_RANK/MASTER_ADDR/MASTER_PORT. OpenMPI's
mpirun exports OMPI_COMM_WORLD_{RANK,SIZE,LOCAL_RANK,LOCAL_SIZE}; the rendezvous
address then comes from the config (``master_addr``/``master_port``), as in the
reference workflow. Slurm's ``srun`` with one task per device exports
SLURM_PROCID/SLURM_LOCALID and, for a job step (not for the batch script
itself, which also sees SLURM_NTASKS), SLURM_STEP_NUM_TASKS. Under mpirun and
srun the rendezvous host is MASTER_ADDR if exported, else ``master_addr``,
unless that is a loopback address and the launch spans several nodes: then
srun's first node, and for mpirun (which does not say where rank 0 runs) an
error naming ``master_addr``, rather than ranks waiting for a rendezvous that
cannot happen. Without a launcher we run as a world of one.

No torch here: a one-process conversion reads its launch without importing it.
"""

from __future__ import annotations

import ipaddress
import os
import re
import socket
from dataclasses import dataclass

from qwen3_pretrain.errors import UserError


@dataclass(frozen=True)
class LaunchInfo:
    rank: int
    world_size: int
    local_rank: int
    launcher: str  # "none" | "torchrun" | "mpirun" | "srun"
    local_world_size: int | None = None  # processes on this node, where the launcher says


def detect_launch(master_addr: str = "127.0.0.1", master_port: int = 29500) -> LaunchInfo:
    """Read rank/world from the launcher's environment and export what ``env://`` init needs."""
    env = os.environ
    if "OMPI_COMM_WORLD_RANK" in env and "RANK" not in env:
        info = LaunchInfo(int(env["OMPI_COMM_WORLD_RANK"]), int(env["OMPI_COMM_WORLD_SIZE"]),
                          int(env.get("OMPI_COMM_WORLD_LOCAL_RANK", 0)), "mpirun",
                          _int_or_none(env.get("OMPI_COMM_WORLD_LOCAL_SIZE")))
    elif "RANK" in env and "WORLD_SIZE" in env:
        info = LaunchInfo(int(env["RANK"]), int(env["WORLD_SIZE"]), int(env.get("LOCAL_RANK", 0)), "torchrun",
                          _int_or_none(env.get("LOCAL_WORLD_SIZE")))
    elif "SLURM_STEP_NUM_TASKS" in env and "SLURM_PROCID" in env:
        info = LaunchInfo(int(env["SLURM_PROCID"]), int(env["SLURM_STEP_NUM_TASKS"]),
                          int(env.get("SLURM_LOCALID", 0)), "srun", slurm_local_tasks(env))
    else:
        info = LaunchInfo(0, 1, 0, "none", 1)
    if "MASTER_ADDR" not in env:
        env["MASTER_ADDR"] = rendezvous_host(info, master_addr) if info.launcher != "none" else "127.0.0.1"
    if "MASTER_PORT" not in env:
        env["MASTER_PORT"] = str(master_port if info.launcher != "none" else free_port())
    env["RANK"], env["WORLD_SIZE"], env["LOCAL_RANK"] = str(info.rank), str(info.world_size), str(info.local_rank)
    return info


def rendezvous_host(info: LaunchInfo, master_addr: str) -> str:
    """Where rank 0 listens when MASTER_ADDR is not exported: ``master_addr``, unless it is a loopback
    address on a launch across nodes (there it would name each rank's own node)."""
    spans = _spans_nodes(info)
    if spans is None or not _is_loopback(master_addr):
        return master_addr
    if info.launcher == "srun":
        host = first_host(os.environ.get("SLURM_STEP_NODELIST", ""))
        if host:
            return host
    raise UserError(f"master_addr is {master_addr}, a loopback address, but this {info.launcher} launch spans "
                    f"several nodes ({spans}): set master_addr in the config to the host name or address of the "
                    "node running rank 0, or export MASTER_ADDR to every rank (mpirun -x MASTER_ADDR)")


def _spans_nodes(info: LaunchInfo) -> str | None:
    """The launcher's evidence that this launch runs on more than one node, or None."""
    env = os.environ
    if info.launcher == "srun" and int(env.get("SLURM_STEP_NUM_NODES", 1)) > 1:
        return f"SLURM_STEP_NUM_NODES {env['SLURM_STEP_NUM_NODES']}"
    if info.launcher == "mpirun" and info.local_world_size is not None and info.local_world_size < info.world_size:
        return f"OMPI_COMM_WORLD_SIZE {info.world_size} > OMPI_COMM_WORLD_LOCAL_SIZE {info.local_world_size}"
    return None


def _is_loopback(host: str) -> bool:
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name
        return False


def _int_or_none(text: str | None) -> int | None:
    return int(text) if text and text.isdigit() else None


def slurm_local_tasks(env) -> int | None:
    """Tasks of this job step on this node, from SLURM_STEP_TASKS_PER_NODE (``4(x2),3``: 4, 4, 3 per node)."""
    counts: list[int] = []
    for item in env.get("SLURM_STEP_TASKS_PER_NODE", "").split(","):
        match = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", item.strip())
        if match is None:
            return None
        counts += [int(match.group(1))] * int(match.group(2) or 1)
    node = int(env.get("SLURM_NODEID", 0))
    return counts[node] if node < len(counts) else None


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
