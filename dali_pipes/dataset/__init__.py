"""The on-disk contract of a dataset: its manifest, its folder's names, and safe file writes.

Converters write it and readers read it, so both import this package and
nothing above it:

- ``manifest``: ``index.json`` (fields, shards, classes, source), loaded and checked;
- ``folder``: a dataset folder's file names, and what to say when one has no manifest;
- ``fileio``: atomic writes, ``fsync`` of a folder, hashing.
"""
