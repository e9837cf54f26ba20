"""Run a ``qwen3-pretrain`` command whose process group is made as the engine makes it for a CUDA device.

A CPU build has no NCCL, so gloo stands in for it, on the same device types: the engine's backend
for ``cuda`` (``env.backend_spec``) with every device library replaced by gloo. A group whose only
backend is for ``cuda`` then refuses a collective on a CPU tensor, "No backend type associated with
device type cpu", exactly as NCCL's does on a GPU. Tensors the engine keeps on its device are CPU
tensors here and stand in for device tensors; the group can only carry them if it has a CPU backend
as well, which is what a GPU run needs for its host-side collectives (checkpoint agreement, DCP).

    python -m torch.distributed.run --nproc_per_node 2 tests/_device_group.py train --config c.yaml
"""

from __future__ import annotations

import sys

from torch.distributed.distributed_c10d import Backend, BackendConfig

from qwen3_pretrain import cli
from qwen3_pretrain.parallel import env


def stand_in(spec: str) -> str:
    """``spec`` with gloo for each device type's library (``cpu:gloo,cuda:nccl`` -> ``cpu:gloo,cuda:gloo``,
    ``nccl`` -> ``cuda:gloo``)."""
    return ",".join(f"{device}:gloo" for device in BackendConfig(Backend(spec)).get_device_backend_map())


def main() -> int:
    spec = stand_in(env.backend_spec("cuda"))
    env.backend_spec = lambda device_type: spec
    print(f"process group backend: {spec}", flush=True)
    return cli.main(sys.argv[1:])


if __name__ == "__main__":
    sys.exit(main())
