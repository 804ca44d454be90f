"""CLI subcommands: one module per command group, each exposing ``register(subparsers)``.

``register`` only declares arguments (no heavy imports) so that ``rayscale plan`` starts fast;
each handler imports what it needs when it runs and returns an exit code.
"""

# Module names under rayscale.commands, in the order `rayscale --help` lists them.
COMMAND_MODULES: tuple[str, ...] = (
    "demo",
    "local",
    "serve",
    "plan",
    "simulate",
    "render",
    "prices",
    "controller",
)
