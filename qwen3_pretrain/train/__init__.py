"""Training: the trainer loop, optimizer and LR schedule, loss, metrics."""
