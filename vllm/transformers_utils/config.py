"""``config.json`` of a local Hugging Face checkpoint, read without
``transformers``.

Hub configs and those written by ``transformers`` 5 spell some fields
differently; :func:`load_hf_config` returns one spelling of each:
``num_experts`` (5.x: ``num_local_experts``), ``rope_theta`` (5.x:
``rope_parameters.rope_theta``) and ``torch_dtype`` (5.x: ``dtype``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def load_hf_config(model: str | Path) -> dict[str, Any]:
    """The normalized ``config.json`` of checkpoint directory ``model``."""
    path = Path(model) / "config.json"
    if not path.is_file():
        raise ValueError(
            f"model: expected a checkpoint directory with config.json, got {model}"
        )
    config: dict[str, Any] = json.loads(path.read_text())
    if "num_experts" not in config and "num_local_experts" in config:
        config["num_experts"] = config["num_local_experts"]
    rope = config.get("rope_parameters") or {}
    if "rope_theta" not in config and "rope_theta" in rope:
        config["rope_theta"] = rope["rope_theta"]
    if rope.get("rope_type", "default") != "default" or config.get("rope_scaling"):
        raise ValueError(
            f"rope_parameters: only the default RoPE is supported, got "
            f"{rope or config.get('rope_scaling')}"
        )
    if "torch_dtype" not in config and "dtype" in config:
        config["torch_dtype"] = config["dtype"]
    return config
