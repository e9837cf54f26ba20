"""Training checkpoints: sharded save/resume (manager) and merging into one HuggingFace model (merge)."""
