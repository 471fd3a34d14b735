"""The plugin's version, and the versions of what it runs on (for ``dynatrain --version``).

The version is the installed distribution's (``importlib.metadata``); a source tree that is on
``sys.path`` without being installed reads it from its ``pyproject.toml``. Nothing here imports
torch or DeepSpeed: their versions are read from their metadata too.
"""

from __future__ import annotations

import os
import re
import sys
from importlib import metadata
from typing import Optional

DISTRIBUTION = "ds_dynatrain"
UNKNOWN = "0+unknown"


def _source_tree_version(pyproject: str) -> Optional[str]:
    """The ``version`` of the ``[project]`` table of ``pyproject`` (a TOML file), or None when
    the file is missing or names another project."""
    try:
        with open(pyproject, encoding="utf-8") as f:
            text = f.read()
    except OSError:
        return None
    table = re.search(r"^\[project\]\s*$(.*?)(?=^\[|\Z)", text, re.M | re.S)
    if table is None or not re.search(rf'^name\s*=\s*"{DISTRIBUTION}"\s*$', table.group(1), re.M):
        return None
    found = re.search(r'^version\s*=\s*"([^"]+)"\s*$', table.group(1), re.M)
    return found.group(1) if found else None


def package_version() -> str:
    """This package's version string (PEP 440): the installed distribution's, else the source
    tree's ``pyproject.toml``, else ``"0+unknown"``."""
    try:
        return metadata.version(DISTRIBUTION)
    except metadata.PackageNotFoundError:
        pass
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    return _source_tree_version(os.path.join(root, "pyproject.toml")) or UNKNOWN


def installed_version(distribution: str) -> Optional[str]:
    """The installed version of ``distribution`` from its metadata (no import), or None."""
    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return None


def version_line() -> str:
    """One line: this package's version and those of torch, DeepSpeed and Python
    (``dynatrain 0.1.0 (torch 2.13.0+cpu, deepspeed 0.19.8, Python 3.11.7)``)."""
    deps = ", ".join(f"{name} {installed_version(name) or 'not installed'}" for name in ("torch", "deepspeed"))
    python = ".".join(map(str, sys.version_info[:3]))
    return f"dynatrain {package_version()} ({deps}, Python {python})"
