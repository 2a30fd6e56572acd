"""The GPU presets are the models they are named after: ``transformers``
builds each from its ``config.json`` (on the meta device: no memory) with
the published total and active parameter counts."""

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from vllm.benchmarks.presets import write_preset_config

# (total, active) parameters in billions, as Qwen publishes them
PUBLISHED = {"qwen3-30b-a3b": (30.5, 3.3), "qwen3-235b-a22b": (235.1, 22.1)}


@pytest.mark.parametrize("preset", sorted(PUBLISHED))
def test_preset_has_the_published_size(preset, tmp_path):
    config = AutoConfig.from_pretrained(write_preset_config(preset, tmp_path))
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    total = sum(p.numel() for p in model.parameters())
    experts = sum(
        p.numel() for name, p in model.named_parameters() if ".experts." in name
    )
    active = total - experts * (1 - config.num_experts_per_tok / config.num_experts)
    published_total, published_active = PUBLISHED[preset]
    assert total / 1e9 == pytest.approx(published_total, rel=0.01)
    assert active / 1e9 == pytest.approx(published_active, rel=0.02)
