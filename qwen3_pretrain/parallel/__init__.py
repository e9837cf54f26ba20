"""Parallelism applied to the plain model from outside: mesh, TP, PP, FSDP, activation checkpointing."""
