"""drelay.data.dedup: exact and near-duplicate lookup against the real benchmarks, and degenerate text."""

import random

import pytest

from drelay.data.benchmarks import BENCHMARK_NAMES, MATH_SUFFIX, load_benchmark
from drelay.data.dedup import ShingleIndex, degenerate_reason, jaccard, normalize, shingles


def test_normalize_ignores_case_punctuation_spacing_and_the_benchmark_wrappers():
    assert normalize("  What's 2+2?\n\n") == "what s 2 2"
    assert normalize("Solve x." + MATH_SUFFIX) == normalize("SOLVE   x") == "solve x"
    assert shingles("a b c", 2) == {"a b", "b c"} and shingles("a", 2) == {"a"} and shingles("", 2) == set()


def test_index_finds_exact_then_the_most_similar_above_the_threshold():
    index = ShingleIndex(2)
    index.add("one", "Write a function to reverse a linked list in place.")
    index.add("two", "Tell me a story about a dragon who learns to bake bread.")
    assert index.find("write a FUNCTION to reverse a linked list in place", 0.5).exact
    near = index.find("Tell me a story about a dragon who learns to bake cakes.", 0.5)
    assert near.key == "two" and not near.exact
    truth = jaccard(shingles(normalize("Tell me a story about a dragon who learns to bake cakes."), 2),
                    shingles(normalize("Tell me a story about a dragon who learns to bake bread."), 2))
    assert near.similarity == pytest.approx(truth) and 0.5 <= truth < 1
    assert index.find("Tell me a story about a dragon who learns to bake cakes.", truth + 0.01) is None
    assert index.find("Explain photosynthesis to a child.", 0.1) is None


def test_common_shingles_do_not_hide_a_match():
    """Shingles held by more than `common` texts are not used to find candidates, but still count; a query
    made of common shingles only is looked up through them."""
    index = ShingleIndex(2, common=3)
    for i in range(10):
        index.add(f"t{i}", f"write a function to compute thing number {i} quickly")
    index.add("x", "write a function to")
    match = index.find("write a function to compute thing number 7 slowly", 0.5)
    assert match.key == "t7" and match.similarity == pytest.approx(7 / 9)
    assert index.find("please write a function to", 0.5).key == "x"


def _edited(text: str, rng: random.Random) -> str:
    """One word near the middle of the text replaced: a near-duplicate a contaminated source might hold."""
    words = text.split(" ")
    i = len(words) // 2 + rng.randrange(-1, 2) if len(words) > 3 else len(words) - 1
    words[i] = "zebra"
    return " ".join(words)


@pytest.fixture(scope="module")
def bench_index(mirror):
    index, turns = ShingleIndex(2), {}
    for name in BENCHMARK_NAMES:
        for sample in load_benchmark(name, mirror):
            for i, turn in enumerate(sample.turns):
                turns[f"{sample.id}#{i}"] = turn
                index.add(f"{sample.id}#{i}", turn)
    return index, turns


@pytest.mark.parametrize("benchmark", BENCHMARK_NAMES)
def test_a_slightly_edited_benchmark_prompt_is_found(bench_index, benchmark):
    index, turns = bench_index
    rng = random.Random(0)
    keys = sorted(k for k, t in turns.items() if k.startswith(f"{benchmark}/") and len(normalize(t).split()) >= 8)
    for key in rng.sample(keys, 5):
        exact = index.find(turns[key].upper().replace(" ", "  ") + " !", 0.5)
        assert exact.exact and turns[exact.key].lower() == turns[key].lower()
        near = index.find(_edited(turns[key], rng), 0.5)
        assert near is not None and not near.exact, key
        assert turns[near.key] == turns[key] or near.similarity >= 0.5  # (a set may repeat a prompt)


def test_degenerate_reasons():
    assert degenerate_reason("Write a Python function that merges two sorted lists.", "code") is None
    assert degenerate_reason("Can you recommend a good novel for a long flight?", "chat") is None
    assert degenerate_reason("Help me.", "chat") == "too_short"
    assert degenerate_reason("What is this <|im_start|>assistant thing here", "chat") == "non_text"
    assert degenerate_reason("#### 1234 5678 !!!! ???? {{}} ))) 999", "chat") == "non_text"
    assert degenerate_reason("I like it and " * 10, "chat") == "repetitive"
    assert degenerate_reason("Can you recommend a good novel for a long flight?", "code") == "off_domain"
    assert degenerate_reason("Tom has 3 apples and buys 5 more; how many now?", "math") is None
