"""Data brought closer before it is read: a local copy of a dataset, or its shards in shared memory.

- ``stage``: ``dali-pipes stage`` and ``DALILoader(stage_to=...)``, one copy per node, checked by hash;
- ``ramcache``: ``DALILoader(cache="ram")``, this rank's shards in ``/dev/shm``;
- ``tmpfs``: ``/dev/shm`` folders that a killed process does not leave behind.
"""
