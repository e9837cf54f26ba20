"""Training-log analysis: the human log or ``metrics.jsonl`` -> CSV, summary and plot.

``parse_log`` reads either view of the training metrics (the ``nohup`` log of
``tools/train.py`` or the ``metrics.jsonl`` it writes), ``plot`` draws loss,
learning rate and throughput against step.
"""
