"""Roofline pricing of a training step's op trace: ``trace`` records it, ``pricing`` prices it on a device."""

from qwen3_pretrain.simulate.roofline.pricing import Breakdown, price, throughput
from qwen3_pretrain.simulate.roofline.trace import OpTrace, RecordingMode, TraceRecorder

__all__ = ["Breakdown", "OpTrace", "RecordingMode", "TraceRecorder", "price", "throughput"]
