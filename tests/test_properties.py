"""Property-based tests of the manifest parser: whatever JSON it is given, it builds a
manifest or raises :class:`ManifestError`, never anything else; valid manifests round-trip.

(The sampling functions already have their hypothesis properties in tests/test_sampling.py.)
"""

from __future__ import annotations

import copy
import json
import math
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dali_pipes.dataset.manifest import (
    ARRAY_DTYPE_KINDS,
    BYTES_ENCODINGS,
    FORMATS,
    MAX_COUNT,
    Field,
    Manifest,
    ManifestError,
    Shard,
    load_manifest,
    parse_manifest,
)

json_scalars = st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8)
json_values = st.recursive(
    json_scalars,
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4),
    max_leaves=20,
)

# What a writer may name things: no '/', no NUL, not '.' or '..'.
names = st.text(min_size=1, max_size=8).filter(lambda s: "/" not in s and "\0" not in s and s not in (".", ".."))
dims = st.integers(1, 8)
fields = st.one_of(
    st.sampled_from(BYTES_ENCODINGS).map(lambda e: Field(kind="bytes", encoding=e)),
    st.builds(
        Field.array,
        st.sampled_from(
            ["uint8", "int8", "int16", "int32", "int64", "uint64", "float16", "float32", "float64", "complex64", "bool"]
        ),
        st.one_of(st.just(-1), dims).flatmap(lambda first: st.lists(dims, max_size=2).map(lambda rest: (first, *rest)))
        | st.just(()),
    ),
)
hexdigests = st.text("0123456789abcdef", min_size=64, max_size=64)
# Shard file names as the runner writes them, and odder ones that are still plain names in the folder.
# (None ends in ".idx", so no shard is named like another one's index.)
shard_paths = st.from_regex(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,11}", fullmatch=True).filter(
    lambda p: not p.endswith(".idx")
)


@st.composite
def shard_lists(draw) -> list[Shard]:
    paths = draw(st.lists(shard_paths, min_size=1, max_size=5, unique=True))
    shards = []
    for path in paths:
        indexed = draw(st.booleans())
        shards.append(
            Shard(
                path=path,
                num_samples=draw(st.integers(0, 10**6)),
                bytes=draw(st.integers(0, 10**12)),
                sha256=draw(hexdigests),
                index_path=path + ".idx" if indexed else None,
                index_sha256=draw(hexdigests) if indexed else None,
            )
        )
    return shards


manifests = st.builds(
    Manifest,
    format=st.sampled_from(FORMATS),
    fields=st.dictionaries(names, fields, min_size=1, max_size=4),
    shards=shard_lists().map(tuple),
    source=st.dictionaries(st.text(max_size=6), json_scalars, max_size=3),
    classes=st.none() | st.lists(st.text(max_size=6), max_size=5).map(tuple),
    extra=st.dictionaries(st.text(max_size=6), json_values, max_size=3),
    created_by=st.text(max_size=12),
)


def _parses_or_refuses(data: Any) -> Manifest | None:
    """``parse_manifest(data)``, with a refusal as None; any other exception fails the test."""
    try:
        return parse_manifest(data)
    except ManifestError as exc:
        assert str(exc), "a refusal must say why"
        return None


@given(json_values)
def test_any_json_value_parses_or_is_refused_with_a_manifest_error(data):
    _parses_or_refuses(data)


@given(manifests)
def test_valid_manifests_round_trip_through_json(manifest):
    text = json.dumps(manifest.to_json())
    assert parse_manifest(json.loads(text)) == manifest


# Values a damaged or hostile manifest may hold where a count, dtype, shape, path or name belongs.
nasty = st.sampled_from(
    [
        True,
        False,
        None,
        0,
        -1,
        1.0,
        1.5,
        2**63 - 1,
        2**63,
        -(2**63),
        2**64,
        10**30,
        "",
        "0",
        "1",
        ".",
        "..",
        "/",
        "/etc/passwd",
        "../x",
        "a\0b",
        "\0",
        "i4,i4",
        "[('a','i4')]",
        "(2,)i4",
        "O",
        "object",
        "S5",
        "U3",
        "V8",
        "M8[s]",
        "m8",
        "void",
        "float16",
        "uint8",
        "int64",
        "float128",
        [],
        {},
        [0],
        [-1],
        [-2],
        [1, -1],
        [0, 4],
        [2**62, 2**62],
        [True],
        [1.0],
        ["3"],
        {"kind": "array"},
        {"kind": "bytes", "encoding": 1},
        {"kind": "array", "dtype": "i4,i4", "shape": []},
        {"kind": "array", "dtype": "float32", "shape": [-1, 0]},
        "ab" * 32,
        "AB" * 32,
        "zz" * 32,
        "ab" * 31,
    ]
)


def _paths(node: Any, prefix: tuple = ()) -> list[tuple]:
    """The path (keys from the top) of every value inside a JSON document."""
    children = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else ()
    out = []
    for key, child in children:
        out.append((*prefix, key))
        out.extend(_paths(child, (*prefix, key)))
    return out


@st.composite
def mutated(draw) -> tuple[Manifest, Any]:
    """A valid manifest, and its JSON with a few values anywhere inside replaced, removed, added or copied.

    Half the time the top-level ``num_samples`` is then set to the sum of the shards' counts
    (whatever they have become), so that a bad count is not caught only by that sum.
    """
    manifest = draw(manifests)
    data = manifest.to_json()
    for _ in range(draw(st.integers(1, 3))):
        path = draw(st.sampled_from(_paths(data)))
        node: Any = data
        for key in path[:-1]:
            node = node[key]
        key = path[-1]
        action = draw(st.sampled_from(["replace", "replace", "delete", "add", "copy"]))
        if action == "delete" and isinstance(node, dict):
            del node[key]
        elif action == "add" and isinstance(node, dict):
            node[draw(st.text(max_size=6))] = draw(nasty | json_values)
        elif action == "copy":
            siblings = list(node.values()) if isinstance(node, dict) else node
            node[key] = copy.deepcopy(draw(st.sampled_from(siblings)))
        else:
            node[key] = draw(nasty | json_values | st.integers(-(2**70), 2**70))
    shards = data.get("shards")
    if draw(st.booleans()) and isinstance(shards, list) and all(isinstance(s, dict) for s in shards):
        counts = [s.get("num_samples") for s in shards]
        if all(isinstance(c, (int, float)) for c in counts):
            data["num_samples"] = sum(counts)
    return manifest, data


def _check_consistent(manifest: Manifest) -> None:
    """What the parser accepts is something every reader can use without another check."""
    assert manifest.num_samples == sum(s.num_samples for s in manifest.shards) <= MAX_COUNT
    assert manifest.shard_offsets[0] == 0 and manifest.shard_offsets[-1] == manifest.num_samples
    if manifest.num_samples:
        assert manifest.locate(manifest.num_samples - 1)[0] < len(manifest.shards)
    for shard in manifest.shards:
        assert type(shard.num_samples) is int and 0 <= shard.num_samples <= MAX_COUNT
        assert type(shard.bytes) is int and 0 <= shard.bytes <= MAX_COUNT
        assert isinstance(shard.path, str) and shard.path and "\0" not in shard.path
        assert len(shard.sha256) == 64 and (shard.index_path is None) == (shard.index_sha256 is None)
    for name, field in manifest.fields.items():
        assert name and "/" not in name
        if field.kind == "array":
            dtype = np.dtype(field.dtype)
            assert dtype.kind in ARRAY_DTYPE_KINDS and dtype.fields is None and dtype.subdtype is None
            assert all(type(d) is int for d in field.shape)
            assert all(d > 0 for d in field.shape[1:]) and (
                not field.shape or field.shape[0] == -1 or field.shape[0] > 0
            )
            assert math.prod(abs(d) for d in field.shape) * dtype.itemsize <= MAX_COUNT
        else:
            assert field.encoding in BYTES_ENCODINGS


@settings(suppress_health_check=[HealthCheck.too_slow], max_examples=300)
@given(mutated())
def test_mutated_manifests_parse_or_are_refused_and_what_parses_is_consistent(case):
    original, data = case
    manifest = _parses_or_refuses(data)
    if manifest is not None:
        _check_consistent(manifest)
        # It survives its own round trip, and a mutation that changed nothing gives the same manifest.
        assert parse_manifest(json.loads(json.dumps(manifest.to_json()))) == manifest
        if data == original.to_json():
            assert manifest == original


@settings(suppress_health_check=[HealthCheck.too_slow], max_examples=150, deadline=None)
@given(mutated())
def test_mutated_manifests_on_disk_load_or_are_refused(case):
    """Through the file, with the shard-path checks: only ManifestError, whatever the bytes."""
    _, data = case
    with tempfile.TemporaryDirectory() as folder:
        # allow_nan: NaN and Infinity are not JSON, but Python writes (and reads) them; the loader refuses them.
        (Path(folder) / "index.json").write_text(json.dumps(data, allow_nan=True), encoding="utf-8")
        try:
            manifest = load_manifest(folder)
        except ManifestError as exc:
            assert str(exc) and folder in str(exc), "a refusal must name the file"
            return
        _check_consistent(manifest)
        root = Path(folder).resolve()
        for shard in manifest.shards:
            assert root in (root / shard.path).resolve().parents


@pytest.mark.parametrize("constant", ["NaN", "Infinity", "-Infinity"])
def test_non_json_numbers_are_refused(constant):
    data = json.dumps(_small_manifest_json()).replace('"created_by": ""', f'"created_by": {constant}')
    assert constant in data
    with tempfile.TemporaryDirectory() as folder:
        (Path(folder) / "index.json").write_text(data)
        try:
            load_manifest(folder)
        except ManifestError as exc:
            assert "not valid JSON" in str(exc)
        else:
            raise AssertionError(f"{constant} was accepted in a manifest")


def _small_manifest_json() -> dict[str, Any]:
    """A small valid manifest's JSON, without hypothesis."""
    manifest = Manifest(
        format="lmdb",
        fields={"image": Field.image()},
        shards=(Shard("shard-00000.lmdb", 1, 10, "ab" * 32),),
        source={},
    )
    return manifest.to_json()
