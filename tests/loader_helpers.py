"""Shared by the loader tests (and the DDP worker processes they start).

Datasets are written through the public writer API (``converters.writers``)
and the manifest module, with images that encode their own sample number, so a
test can check which sample it got from the pixels as well as from ``index``.
"""

from __future__ import annotations

import atexit
import io
import logging
import os
import shutil
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Mapping

import numpy as np
from PIL import Image

from converters.writers import writer_class
from dali_pipes.dataset.fileio import sha256_file
from dali_pipes.dataset.manifest import Field, Manifest, Shard, write_manifest

SIZE = 16  # side of the images the test spec outputs


def encode_jpeg(value: int, shape: tuple[int, int] = (20, 24)) -> bytes:
    """A flat-grey JPEG whose grey level encodes ``value`` (decodes back within a few levels)."""
    array = np.full((*shape, 3), value, dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(array).save(out, format="JPEG", quality=95)
    return out.getvalue()


def grey_level(i: int) -> int:
    # Distinct levels 8 apart for up to 30 samples; larger sets repeat, which the tests allow for.
    return 8 * (i % 30) + 8


#: The sockets that hold the ports free_port() handed out, bound until this process exits.
_RESERVED_PORTS: list[socket.socket] = []


@atexit.register
def _release_ports() -> None:
    for sock in _RESERVED_PORTS:  # closed before exit, not left to the garbage collector's ResourceWarning
        sock.close()


def free_port() -> int:
    """A TCP port on 127.0.0.1 that no other process is handed while this one runs: for a rendezvous.

    For ``init_process_group(init_method=f"tcp://127.0.0.1:{port}")`` and ``torchrun --master_port``.
    Binding port 0 and closing the socket (what the tests did) released the port before the job's
    store bound it, so under ``pytest -n auto`` another test's probe could be handed it in between
    and two jobs met at one port. Here the socket stays bound, with ``SO_REUSEADDR`` and never
    listening, for the life of this process. On Linux the kernel then hands the port to no socket
    that binds port 0 and to no outgoing connection; a socket that binds it by number with
    ``SO_REUSEADDR`` still can, since ours does not listen: torch's ``TCPStore`` sets it (with and
    without libuv), so the job's store binds it and is the only one listening there
    (``tests/test_ports.py``). A ``file://`` rendezvous needs no port, but torchrun's nodes and the
    helpers that take a port number need one.
    """
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    _RESERVED_PORTS.append(sock)  # a few per test process: kept rather than tracked per job
    return sock.getsockname()[1]


def skip_if_fork_refused() -> None:
    """Skip a test that forces ``py_start_method="fork"`` where DALI refuses to fork.

    Every loader calls ``torch.cuda.is_available()`` (to resolve its device), which
    initialises the CUDA driver on a CUDA machine, and DALI cannot fork after that;
    the spawn variants of such tests cover the same path there.
    """
    import pytest
    import torch

    from dali_pipes.loading.start_method import driver_initialized

    torch.cuda.is_available()  # what DALILoader does first; on a CUDA machine it initialises the driver
    if driver_initialized():
        pytest.skip("forces fork, which DALI refuses once the CUDA driver is initialised (a CUDA machine)")


def write_dataset(
    out: str | os.PathLike,
    num_samples: int,
    *,
    fmt: str = "lmdb",
    samples_per_shard: int = 7,
    corrupt: frozenset[int] = frozenset(),
    fields: str = "images",
    image_shape: tuple[int, int] = (20, 24),
) -> Path:
    """A dataset of ``num_samples`` samples: ``image`` (grey JPEG), ``label`` (= index % 5), ``key``.

    ``corrupt`` sample numbers get image bytes that are not a decodable image.
    ``fields="arrays"`` writes a features-only dataset (``features``, ``label``) instead.
    ``image_shape`` is the images' (height, width).
    """
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    if fields == "arrays":
        schema = {"features": Field.array("float32", (4,)), "label": Field.array("int64", ())}
    else:
        schema = {"image": Field.image(), "label": Field.array("int64", ()), "key": Field.text()}
    writer_cls = writer_class(fmt)
    shards = []
    for number, lo in enumerate(range(0, num_samples, samples_per_shard)):
        hi = min(lo + samples_per_shard, num_samples)
        name = f"shard-{number:05d}{writer_cls.suffix}"
        writer = writer_cls(out / name, schema)
        for i in range(lo, hi):
            writer.write(_sample(i, fields, i in corrupt, image_shape))
        writer.close()
        index_path = writer.index_path()
        shards.append(
            Shard(
                path=name,
                num_samples=hi - lo,
                bytes=(out / name).stat().st_size,
                sha256=sha256_file(out / name),
                index_path=index_path.name if index_path else None,
                index_sha256=sha256_file(index_path) if index_path else None,
            )
        )
    manifest = Manifest(format=fmt, fields=schema, shards=tuple(shards), source={"kind": "test"}, classes=None)
    write_manifest(out, manifest)
    return out


def _sample(i: int, fields: str, corrupt: bool, image_shape: tuple[int, int] = (20, 24)) -> dict:
    label = np.array(i % 5, dtype=np.int64)
    if fields == "arrays":
        return {"features": np.full(4, i, dtype=np.float32), "label": label}
    image = encode_jpeg(grey_level(i), image_shape)
    if corrupt:
        # A valid JPEG start (so it is taken for a JPEG) followed by garbage.
        image = image[:40] + bytes(range(256)) * 4
    return {"image": image, "label": label, "key": f"sample-{i}".encode()}


# --- damage done to a converted dataset after conversion ------------------------------------------

#: The ways a shard can be damaged after conversion, for :func:`damage_shard`.
DAMAGES = ("flip", "scribble", "truncate", "delete", "swap")


def shard_name(fmt: str, number: int) -> str:
    """The file name :func:`write_dataset` gives shard ``number`` of a ``fmt`` dataset."""
    return f"shard-{number:05d}{writer_class(fmt).suffix}"


def _stored_image(root: Path, fmt: str, shard: int, sample: int) -> tuple[Path, bytearray, bytes, int]:
    """``(shard path, its bytes, sample's JPEG, where it starts)``: the image bytes found in the shard file itself.

    Every format stores them verbatim, so damage done there is damage on disk, below any reader.
    """
    path = root / shard_name(fmt, shard)
    raw = bytearray(path.read_bytes())
    jpeg = encode_jpeg(grey_level(sample))
    at = raw.find(jpeg)
    if at < 0 or raw.find(jpeg, at + 1) >= 0:
        raise AssertionError(f"{path}: the image of sample {sample} is not stored exactly once")
    return path, raw, jpeg, at


def flip_image_header(root: Path, fmt: str, shard: int, sample: int) -> None:
    """Zero the first 4 bytes (JPEG SOI and APP0 markers) of ``sample``'s image inside shard ``shard``."""
    path, raw, _, at = _stored_image(root, fmt, shard, sample)
    raw[at : at + 4] = bytes(4)
    path.write_bytes(bytes(raw))


def scribble_image(root: Path, fmt: str, shard: int, sample: int) -> None:
    """Overwrite the middle of ``sample``'s JPEG entropy-coded data inside shard ``shard``, size unchanged.

    The markers are kept, so the damaged image still starts and ends like a JPEG
    and a decoder usually decodes it (into a damaged picture) without an error:
    only a checksum of the record can tell.
    """
    path, raw, jpeg, at = _stored_image(root, fmt, shard, sample)
    scan = jpeg.rfind(b"\xff\xda")  # start of scan: the entropy-coded data follows its header
    lo, hi = at + scan + 14, at + len(jpeg) - 2  # up to the EOI marker
    raw[lo:hi] = bytes(0x55 for _ in range(hi - lo))
    path.write_bytes(bytes(raw))


def damage_shard(root: Path, fmt: str, how: str, shard: int, sample: int, other: Path | None = None) -> None:
    """Damage shard ``shard`` of the dataset at ``root`` the way ``how`` (one of :data:`DAMAGES`) says.

    ``flip``: :func:`flip_image_header` of ``sample``; ``scribble``:
    :func:`scribble_image` of ``sample``; ``truncate``: cut the file
    to half its size; ``delete``: remove it; ``swap``: copy the same-named shard
    (and its index) of the dataset ``other`` over it.
    """
    path = root / shard_name(fmt, shard)
    if how == "flip":
        flip_image_header(root, fmt, shard, sample)
    elif how == "scribble":
        scribble_image(root, fmt, shard, sample)
    elif how == "truncate":
        os.truncate(path, path.stat().st_size // 2)
    elif how == "delete":
        path.unlink()
    elif how == "swap":
        assert other is not None
        for name in os.listdir(other):
            if name.startswith(path.name):  # the shard and, for TFRecord, its .idx
                shutil.copyfile(other / name, root / name)
    else:
        raise ValueError(f"unknown damage {how!r}")


# --- processes ---------------------------------------------------------------------------------------


def process_alive(pid: int) -> bool:
    """Whether process ``pid`` is running: not gone, and not a zombie waiting to be reaped.

    Reading ``/proc/PID/stat`` races with the process's exit: the file can vanish
    (``FileNotFoundError``), fail with ``ESRCH`` (``ProcessLookupError``) while the
    process is being reaped, or read empty; each means the process is dead.
    """
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except OSError:
        return False
    _, paren, rest = stat.rpartition(")")
    fields = rest.split()
    if not paren or not fields:
        return False  # read empty: it was reaped between the open and the read
    return fields[0] not in ("Z", "X")


def wait_until_dead(pid: int, timeout: float = 60.0) -> None:
    """Wait until process ``pid`` is dead (see :func:`process_alive`); ``AssertionError`` after ``timeout`` s.

    The timeout is generous: a loaded machine can take seconds to deliver a signal and schedule the exit.
    """
    deadline = time.monotonic() + timeout
    while process_alive(pid):
        if time.monotonic() > deadline:
            raise AssertionError(f"process {pid} is still alive {timeout} s later")
        time.sleep(0.01)


def epoch_folders() -> set[Path]:
    """The folders in ``/dev/shm`` in which this process's loaders keep their epoch control block and plans.

    Named ``dali-pipes-epoch-<pid>-...`` (``loading/sources.py``); a test takes the set before and after
    making a loader to find that loader's folder, the files it writes seen from outside.
    """
    import pytest

    if not os.access("/dev/shm", os.W_OK):
        pytest.skip("needs a writable /dev/shm, where the loader keeps its epoch plans")
    return set(Path("/dev/shm").glob(f"dali-pipes-epoch-{os.getpid()}-*"))


# --- processes that read a dataset at the same time -----------------------------------------------


def read_every_sample(path: str, barrier, results) -> None:
    """Read every sample of the dataset at ``path`` twice, holding its shards open across a barrier.

    Run in a spawned process by the concurrent-reader tests. The first pass
    opens every shard; :meth:`barrier.wait` then holds until every reader (and the
    test's loader) has its handles open at once, so any exclusive lock would
    show as a failed open or a barrier timeout; the second pass reads again with
    every process's handles open. Puts ``(pid, digests)`` (one SHA-256 per
    sample, over its fields) on ``results``, or ``(pid, error message)``.
    """
    import hashlib

    from dali_pipes import open_store

    try:
        store = open_store(path)
        first = [_digest(store[i], hashlib) for i in range(len(store))]
        barrier.wait(timeout=120)
        second = [_digest(store[i], hashlib) for i in range(len(store))]
        store.close()
        results.put((os.getpid(), first if first == second else "the two passes differ"))
    except BaseException as exc:  # noqa: BLE001 - reported to the test, which fails on it
        barrier.abort()
        results.put((os.getpid(), f"{type(exc).__name__}: {exc}"))


def _digest(sample: Mapping, hashlib) -> str:
    h = hashlib.sha256()
    for name in sorted(sample):
        value = sample[name]
        h.update(name.encode())
        h.update(value if isinstance(value, bytes) else np.ascontiguousarray(value).tobytes())
    return h.hexdigest()


def sample_digests(path: str | os.PathLike) -> list[str]:
    """One SHA-256 per sample of the dataset at ``path``, read in this process."""
    import hashlib

    from dali_pipes import open_store

    store = open_store(path)
    try:
        return [_digest(store[i], hashlib) for i in range(len(store))]
    finally:
        store.close()


@dataclass(frozen=True)
class TinySpec:
    """A minimal pipeline spec for the tests: decode, resize to SIZE x SIZE, pass the label."""

    required_fields: tuple[str, ...] = ("image", "label")
    needs_conditionals: bool = False

    def build(self, inputs: Mapping, *, device: str) -> dict:
        from nvidia.dali import fn, types

        decoder = "mixed" if device == "gpu" else "cpu"
        images = fn.decoders.image(inputs["image"], device=decoder, output_type=types.RGB)
        images = fn.resize(images, resize_x=SIZE, resize_y=SIZE)
        label = inputs["label"].gpu() if device == "gpu" else inputs["label"]
        return {"image": images, "label": label}


def job_rows(source, world_size: int, *, epoch: int = 0, state=None, batch_size: int = 4, run=None, **loader_kwargs):
    """Every rank's real ``(index, label)`` rows, in the job's global order, and rank 0's state after 2 batches.

    One loader per rank in turn (``seed=9``, CPU, ``run``'s other options), each on ``epoch`` or resumed
    from ``state``; ``loader_kwargs`` go to ``DALILoader`` as they are. Asserts that every rank yields as
    many batches.
    """
    from dataclasses import replace

    from dali_pipes import BatchFormat, DALILoader, RunOptions

    per_rank, saved = [], None
    for rank in range(world_size):
        options = replace(run or RunOptions(), device="cpu", rank=rank, world_size=world_size)
        with DALILoader(
            source,
            TinySpec(),
            batch_size=batch_size,
            seed=9,
            run=options,
            batch_format=BatchFormat(with_index=True),
            **loader_kwargs,
        ) as loader:
            loader.load_state_dict(state) if state is not None else loader.set_epoch(epoch)
            batches = []
            for number, batch in enumerate(loader):
                rows = zip(batch["index"].tolist(), batch["label"].tolist(), batch["is_pad"].tolist())
                batches.append([(i, label) for i, label, pad in rows if not pad])
                if number == 1 and rank == 0:
                    saved = loader.state_dict()
            per_rank.append(batches)
    assert len({len(b) for b in per_rank}) == 1  # the same number of batches on every rank
    return [row for step in zip(*per_rank) for rows in step for row in rows], saved


def ordered_batches(
    path: str | os.PathLike, spec, *, epochs: int = 1, batch_size: int = 8, device: str = "cpu", seed: int = 0
) -> list[dict]:
    """Every batch of ``epochs`` epochs in dataset order, with ``index``, as numpy arrays, read in this process.

    Asserts that every output is on ``device``.
    """
    from dali_pipes import BatchFormat, DALILoader, RunOptions

    batches = []
    run = RunOptions(device=device, py_num_workers=0)
    with DALILoader(
        path, spec, batch_size=batch_size, shuffle=False, seed=seed, run=run, batch_format=BatchFormat(with_index=True)
    ) as loader:
        for epoch in range(epochs):
            loader.set_epoch(epoch)
            for batch in loader:
                assert all(v.is_cuda == (device == "gpu") for v in batch.values())
                batches.append({k: v.cpu().numpy() for k, v in batch.items()})
    return batches


def real_rows(batches: list[dict]) -> Iterator[tuple[dict, int]]:
    """``(batch, row)`` for every real (not padding) sample of ``batches``."""
    for batch in batches:
        for row in range(len(batch["index"])):
            if not batch["is_pad"][row]:
                yield batch, row


def run_module_on_cpu(module: str, *args: str, timeout: float) -> subprocess.CompletedProcess:
    """``python -m module args`` with no GPU visible and one OpenMP thread (the tests share a few cores)."""
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-m", module, *map(str, args)]
    return subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=env)


def batch_rows(batch: Mapping) -> list[tuple[int, int, bool, int]]:
    """``(index, label, is_pad, grey level)`` per sample of a yielded batch."""
    grey = batch["image"].float().mean(dim=(1, 2, 3)).round().to(int).tolist()
    return list(zip(batch["index"].tolist(), batch["label"].tolist(), batch["is_pad"].tolist(), grey))


def quiet_dali_logs() -> None:
    logging.getLogger("dali_pipes").setLevel(logging.WARNING)


def ddp_worker(rank: int, world_size: int, port: int, dataset: str, out_dir: str, options: dict) -> None:
    """One rank of a real DDP job (gloo, CPU DALI), started by ``torch.multiprocessing``.

    Reads ``options["epochs"]`` whole epochs, stepping in lockstep with an
    all-reduce per batch the way training does, then ``options["partial"]``
    batches of the next epoch, and writes what it saw to ``out_dir/rank-R.json``.
    """
    import json

    import torch
    import torch.distributed as dist

    from dali_pipes import BatchFormat, DALILoader, LoaderError, RunOptions

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    try:
        kwargs = dict(
            batch_size=options["batch_size"],
            seed=options.get("seed", 0),
            shuffle=options.get("shuffle", True),
            run=RunOptions(device="auto", py_num_workers=options.get("workers", 0)),
            batch_format=BatchFormat(with_index=True),
        )
        if options.get("weighted"):  # an epoch of options["weighted"] samples drawn with weights 1..N
            from dali_pipes import WeightedSampling, load_manifest

            n = load_manifest(dataset).num_samples
            kwargs["sampling"] = WeightedSampling(np.arange(1, n + 1, dtype=float), num_samples=options["weighted"])
        if options.get("dataloader_shape"):  # as a script written for a DataLoader evaluates: tuples, no padding
            kwargs["batch_format"] = BatchFormat(keys=("image", "label", "index"), drop_padding=True, with_index=True)
        if options.get("mixture"):  # dataset "a" mixed with options["mixture"]["b"], as Mixture(**options["mixture"])
            from dali_pipes import Mixture

            mixture = dict(options["mixture"])
            dataset = Mixture({"a": dataset, "b": mixture.pop("b")}, **mixture)
        loader = DALILoader(dataset, TinySpec(), **kwargs)
        report: dict = {"world": [loader.world.rank, loader.world.world_size], "len": len(loader), "epochs": []}
        report["dataset_len"] = len(loader.dataset)
        for epoch in range(options["epochs"]):
            loader.sampler.set_epoch(epoch) if options.get("dataloader_shape") else loader.set_epoch(epoch)
            batches = []
            try:
                for batch in loader:
                    dist.all_reduce(torch.ones(1))  # a training step: every rank must take part
                    if isinstance(batch, tuple):
                        image, label, index = batch
                        batches.append([index.tolist(), [False] * len(index)])
                        continue
                    batches.append([batch["index"].tolist(), batch["is_pad"].tolist()])
            except LoaderError as exc:
                # Keep this rank's own message: the job may report another rank's failure first.
                with open(os.path.join(out_dir, f"rank-{rank}.error"), "w") as f:
                    f.write(str(exc))
                raise
            report["epochs"].append(batches)
        report["refills"] = loader.refills  # DALI epochs started from empty: 1 while the epochs read on
        if options.get("partial"):
            loader.set_epoch(options["epochs"])
            iterator = iter(loader)
            report["partial"] = []
            for _ in range(options["partial"]):
                batch = next(iterator)
                dist.all_reduce(torch.ones(1))
                report["partial"].append([batch["index"].tolist(), batch["is_pad"].tolist()])
            report["state"] = loader.state_dict()
        if options.get("repeat"):
            # A second loader with the same seed must read the same epochs.
            twin = DALILoader(dataset, TinySpec(), **kwargs)
            report["twin"] = [[b["index"].tolist(), b["is_pad"].tolist()] for b in twin]
        with open(os.path.join(out_dir, f"rank-{rank}.json"), "w") as f:
            json.dump(report, f)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def stream_worker(rank: int, world_size: int, url: str, out_dir: str, options: dict) -> None:
    """One rank of a streaming job, a process of its own (``torch.multiprocessing``).

    Reads ``url`` with ``DataOptions(stream=StreamOptions(**options["stream"]), storage_options=options["storage"])``
    (``options["stream"]`` a list: one per rank) from the node's shared cache folder (``DALI_PIPES_CACHE``,
    inherited; ``url`` a dict of name -> URL: a ``Mixture`` of them, ``options["mixture"]`` its keywords): the rest of
    the epoch of ``options["state"]`` when given, else one epoch, stopping after
    ``options["stop"]`` batches when given (its ``state_dict()`` then reported). In a gloo process group
    when ``options["group"]``, else without one; ``options["env"]`` (a list: one dict per rank) sets what a
    launcher would (``LOCAL_WORLD_SIZE``, ``GROUP_RANK``: a simulated node). Writes ``out_dir/rank-R.json``: the
    batches (indices, is_pad), the node window, and the cache's peak bytes and limit.
    """
    import json

    import torch.distributed as dist

    from dali_pipes import BatchFormat, DALILoader, DataOptions, Mixture, RunOptions, StreamOptions

    quiet_dali_logs()
    os.environ.update(options["env"][rank] if options.get("env") else {})
    if options.get("group"):
        store = f"file://{os.path.join(out_dir, 'group-store')}"
        dist.init_process_group("gloo", init_method=store, rank=rank, world_size=world_size)
        run = RunOptions(device="cpu", py_num_workers=0)
    else:
        run = RunOptions(rank=rank, world_size=world_size, device="cpu", py_num_workers=0)
    stream = options["stream"][rank] if isinstance(options["stream"], list) else options["stream"]
    data = DataOptions(stream=StreamOptions(**stream), storage_options=options["storage"])
    kwargs = dict(batch_size=options["batch_size"], seed=options.get("seed", 0), run=run, data=data)
    try:
        source = Mixture(url, **options.get("mixture", {})) if isinstance(url, dict) else url
        with DALILoader(source, TinySpec(), batch_format=BatchFormat(with_index=True), **kwargs) as loader:
            if options.get("state"):
                loader.load_state_dict(options["state"])
            window = getattr(loader.sampling, "node_window", None)
            report: dict = {"len": len(loader), "window": window, "batches": []}
            for batch in loader:
                report["batches"].append([batch["index"].tolist(), batch["is_pad"].tolist()])
                if len(report["batches"]) == options.get("stop"):
                    report["state"] = loader.state_dict()
                    break
            report["peak"] = loader.cache.peak_bytes
            report["limit"] = loader.cache.limit_bytes
    finally:
        if options.get("group"):
            dist.destroy_process_group()
    with open(os.path.join(out_dir, f"rank-{rank}.json"), "w") as f:
        json.dump(report, f)
