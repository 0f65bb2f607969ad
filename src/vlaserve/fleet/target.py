"""A `serve run` / KubeRay RayService target: `serve run vlaserve.fleet.target:app config=fleet.json`
(the config file of `vlaserve serve-ray`; its host, port, ray_address and robot_id_header are the
cluster's business there)."""

from __future__ import annotations


def app(args: dict):
    from ..cli import UsageError
    from .command import fleet_options
    from .replica import build

    cli = {"config": args["config"]} if "config" in args else {}
    try:
        options = fleet_options(cli)
    except UsageError as e:
        raise ValueError(str(e)) from None
    return build(options)
