"""Gang shapes: TP stays in a node, PP spans nodes, one instance type per gang, cheapest fit wins."""

from __future__ import annotations

import pytest

from rayscale.config import load_catalog
from rayscale.core.catalog import CapacityType, Catalog, Parallelism
from rayscale.core.gangs import GangError, GangShape, choose_zone, gang_shape


@pytest.fixture(scope="module")
def cat() -> Catalog:
    return load_catalog()


def _with(cat: Catalog, model: str, flavor: str, tp: int, pp: int = 1) -> Catalog:
    m = cat.models[model]
    par = {**m.parallelism, flavor: Parallelism(tp=tp, pp=pp)}
    return cat.model_copy(update={"models": {**cat.models, model: m.model_copy(update={"parallelism": par})}})


@pytest.mark.parametrize(
    ("flavor", "tp", "pp", "expected"),
    [
        ("a10g", 1, 1, GangShape("g5.xlarge", 1, 1, 1, 1)),
        ("a10g", 4, 1, GangShape("g5.12xlarge", 1, 4, 4, 1)),  # never four g5.xlarge
        ("a10g", 2, 1, GangShape("g5.12xlarge", 1, 2, 2, 1, slots=2)),  # two TP=2 replicas share it
        ("a10g", 4, 2, GangShape("g5.12xlarge", 2, 4, 4, 2)),  # two g5.12xlarge cost less than one g5.48xlarge
        ("a10g", 8, 1, GangShape("g5.48xlarge", 1, 8, 8, 1)),
        ("a100", 8, 2, GangShape("p4d.24xlarge", 2, 8, 8, 2)),  # PP=2 x TP=8: two p4d.24xlarge
        ("a100", 4, 2, GangShape("p4d.24xlarge", 1, 8, 4, 2)),  # both stages fit one node
        ("inf2", 2, 1, GangShape("inf2.xlarge", 1, 1, 2, 1)),  # TP counts NeuronCores: 2 = one chip
        ("inf2", 8, 1, GangShape("inf2.48xlarge", 1, 4, 8, 1, slots=3)),
        ("trn1", 32, 1, GangShape("trn1.32xlarge", 1, 16, 32, 1)),
    ],
)
def test_gang_shapes(cat: Catalog, flavor: str, tp: int, pp: int, expected: GangShape) -> None:
    c = _with(cat, "mistral-7b", flavor, tp, pp)
    assert gang_shape(c, "mistral-7b", flavor) == expected


def test_tp_larger_than_any_node_is_an_error(cat: Catalog) -> None:
    c = _with(cat, "mistral-7b", "a10g", 16)
    with pytest.raises(GangError, match="tp=16 needs 16 devices in one node; largest a10g instance has 8"):
        gang_shape(c, "mistral-7b", "a10g")


def test_zone_choice_skips_backed_off_and_spreads(cat: Catalog) -> None:
    fl = cat.flavors["a10g"]
    od = CapacityType.ON_DEMAND
    assert choose_zone(fl, od, []) == "us-east-1a"
    assert choose_zone(fl, od, [("a10g", "us-east-1a", "on-demand")]) == "us-east-1b"
    # A back-off of spot capacity does not block on-demand.
    assert choose_zone(fl, od, [("a10g", "us-east-1a", "spot")]) == "us-east-1a"
    assert choose_zone(fl, od, [], taken={"us-east-1a": 2, "us-east-1b": 1}) == "us-east-1c"
    all_off = [("a10g", z, "on-demand") for z in fl.zones]
    assert choose_zone(fl, od, all_off) is None
