"""Refreshing the catalog's prices from AWS: the Pricing API (on-demand) and EC2 spot price history.

Offline, or when a call fails, the shipped table stays in force and the failure is reported: a price
is never guessed. Every refreshed number says so in its ``price_source`` with the date and the API.
"""

from __future__ import annotations

import json
import statistics
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from rayscale.core.catalog import CapacityType, Catalog

# The Pricing API names regions by location; these are the ones the shipped flavors live in.
LOCATIONS = {
    "us-east-1": "US East (N. Virginia)",
    "us-east-2": "US East (Ohio)",
    "us-west-2": "US West (Oregon)",
    "eu-west-1": "EU (Ireland)",
}


@dataclass(frozen=True)
class PriceChange:
    flavor: str
    instance_type: str
    capacity_type: str
    old: float | None
    new: float
    source: str


def spot_prices(ec2: Any, instance_types: list[str], zones: list[str] | None = None) -> dict[str, dict[str, float]]:
    """Latest Linux spot price per instance type and zone (describe_spot_price_history, paginated)."""
    latest: dict[tuple[str, str], tuple[datetime, float]] = {}
    kwargs: dict[str, Any] = {"InstanceTypes": instance_types, "ProductDescriptions": ["Linux/UNIX"]}
    if zones:
        kwargs["Filters"] = [{"Name": "availability-zone", "Values": zones}]
    for page in ec2.get_paginator("describe_spot_price_history").paginate(**kwargs):
        for h in page.get("SpotPriceHistory", []):
            key = (h["InstanceType"], h["AvailabilityZone"])
            ts, price = h["Timestamp"], float(h["SpotPrice"])
            if key not in latest or ts > latest[key][0]:
                latest[key] = (ts, price)
    out: dict[str, dict[str, float]] = {}
    for (it, zone), (_, price) in latest.items():
        out.setdefault(it, {})[zone] = price
    return out


def on_demand_price(pricing: Any, instance_type: str, region: str) -> float | None:
    """Linux, shared tenancy, no pre-installed software, in ``region``: USD per hour (None if not listed)."""
    filters = [
        {"Type": "TERM_MATCH", "Field": k, "Value": v}
        for k, v in (("instanceType", instance_type), ("location", LOCATIONS.get(region, region)),
                     ("operatingSystem", "Linux"), ("tenancy", "Shared"), ("preInstalledSw", "NA"),
                     ("capacitystatus", "Used"))
    ]
    resp = pricing.get_products(ServiceCode="AmazonEC2", Filters=filters, MaxResults=10)
    for raw in resp.get("PriceList", []):
        item = json.loads(raw) if isinstance(raw, str) else raw
        for term in item.get("terms", {}).get("OnDemand", {}).values():
            for dim in term.get("priceDimensions", {}).values():
                usd = dim.get("pricePerUnit", {}).get("USD")
                if usd is not None and float(usd) > 0:
                    return float(usd)
    return None


def refresh(catalog: Catalog, region: str = "us-east-1", ec2: Any = None, pricing: Any = None,
            spot: bool = True, on_demand: bool = True, now: datetime | None = None,
            ) -> tuple[Catalog, list[PriceChange], list[str]]:
    """A catalog with refreshed prices, the changes, and the errors (the old price stays on error)."""
    day = (now or datetime.now(UTC)).strftime("%Y-%m-%d")
    changes: list[PriceChange] = []
    errors: list[str] = []
    flavors = dict(catalog.flavors)
    for name, fl in catalog.flavors.items():
        its = [it for it in fl.instance_types if not it.name.startswith("local-")]
        if not its:
            continue
        spots: dict[str, dict[str, float]] = {}
        if spot and ec2 is not None and CapacityType.SPOT in fl.capacity_types:
            try:
                spots = spot_prices(ec2, [it.name for it in its], [z for z in fl.zones if z != "local"] or None)
            except Exception as e:
                errors.append(f"{name}: spot price history: {e}")
        new_its = []
        for it in fl.instance_types:
            upd: dict[str, Any] = {}
            if it in its and on_demand and pricing is not None:
                try:
                    p = on_demand_price(pricing, it.name, region)
                    if p is None:
                        errors.append(f"{name}/{it.name}: not in the price list for {region}")
                    else:
                        upd["on_demand_usd_per_h"] = p
                        upd["price_source"] = f"refreshed: {day} AWS Pricing API, {region}"
                        changes.append(PriceChange(name, it.name, "on-demand", it.on_demand_usd_per_h, p,
                                                   upd["price_source"]))
                except Exception as e:
                    errors.append(f"{name}/{it.name}: pricing API: {e}")
            if spots.get(it.name):
                # The median over the flavor's zones: one zone's dip should not steer the whole plan.
                p = round(statistics.median(spots[it.name].values()), 5)
                upd["spot_usd_per_h"] = p
                changes.append(PriceChange(name, it.name, "spot", it.spot_usd_per_h, p,
                                           f"refreshed: {day} describe_spot_price_history, median of "
                                           f"{len(spots[it.name])} zones"))
            new_its.append(it.model_copy(update=upd) if upd else it)
        flavors[name] = fl.model_copy(update={"instance_types": new_its})
    return catalog.model_copy(update={"flavors": flavors}), changes, errors
