import pytest
import torch
from transformers.models.qwen3_moe.modeling_qwen3_moe import apply_rotary_pos_emb

from vllm.model_executor.layers.rotary_embedding import RotaryEmbedding


def test_matches_transformers_rotation():
    torch.manual_seed(0)
    head, theta = 32, 1e6
    positions = torch.tensor([0, 1, 7, 300, 4095])
    q, k = torch.randn(5, 4, head), torch.randn(5, 2, head)
    ours_q, ours_k = RotaryEmbedding(head, theta, 4096)(positions, q, k)
    inv = 1.0 / theta ** (torch.arange(0, head, 2).float() / head)
    angles = torch.cat([positions[:, None] * inv] * 2, dim=-1)
    # transformers' layout: [batch, heads, tokens, head_size]
    their_q, their_k = apply_rotary_pos_emb(
        q.transpose(0, 1)[None],
        k.transpose(0, 1)[None],
        angles.cos()[None],
        angles.sin()[None],
    )
    torch.testing.assert_close(ours_q, their_q[0].transpose(0, 1))
    torch.testing.assert_close(ours_k, their_k[0].transpose(0, 1))
    assert torch.equal(ours_q[0], q[0])  # position 0 is not rotated
    with pytest.raises(ValueError, match="head_size: expected an even number"):
        RotaryEmbedding(31, theta, 4096)


def test_layers_share_one_angle_table():
    first, second = RotaryEmbedding(64, 1e6, 1024), RotaryEmbedding(64, 1e6, 1024)
    assert first.cos_sin.data_ptr() == second.cos_sin.data_ptr()
    assert RotaryEmbedding(64, 1e4, 1024).cos_sin.data_ptr() != first.cos_sin.data_ptr()
