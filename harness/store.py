"""The config's keys and defaults (``Point``) as Hydra's structured-config schema: conf/config.yaml
starts from it (its first default), so that Hydra composes only known keys."""

from __future__ import annotations

from dataclasses import MISSING, field, fields, make_dataclass
from typing import Any

from harness.config import Point


def _schema(cls, name: str):
    """``cls``'s keys and defaults as a structured config whose values OmegaConf does not type
    (``Any``): the key set and the defaults are enforced at compose; the values by
    ``__post_init__``, per point."""
    specs = []
    for f in fields(cls):
        if f.default_factory is not MISSING:
            nested = _schema(f.default_factory, f.default_factory.__name__ + "Keys")
            specs.append((f.name, nested, field(default_factory=nested)))
        else:
            specs.append((f.name, Any, field(default=f.default)))
    return make_dataclass(name, specs)


SCHEMA = "mha_bench"  # conf/config.yaml's first default


def register() -> None:
    """Put the schema into Hydra's ConfigStore (before Hydra composes conf/config.yaml)."""
    from hydra.core.config_store import ConfigStore

    ConfigStore.instance().store(name=SCHEMA, node=_schema(Point, "PointKeys"))
