"""Price refresh through real boto3 clients: EC2 spot history from moto, the Pricing API stubbed
(moto does not implement it), and the shipped prices kept on any failure."""

from __future__ import annotations

import json
from datetime import UTC, datetime

import boto3
import pytest
from botocore.stub import ANY, Stubber
from moto import mock_aws

from rayscale.config import load_catalog
from rayscale.core.catalog import CapacityType
from rayscale.prices import refresh


def _price_list(usd: str) -> str:
    return json.dumps({"terms": {"OnDemand": {"T1": {"priceDimensions": {"D1": {"pricePerUnit": {"USD": usd}}}}}}})


def test_spot_from_ec2_history_and_on_demand_from_pricing_api() -> None:
    cat = load_catalog().subset(["mistral-7b"], ["a10g"])
    with mock_aws():
        ec2 = boto3.client("ec2", region_name="us-east-1")
        pricing = boto3.client("pricing", region_name="us-east-1")
        stub = Stubber(pricing)
        for it in cat.flavors["a10g"].instance_types:
            stub.add_response("get_products", {"PriceList": [_price_list("1.111" if it.name == "g5.xlarge" else "9.0")]},
                              {"ServiceCode": "AmazonEC2", "Filters": ANY, "MaxResults": 10})
        with stub:
            new, changes, errors = refresh(cat, "us-east-1", ec2, pricing, now=datetime(2026, 11, 21, tzinfo=UTC))
    assert not errors
    g5 = new.flavors["a10g"].instance("g5.xlarge")
    assert g5.on_demand_usd_per_h == 1.111 and g5.price_source == "refreshed: 2026-11-21 AWS Pricing API, us-east-1"
    # moto's spot history answers a placeholder price for every zone: the catalog takes what EC2 said.
    assert g5.spot_usd_per_h == pytest.approx(0.00001)
    assert new.price("a10g", "g5.xlarge", CapacityType.SPOT) == pytest.approx(0.00001)
    kinds = {(c.instance_type, c.capacity_type) for c in changes}
    assert ("g5.xlarge", "spot") in kinds and ("g5.xlarge", "on-demand") in kinds


def test_failures_keep_the_shipped_prices_and_say_why() -> None:
    cat = load_catalog().subset(["mistral-7b"], ["a10g"])
    pricing = boto3.client("pricing", region_name="us-east-1", aws_access_key_id="x", aws_secret_access_key="x")
    stub = Stubber(pricing)
    stub.add_client_error("get_products", "ThrottlingException", "slow down")
    stub.add_response("get_products", {"PriceList": []}, {"ServiceCode": "AmazonEC2", "Filters": ANY, "MaxResults": 10})
    with stub:
        new, _, errors = refresh(cat.subset(None, ["a10g"]), "us-east-1", None, pricing, spot=False)
    old = cat.flavors["a10g"].instance_types
    got = new.flavors["a10g"].instance_types
    assert got[0].on_demand_usd_per_h == old[0].on_demand_usd_per_h and got[0].price_source == old[0].price_source
    assert any("ThrottlingException" in e for e in errors)
    assert any("not in the price list" in e for e in errors)
