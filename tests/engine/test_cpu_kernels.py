"""asyncrl/engine/cpu_kernels.py: the transposed small-batch product equals nn.Linear, leaves the
parameters alone, and steps aside where it does not apply."""

import pytest
import torch
from torch import nn

from asyncrl.engine.cpu_kernels import SmallBatchLinear, use_small_batch_linears


def _pair(inp: int, out: int, bias: bool) -> tuple[nn.Linear, nn.Linear]:
    torch.manual_seed(0)
    ref = nn.Linear(inp, out, bias=bias)
    fast = nn.Linear(inp, out, bias=bias)
    fast.load_state_dict(ref.state_dict())
    assert use_small_batch_linears(fast, max_rows=8) == 1
    return ref, fast


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("shape", [(1, 24), (3, 24), (2, 4, 24), (8, 24), (9, 24), (2, 5, 24)])
def test_same_product_as_linear_for_small_and_large_inputs(shape, bias):
    ref, fast = _pair(24, 40, bias)
    x = torch.randn(*shape)
    with torch.inference_mode():
        want, got = ref(x), fast(x)
    assert got.shape == want.shape and got.is_contiguous()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_parameters_and_names_are_untouched_and_in_place_updates_are_seen():
    model = nn.Sequential(nn.Linear(6, 5), nn.ReLU(), nn.Linear(5, 3, bias=False))
    before = {k: v.data_ptr() for k, v in model.state_dict().items()}
    assert use_small_batch_linears(model) == 2
    assert all(isinstance(m, SmallBatchLinear) for m in (model[0], model[2]))
    assert {k: v.data_ptr() for k, v in model.state_dict().items()} == before
    with torch.no_grad():
        model.state_dict()["2.weight"].copy_(torch.zeros(3, 5))  # what EngineCore.apply_weights does
    assert torch.equal(model(torch.randn(2, 6)), torch.zeros(2, 3))


def test_other_dtypes_empty_inputs_and_bad_arguments():
    ref, fast = _pair(4, 3, True)
    x64 = torch.randn(2, 4, dtype=torch.float64)
    with pytest.raises(RuntimeError):  # nn.Linear refuses a dtype mismatch; so does the fallback
        ref(x64)
    with pytest.raises(RuntimeError):
        fast(x64)
    assert fast(torch.randn(0, 4)).shape == (0, 3)
    with pytest.raises(ValueError, match="max_rows must be >= 1, got 0"):
        use_small_batch_linears(nn.Linear(2, 2), max_rows=0)
