"""``dali-pipes bench --suite scale-out``: streaming on 1, 2 and 4 simulated nodes, side by side with MosaicML Streaming.

What a team with more data than a node's disk asks of a streamed loader on several nodes: what each node
downloads an epoch, how well its batches mix, how fast it reads, and whether every sample comes once. On
this machine (no real nodes), each node is simulated as ``ranks_per_node`` processes started as torchrun
starts them (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, ``GROUP_RANK``,
``GROUP_WORLD_SIZE``; one gloo process group for all), with a cache folder of its own and a latency proxy of
its own in front of one local S3 server (moto, :mod:`dali_pipes.bench.object_storage`; 30 ms to each answer's
first byte): what a node's proxy forwarded is what the node downloaded.

The data (:mod:`dali_pipes.bench.scale_out_data`): a class-ordered image folder of small photo crops,
converted by ``dali-pipes convert`` with its defaults (a shuffled order) and with ``--order source``, and
written as MDS shards of about the same bytes. The rows, for each node count of the plan:

- ``dali-pipes convert default``, ``dali-pipes --order source``: this package's loader
  (:mod:`dali_pipes.bench.scale_out_rank`), a cache of ``cache_share`` of the dataset's shard bytes per node;
- ``MosaicML Streaming``: ``StreamingDataset`` with the same cache share, ``num_canonical_nodes`` = the
  nodes (:mod:`dali_pipes.bench.scale_out_mds`), run by ``mds_python`` (``--mds-python``, else
  ``$DALI_PIPES_BENCH_MDS_PYTHON``): a Python with ``mosaicml-streaming`` installed, its own environment;
  without one the rows say so.

Every rank reads on the CPU (a small decode and resize), so the images/s are those of 2 shared cores
running all of a row's processes, the server and the proxies: the bytes, classes and the exactly-once check
are the figures that carry over to real nodes. The figures: :mod:`dali_pipes.bench.scale_out_table`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

from dali_pipes.bench import scale_out_data as data
from dali_pipes.bench.object_storage import latency_proxy, s3_server, server_options, upload
from dali_pipes.bench.scale_out_table import format_table, global_classes, goal_lines, row_figures

log = logging.getLogger(__name__)

#: The environment variable naming the Python that has MosaicML Streaming.
MDS_PYTHON_ENV = "DALI_PIPES_BENCH_MDS_PYTHON"
OURS = {"ours-shuffled": "dali-pipes convert default", "ours-source": "dali-pipes --order source"}
MDS = "MosaicML Streaming"


@dataclass(frozen=True)
class ScaleOutPlan:
    """The suite's sizes (the defaults ran in 15 minutes on 2 busy cores, 9 rows; :meth:`quick` in 2 to 4)."""

    images: int = 1200
    classes: int = 20
    image_size: tuple[int, int] = (64, 48)
    samples_per_shard: int = 10
    batch_size: int = 16
    nodes: tuple[int, ...] = (1, 2, 4)
    ranks_per_node: int = 2
    epochs: int = 2
    cache_share: float = 0.10
    out_size: int = 32
    seed: int = 0
    row_timeout_s: float = 300.0

    @classmethod
    def quick(cls) -> "ScaleOutPlan":
        """Tiny data, 1 and 2 nodes, one epoch: checks that every row runs; the figures mean little. A cache of 15%:
        a tenth of these 60 uneven shards is less than the six largest the stream takes."""
        return cls(
            images=240, classes=12, samples_per_shard=4, batch_size=8, nodes=(1, 2), epochs=1, cache_share=0.15,
            row_timeout_s=180,
        )  # fmt: skip


def run_scale_out(workdir: Path, plan: ScaleOutPlan, mds_python: str | None = None) -> dict[str, Any]:
    """Make the data in ``workdir``, run every row, and return the report (``rows``, ``table``, the plan)."""
    mds_python = mds_python or os.environ.get(MDS_PYTHON_ENV) or None
    images = data.make_image_folder(workdir / "images", plan.images, plan.classes, plan.image_size, plan.seed)
    datasets = {order: _ours_dataset(folder) for order, folder in data.convert_both(images, workdir, plan).items()}
    mds, why = _mds_dataset(workdir, images, datasets["ours-source"]["shards"], plan, mds_python)
    reference = global_classes(data.labels_of(images), plan.batch_size, plan.epochs, plan.seed)
    rows = []
    with s3_server() as port:
        for name, entry in [*datasets.items(), ("mds", mds)]:
            if entry is not None:
                entry["url"] = upload(entry["folder"], server_options(port), name)[0]
        peer = f"{MDS} {mds['version']}" if mds else MDS
        for name, kind, entry in [*((OURS[o], "ours", d) for o, d in datasets.items()), (peer, "mds", mds)]:
            for nodes in plan.nodes:
                row = {"name": name, "layout": f"{nodes}x{plan.ranks_per_node}"}
                if entry is None:
                    row["skipped"] = why
                else:
                    row.update(_run_row(workdir, plan, port, kind, entry, nodes, reference, mds_python))
                rows.append(row)
                log.info("scale-out: %s %s done", name, row["layout"])
    return {
        "plan": dataclasses.asdict(plan),
        "datasets": {
            name: {k: entry[k] for k in ("bytes", "shards", "samples", "version") if k in entry}
            for name, entry in [*datasets.items(), ("mds", mds)]
            if entry is not None
        },
        "global_classes": reference,
        "rows": rows,
        "table": format_table(rows, reference, plan.batch_size),
        "goals": goal_lines(rows, OURS["ours-shuffled"]),
    }


def _mds_dataset(
    workdir: Path, images: Path, shards: int, plan: ScaleOutPlan, python: str | None
) -> tuple[dict[str, Any] | None, str | None]:
    """The MDS copy of ``images`` (``shards`` shards of about as many images as this package's) and ``None``, or
    ``None`` and why the peer's rows cannot run."""
    if not python:
        return None, f"no Python with mosaicml-streaming here (--mds-python or ${MDS_PYTHON_ENV})"
    # MDS shards hold the JPEGs as they are (LMDB's pages add to ours): sized to hold as many images as ours.
    limit = int(data.folder_bytes(images, ".jpg") / shards * 1.1) + 1024
    folder = workdir / "mds"
    try:
        version = data.write_mds(python, images, folder, limit)
    except Exception as exc:  # noqa: BLE001 - the peer's rows say why, ours still run
        return None, str(exc)
    count = len(list(folder.glob("*.mds")))
    entry = {"folder": folder, "bytes": data.folder_bytes(folder, ".mds"), "shards": count, "samples": plan.images}
    return {**entry, "version": version}, None


def _ours_dataset(folder: Path) -> dict[str, Any]:
    from dali_pipes.bench.stream_rows import shard_bytes
    from dali_pipes.dataset.manifest import load_manifest

    manifest = load_manifest(folder)
    sizes = shard_bytes(folder, manifest)
    return {"folder": folder, "bytes": sum(sizes), "shards": len(sizes), "samples": manifest.num_samples}


def _run_row(
    workdir: Path,
    plan: ScaleOutPlan,
    port: int,
    kind: str,
    entry: dict[str, Any],
    nodes: int,
    reference: float,
    mds_python: str | None,
) -> dict[str, Any]:
    """One row: ``nodes`` simulated nodes reading ``entry``'s URL; its figures, or its error."""
    limit = max(1, int(entry["bytes"] * plan.cache_share))
    with tempfile.TemporaryDirectory(prefix=f"scale-out-{kind}-{nodes}-", dir=workdir) as tmp:
        base = {
            "kind": kind, "url": entry["url"], "cache_limit": limit, "batch_size": plan.batch_size,
            "epochs": plan.epochs, "out_size": plan.out_size, "seed": plan.seed, "nodes": nodes,
            "dump_at": time.time() + plan.row_timeout_s - 10,
        }  # fmt: skip
        python = mds_python if kind == "mds" else sys.executable
        try:
            results = _launch(Path(tmp), base, plan, port, python, plan.row_timeout_s)
        except Exception as exc:  # noqa: BLE001 - the row shows it, the others still run
            logs = workdir / f"logs-{kind}-{nodes}x{plan.ranks_per_node}"
            shutil.rmtree(logs, ignore_errors=True)
            shutil.copytree(tmp, logs, ignore=lambda _, names: [n for n in names if not n.endswith(".log")])
            log.warning("scale-out: %s on %d node(s) failed (the ranks' logs: %s): %s", kind, nodes, logs, exc)
            return {"error": str(exc)}
    return {"figures": row_figures(results, entry["bytes"], entry["samples"], reference), "cache_limit": limit}


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@contextlib.contextmanager
def _proxies(tmp: Path, port: int, nodes: int) -> Iterator[list[tuple[int, Path]]]:
    """One latency proxy per node in front of the server: ``[(its port, its count file)]``."""
    with contextlib.ExitStack() as stack:
        counts = [tmp / f"node{n}.count" for n in range(nodes)]
        yield [(stack.enter_context(latency_proxy(port, count)), count) for count in counts]


@contextlib.contextmanager
def _machines(tmp: Path, nodes: int, isolate: bool) -> Iterator[list[list[str]]]:
    """Per node, the command prefix that runs a rank on its own "machine": with ``isolate``, in a mount namespace
    of the node's own (``unshare``, as root) with a ``/dev/shm`` of its own, held by a process started here and
    ended on exit; else nothing (``[]``).

    MosaicML Streaming finds a node's ranks through ``/dev/shm`` names and lock files in the temporary folder, one
    node per machine: two simulated nodes sharing them collide (``FileExistsError: '/000001_locals'``)."""
    if not isolate:
        yield [[] for _ in range(nodes)]
        return
    holders = []
    try:
        for _ in range(nodes):
            script = "mount -t tmpfs -o size=2g tmpfs /dev/shm && echo ready && exec sleep 86400"
            holder = subprocess.Popen(
                ["unshare", "-m", "--propagation", "private", "sh", "-c", script], stdout=subprocess.PIPE, text=True
            )
            holders.append(holder)
            if (holder.stdout.readline() if holder.stdout else "").strip() != "ready":
                raise RuntimeError("could not give a simulated node a /dev/shm of its own (unshare -m needs root)")
        yield [["nsenter", "-t", str(holder.pid), "-m"] for holder in holders]
    finally:
        for holder in holders:
            holder.kill()
            holder.wait(timeout=10)


def _launch(tmp: Path, base: dict, plan: ScaleOutPlan, port: int, python: str, timeout: float) -> list[dict]:
    """Start the row's ranks (module docstring), wait for them, and return their results."""
    nodes, per_node, mds = base["nodes"], plan.ranks_per_node, base["kind"] == "mds"
    master = _free_port()
    with _proxies(tmp, port, nodes) as proxies, _machines(tmp, nodes, isolate=mds) as machines:
        processes = []
        for rank in range(nodes * per_node):
            node, local = divmod(rank, per_node)
            config = {**base, "folder": str(tmp / f"node{node}"), "count_file": str(proxies[node][1])}
            config.update(_endpoint(base["kind"], proxies[node][0]), out=str(tmp / f"rank{rank}.json"))
            (tmp / f"rank{rank}.config.json").write_text(json.dumps(config))
            env = _rank_env(rank, node, local, nodes, per_node, master, proxies[node][0])
            if mds:  # its lock files too, one temporary folder a node (see _machines)
                env["TMPDIR"] = str(tmp / f"node{node}.tmp")
                os.makedirs(env["TMPDIR"], exist_ok=True)
            log_file = open(tmp / f"rank{rank}.log", "wb")  # noqa: SIM115 - closed with the process below
            module = ["dali_pipes.bench.scale_out_mds", "rank"] if mds else ["dali_pipes.bench.scale_out_rank"]
            command = [*machines[node], python, "-m", *module, f"{tmp}/rank{rank}.config.json"]
            processes.append((subprocess.Popen(command, env=env, stdout=log_file, stderr=subprocess.STDOUT), log_file))
        _wait(processes, tmp, timeout)
    return [json.loads((tmp / f"rank{rank}.json").read_text()) for rank in range(len(processes))]


def _endpoint(kind: str, proxy: int) -> dict[str, Any]:
    """How a rank of ``kind`` reaches the server through its node's proxy (this package: storage options)."""
    return {} if kind == "mds" else {"storage_options": server_options(proxy)}


def _rank_env(rank: int, node: int, local: int, nodes: int, per_node: int, master: int, proxy: int) -> dict:
    """The environment torchrun gives a rank, plus the S3 endpoint and keys MosaicML Streaming reads."""
    env = dict(os.environ)
    env.update(
        RANK=str(rank), WORLD_SIZE=str(nodes * per_node), LOCAL_RANK=str(local), LOCAL_WORLD_SIZE=str(per_node),
        GROUP_RANK=str(node), GROUP_WORLD_SIZE=str(nodes), ROLE_RANK=str(rank), ROLE_WORLD_SIZE=str(nodes * per_node),
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(master), OMP_NUM_THREADS="1",
        S3_ENDPOINT_URL=f"http://127.0.0.1:{proxy}", AWS_ACCESS_KEY_ID="bench-key",
        AWS_SECRET_ACCESS_KEY="bench-secret", AWS_DEFAULT_REGION="eu-west-1",
    )  # fmt: skip
    return env


def _wait(processes: list[tuple[subprocess.Popen, Any]], tmp: Path, timeout: float) -> None:
    """Wait for every rank; on a failure or past ``timeout`` end the others and raise with the first error."""
    deadline = time.monotonic() + timeout
    try:
        while any(p.poll() is None for p, _ in processes):
            _raise_failed(processes, tmp)
            if time.monotonic() > deadline:
                raise RuntimeError(f"the ranks did not finish within {timeout:g} s (their stacks are in their logs)")
            time.sleep(0.2)
        _raise_failed(processes, tmp)
    finally:
        for process, log_file in processes:
            if process.poll() is None:
                process.kill()
                process.wait(timeout=30)
            log_file.close()


def _raise_failed(processes: list[tuple[subprocess.Popen, Any]], tmp: Path) -> None:
    """Raise the error of a rank that exited non-zero: one whose peers did not fail first, where known."""
    failed = [i for i, (p, _) in enumerate(processes) if p.returncode not in (None, 0)]
    if failed:
        lines = {i: _last_line(tmp, i) for i in failed}
        # A rank whose peer crashed ends with gloo's "Connection closed by peer": the peer's error is the one to show.
        first = next((i for i in failed if "closed by peer" not in lines[i]), failed[0])
        raise RuntimeError(f"rank {first} exited {processes[first][0].returncode}: {lines[first]}")


def _last_line(tmp: Path, rank: int) -> str:
    lines = (tmp / f"rank{rank}.log").read_text(errors="replace").strip().splitlines()
    return lines[-1] if lines else "(no output)"


def scale_out_report(workdir: Path | None, quick: bool, mds_python: str | None, json_out: Path | None) -> dict:
    """Run the suite (in ``workdir``, else a temporary folder) and write its JSON to ``json_out``; the report."""
    plan = ScaleOutPlan.quick() if quick else ScaleOutPlan()
    with contextlib.ExitStack() as stack:
        if workdir is None:
            workdir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="dali-pipes-scale-out-")))
        workdir.mkdir(parents=True, exist_ok=True)
        report = run_scale_out(workdir, plan, mds_python)
    if json_out is not None:
        json_out.write_text(json.dumps(report, indent=1, default=str))
    return report
