"""A DeepSpeed config in any form DeepSpeed accepts (a dict, a JSON file, a JSON string), read
without validating it, and its ``"dynatrain"`` section (also in Accelerate's DeepSpeed plugins)."""

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


def sections(plugin) -> list:
    """The DeepSpeed plugins of Accelerate (one, or a dict of them) whose config has an enabled
    ``"dynatrain"`` section."""
    plugins = plugin.values() if isinstance(plugin, dict) else [plugin]
    found = []
    for p in plugins:
        cfg = getattr(p, "deepspeed_config", None) or getattr(getattr(p, "hf_ds_config", None), "config", None)
        if isinstance(cfg, dict) and SECTION in cfg and (cfg[SECTION] or {}).get("enabled", True) is not False:
            found.append(p)
    return found
