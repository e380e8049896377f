"""The front end's and the engine core's feature mirrors stay identical, so stripped items resolve."""

from __future__ import annotations

import random

import pytest
import torch

from fastdeploy.core.mm_item import MMItem
from fastdeploy.engine.feature_mirror import FeatureMirror

KIB = 1024


def wire(name: str, rows: int) -> dict:
    features = torch.full((rows, 256), float(len(name) + rows))  # rows KiB of float32
    return MMItem("image", 0, rows, (1, 2, 2 * rows), name, features).to_wire()


def test_repeated_items_travel_without_features_and_resolve():
    rng = random.Random(0)
    front, core = FeatureMirror(8 * KIB / 2**30), FeatureMirror(8 * KIB / 2**30)
    sizes = {f"img{i}": rng.randint(1, 4) for i in range(8)} | {"huge": 9}  # huge never fits
    stripped = 0
    for _ in range(300):
        names = rng.sample(sorted(sizes), rng.randint(1, 3))
        sent = front.strip([wire(n, sizes[n]) for n in names])
        stripped += sum(w["features"] is None for w in sent)
        items = core.resolve(sent)
        for name, item in zip(names, items):
            assert torch.equal(item.features, MMItem.from_wire(wire(name, sizes[name])).features)
        assert list(front._entries) == list(core._entries)
    assert stripped > 100
    assert "huge" not in core._entries


def test_an_item_the_core_lacks_is_refused_not_crashed():
    core = FeatureMirror(1.0)
    lost = {**wire("x", 1), "features": None}
    with pytest.raises(ValueError, match="arrived without features"):
        core.resolve([lost])


def test_one_mirror_per_engine_core_with_data_parallelism():
    """Items routed to two engine cores: a front-end mirror per core keeps each pair in step; one mirror
    shared by both cores would strip features that the other core never received."""
    rng = random.Random(1)
    budget = 8 * KIB / 2**30
    fronts, cores = [FeatureMirror(budget) for _ in range(2)], [FeatureMirror(budget) for _ in range(2)]
    stripped = 0
    for _ in range(200):
        rank = rng.randrange(2)
        names = rng.sample([f"img{i}" for i in range(6)], 2)
        sent = fronts[rank].strip([wire(n, 2) for n in names])
        stripped += sum(w["features"] is None for w in sent)
        items = cores[rank].resolve(sent)
        for name, item in zip(names, items):
            assert torch.equal(item.features, MMItem.from_wire(wire(name, 2)).features)
        assert list(fronts[rank]._entries) == list(cores[rank]._entries)
    assert stripped > 50

    shared, cores = FeatureMirror(budget), [FeatureMirror(budget) for _ in range(2)]
    cores[0].resolve(shared.strip([wire("img0", 2)]))
    with pytest.raises(ValueError, match="arrived without features"):
        cores[1].resolve(shared.strip([wire("img0", 2)]))
