import pytest
import torch

from tests.v1.worker.test_model_runner import CONFIG
from vllm.model_executor.models.moe_decoder import (
    MoEDecoder,
    MoEDecoderConfig,
    MoEDecoderLayer,
    load_checkpoint,
    save_random_checkpoint,
)


def test_config_roundtrip(tmp_path):
    CONFIG.to_json(tmp_path / "config.json")
    assert MoEDecoderConfig.from_json(tmp_path / "config.json") == CONFIG


def test_checkpoint_loads_every_tensor(tmp_path, device):
    save_random_checkpoint(CONFIG, tmp_path, seed=3)
    weights = load_checkpoint(tmp_path)
    model = MoEDecoder(CONFIG, prefix="decoder.load", device=device)
    model.load_weights(weights.items())
    layer = model.layers[1]
    assert isinstance(layer, MoEDecoderLayer)
    expert = 5
    gate = weights[f"layers.1.mlp.experts.{expert}.gate_proj.weight"]
    up = weights[f"layers.1.mlp.experts.{expert}.up_proj.weight"]
    down = weights[f"layers.1.mlp.experts.{expert}.down_proj.weight"]
    w13, w2 = layer.experts.w13_weight, layer.experts.w2_weight
    assert w13 is not None and w2 is not None
    inter = CONFIG.intermediate_size
    assert torch.equal(w13[expert, :inter].cpu(), gate)
    assert torch.equal(w13[expert, inter:].cpu(), up)
    assert torch.equal(w2[expert].cpu(), down)
    assert torch.equal(layer.router.weight.cpu(), weights["layers.1.mlp.gate.weight"])


def test_checkpoint_names_are_checked(tmp_path, device):
    save_random_checkpoint(CONFIG, tmp_path, seed=4)
    model = MoEDecoder(CONFIG, prefix="decoder.bad", device=device)
    weights = load_checkpoint(tmp_path)
    with pytest.raises(ValueError, match="matches no parameter"):
        model.load_weights([("layers.0.mlp.shared.weight", torch.zeros(1))])
    bad = {"layers.0.mlp.experts.0.fused_proj.weight": weights["norm.weight"]}
    with pytest.raises(ValueError, match="unknown expert projection"):
        model.load_weights(bad.items())
    partial = {k: v for k, v in weights.items() if k != "lm_head.weight"}
    with pytest.raises(ValueError, match="lacks"):
        model.load_weights(partial.items())
