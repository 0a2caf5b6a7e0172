"""Metric names -> `evaluate` module locations: the local ones under eval/metrics/ first, the hub only if allowed.

`evaluate.load("exact_match")` fetches its script from the Hugging Face hub, which air-gapped
clusters (and this machine) cannot reach; a local module directory whose script is named like the
directory loads offline. Both sides use this module: the flow calls `check_eval_config` /
`check_metric_names` before any job is submitted, so a typo in a metric name is a config error,
not a failure after training; the evaluate job loads what `resolve_metric` names (eval/metrics_loader.py).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from tuneproof.core.config import PROJECT_ROOT
from tuneproof.core.files import not_a_file
from tuneproof.core.names import storage_root_problem

if TYPE_CHECKING:
    from tuneproof.core.config_eval import EvalConfig, Gate, SuiteConfig

METRICS_DIR = PROJECT_ROOT / "eval" / "metrics"
LOSS_METRICS = ("eval_loss", "perplexity")
"""Computed for every model by eval/generation.py, not by an `evaluate` module."""


class MetricNotFound(LookupError):
    """A metric name that resolves to no local module, with the hub not allowed (or not having it)."""


def local_metrics() -> list[str]:
    """Names of the modules shipped under eval/metrics/ (each <name>/<name>.py)."""
    return sorted(d.name for d in METRICS_DIR.iterdir() if (d / f"{d.name}.py").is_file())


def resolve_metric(name: str, allow_hub: bool = False) -> str:
    """The local module directory for `name`, else `name` itself for evaluate.load when the hub is allowed."""
    if _is_slug(name) and (METRICS_DIR / name / f"{name}.py").is_file():
        return str(METRICS_DIR / name)
    if allow_hub:
        return name
    raise MetricNotFound(
        f"metric {name!r} is not a local module (eval/metrics/ has {', '.join(local_metrics())}) and "
        f"eval.hub_metrics is false: add eval/metrics/{name}/{name}.py or allow hub metrics"
    )


def check_metric_names(names: list[str], allow_hub: bool = False) -> list[str]:
    """One problem per name that cannot be loaded, each naming the metric; [] when all resolve.

    The caller prefixes the field ("eval.metrics: ..."). With the hub allowed, a non-local name is
    checked by fetching its script (network I/O).
    """
    problems = []
    for name in names:
        if name in LOSS_METRICS:
            problems.append(
                f"metric {name!r} is computed for every model already ({', '.join(LOSS_METRICS)}); remove it from the list"
            )
            continue
        try:
            source = resolve_metric(name, allow_hub)
        except MetricNotFound as e:
            problems.append(str(e))
            continue
        if source == name and not _hub_has(name):
            problems.append(f"metric {name!r} is neither under eval/metrics/ nor on the Hugging Face hub")
    return problems


def check_gate_names(metric_names: list[str], gate_names: list[str]) -> list[str]:
    """One 'eval.gates.<name>: ...' problem per gate on a value no configured metric produces.

    Local modules report one value named like the module; a hub metric may report other keys
    (rouge -> rouge1, rougeL, ...), so with any hub metric configured unknown gate names pass here.
    """
    local = set(local_metrics())
    if not set(metric_names) <= local:
        return []
    produced = [*metric_names, *LOSS_METRICS]
    return [
        f"eval.gates.{gate}: no configured metric produces {gate!r} (computed: {', '.join(produced)})"
        for gate in gate_names
        if gate not in produced
    ]


FRACTIONS = ("accuracy", "exact_match", "rouge_l")
"""The shipped metrics whose values are fractions, 0..1, scored item by item (each item 0 or 1, or an F1)."""
HIGHER_IS_BETTER = {**dict.fromkeys(FRACTIONS, True), "eval_loss": False, "perplexity": False}
"""Which way each metric tuneproof knows improves: a gate pointing the other way passes worse models."""
FLOORS = {"eval_loss": 0.0, "perplexity": 1.0}
"""The least value a loss metric can take (a cross-entropy is >= 0, its exp >= 1)."""


def check_gate_ranges(gates: dict[str, Gate]) -> list[str]:
    """'eval.gates.<name>.<field>: ...' per gate that points the wrong way for a metric tuneproof knows, and per
    threshold no model's value can meet (pure).

    A gate of exact_match >= 1.01 fails every model, so its failure says nothing about this one: a config
    error, not a modeling verdict. A fraction lies in 0..1 and a difference of two in -1..1, and since its
    gates are decided on an interval over the items, whose bounds never reach the ends (a Wilson bound on
    300 of 300 right is 0.9874), an end itself cannot be met either: min 1, an improvement of 1, a regression
    of -1. A loss is compared on its point value, so its floor can be met but nothing below it. A threshold
    every model meets (min 0) is left alone: it judges nothing, and says so by passing (the image canary asks
    its gates only that the metric was computed)."""
    problems = []
    for name, gate in gates.items():
        higher = HIGHER_IS_BETTER.get(name)
        if higher is not None and gate.higher_is_better != higher:
            problems.append(
                f"eval.gates.{name}.higher_is_better: {str(gate.higher_is_better).lower()}, but a "
                f"{'higher' if higher else 'lower'} {name} is better: set higher_is_better: {str(higher).lower()} "
                "(as given, the gate would pass worse models and fail better ones)"
            )
            continue
        problems += [
            f"eval.gates.{name}.{field}: {getattr(gate, field)} cannot be met ({why}): every model would fail it, "
            "a verdict about none of them"
            for field, why in _unmeetable(name, gate).items()
        ]
    return problems


def _unmeetable(name: str, gate: Gate) -> dict[str, str]:
    """{field: why} for each threshold of `gate` that no value of metric `name` can meet (`gate` points the
    metric's way)."""
    if name in FLOORS:
        floor = FLOORS[name]
        return {"min": f"{name} is at least {floor:g}"} if gate.min is not None and gate.min < floor else {}
    if name not in FRACTIONS:
        return {}
    why = f"{name} is a fraction, 0..1, a difference of two lies in -1..1, and an interval over items never reaches an end"
    bad = {
        "min": gate.min is not None and gate.min >= 1.0,
        "min_improvement": gate.min_improvement is not None and gate.min_improvement >= 1.0,
        "max_regression": gate.max_regression is not None and gate.max_regression <= -1.0,
        "max_regression_vs_base": gate.max_regression_vs_base is not None and gate.max_regression_vs_base <= -1.0,
    }
    return {field: why for field, unmeetable in bad.items() if unmeetable}


def check_eval_config(eval_cfg: EvalConfig) -> list[str]:
    """Every metric, gate and suite problem of an EvalConfig as 'eval.<field>: ...' lines, before any job runs."""
    metric_problems = [f"eval.metrics: {p}" for p in check_metric_names(eval_cfg.metrics, eval_cfg.hub_metrics)]
    gate_problems = check_gate_names(eval_cfg.metrics, list(eval_cfg.gates)) + check_gate_ranges(eval_cfg.gates)
    return metric_problems + gate_problems + check_suites(eval_cfg.suites)


def check_suites(suites: dict[str, SuiteConfig]) -> list[str]:
    """'eval.suites.<name>.<field>: ...' per suite whose source is no form Storage reads, whose local file is not
    a file, or whose metric is not a local module (a suite is scored item by item: a hub metric may not score one item alone)."""
    problems = []
    for name, suite in suites.items():
        # Read through Storage: a scheme it cannot read (gs://, http://, a bare s3://) failed the data stage late.
        if scheme := storage_root_problem(suite.source):
            problems.append(f"eval.suites.{name}.source: {scheme} (got {suite.source!r})")
        elif "://" not in suite.source and (what := not_a_file(suite.source)):
            problems.append(f"eval.suites.{name}.source: {what} (got {suite.source!r}); give a JSONL file of items")
        problems += [f"eval.suites.{name}.metrics: {p}" for p in check_metric_names(suite.metrics, allow_hub=False)]
    return problems


def _is_slug(name: str) -> bool:
    return bool(name) and "/" not in name and "\\" not in name and not name.startswith(".")


def _hub_has(name: str) -> bool:
    from evaluate.loading import evaluation_module_factory

    try:
        evaluation_module_factory(name)
    except (FileNotFoundError, ConnectionError):
        return False
    return True
