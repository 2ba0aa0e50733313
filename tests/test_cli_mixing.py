"""``dali-pipes mixing``: on a dataset converted class by class, bigger windows put more classes in a batch."""

from __future__ import annotations

import json

from test_convert import run_cli  # noqa: E402 - shared helpers


def test_bigger_windows_mix_more_and_the_global_shuffle_is_last(tmp_path):
    images, shards = tmp_path / "images", tmp_path / "shards"
    run_cli("synth", images, "--num", "240", "--classes", "12", "--size", "16x16", "--workers", "1")
    # Class folders converted in their order (not the default shuffle): 24 shards of 10 samples, each of one class.
    run_cli("convert", "imagefolder", images, shards, "--samples-per-shard", "10", "--workers", "1", "--no-progress",
            "--order", "source")  # fmt: skip

    report = json.loads(run_cli("mixing", shards, "--windows", "1", "4", "24", "--batch-size", "16", "--json").stdout)
    assert (report["num_samples"], report["num_shards"], report["num_classes"]) == (240, 24, 12)
    rows = report["rows"]
    assert [r["window"] for r in rows] == [1, 4, 24, "global"]
    assert [r["shards_per_window"] for r in rows] == [1, 4, 24, 24]
    classes = [r["classes_per_batch"] for r in rows]
    entropy = [r["entropy_bits"] for r in rows]
    assert classes[0] < classes[1] < classes[2] and entropy[0] < entropy[1] < entropy[2], rows
    assert classes[0] <= 3  # a batch of 16 spans at most 3 one-class shards of 10
    assert classes[3] > classes[1] and all(r["batches"] == 15 for r in rows), rows
    assert report["max_entropy_bits"] == 4.0 and max(entropy) <= 4.0

    table = run_cli("mixing", shards, "--windows", "1", "4", "--batch-size", "16").stdout.splitlines()
    assert "240 samples in 24 shards, 12 classes of 'label'; batches of 16" in table[0], table
    assert table[1].split() == ["window", "shards", "samples", "classes/batch", "entropy", "(bits)"], table
    assert [line.split()[0] for line in table[2:]] == ["1", "4", "global"], table


def test_a_missing_field_is_one_line(tmp_path):
    images, shards = tmp_path / "images", tmp_path / "shards"
    run_cli("synth", images, "--num", "4", "--classes", "2", "--size", "16x16", "--workers", "1")
    run_cli("convert", "imagefolder", images, shards, "--workers", "1", "--no-progress")
    proc = run_cli("mixing", shards, "--field", "klass", check=False)
    assert proc.returncode != 0 and "Traceback" not in proc.stderr, proc.stderr
    assert "no field 'klass'" in proc.stderr and "--field" in proc.stderr, proc.stderr
    proc = run_cli("mixing", shards, "--windows", "0", check=False)
    assert proc.returncode != 0 and "--windows must be" in proc.stderr, proc.stderr
