"""``flightcache.__all__`` is exactly what the package exposes (httpx's test_exported_members),
and the front door's arguments are the settings ``_config.Settings`` checks."""

from __future__ import annotations

import inspect
import types

import flightcache
from flightcache._config import Settings

DUNDERS = {"__version__"}  # private-looking names that are public on purpose


def _order(name: str) -> tuple[bool, str]:
    return (not name.isupper(), name)  # constants first, as ruff's isort-style sort


def test_all_is_sorted_without_duplicates() -> None:
    assert flightcache.__all__ == sorted(set(flightcache.__all__), key=_order)


def test_every_public_name_is_in_all() -> None:
    public = {
        name
        for name, value in vars(flightcache).items()
        if (not name.startswith("_") or name in DUNDERS)
        and not isinstance(value, types.ModuleType)  # subpackages, once imported
    }
    assert public == set(flightcache.__all__)


def test_every_name_in_all_resolves_and_star_import_gives_all() -> None:
    missing = [name for name in flightcache.__all__ if not hasattr(flightcache, name)]
    assert missing == []
    namespace: dict[str, object] = {}
    exec("from flightcache import *", namespace)
    assert set(namespace) - {"__builtins__"} == set(flightcache.__all__)


def test_exported_classes_come_from_the_package() -> None:
    for name in flightcache.__all__:
        value = getattr(flightcache, name)
        if isinstance(value, type):
            assert value.__module__.startswith("flightcache."), name


def test_the_constructor_takes_exactly_the_settings() -> None:
    """Every FlightCache argument is checked by Settings.from_args, in the same order and of
    the same kind (a front door added later is held to the same list)."""
    door = inspect.signature(flightcache.FlightCache.__init__).parameters
    settings = inspect.signature(Settings.from_args).parameters
    assert [(p.name, p.kind) for p in list(door.values())[1:]] == [
        (p.name, p.kind) for p in settings.values()
    ]
