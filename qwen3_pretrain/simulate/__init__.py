"""Scale simulation: the training engine on fake tensors and a fake process group (``qwen3-pretrain simulate``)."""
