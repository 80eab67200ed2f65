"""Module flags: kernel forms still under trial, held as module attributes of ``kernels/triton`` until timed.

A flag is not a `Schedule` field (the tuner never sets one); the benchmark scripts set them by name for one
measurement ("scan.EARLY_GATE_ROW=0"). One parser for all of them, so that a typo is refused instead of
creating a new attribute that no kernel reads, and the default's code timed under the flag's name.
"""

from __future__ import annotations

import contextlib
import importlib
from types import ModuleType
from typing import Any, Iterator

PACKAGE = "rewy_tune.kernels.triton"


def flag_home(key: str, default_module: str = "vector_local") -> tuple[ModuleType, str]:
    """(module, attribute) that `key` ("module.NAME", or NAME of `default_module`) names; ValueError unless the
    module exists and already has that attribute."""
    module, _, name = key.rpartition(".")
    try:
        home = importlib.import_module(f"{PACKAGE}.{module or default_module}")
    except ImportError:
        home = None
    if home is None or not name or not hasattr(home, name):
        raise ValueError(f"{key!r} names no existing flag of a {PACKAGE} module (e.g. scan.EARLY_GATE_ROW)")
    return home, name


def parse_flag(item: str) -> tuple[str, int]:
    """"module.NAME=INT" checked (the flag exists, the value is an integer) into (key, value)."""
    key, eq, value = item.partition("=")
    try:
        if not eq or "." not in key:
            raise ValueError
        flag_home(key)
        return key, int(value)
    except ValueError:
        raise ValueError(f"{item!r}: expected MODULE.NAME=INT naming an existing flag of a {PACKAGE} module, "
                         "e.g. scan.EARLY_GATE_ROW=0") from None


@contextlib.contextmanager
def module_flags(flags: dict[str, Any], default_module: str = "vector_local") -> Iterator[None]:
    """Set flags (keys as `flag_home` reads them) for the duration; the old values come back after, error or not."""
    homes = {key: flag_home(key, default_module) for key in flags}
    old = {key: getattr(*home) for key, home in homes.items()}
    try:
        for key, value in flags.items():
            setattr(*homes[key], value)
        yield
    finally:
        for key, value in old.items():
            setattr(*homes[key], value)
