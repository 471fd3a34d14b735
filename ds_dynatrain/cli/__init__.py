"""The ``dynatrain`` command line (``python -m ds_dynatrain.cli`` runs it too)."""

from .main import build_parser, main

__all__ = ["main", "build_parser"]
