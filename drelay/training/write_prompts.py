"""Training prompts the target writes itself (DESIGN §2, the Magpie recipe).

The target is given only the start of a conversation: its chat template up to the opening of a user
turn, with a system message naming a domain ("The user will ask a question about history."). An
instruct model continues that with a plausible user request, which becomes one training prompt. The
domain lines are many and varied, each used in turn (seeded order); requests are sampled at a
temperature with a seeded generator, so the same seed, settings and target write the same prompts.
A request still going at the token budget is returned as unfinished (the filter drops it).
"""

from __future__ import annotations

import random
import time

import torch
from tqdm import tqdm

from drelay.config import DOMAINS, WRITTEN_SOURCE
from drelay.data.prompts import Prompt, WrittenPrompts
from drelay.models.target import Target, TargetError
from drelay.training.distill import generate_batch

SYSTEM_TEMPLATE = "You are a helpful AI assistant. The user will ask {line}."
DOMAIN_LINES = {
    "math": (
        "a maths word problem about shopping and prices", "a maths word problem about time and speed",
        "an algebra question", "a geometry question about areas and angles", "a probability question",
        "a question about percentages and discounts", "a maths word problem about sharing things among friends",
        "a question about fractions", "a number theory puzzle", "a maths word problem about a school trip",
        "a question about solving an equation", "a maths word problem about saving money",
        "a counting and combinatorics question", "a maths word problem about a farm",
    ),
    "code": (
        "a Python programming question", "a request to write a Python function",
        "a request to write a JavaScript function", "a question about SQL queries",
        "a request to debug a piece of code", "a question about algorithms and data structures",
        "a request to explain what some code does", "a request to write a shell script",
        "a question about regular expressions", "a request to write unit tests for a function",
        "a question about object-oriented programming", "a request to write a C++ program",
        "a question about string manipulation in Python", "a request to optimise slow code",
        "a question about sorting and searching algorithms", "a request to write a Java class",
        "a question about recursion", "a request to parse a file with Python",
    ),
    "chat": (
        "a request for a short story", "a request for a poem", "a question about history",
        "a question about science", "a request for travel advice", "a question about cooking",
        "a request to write an email", "a request for career advice", "a question about health and fitness",
        "a request to explain a concept simply", "a request to summarise a text", "a question about philosophy",
        "a request to brainstorm ideas", "a question about economics", "a request for a product description",
        "a question about geography", "a request to role-play a character", "a question about literature",
        "a request for advice about a personal situation", "a logic or reasoning puzzle",
        "a request to compare two things", "a question about music or art", "a request to write a persuasive essay",
        "a question about physics or chemistry", "a request for study tips", "a request to plan an event",
    ),
}
assert tuple(DOMAIN_LINES) == DOMAINS


def pre_query_ids(target: Target, system: str) -> list[int]:
    """Token ids of the chat template up to where the user's first message would start, with
    `system` as the system message."""
    tokenizer = target.tokenizer
    if tokenizer is None or not tokenizer.chat_template:
        raise TargetError(f"target {target.name!r} has no chat template: it cannot write user requests")
    marker = "\u2063USER\u2063"  # text no template contains
    messages = [{"role": "system", "content": system}, {"role": "user", "content": marker}]
    text = tokenizer.apply_chat_template(messages, tokenize=False)
    if marker not in text:
        raise TargetError(f"the chat template of {target.name!r} drops the user's message")
    return tokenizer(text[: text.index(marker)], add_special_tokens=False)["input_ids"]


def domain_lines(counts: dict[str, int], seed: int) -> list[tuple[str, str]]:
    """(domain, line) for each request to write: each domain's lines in a seeded order, repeated."""
    rng = random.Random(seed)
    jobs = []
    for domain in DOMAINS:
        lines = rng.sample(DOMAIN_LINES[domain], len(DOMAIN_LINES[domain]))
        jobs += [(domain, lines[i % len(lines)]) for i in range(counts.get(domain, 0))]
    return jobs


def write_prompts(target: Target, counts: dict[str, int], *, temperature: float, max_new_tokens: int,
                  batch_size: int, seed: int) -> WrittenPrompts:
    """`counts[domain]` requests written by `target` per domain (see the module docstring)."""
    jobs = domain_lines(counts, seed)
    stop = set(target.stop_token_ids())
    generator = torch.Generator(device=target.device).manual_seed(seed)
    layer_ids = list(target.layer_ids)
    if not layer_ids:  # generate_batch reads captured features: capture one layer while writing
        target.set_layer_ids([0])
    out = WrittenPrompts(requested={d: counts.get(d, 0) for d in DOMAINS})
    numbers = {d: 0 for d in DOMAINS}
    t0 = time.perf_counter()
    bar = tqdm(total=len(jobs), desc="writing prompts", unit="prompt", dynamic_ncols=True, disable=not jobs)
    try:
        for start in range(0, len(jobs), batch_size):
            batch = jobs[start: start + batch_size]
            prompts = [pre_query_ids(target, SYSTEM_TEMPLATE.format(line=line)) for _, line in batch]
            for (domain, _), seq in zip(batch, generate_batch(target, prompts, max_new_tokens, stop,
                                                              temperature, generator)):
                response = seq.tokens[seq.prompt_len:].tolist()
                out.tokens += len(response)
                finished = bool(response) and response[-1] in stop
                text = target.tokenizer.decode(response[:-1] if finished else response,
                                               skip_special_tokens=True).strip()
                prompt = Prompt.user(f"{WRITTEN_SOURCE}/{domain}/{numbers[domain]}", WRITTEN_SOURCE, text, domain)
                numbers[domain] += 1
                (out.prompts if finished else out.unfinished).append(prompt)
            bar.update(len(batch))
            bar.set_postfix(tokens_per_s=f"{out.tokens / (time.perf_counter() - t0):.0f}")
    finally:
        bar.close()
        if not layer_ids:
            target.set_layer_ids([])
    out.seconds = time.perf_counter() - t0
    return out
