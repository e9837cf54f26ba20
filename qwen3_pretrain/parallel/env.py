"""Process start-up on a device: which device a rank takes, deterministic kernels, and the process group.

The launch itself (rank, world, rendezvous) is read by ``launch.py``, without torch.
"""

from __future__ import annotations

import datetime
import os
import socket

import torch
import torch.distributed as dist

from qwen3_pretrain.errors import UserError
from qwen3_pretrain.parallel.launch import LaunchInfo


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


def node_cpu_share(launched: bool) -> tuple[int, int]:
    """The CPU cores that this launch's processes on this node may use between them, and how many processes
    that is (collective: every rank calls it). The node of a rank is its host name.

    A rank's cores are its affinity mask and, when a launcher started it (``launched``), its parent's: the
    launcher's own process (torchrun's agent, mpirun or orted, slurmstepd) is not bound to one rank's cores.
    So a launcher that binds each rank to a core of its own (mpirun) and one that lets every rank run
    anywhere (torchrun) give the same pair, and a rank's share of the node (cores / processes) does not
    depend on the launcher; a launch restricted as a whole (``taskset -c 0-7 torchrun ...``, a container's
    or a job's CPU set) counts only the cores it was given."""
    cores = _affinity(0)
    parent = os.getppid()
    if launched and parent > 1:
        cores |= _affinity(parent)
    mine = (socket.gethostname(), sorted(cores))
    everyone: list = [mine]
    if dist.is_initialized() and dist.get_world_size() > 1:
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, mine)
    return share_of_node(everyone, mine[0])


def set_cpu_threads(launched: bool) -> str:
    """Fix this process's intra-op thread count for the whole run, once, at start-up (collective: every rank
    calls it), and say what was set (the trainer logs it).

    The count is ``OMP_NUM_THREADS`` where the user or launcher set it (torchrun sets 1 per rank), else
    this rank's share of the node's cores (``node_cpu_share``: cores / processes, at most torch's
    default). Setting it through ``torch.set_num_threads`` also turns MKL's dynamic thread choice off
    (``mkl_set_dynamic(0)``), which torch leaves on until someone sets a count: with it on, MKL may run
    a GEMM on fewer threads than asked, and a GEMM split over another number of threads sums in another
    order, so the same run could differ in its last bits from one start to the next. A fixed count, the
    same in every run of a config on the same cores, keeps every kernel's split, and so a 1-process
    run's losses, the same bitwise whatever the machine's load (tests/test_reproducible_load.py).
    Interop threads are left at torch's default: the engine runs no inter-op parallel work. A count
    above this rank's share is oversubscription (the ranks' threads preempting each other; under load,
    OpenMP's spinning workers take cores from the ones doing work), hence the share as the default."""
    cores, processes = node_cpu_share(launched)
    # Never above torch's own default (physical cores where it can tell): the affinity mask counts
    # hyper-threads, and two threads on one core's siblings slow GEMMs down.
    share = max(1, min(cores // processes, torch.get_num_threads()))
    given = os.environ.get("OMP_NUM_THREADS", "").strip()
    user_set = given.isdigit() and int(given) > 0
    threads = int(given) if user_set else share
    torch.set_num_threads(threads)
    origin = f"OMP_NUM_THREADS={given}" if user_set else f"{cores} cores / {processes} process(es)"
    note = f"; above this rank's share of {share}: the ranks' threads preempt each other" if threads > share else ""
    return f"CPU threads: {threads} intra-op ({origin}), MKL dynamic off{openmp_wait_note(threads)}{note}"


def openmp_wait_note(threads: int) -> str:
    """How OpenMP's idle workers wait, for the threads line (nothing with one thread: no workers).

    Left to OpenMP (GNU libgomp, torch's on Linux, polls up to ``GOMP_SPINCOUNT`` times before it sleeps:
    300,000, or 1,000 when the threads outnumber the cores; Intel's runtime waits ``KMP_BLOCKTIME``): on
    cores of its own that is the faster choice, ``OMP_WAIT_POLICY=PASSIVE`` (sleep at once) made bf16
    steps up to 18% slower on an idle 2-core CPU; on a CPU shared with other work the polling worker takes the
    time slices of the thread still working and PASSIVE was 1.17-1.38x faster (bench/README.md "Under
    contention"). OpenMP reads both once, when torch loads it, so only the user can choose, before the
    command starts; the line says which applies."""
    if threads <= 1:
        return ""
    policy, spins = os.environ.get("OMP_WAIT_POLICY", "").strip(), os.environ.get("GOMP_SPINCOUNT", "").strip()
    blocktime = os.environ.get("KMP_BLOCKTIME", "").strip()
    if policy:
        return f", OpenMP wait policy {policy}"
    if spins:
        return f", OpenMP spin count {spins}"
    if blocktime:
        return f", OpenMP block time {blocktime}"
    return ", OpenMP idle workers spin before sleeping (OMP_WAIT_POLICY=PASSIVE is faster on a shared CPU)"


def set_cpu_denormals(flush: bool) -> str:
    """Flush denormal floats to zero on this process's CPU threads (the config's ``cpu_flush_denormal``),
    before the first parallel kernel runs, and say what holds (the trainer logs it beside the threads line).

    An x86 core computes an operation with a denormal operand or result (|x| below 1.2e-38 in fp32) in
    microcode, tens to hundreds of times slower than the same operation on normal numbers; GPUs and NPUs
    have no such penalty. With ``flush`` the SSE control register's flush-to-zero and denormals-are-zero
    bits are set (``torch.set_flush_denormal``): every op reads a denormal operand as 0 and writes a
    denormal result as 0 (a later product can move by more than 1e-38: 1.5e-39 x 1e30 gives 0, not 1.5e-9;
    the hybrid's training losses were bitwise equal flushed or not, bench/README.md). The register is per thread and a
    thread copies its creator's, so the bits reach torch's intra-op (OpenMP) pool only where it starts after
    this call, as it does in a training process (it starts at the first parallel kernel); the line says
    when a pool started before keeps denormals on some threads. Every rank calls it with the same value, so
    every layout computes alike. The two halves apart: ``flush_cpu_denormals`` (before the first parallel
    kernel) and ``cpu_denormals_line`` (its check runs a parallel kernel: after the run's thread count is set,
    so that it checks the pool the run uses)."""
    return cpu_denormals_line(flush, flush_cpu_denormals(flush))


def flush_cpu_denormals(flush: bool) -> bool:
    """Sets flush-to-zero on this thread where ``flush`` (``set_cpu_denormals``); whether it is set."""
    return flush and torch.set_flush_denormal(True)


def cpu_denormals_line(flush: bool, flushed: bool) -> str:
    """What holds after ``flush_cpu_denormals(flush)`` returned ``flushed``, checked on every intra-op thread."""
    if not flush:
        return "CPU denormals: computed as such (cpu_flush_denormal: false)"
    if not flushed:
        return "CPU denormals: computed as such (this CPU has no flush-to-zero mode torch can set)"
    if not _denormals_flushed_on_every_thread():
        return ("CPU denormals: flushed to zero on this thread only; the intra-op threads started before "
                "cpu_flush_denormal was applied keep them (start training before other torch work in the process)")
    return "CPU denormals: flushed to zero (FTZ/DAZ) on every intra-op thread (cpu_flush_denormal)"


def _denormals_flushed_on_every_thread() -> bool:
    """Whether a product that underflows into the denormal range is 0 in every slice of a parallel kernel:
    each intra-op thread multiplies a slice of at least torch's grain (32,768 elements)."""
    tiny = torch.full((65536 * max(torch.get_num_threads(), 1),), 1e-20)
    return not bool((tiny * tiny).any())


def share_of_node(ranks: list[tuple[str, list[int]]], host: str) -> tuple[int, int]:
    """(cores, processes) of ``host``, from every rank's (host name, cores)."""
    here = [set(cores) for name, cores in ranks if name == host]
    return max(len(set().union(*here)), 1), max(len(here), 1)


def _affinity(pid: int) -> set[int]:
    """The cores process ``pid`` (0: this one) may run on; empty when that cannot be read."""
    try:
        return set(os.sched_getaffinity(pid))
    except AttributeError:  # not on Linux: every core
        return set(range(os.cpu_count() or 1))
    except OSError:  # the process is gone
        return set()


def destroy() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
