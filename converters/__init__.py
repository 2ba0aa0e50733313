"""Offline conversion of training sets into LMDB, HDF5 or TFRecord shards with one manifest.

``python -m converters`` runs the ``convert`` commands of the ``dali-pipes`` CLI.
"""
