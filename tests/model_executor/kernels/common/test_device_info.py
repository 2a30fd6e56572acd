import pytest
import torch

from vllm import envs
from vllm.model_executor.kernels.common.device_info import (
    CPU_SMS,
    capability,
    inline_ptx,
    num_sms,
)
from vllm.model_executor.kernels.marlin.gemv import _marlin_gemv_kernel


def test_cpu_has_the_interpreter_bound():
    assert num_sms(torch.device("cpu")) == CPU_SMS
    assert capability(torch.device("cpu")) is None


@pytest.mark.gpu
def test_cuda_matches_the_device_properties():
    props = torch.cuda.get_device_properties(0)
    assert num_sms(torch.device("cuda", 0)) == props.multi_processor_count
    assert num_sms(torch.device("cuda")) == props.multi_processor_count
    major, minor = props.major, props.minor
    assert capability(torch.device("cuda", 0)) == (major, minor)
    assert capability(torch.device("cuda")) == (major, minor)


def test_inline_ptx_only_in_kernels_compiled_for_nvidia():
    """The interpreter (CPU runs) cannot execute PTX, even for a CUDA tensor."""
    assert not inline_ptx(torch.device("cpu"), _marlin_gemv_kernel)
    compiled = not envs.triton_interpret() and torch.version.hip is None
    assert inline_ptx(torch.device("cuda"), _marlin_gemv_kernel) == compiled
