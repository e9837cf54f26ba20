"""Training-time data: the shard format (``indexed_dataset``) and the manifest beside the shards (``manifest``),
both also written by ``convert/``; the packed reader, blends of several datasets, the prefetching thread.
Nothing here knows of ranks or meshes: the trainer hands the reader its dp rank."""
