"""The tokenizer of a checkpoint directory."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def get_tokenizer(model: str | Path) -> Any:
    """``transformers``' tokenizer of ``model`` (its chat template included),
    or None for a directory without tokenizer files (token ids only)."""
    root = Path(model)
    if not any(
        (root / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json")
    ):
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(root))
