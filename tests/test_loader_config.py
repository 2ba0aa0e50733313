"""``RunOptions`` and ``DataOptions``: a bad value is refused when the config is made, naming the field; the
configs are frozen, keep credentials out of their ``repr``, and a loader built with them really uses them."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest

from dali_pipes import BatchFormat, DALILoader, DataOptions, RunOptions, StreamOptions
from dali_pipes.settings import SETTINGS_KIND

from loader_helpers import TinySpec, write_dataset

SECRET = "CANARY-not-a-real-key"


@pytest.mark.parametrize(
    ("make", "error", "field"),
    [
        (lambda: RunOptions(device="tpu"), ValueError, "RunOptions.device"),
        (lambda: RunOptions(num_threads=0), ValueError, "RunOptions.num_threads"),
        (lambda: RunOptions(num_threads=2.5), ValueError, "RunOptions.num_threads"),
        (lambda: RunOptions(py_num_workers=-1), ValueError, "RunOptions.py_num_workers"),
        (lambda: RunOptions(prefetch=0), ValueError, "RunOptions.prefetch"),
        (lambda: RunOptions(rank=-1), ValueError, "RunOptions.rank"),
        (lambda: RunOptions(world_size=0), ValueError, "RunOptions.world_size"),
        (lambda: RunOptions(py_start_method="forkserver"), ValueError, "RunOptions.py_start_method"),
        (lambda: RunOptions(batch_reads="yes"), TypeError, "RunOptions.batch_reads"),
        (lambda: DataOptions(cache="disk"), ValueError, "DataOptions.cache"),
        (lambda: DataOptions(cache_bytes=5), ValueError, "DataOptions.cache_bytes"),
        (lambda: DataOptions(cache="ram", cache_bytes=-1), ValueError, "DataOptions.cache_bytes"),
        (lambda: DataOptions(cache="ram", cache_bytes="1G"), ValueError, "DataOptions.cache_bytes"),
        (lambda: DataOptions(storage_options="key=abc"), TypeError, "DataOptions.storage_options"),
    ],
    ids=lambda value: value if isinstance(value, str) else None,
)
def test_a_bad_value_is_refused_when_the_config_is_made_naming_the_field(make, error, field):
    with pytest.raises(error, match=field.replace(".", r"\.")):
        make()


def test_counts_are_kept_as_plain_ints():
    # numpy integers (a count read from an array or a config file) are taken and stored as int.
    run = RunOptions(num_threads=np.int64(3), py_num_workers=np.int32(0), rank=np.int64(1), world_size=2)
    assert (run.num_threads, run.py_num_workers, run.rank) == (3, 0, 1)
    assert all(type(value) is int for value in (run.num_threads, run.py_num_workers, run.rank))
    assert type(DataOptions(cache="ram", cache_bytes=np.int64(1 << 20)).cache_bytes) is int
    # As the RAM cache takes them: 0 caches nothing, a float such as 16e9 is a number of bytes.
    assert DataOptions(cache="ram", cache_bytes=0).cache_bytes == 0
    assert DataOptions(cache="ram", cache_bytes=16e9).cache_bytes == 16e9
    assert (
        RunOptions(batch_reads=np.bool_(False)).batch_reads is False and RunOptions(batch_reads=1).batch_reads is True
    )


@pytest.mark.parametrize(
    ("config", "field", "value"),
    [(RunOptions(), "num_threads", 2), (RunOptions(), "device", "cpu"), (DataOptions(), "cache", "ram")],
)
def test_the_configs_are_frozen(config, field, value):
    # One value may be shared by every loader of a script: none of them can change it for the others.
    with pytest.raises(dataclasses.FrozenInstanceError):
        setattr(config, field, value)
    assert dataclasses.replace(config, **{field: value}) != config  # a changed copy is how to vary one


def test_storage_options_never_show_in_the_repr():
    options = {"key": "AKIA-TEST", "secret": SECRET, "endpoint_url": "http://127.0.0.1:9"}
    data = DataOptions(stage_to="/tmp/x", storage_options=options)
    assert SECRET not in repr(data) and SECRET not in str(data) and "storage_options" not in repr(data)
    assert "stage_to='/tmp/x'" in repr(data)  # the rest still shows, for a log line or an error
    assert data.storage_options == options


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    return write_dataset(tmp_path_factory.mktemp("config") / "ds", 10)


@pytest.mark.timeout(120)
@pytest.mark.parametrize(("threads", "workers"), [(1, 0), (2, 1)])
def test_a_loader_uses_the_counts_its_run_options_give(dataset, threads, workers):
    run = RunOptions(device="cpu", num_threads=threads, py_num_workers=workers)
    with DALILoader(dataset, TinySpec(), batch_size=4, batch_format=BatchFormat(with_index=True), run=run) as loader:
        assert (loader.num_threads, loader.py_num_workers) == (threads, workers)
        assert len(loader.worker_pids) == workers
        assert loader.device == "cpu" and loader.with_index
        assert (loader.world.rank, loader.world.world_size) == (0, 1)
        assert loader.staged is None and loader.cache is None  # DataOptions() by default: read in place
        assert sorted(i for batch in loader for i in batch["index"][~batch["is_pad"]].tolist()) == list(range(10))


@pytest.mark.timeout(120)
def test_a_tuned_settings_files_reader_processes_read_a_streamed_dataset(dataset, tmp_path):
    """A settings file of ``dali-pipes tune`` chose reader processes: a streamed loader reads with them (issue 56
    item 2; they were left out before), by the pins of the loader's process, every sample once, within the limit."""
    tuned = tmp_path / "settings.json"
    tuned.write_text(
        json.dumps({"kind": SETTINGS_KIND, "version": 1, "loader": {"py_num_workers": 2, "num_threads": 2}})
    )
    data = DataOptions(stream=StreamOptions(cache_limit=1 << 20, folder=tmp_path / "cache"))
    run = RunOptions(device="cpu", settings=tuned)
    with DALILoader(
        dataset, TinySpec(), batch_size=4, batch_format=BatchFormat(with_index=True), run=run, data=data
    ) as loader:
        assert (loader.py_num_workers, loader.num_threads) == (2, 2) and len(loader.worker_pids) == 2
        assert sorted(i for batch in loader for i in batch["index"][~batch["is_pad"]].tolist()) == list(range(10))
        assert loader.cache.peak_bytes <= loader.cache.limit_bytes
        assert loader.store.board is not None  # read through the board, not in this process
