"""drelay.training.write_prompts: the target writes user requests from its chat template (Magpie)."""

import pytest

from drelay.models.target import Target, TargetError, make_tiny_random_target
from drelay.training.write_prompts import DOMAIN_LINES, domain_lines, pre_query_ids, write_prompts
from tests.conftest import make_tiny_target

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def chat_target(tmp_path_factory) -> Target:
    """A tiny random Llama with SmolLM2's tokenizer and chat template (its text is gibberish)."""
    return Target.load(make_tiny_random_target(tmp_path_factory.mktemp("target") / "tiny"), dtype="float32")


def test_the_pre_query_is_the_template_up_to_the_users_message(chat_target):
    ids = pre_query_ids(chat_target, "You are a helpful AI assistant. The user will ask a question about history.")
    text = chat_target.tokenizer.decode(ids)
    assert text == ("<|im_start|>system\nYou are a helpful AI assistant. The user will ask a question about history."
                    "<|im_end|>\n<|im_start|>user\n")
    with pytest.raises(TargetError, match="no chat template"):
        pre_query_ids(make_tiny_target(), "x")


def test_domain_lines_use_every_line_before_repeating_one():
    jobs = domain_lines({"code": len(DOMAIN_LINES["code"]) + 2, "chat": 3}, seed=0)
    code = [line for domain, line in jobs if domain == "code"]
    assert sorted(code[: len(DOMAIN_LINES["code"])]) == sorted(DOMAIN_LINES["code"])
    assert code[-2:] == code[:2] and [d for d, _ in jobs].count("chat") == 3
    assert domain_lines({"code": 5}, seed=0) != domain_lines({"code": 5}, seed=1)


def test_writing_is_reproducible_under_a_seed(chat_target):
    def write(seed: int):
        out = write_prompts(chat_target, {"code": 3, "chat": 2}, temperature=1.0, max_new_tokens=8, batch_size=4,
                            seed=seed)
        return out, [(p.id, p.domain, p.text) for p in out.prompts + out.unfinished]

    first, texts = write(0)
    again, texts_again = write(0)
    assert texts == texts_again and len(texts) == 5
    assert write(1)[1] != texts
    assert sorted(i for i, _, _ in texts) == ["written/chat/0", "written/chat/1", "written/code/0", "written/code/1",
                                              "written/code/2"]
    assert all(i.split("/")[1] == domain for i, domain, _ in texts)
    assert first.requested == {"math": 0, "code": 3, "chat": 2} and first.seconds > 0
    assert 5 <= first.tokens <= 5 * 8 and all(p.source == "written" for p in first.prompts + first.unfinished)
    assert chat_target.layer_ids == []  # the capture it needed is taken off again
