"""Message ids hashed in bulk are the reference XXH64's (what Spark's ``xxhash64`` computes),
and ids made in bulk are distinct version-4 UUIDs, as one made at a time is."""

from __future__ import annotations

import random
import uuid

import numpy as np
import pyarrow as pa
import xxhash

from engine.core.message import new_msg_ids
from engine.stamp.id_hash import xxh64

SEED = 42


def _reference(values: list[str | None]) -> list[int | None]:
    digests = [None if v is None else xxhash.xxh64_intdigest(v.encode(), SEED) for v in values]
    return [None if d is None else int(np.uint64(d).view(np.int64)) for d in digests]


def _random_ids(count: int, seed: int) -> list[str | None]:
    rng = random.Random(seed)
    letters = "AZaz09_.-:é€😀"

    def one() -> str:
        return "".join(rng.choice(letters) for _ in range(rng.randrange(140)))

    return [None if rng.random() < 0.02 else one() for _ in range(count)]


def test_every_length_hashes_as_the_reference_does() -> None:
    values = [("x" * n) for n in range(200)] + _random_ids(5_000, 1)
    assert xxh64(pa.array(values, pa.string()), SEED).to_pylist() == _reference(values)


def test_long_values_hash_as_the_reference_does() -> None:
    values = ["y" * 511, "z" * 512, "w" * 513, "v" * 100_000, "short"]
    assert xxh64(pa.array(values, pa.string()), SEED).to_pylist() == _reference(values)


def test_a_slice_and_chunks_hash_as_their_values() -> None:
    values = _random_ids(2_000, 2)
    sliced = pa.array(values, pa.string()).slice(37, 900)
    assert xxh64(sliced, SEED).to_pylist() == _reference(values[37:937])
    chunked = pa.chunked_array([pa.array(values[:500]), pa.array(values[500:])])
    assert xxh64(chunked, SEED).to_pylist() == _reference(values)


def test_no_ids_or_only_nulls() -> None:
    assert xxh64(pa.array([], pa.string()), SEED).to_pylist() == []
    assert xxh64(pa.nulls(3), SEED).to_pylist() == [None, None, None]


def test_ids_made_in_bulk_are_distinct_uuids() -> None:
    ids = new_msg_ids(50_000).to_pylist()
    assert len(set(ids)) == len(ids)
    for made in ids[:2_000]:
        parsed = uuid.UUID(made)
        assert parsed.version == 4 and parsed.variant == uuid.RFC_4122
        assert parsed.hex.upper() == made
    assert new_msg_ids(0).to_pylist() == []
