"""The offline conversion: a Wikipedia dump (or wikiextractor output) to parquet (``wiki``), and parquet or
JSON lines to tokenized Megatron indexed-dataset shards (``run``: one process; ``ranks``: several, started
as training is). Training reads the shards through ``data/`` and never imports this package."""
