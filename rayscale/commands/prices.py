"""`rayscale prices`: refresh on-demand and spot prices from AWS (boto3); offline the shipped table stays."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from rayscale.commands.plan import add_catalog_args


def register(sub: Any) -> None:
    p = sub.add_parser("prices", help="refresh prices from the AWS Pricing API and spot price history",
                       description="Print (and optionally write) the catalog's prices refreshed from AWS.")
    add_catalog_args(p)
    p.add_argument("--region", default="us-east-1")
    p.add_argument("--no-spot", action="store_true", help="skip describe_spot_price_history")
    p.add_argument("--no-on-demand", action="store_true", help="skip the Pricing API")
    p.add_argument("--write", metavar="FLAVORS_YAML", help="write the refreshed flavors file here")
    p.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    import json

    import yaml

    try:
        import boto3
    except ImportError as e:
        from rayscale.extras import missing_extra

        raise missing_extra("aws", "rayscale prices") from e

    from rayscale.config import load_catalog
    from rayscale.core.catalog import CatalogError
    from rayscale.prices import refresh
    from rayscale.tables import format_table

    try:
        cat = load_catalog(args.models, args.flavors, args.profiles)
        if args.only_flavors:
            cat = cat.subset(None, args.only_flavors)
    except CatalogError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    ec2 = None if args.no_spot else boto3.client("ec2", region_name=args.region)
    # The Pricing API is served from us-east-1 whatever region is priced.
    pricing = None if args.no_on_demand else boto3.client("pricing", region_name="us-east-1")
    new, changes, errors = refresh(cat, args.region, ec2, pricing, spot=not args.no_spot,
                                   on_demand=not args.no_on_demand)
    print(format_table(["flavor", "instance type", "capacity", "was $/h", "now $/h", "source"],
                       [[c.flavor, c.instance_type, c.capacity_type, "-" if c.old is None else f"{c.old:.4f}",
                         f"{c.new:.4f}", c.source] for c in changes]))
    for err in errors:
        print(f"kept the shipped price: {err}", file=sys.stderr)
    if args.write:
        data = {"spot_default_discount": new.spot_default_discount,
                "flavors": [json.loads(f.model_dump_json(exclude_none=True)) for f in new.flavors.values()]}
        with open(args.write, "w") as f:
            yaml.safe_dump(data, f, sort_keys=False)
        print(f"wrote {args.write}")
    return 0 if changes or not errors else 1
