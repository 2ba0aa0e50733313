"""No secret in anything streaming says or writes (issue 54 item 2), against the loopback S3-protocol server.

A recognisable secret is planted in every place users keep one: a URL's ``user:password@``, the
``storage_options`` (``secret``, ``token``), and the environment that botocore and the redaction read
(``AWS_SECRET_ACCESS_KEY``, ``AWS_SESSION_TOKEN``). Then everything the code says is searched for each:
the messages of the errors raised and of their whole chains (``str`` and ``repr``), every record of the
``dali_pipes`` loggers at DEBUG, the repr of each public object (the options, the loader, its store,
streamer and cache), what was printed, and every file written under the cache base, by name and content.
``tests/test_streaming_faults.py`` checks the storage options' secret through retried and denied downloads.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Iterator

import pytest
from s3_helpers import ACCESS_KEY, options
from test_remote_stage import upload

from dali_pipes import BatchFormat, DALILoader, DataOptions, LoaderError, RunOptions, StreamOptions

from loader_helpers import TinySpec, write_dataset

URL_PASSWORD = "URLPASS-canary-0001"
OPTION_SECRET = "OPTSECRET-canary-0002"
OPTION_TOKEN = "OPTTOKEN-canary-0003"
ENV_SECRET = "ENVSECRET-canary-0004"
ENV_TOKEN = "ENVTOKEN-canary-0005"
CANARIES = (URL_PASSWORD, OPTION_SECRET, OPTION_TOKEN, ENV_SECRET, ENV_TOKEN)

SHARD = 12288  # every LMDB shard of 4 samples here: 3 pages
SHARDS = 6
RUN = RunOptions(device="cpu", py_num_workers=0)


def chain(error: BaseException | None) -> Iterator[BaseException]:
    """``error`` and every exception a traceback shows behind it (its cause, or its context unless suppressed)."""
    seen: set[int] = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        yield error
        error = error.__cause__ or (None if error.__suppress_context__ else error.__context__)


def said(error: BaseException | None, records: list[logging.LogRecord], base: Path, *extra: str) -> list[str]:
    """Everything shown or written: the error chain, the package's log records, ``extra`` texts, the files
    under ``base`` (their paths and their bytes)."""
    texts = [*extra]
    texts += [text for exc in chain(error) for text in (str(exc), repr(exc))]
    for record in records:
        if record.name.startswith("dali_pipes"):
            texts.append(record.getMessage())
            if record.exc_info:
                texts.append(logging.Formatter().formatException(record.exc_info))
    for path in base.rglob("*"):
        texts.append(str(path))
        if path.is_file():
            texts.append(path.read_bytes().decode("latin-1"))
    return texts


def leaks(texts: list[str]) -> list[tuple[str, str]]:
    return [(secret, text[:200]) for text in texts for secret in CANARIES if secret in text]


@pytest.fixture
def planted(tmp_path, monkeypatch, caplog) -> Path:
    """The environment's secrets planted, the cache base in ``tmp_path/base``, every package record kept."""
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", ENV_SECRET)
    monkeypatch.setenv("AWS_SESSION_TOKEN", ENV_TOKEN)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", ACCESS_KEY)
    for name in ("AWS_CONFIG_FILE", "AWS_SHARED_CREDENTIALS_FILE"):
        monkeypatch.setenv(name, "/dev/null")
    monkeypatch.setenv("DALI_PIPES_CACHE", str(tmp_path / "base"))
    caplog.set_level(logging.DEBUG, logger="dali_pipes")
    return tmp_path / "base"


def stream(url: str, storage_options: dict | None) -> DALILoader:
    # One loader of the dataset on the node: its windows may take the whole limit (4 of the 6 shards).
    data = DataOptions(stream=StreamOptions(cache_limit=4 * SHARD, loaders=1), storage_options=storage_options)
    return DALILoader(url, TinySpec(), batch_size=4, batch_format=BatchFormat(with_index=True), run=RUN, data=data)


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "url",
    [
        f"https://alice:{URL_PASSWORD}@data.example.com/train.h5",  # the issue's: a merged file, refused
        f"https://alice:{URL_PASSWORD}@data.example.com/ds",  # not a URL of object storage: a local path
        f"s3://alice:{URL_PASSWORD}@bucket/train.h5",
        f"s3://alice:{URL_PASSWORD}@bucket/ds",  # s3fs takes the userinfo for the bucket's name: it fails
    ],
)
def test_a_password_inside_the_url_shows_nowhere(planted, caplog, capsys, url):
    with pytest.raises((ValueError, OSError, LoaderError)) as refused:
        stream(url, {"endpoint_url": "http://127.0.0.1:9", "config_kwargs": {"retries": {"max_attempts": 1}}})
    assert "***@" in str(refused.value) or "alice" not in str(refused.value)  # the URL is named, redacted
    out = capsys.readouterr()
    assert not leaks(said(refused.value, caplog.records, planted, out.out, out.err))


@pytest.mark.timeout(90)
@pytest.mark.parametrize("credentials", ["options", pytest.param("environment", marks=pytest.mark.slow)])
def test_a_streamed_epoch_and_its_failure_show_and_write_no_secret(tmp_path, s3, planted, caplog, capsys, credentials):
    """The secret key in the storage options (with a token) or in the environment; the epoch read, a
    transient fault retried, a shard denied for good mid-epoch: the error, logs, reprs and files hold none of them."""
    source = write_dataset(tmp_path / "src", SHARDS * 4, fmt="lmdb", samples_per_shard=4)
    url = upload(s3, source)
    given = options(s3.proxy.url, secret=OPTION_SECRET, token=OPTION_TOKEN)
    if credentials == "environment":  # botocore reads AWS_* (the planted ones); the options name only the server
        given = {k: v for k, v in given.items() if k not in ("key", "secret", "token")}
    texts = [repr(StreamOptions(cache_limit=4 * SHARD, loaders=1)), repr(DataOptions(storage_options=given))]
    # The shard denied for good is dropped once first: retried (and logged) before it fails the epoch. A drop of any
    # shard raced the denial: in a clean-clone CI run the first GET was of a shard fetched ahead, and the denied
    # one, read first, failed the epoch before that drop's retry was logged.
    s3.proxy.add("drop", path=rf"/shard-{SHARDS - 1:05d}\.lmdb$", times=1)
    s3.proxy.add("deny", path=rf"/shard-{SHARDS - 1:05d}\.lmdb$", times=None)
    with stream(url, given) as loader:
        store = loader.store
        texts += [repr(loader), repr(store), repr(store.streamer), repr(store.streamer.cache)]
        with pytest.raises(LoaderError) as denied:
            list(loader)
        texts.append(repr(loader))
    retried = any("retrying" in r.getMessage() or "Retryable" in r.getMessage() for r in caplog.records)
    assert retried, f"no retry logged; the loader failed with: {denied.value}"
    # The start-up lines name the dataset by its URL, then the cache folder (item 17).
    folder = loader.store.root
    messages = [r.getMessage() for r in caplog.records]
    assert [m for m in messages if m.startswith(f"stream {url}: cache {folder}, limit")]
    assert [m for m in messages if m.startswith(f"DALILoader: {url} (cache {folder}): rank 0 of 1")]
    out = capsys.readouterr()
    assert not leaks(said(denied.value, caplog.records, planted, *texts, out.out, out.err))
