"""``serve run kvpage.entrypoints.cli.ray_app:app_builder``: the Ray Serve application from Serve's own tools.

``app_builder(args)`` serves ``serve run`` and Serve config files (``docs/ray-serve.yaml``):
``args`` holds ``kvpage serve``'s flags by name (``block_size: 16``, ``replicas: 2``,
``router: prefix``; a bare flag takes ``true``/``false``), parsed by the very same argument
parser as ``kvpage serve``. Nothing in kvpage imports this module: it is an entry point.
"""
from __future__ import annotations

import dataclasses
from typing import Any

from kvpage.entrypoints.cli.main import build_parser
from kvpage.entrypoints.cli.serve import config_from_args, model_of


def _argv(args: dict) -> list[str]:
    argv = ["serve"]
    for name, value in args.items():
        flag = "--" + str(name).replace("_", "-")
        if name == "model":
            argv.append(str(value))
        elif value is True or str(value).lower() == "true":
            argv.append(flag)
        elif value is False or str(value).lower() == "false":
            argv.append("--no-" + flag[2:])
        elif isinstance(value, (list, tuple)):
            argv += [flag, *map(str, value)]
        else:
            argv += [flag, str(value)]
    return argv


def app_builder(args: dict) -> Any:
    """``serve run kvpage.entrypoints.cli.ray_app:app_builder model=PATH replicas=2 ...`` (see the module docstring)."""
    from kvpage.entrypoints.ray_serve.app import app_from_args  # Ray loads here, not at import

    parsed = build_parser().parse_args(_argv(args))
    model = model_of(parsed)
    engine = dataclasses.asdict(config_from_args(parsed))
    return app_from_args(parsed, model, engine)
