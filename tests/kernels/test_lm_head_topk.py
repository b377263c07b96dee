"""lm_head_topk: the fused head + streaming top-k gives the pool and the normaliser of the materialised
logits, on odd shapes (rows, width and vocabulary not multiples of any block), and through the drafter."""

import pytest
import torch

from drelay.kernels.lm_head_topk import lm_head_topk
from drelay.kernels.reference import lm_head_topk_ref
from drelay.models.drafter import BlockDrafter
from tests.conftest import make_tiny_target
from tests.kernels.conftest import close


@pytest.mark.parametrize("lead, H, V, k", [((2, 7), 24, 1001, 5), ((3,), 40, 130, 8), ((1, 1), 17, 9, 9),
                                           ((5, 3), 16, 300, 1)])
@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_kernel_matches_reference(device, lead, H, V, k, seed, dtype):
    """Outputs are fp32 in both (the pool's log-probs), whatever the input dtype."""
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(*lead, H, generator=gen, dtype=dtype).to(device)
    weight = torch.randn(V, H, generator=gen, dtype=dtype).to(device)
    ids, logprobs, lse = lm_head_topk(hidden, weight, k)
    ref_ids, ref_logprobs, ref_lse = lm_head_topk_ref(hidden, weight, k)
    assert ids.shape == logprobs.shape == (*lead, k) and lse.shape == lead and ids.dtype == torch.long
    assert torch.equal(ids, ref_ids)
    close(logprobs, ref_logprobs)
    close(lse, ref_lse)


def test_launcher_names_the_bad_argument(device):
    hidden, weight = torch.randn(4, 8, device=device), torch.randn(30, 8, device=device)
    with pytest.raises(ValueError, match=r"weight must have shape \(\*, 8\)"):
        lm_head_topk(hidden, weight[:, :7], 3)
    with pytest.raises(ValueError, match="weight must be torch.float32"):
        lm_head_topk(hidden, weight.double(), 3)
    with pytest.raises(ValueError, match=r"k must be in \[1, V=30\]"):
        lm_head_topk(hidden, weight, 31)


def test_drafter_pool_through_the_kernel_skips_the_logits(kernels):
    target = make_tiny_target(vocab_size=96, dtype=torch.float32, seed=1)
    drafter = BlockDrafter.for_target(target, block_size=4)
    hidden = torch.randn(2, 3, target.hidden_size, generator=torch.Generator().manual_seed(0))
    kernels("reference")
    drafter.attach(target)  # the ops are chosen when a drafter is attached, never per call
    logits, ids, logprobs = drafter.pool(hidden, 6, with_logits=False)  # the reference always has them
    kernels("triton")
    drafter.attach(target)
    no_logits, got_ids, got_logprobs = drafter.pool(hidden, 6, with_logits=False)
    assert no_logits is None and torch.equal(got_ids, ids)
    close(got_logprobs, logprobs)
    close(drafter.pool(hidden, 6, with_logits=True)[0], logits)


def test_cuda_launch_settings_in_the_interpreter(device, monkeypatch):
    """The CUDA tiling (16-row blocks, 64-wide H steps, ~4 tiles per vocabulary split) on rows and a
    vocabulary that leave partial blocks and several splits to merge."""
    monkeypatch.setattr("drelay.kernels.lm_head_topk.interpreting", lambda: False)
    gen = torch.Generator().manual_seed(5)
    hidden, weight = torch.randn(3, 7, 70, generator=gen).to(device), torch.randn(2100, 70, generator=gen).to(device)
    ids, logprobs, lse = lm_head_topk(hidden, weight, 6)
    ref_ids, ref_logprobs, ref_lse = lm_head_topk_ref(hidden, weight, 6)
    assert torch.equal(ids, ref_ids)
    close(logprobs, ref_logprobs)
    close(lse, ref_lse)
