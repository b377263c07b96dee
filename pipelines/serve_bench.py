"""serve_bench: end-to-end serving speed under SGLang 0.5.23 (a CUDA host), the paper's headline numbers.

Writes the prompt files of the benchmarks (`serve.out_dir`/prompts/<benchmark>.jsonl, from prepare_data's
copies: the host may be offline). Without CUDA it stops there and records
`{"skipped": "no CUDA", "reason": ...}` in metrics/serve.json, reports/serve.md and its MLflow run: no
numbers are made up. With CUDA, per configuration (no speculation, then each of `serve.methods` that
drelay.serving.export can write) and benchmark it starts a fresh `sglang.launch_server`, runs
`sglang.benchmark.serving` at each `serve.concurrency`, and stops the server; it writes output tokens/s,
TPOT, accept length and the speedup over no speculation per configuration, benchmark and concurrency
(drelay/serving/bench.py has the commands and why a server per benchmark).

    python -m pipelines.serve_bench [--params P] [--set serve.num_prompts=32]
"""

from pipelines.common import configure_environment, stage_main, stop_process, wait_for_health, write_metrics

configure_environment()

import json  # noqa: E402
import os  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

from prefect import flow, get_run_logger  # noqa: E402

from drelay.config import ConfigError, load_params  # noqa: E402
from drelay.data.benchmarks import load_prepared_benchmark  # noqa: E402
from drelay.serving import bench  # noqa: E402
from pipelines.tracking import stage_run  # noqa: E402

STAGE = "serve_bench"
REPORT = Path("reports/serve.md")


def serve_python(cfg) -> str:
    """The interpreter that runs SGLang's server and client: serve.python (~ expanded), else this one."""
    return os.path.expanduser(cfg.python) if cfg.python else sys.executable


def cuda_reason() -> str | None:
    """Why this host cannot serve (None when it can): no CUDA device visible to torch."""
    import torch

    if not torch.cuda.is_available():
        return (f"torch {torch.__version__} sees no CUDA device on this host; serve_bench needs a CUDA GPU with "
                f"sglang==0.5.23 installed (README, Serving)")
    return None


def write_prompt_files(params) -> dict[str, int]:
    """serve.out_dir/prompts/<benchmark>.jsonl: the first serve.num_prompts first user turns of each benchmark."""
    cfg = params.serve
    counts = {}
    for name in cfg.benchmarks:
        samples = load_prepared_benchmark(Path(params.data.out_dir) / "benchmarks", name, limit=cfg.num_prompts)
        bench.write_prompt_file(Path(cfg.out_dir) / "prompts" / f"{name}.jsonl", [s.turns[0] for s in samples])
        counts[name] = len(samples)
    return counts


def _wait_until_served(port: int, server: subprocess.Popen, timeout: float, log: Path) -> None:
    try:
        wait_for_health(f"http://127.0.0.1:{port}", timeout, server, what="the SGLang server", log=str(log),
                        interval=2)
    except RuntimeError as err:
        raise RuntimeError(f"{err}:\n{log.read_text()[-2000:]}") from None
    except TimeoutError as err:
        raise TimeoutError(f"{err}; raise serve.startup_timeout_s if the model needs longer to load") from None


def export_drafts(params, out: Path) -> dict[str, dict]:
    """The served methods' SGLang draft folders: {method: {"dir", "block_size"}} or {method: {"skipped"}}."""
    from drelay.serving.export import export_for_sglang

    joint = Path(params.joint.common.out_dir)
    drafts: dict[str, dict] = {}
    for method in params.serve.methods:
        if method in bench.NOT_EXPORTED:
            drafts[method] = {"skipped": bench.NOT_EXPORTED[method]}
            continue
        relay = joint / method / "relay" if method == "drelay" else None
        folder = export_for_sglang(joint / method / "drafter", out / "drafts" / method, params.target.path, relay)
        block_size = json.loads((folder / "config.json").read_text())["dflash_config"]["block_size"]
        drafts[method] = {"dir": str(folder), "block_size": block_size}
    return drafts


def serve_one(params, config: str, draft: dict | None, benchmark: str, log_dir: Path, results_dir: Path,
              logger) -> dict:
    """One fresh server for (config, benchmark), the client at each concurrency: {concurrency: numbers}."""
    cfg = params.serve
    python = serve_python(cfg)
    cmd = bench.server_command(python, params.target.path, cfg.port, config,
                               draft and draft["dir"], draft and draft["block_size"], cfg.server_args)
    log = log_dir / f"{config}.{benchmark}.server.log"
    with open(log, "wb") as sink:
        server = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=sink, stderr=subprocess.STDOUT,
                                  start_new_session=True)
    try:
        _wait_until_served(cfg.port, server, cfg.startup_timeout_s, log)
        numbers = {}
        for conc in cfg.concurrency:
            result = results_dir / f"{config}.{benchmark}.c{conc}.jsonl"
            result.unlink(missing_ok=True)  # the client appends
            client = bench.client_command(python, cfg.port, Path(cfg.out_dir) / "prompts" / f"{benchmark}.jsonl",
                                          cfg.num_prompts, conc, cfg.max_new_tokens, result, params.run.seed)
            done = subprocess.run(client, capture_output=True, text=True)
            if done.returncode != 0:
                raise RuntimeError(f"sglang.benchmark.serving failed ({config}, {benchmark}, concurrency {conc}):\n"
                                   f"{done.stderr[-2000:]}")
            numbers[conc] = bench.read_client_result(result, expected=cfg.num_prompts)
            logger.info(f"{config} {benchmark} c={conc}: {numbers[conc]['output_throughput']:.1f} tok/s, "
                        f"accept length {numbers[conc]['accept_length']}")
        return numbers
    finally:
        stop_process(server, grace=30)


@flow(name=STAGE)
def serve_bench_flow(params_path: str = "params.yaml", overrides: list[str] | None = None) -> dict:
    """SGLang serving speed per configuration, benchmark and concurrency (skipped, with the reason, without CUDA)."""
    params = load_params(params_path, overrides)
    cfg = params.serve
    logger = get_run_logger()
    with stage_run(STAGE, params, ["target", "serve"]) as tracker:
        out = Path(cfg.out_dir)
        prompt_files = write_prompt_files(params)
        drafts = export_drafts(params, out)  # also without CUDA: serve.out_dir can be copied to a GPU host
        reason = cuda_reason()
        if reason is not None:
            metrics = {"skipped": "no CUDA", "reason": reason, "prompt_files": prompt_files, "drafts": drafts}
            logger.warning(f"serve_bench skipped: {reason}")
            client = tracker.client
            client.set_tag(tracker.run_id, "skipped", "no CUDA")
            client.set_tag(tracker.run_id, "skip_reason", reason)
        else:
            log_dir, results_dir = out / "logs", out / "results"
            log_dir.mkdir(parents=True, exist_ok=True)
            results_dir.mkdir(parents=True, exist_ok=True)
            results: dict = {}
            for config in [bench.NONE, *cfg.methods]:
                draft = drafts.get(config)
                if draft is not None and "skipped" in draft:
                    results[config] = {"skipped": draft["skipped"]}
                    continue
                results[config] = {b: serve_one(params, config, draft, b, log_dir, results_dir, logger)
                                   for b in cfg.benchmarks}
            results = bench.with_speedups(results)
            metrics = {"results": results, "prompt_files": prompt_files, "drafts": drafts,
                       "gpu": _gpu_name(), "python": serve_python(cfg)}
            tracker.log_metrics({f"{config}/{b}/c{c}/{k}": v for config, per_bench in results.items()
                                 if "skipped" not in per_bench for b, per_conc in per_bench.items()
                                 for c, numbers in per_conc.items() for k, v in numbers.items()
                                 if isinstance(v, (int, float))})
            tracker.log_artifacts(results_dir, "client_results")
        REPORT.parent.mkdir(parents=True, exist_ok=True)
        REPORT.write_text(bench.markdown(metrics))
        tracker.log_artifact(REPORT)
        tracker.log_dict(metrics, "serve.json")
        path = write_metrics("serve", metrics)
        tracker.log_metrics({"wall_s": json.loads(path.read_text())["wall_s"]})
    return metrics


def _gpu_name() -> str:
    import torch

    return torch.cuda.get_device_name(0)


def require_inputs(params) -> None:
    """prepare_data's benchmark copies, the target and the served methods' train@ outputs; with CUDA also an
    interpreter that can import sglang and the plugin."""
    benchmarks = Path(params.data.out_dir) / "benchmarks"
    for name in params.serve.benchmarks:
        if not (benchmarks / f"{name}.jsonl").is_file():
            raise FileNotFoundError(f"{benchmarks / name}.jsonl is missing (the prepare_data stage writes it): "
                                    f"needed by serve_bench")
    if not Path(params.target.path, "config.json").is_file():
        raise FileNotFoundError(f"{params.target.path}/config.json is missing (the prepare_target stage makes it)")
    for method in params.serve.methods:
        if method in bench.NOT_EXPORTED:
            continue
        if method not in params.joint.methods:
            raise ConfigError(f"serve.methods has {method}, which joint.methods does not train")
        path = Path(params.joint.common.out_dir) / method / "drafter" / "config.json"
        if not path.is_file():
            raise FileNotFoundError(f"{path} is missing (the train@{method} stage makes it): needed by serve_bench")
    if cuda_reason() is not None:
        return  # the stage records the skip
    python = serve_python(params.serve)
    probe = subprocess.run([python, "-c", "import sglang, drelay.serving.plugin"], capture_output=True, text=True,
                           env={**os.environ})
    if probe.returncode != 0:
        raise ConfigError(f"serve.python ({python}) cannot import sglang and drelay.serving.plugin: install "
                          f"`pip install sglang==0.5.23 && pip install --no-deps -e .` there, or point serve.python "
                          f"at such an interpreter ({probe.stderr.strip().splitlines()[-1:]})")


if __name__ == "__main__":
    stage_main(serve_bench_flow, precheck=require_inputs)
