import pytest
import torch

from drelay.kernels.reference import greedy_accept, target_probs
from drelay.decoding.verify import rejection_accept


def test_greedy_accept_counts_matching_prefix_and_takes_the_next_argmax():
    V = 10
    target_tokens = torch.tensor([[3, 4, 5, 6], [3, 4, 5, 6], [3, 4, 5, 6]])  # argmax of rows 0..3
    logits = torch.nn.functional.one_hot(target_tokens, V).float()
    drafts = torch.tensor([[3, 4, 5], [3, 9, 5], [0, 4, 5]])
    accept_len, next_token = greedy_accept(drafts, logits)
    assert accept_len.tolist() == [3, 1, 0]
    assert next_token.tolist() == [6, 4, 3]  # bonus after a full accept, else the correction


def test_rejection_accept_rejects_unknown_rule():
    with pytest.raises(ValueError, match="unknown sampling rule"):
        rejection_accept(torch.zeros(1, 2, dtype=torch.long), torch.full((1, 3, 4), 0.25), rule="magic")


@pytest.mark.parametrize("rule", ["residual", "match"])
def test_rejection_accept_keeps_the_target_distribution(rule):
    # One drafted position: the committed token must be distributed as p whatever the draft is.
    gen = torch.Generator().manual_seed(0)
    p = torch.tensor([0.5, 0.3, 0.15, 0.05], dtype=torch.float64)
    n_rows = 40_000
    probs = p.expand(n_rows, 2, 4)
    drafts = torch.full((n_rows, 1), 1)  # always propose token 1 (p = 0.3)
    accept_len, next_token = rejection_accept(drafts, probs, gen, rule)
    out = torch.where(accept_len == 1, drafts[:, 0], next_token)
    freq = torch.bincount(out, minlength=4).double() / n_rows
    assert torch.allclose(freq, p, atol=0.01), freq
    assert abs(accept_len.double().mean().item() - 0.3) < 0.01  # accept with probability p(d)


def test_residual_sampling_never_returns_the_rejected_token():
    gen = torch.Generator().manual_seed(1)
    probs = torch.tensor([0.6, 0.4], dtype=torch.float64).expand(5000, 2, 2)
    drafts = torch.zeros(5000, 1, dtype=torch.long)
    accept_len, next_token = rejection_accept(drafts, probs, gen)
    assert (next_token[accept_len == 0] == 1).all()


def test_target_probs_uses_temperature():
    logits = torch.tensor([[0.0, 1.0]])
    assert target_probs(logits, 1.0)[0, 1] < target_probs(logits, 0.1)[0, 1]
