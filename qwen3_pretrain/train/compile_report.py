"""What ``torch.compile`` made of the model, read from dynamo's own counters, for one log line after the
first compiled step (``compile: true``).

A clean compile of the decoder layers is one graph per layer kind (dense, sparse, Gated DeltaNet, gated
attention, ...), no graph break, and no recompile beyond one per further kind: the layers of a kind share
their compiled code. A graph break or a recompile per layer means that part of every step runs eager, which
the log line then says, with dynamo's reasons (tests/test_compile.py asserts the clean case per model).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch._dynamo.utils import counters


@dataclass(frozen=True)
class CompileSummary:
    graphs: int  # distinct graphs dynamo captured
    graph_breaks: int  # places where a frame stopped being traced and ran eager
    frames: int  # frames compiled, each recompile counted again
    recompiles: int  # compiles of a frame beyond its first (a further layer kind, or a failed guard)
    break_reasons: tuple[str, ...]  # dynamo's first line for each distinct graph break

    def line(self) -> str:
        text = (f"compiled {self.graphs} graph{'s' * (self.graphs != 1)} in {self.frames} frame"
                f"{'s' * (self.frames != 1)}: {self.graph_breaks} graph break{'s' * (self.graph_breaks != 1)}, "
                f"{self.recompiles} recompile{'s' * (self.recompiles != 1)}")
        if self.break_reasons:
            text += "; graph breaks (run eager): " + " | ".join(self.break_reasons)
        return text


def compile_summary() -> CompileSummary:
    """The counters of every compile in this process so far."""
    breaks = counters["graph_break"]
    reasons = tuple(sorted({str(reason).strip().splitlines()[0][:160] for reason in breaks}))
    return CompileSummary(graphs=counters["stats"]["unique_graphs"], graph_breaks=sum(breaks.values()),
                          frames=counters["frames"]["ok"], recompiles=_recompiles(), break_reasons=reasons)


def _recompiles() -> int:
    """Compiles beyond each frame's first: dynamo numbers each frame's compiles (its compile id's
    ``frame_compile_id``), kept per frame in ``convert_frame``."""
    per_frame = getattr(torch._dynamo.convert_frame, "FRAME_COMPILE_COUNTER", {})
    return sum(max(0, n - 1) for n in per_frame.values())
