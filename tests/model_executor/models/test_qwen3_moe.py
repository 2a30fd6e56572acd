"""Qwen3-MoE against ``transformers`` on the same random checkpoint: logits
(fp32, CPU) and greedy generation, plus the loader's errors."""

import itertools
import json
from typing import Any

import pytest
import torch

from tests.distributed.utils import (
    init_gloo_world,
    layout_group,
    run_workers,
    values,
)
from vllm.distributed import (
    GroupCoordinator,
    destroy_distributed_environment,
    get_ep_group,
    get_tp_group,
    initialize_model_parallel,
)
from vllm.forward_context import set_forward_context
from vllm.model_executor.kernels.grouped_gemm.w4a8 import dequantize_w4, quantize_w4
from vllm.model_executor.layers.attention import bind_kv_cache
from vllm.model_executor.layers.quantization.marlin import MarlinLinear
from vllm.model_executor.layers.quantization.utils.marlin_utils import (
    marlin_dequantize,
    marlin_quantize_and_repack,
)
from vllm.model_executor.model_loader import get_model
from vllm.model_executor.model_loader.tiny_checkpoint import build_tiny_checkpoint
from vllm.model_executor.model_loader.weight_utils import safetensors_weights_iterator
from vllm.model_executor.models.qwen3_moe import (
    Qwen3MoeAttention,
    Qwen3MoeForCausalLM,
)
from vllm.v1.attention.backends.torch_paged import PagedAttentionMetadata
from vllm.v1.core.block_pool import BlockPool
from vllm.v1.worker.workspace import init_workspace_manager, reset_workspace_manager

_prefixes = (f"qwen3_moe_test_{i}." for i in itertools.count())
PROMPTS = [[5, 17, 300, 2, 99, 41, 8], list(range(40, 73)), [7]]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen3_moe")
    return path, build_tiny_checkpoint(path, with_tokenizer=False)


def load(
    path,
    load_format="auto",
    dtype: str | torch.dtype = torch.float32,
    device="cpu",
    ep_group: GroupCoordinator | None = None,
    tp_group: GroupCoordinator | None = None,
) -> Qwen3MoeForCausalLM:
    model = get_model(
        path,
        load_format=load_format,
        dtype=dtype,
        device=device,
        prefix=next(_prefixes),
        ep_group=ep_group,
        tp_group=tp_group,
    )
    assert isinstance(model, Qwen3MoeForCausalLM)
    return model


def our_logits(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        tokens = torch.tensor(ids)
        return model.compute_logits(model(tokens, torch.arange(len(ids)))).float()


def hf_logits(hf, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0].float()


def test_logits_match_transformers(checkpoint):
    path, hf = checkpoint
    model = load(path)
    for ids in PROMPTS:
        ours, theirs = our_logits(model, ids), hf_logits(hf, ids)
        assert theirs.std() > 0.1  # a model whose logits say something
        assert (ours - theirs).abs().max() <= 1e-4


def test_greedy_generation_matches_transformers(checkpoint):
    """32 greedy tokens, token for token; a first difference is accepted only
    where transformers' own top-2 logits are within fp32 noise (a tie)."""
    path, hf = checkpoint
    model = load(path)
    for prompt in PROMPTS[:2]:
        with torch.no_grad():
            expected = hf.generate(
                torch.tensor([prompt]), max_new_tokens=32, do_sample=False
            )[0, len(prompt) :].tolist()
        ids = list(prompt)
        for step, want in enumerate(expected):
            got = int(our_logits(model, ids)[-1].argmax())
            if got != want:
                top2 = hf_logits(hf, ids)[-1].topk(2).values
                assert float(top2[0] - top2[1]) < 1e-4, (step, got, want)
                break
            ids.append(got)


def test_tied_embeddings_and_sharded_checkpoint(tmp_path):
    """A tied head (no lm_head tensor) from a checkpoint split over several
    safetensors files with an index."""
    hf = build_tiny_checkpoint(
        tmp_path,
        seed=1,
        max_shard_size="200KB",
        tie_word_embeddings=True,
        with_tokenizer=False,
    )
    assert (tmp_path / "model.safetensors.index.json").is_file()
    assert len(list(tmp_path.glob("*.safetensors"))) > 1
    model = load(tmp_path)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    ids = PROMPTS[0]
    assert (our_logits(model, ids) - hf_logits(hf, ids)).abs().max() <= 1e-4


def test_hub_spellings_of_the_config(checkpoint, tmp_path):
    """Hub configs say num_experts / rope_theta / torch_dtype where
    transformers 5 writes num_local_experts / rope_parameters / dtype."""
    path, hf = checkpoint
    config = json.loads((path / "config.json").read_text())
    theta = (config.get("rope_parameters") or {}).get("rope_theta", 1e6)
    for key in ("rope_parameters", "num_local_experts", "dtype"):
        config.pop(key, None)
    config |= {"num_experts": 16, "rope_theta": theta, "torch_dtype": "float16"}
    (tmp_path / "config.json").write_text(json.dumps(config))
    for f in path.glob("*.safetensors"):
        (tmp_path / f.name).symlink_to(f)
    ids = PROMPTS[0]
    assert load(tmp_path, dtype="auto").lm_head.weight.dtype == torch.float16
    model = load(tmp_path)
    assert (our_logits(model, ids) - hf_logits(hf, ids)).abs().max() <= 1e-4


def test_bad_checkpoints_are_named(checkpoint, tmp_path):
    path, _ = checkpoint
    model = load(path)
    weights = dict(safetensors_weights_iterator(path))
    name = "model.layers.0.self_attn.q_norm.weight"
    with pytest.raises(ValueError, match=f"missing \\['{name}'\\]"):
        model.load_weights((n, t) for n, t in weights.items() if n != name)
    with pytest.raises(
        ValueError, match=f"'{name}' expected shape \\[32\\], got \\[31\\]"
    ):
        model.load_weights([(name, torch.zeros(31))])
    with pytest.raises(ValueError, match=r"'model\.extra\.weight' is not a tensor"):
        model.load_weights([("model.extra.weight", torch.zeros(1))])
    expert_up = "model.layers.0.mlp.experts.5.up_proj.weight"
    with pytest.raises(ValueError, match=rf"'{expert_up}': loaded_weight: expected"):
        model.load_weights([(expert_up, torch.zeros(63, 128))])
    fresh = type(model)(model.config, dtype=torch.float32, prefix=next(_prefixes))
    expert = "model.layers.2.mlp.experts.3.up_proj.weight"
    with pytest.raises(ValueError, match=r"experts: 1 expert shards were not"):
        fresh.load_weights((n, t) for n, t in weights.items() if n != expert)
    config = json.loads((path / "config.json").read_text())
    (tmp_path / "config.json").write_text(
        json.dumps(config | {"architectures": ["MixtralForCausalLM"]})
    )
    with pytest.raises(ValueError, match=r"MixtralForCausalLM.*Qwen3MoeForCausalLM"):
        get_model(tmp_path, load_format="dummy")
    with pytest.raises(ValueError, match="load_format: expected one of"):
        get_model(path, load_format="pt")


def test_dummy_weights_have_the_checkpoints_shapes(checkpoint):
    path, _ = checkpoint
    model = load(path, load_format="dummy", dtype="bfloat16")
    real = {n: t.shape for n, t in safetensors_weights_iterator(path)}
    dummy = {n: torch.Size(s) for n, s, _ in model.checkpoint_shapes()}
    assert dummy == real
    logits = our_logits(model, PROMPTS[0])
    assert logits.shape == (7, 320) and logits.isfinite().all()


@pytest.mark.parametrize("load_format", ["auto", "dummy"])
def test_an_expert_parallel_rank_holds_and_loads_only_its_experts(
    checkpoint, load_format
):
    """Rank 1 of 2 (the group's layout only: nothing is exchanged while
    loading) holds experts 8..15 of 16, equal to those of the whole model:
    the checkpoint's and the dummy ones alike (drawn per tensor)."""
    path, _ = checkpoint
    group = layout_group("ep", [0, 1], 1)
    whole = load(path, load_format)
    shard = load(path, load_format, ep_group=group)
    names = [n for n, _, _ in shard.checkpoint_shapes()]
    experts = {int(n.split(".")[5]) for n in names if ".experts." in n}
    assert experts == set(range(8, 16))
    assert len(names) == len(list(whole.checkpoint_shapes())) - 3 * 8 * 3
    for mine, full in zip(shard.moe_layers(), whole.moe_layers(), strict=True):
        assert mine.ep_group is group
        assert mine.moe.placement.local_experts == range(8, 16)
        assert mine.w13_weight is not None and full.w13_weight is not None
        assert torch.equal(mine.w13_weight, full.w13_weight[8:])
        assert mine.w2_weight is not None and full.w2_weight is not None
        assert torch.equal(mine.w2_weight, full.w2_weight[8:])


def test_paged_steps_equal_full_recompute(checkpoint):
    """Chunked prefill and decode through the KV cache, two requests in one
    batch, give the logits of recomputing each whole sequence."""
    path, _ = checkpoint
    model = load(path)
    pool = BlockPool(num_blocks=8, block_size=16)
    bind_kv_cache(model, pool.num_blocks, pool.block_size)
    seqs = {"a": PROMPTS[1][:20], "b": PROMPTS[0]}
    for r, ids in seqs.items():
        pool.allocate(r, len(ids) + 2)
    # Step 1: a's first 12 tokens. Step 2: a's last 8 and all of b.
    # Steps 3-4: one decode token each (the argmax of the step before).
    steps = [[("a", 0, 12)], [("a", 12, 20), ("b", 0, 7)]]
    for step in range(4):
        chunks = (
            steps[step]
            if step < 2
            else [(r, len(seq) - 1, len(seq)) for r, seq in seqs.items()]
        )
        token_ids = torch.tensor([t for r, s, e in chunks for t in seqs[r][s:e]])
        positions = torch.cat([torch.arange(s, e) for _, s, e in chunks])
        meta = PagedAttentionMetadata.build(pool, chunks, "cpu")
        with torch.no_grad(), set_forward_context(meta):
            logits = model.compute_logits(model(token_ids, positions))
        ends = meta.query_start_loc[1:].long() - 1
        for (r, _, e), last in zip(chunks, logits[ends], strict=True):
            if e == len(seqs[r]):  # the request's whole sequence is cached
                full = our_logits(model, seqs[r])[-1]
                torch.testing.assert_close(last, full, rtol=0, atol=1e-4)
                if step >= 1:
                    seqs[r] = [*seqs[r], int(last.argmax())]


@pytest.mark.gpu
def test_bf16_on_the_gpu_stays_near_transformers(checkpoint):
    """bf16 on CUDA (our experts backend, e.g. the Hopper GEMMs) against
    transformers in bf16 on the same GPU: relative error of the logits
    under 5% per prompt (bf16 rounding through 4 layers; a near-tied route
    may flip) and the same greedy next token where transformers' top-2 gap
    is clear."""
    path, hf = checkpoint
    model = load(path, dtype="bfloat16", device="cuda")
    hf_bf16 = type(hf)(hf.config).to(device="cuda", dtype=torch.bfloat16).eval()
    hf_bf16.load_state_dict(hf.state_dict())
    for ids in PROMPTS:
        with torch.no_grad():
            tokens = torch.tensor(ids, device="cuda")
            ours = model.compute_logits(
                model(tokens, torch.arange(len(ids), device="cuda"))
            )
            theirs = hf_bf16(tokens[None]).logits[0]
        ours, theirs = ours.float().cpu(), theirs.float().cpu()
        error = float((ours - theirs).norm() / theirs.norm())
        print(f"bf16 logits relative error, {len(ids)} tokens: {error:.4f}")
        assert error < 0.05
        top2 = theirs[-1].topk(2)
        if float(top2.values[0] - top2.values[1]) > 0.1:
            assert int(ours[-1].argmax()) == int(top2.indices[0])


def w4a16_reference(hf, names: tuple[str, ...]) -> None:
    """Replace ``hf``'s weights that "w4a16" quantizes by their uint4
    round trip (in bf16, as our layers hold them): the exact oracle."""
    with torch.no_grad():
        for name, param in hf.named_parameters():
            if not name.endswith(names):
                continue
            rows = param.data.reshape(-1, param.shape[-1]).to(torch.bfloat16)
            packed, scales = marlin_quantize_and_repack(rows, 128, torch.bfloat16)
            param.copy_(marlin_dequantize(packed, scales, 128).view(param.shape))


def w4a8_reference(hf, names: tuple[str, ...]) -> None:
    """Replace ``hf``'s expert weights by their uint4 round trip (of their
    bf16 values, as our layers quantize them)."""
    with torch.no_grad():
        for name, param in hf.named_parameters():
            if name.endswith(names):
                w = param.data.to(torch.bfloat16)
                param.copy_(dequantize_w4(*quantize_w4(w)))


@pytest.mark.parametrize(
    ("quantization", "experts", "bound"),
    [
        (None, "GroupedMMExperts", 0.05),
        ("fp8", "TritonExpertsFp8", 0.08),
        ("w4a16", "MarlinExperts", 0.05),
        ("w4a8", "TritonExpertsW4A8", 0.08),
    ],
)
def test_online_quantization_matches_its_oracle(tmp_path, quantization, experts, bound):
    """bf16 on the CPU (the quantized kernels' references) against
    transformers in fp32: relative error of the logits under ``bound``. For
    "w4a16" and "w4a8" transformers runs the uint4 round trip of the same
    weights (4-bit weights alone move these random logits by ~35%); for
    "fp8" the original weights (FP8 rounding of weights and activations is
    within the bound)."""
    dims: dict[str, Any] = {"moe_intermediate_size": 128, "intermediate_size": 256}
    hf = build_tiny_checkpoint(
        tmp_path,
        seed=2,
        with_tokenizer=False,
        **dims,
    )
    if quantization == "w4a8":
        w4a8_reference(hf, ("gate_up_proj", "experts.down_proj"))
    if quantization == "w4a16":
        projections = ("q_proj.weight", "k_proj.weight", "v_proj.weight")
        mlp = ("o_proj.weight", "gate_proj.weight", "up_proj.weight")
        w4a16_reference(hf, (*projections, *mlp, "down_proj.weight", "down_proj"))
        w4a16_reference(hf, ("gate_up_proj",))
    model = get_model(
        tmp_path, dtype="bfloat16", quantization=quantization, prefix=next(_prefixes)
    )
    assert isinstance(model, Qwen3MoeForCausalLM)
    kernel = model.moe_layers()[0].kernel
    assert kernel is not None and type(kernel.experts).__name__ == experts
    dense = [m for m in model.modules() if isinstance(m, MarlinLinear)]
    assert len(dense) == (4 * 2 + 3 if quantization == "w4a16" else 0)  # qkv, o
    for ids in PROMPTS[:2]:
        ours, theirs = our_logits(model, ids), hf_logits(hf, ids)
        error = float((ours - theirs).norm() / theirs.norm())
        print(f"{quantization}: logits relative error {error:.4f}")
        assert error < bound
    with pytest.raises(ValueError, match="quantization: expected None or one of"):
        get_model(tmp_path, quantization="int8", prefix=next(_prefixes))


def _tensor_parallel_worker(rank: int, world_size: int, port: int, path) -> dict:
    """This rank's logits of every prompt, from the checkpoint and from
    dummy weights, with attention heads, dense MLPs and experts split over
    the world's ranks; and the sizes of what it holds."""
    init_gloo_world(rank, world_size, port)
    init_workspace_manager("cpu")
    try:
        initialize_model_parallel(tensor_model_parallel_size=world_size)
        tp, ep = get_tp_group(), get_ep_group()
        out: dict = {}
        for load_format in ("auto", "dummy"):
            model = load(path, load_format, ep_group=ep, tp_group=tp)
            out[load_format] = [our_logits(model, ids) for ids in PROMPTS]
        attn = next(m for m in model.modules() if isinstance(m, Qwen3MoeAttention))
        out["heads"] = (attn.num_heads, attn.num_kv_heads, attn.qkv_proj.weight.shape)
        return out
    finally:
        reset_workspace_manager()
        destroy_distributed_environment()


def test_tensor_parallel_ranks_give_the_whole_models_logits(checkpoint):
    """fp32 on 2 gloo ranks: each holds half the query and KV heads, half of
    the dense MLP's intermediate columns and half the experts, and both
    compute the single-process logits (checkpoint and dummy weights: the
    dummy tensors are drawn whole, then split)."""
    path, _ = checkpoint
    whole = {
        load_format: [our_logits(load(path, load_format), ids) for ids in PROMPTS]
        for load_format in ("auto", "dummy")
    }
    for result in values(run_workers(_tensor_parallel_worker, 2, path)):
        heads, kv_heads, qkv_shape = result["heads"]
        assert (2 * heads, 2 * kv_heads) == (4, 2)  # the tiny model's heads
        assert qkv_shape[0] == (heads + 2 * kv_heads) * 32
        for load_format, logits in whole.items():
            for mine, ref in zip(result[load_format], logits, strict=True):
                torch.testing.assert_close(mine, ref, atol=1e-4, rtol=1e-4)


def test_tensor_parallelism_needs_even_splits_and_the_experts_group(checkpoint):
    path, _ = checkpoint
    group = layout_group("tp", [0, 1, 2], 1)
    with pytest.raises(ValueError, match=r"^tp_group: tensor parallelism shards"):
        load(path, tp_group=group)
    with pytest.raises(ValueError, match=r"^tensor_parallel_size: 3 ranks must split"):
        load(path, ep_group=group, tp_group=group)
