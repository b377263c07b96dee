"""The eight evaluation benchmarks as one record type, read from the offline mirror (or the HF hub).

Files live under `<mirror>/benchmarks/` (see its SOURCES.md); if a file is missing the same set is
loaded from the hub through `datasets` (when installed), else DataNotFoundError names both.

Prompt formats (the user message of each turn). We follow the public DFlash benchmark code so that
acceptance lengths are comparable with the DFlash paper (our own code, same strings):
- gsm8k, math500, aime24, aime25: problem + MATH_SUFFIX (DESIGN §2; identical in DFlash,
  z-lab/dflash `dflash/benchmark.py` @44947fb and `model/utils.py` @bb48ef9).
- humaneval: "Write a solution to the following problem and make sure that it passes the tests:"
  then the function stub in a ```python fence (DFlash, same files).
- mbpp: the sanitized set's `prompt` text alone, without the test asserts (DFlash, same files).
  Note the model is not told the expected function name; SpecForge's benchmarker instead appends
  the tests ("... Your code should pass these tests: ... [BEGIN]").
- mt_bench: the two questions as written (DFlash, FastChat). Turn 2 is sent after the model's OWN
  answer to turn 1 (as DFlash and FastChat do): use `conversation(sample, answers)`.
- alpaca: the instruction, plus "\\n\\nInput:\\n" + input when the row has one (DFlash
  `model/utils.py` @bb48ef9). The mirror's AlpacaEval rows have no input field.

Data oddity: DESIGN's hub id for alpaca, tatsu-lab/alpaca, is the 52k Alpaca *training* set
(what DFlash benchmarks on), while the mirror holds the 805-instruction AlpacaEval set. The hub
fallback therefore gives a different, much larger set; a warning says so.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from drelay.io import DataFormatError, HubSource, load_rows, read_jsonl

MATH_SUFFIX = "\nPlease reason step by step, and put your final answer within \\boxed{}."
HUMANEVAL_HEADER = "Write a solution to the following problem and make sure that it passes the tests:"

BENCHMARK_NAMES = ("gsm8k", "math500", "aime24", "aime25", "humaneval", "mbpp", "mt_bench", "alpaca")
HF_IDS = {
    "gsm8k": "openai/gsm8k",
    "math500": "HuggingFaceH4/MATH-500",
    "aime24": "HuggingFaceH4/aime_2024",
    "aime25": "MathArena/aime_2025",
    "humaneval": "openai/openai_humaneval",
    "mbpp": "google-research-datasets/mbpp",
    "mt_bench": "HuggingFaceH4/mt_bench_prompts",
    "alpaca": "tatsu-lab/alpaca",
}
MBPP_TEST_IDS = range(11, 511)  # the MBPP test range; the sanitized set has 257 problems in it


@dataclass(frozen=True)
class BenchmarkSample:
    """One evaluation item. `turns` are the user messages, already formatted: one per set, except
    MT-Bench's two, where turn 2 follows the model's own answer to turn 1 (see `conversation`).
    `reference` is the set's reference answer where it has one, for information only."""

    id: str  # "<benchmark>/<the set's own id, or the row index>"
    benchmark: str
    turns: tuple[str, ...]
    reference: str | None

    @classmethod
    def from_dict(cls, d: dict) -> BenchmarkSample:
        """The inverse of `dataclasses.asdict` (what `write_jsonl` stores)."""
        return cls(id=d["id"], benchmark=d["benchmark"], turns=tuple(d["turns"]), reference=d["reference"])


def conversation(sample: BenchmarkSample, answers: list[str]) -> list[dict]:
    """Chat messages for turn len(answers)+1: user 1, assistant `answers[0]`, user 2, ...
    `answers` are the model's own earlier replies, so each method is scored on its own dialogue."""
    if len(answers) >= len(sample.turns):
        raise ValueError(f"{sample.id} has {len(sample.turns)} turn(s); got {len(answers)} answer(s) already")
    messages = []
    for user, assistant in zip(sample.turns, answers):
        messages += [{"role": "user", "content": user}, {"role": "assistant", "content": assistant}]
    messages.append({"role": "user", "content": sample.turns[len(answers)]})
    return messages


# ---- prompt formats --------------------------------------------------------------------------


def math_prompt(problem: str) -> str:
    return problem + MATH_SUFFIX


def humaneval_prompt(stub: str) -> str:
    return f"{HUMANEVAL_HEADER}\n```python\n{stub}\n```"


def mbpp_prompt(text: str) -> str:
    """DFlash sends the problem statement alone (see the module docstring)."""
    return text


def instruction_prompt(instruction: str, input_text: str = "") -> str:
    return f"{instruction}\n\nInput:\n{input_text}" if input_text else instruction


# ---- one row of each set -> BenchmarkSample (the same for mirror and hub rows) ---------------


def _sample(name: str, native_id: object, turns: list[str], reference: object) -> BenchmarkSample:
    ref = None if reference is None else str(reference)
    return BenchmarkSample(f"{name}/{native_id}", name, tuple(turns), ref)


def _gsm8k(i: int, row: dict) -> BenchmarkSample:
    answer = row["answer"].split("####")[-1].strip()  # the solution ends with "#### <number>"
    return _sample("gsm8k", i, [math_prompt(row["question"])], answer)


def _math500(i: int, row: dict) -> BenchmarkSample:
    return _sample("math500", row["unique_id"], [math_prompt(row["problem"])], row["answer"])


def _aime(name: str) -> Callable[[int, dict], BenchmarkSample]:
    # aime24 rows carry an id (60..89); aime25 rows do not (hub: problem_idx), so the row index
    return lambda i, row: _sample(name, row.get("id", i), [math_prompt(row["problem"])], row["answer"])


def _humaneval(i: int, row: dict) -> BenchmarkSample:
    number = row["task_id"].split("/")[-1]  # "HumanEval/17" -> 17
    return _sample("humaneval", number, [humaneval_prompt(row["prompt"])], row["canonical_solution"])


def _mbpp(i: int, row: dict) -> BenchmarkSample | None:
    if row["task_id"] not in MBPP_TEST_IDS:
        return None
    return _sample("mbpp", row["task_id"], [mbpp_prompt(row["prompt"])], row["code"])


def _mt_bench(i: int, row: dict) -> BenchmarkSample:
    # FastChat (mirror): question_id, turns, reference; hub: prompt_id, prompt, reference
    turns = row["turns"] if "turns" in row else row["prompt"]
    reference = row.get("reference") or None  # per-turn references (math, reasoning, coding only)
    ref = None if reference is None else "\n\n".join(reference)
    return _sample("mt_bench", row.get("question_id", row.get("prompt_id")), list(turns), ref)


def _alpaca(i: int, row: dict) -> BenchmarkSample:
    prompt = instruction_prompt(row["instruction"], row.get("input") or "")
    return _sample("alpaca", i, [prompt], row.get("output"))


@dataclass(frozen=True)
class _Set:
    path: str  # under <mirror>/benchmarks/
    hub: HubSource
    to_sample: Callable[[int, dict], BenchmarkSample | None]  # None: the row is not in the set


_SETS = {
    "gsm8k": _Set("gsm8k/test.jsonl", HubSource(HF_IDS["gsm8k"], "main", "test"), _gsm8k),
    "math500": _Set("math500/test.jsonl", HubSource(HF_IDS["math500"], None, "test"), _math500),
    "aime24": _Set("aime24/test.jsonl", HubSource(HF_IDS["aime24"], None, "train"), _aime("aime24")),
    "aime25": _Set("aime25/test.jsonl", HubSource(HF_IDS["aime25"], None, "train"), _aime("aime25")),
    "humaneval": _Set("humaneval/HumanEval.jsonl.gz", HubSource(HF_IDS["humaneval"], None, "test"), _humaneval),
    "mbpp": _Set("mbpp/sanitized-mbpp.json", HubSource(HF_IDS["mbpp"], "sanitized", "test"), _mbpp),
    "mt_bench": _Set("mt_bench/question.jsonl", HubSource(HF_IDS["mt_bench"], None, "train"), _mt_bench),
    "alpaca": _Set("alpaca_eval/model_outputs.json", HubSource(HF_IDS["alpaca"], None, "train"), _alpaca),
}


def load_benchmark(name: str, mirror: str | Path, limit: int | None = None) -> list[BenchmarkSample]:
    """Benchmark `name` in its file's order (the first `limit` samples if given)."""
    if name not in _SETS:
        raise ValueError(f"unknown benchmark {name!r}; valid: {', '.join(BENCHMARK_NAMES)}")
    spec = _SETS[name]
    path = Path(mirror) / "benchmarks" / spec.path
    from_mirror = path.is_file()
    rows = load_rows(path, spec.hub)
    if name == "alpaca" and not from_mirror:
        warnings.warn(f"{path} not found: {spec.hub.id} from the hub is the 52k Alpaca training set, "
                      "not the 805-instruction AlpacaEval set of the mirror", stacklevel=2)
    samples = []
    for i, row in enumerate(rows):
        if limit is not None and len(samples) >= limit:
            break
        try:
            sample = spec.to_sample(i, row)
        except (KeyError, TypeError, AttributeError) as e:
            where = path if from_mirror else spec.hub.id
            raise DataFormatError(f"{where}: record {i + 1}: unexpected fields ({type(e).__name__}: {e})") from None
        if sample is not None:
            samples.append(sample)
    return samples


def load_prepared_benchmark(benchmarks_dir: str | Path, name: str, limit: int | None = None) -> list[BenchmarkSample]:
    """Benchmark `name` as prepare_data wrote it (<data.out_dir>/benchmarks/<name>.jsonl, the same samples in
    the same order as `load_benchmark`), the first `limit` samples if given."""
    if name not in _SETS:
        raise ValueError(f"unknown benchmark {name!r}; valid: {', '.join(BENCHMARK_NAMES)}")
    path = Path(benchmarks_dir) / f"{name}.jsonl"
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing (the prepare_data stage writes it)")
    records = read_jsonl(path)
    try:
        return [BenchmarkSample.from_dict(r) for r in records[:limit]]
    except KeyError as e:
        raise DataFormatError(f"{path}: a record lacks the field {e}") from None
