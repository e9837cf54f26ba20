"""Operations the model runs, chosen by the engine: the fused LM head + cross-entropy, the tied head, the
precision kernels, the mixture-of-experts block, the lean norm and SwiGLU, RoPE, each device's elementwise
kernels (``elementwise.py``: norms, RoPE, SwiGLU), and the hybrids' chunked gated delta rule and causal convolution with the device's choice of delta-rule kernel (the attention kernels live beside
the model, in ``models/qwen3/attention.py``)."""
