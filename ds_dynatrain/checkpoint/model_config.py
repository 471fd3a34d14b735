"""The model's Hugging Face config, kept with each snapshot and written beside an export.

A ``transformers`` model carries its architecture in ``module.config`` (a ``PretrainedConfig``).
:meth:`~ds_dynatrain.engine.elastic_engine.ElasticEngine.save_checkpoint` stores it in the
model-state file as plain JSON data (the client state key :data:`MODEL_CONFIG_KEY`; the
serializer's allow-list needs nothing new), and ``dynatrain export`` writes it as
``config.json`` beside the safetensors file, so that the directory loads with
``from_pretrained`` without the training code at hand.
"""

from __future__ import annotations

import json
import os
from typing import Any, Optional

MODEL_CONFIG_KEY = "dynatrain_model_config"
CONFIG_FILE = "config.json"


def model_config_of(module: Any) -> Optional[dict]:
    """The Hugging Face config of ``module`` as a JSON object (every default included), or None
    when the module has no ``config`` with ``to_json_string``/``to_dict`` (not a ``transformers``
    model) or the config is not JSON data."""
    cfg = getattr(module, "config", None)
    try:
        if hasattr(cfg, "to_json_string"):
            out = json.loads(cfg.to_json_string(use_diff=False))
        elif hasattr(cfg, "to_dict"):
            out = json.loads(json.dumps(cfg.to_dict()))
        else:
            return None
    except (TypeError, ValueError):
        return None
    return out if isinstance(out, dict) else None


def with_model_config(client_state: Optional[dict], module: Any) -> dict:
    """``client_state`` with the module's config under :data:`MODEL_CONFIG_KEY` (unchanged when the
    module has none, or the caller's state names that key already)."""
    state = dict(client_state or {})
    cfg = model_config_of(module)
    if cfg is not None and MODEL_CONFIG_KEY not in state:
        state[MODEL_CONFIG_KEY] = cfg
    return state


def write_config_json(model_state: dict, out_dir: str) -> Optional[str]:
    """Write the config saved in ``model_state`` (a checkpoint's model-state dict) to
    ``out_dir/config.json``, whole or not at all (a temporary file renamed). Returns its path, or
    None when the checkpoint holds no config.

    Raises:
        OSError: the file cannot be written.
    """
    cfg = model_state.get(MODEL_CONFIG_KEY)
    if not isinstance(cfg, dict):
        return None
    path = os.path.join(out_dir, CONFIG_FILE)
    tmp = f"{path}.tmp-{os.getpid()}"
    try:
        with open(tmp, "w") as f:
            json.dump(cfg, f, indent=2, sort_keys=True)
            f.write("\n")
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise
    return path
