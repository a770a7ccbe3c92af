"""Resume policy: which config a resumed run uses and which run files go back to their checkpointed state.

The checkpoint mechanics (writing, verifying, finding and loading checkpoints) are :mod:`grpo_kit.trainer.checkpoints`;
the entry point that resumes a run is :func:`grpo_kit.app.run.resume`.
"""

from __future__ import annotations

import csv
import io
import os
from pathlib import Path

from grpo_kit.app.config import NULL_MEANS_AUTO, ConfigError, GRPOKitConfig
from grpo_kit.trainer.checkpoints import atomic_write_text

# Config fields that may differ from the run folder's saved config when resuming: they change how
# long the run goes, what is kept or where its metrics are reported, not the math of the steps already taken.
SAFE_RESUME_OVERRIDES = (
    "max_steps",
    "save_steps",
    "keep_checkpoints",
    "max_bad_steps",
    "loss_chunk_size",
    "scoring_batch_size",
    "report_to",
    "run_name",
)


def resume_config(run_dir: str | os.PathLike, overrides=(), config_values: dict | None = None):
    """The run folder's saved config, with only the overrides that are safe on resume.

    ``overrides``: ``key=value`` strings; ``config_values``: a mapping (e.g. a YAML file the user
    passed again). A value that differs from the saved one in a field outside
    :data:`SAFE_RESUME_OVERRIDES` raises ``ConfigError`` naming it.
    """
    run_dir = Path(run_dir)
    saved_path = run_dir / "config.yaml"
    if not saved_path.is_file():
        raise ConfigError(f"cannot resume {str(run_dir)!r}: it has no config.yaml (not a grpo_kit run folder)")
    saved = GRPOKitConfig.from_yaml(saved_path)
    for name in NULL_MEANS_AUTO:  # a run saved when 0 meant "automatic" for these
        if getattr(saved, name) == 0:
            setattr(saved, name, None)
    wanted = GRPOKitConfig.from_dict(saved.to_dict())
    for key, value in (config_values or {}).items():
        wanted.set(key, value)
    wanted.apply_overrides(list(overrides))
    given_dir = [o.split("=", 1)[1] for o in overrides if o.split("=", 1)[0].strip() == "output_dir"]
    given_dir += [str(config_values["output_dir"])] if config_values and "output_dir" in config_values else []
    for d in given_dir:
        if Path(d).resolve() != run_dir.resolve():
            raise ConfigError(f"output_dir={d!r}: a resumed run writes to its own folder {str(run_dir)!r}")
    wanted.output_dir = str(run_dir)
    saved.output_dir = str(run_dir)
    conflicts = [
        (k, v, getattr(wanted, k))
        for k, v in saved.to_dict().items()
        if getattr(wanted, k) != v and k not in SAFE_RESUME_OVERRIDES
    ]
    if conflicts:
        lines = "; ".join(f"{k}: saved {a!r}, given {b!r}" for k, a, b in conflicts)
        raise ConfigError(
            f"cannot resume {str(run_dir)!r} with a different config ({lines}). A resumed run uses the "
            f"run folder's config.yaml; the fields that may change on resume are "
            f"{', '.join(SAFE_RESUME_OVERRIDES)}. Start a new run folder to change the others."
        )
    return wanted.validate()


def restore_run_files(
    run_dir: str | os.PathLike, run_state: dict, columns: list[str], samples_path: Path
) -> list[dict]:
    """Put ``metrics.csv`` and ``samples.jsonl`` back to what they were at the checkpoint.

    Rows and samples written after it (by the run that was killed) are dropped, so the resumed run
    appends exactly the steps it redoes: no duplicate or missing rows. Returns the metrics rows.
    """
    history = list(run_state.get("metrics") or [])
    buf = io.StringIO(newline="")
    writer = csv.writer(buf)
    writer.writerow(columns)
    for row in history:
        writer.writerow([row.get(c) for c in columns])
    atomic_write_text(Path(run_dir) / "metrics.csv", buf.getvalue())
    keep = int(run_state.get("samples_bytes") or 0)
    samples_path = Path(samples_path)
    if samples_path.is_file() and samples_path.stat().st_size >= keep:
        with open(samples_path, "r+b") as fh:
            fh.truncate(keep)
            os.fsync(fh.fileno())
    else:
        samples_path.write_text("")
    return history
