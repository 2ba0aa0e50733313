"""dali-pipes: shards in, augmented GPU batches out.

Offline, ``dali-pipes convert`` writes a training set into LMDB, HDF5 or TFRecord
shards described by one manifest; online, the stores read them by sample index.
"""

from dali_pipes.manifest import Manifest, ManifestError, load_manifest
from dali_pipes.stores import Store, StoreError, open_store
from dali_pipes.loader import DALILoader, LoaderError
from dali_pipes.sampling import World, epoch_order, num_batches, rank_indices

__version__ = "0.1.0"

__all__ = ["Manifest", "ManifestError", "Store", "StoreError", "load_manifest", "open_store", "__version__"]
__all__ += ["DALILoader", "LoaderError", "World", "epoch_order", "num_batches", "rank_indices"]
