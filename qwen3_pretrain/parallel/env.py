"""Process start-up: who launched us (nothing, torchrun, mpirun or srun), which device, and the process group.

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
"""

from __future__ import annotations

import datetime
import ipaddress
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


def pick_device(kind: str, local_rank: int, local_world_size: int | None = None) -> torch.device:
    """``auto`` prefers CUDA, then an Ascend NPU (torch_npu), then the CPU. On a device, local rank r
    takes device r; more processes on a node than devices is an error, not two ranks sharing one."""
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
    index = _device_index(kind, module.device_count(), local_rank, local_world_size)
    module.set_device(index)
    return torch.device(kind, index)


VISIBLE_DEVICES = {"cuda": "CUDA_VISIBLE_DEVICES", "npu": "ASCEND_RT_VISIBLE_DEVICES"}


def _device_index(kind: str, count: int, local_rank: int, local_world_size: int | None) -> int:
    variable = VISIBLE_DEVICES[kind]
    visible = [d for d in os.environ.get(variable, "").split(",") if d.strip()]
    # A launcher that binds one device to each process (srun --gpus-per-task=1) leaves each process one.
    if count == 1 and len(visible) == 1:
        return 0
    needed = max(local_rank + 1, local_world_size or 0)
    if needed > count:
        raise UserError(f"{needed} processes on this node but {count} {kind} device(s) visible "
                        f"({variable}={os.environ.get(variable, '(unset)')}): each process needs a device of its "
                        "own; start at most one process per device (torchrun --nproc_per_node, hostfile slots, "
                        "mpirun -npernode, srun --ntasks-per-node)")
    return local_rank


def _npu_available() -> bool:
    try:
        import torch_npu  # noqa: F401  (registers torch.npu)
    except ImportError:
        return False
    return bool(torch.npu.is_available())


def set_deterministic(enabled: bool) -> None:
    """Deterministic kernels for this process (the config's ``deterministic``), before the first kernel runs:
    cuBLAS reads its workspace setting when its first handle is made, HCCL its setting at communicator
    creation. Off leaves everything as torch sets it."""
    if not enabled:
        return
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    os.environ.setdefault("HCCL_DETERMINISTIC", "true")
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False


# The collective library for device tensors. Host-side collectives (checkpoint agreement, DCP's
# metadata exchange, its asynchronous save) run on CPU tensors, which NCCL and HCCL do not take:
# on a device the process group has gloo beside the device library.
DEVICE_BACKENDS = {"cuda": "nccl", "npu": "hccl", "xpu": "xccl"}
# Device libraries that split a communicator (ncclCommSplit). Only there is the device bound at
# init_process_group (``device_id``): DeviceMesh then splits the world's communicator for each axis
# instead of creating one per group. Bound elsewhere, DeviceMesh's split raises unless the library
# reports it can split (HCCL and XCCL have not), and every later group inherits the device, so a
# group of another library (``new_group(backend="gloo")``) has no backend for it.
SPLITTING_LIBRARIES = frozenset({"nccl"})


def bound_device(device: torch.device) -> torch.device | None:
    """The ``device_id`` to bind the process group to: the device where its library splits, else None."""
    return device if DEVICE_BACKENDS.get(device.type) in SPLITTING_LIBRARIES else None


def backend_spec(device_type: str) -> str:
    """The ``backend`` of ``init_process_group``: gloo on a CPU, ``cpu:gloo,<device>:<library>`` on a device."""
    if device_type == "cpu":
        return "gloo"
    return f"cpu:gloo,{device_type}:{DEVICE_BACKENDS[device_type]}"


def init_process_group(info: LaunchInfo, device: torch.device, timeout_s: int,
                       init_timeout_s: int) -> dist.Store | None:
    """Join the process group; an unreachable rendezvous is a clear error, not a hang. Returns the
    rendezvous store the ranks share (None when the group already existed)."""
    if dist.is_initialized():
        return None
    backend = backend_spec(device.type)
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
                            timeout=timeout, device_id=bound_device(device))
    return store


def destroy() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
