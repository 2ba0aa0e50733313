"""What the real training scripts ask of a DataLoader, found by running them with DALILoader swapped in (issue 37).

timm's ``train.py`` sets the epoch through ``hasattr(loader.batch_sampler, "set_epoch")`` before it
looks at ``loader.sampler``; torchvision's reference script hands its MixUp/CutMix over as a
``RandomChoice`` of them; timm's ``train.py`` builds a ``FastCollateMixup`` unless it runs with
``--no-prefetcher``. The scripts themselves are not in this repository: these tests ask the same
questions of the loader.
"""

from __future__ import annotations

import pytest

from dali_pipes import BatchFormat, DALILoader, RunOptions
from dali_pipes.loading.compat import _is_mixer

from loader_helpers import TinySpec, write_dataset


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_dataset(tmp_path_factory.mktemp("compat-scripts") / "ds", 10, samples_per_shard=5)


def test_the_epoch_is_set_as_timms_train_py_sets_it(tiny):
    """``loader.batch_sampler`` is there (None, as a DataLoader's without a BatchSampler): timm goes on to ``sampler``."""
    with DALILoader(tiny, TinySpec(), batch_size=4, run=RunOptions(device="cpu")) as loader:
        assert loader.batch_sampler is None
        # timm's train.py, _set_loader_epoch(loader, 5): the dataset first, then the batch sampler, else the sampler.
        assert not hasattr(loader.dataset, "set_epoch")
        assert not hasattr(loader.batch_sampler, "set_epoch")
        loader.sampler.set_epoch(5)
        assert loader.epoch == 5


class _Named:
    """A callable standing in for a mixing transform of the given class name."""

    def __init__(self, *transforms):
        self.transforms = list(transforms)

    def __call__(self, image, label):
        return image, label


def _named(name, *transforms):
    return type(name, (_Named,), {})(*transforms)


def test_torchvisions_random_choice_of_mixup_and_cutmix_is_seen_as_mixing():
    """``get_mixup_cutmix`` of torchvision's references returns ``RandomChoice([MixUp, CutMix])`` (v2) or of
    ``RandomMixUp``/``RandomCutMix`` (v1): a spec that mixes in its graph must refuse either."""
    for inner in ("MixUp", "CutMix", "RandomMixUp", "RandomCutMix", "RandomMixup", "RandomCutmix"):
        assert _is_mixer(_named("RandomChoice", _named(inner))), inner
        assert _is_mixer(_named(inner)), inner
    assert not _is_mixer(_named("RandomChoice", _named("RandomHorizontalFlip")))
    assert not _is_mixer(lambda image, label: (image, label))

    from dali_pipes import ClassificationTrain, Mix

    spec = ClassificationTrain(size=16, mix=Mix(mixup_alpha=0.8, num_classes=5))
    fmt = BatchFormat(keys=("image", "label"), transform=_named("RandomChoice", _named("MixUp"), _named("CutMix")))
    with pytest.raises(ValueError, match="mixes in the graph.*mix in one place"):
        fmt.check_spec(spec)


def test_fast_collate_mixup_is_refused_pointing_at_timms_no_prefetcher():
    """timm's train.py makes a FastCollateMixup in its prefetcher mode: the message says which flag gives a Mixup."""
    with pytest.raises(ValueError, match="FastCollateMixup.*--no-prefetcher"):
        BatchFormat(keys=("image", "label"), transform=_named("FastCollateMixup"))
