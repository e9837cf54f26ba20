"""The Qwen3 dense family: ``config`` (HF key names, presets; no torch), ``model`` (plain torch), attention
kernels (``attention``) and the calls they make (``attention_calls``; no torch), HF I/O, generation.
Import from the module that defines a name: this package imports nothing, so reading a config or a
preset does not import torch."""
