"""The opt-in few-row linear rule: the same products as F.linear; off by default, on for the target, the drafter
and the repair methods when DRELAY_FEW_ROW_LINEAR_MAX_ROWS is set."""

import torch
import torch.nn.functional as F
from torch import nn

from drelay.models import cpu_linear
from drelay.models.cpu_linear import few_row_linear, use_few_row_linear

ON = 256  # rows, as DRELAY_FEW_ROW_LINEAR_MAX_ROWS=256 would set


def test_matches_f_linear_for_every_row_count_and_shape():
    torch.manual_seed(0)
    weight, bias = torch.randn(40, 24), torch.randn(40)
    for shape in [(1, 24), (3, 1, 24), (2, 8, 24), (ON + 5, 24), (24,)]:
        x = torch.randn(*shape)
        for b in (None, bias):
            out = few_row_linear(x, weight, b, max_rows=ON)
            assert out.shape == F.linear(x, weight, b).shape
            torch.testing.assert_close(out, F.linear(x, weight, b), rtol=1e-5, atol=1e-5)
            assert out.is_contiguous()


def test_other_dtypes_keep_f_linear_bit_for_bit():
    x, weight = torch.randn(2, 8, 24, dtype=torch.float64), torch.randn(40, 24, dtype=torch.float64)
    assert torch.equal(few_row_linear(x, weight, max_rows=ON), F.linear(x, weight))


def test_patched_module_keeps_gradients_and_is_patched_once(monkeypatch):
    monkeypatch.setattr(cpu_linear, "MAX_ROWS", ON)
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(6, 5), nn.ReLU(), nn.Linear(5, 3, bias=False))
    ref = nn.Sequential(nn.Linear(6, 5), nn.ReLU(), nn.Linear(5, 3, bias=False))
    ref.load_state_dict(net.state_dict())
    assert use_few_row_linear(net) == 2
    assert use_few_row_linear(net) == 0  # already routed
    x = torch.randn(4, 6)
    net(x).square().sum().backward()
    ref(x).square().sum().backward()
    for p, q in zip(net.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6)
    assert set(net.state_dict()) == set(ref.state_dict())


def test_off_by_default_and_target_and_drafter_use_it_when_on(monkeypatch):
    from drelay.models.drafter import BlockDrafter
    from tests.conftest import make_tiny_target

    def routed(model) -> list[bool]:
        return [getattr(m.forward, "__func__", None) is cpu_linear._forward for m in model.modules()
                if type(m) is nn.Linear]

    assert cpu_linear.MAX_ROWS == 0  # the suite sets DRELAY_FEW_ROW_LINEAR_MAX_ROWS=0 (tests/conftest.py)
    target = make_tiny_target(dtype=torch.float32)
    assert not any(routed(target.model)) and not any(routed(BlockDrafter.for_target(target, block_size=4)))
    monkeypatch.setattr(cpu_linear, "MAX_ROWS", ON)
    target = make_tiny_target(dtype=torch.float32)
    for model in (target.model, BlockDrafter.for_target(target, block_size=4)):
        assert routed(model) and all(routed(model))


def test_auto_measures_each_shape_and_row_count_once_inside_the_decoders_only(monkeypatch):
    """The default ("auto"): inside the live decoders (`decoding_products`) the first few-row product of a weight
    shape times both orders and keeps the faster, drawing nothing from the global RNG; outside them, and for more
    rows than AUTO_MAX_ROWS, F.linear exactly."""
    monkeypatch.setattr(cpu_linear, "AUTO", True)
    monkeypatch.setattr(cpu_linear, "MAX_ROWS", cpu_linear.AUTO_MAX_ROWS)
    monkeypatch.setattr(cpu_linear, "_CHOICE", {})
    weight, bias = torch.randn(96, 40), torch.randn(96)
    x = torch.randn(2, 3, 40)  # 6 rows
    assert torch.equal(few_row_linear(x, weight, bias), F.linear(x, weight, bias)) and not cpu_linear._CHOICE
    rng = torch.get_rng_state()
    with cpu_linear.decoding_products():
        out = few_row_linear(x, weight, bias)
        assert torch.equal(torch.get_rng_state(), rng)
        torch.testing.assert_close(out, F.linear(x, weight, bias), rtol=1e-5, atol=1e-5)
        assert list(cpu_linear._CHOICE) == [(6, 96, 40, True, False)]
        chosen = cpu_linear._CHOICE[(6, 96, 40, True, False)]
        expected = (cpu_linear._transposed(x.reshape(6, 40), weight, bias).view(2, 3, 96) if chosen
                    else F.linear(x, weight, bias))
        assert torch.equal(few_row_linear(x, weight, bias), expected)  # the kept order, not measured again
        many = torch.randn(cpu_linear.AUTO_MAX_ROWS + 1, 40)
        assert torch.equal(few_row_linear(many, weight, bias), F.linear(many, weight, bias))
    assert len(cpu_linear._CHOICE) == 1 and not cpu_linear._SCOPE["decoding"]
