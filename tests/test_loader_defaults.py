"""What a loader does when not told: shuffle as the spec says, and a clear error for a spec class."""

from __future__ import annotations

import pytest

from dali_pipes import ClassificationTrain, ClassificationVal, DALILoader, DetectionVal

from loader_helpers import TinySpec, write_dataset


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    return write_dataset(tmp_path_factory.mktemp("defaults") / "ds", 24, samples_per_shard=8)


def _order(dataset, spec, **kwargs) -> list[int]:
    with DALILoader(dataset, spec, batch_size=6, device="cpu", py_num_workers=0, with_index=True, **kwargs) as it:
        return [int(i) for batch in it for i in batch["index"]]


def test_evaluation_specs_read_in_order_and_training_specs_shuffle_by_default(dataset):
    val = ClassificationVal(size=16, resize=16)
    assert DetectionVal.shuffle_by_default is False and ClassificationVal.shuffle_by_default is False
    assert _order(dataset, val) == list(range(24))
    train = _order(dataset, ClassificationTrain(size=16))
    assert sorted(train) == list(range(24)) and train != list(range(24))
    # A spec that does not say (a user's own) shuffles, as before; an explicit argument always wins.
    assert _order(dataset, TinySpec()) != list(range(24))
    assert _order(dataset, val, shuffle=True) != list(range(24))
    assert _order(dataset, ClassificationTrain(size=16), shuffle=False) == list(range(24))


def test_a_spec_class_instead_of_an_instance_says_to_pass_an_instance(dataset):
    with pytest.raises(TypeError, match=r"pass a pipeline spec instance, ClassificationTrain\(\), not the class"):
        DALILoader(dataset, ClassificationTrain, batch_size=4, device="cpu")
