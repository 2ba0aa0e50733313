"""Property-based tests of the manifest parser: whatever JSON it is given, it builds a
manifest or raises :class:`ManifestError`, never anything else; valid manifests round-trip.

(The sampling functions already have their hypothesis properties in tests/test_sampling.py.)
"""

from __future__ import annotations

import json
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dali_pipes.manifest import BYTES_ENCODINGS, FORMATS, Field, Manifest, ManifestError, Shard, parse_manifest

json_scalars = st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8)
json_values = st.recursive(
    json_scalars,
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4),
    max_leaves=20,
)

names = st.text(min_size=1, max_size=8).filter(lambda s: "/" not in s)
fields = st.one_of(
    st.sampled_from(BYTES_ENCODINGS).map(lambda e: Field(kind="bytes", encoding=e)),
    st.builds(
        Field.array,
        st.sampled_from(["uint8", "int32", "int64", "float32", "float64", "bool"]),
        st.tuples(st.integers(-1, 8), *[st.integers(0, 8)] * 2).flatmap(lambda t: st.just(t[: 1 + t[1] % 3])),
    ),
)
hexdigests = st.text("0123456789abcdef", min_size=64, max_size=64)


@st.composite
def shard_lists(draw) -> list[Shard]:
    paths = draw(st.lists(st.text(min_size=1, max_size=12), min_size=1, max_size=5, unique=True))
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


@st.composite
def mutated(draw) -> Any:
    """A valid manifest's JSON with one value somewhere inside replaced, or one key removed."""
    data = draw(manifests).to_json()
    node: Any = data
    # Walk down a random path, then change what is there.
    while True:
        keys = list(node) if isinstance(node, dict) else list(range(len(node))) if isinstance(node, list) else []
        if not keys:
            break
        key = draw(st.sampled_from(keys))
        child = node[key]
        if isinstance(child, (dict, list)) and child and draw(st.booleans()):
            node = child
            continue
        if isinstance(node, dict) and draw(st.booleans()):
            del node[key]
        else:
            node[key] = draw(json_values | st.integers(-(2**70), 2**70))
        break
    return data


@settings(suppress_health_check=[HealthCheck.too_slow])
@given(mutated())
def test_mutated_manifests_parse_or_are_refused_and_what_parses_is_consistent(data):
    manifest = _parses_or_refuses(data)
    if manifest is not None:
        # Whatever is accepted is self-consistent: its counts add up, and it survives its own round trip.
        assert manifest.num_samples == sum(s.num_samples for s in manifest.shards)
        assert parse_manifest(json.loads(json.dumps(manifest.to_json()))) == manifest
