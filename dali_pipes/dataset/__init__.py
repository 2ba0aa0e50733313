"""The contract of a dataset: its manifest, its folder's names, safe file writes, and how its fields come out.

Converters write it and readers read it, so both import this package, which
imports nothing above it:

- ``manifest``: ``index.json`` (fields, shards, classes, source), loaded and checked;
- ``folder``: a dataset folder's file names, and what to say when one has no manifest;
- ``fileio``: atomic writes, ``fsync`` of a folder, hashing;
- ``outputs``: the DALI type of each field dtype, and the output names the loader adds beside the fields.
"""
