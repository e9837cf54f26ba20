"""Process groups on a device whose collective library cannot split a communicator (Ascend's HCCL, XPU's):
the engine's mesh and its host-side groups are made without error.

A CPU build has neither device, so a stand-in plays it: torch's Python-only accelerator (PrivateUse1
renamed ``npu``) and a stand-in ``hccl`` library registered for it (torch's fake process group, which,
like HCCL, does not report that it can split). Bound to the device at init, the process group made
DeviceMesh split the world's communicator ("No backend for the parent process group or its backend does
not support splitting"), and a gloo-only group had no backend for the bound device ("No backend type
associated with device type npu").
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from qwen3_pretrain.parallel import env, launch
from qwen3_pretrain.parallel.dims import ParallelDims
from tests._train_helpers import free_port


def _stand_in_npu() -> None:
    from torch._C._distributed_c10d import FakeProcessGroup
    from torch.utils.backend_registration import _setup_privateuseone_for_python_backend

    _setup_privateuseone_for_python_backend(rename="npu")
    dist.Backend.register_backend(
        "hccl", lambda store, options: FakeProcessGroup._create_internal(store.group_rank, store.group_size,
                                                                         FakeProcessGroup.Options()),
        extended_api=True, devices=["npu"])


def _rank(rank: int, world: int, port: int) -> None:
    import os

    from qwen3_pretrain.checkpoint.manager import Checkpointer

    _stand_in_npu()
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    info = launch.LaunchInfo(rank, world, rank, "torchrun")
    env.init_process_group(info, torch.device("npu", 0), timeout_s=60, init_timeout_s=60)
    try:
        backend = dist.group.WORLD._get_backend(torch.device("npu"))
        assert not backend.supports_splitting  # the stand-in is the case under test
        # tp 1 x dp 2 (an axis narrower than the world: DeviceMesh makes a group for it), and the
        # flattened axis FSDP shards over under cp
        dims = ParallelDims.resolve(world_size=world, cp=2)
        mesh = dims.build_mesh("npu")
        dims.dp_mesh(mesh)
        Checkpointer("unused", [], [], async_save=True)  # the asynchronous save's group of its own
        # host-side collectives still run on the CPU library
        flag = torch.ones(1)
        dist.all_reduce(flag)
        assert flag.item() == world
    finally:
        dist.destroy_process_group()


def test_mesh_and_host_groups_on_a_device_whose_library_cannot_split() -> None:
    mp.spawn(_rank, args=(2, free_port()), nprocs=2, join=True)


def test_the_device_is_bound_only_where_its_library_splits() -> None:
    assert env.bound_device(torch.device("cuda", 1)) == torch.device("cuda", 1)
    assert env.bound_device(torch.device("xpu", 0)) is None  # (npu is a device type only with torch_npu)
    assert env.bound_device(torch.device("cpu")) is None
