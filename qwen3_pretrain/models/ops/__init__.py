"""Operations the model runs, chosen by the engine: the fused LM head + cross-entropy, the tied head,
and the precision kernels (the attention kernels live beside the model, in ``models/qwen3/attention.py``)."""
