"""MemoryTracker on CPU counts known allocations exactly: each storage once, freed ones subtracted."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from qwen3_pretrain.simulate.memtrack import MemoryTracker

MB = 1_000_000


def test_a_new_tensor_counts_its_bytes_and_views_do_not_count_again():
    with MemoryTracker() as mem:
        a = torch.empty(25_000_000)  # 100 MB of fp32
        assert mem.current_bytes == 100 * MB
        views = [a[10:], a.view(5000, 5000).t(), a.narrow(0, 0, 7), a.detach()]
        a.add_(1.0)  # in place: same storage
        assert mem.current_bytes == 100 * MB
        b = a.to(torch.bfloat16)
        assert mem.current_bytes == 150 * MB and mem.peak_bytes == 150 * MB
        del a
        assert mem.current_bytes == 150 * MB  # the views keep the storage alive
        del views
        assert mem.current_bytes == 50 * MB
        del b
        assert mem.current_bytes == 0 and mem.peak_bytes == 150 * MB


def test_reset_starts_a_new_peak_and_counts_stay_after_exit():
    with MemoryTracker() as mem:
        tmp = torch.zeros(1_000_000)
        del tmp
        keep = torch.ones(250_000)
        mem.reset()
        assert mem.peak_bytes == mem.current_bytes == MB
        extra = keep * 2
        del extra
    assert mem.current_bytes == MB and mem.peak_bytes == 2 * MB


def test_autograd_saved_tensors_and_gradients_are_counted():
    x = torch.randn(500, 500, requires_grad=True)  # 1 MB, created before: not counted
    with MemoryTracker() as mem:
        y = (x @ x).relu()  # the product is freed (relu saves its output), the relu output stays
        assert mem.current_bytes == MB
        y.sum().backward()
        # x.grad (1 MB) remains; y (1 MB) is still referenced
        assert mem.current_bytes == 2 * MB
        assert mem.peak_bytes >= 3 * MB


def test_counted_bytes_are_the_live_storages_made_in_the_block_among_those_given():
    before = torch.randn(250_000)  # 1 MB, created before: not counted
    with MemoryTracker() as mem:
        a, b = torch.empty(500_000), torch.empty(750_000)  # 2 MB, 3 MB
        freed = torch.empty(1_000_000)
        del freed
        assert mem.counted_bytes(a, [a[1:], a.t()], before) == 2 * MB  # a's storage once; views add nothing
        assert mem.counted_bytes([b, {"x": a}]) == 5 * MB
        assert mem.counted_bytes(before, torch.empty(0)) == 0
    with pytest.raises(RuntimeError, match="inside the 'with' block"):
        mem.counted_bytes(a)


class _SlowPops(dict):
    """The counter's table, made to give up the interpreter in the middle of a free's update."""

    def pop(self, *args):
        time.sleep(0.001)
        return super().pop(*args)


def test_a_storage_freed_in_another_thread_is_subtracted():
    """Tensors whose last reference goes in another thread (as gloo's worker lets go of a collective's
    buffers) are freed by finalizers that run there, beside this thread's counting: no update is lost."""
    with MemoryTracker() as mem:
        mem._counter._sizes = _SlowPops(mem._counter._sizes)
        for _ in range(5):
            held = [torch.empty(2500) for _ in range(20)]
            release = threading.Thread(target=held.clear)
            release.start()
            churn = [torch.empty(10) for _ in range(200)]  # counted here while the other thread frees
            release.join()
            del churn
            assert mem.current_bytes == 0


def test_storages_resized_in_place_are_followed():
    with MemoryTracker() as mem:
        t = torch.empty(0)
        storage = t.untyped_storage()
        storage.resize_(4 * MB)
        assert mem.current_bytes == 4 * MB
        storage.resize_(0)
        assert mem.current_bytes == 0 and mem.peak_bytes == 4 * MB


def test_an_empty_storage_from_before_that_grows_is_new_memory():
    storage = torch.empty(0).untyped_storage()  # as FSDP's unsharded parameters between steps
    with MemoryTracker() as mem:
        storage.resize_(4 * MB)
        assert mem.current_bytes == 4 * MB
        storage.resize_(0)
        assert mem.current_bytes == 0 and mem.peak_bytes == 4 * MB


def test_track_registers_what_existed_before():
    model = torch.nn.Linear(1000, 250, bias=False)  # 1 MB of weights
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.ones(1, 1000)).sum().backward()
    optimizer.step()  # momentum buffer: 1 MB
    with MemoryTracker() as mem:
        mem.track(model, optimizer)
        assert mem.current_bytes == 3 * MB  # weight, gradient, momentum
        mem.track(model.weight)  # counted once, however often it is registered
        assert mem.current_bytes == 3 * MB
    with pytest.raises(RuntimeError, match="inside the 'with' block"):
        mem.track(model)


def test_accelerator_without_statistics_is_a_clear_error():
    with pytest.raises(RuntimeError, match="no memory statistics"):
        MemoryTracker("meta").current_bytes  # noqa: B018


def test_a_dtensor_counts_its_local_shard_not_its_global_shape():
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    import torch.distributed as dist

    owned = not dist.is_initialized()  # later tests may start process groups of their own
    if owned:
        dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    try:
        mesh = init_device_mesh("cpu", (1,))
        # A shard of 1 MB that declares a 4 MB global tensor, as rank 0 of 4 would hold.
        shard = DTensor.from_local(torch.ones(250_000), mesh, [Shard(0)], run_check=False,
                                   shape=torch.Size([1_000_000]), stride=(1,))
        with MemoryTracker() as mem:
            doubled = shard * 2
            assert doubled.shape == (1_000_000,)
            assert mem.current_bytes == MB
    finally:
        if owned:
            dist.destroy_process_group()
