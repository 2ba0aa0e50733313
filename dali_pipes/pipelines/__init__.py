"""DALI graph builders: small frozen specs that the loader turns into pipelines.

A spec names the dataset fields it reads (``required_fields``), says whether the
pipeline needs DALI conditionals (``needs_conditionals``) and adds its graph with
``build(inputs, device=...)`` inside the pipeline definition, on ``"gpu"``
(``mixed`` decoding, GPU operators) or ``"cpu"``.

- ``config``: the values specs are made of (:class:`ColorJitter`,
  :class:`DecoderHints`, ImageNet mean/std) and their validation;
- ``ops``: graph fragments (decode, resize, jitter, normalise, auto-augment);
- ``base``: the :class:`PipelineSpec` protocol and checks on ``build`` calls;
- ``classification``: :class:`ClassificationTrain` and :class:`ClassificationVal`;
- ``presets``: those two as torchvision's reference script and timm's ``train.py`` make them, from their flags;
- ``detection``: :class:`Detection` and :class:`DetectionVal` (COCO-style boxes);
- ``features``: :class:`Features` (fixed-shape arrays to the device);
- ``schedule``: :class:`ResolutionSchedule` (FFCV's progressive resizing), sizes by epoch;
- ``mixing``, ``erasing``: :class:`Mix` (MixUp/CutMix) and :class:`RandomErasing`, timm's
  semantics, their per-batch draws; ``batch_inputs``: those draws fed to the graph per batch;
  ``recipe_ops``: the graph fragments that apply them.
- ``instance_segmentation``: :class:`InstanceSegmentation` and :class:`InstanceSegmentationVal` (boxes and masks);
- ``semantic_segmentation``: :class:`SemanticSegmentation` and :class:`SemanticSegmentationVal` (label maps).
"""

from dali_pipes.pipelines.base import PipelineSpec
from dali_pipes.pipelines.classification import ClassificationTrain, ClassificationVal
from dali_pipes.pipelines.config import IMAGENET_MEAN, IMAGENET_STD, ColorJitter, DecoderHints
from dali_pipes.pipelines.detection import Detection, DetectionVal
from dali_pipes.pipelines.erasing import RandomErasing
from dali_pipes.pipelines.features import Features
from dali_pipes.pipelines.instance_segmentation import InstanceSegmentation, InstanceSegmentationVal
from dali_pipes.pipelines.mixing import Mix
from dali_pipes.pipelines.schedule import ResolutionSchedule
from dali_pipes.pipelines.semantic_segmentation import SemanticSegmentation, SemanticSegmentationVal

__all__ = [
    "ClassificationTrain",
    "ClassificationVal",
    "ColorJitter",
    "DecoderHints",
    "Detection",
    "DetectionVal",
    "Features",
    "IMAGENET_MEAN",
    "IMAGENET_STD",
    "InstanceSegmentation",
    "InstanceSegmentationVal",
    "Mix",
    "PipelineSpec",
    "RandomErasing",
    "ResolutionSchedule",
    "SemanticSegmentation",
    "SemanticSegmentationVal",
]
