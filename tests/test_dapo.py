"""DAPO dynamic-sampling filter and soft overlong penalty."""

import pytest
import torch

from rlbus.learner.algorithms import overlong_penalty


def test_overlong_penalty_soft_ramp():
    # max 20, buffer 4 -> no penalty up to 16, then -(len - 16) / 4, -1 from 20 on.
    lengths = torch.tensor([10, 16, 17, 18, 20, 25])
    torch.testing.assert_close(
        overlong_penalty(lengths, 20, 4, 1.0), torch.tensor([0.0, 0.0, -0.25, -0.5, -1.0, -1.0])
    )
    # The penalty factor scales the ramp.
    torch.testing.assert_close(
        overlong_penalty(lengths, 20, 4, 0.5), torch.tensor([0.0, 0.0, -0.125, -0.25, -0.5, -0.5])
    )


def test_overlong_penalty_zero_buffer_is_hard_and_bad_buffer_raises():
    torch.testing.assert_close(
        overlong_penalty(torch.tensor([19, 20, 21]), 20, 0, 2.0), torch.tensor([0.0, 0.0, -2.0])
    )
    with pytest.raises(ValueError):
        overlong_penalty(torch.tensor([1]), 20, 30, 1.0)
