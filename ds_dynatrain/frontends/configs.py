"""A DeepSpeed config in any form DeepSpeed accepts (a dict, a JSON file, a JSON string), read
without validating it, and its ``"dynatrain"`` section."""

from __future__ import annotations

import json
import os
from typing import Any, Optional

from ..config import SECTION


def parsed_config(config: Any) -> Optional[dict]:
    """A DeepSpeed config given as DeepSpeed accepts it (a dict, a JSON file path or a JSON
    string) as a dict, or None where it cannot be read (left to the initializer that will read it
    and name the problem)."""
    if isinstance(config, (str, os.PathLike)):
        text = os.fspath(config)
        try:
            if text.lstrip().startswith("{"):
                config = json.loads(text)
            else:
                with open(text) as f:
                    config = json.load(f)
        except (OSError, ValueError):
            return None
    return config if isinstance(config, dict) else None


def section_of(config: Any) -> Optional[Any]:
    """The ``"dynatrain"`` section of a DeepSpeed config (any form :func:`parsed_config` reads), or None."""
    parsed = parsed_config(config)
    return None if parsed is None else parsed.get(SECTION)
