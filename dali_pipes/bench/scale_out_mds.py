"""The scale-out suite's peer row: MosaicML Streaming (``mosaicml-streaming``) on the same images and server.

Run with a Python that has ``mosaicml-streaming`` (its own environment: it is not a dependency of this
package; :mod:`dali_pipes.bench.scale_out` takes it as ``--mds-python``):

- ``python -m dali_pipes.bench.scale_out_mds write IMAGES OUT SIZE_LIMIT``: the image folder's JPEGs, class
  after class (sorted folders, sorted files: the order a script over an image folder writes them in), as
  MDS shards of at most ``SIZE_LIMIT`` bytes (``MDSWriter``, columns ``image: bytes``, ``label: int``,
  ``index: int``, no compression); prints the package's version;
- ``python -m dali_pipes.bench.scale_out_mds rank CONFIG.json``, a rank (:func:`run_mds`, its environment
  as :mod:`dali_pipes.bench.scale_out_rank` says): ``StreamingDataset(remote=s3://...,
  local=the node's folder, cache_limit=..., num_canonical_nodes=the nodes, batch_size=..., shuffle=True)``
  with its defaults otherwise (``shuffle_algo="py1e"``), read in the rank's own process as its users read it
  without workers: each JPEG decoded with PIL and resized to the same small size as this package's rows,
  grouped into batches of ``batch_size`` consecutive samples. ``S3_ENDPOINT_URL`` points at the node's proxy.
  The cache's peak is Streaming's own ``cache_usage`` (shared by the node's ranks), sampled after every batch.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any, Iterator

import numpy as np

from dali_pipes.bench.scale_out_rank import Batch, init_group, record_epochs, write_result

#: The MDS columns written.
COLUMNS = {"image": "bytes", "label": "int", "index": "int"}


def class_files(images: Path) -> list[tuple[Path, int]]:
    """``(file, label)`` of an image folder, class after class (label = the sorted folder's position)."""
    classes = sorted(p for p in images.iterdir() if p.is_dir())
    return [(f, label) for label, folder in enumerate(classes) for f in sorted(folder.iterdir()) if f.is_file()]


def write_mds(images: Path, out: Path, size_limit: int) -> str:
    """Write ``images`` as MDS shards in ``out`` (see the module docstring); the package's version."""
    import streaming
    from streaming import MDSWriter

    with MDSWriter(out=str(out), columns=COLUMNS, size_limit=size_limit) as writer:
        for index, (path, label) in enumerate(class_files(images)):
            writer.write({"image": path.read_bytes(), "label": label, "index": index})
    return streaming.__version__


def mds_epochs(dataset: Any, config: dict[str, Any], peak: list[int]) -> Iterator[Iterator[Batch]]:
    """``config["epochs"]`` passes of ``dataset``, decoded and batched (see the module docstring)."""
    for _ in range(config["epochs"]):
        yield _batches(dataset, config["batch_size"], config["out_size"], peak)


def _batches(dataset: Any, size: int, out_size: int, peak: list[int]) -> Iterator[Batch]:
    import io

    from PIL import Image

    index: list[int] = []
    labels: list[int] = []
    for sample in dataset:
        image = Image.open(io.BytesIO(sample["image"])).convert("RGB").resize((out_size, out_size))
        np.asarray(image)  # decoded and resized, as a transform hands it on
        index.append(int(sample["index"]))
        labels.append(int(sample["label"]))
        if len(index) == size:
            peak[0] = max(peak[0], int(dataset.cache_usage))
            yield np.array(index), np.array(labels), True
            index, labels = [], []
    if index:
        yield np.array(index), np.array(labels), False


def run_mds(config: dict[str, Any]) -> dict[str, Any]:
    """One MosaicML Streaming rank (see the module docstring); what it read, as :func:`record_epochs` says."""
    import streaming
    from streaming import StreamingDataset

    dist = init_group(config)
    dataset = StreamingDataset(
        remote=config["url"],
        local=config["folder"],
        cache_limit=config["cache_limit"],
        num_canonical_nodes=config["nodes"],
        batch_size=config["batch_size"],
        shuffle=True,
        shuffle_seed=config["seed"],
    )
    peak = [0]

    def figures() -> dict[str, Any]:
        return {
            "peak": peak[0],
            "limit": config["cache_limit"],
            "version": streaming.__version__,
            "shuffle_algo": dataset.shuffle_algo,
            "shuffle_block_size": dataset.shuffle_block_size,
        }

    result = record_epochs(config, mds_epochs(dataset, config, peak), dist, figures)
    dist.barrier()
    dist.destroy_process_group()
    return result


def main(argv: list[str]) -> int:
    """``write IMAGES OUT SIZE_LIMIT``, or ``rank CONFIG.json`` (see the module docstring)."""
    if len(argv) == 4 and argv[0] == "write":
        print(write_mds(Path(argv[1]), Path(argv[2]), int(argv[3])))
        return 0
    if len(argv) == 2 and argv[0] == "rank":
        config = json.loads(Path(argv[1]).read_text())
        write_result(config, run_mds(config))
        return 0
    print(
        "usage: python -m dali_pipes.bench.scale_out_mds write IMAGES OUT SIZE_LIMIT | rank CONFIG.json",
        file=sys.stderr,
    )
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
