"""The measuring room: the training engine on fake tensors and a fake process group at full size
(``qwen3-pretrain simulate``: ``run``, the target device's attention kernels ``attention``, per-step memory
and bytes ``track``), and the allocator-level memory tracker (``memtrack``) that tests and benchmarks hold
the planner's predictions against."""
