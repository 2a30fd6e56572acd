import pytest
import torch

from vllm.model_executor.kernels.common.device_info import CPU_SMS, capability, num_sms


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
