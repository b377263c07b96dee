"""DRelay's ablation: the paper-literal `drelay-lite`, drelay-lite plus each v2 part alone, and every part
together (joint.drelay, DRelay v2; the variants share its other settings), each trained like a train@ stage (the train_dflash drafter continued for
joint.common.extra_steps on the same batches) and measured on the same held-out replay. One MLflow run
per variant (`ablation:<variant>`, tag `ablation`) so the variants compare side by side in the UI;
`reports/drelay_ablation.md` and `metrics/drelay_ablation.json` hold the table. Not a DVC stage (it
trains a dozen models): `make ablation [PROFILE=name]` runs it on a reproduced pipeline's outputs.
A killed run resumes: finished variants are read back, the running one from its checkpoint.

    python -m pipelines.ablation [--params P] [--set joint.common.extra_steps=50] [--only lattice,calibration]
"""

from pipelines.common import apply_run_settings, configure_environment, stage_main, write_metrics

configure_environment()

import dataclasses  # noqa: E402
import json  # noqa: E402
from pathlib import Path  # noqa: E402

from prefect import flow  # noqa: E402

from drelay.config import ConfigError, DRelayLiteSettings, DRelaySettings, load_params  # noqa: E402
from drelay.data.records import load_distilled, split_sequences  # noqa: E402
from drelay.models.drafter import BlockDrafter, DrafterError  # noqa: E402
from drelay.models.target import Target  # noqa: E402
from drelay.training.trainer import train_method  # noqa: E402
from pipelines.tracking import stage_run  # noqa: E402
from pipelines.train import oracle_gap_closed  # noqa: E402

LITE = "drelay-lite"
ALL = "drelay (all)"
# Each v2 part and the settings fields that switch it on (DESIGN §1.3-§1.6); a part takes joint.drelay's values
PARTS: dict[str, tuple[str, ...]] = {
    "token tables": ("token_rank",),
    "anchor token": ("anchor_token",),
    "lattice": ("lattice_rank",),
    "lattice + vocabulary CE": ("lattice_rank", "lattice_ce"),
    "lattice + bigram": ("lattice_rank", "lattice_ce", "lattice_bigram"),
    "lattice + messages": ("lattice_rank", "lattice_messages", "lattice_ce"),
    "calibration": ("calibrate", "repair_margins"),
    "co-adaptation": ("coadapt", "ce_weight_final"),
    "ω reach": ("omega",),
    "repair weight": ("repair_weight",),
    "position-weighted hinge": ("hinge_position_weighted",),
}
COLUMNS = (("replay_tau", "τ"), ("gain", "Δτ vs lite"), ("oracle_gap_closed", "oracle gap closed"),
           ("replay_replace_rate", "replace"), ("replay_repair_precision", "precision"),
           ("replay_harm_rate", "harm"), ("repair_margin", "δ"))
REPORT = Path("reports/drelay_ablation.md")


def variants(full: DRelaySettings, only: list[str] | None = None) -> dict[str, DRelayLiteSettings]:
    """{name: settings} from joint.drelay: drelay-lite (joint.drelay with every part of PARTS as
    DRelayLiteSettings has it), drelay-lite + each part (skipped where joint.drelay leaves it as lite has it),
    and joint.drelay itself (all together). Every variant shares joint.drelay's other settings (reader
    size, λ's, ...), so a row differs from drelay-lite by its part alone. `only`: the parts to run
    (drelay-lite and all together always run)."""
    unknown = sorted(set(only or ()) - set(PARTS))
    if unknown:
        raise ValueError(f"unknown ablation part(s) {', '.join(unknown)} (parts: {', '.join(PARTS)})")
    off = DRelayLiteSettings()
    lite = DRelayLiteSettings(**{**dataclasses.asdict(full),
                                 **{k: getattr(off, k) for keys in PARTS.values() for k in keys}})
    out = {LITE: lite}
    for part, keys in PARTS.items():
        if only and part not in only:
            continue
        change = {k: getattr(full, k) for k in keys}
        if all(getattr(lite, k) == v for k, v in change.items()):
            continue
        out[f"+ {part}"] = dataclasses.replace(lite, **change)
    out[ALL] = DRelayLiteSettings(**dataclasses.asdict(full))
    return out


def slug(name: str) -> str:
    """A folder name: runs of anything but letters and digits become one "_"."""
    return "_".join("".join(c if c.isalnum() else " " for c in name).split())


def table(rows: dict[str, dict]) -> str:
    """The markdown report: one row per variant, then acceptance per block position."""
    lines = ["# DRelay ablation", "",
             "Every variant continues the same train_dflash drafter for the same extra steps on the same batches, "
             "and is measured by replay on the same held-out distilled sequences (δ chosen there too). "
             f"Native (dflash) τ {next(iter(rows.values()))['native_tau']:.3f}, oracle τ "
             f"{next(iter(rows.values()))['oracle_tau']:.3f} (the starting drafter's, after the extra steps of "
             f"the {LITE} run).", "",
             "| variant | " + " | ".join(label for _, label in COLUMNS) + " |", "|---|" + "---|" * len(COLUMNS)]
    for name, row in rows.items():
        cells = [f"{row[k]:+.3f}" if k == "gain" else f"{row[k]:.3f}" if k in row else "—" for k, _ in COLUMNS]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    positions = sorted({int(k.rsplit("pos", 1)[1]) for row in rows.values() for k in row
                        if k.startswith("replay_accept_pos")})
    if positions:
        lines += ["", "Acceptance rate per block position (held-out replay):", "",
                  "| variant | " + " | ".join(str(p) for p in positions) + " |", "|---|" + "---|" * len(positions)]
        for name, row in rows.items():
            lines.append(f"| {name} | " + " | ".join(f"{row.get(f'replay_accept_pos{p}', float('nan')):.3f}"
                                                   for p in positions) + " |")
    return "\n".join(lines) + "\n"


@flow(name="ablation")
def ablation_flow(params_path: str = "params.yaml", overrides: list[str] | None = None,
                  only: str | None = None) -> dict:
    """DRelay's ablation (see the module docstring) on the train_dflash drafter and the distilled data."""
    params = load_params(params_path, overrides)
    apply_run_settings(params)
    joint, train_cfg = params.joint, params.train
    chosen = variants(joint.drelay, [p.strip() for p in only.split(",")] if only else None)
    target = Target.load(params.target.path, dtype=params.target.dtype, device=params.target.device)
    train, val = split_sequences(load_distilled(params.distill.out_dir), train_cfg.val_fraction, params.run.seed)
    root = Path(joint.common.out_dir).parent / "ablation"
    rows: dict[str, dict] = {}
    for name, settings in chosen.items():
        folder = root / slug(name)
        done = folder / "result.json"
        stamp = json.loads(json.dumps(dataclasses.asdict(settings)))  # as read back (tuples become lists)
        if done.is_file() and json.loads(done.read_text()).get("settings") == stamp:
            rows[name] = json.loads(done.read_text())["metrics"]  # finished in an earlier run
            continue
        cfg = dataclasses.replace(joint, drelay_lite=settings, common=dataclasses.replace(
            joint.common, out_dir=str(folder), checkpoint_dir=str(Path("checkpoints/ablation") / slug(name))))
        with stage_run(f"ablation:{name}", params, ["target", "drafter", "train", "joint"]) as tracker:
            tracker.client.set_tag(tracker.run_id, "ablation", name)
            tracker.client.log_param(tracker.run_id, "ablation.settings", json.dumps(dataclasses.asdict(settings)))
            try:
                drafter = BlockDrafter.load(train_cfg.out_dir, target).float()
            except DrafterError as err:
                raise FileNotFoundError(f"{err} (the train_dflash stage makes it)") from err
            result = train_method(LITE, drafter, train, val, cfg, train_cfg, pool_size=params.decode.pool_size,
                                  seed=params.run.seed, log=lambda m, step: tracker.log_metrics(m, step=step))
            final = result.final
            metrics = {k: v for k, v in final.items() if k.startswith("replay_")}
            metrics.update(native_tau=final["native_tau"], oracle_tau=final["oracle_tau"],
                           oracle_gap_closed=oracle_gap_closed(final["replay_tau"], final["native_tau"],
                                                               final["oracle_tau"]),
                           **result.method_metrics)
            tracker.log_metrics({k: v for k, v in metrics.items() if not k.startswith("replay_") or "_pos" not in k})
            done.write_text(json.dumps({"settings": stamp, "metrics": metrics}))
        rows[name] = metrics
    lite_tau = rows[LITE]["replay_tau"]
    for row in rows.values():
        row["gain"] = row["replay_tau"] - lite_tau
    REPORT.parent.mkdir(parents=True, exist_ok=True)
    REPORT.write_text(table(rows))
    write_metrics("drelay_ablation", {name: {k: v for k, v in row.items() if "_pos" not in k}
                                      for name, row in rows.items()})
    return rows


def require_inputs(params, only: str | None = None) -> None:
    needed = {Path(params.train.out_dir) / "config.json": "the train_dflash stage makes it",
              Path(params.distill.out_dir) / "manifest.json": "the distill stage makes it"}
    for path, maker in needed.items():
        if not path.is_file():
            raise FileNotFoundError(f"{path} is missing ({maker}): needed by the ablation")
    if only:
        try:
            variants(params.joint.drelay, [p.strip() for p in only.split(",")])
        except ValueError as err:
            raise ConfigError(str(err)) from None  # stage_main: one error line, exit 2


if __name__ == "__main__":
    stage_main(ablation_flow, options={"only": dict(default=None, help="comma-separated parts to run (default: all)")},
               precheck=require_inputs)
