"""The storage suite's streaming rows (``s3 staged``, ``s3 stream cache=10%``) on a tiny dataset, for real.

A real moto S3 server behind the bench's latency proxy, real DALI loaders, real LMDB shards. Speed is
reported, never asserted: these tests check that the figures the rows report agree with each other
and with the dataset (the cache's bound, the ratio, the bytes before the first batch, the images
counted), and that a dataset whose shards a tenth cannot hold gets a row that says how to fix it.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from converters.runner import convert
from converters.sources import ImageFolderSource
from converters.synth import make_imagefolder

pytest.importorskip("moto.server", reason="the test extra's moto[server] is not installed")
pytest.importorskip("s3fs", reason="the test extra's s3fs is not installed")

SAMPLES, BATCH = 40, 4


def _shards(root: Path, per_shard: int) -> Path:
    images = make_imagefolder(root / "images", SAMPLES, size=(64, 48), classes=4, workers=1)
    out = root / "shards"
    convert(
        ImageFolderSource(images.resolve()), out, format="lmdb", samples_per_shard=per_shard, workers=1, progress=False
    )
    return out


def _inputs(dataset: Path):
    from dali_pipes.bench.inputs import bench_inputs

    return bench_inputs(dataset, batch_size=BATCH)


def _rows(inputs, later_epochs: int = 1, readers: tuple[int, ...] = (0,)):
    from dali_pipes.bench.stream_rows import s3_stream_rows
    from dali_pipes.bench.suites.stages import GraphPrefix

    return s3_stream_rows(inputs, GraphPrefix(inputs.spec, 0), 1, later_epochs, readers)


@pytest.mark.slow  # 13 s: the rows run twice over; the skip case below stays in the default suite
def test_staged_and_streamed_rows_report_consistent_figures(tmp_path):
    from dali_pipes.bench.stream_rows import STAGED, STREAM

    dataset = _shards(tmp_path, per_shard=1)  # 40 shards: a tenth holds 4 of them
    inputs = _inputs(dataset)
    rows = _rows(inputs, later_epochs=2, readers=(0, 2))  # issue 56: each pair with 0 and 2 reader processes
    assert [row.name for row in rows] == [STAGED, STREAM, f"{STAGED} workers=2", f"{STREAM} workers=2"]
    assert (STAGED, STREAM) == ("s3 staged", "s3 stream cache=10%")
    _check_pair(dataset, *rows[:2], workers=0)
    # Windows of a tenth of 40 one-sample shards hold fewer samples than 2 reader processes' batches: that row
    # says so and what to change; its staged row runs.
    assert rows[2].error is None and rows[2].timing is not None and "py_num_workers=2" in rows[2].description
    assert rows[3].timing is None and "RunOptions(py_num_workers=0)" in rows[3].error


def _check_pair(dataset: Path, staged, stream, workers: int) -> None:
    for row in (staged, stream):
        assert row.error is None and row.skipped is None, (row.name, row.error, row.skipped)
        assert row.extra["first_batch_s"] > 0 and row.extra["latency_ms"] == 30
        assert f"py_num_workers={workers}" in row.description

    # The cache's limit is a tenth of the shards' bytes, its largest shard the largest file, and the peak
    # the cache folder reached stays within the limit plus one shard.
    sizes = [p.stat().st_size for p in dataset.glob("shard-*.lmdb")]
    assert len(sizes) == SAMPLES
    extra = stream.extra
    assert extra["limit_bytes"] == int(sum(sizes) * 0.1) and extra["shard_bytes"] == max(sizes)
    assert 0 < extra["peak_bytes"] <= extra["limit_bytes"] + extra["shard_bytes"] and extra["peak_ok"] is True
    assert 0.0 <= extra["blocked_share"] <= 1.0  # of the steady seconds, the reading thread waited for downloads

    # The ratio is the streamed row's steady rate over the staged row's, the rate the table shows.
    assert extra["ratio"] == pytest.approx(stream.images_per_s / staged.images_per_s)

    # Staging copied the whole dataset before the first batch; streaming held a part of it in its cache.
    total = sum(p.stat().st_size for p in dataset.iterdir() if p.is_file())
    assert staged.extra["MB_at_first_batch"] == pytest.approx(total / 1e6, abs=0.01)
    assert 0 < stream.extra["MB_at_first_batch"] * 1e6 <= extra["limit_bytes"] + extra["shard_bytes"] + 1e4
    assert stream.extra["MB_at_first_batch"] < staged.extra["MB_at_first_batch"]

    # Steady windows: the staged row times the epochs after the first, the streamed row all but its first batch.
    assert staged.timing.images == 2 * SAMPLES
    assert stream.timing.images == (SAMPLES - BATCH) + 2 * SAMPLES


def test_a_cache_too_small_for_three_shards_skips_the_streamed_row_saying_how_to_fix_it(tmp_path):
    dataset = _shards(tmp_path, per_shard=10)  # 4 shards: a tenth of the dataset is less than one
    staged, stream = _rows(_inputs(dataset))
    assert staged.error is None and staged.timing is not None  # the staged row still runs
    assert stream.timing is None and stream.error is None
    assert "--samples-per-shard" in stream.skipped and "fewer than three of its largest shard" in stream.skipped


@pytest.mark.gpu  # .ci/gpu-run's storage step measures these rows at the GPU's rate; this checks they run there
def test_the_training_graph_streams_decoded_on_the_gpu_with_the_same_figures(tmp_path):
    from dali_pipes.bench.stream_rows import s3_stream_rows

    dataset = _shards(tmp_path, per_shard=1)
    inputs = _inputs(dataset)
    staged, stream = s3_stream_rows(inputs, inputs.spec, 1, 2, (0,), device="gpu")
    _check_pair(dataset, staged, stream, workers=0)
