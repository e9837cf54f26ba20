"""Memory and throughput model of the training engine, per parallel layout.

    from qwen3_pretrain.plan import Layout, predict_memory, predict_step, get_device
    mem = predict_memory(model_cfg, Layout(tp=4, pp=2, micro_batch_size=4, seq_length=8192))
    print(mem.gib())  # parameters, gradients, optimizer, activations, logits, overhead, total

Nothing here imports torch but ``commbench`` (it measures real collectives), which
is imported on its own: ``plan`` starts without torch (``tests/test_torch_free.py``).
"""

from qwen3_pretrain.hardware import DEVICES, Hardware, get_device
from qwen3_pretrain.plan.layout import Cluster, Layout
from qwen3_pretrain.plan.memory import MemoryBreakdown, predict_memory
from qwen3_pretrain.plan.step import StepEstimate, predict_step

__all__ = ["DEVICES", "Cluster", "Hardware", "Layout", "MemoryBreakdown", "StepEstimate", "get_device",
           "predict_memory", "predict_step"]
