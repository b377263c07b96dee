"""The serving benchmark's pieces (the serve_bench stage, pipelines/serve_bench.py): prompt files in the
format of SGLang's `custom` dataset, the server and client command lines per configuration, and the
client's result read back. Nothing here imports sglang: the stage runs it as separate processes, in
the interpreter `serve.python` names.

One configuration is `none` (the target alone) or a method served as a speculative algorithm:
    dflash  -> DFLASH with our DFlash drafter (train@dflash's), exported by drelay.serving.export
    drelay  -> DRELAY (drelay/serving/plugin.py) with train@drelay's drafter and relay
    dspark  -> not exported: drelay.serving.export writes DFlash drafts (and our relay), and SGLang's DSPARK
               reads its own draft format, which our DSpark head is not written in; recorded as such.

SGLang's reported accept length is a running average since the server started, so the stage starts a
fresh server per configuration and benchmark; the concurrency levels run one after another on it (same
prompts, greedy: their acceptance is the same up to numerics, and the average covers them all).
"""

from __future__ import annotations

import json
from pathlib import Path

# method -> SGLang's --speculative-algorithm; a SERVE_METHODS name missing here has no export
ALGORITHMS = {"dflash": "DFLASH", "drelay": "DRELAY"}
NOT_EXPORTED = {"dspark": "our DSpark head has no SGLang export (drelay.serving.export writes DFlash drafts and "
                          "the DRelay relay; SGLang's DSPARK reads its own draft format)"}
NONE = "none"  # the configuration without speculation
# SGLang's custom dataset keeps rows with a user and an assistant turn; the assistant turn only sets the
# output length, which --sharegpt-output-len fixes instead.
_PLACEHOLDER = "(output length set by --sharegpt-output-len)"
RESULT_KEYS = ("output_throughput", "mean_tpot_ms", "median_tpot_ms", "mean_ttft_ms", "accept_length",
               "completed", "total_output_tokens", "duration")


def prompt_rows(turns: list[str]) -> list[dict]:
    """One JSONL row per prompt for `--dataset-name custom` (the first user turn of each sample)."""
    return [{"conversations": [{"role": "user", "content": turn}, {"role": "assistant", "content": _PLACEHOLDER}]}
            for turn in turns]


def write_prompt_file(path: Path, turns: list[str]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(row) + "\n" for row in prompt_rows(turns)))
    return path


def server_command(python: str, target: str | Path, port: int, method: str, draft_dir: str | Path | None = None,
                   block_size: int | None = None, extra: tuple[str, ...] | list[str] = ()) -> list[str]:
    """`python -m sglang.launch_server ...` for one configuration (`none` or a key of ALGORITHMS)."""
    cmd = [python, "-m", "sglang.launch_server", "--model-path", str(target), "--host", "127.0.0.1",
           "--port", str(port)]
    if method != NONE:
        if method not in ALGORITHMS:
            raise ValueError(f"no SGLang speculative algorithm for {method!r} (served: {', '.join(ALGORITHMS)})")
        if draft_dir is None or block_size is None:
            raise ValueError(f"{method}: a draft folder and its block size are needed")
        cmd += ["--speculative-algorithm", ALGORITHMS[method], "--speculative-draft-model-path", str(draft_dir),
                "--speculative-num-draft-tokens", str(block_size)]
    return cmd + list(extra)


def client_command(python: str, port: int, prompts: str | Path, num_prompts: int, concurrency: int,
                   max_new_tokens: int, output_file: str | Path, seed: int) -> list[str]:
    """`python -m sglang.benchmark.serving ...`: greedy, chat template applied, fixed output length (EOS
    ignored, SGLang's client default), one warm-up request, the result appended to `output_file`."""
    return [python, "-m", "sglang.benchmark.serving", "--backend", "sglang", "--base-url", f"http://127.0.0.1:{port}",
            "--dataset-name", "custom", "--dataset-path", str(prompts), "--num-prompts", str(num_prompts),
            "--max-concurrency", str(concurrency), "--apply-chat-template", "--temperature", "0",
            "--sharegpt-output-len", str(max_new_tokens), "--seed", str(seed), "--output-file", str(output_file),
            "--disable-tqdm"]


class ClientResultError(RuntimeError):
    """A benchmark client wrote no usable result."""


def read_client_result(path: str | Path, expected: int) -> dict:
    """The numbers of the client's last JSONL record (`RESULT_KEYS`); an error unless all `expected`
    requests completed."""
    path = Path(path)
    try:
        lines = [line for line in path.read_text().splitlines() if line.strip()]
        record = json.loads(lines[-1])
    except (FileNotFoundError, IndexError, json.JSONDecodeError) as err:
        raise ClientResultError(f"{path}: no benchmark result ({err.__class__.__name__}: {err})") from err
    if record.get("completed") != expected:
        raise ClientResultError(f"{path}: {record.get('completed')} of {expected} requests completed")
    return {key: record.get(key) for key in RESULT_KEYS}


def with_speedups(results: dict) -> dict:
    """results[config][benchmark][concurrency] = numbers -> the same with `speedup` (output tokens/s over
    `none`'s at that benchmark and concurrency) and a `mean` benchmark per configuration and concurrency."""
    base = results.get(NONE, {})
    out: dict = {}
    for config, per_bench in results.items():
        if not isinstance(per_bench, dict) or "skipped" in per_bench:
            out[config] = per_bench
            continue
        out[config] = {}
        for bench, per_conc in per_bench.items():
            out[config][bench] = {}
            for conc, numbers in per_conc.items():
                ref = base.get(bench, {}).get(conc, {}).get("output_throughput")
                speedup = numbers["output_throughput"] / ref if ref else None
                out[config][bench][conc] = {**numbers, "speedup": speedup}
        means: dict = {}
        for conc in {c for per_conc in out[config].values() for c in per_conc}:
            rows = [per_conc[conc] for per_conc in out[config].values() if conc in per_conc]
            means[conc] = {key: _mean([r.get(key) for r in rows])
                           for key in ("output_throughput", "mean_tpot_ms", "accept_length", "speedup")}
        out[config]["mean"] = means
    return out


def _mean(values: list) -> float | None:
    values = [v for v in values if isinstance(v, (int, float))]
    return sum(values) / len(values) if values else None


def _fmt(value, spec: str) -> str:
    return format(value, spec) if isinstance(value, (int, float)) else "-"


def markdown(metrics: dict) -> str:
    """reports/serve.md: the skip and its reason, or one table per concurrency (configuration x benchmark:
    output tokens/s, speedup over no speculation, accept length)."""
    lines = ["# Serving speed (SGLang)", ""]
    if "skipped" in metrics:
        lines += [f"Not measured: **{metrics['skipped']}**. {metrics.get('reason', '')}".rstrip(), ""]
        files = metrics.get("prompt_files", {})
        if files:
            lines += [f"Prompt files written for a GPU host: {', '.join(f'{b} ({n})' for b, n in files.items())}.", ""]
        return "\n".join(lines)
    results = metrics["results"]
    served = {c: r for c, r in results.items() if "skipped" not in r}
    benches = [b for b in next(iter(served.values()), {}) if b != "mean"]
    concurrencies = sorted({int(c) for r in served.values() for c in r.get("mean", {})})
    for conc in concurrencies:
        lines += [f"## Concurrency {conc}", "", "tokens/s · speedup over no speculation · accept length", "",
                  "| configuration | " + " | ".join([*benches, "mean"]) + " |",
                  "|---" * (len(benches) + 2) + "|"]
        for config, per_bench in served.items():
            cells = []
            for bench in [*benches, "mean"]:
                n = per_bench.get(bench, {}).get(conc) or per_bench.get(bench, {}).get(str(conc)) or {}
                cells.append(f"{_fmt(n.get('output_throughput'), '.1f')} · {_fmt(n.get('speedup'), '.2f')}x · "
                             f"{_fmt(n.get('accept_length'), '.2f')}")
            lines.append(f"| {config} | " + " | ".join(cells) + " |")
        lines.append("")
    for config, r in results.items():
        if "skipped" in r:
            lines.append(f"- {config}: not served: {r['skipped']}")
    return "\n".join(lines) + "\n"
