"""Links into the MLflow UI that open each `drelay-<profile>` experiment on its runs table (`make ui` prints them).

MLflow 3.17's UI opens every experiment on its GenAI "Overview" (traces: empty for us) unless the page asks
for the model-training view: the experiment's `mlflow.experimentKind` tag, which the stages set, does not
change that landing page (checked in a headless browser). `?workflowType=machine_learning` in the URL
does, and the "Model training" switch at the top left of the UI keeps that choice for the browser.

    python -m pipelines.ui [PORT]
"""

from __future__ import annotations

import sys

from pipelines.tracking import tracking_uri


def links(port: int) -> list[str]:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri())
    base = f"http://127.0.0.1:{port}/#"
    out = [f"{e.name:<24} {base}/experiments/{e.experiment_id}?workflowType=machine_learning"
           for e in client.search_experiments() if e.name.startswith("drelay-")]
    if client.search_registered_models(max_results=1):
        out.append(f"{'registered models':<24} {base}/models?workflowType=machine_learning")
    return out


if __name__ == "__main__":
    port = int(sys.argv[1]) if len(sys.argv) > 1 else 5000
    found = links(port)
    print("MLflow UI (the runs tables; the UI's default landing page is an empty GenAI overview):")
    print("\n".join(f"  {line}" for line in found) or "  no drelay experiment yet: run the pipeline first")
