"""``dali-pipes stage/inspect/verify`` on URLs, and secrets that never show: against moto's S3 server on 127.0.0.1."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import traceback

import pytest
from s3_helpers import ACCESS_KEY
from test_remote_stage import upload

from dali_pipes import RemoteError
from dali_pipes.cli.inspect import summarize
from dali_pipes.cli.verify import verify_dataset
from dali_pipes.remote.urls import redact
from dali_pipes.staging.stage import stage_dataset

from loader_helpers import sample_digests, shard_name, write_dataset

#: A recognisable secret, planted where users keep theirs and searched for everywhere afterwards.
CANARY = "CANARY-s3cr3t-7f1e9a0d42"


def cli(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "dali_pipes", *args], capture_output=True, text=True, env=env, timeout=120
    )


def s3_env(s3, secret: str = "testsecret") -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        AWS_ACCESS_KEY_ID=ACCESS_KEY,
        AWS_SECRET_ACCESS_KEY=secret,
        AWS_DEFAULT_REGION="eu-west-1",
        AWS_ENDPOINT_URL=s3.proxy.url,
        AWS_CONFIG_FILE=os.devnull,
        AWS_SHARED_CREDENTIALS_FILE=os.devnull,
    )
    return env


def assert_no_canary(seen: list[str], folder) -> None:
    """:data:`CANARY` is in none of the texts ``seen`` nor in any file below ``folder``; else show where."""
    seen = seen + [path.read_bytes().decode("latin-1") for path in folder.rglob("*") if path.is_file()]
    leaks = [text[max(0, text.find(CANARY) - 80) : text.find(CANARY) + 40] for text in seen if CANARY in text]
    assert not leaks, leaks


def upload_list(s3, imagenet_mini, folder, count: int, extra_lines: tuple[str, ...] = ()) -> tuple[str, list]:
    """``count`` photos and a list file of them (plus ``extra_lines``) in a new bucket: the list's URL, the rows."""
    from packed_helpers import photos

    (folder / "images").mkdir(parents=True)
    rows = photos(imagenet_mini)[:count]
    for key, image, _ in rows:
        (folder / "images" / f"{key}.jpg").write_bytes(image)
    lines = [f"{key} images/{key}.jpg {label}" for key, _, label in rows] + list(extra_lines)
    (folder / "train.txt").write_text("\n".join(lines) + "\n")
    bucket = s3.new_bucket()
    s3.fs().put(f"{folder}/", f"{bucket}/data/", recursive=True)
    return f"s3://{bucket}/data/train.txt", rows


def test_stage_inspect_and_verify_take_urls(tmp_path, s3):
    source = write_dataset(tmp_path / "src", 20, fmt="tfrecord")
    url = upload(s3, source)
    env = s3_env(s3)
    out = cli("inspect", url, env=env)
    assert out.returncode == 0, out.stderr
    assert f"dataset   {url}" in out.stdout and "samples   20 in 3 shard(s)" in out.stdout
    out = cli("verify", url, "--no-progress", env=env)
    assert out.returncode == 0 and f"{url}: OK: 3 shard(s), sizes and SHA-256 read remotely" in out.stdout, out.stderr
    out = cli("stage", url, str(tmp_path / "dest"), "--no-progress", "--workers", "3", env=env)
    assert out.returncode == 0, out.stderr
    assert sample_digests(tmp_path / "dest") == sample_digests(source)

    damaged = bytearray((source / shard_name("tfrecord", 1)).read_bytes())
    damaged[100] ^= 0xFF
    s3.fs().pipe_file(f"{url.removeprefix('s3://')}/{shard_name('tfrecord', 1)}", bytes(damaged))
    out = cli("verify", url, "--no-progress", env=env)
    assert out.returncode != 0 and f"{shard_name('tfrecord', 1)}: SHA-256 does not match" in out.stderr
    out = cli("inspect", "s3://no-such-bucket/ds", env=env)
    assert out.returncode != 0 and out.stderr.startswith(
        "dali-pipes: error: s3://no-such-bucket/ds/index.json: the bucket no-such-bucket does not exist"
    )  # as a conversion into it says
    out = cli("inspect", f"{url}/nope", env=env)  # a wrong path in a bucket that exists says which is wrong
    bucket = url.removeprefix("s3://").split("/")[0]
    assert out.returncode != 0 and out.stderr.startswith(
        f"dali-pipes: error: no index.json under {url}/nope (the bucket {bucket} exists): check the path"
    ), out.stderr


def test_redact_takes_out_url_passwords_queries_and_option_values():
    text = "https://user:hunter2222@host/x?X-Amz-Signature=abcdef123456&X-Amz-Credential=zz and tok=SASTOKEN123"
    shown = redact(
        text, {"sas_token": "SASTOKEN123", "anon": False, "client_kwargs": {"aws_session_token": "nested-TOKEN"}}
    )
    assert "hunter2222" not in shown and "abcdef123456" not in shown and "SASTOKEN123" not in shown
    assert shown.startswith("https://***@host/x?***")
    assert "nested-TOKEN" not in redact("x nested-TOKEN y", {"client_kwargs": {"aws_session_token": "nested-TOKEN"}})


def test_a_planted_secret_appears_in_no_file_log_output_or_error(tmp_path, s3, monkeypatch, caplog):
    caplog.set_level(logging.DEBUG, logger="dali_pipes")
    monkeypatch.setenv("DALI_PIPES_CACHE", str(tmp_path / "cache"))
    source = write_dataset(tmp_path / "src", 12, fmt="lmdb")
    url = upload(s3, source)
    options = {**s3.options, "secret": CANARY}
    seen: list[str] = []

    stage_dataset(url, tmp_path / "dest", storage_options=options, progress=False)
    seen.append(json.dumps(summarize(url, storage_options=options)))
    seen.append(str(verify_dataset(url, storage_options=options, progress=False)))
    s3.proxy.add("deny", method="GET", times=None)  # an error on the way: its message must not carry the secret
    with pytest.raises(RemoteError) as failure:
        stage_dataset(url, tmp_path / "other", storage_options=options, progress=False)
    seen.append(str(failure.value) + repr(failure.value))
    s3.proxy.clear()
    with pytest.raises(RemoteError) as failure:
        stage_dataset(f"s3://{CANARY.lower()}-no-bucket/ds", tmp_path / "x", storage_options=options, progress=False)
    seen.append(str(failure.value).replace(CANARY.lower(), ""))  # the bucket's own name is not the secret
    with pytest.raises(RemoteError) as failure:  # a password inside the URL, quoted back by the backend
        stage_dataset(f"s3://me:{CANARY}@bucket/ds", tmp_path / "y", storage_options=s3.options, progress=False)
    seen.append("".join(traceback.format_exception(failure.value)))

    env = s3_env(s3, secret=CANARY)
    for args in (("inspect", url), ("verify", url), ("stage", url, str(tmp_path / "cli")), ("inspect", "s3://nob/x")):
        out = cli("-v", *args, env=env)
        seen += [out.stdout, out.stderr]
    seen.append(caplog.text)
    assert_no_canary(seen, tmp_path)


def test_a_conversion_from_s3_shows_and_records_no_planted_secret(tmp_path, s3, imagenet_mini):
    """The secret key in the environment, and a password inside an input URL, appear in no file the conversion
    wrote (shards, manifest, errors.jsonl, job records), nor in what the command printed or logged, whether it
    converts (a listed image missing: left out, named) or fails (the URL with a password)."""
    env = s3_env(s3, secret=CANARY)
    listed, _ = upload_list(s3, imagenet_mini, tmp_path / "data", 6, ("gone images/gone.jpg 1",))
    out = tmp_path / "out"
    seen: list[str] = []
    for url in (listed, listed.replace("s3://", f"s3://me:{CANARY}@")):
        done = cli("-v", "convert", "list", url, str(out), "--format", "lmdb", "--on-error", "skip", env=env)
        seen += [done.stdout, done.stderr]
        assert (done.returncode == 0) == (CANARY not in url), done.stderr
    assert "gone.jpg" in (out / "errors.jsonl").read_text()  # the run did get as far as naming a left-out input
    assert json.loads((out / "index.json").read_text())["source"]["list_file"] == listed
    assert_no_canary(seen, tmp_path)


def test_input_storage_options_reach_the_workers_and_their_secret_shows_nowhere(tmp_path, s3, imagenet_mini):
    """Endpoint and keys of the input bucket given only as --input-storage-option (the environment names no S3
    server and holds no keys): the planning process and both spawned workers read the inputs with them."""
    from packed_helpers import assert_converted

    listed, rows = upload_list(s3, imagenet_mini, tmp_path / "data", 8)
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    env.update(AWS_CONFIG_FILE=os.devnull, AWS_SHARED_CREDENTIALS_FILE=os.devnull, AWS_EC2_METADATA_DISABLED="true")
    options = [f"endpoint_url={s3.proxy.url}", f"key={ACCESS_KEY}", f"secret={CANARY}"]
    options += ["client_kwargs.region_name=eu-west-1"]
    argv = ["-v", "convert", "list", listed, str(tmp_path / "out"), "--format", "lmdb"]
    argv += ["--workers", "2", "--samples-per-shard", "3", "--no-progress", "--order", "source"]  # rows in order
    done = cli(*argv, *[arg for option in options for arg in ("--input-storage-option", option)], env=env)
    assert done.returncode == 0, done.stderr
    assert_converted(tmp_path / "out", rows)
    misplaced = cli(*argv[:4], str(tmp_path / "other"), "--storage-option", f"endpoint_url={s3.proxy.url}", env=env)
    assert misplaced.returncode != 0 and "--input-storage-option" in misplaced.stderr  # not silently ignored
    assert_no_canary([done.stdout, done.stderr, misplaced.stdout, misplaced.stderr], tmp_path)


def test_the_log_filter_redacts_messages_and_tracebacks_once_and_leaves_bad_records_to_logging():
    import io

    from dali_pipes.remote.urls import RedactingFilter, redact_log_lines

    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    redact_log_lines(handler)
    redact_log_lines(handler)  # a second CLI call in the same process adds no second filter
    assert sum(isinstance(f, RedactingFilter) for f in handler.filters) == 1
    log = logging.getLogger("test-redacting")
    log.addHandler(handler)
    try:
        log.warning("%s: gone", "s3://me:pa55word-x@bucket/a.jpg?X-Amz-Signature=0123456789")
        try:
            raise OSError("cannot open gs://u:hunter2222@b/x")
        except OSError:
            log.exception("failed")
    finally:
        log.removeHandler(handler)
    text = stream.getvalue()
    assert "s3://***@bucket/a.jpg?*** gone" in text and "gs://***@b/x" in text  # a query runs to a space
    assert "pa55word" not in text and "hunter2222" not in text and "0123456789" not in text
    bad = logging.LogRecord("x", logging.WARNING, __file__, 1, "%d", ("not a number",), None)
    assert RedactingFilter().filter(bad) and bad.args == ("not a number",)  # left for logging's own report
    assert (
        redact("abfs://container@account.dfs.core.windows.net/x") == "abfs://container@account.dfs.core.windows.net/x"
    )


def test_recorded_source_descriptions_lose_url_passwords_and_queries_but_keep_local_paths():
    from converters.sources import ListFileSource

    signed = ListFileSource("s3://me:pa55word-x@bucket/train.txt?X-Amz-Signature=0123456789abcdef")
    assert signed.recorded()["list_file"] == "s3://***@bucket/train.txt?***"
    local = ListFileSource("/data/testsecret/train.txt")  # the environment's secret values are not searched for
    assert local.recorded() == local.describe()


def test_no_credentials_are_named_with_where_to_give_them(s3):
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    env.update(
        AWS_ENDPOINT_URL=s3.proxy.url,
        AWS_CONFIG_FILE=os.devnull,
        AWS_SHARED_CREDENTIALS_FILE=os.devnull,
        AWS_EC2_METADATA_DISABLED="true",  # no instance-metadata lookup (it would wait on the network)
        AWS_DEFAULT_REGION="eu-west-1",
    )
    out = cli("inspect", "s3://bucket/ds", env=env)
    assert out.returncode != 0
    assert out.stderr.startswith("dali-pipes: error: s3://bucket/ds/index.json: no credentials found")
    assert "AWS_ACCESS_KEY_ID" in out.stderr and "Traceback" not in out.stderr
    assert "anon=true" in out.stderr and not any(other in out.stderr for other in ("gcloud", "AZURE", "HF_TOKEN"))
    assert len(out.stderr) < 400, out.stderr  # S3's way only, not every cloud's
