"""`rayscale render`: write the Karpenter NodePools / EC2NodeClasses, the RayCluster / RayService and the
controller's manifests, generated from the flavor catalog (see rayscale.cluster.render)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from rayscale.commands.plan import add_catalog_args, catalog_from_args


def register(sub: Any) -> None:
    p = sub.add_parser("render", help="write Kubernetes manifests (NodePools, RayCluster/RayService, controller)",
                       description="Render nodepools/ and deployments/k8s/ from the flavor catalog; every "
                                   "manifest is validated against the CRD schemas, and every serve config (each "
                                   "serveConfigV2, each deployments/*.yaml) against Ray Serve's schema and "
                                   "rayscale's rules, before anything is written or compared.")
    add_catalog_args(p)
    p.add_argument("--out", default=".", help="directory to write nodepools/ and deployments/k8s/ into")
    p.add_argument("--serve-config", action="append", default=None,
                   help="serve config(s) for serveConfigV2 (default: deployments/*.yaml except local-*; "
                        "none: one generated from the catalog)")
    p.add_argument("--cluster-name", default="rayscale", help="EKS cluster name (discovery tags, node role)")
    p.add_argument("--namespace", default="rayscale")
    p.add_argument("--settings", default=None, metavar="FILE",
                   help="the controller's settings file, shipped in its ConfigMap (default: the shipped settings)")
    p.add_argument("--image", default="rayscale:0.1.0")
    p.add_argument("--neuron-image", default="rayscale:0.1.0-neuron")
    p.add_argument("--check", action="store_true", help="write nothing; exit 1 if a file under --out differs")
    p.add_argument("--no-validate", action="store_true",
                   help="skip validation (CRD schemas of every manifest; Ray Serve's schema and rayscale's rules "
                        "on every serve config rendered or shipped in deployments/)")
    p.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    import yaml

    from rayscale.cluster import crdschema
    from rayscale.cluster.render import (
        RenderSettings,
        check_serve_configs,
        default_serve_configs,
        render,
        shipped_serve_configs,
        stale,
        write,
    )
    from rayscale.core.catalog import CatalogError
    from rayscale.serve.config import ConfigError

    try:
        cat = catalog_from_args(args)
    except CatalogError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    serve = args.serve_config if args.serve_config is not None else [str(p) for p in default_serve_configs(".")]
    settings = RenderSettings(cluster_name=args.cluster_name, namespace=args.namespace, image=args.image,
                              settings_file=args.settings,
                              neuron_image=args.neuron_image, serve_configs=tuple(serve))
    try:
        files = render(cat, settings)
    except (ConfigError, CatalogError) as e:  # serve configs that cannot become one; a bad settings file
        print(f"invalid: {e}", file=sys.stderr)
        return 1
    if not args.no_validate:
        crds = crdschema.load_crds()
        errors = [str(err) for rel, text in files.items() for doc in yaml.safe_load_all(text) if doc
                  for err in crdschema.validate_all(doc, source=rel, crds=crds)]
        errors += check_serve_configs(files) + _shipped_serve_errors([*serve, *shipped_serve_configs(".")])
        if errors:
            for err in errors:
                print(f"invalid: {err}", file=sys.stderr)
            return 1
    if args.check:
        bad = stale(files, args.out)
        for rel in bad:
            print(f"stale: {rel} (run `rayscale render --out {args.out}`)", file=sys.stderr)
        return 1 if bad else 0
    for p in write(files, args.out):
        print(p)
    return 0


def _shipped_serve_errors(paths: list[str | Path]) -> list[str]:
    """Each serve config file checked as Ray Serve loads it, plus rayscale's rules; one message per file."""
    from rayscale.serve.config import ConfigError, load_serve_config

    errors = []
    for p in dict.fromkeys(str(x) for x in paths):
        try:
            load_serve_config(p)
        except ConfigError as e:
            errors.append(str(e))
    return errors
