"""The GPU paths' arguments checked against DALI's own operator schemas, on any machine.

No GPU is needed: ``nvidia.dali.backend.GetSchema`` is the truth for what a
``mixed`` operator accepts, and a value it cannot hold would otherwise fail only
when a GPU pipeline is built.
"""

from __future__ import annotations

import itertools

import pytest
from nvidia.dali.backend import GetSchema
from nvidia.dali.types import DALIDataType

from dali_pipes.pipelines import DecoderHints
from dali_pipes.pipelines.config import INT32_MAX

# Every decoder the specs run as ``mixed`` on the GPU (ops.decode, decode_random_crop, decode_slice).
MIXED_DECODERS = ("decoders__Image", "decoders__ImageRandomCrop", "decoders__ImageSlice")
SIZE_HINTS = ("device_memory_padding", "host_memory_padding", "preallocate_width_hint", "preallocate_height_hint")


@pytest.mark.parametrize("schema", MIXED_DECODERS)
def test_every_hint_is_an_argument_of_the_mixed_decoders_with_its_type(schema):
    expected = {int: DALIDataType.INT32, float: DALIDataType.FLOAT, bool: DALIDataType.BOOL}
    for hints, region in itertools.product((DecoderHints(), DecoderHints.imagenet()), (False, True)):
        for name, value in hints.as_kwargs(region=region).items():
            # A wrong name or type would be refused by DALI only when the GPU pipeline is built.
            assert GetSchema(schema).GetArgumentType(name) == expected[type(value)], (schema, name)


@pytest.mark.parametrize("name", SIZE_HINTS)
def test_sizes_dali_cannot_hold_as_int32_are_refused_up_front(name):
    assert DecoderHints(**{name: INT32_MAX}).as_kwargs()[name] == INT32_MAX
    with pytest.raises(ValueError, match=rf"DecoderHints\.{name} must be an integer in \[0, 2147483647\]"):
        DecoderHints(**{name: INT32_MAX + 1})
    with pytest.raises(ValueError, match=rf"DecoderHints\.{name}"):
        DecoderHints(**{name: -1})


def test_fancy_upsampling_is_on_for_whole_image_gpu_decodes_and_off_for_region_decodes_by_default():
    # DALI's default for the mixed decoder is off, which makes GPU pixels differ from the CPU's; nvJPEG before 13.2
    # declines a region decode with it on, which then falls back to libjpeg-turbo on the CPU threads.
    assert GetSchema("decoders__Image").GetArgumentDefaultValueString("jpeg_fancy_upsampling") == "False"
    assert DecoderHints().as_kwargs()["jpeg_fancy_upsampling"] is True
    assert DecoderHints().as_kwargs(region=True)["jpeg_fancy_upsampling"] is False
    for forced in (True, False):
        for region in (False, True):
            assert (
                DecoderHints(jpeg_fancy_upsampling=forced).as_kwargs(region=region)["jpeg_fancy_upsampling"] is forced
            )
    with pytest.raises(ValueError, match="jpeg_fancy_upsampling must be True, False or None"):
        DecoderHints(jpeg_fancy_upsampling="yes")


def test_the_default_hardware_decoder_load_is_chosen_for_the_gpu_and_threads_and_never_below_dalis():
    from dali_pipes.pipelines.config import DALI_HW_DECODER_LOAD, HW_ONLY_MAX_THREADS

    # Our floor is DALI's own default, read from its schema rather than trusted.
    assert float(GetSchema("decoders__ImageRandomCrop").GetArgumentDefaultValueString("hw_decoder_load")) == (
        DALI_HW_DECODER_LOAD
    )
    auto = DecoderHints()
    assert auto.hw_decoder_load is None
    load, why = auto.chosen_load(threads=16, hw_decoder=True)
    assert load == 1.0 and "16 CPU threads" in why
    assert auto.chosen_load(threads=HW_ONLY_MAX_THREADS, hw_decoder=True)[0] == 1.0
    assert auto.chosen_load(threads=HW_ONLY_MAX_THREADS + 1, hw_decoder=True)[0] == DALI_HW_DECODER_LOAD
    load, why = auto.chosen_load(threads=4, hw_decoder=False)
    assert load == DALI_HW_DECODER_LOAD and "no hardware JPEG decoder" in why
    # A value given is kept, whatever the machine; the chosen one reaches DALI's arguments.
    assert DecoderHints(hw_decoder_load=0.3).chosen_load(threads=16, hw_decoder=True) == (0.3, "as given")
    assert auto.as_kwargs(load=1.0)["hw_decoder_load"] == 1.0
    assert auto.as_kwargs()["hw_decoder_load"] == DALI_HW_DECODER_LOAD
    assert DecoderHints.imagenet().hw_decoder_load is None


def test_the_plain_dali_anchor_keeps_dalis_default_load_where_ours_chooses_one():
    from dali_pipes.bench.anchor import as_plain_dali
    from dali_pipes.pipelines import ClassificationTrain

    assert as_plain_dali(ClassificationTrain()).decoder.hw_decoder_load == 0.65
    given = ClassificationTrain(decoder=DecoderHints(hw_decoder_load=1.0))
    assert as_plain_dali(given) is given
