"""The ImageNet-style DDP example trains under torchrun on CPU (gloo), and resumes from its checkpoint."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from converters.runner import convert
from converters.sources import ImageFolderSource
from converters.synth import make_imagefolder

from loader_helpers import run_module_on_cpu

NUM_IMAGES = 50


@pytest.fixture(scope="module")
def tiny_dataset(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("example")
    images = make_imagefolder(root / "images", NUM_IMAGES, size=(96, 72), classes=3, seed=1)
    convert(ImageFolderSource(images), root / "shards", format="lmdb", workers=1, progress=False)
    return root / "shards"


def _torchrun(*args: str) -> str:
    torchrun = Path(sys.executable).with_name("torchrun")
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [str(torchrun), "--standalone", "--nproc_per_node=2", "-m", "dali_pipes.examples.train_imagenet", *args],
        capture_output=True,
        text=True,
        timeout=240,
        env=env,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


@pytest.mark.driver_init  # torchrun's ranks then spawn their DALI workers
@pytest.mark.timeout(600)
def test_ddp_example_trains_every_sample_once_per_epoch_and_resumes(tiny_dataset, tmp_path):
    checkpoint = tmp_path / "ckpt.pt"
    common = [str(tiny_dataset), "--batch-size", "8", "--size", "32", "--checkpoint", str(checkpoint)]
    out = _torchrun(*common, "--epochs", "2")
    epochs = re.findall(r"^epoch (\d+): (\d+) samples, loss ([\d.]+)", out, re.M)
    assert [(e, int(n)) for e, n, _ in epochs] == [("0", NUM_IMAGES), ("1", NUM_IMAGES)], out
    assert all(float(loss) > 0 for _, _, loss in epochs)
    assert checkpoint.exists()

    resumed = _torchrun(*common, "--epochs", "3", "--resume")
    assert re.findall(r"^epoch (\d+): (\d+) samples", resumed, re.M) == [("2", str(NUM_IMAGES))], resumed


@pytest.mark.timeout(600)
def test_multi_node_torchrun_two_nodes_on_loopback(tiny_dataset):
    # Two torchrun "nodes" of one process each, meeting at a rendezvous on 127.0.0.1, as two
    # machines sharing a filesystem would: together they cover the epoch exactly once.
    from loader_helpers import free_port

    port = free_port()  # held for this process: no other test's job is handed it before node 0 binds it
    torchrun = Path(sys.executable).with_name("torchrun")
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1"}
    nodes = [
        subprocess.Popen(
            [
                str(torchrun),
                "--nnodes=2",
                "--nproc_per_node=1",
                f"--node_rank={rank}",
                "--master_addr=127.0.0.1",
                f"--master_port={port}",
                "-m",
                "dali_pipes.examples.train_imagenet",
                str(tiny_dataset),
                "--epochs",
                "1",
                "--batch-size",
                "8",
                "--size",
                "32",
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        for rank in (0, 1)
    ]
    try:
        outputs = [node.communicate(timeout=240) for node in nodes]
    finally:
        for node in nodes:  # a node left waiting at the rendezvous must not outlive the test
            if node.poll() is None:
                node.kill()
    for node, (out, err) in zip(nodes, outputs):
        assert node.returncode == 0, out + err
    assert re.findall(r"^epoch 0: (\d+) samples.* on (\d+) process", outputs[0][0], re.M) == [(str(NUM_IMAGES), "2")]
    for rank, (out, _) in enumerate(outputs):  # every rank says it started and finished, not only rank 0
        assert re.search(rf"^rank {rank} of 2: \d+ batches of 8 per epoch on cpu$", out, re.M), out
        assert f"rank {rank} of 2: done" in out, out


@pytest.mark.timeout(300)
def test_the_recipe_flags_train_with_soft_targets_and_a_rising_resolution(tiny_dataset, capsys):
    from dali_pipes.examples.train_imagenet import parse_args, train_spec

    flags = ["--mixup", "0.8", "--cutmix", "1.0", "--erasing", "0.25", "--res-schedule", "32,64,0,1"]
    spec = train_spec(parse_args([str(tiny_dataset), *flags]))
    assert [spec.size_at(e) for e in (0, 1)] == [32, 64] and spec.mix.cutmix_alpha == 1.0 and spec.erasing.prob == 0.25
    proc = run_module_on_cpu(
        "dali_pipes.examples.train_imagenet", tiny_dataset, "--epochs", "2", "--batch-size", "8", *flags, timeout=240
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    epochs = re.findall(r"^epoch (\d+): (\d+) samples, loss ([\d.]+), at (\d+) px", proc.stdout, re.M)
    assert [(e, int(n), px) for e, n, _, px in epochs] == [("0", NUM_IMAGES, "32"), ("1", NUM_IMAGES, "64")], (
        proc.stdout
    )
    # The script's own flag parsing, in this process: a wrong schedule is argparse's usage error (exit 2).
    with pytest.raises(SystemExit) as bad:
        parse_args([str(tiny_dataset), "--res-schedule", "160,192"])
    assert bad.value.code == 2 and "MIN,MAX,START,END" in capsys.readouterr().err


def test_the_example_help_shows_every_default(capsys):
    from dali_pipes.examples.train_imagenet import parse_args

    with pytest.raises(SystemExit):
        parse_args(["--help"])
    shown = " ".join(capsys.readouterr().out.split())
    assert "per process (default: 64)" in shown and "(default: 0.1)" in shown and "(default: 224)" in shown


@pytest.fixture(scope="module")
def imbalanced_dataset(tmp_path_factory) -> Path:
    """40 images of class a, 10 of b, 2 of c."""
    from converters.synth import render

    root = tmp_path_factory.mktemp("imbalanced")
    for c, (name, count) in enumerate((("a", 40), ("b", 10), ("c", 2))):
        (root / "images" / name).mkdir(parents=True)
        for i in range(count):
            render(i * 3 + c, size=(48, 40), classes=3).save(root / "images" / name / f"{i}.jpg")
    # In the folder's order: the test draws sample indices and names their labels by it.
    convert(
        ImageFolderSource(root / "images"), root / "shards", format="lmdb", workers=1, progress=False, order="source"
    )
    return root / "shards"


def test_the_example_balances_classes_mixes_datasets_and_streams(
    imbalanced_dataset, tiny_dataset, capsys, tmp_path, monkeypatch
):
    import numpy as np

    from dali_pipes.examples.train_imagenet import data_source, main, parse_args

    dataset, sampling, _ = data_source(parse_args([str(imbalanced_dataset), "--balance-classes"]))
    labels = np.repeat([0, 1, 2], [40, 10, 2])
    drawn = labels[np.concatenate([sampling.order(52, epoch, 0) for epoch in range(200)])]
    assert np.allclose(np.bincount(drawn) / len(drawn), 1 / 3, atol=0.02)  # 40:10:2 in the data, 1:1:1 drawn

    mixture, none, _ = data_source(
        parse_args([str(imbalanced_dataset), "--mix-with", str(tiny_dataset), "--mix-share", "0.25"])
    )
    assert none is None and mixture.proportions == {"main": 0.75, "extra": 0.25}
    common = ["--epochs", "1", "--batch-size", "8", "--size", "32"]
    main([str(imbalanced_dataset), *common, "--mix-with", str(tiny_dataset), "--mix-labels", "offset"])
    main([str(imbalanced_dataset), *common, "--balance-classes"])
    monkeypatch.setenv("DALI_PIPES_CACHE", str(tmp_path / "cache"))
    main([str(imbalanced_dataset), *common, "--stream-cache", "0.001"])  # a local folder read through 1 MB
    assert any((tmp_path / "cache" / "stream").glob("*/shard-*"))
    out = capsys.readouterr().out
    assert re.findall(r"^epoch 0: (\d+) samples", out, re.M) == [str(52 + NUM_IMAGES), "52", "52"], out
    with pytest.raises(SystemExit):
        parse_args([str(imbalanced_dataset), "--balance-classes", "--mix-with", str(tiny_dataset)])
    assert "do not go together" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parse_args([str(imbalanced_dataset), "--stream-cache", "1", "--balance-classes"])
    assert "--stream-cache reads DATASET shard window by window, which --balance-classes" in capsys.readouterr().err
