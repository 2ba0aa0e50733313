"""``dtype="bfloat16"``: DALI has no such type, so the graph makes float32 and the loader casts on the output's device."""

from __future__ import annotations

import pytest
import torch

from dali_pipes import BatchFormat, ClassificationTrain, ClassificationVal, DALILoader, RunOptions

from loader_helpers import write_dataset


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    return write_dataset(tmp_path_factory.mktemp("bf16") / "ds", 12, samples_per_shard=6, image_shape=(40, 48))


def _batches(dataset, spec) -> list[dict]:
    run = RunOptions(device="cpu", py_num_workers=0)
    with DALILoader(dataset, spec, batch_size=5, run=run, batch_format=BatchFormat(with_index=True)) as loader:
        return list(loader)


@pytest.mark.parametrize("layout", ["NCHW", "NHWC"])
def test_bfloat16_is_the_float32_output_rounded_and_only_the_image_is_cast(dataset, layout):
    wide = _batches(dataset, ClassificationVal(size=32, resize=32, dtype="float32", layout=layout))
    narrow = _batches(dataset, ClassificationVal(size=32, resize=32, dtype="bfloat16", layout=layout))
    assert len(narrow) == len(wide) == 3
    for b16, b32 in zip(narrow, wide):
        assert b16["image"].dtype == torch.bfloat16 and b16["image"].shape == b32["image"].shape
        assert torch.equal(b16["image"], b32["image"].to(torch.bfloat16))
        assert b16["label"].dtype == b32["label"].dtype and torch.equal(b16["index"], b32["index"])
    assert ClassificationTrain(dtype="bfloat16").output_casts == {"image": "bfloat16"}
    assert ClassificationTrain(dtype="float16").output_casts == {}


def test_an_unknown_dtype_names_the_choices():
    with pytest.raises(ValueError, match="bfloat16"):
        ClassificationTrain(dtype="float8")
