"""`tuneproof lint` and `tuneproof verify --from-files`: plain functions the CLI calls, returning exit codes.

    tuneproof lint deployments/ [--config configs/eks.yaml] [--set k=v]...
    tuneproof verify --from-files DIR [--config configs/eks.yaml] [--json]

Both default to configs/eks.yaml: the manifests and saved objects they read are the eks cluster's.
Lint also reads the project's prefect.yaml (the deployments that run on the manifests' worker)
unless a prefect.yaml is among the paths.
Exit codes: 0 no errors (warnings and notes allowed), 1 lint errors, 3 invalid config,
4 (infrastructure) when the saved cluster objects fail verification or cannot be read.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from tuneproof.app.terminal import printable
from tuneproof.core.config import PROJECT_ROOT, ConfigError, PipelineConfig, load_config
from tuneproof.core.findings import Finding, errors
from tuneproof.core.results import EXIT_BY_CLASS, EXIT_INVALID_CONFIG, EXIT_OK, FailureClass

EKS_PROFILE = PROJECT_ROOT / "configs" / "eks.yaml"
PREFECT_PROJECT = PROJECT_ROOT / "prefect.yaml"
EXIT_LINT_ERRORS = 1


def lint_command(paths: list[str], config_path: str | None, sets: list[str], read_s3_pointer: bool = False) -> int:
    """Print every finding over the manifests; non-zero when any is an error.

    EKS runs pin the image images/current.json names once a canary adopted one, so the manifests are
    checked against that image: read from a local storage root always, from S3 only when asked
    (read_s3_pointer: it needs credentials and the network, which lint otherwise never does)."""
    from tuneproof.app.lint import lint_paths

    try:
        cfg = _config(config_path, sets)
        cfg, pointer_findings, against = with_adopted_image(cfg, read_s3_pointer)
        findings = pointer_findings + lint_paths(with_prefect_project(paths), cfg)
    except ConfigError as e:
        return _config_error(e)
    except FileNotFoundError as e:
        print(printable(e), file=sys.stderr)
        return EXIT_LINT_ERRORS
    _print_findings(findings)
    print(
        printable(
            _tally(
                findings, f"lint of {', '.join(paths)}" + (f" against profile {cfg.profile}{against}" if cfg else "")
            )
        )
    )
    return EXIT_LINT_ERRORS if errors(findings) else EXIT_OK


def with_adopted_image(cfg: PipelineConfig | None, read_s3: bool) -> tuple[PipelineConfig | None, list[Finding], str]:
    """(the config as EKS runs see it, a finding when the pointer cannot be read, what the tally says about it)."""
    from tuneproof.control import images
    from tuneproof.core.storage import Storage

    if cfg is None or cfg.cluster.backend != "eks":
        return cfg, [], ""
    storage = Storage.from_config(cfg.storage)
    where = storage.uri(images.IMAGES, images.CURRENT)
    if storage.is_s3 and not read_s3:
        return cfg, [], f" (image from the profile; {where} not read: --read-pointer reads it)"
    try:
        pointer, _ = images.read_current(storage)
    except Exception as e:  # noqa: BLE001 - credentials, network, a corrupt pointer: named, and lint goes on
        problem = Finding(
            where,
            "images/current.json",
            f"{type(e).__name__}: {e}",
            "a readable pointer",
            "cannot read the adopted image: the manifests were checked against the profile's",
            "warning",
        )
        return cfg, [problem], ""
    if pointer is None:
        return cfg, [], f" (no image adopted yet under {where})"
    return images.pinned(cfg, pointer), [], f" and the image {where} names (decision {pointer.decision_id})"


def verify_from_files_command(directory: str, config_path: str | None, sets: list[str], as_json: bool) -> int:
    """Run the Kubernetes half of verify over saved `kubectl get -o json` / `ray list nodes` files."""
    from tuneproof.control.kube import load_objects_from_dir
    from tuneproof.control.kube_checks import check_cluster, summarize

    try:
        cfg = _config(config_path, sets) or load_config(EKS_PROFILE, sets)
        objects = load_objects_from_dir(directory)
    except ConfigError as e:
        return _config_error(e)
    except (FileNotFoundError, ValueError) as e:
        print(printable(e), file=sys.stderr)
        return EXIT_BY_CLASS[FailureClass.infrastructure]
    try:
        findings = check_cluster(objects, cfg)
        summary = summarize(objects, cfg) if as_json else None
    except (KeyError, TypeError, AttributeError, ValueError, IndexError) as e:
        # The files parsed as Kubernetes objects, but a field holds a shape kubectl never writes.
        print(
            printable(
                f"{directory}: saved objects have an unexpected shape ({type(e).__name__}: {e}); "
                "save them again with the commands in deployments/README.md"
            ),
            file=sys.stderr,
        )
        return EXIT_BY_CLASS[FailureClass.infrastructure]
    if as_json:
        print(
            json.dumps(
                {"ok": not errors(findings), "findings": [f.to_json() for f in findings], "summary": summary},
                indent=2,
                default=str,
            )
        )
    else:
        _print_findings(findings)
        print(printable(_tally(findings, f"verify of {directory} against profile {cfg.profile}")))
    return EXIT_BY_CLASS[FailureClass.infrastructure] if errors(findings) else EXIT_OK


def with_prefect_project(paths: list[str]) -> list[str]:
    """The paths, plus the project's prefect.yaml when none of them is (or holds) a prefect.yaml."""
    named = any(Path(p).name == "prefect.yaml" or (Path(p) / "prefect.yaml").is_file() for p in paths)
    return paths if named or not PREFECT_PROJECT.is_file() else [*paths, str(PREFECT_PROJECT)]


def _config(config_path: str | None, sets: list[str]) -> PipelineConfig | None:
    """The given profile, else configs/eks.yaml when it exists (lint without a profile checks less)."""
    if config_path:
        return load_config(config_path, sets)
    return load_config(EKS_PROFILE, sets) if EKS_PROFILE.exists() else None


def _config_error(e: ConfigError) -> int:
    print("invalid config:", file=sys.stderr)
    for problem in e.problems:
        print(f"  {printable(problem)}", file=sys.stderr)
    return EXIT_INVALID_CONFIG


def _print_findings(findings: list[Finding]) -> None:
    order = {"error": 0, "warning": 1, "info": 2}
    for f in sorted(findings, key=lambda f: order[f.severity]):
        print(f"{f.severity.upper():7} {printable(f.line())}")


def _tally(findings: list[Finding], what: str) -> str:
    counts = {s: sum(1 for f in findings if f.severity == s) for s in ("error", "warning", "info")}
    verdict = "FAILED" if counts["error"] else "ok"
    return f"{what}: {verdict} ({counts['error']} errors, {counts['warning']} warnings, {counts['info']} notes)"
