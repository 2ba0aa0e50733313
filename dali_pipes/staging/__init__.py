"""Data brought closer before it is read: a local copy of a dataset, or its shards in shared memory.

- ``stage``: ``dali-pipes stage`` and ``DataOptions(stage_to=...)``, one copy per node, checked by hash;
- ``checked``: one staged file, written under a temporary name and kept only when whole;
- ``download``: the plan and the copier of a dataset at a URL of object storage (ranged, retried downloads);
- ``remote``: ``open_store(URL)`` and the loader's staging of a URL (into the cache folder by default);
- ``stream_cache``: a bounded shard cache shared by a node's processes, for training from object storage
  (``cache_folder``: its locks and bookkeeping; ``cache_plan``: its entries and what a folder already holds);
- ``mounts``: the filesystem a folder is on (the mount table), and whether it is a network one;
- ``ramcache``: ``DataOptions(cache="ram")``, this rank's shards in ``/dev/shm``;
- ``tmpfs``: ``/dev/shm`` folders that a killed process does not leave behind.
"""
