"""The Marlin runtime op, its lock workspaces and weight preparation.

Kernel-level numerics under the Triton interpreter live in
tests/model_executor/kernels/marlin/test_gemm.py and MarlinLinear's own
contract in tests/model_executor/layers/quantization/test_marlin.py; here the
op runs the Triton kernel on CUDA and the plain-PyTorch path on CPU.
"""

import pytest
import torch

from vllm.model_executor.kernels.marlin import (
    marlin_workspace_numel,
    quantize_weights,
    unpack_weights,
)
from vllm.model_executor.kernels.marlin.config import default_config
from vllm.model_executor.layers.quantization.marlin import MarlinLinear
from vllm.model_executor.layers.quantization.utils.marlin_utils import (
    MARLIN_WORKSPACE_KEY,
    get_marlin_workspace,
    marlin_dequantize,
    marlin_make_workspace_new,
    marlin_quantize_and_repack,
)
from vllm.utils import canonical_device
from vllm.v1.worker.ubatching import run_ubatches
from vllm.v1.worker.workspace import (
    WorkspaceLockedError,
    init_workspace_manager,
    reset_workspace_manager,
    use_workspace_lane,
)

CUDA = torch.cuda.is_available()


def make_weights(n: int, k: int, group_size: int, dtype, device):
    w = torch.randn(n, k, device=device, dtype=torch.float32)
    packed, scales = marlin_quantize_and_repack(w, group_size, dtype)
    return w, packed, scales


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


def marlin_op(a, packed, scales, group_size, n, k, workspace=None):
    return torch.ops.vllm.marlin_gemm(a, packed, scales, workspace, group_size, n, k)


# -- weight preparation --------------------------------------------------------


@pytest.mark.parametrize("group_size", [128, -1])
def test_quantize_repack_dequantize_roundtrip(group_size):
    torch.manual_seed(0)
    w = torch.randn(96, 256)
    q, scales = quantize_weights(w, group_size)
    packed, scales_bf16 = marlin_quantize_and_repack(w, group_size, torch.bfloat16)
    assert torch.equal(unpack_weights(packed).to(torch.uint8), q)
    g = 256 if group_size == -1 else group_size
    expected = (q.float() - 8) * scales.t().repeat_interleave(g, dim=1)
    dequant = marlin_dequantize(packed, scales_bf16, group_size)
    torch.testing.assert_close(dequant.float(), expected, rtol=1e-2, atol=1e-3)
    assert relative_error(dequant, w) < 0.15  # 4-bit symmetric quantization


# -- numerics through the op ---------------------------------------------------

GPU_SHAPES = [(4096, 4096, 128), (8192, 8192, 128), (28672, 4096, -1), (384, 640, 128)]


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 7, 16, 64, 1000])
@pytest.mark.parametrize("n,k,group_size", GPU_SHAPES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_op_matches_dequantized_reference(workspace_init, m, n, k, group_size, dtype):
    torch.manual_seed(m + n)
    _, packed, scales = make_weights(n, k, group_size, dtype, "cuda")
    a = torch.randn(m, k, device="cuda", dtype=dtype)
    out = marlin_op(a, packed, scales, group_size, n, k)
    ref = a.float() @ marlin_dequantize(packed, scales, group_size).float().t()
    assert relative_error(out, ref) < 1e-2
    workspace = get_marlin_workspace("cuda")
    assert int(workspace.count_nonzero()) == 0  # every call leaves the locks zero


@pytest.mark.gpu
def test_poisoned_locks_give_wrong_results(workspace_init):
    """Why the buffer must be zero at launch: a stale counter reorders slices."""
    torch.manual_seed(1)
    # Few output tiles, long K: split-K is active; 17 rows, past the decode
    # kernels (which take no locks).
    m, n, k = 17, 256, 8192
    _, packed, scales = make_weights(n, k, 128, torch.bfloat16, "cuda")
    a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    ref = a.float() @ marlin_dequantize(packed, scales, 128).float().t()
    clean = marlin_make_workspace_new("cuda")
    assert relative_error(marlin_op(a, packed, scales, 128, n, k, clean), ref) < 1e-2
    # Every counter at the last slice's number: that slice goes first, then
    # resets the counter and slice 0 overwrites its partial sum.
    split = default_config(m, n, k, torch.device("cuda")).split_k
    assert split > 1
    poisoned = marlin_make_workspace_new("cuda").fill_(split - 1)
    out = marlin_op(a, packed, scales, 128, n, k, poisoned)
    assert relative_error(out, ref) > 1e-1 or bool(out.isnan().any())


def test_op_computes_the_quantized_product(workspace_init, device):
    """Against the original (unquantized) weights: 4-bit error, not more."""
    torch.manual_seed(2)
    w, packed, scales = make_weights(64, 256, 128, torch.bfloat16, device)
    a = torch.randn(5, 256, dtype=torch.bfloat16, device=device)
    out = marlin_op(a, packed, scales, 128, 64, 256)
    assert out.dtype == torch.bfloat16 and out.shape == (5, 64)
    assert relative_error(out, a.float() @ w.t()) < 0.15
    # A permuted weight layout would be off by far more than quantization.
    assert relative_error(out, a.float() @ w.flip(1).t()) > 0.5


def test_opcheck(workspace_init, device):
    torch.manual_seed(3)
    dtype = torch.bfloat16
    _, packed, scales = make_weights(128, 256, 128, dtype, device)
    a = torch.randn(3, 256, device=device, dtype=dtype)
    for workspace in (None, marlin_make_workspace_new(device)):
        torch.library.opcheck(
            torch.ops.vllm.marlin_gemm.default,
            (a, packed, scales, workspace, 128, 128, 256),
        )


def test_bad_workspace_is_rejected(device):
    torch.manual_seed(4)
    _, packed, scales = make_weights(128, 256, 128, torch.bfloat16, device)
    a = torch.randn(2, 256, device=device, dtype=torch.bfloat16)
    small = torch.zeros(
        marlin_workspace_numel(device) - 1, dtype=torch.int32, device=device
    )
    with pytest.raises(ValueError, match="workspace"):
        marlin_op(a, packed, scales, 128, 128, 256, small)
    wrong = torch.zeros(
        marlin_workspace_numel(device), dtype=torch.int64, device=device
    )
    with pytest.raises(ValueError, match="workspace"):
        marlin_op(a, packed, scales, 128, 128, 256, wrong)
    with pytest.raises(ValueError, match="max_blocks_per_sm"):
        marlin_make_workspace_new(device, 3)
    bigger = marlin_make_workspace_new(device, 8)
    assert bigger.numel() == 2 * marlin_workspace_numel(device)
    # The CPU path checks like the kernel: wrong scales and group size are named.
    with pytest.raises(ValueError, match="scales"):
        marlin_op(a, packed, scales[:1], 128, 128, 256)
    with pytest.raises(ValueError, match="group_size"):
        marlin_op(a, packed, scales, 96, 128, 256)


# -- lock workspaces -------------------------------------------------------------


def test_workspace_without_manager_is_fresh_and_zero(device):
    reset_workspace_manager()
    first, second = get_marlin_workspace(device), get_marlin_workspace(device)
    assert first.data_ptr() != second.data_ptr()
    assert first.dtype == torch.int32 and int(first.count_nonzero()) == 0
    assert first.numel() == marlin_workspace_numel(device)


def test_workspace_on_another_device_is_refused(workspace_init):
    with pytest.raises(ValueError, match="device: the workspace manager owns"):
        get_marlin_workspace("meta")


def test_workspace_per_slot(device):
    reset_workspace_manager()
    manager = init_workspace_manager(device, num_ubatches=2, num_lanes=2)
    try:

        def lookup():
            ptrs = []
            for lane in (0, 1):
                with use_workspace_lane(lane):
                    locks = get_marlin_workspace(device)
                    assert get_marlin_workspace(device) is locks  # same stream
                    ptrs.append(locks.data_ptr())
            return ptrs

        ptrs = [p for ubatch in run_ubatches([lookup, lookup]) for p in ubatch]
        assert len(set(ptrs)) == 4
        report = manager.memory_report()
        for slot in report.slots:
            (res,) = slot.resources
            marlin_key = (MARLIN_WORKSPACE_KEY, str(canonical_device(device)))
            assert isinstance(res.key, tuple) and res.key[0] == marlin_key
            assert res.nbytes == 4 * marlin_workspace_numel(device)
    finally:
        reset_workspace_manager()


def test_explicit_workspace_used_as_given(workspace_init, device):
    _, packed, scales = make_weights(128, 256, 128, torch.bfloat16, device)
    a = torch.randn(2, 256, device=device, dtype=torch.bfloat16)
    workspace_init.lock()
    with pytest.raises(WorkspaceLockedError, match=MARLIN_WORKSPACE_KEY):
        marlin_op(a, packed, scales, 128, 128, 256)  # would need a new resource
    explicit = marlin_make_workspace_new(device)
    out = marlin_op(a, packed, scales, 128, 128, 256, explicit)
    assert out.shape == (2, 128)


@pytest.mark.gpu
def test_streams_get_own_buffers_and_run_concurrently(workspace_init):
    torch.manual_seed(5)
    n, k = 512, 8192
    _, packed, scales = make_weights(n, k, 128, torch.bfloat16, "cuda")
    weight = marlin_dequantize(packed, scales, 128).float()
    streams = [torch.cuda.Stream(), torch.cuda.Stream()]
    inputs = [torch.randn(4, k, device="cuda", dtype=torch.bfloat16) for _ in streams]
    buffers = []
    for s in streams:
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            buffers.append(get_marlin_workspace("cuda"))
    assert buffers[0].data_ptr() != buffers[1].data_ptr()
    assert get_marlin_workspace("cuda").data_ptr() not in {
        b.data_ptr() for b in buffers
    }
    outs: list[list[torch.Tensor]] = [[], []]
    for _ in range(20):  # interleave launches so the kernels overlap
        for i, s in enumerate(streams):
            with torch.cuda.stream(s):
                outs[i].append(marlin_op(inputs[i], packed, scales, 128, n, k))
    torch.cuda.synchronize()
    for i in range(2):
        ref = inputs[i].float() @ weight.t()
        for out in outs[i]:
            assert relative_error(out, ref) < 1e-2
        assert int(buffers[i].count_nonzero()) == 0


# -- torch.compile ---------------------------------------------------------------


class TwoLinears(torch.nn.Module):
    def __init__(self, device):
        super().__init__()
        self.up = MarlinLinear(256, 384, device=device)
        self.down = MarlinLinear(384, 256, group_size=-1, device=device)
        for layer in (self.up, self.down):
            assert layer.weight is not None
            layer.weight_loader(torch.randn_like(layer.weight, dtype=torch.float32))
            layer.process_weights_after_loading()

    def forward(self, x):
        return self.down(torch.nn.functional.silu(self.up(x)))


def test_compiled_module_resolves_workspace_per_slot(device):
    torch.manual_seed(7)
    torch._dynamo.reset()
    reset_workspace_manager()
    manager = init_workspace_manager(device, num_lanes=2)
    try:
        model = TwoLinears(device)
        x = torch.randn(16, 256, device=device, dtype=torch.bfloat16)
        expected = model(x)
        compiled = torch.compile(model, fullgraph=True)
        with torch._dynamo.config.patch(error_on_recompile=True):
            torch.testing.assert_close(compiled(x), expected, rtol=2e-2, atol=2e-2)
            with use_workspace_lane(1):
                torch.testing.assert_close(compiled(x), expected, rtol=2e-2, atol=2e-2)
            if CUDA:
                side = torch.cuda.Stream()
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side):
                    compiled(x)
                torch.cuda.current_stream().wait_stream(side)
        lanes = [
            s.lane
            for s in manager.memory_report().slots
            for r in s.resources
            if MARLIN_WORKSPACE_KEY in str(r.key)
        ]
        # One buffer per (lane, stream): lane 0 ran on two streams with CUDA.
        assert sorted(lanes) == ([0, 0, 1] if CUDA else [0, 1])
    finally:
        reset_workspace_manager()
        torch._dynamo.reset()
