"""The promotion gate on a reproduced workspace (pipelines/registry.py): compares the version of
`registry.champion_method` the last `register` stage made with the `champion`, moves the alias only if it is
better, and prints the decision as one JSON line (the scheduled retrain flow reads it).

    python -m pipelines.promote [--params P]      # in the workspace (repo root or runs/<profile>/)
"""

from __future__ import annotations

from pipelines.common import configure_environment

configure_environment()

import argparse  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

from drelay.config import ConfigError, load_params  # noqa: E402
from pipelines.registry import RegistryError, promote  # noqa: E402
from pipelines.tracking import tracking_uri  # noqa: E402

REGISTERED = Path("metrics/register.json")


def reevaluator(params):
    """bundle dir -> the champion's per-sample τ on this workspace's evaluation (its cached continuations)."""
    def reevaluate(bundle: Path):
        from drelay.eval.run import replay_sample_taus
        from drelay.models.methods import load_speculator
        from drelay.models.target import Target

        target = Target.load(params.target.path, dtype=params.target.dtype, device=params.target.device)
        speculator = load_speculator(target, bundle.parent, params.registry.champion_method)
        return replay_sample_taus(target, speculator, params.eval, params.registry.temperature,
                                  benchmarks_dir=Path(params.data.out_dir) / "benchmarks",
                                  pool_size=params.decode.pool_size, max_prompt_tokens=params.distill.max_prompt_tokens,
                                  seed=params.run.seed, precision=params.train.precision,
                                  verify_size=params.decode.verify_size)
    return reevaluate


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--params", default="params.yaml")
    args = parser.parse_args(argv)
    try:
        params = load_params(args.params)
        if not REGISTERED.is_file():
            raise FileNotFoundError(f"{REGISTERED} is missing (the register stage writes it): run the pipeline first")
        registered = json.loads(REGISTERED.read_text())["models"]
        from mlflow.tracking import MlflowClient

        decision = promote(MlflowClient(tracking_uri()), params, registered, reevaluate=reevaluator(params))
    except (ConfigError, FileNotFoundError, RegistryError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(json.dumps(decision.as_dict()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
