import pytest
import torch

from vllm.model_executor.kernels.common.checks import check_contiguous


def test_check_contiguous_accepts_the_expected_tensor():
    t = torch.zeros(2, 3, dtype=torch.int32)
    check_contiguous("t", t, torch.int32, [2, 3], torch.device("cpu"))


@pytest.mark.parametrize(
    "tensor,message",
    [
        (
            torch.zeros(2, 3),
            r"t: expected contiguous torch.int32 \[2, 3\] on cpu, got "
            r"torch.float32 \[2, 3\] on cpu",
        ),
        (torch.zeros(3, 2, dtype=torch.int32), r"got torch.int32 \[3, 2\]"),
        (torch.zeros(3, 2, dtype=torch.int32).t(), r"got non-contiguous torch.int32"),
    ],
    ids=["dtype", "shape", "layout"],
)
def test_check_contiguous_names_argument_and_mismatch(tensor, message):
    with pytest.raises(ValueError, match=message):
        check_contiguous("t", tensor, torch.int32, [2, 3], torch.device("cpu"))
