"""What grad-free selects reuse (relay.py `Derived`): the token tables over the vocabulary and the lattice's
float16 S give the values the plain computation gives, follow every change of the weights they come from, and
are built by `prepare_inference` before a timed decode; a float32 engine with them stays lossless."""

import pytest
import torch
from torch import nn

from drelay.decoding.generate import SpeculativeDecoder, ar_generate
from drelay.kernels.reference import candidate_pool
from drelay.models.drafter import BlockDrafter
from drelay.models.relay import FEW_QUERY_ROWS, DRelay, RelayConfig
from drelay.models.repair import DraftBlock
from tests.conftest import make_tiny_target
from tests.models.test_relay import as_if_trained

V, H = 40, 16

pytestmark = pytest.mark.usefixtures("one_thread")


def _relay(dtype=torch.float32) -> DRelay:
    torch.manual_seed(0)
    cfg = RelayConfig(hidden_size=H, block_size=6, pool_size=4, reader_dim=32, reader_layers=1, reader_heads=4,
                      vocab_size=V, token_rank=8, lattice_rank=8, lattice_messages=True, anchor_token=True,
                      calibrate=True, lattice_pool_first=True)
    embed = nn.Embedding(V, H).to(dtype).requires_grad_(False)
    return as_if_trained(DRelay(cfg).to(dtype).attach(embed))


def _block(relay: DRelay, b=3, n=5, seed=1) -> DraftBlock:
    gen = torch.Generator().manual_seed(seed)
    dtype = relay.reader.A.weight.dtype
    logits = torch.randn(b, n, V, generator=gen, dtype=dtype) * 2
    pool_ids, pool_logprobs = candidate_pool(logits, relay.config.pool_size)
    hidden = torch.randn(b, n, H, generator=gen, dtype=dtype)
    anchor = torch.randint(0, V, (b,), generator=gen)
    return DraftBlock(anchor, torch.zeros(b, dtype=torch.long), hidden, logits, pool_ids, pool_logprobs)


def _computed(relay: DRelay, part, ids: torch.Tensor) -> torch.Tensor:
    with torch.enable_grad():  # the training path: no table
        return part.token_input(relay.embed(ids), ids).detach()


def test_grad_free_token_inputs_are_the_computed_ones_and_follow_the_weights():
    relay = _relay()
    ids = torch.tensor([[0, 5, 39], [7, 7, 1]])
    for part in (relay.reader, relay.selector):
        with torch.no_grad():
            got = relay.token_inputs(part, ids)
        torch.testing.assert_close(got, _computed(relay, part, ids), rtol=1e-5, atol=1e-6)
    # an optimizer step changes the weights in place: the next grad-free call reads a rebuilt table
    optimizer = torch.optim.SGD(relay.parameters(), lr=1.0)
    for p in relay.parameters():
        p.grad = torch.ones_like(p)
    with torch.no_grad():
        before = {name: relay.token_inputs(part, ids) for name, part in (("r", relay.reader), ("s", relay.selector))}
    optimizer.step()
    for name, part in (("r", relay.reader), ("s", relay.selector)):
        with torch.no_grad():
            after = relay.token_inputs(part, ids)
        assert not torch.allclose(after, before[name])
        torch.testing.assert_close(after, _computed(relay, part, ids), rtol=1e-5, atol=1e-6)
    # so does loading other weights, and a new embedding
    other = _relay()
    relay.load_state_dict(other.state_dict())
    relay.attach(nn.Embedding(V, H).requires_grad_(False))
    with torch.no_grad():
        torch.testing.assert_close(relay.token_inputs(relay.reader, ids), _computed(relay, relay.reader, ids),
                                   rtol=1e-5, atol=1e-6)


def test_few_row_vocabulary_products_read_a_float16_successor_within_rounding():
    relay = _relay()
    lattice = relay.lattice
    nn.init.normal_(lattice.successor, std=0.5)
    gen = torch.Generator().manual_seed(3)
    for rows in (1, FEW_QUERY_ROWS, FEW_QUERY_ROWS + 1):
        prev = torch.randint(0, V, (rows, 1), generator=gen)
        hidden = torch.randn(rows, 1, H, generator=gen)
        with torch.enable_grad():
            exact = lattice.vocabulary(prev, hidden).detach()
        with torch.no_grad():
            got = lattice.vocabulary(prev, hidden)
        assert got.dtype == torch.float32
        if rows <= FEW_QUERY_ROWS:  # float16 S: within its rounding, not bit-equal
            torch.testing.assert_close(got, exact, rtol=0, atol=2e-3 * float(exact.abs().max()))
            assert not torch.equal(got, exact)
        else:  # more rows (training, replay): the float32 product
            assert torch.equal(got, exact)
    # the float16 copy follows S
    with torch.no_grad():
        lattice.successor.mul_(-1.0)
        flipped = lattice.vocabulary(prev[:1], hidden[:1])
    with torch.enable_grad():
        torch.testing.assert_close(flipped, lattice.vocabulary(prev[:1], hidden[:1]).detach(), rtol=0,
                                   atol=2e-3 * float(exact.abs().max()))


def test_prepare_inference_builds_what_select_then_reuses():
    relay = _relay()
    relay.prepare_inference()
    tables = {name: cache._value for name, cache in relay._token_tables.items()}
    half = relay.lattice._half_successor._value
    assert set(tables) == {"reader", "selector"} and all(t.shape == (V, 32) for t in tables.values())
    assert half is not None and half.dtype == torch.float16
    block = _block(relay, b=1)
    relay.select(block)
    assert all(relay._token_tables[name]._value is t for name, t in tables.items())  # not rebuilt
    assert relay.lattice._half_successor._value is half


def test_float32_engine_with_the_tables_is_lossless():
    target = make_tiny_target(vocab_size=40, dtype=torch.float32, init=0.3, seed=2)
    drafter = BlockDrafter.for_target(target, block_size=6)
    torch.manual_seed(0)
    relay = as_if_trained(DRelay.for_drafter(drafter, reader_dim=32, reader_heads=4, pool_size=4, token_rank=8,
                                             lattice_rank=8, lattice_messages=True, anchor_token=True,
                                             calibrate=True, lattice_pool_first=True))
    nn.init.normal_(relay.lattice.successor, std=1.0)
    replaced = 0
    for prompt in ([1, 5, 7, 9, 3], [1, 20, 21]):
        ar = ar_generate(target, prompt, 30).tokens
        decoder = SpeculativeDecoder(target, drafter, relay, pool_size=4, verify_size=3)
        assert decoder.generate(prompt, 30).tokens == ar
        state = decoder.start(prompt)
        for _ in range(5):
            block = decoder.propose(state)
            replaced += int((relay.select(block) != block.pool_ids[..., 0]).sum())
            decoder.step(state)
    assert replaced > 0  # the relay repaired drafts; the output stayed the target's
