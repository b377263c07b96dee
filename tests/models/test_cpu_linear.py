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


def _auto(monkeypatch) -> None:
    monkeypatch.setattr(cpu_linear, "AUTO", True)
    monkeypatch.setattr(cpu_linear, "MAX_ROWS", cpu_linear.AUTO_MAX_ROWS)
    monkeypatch.setattr(cpu_linear, "ROW_CHOICE", {})
    monkeypatch.setattr(cpu_linear, "ROW_TIMES", {})


def test_auto_uses_the_order_chosen_per_row_count_inside_the_decoders_only(monkeypatch):
    """The default ("auto"): inside the live decoders (`decoding_products`) a product of r rows takes the order
    kept for r; outside them, for unmeasured row counts and for more rows than AUTO_MAX_ROWS, F.linear exactly."""
    _auto(monkeypatch)
    weight, bias = torch.randn(96, 40), torch.randn(96)
    x, one = torch.randn(2, 3, 40), torch.randn(1, 40)  # 6 rows, 1 row
    cpu_linear.ROW_CHOICE.update({6: True, 1: False})
    transposed = cpu_linear._transposed(x.reshape(6, 40), weight, bias).view(2, 3, 96)
    # Which order ran is told by the calls (on some CPUs the two orders round this small product alike).
    calls: list[int] = []
    real = cpu_linear._transposed
    monkeypatch.setattr(cpu_linear, "_transposed", lambda x2, w, b: calls.append(x2.shape[0]) or real(x2, w, b))
    assert torch.equal(few_row_linear(x, weight, bias), F.linear(x, weight, bias)) and calls == []  # outside
    with cpu_linear.decoding_products():
        assert torch.equal(few_row_linear(x, weight, bias), transposed) and calls == [6]
        assert torch.equal(few_row_linear(one, weight, bias), F.linear(one, weight, bias))
        two = torch.randn(2, 40)  # not measured
        assert torch.equal(few_row_linear(two, weight, bias), F.linear(two, weight, bias))
        many = torch.randn(cpu_linear.AUTO_MAX_ROWS + 1, 40)
        assert torch.equal(few_row_linear(many, weight, bias), F.linear(many, weight, bias))
        assert calls == [6]  # 1 row (kept: F.linear), 2 rows (unmeasured) and too many rows: F.linear
    assert not cpu_linear._SCOPE["decoding"]


def test_auto_measures_whole_forwards_once_per_process_before_the_decoders_time(monkeypatch):
    """The live decoders have the target time whole forwards of 1..AUTO_MAX_ROWS new tokens in both orders, once,
    before their timer starts, drawing nothing from the global RNG; a bf16 target is not measured."""
    from drelay.decoding.generate import ar_generate
    from tests.conftest import make_tiny_target

    _auto(monkeypatch)
    bf16 = make_tiny_target(dtype=torch.bfloat16)
    bf16.measure_few_row_orders()
    assert cpu_linear.needs_measuring() and not cpu_linear.ROW_TIMES
    target = make_tiny_target(dtype=torch.float32)
    rng = torch.get_rng_state()
    seen = []
    real_forward = target.forward

    def counting_forward(ids, *args, **kwargs):
        seen.append(ids.shape[1])
        return real_forward(ids, *args, **kwargs)

    monkeypatch.setattr(target, "forward", counting_forward)
    transposed, real_transposed = [], cpu_linear._transposed
    monkeypatch.setattr(cpu_linear, "_transposed", lambda *a: transposed.append(1) or real_transposed(*a))
    target.measure_few_row_orders(context=32)
    assert torch.equal(torch.get_rng_state(), rng)
    rows = list(range(1, cpu_linear.AUTO_MAX_ROWS + 1))
    assert sorted(cpu_linear.ROW_CHOICE) == rows and sorted(cpu_linear.ROW_TIMES) == rows
    for r, t in cpu_linear.ROW_TIMES.items():
        assert cpu_linear.ROW_CHOICE[r] == (t["transposed"] < cpu_linear.AUTO_MARGIN * t["linear"])
        assert min(t.values()) > 0
    # one 32-token prefill, then per row count a warm-up and 3 timed rounds of both orders
    assert seen == [32] + [r for r in rows for _ in range(2 * 4)]
    linears = sum(type(m) is nn.Linear for m in target.model.modules())
    assert len(transposed) == linears * 4 * len(rows)  # every product of the forced rounds, none of the others
    assert not cpu_linear.needs_measuring()
    target.measure_few_row_orders(context=32)  # chosen already: nothing runs
    assert len(seen) == 1 + 2 * 4 * len(rows) and cpu_linear._SCOPE == {"decoding": False, "force": None}
    _auto(monkeypatch)  # the decoders measure first
    assert len(ar_generate(make_tiny_target(dtype=torch.float32), [1, 5, 7], 4).tokens) == 4
    assert sorted(cpu_linear.ROW_CHOICE) == rows
