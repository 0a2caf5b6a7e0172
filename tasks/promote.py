"""The promote stage (a Prefect task, not a Ray job): only on evidence, and never over a stale incumbent.

Promotion needs evidence about exactly the model it copies: the current (not superseded) evaluation
passed every gate for the content hash of the current fine-tune's export, the export in storage still
has that hash, and the resume test passed on the same fine-tune's Ray Train run; each of those stages
read the settings this config gives (evidence reached under another config, or another model's, is
refused), no rollback moved production away from that content, and evaluate saved answers to score the
copy with. The model is copied to models/<name>/<version>/ with its card (the copy checked against the
hash), then the production pointer, naming the hash, moves with a compare-and-swap on the pointer the
evaluation compared against, so two concurrent runs cannot both promote over the same incumbent. A
refusal leaves the pointer untouched and says why; what fails after the pointer moved (publishing the
history) is a warning. `tuneproof promote RUN --force --reason` is the logged override (it bypasses the
gates and a rollback, never the check that the copied files are the export's own).
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Callable
from contextlib import nullcontext
from typing import Any

from prefect import task
from prefect.artifacts import create_markdown_artifact
from prefect.cache_policies import NO_CACHE
from pydantic import BaseModel, ConfigDict, ValidationError

from tasks import artifacts
from tasks.jobs import StageCall, runner_for
from tuneproof.control import cost, history, registry
from tuneproof.control import record as records
from tuneproof.control import rollback as rollbacks
from tuneproof.control import stages as table
from tuneproof.control.cost import VersionCost
from tuneproof.control.history import MoveIntent
from tuneproof.control.lease import Lease, LeaseHeld
from tuneproof.control.record import Invocation, JobEntry, Override, RolledBack, RunRecord, StageEntry
from tuneproof.core import config_reads, markers
from tuneproof.core.config import PipelineConfig
from tuneproof.core.config_eval import COPY_CHECK_EXAMPLES
from tuneproof.core.config_train import LORA_ADAPTER_DIR
from tuneproof.core.results import FailureClass, first_problem, now_iso
from tuneproof.core.storage import Storage
from tuneproof.core.summaries_data import DataSummary
from tuneproof.core.summaries_eval import ApprovalAnswer, CopyCheckSummary, EvaluateSummary, Forced, PromoteSummary
from tuneproof.core.summaries_training import FinetuneSummary, ResumeSummary


def refusal_reasons(cfg: PipelineConfig, record: RunRecord) -> list[str]:
    """Why this run may not be promoted (empty when it may). Pure over the record."""
    finetune = record.summary("finetune", FinetuneSummary) if record.passed("finetune") else None
    if finetune is None or finetune.export_sha256 is None:
        return [f"run {record.run_id} has no succeeded fine-tune with a hashed export: run finetune first"]
    return config_reasons(cfg, record) + resume_reasons(cfg, record, finetune) + evaluation_reasons(record, finetune)


def config_reasons(cfg: PipelineConfig, record: RunRecord) -> list[str]:
    """The evidence stages that read a setting whose value `cfg` does not give: their verdict was reached under
    another config (a `--only promote` with other settings, another model's run), so it is not this one's.
    Compared by each stage's observed inputs (StageInputs.config: sha256 per setting read), the data stage's
    included: the evaluation scored the eval split data prepared, and no evaluate or fine-tune job reads a data.*
    source setting, so only data's reads show that `--only evaluate,promote` came after data.eval_source changed.
    Pure."""
    now = cfg.model_dump(mode="json")
    reasons = []
    for stage in ("data", *EVIDENCE_STAGES):
        entry = record.stages.get(stage)
        observed = observed_settings(record, entry) if entry is not None else {}
        current = config_reads.reads_hashes(now, list(observed))
        changed = [
            path
            for path in sorted(observed)
            if current.get(path) != observed[path] and not config_reads.is_read(path, PLACES)
        ]
        if changed:
            more = f" (+{len(changed) - 3} more)" if len(changed) > 3 else ""
            reasons.append(
                f"{stage} ran with other settings than this config gives: {', '.join(changed[:3])}{more}; "
                f"rerun {stage} with this config, or promote with the config it ran with"
            )
    return reasons


PLACES = {"storage", "cluster.address", "cluster.auth_token_file"}
"""Settings that say where a run's files and cluster were reached, not what its evidence judged: the record is
read from this config's storage (a run moved or cloned to another root read another), and what was judged is
bound by content hash, which promotion checks again where the files are now."""


def observed_settings(record: RunRecord, entry: StageEntry) -> dict[str, str]:
    """sha256 per setting the entry's stage read: its inputs; for an entry of an earlier release without them,
    every section but the timeouts of its invocation's config (none when that was not kept either). Pure."""
    if entry.inputs is not None:
        return entry.inputs.config
    ran = invocation_of(record, entry)
    if ran is None or ran.config is None:
        return {}
    sections = [s for s in PipelineConfig.model_fields if s not in config_reads.NOT_INPUTS]
    return config_reads.reads_hashes(ran.config, sections)


def invocation_of(record: RunRecord, entry: StageEntry | None) -> Invocation | None:
    """The invocation that produced `entry` (None: not in the record, as in a record built by hand)."""
    return next((i for i in record.invocations if entry is not None and i.number == entry.invocation), None)


def resume_reasons(cfg: PipelineConfig, record: RunRecord, finetune: FinetuneSummary) -> list[str]:
    resume = record.stages.get("resume")
    if not cfg.resume.enabled:
        return ["resume test disabled (resume.enabled=false): no evidence that checkpoints restore"]
    if resume is None:
        return [f"resume test did not run for the current fine-tune{superseded_note(record, 'resume')}"]
    if not resume.ok:
        return [f"resume test {resume.status}: {resume.cause or ''}".rstrip(": ")]
    summary = resume.summary_as(ResumeSummary)
    if summary is None or not summary.interrupted or summary.restored_step != summary.interrupted_at_step:
        return ["resume test has no proof of an interruption restored at its hold step"]
    if summary.tested_run_name != finetune.run_name:
        return [
            f"resume test tested Ray Train run {summary.tested_run_name}, not the fine-tune being promoted "
            f"({finetune.run_name}): rerun the resume stage"
        ]
    return []


def evaluation_reasons(record: RunRecord, finetune: FinetuneSummary) -> list[str]:
    evaluation = record.stages.get("evaluate")
    summary = record.summary("evaluate", EvaluateSummary)
    if evaluation is None:
        return [
            f"evaluation gates not passed: evaluate did not run for the current fine-tune{superseded_note(record, 'evaluate')}"
        ]
    if not evaluation.ok or summary is None or not summary.gates.passed:
        return [f"evaluation gates not passed: {evaluation.cause or evaluation.status}"]
    forgot = [s.gates.failure_cause() for s in summary.suites if not s.gates.passed]
    if forgot:
        return [f"regression suite gates not passed: {cause}" for cause in forgot]
    scored = summary.models.get("candidate")
    scored_hash = scored.content_sha256 if scored else None
    if scored_hash != finetune.export_sha256:
        return [
            f"evaluation scored content {str(scored_hash)[:12]}, but the current fine-tune's export "
            f"{finetune.export_path} is content {str(finetune.export_sha256)[:12]}: re-run evaluate"
        ]
    return []


def superseded_note(record: RunRecord, stage: str) -> str:
    """' (its last result was superseded by invocation N's rerun)' when the stage's evidence went stale."""
    stale = [e for e in record.superseded if e.stage == stage]
    if not stale:
        return ""
    return f" (its last result, from invocation {stale[-1].invocation}, was superseded by a rerun of an earlier stage)"


def model_card(
    cfg: PipelineConfig, record: RunRecord, forced: Forced | None = None, approval: ApprovalAnswer | None = None
) -> registry.CardFacts:
    evaluation = record.summary("evaluate", EvaluateSummary)
    resume = record.summary("resume", ResumeSummary)
    cluster = record.cluster
    trained, trained_hash = trained_under(record)
    return registry.CardFacts(
        name=cfg.model.name,
        run_id=record.run_id,
        base_model=config_reads.value_at(trained, "model.source"),
        **base_facts(record),
        **method_facts(record),
        metrics={role: (score.metrics if score else None) for role, score in evaluation.models.items()}
        if evaluation
        else {},
        incumbent_version=evaluation.incumbent_version if evaluation else None,
        gates=card_gate_lines(evaluation) if evaluation else [],
        suites=evaluation.suite_rows() if evaluation and evaluation.suites else [],
        dataset_hash=record.data.content_hash if record.data else None,
        replay=replay_facts(record),
        image=config_reads.value_at(trained, "cluster.expect.image"),
        image_digest=cluster.image_digest if cluster else None,
        environment_digest=cluster.environment_digest if cluster else None,
        code_sha=record.code.git_sha,
        code_dirty=record.code.dirty,
        working_dir_hash=record.code.working_dir_hash,
        config_hash=trained_hash,
        resume=registry.Restored(restored_step=resume.restored_step, max_loss_diff=resume.max_loss_diff)
        if resume
        else None,
        forced=forced,
        approval=approval,
    )


def trained_under(record: RunRecord) -> tuple[dict[str, Any], str]:
    """(config as JSON, its hash) of the invocation that ran the fine-tune being promoted: what the model was
    trained under. The record's own config is its latest invocation's, and a `--only promote` trained nothing;
    a record without that invocation (one built by hand) gives its own."""
    ran = invocation_of(record, record.stages.get("finetune"))
    if ran is None:
        return record.config, record.config_hash
    return ran.config or {}, ran.config_hash


def card_gate_lines(evaluation: EvaluateSummary) -> list[str]:
    """Every gate line of the task and the suites, each naming the split it was decided on; the plain lines of a
    decision without verdicts (an older record)."""
    decisions = [evaluation.gates, *(s.gates for s in evaluation.suites)]
    return [line for d in decisions for line in ([v.with_split() for v in d.verdicts] or d.lines)]


def base_facts(record: RunRecord) -> dict[str, Any]:
    """The base's content hash and recipe, where the fine-tune found its build record (base.json)."""
    finetune = record.summary("finetune", FinetuneSummary)
    if finetune is None or finetune.base_model is None:
        return {}
    return {"base_content_hash": finetune.base_model.content_hash, "base_recipe": finetune.base_model.recipe}


def replay_facts(record: RunRecord) -> registry.Replayed | None:
    """The data.replay file the training split mixed in (against forgetting), as the data stage hashed it."""
    data = record.summary("data", DataSummary)
    manifest = data.manifest if data else None
    if manifest is None or manifest.replay is None:
        return None
    return registry.Replayed(
        source=manifest.replay.uri, sha256=manifest.replay.sha256, share=manifest.settings["replay"]["share"]
    )


def method_facts(record: RunRecord) -> dict[str, Any]:
    """How the promoted model was trained: method, parameter counts and, for LoRA, the adapter's folder."""
    finetune = record.summary("finetune", FinetuneSummary)
    if finetune is None:
        return {}
    return {
        "method": finetune.method,
        "trainable_params": finetune.trainable_params,
        "total_params": finetune.total_params,
        "adapter": LORA_ADAPTER_DIR if finetune.adapter_path else None,
    }


@task(name="promote", cache_policy=NO_CACHE)
def promote(call: StageCall, approval: ApprovalAnswer | None = None) -> StageEntry:
    """Promote on the record's evidence; `approval` is the approver's yes when promote.require_approval asked."""
    started = now_iso()
    reasons = refusal_reasons(call.cfg, call.record)
    if reasons:
        return refused(started, reasons, FailureClass.modeling)
    storage = Storage.from_config(call.cfg.storage)
    evaluation = call.record.summary("evaluate", EvaluateSummary)
    items = copy_check_slice(storage, evaluation)
    if items is None:  # without saved answers the registry copy would go unscored: no evidence, no promotion
        return refused(started, [no_copy_check(call.cfg, evaluation)], FailureClass.modeling)
    jobs: list[JobEntry] = []
    checker = copy_checker(call, items, jobs)
    entry = move_pointer(call.cfg, call.record, started, forced=None, check_copy=checker, jobs=jobs, approval=approval)
    entry = with_copy_check(entry, jobs)
    if entry.ok:
        published(storage, call.cfg.model.name, call.record.run_id)
    return entry


def publish_history(storage: Storage, name: str, key_id: str) -> None:
    """The model's production history as a markdown artifact of this flow run (where people look)."""
    moves = registry.read_history(storage, name)
    text = "\n".join([f"# {name}: production history", "", *history.render(moves)])
    create_markdown_artifact(
        text, key=artifacts.key("production-history", key_id), description=f"{name} production history"
    )


def published(storage: Storage, name: str, key_id: str) -> list[str]:
    """publish_history after the pointer has moved (or a rollback was decided): a failure is a warning, logged
    and returned, never the move's failure (the pointer already names the model; the history is in storage)."""
    try:
        publish_history(storage, name, key_id)
    except Exception as e:  # noqa: BLE001 - whatever the artifact API raises, the move stands
        warning = f"the production history artifact of {name} was not published: {type(e).__name__}: {e}"
        logging.getLogger("tuneproof.promote").warning(warning)
        return [warning]
    return []


def move_pointer(
    cfg: PipelineConfig,
    record: RunRecord,
    started: str,
    forced: Forced | None,
    check_copy: Callable[[str], None] | None = None,
    jobs: list[JobEntry] | None = None,
    approval: ApprovalAnswer | None = None,
) -> StageEntry:
    """Check the export is the judged content, copy it to a new version, check the copy (check_copy, given
    the version's path) and CAS the pointer against the incumbent that was evaluated. Every refusal
    happens before the pointer is touched. `jobs` is the promote stage's own (check_copy appends the copy
    check's): the card's cost, computed once the check has run, includes them. `approval` (the approver's yes)
    goes on the summary, the card and the history's move."""
    storage = Storage.from_config(cfg.storage)
    finetune = record.summary("finetune", FinetuneSummary)
    if finetune is None or finetune.export_path is None:
        return refused(started, [f"run {record.run_id} has no exported model"], FailureClass.infrastructure)
    problem, content = export_problem(storage, finetune, forced)
    if problem or content is None:
        return refused(started, [problem or "no content hash"], FailureClass.infrastructure)
    evaluation = record.summary("evaluate", EvaluateSummary)
    evaluated = evaluation.incumbent_version if evaluation else None
    try:
        pointer, token = registry.read_pointer(storage, cfg.model.name)
        moves = history.read(storage, cfg.model.name, pointer.move if pointer else None)
    except (registry.RegistryUnreadable, history.HistoryUnreadable) as e:  # never moved on a registry nobody can read
        return refused(started, [str(e)], FailureClass.infrastructure)
    current = pointer.version if pointer else None
    if registry.is_promotion_of(pointer, record.run_id, content):
        # This run's own promotion already landed: a retry, or a continuation of a run whose flow died
        # between the pointer's swap and the record's save. The same version, not a second copy, and not
        # "the production model changed since evaluation" (it changed to this run).
        logging.getLogger("tuneproof.promote").info(f"{cfg.model.name} {current} is already this run's model")
        summary = promoted_summary(pointer, forced, approval)
        return StageEntry.succeeded("promote", summary, started)
    if registry.serves_content(pointer, content):  # before the rollback and incumbent checks: nothing would move
        return already_served(started, registry.AlreadyServing(pointer))
    rolled_back = rollback_reasons(storage, cfg.model.name, record, content, moves)
    if forced is None and rolled_back:  # a judgement on the model, like a failed gate: only the override undoes it
        return refused(started, rolled_back, FailureClass.modeling)
    if forced is not None:  # the override says what it went past, the rollback included
        forced = forced.model_copy(update={"bypassed": [*forced.bypassed, *rolled_back]})
    if forced is None and current != evaluated:
        return refused(
            started,
            [f"the production model changed since evaluation ({evaluated} -> {current}); re-evaluate"],
            FailureClass.infrastructure,
        )
    card = model_card(cfg, record, forced, approval).model_copy(update={"content_sha256": content})

    def cost_of(move: history.Move) -> VersionCost:
        return promotion_cost(storage, cfg, as_stored(record, started, jobs or []), move, pointer)

    try:
        with rollbacks.hold(storage, cfg.model.name, record.run_id, f"promote {record.run_id}", HOLD_WAIT_S):
            result = registry.promote(
                storage,
                cfg.model.name,
                record.run_id,
                finetune.export_path,
                card,
                token,
                content_sha256=content,
                intent=move_intent(record, forced, approval),
                check_copy=check_copy,
                cost_of=cost_of,
            )
    except (CopyCheckFailed, CostUnknown, history.HistoryUnreadable) as e:
        return refused(started, [str(e)], FailureClass.infrastructure)
    except registry.AlreadyServing as e:  # a promotion of the same bytes landed since the pointer was read above
        return already_served(started, e)
    except (registry.PromotionConflict, rollbacks.PointerHeld) as e:
        return refused(started, [f"lost a concurrent promotion: {e}"], FailureClass.infrastructure)
    except markers.ExportUnverified as e:
        return refused(started, [f"the copied model is not the judged export: {e}"], FailureClass.infrastructure)
    logging.getLogger("tuneproof.promote").info(f"promoted {cfg.model.name} {result.version} (previous: {current})")
    summary = promoted_summary(result, forced, approval)
    return StageEntry.succeeded("promote", summary, started)


def rollback_reasons(
    storage: Storage, name: str, record: RunRecord, content: str, moves: list[history.Move]
) -> list[str]:
    """Why `content` may not go back to production on its evidence alone: a rollback moved production away from
    a version of it, as the model's history (`moves`) or this run's record says. Only the override
    (`tuneproof promote RUN --force --reason`) promotes it again, and its card says it went past this."""
    recorded = [r for r in record.rollbacks if r.model == name]
    away: dict[int, history.Move | RolledBack] = {m.seq: m for m in moves if m.kind == "rollback"}
    away.update({r.seq: r for r in recorded})
    ours = {m.to_version for m in moves if m.run_id == record.run_id} | {r.from_version for r in recorded}
    return [
        f"{name} {m.from_version}, this content ({content[:12]}), was rolled back by {m.by} (history #{seq}): "
        f"{m.reason}; only `tuneproof promote {record.run_id} --force --reason ...` promotes it again"
        for seq, m in sorted(away.items())
        if m.from_version is not None and holds(storage, name, m.from_version, content, m.from_version in ours)
    ]


def holds(storage: Storage, name: str, version: str, content: str, ours: bool) -> bool:
    """Whether registry version `version` is `content`, as its card says. A card that cannot say (unreadable,
    or written before cards named content) counts when the version is this run's (`ours`): a broken card never
    hides a rollback of this run's model."""
    try:
        found = registry.read_card(storage, name, version).content_sha256
    except (ValueError, OSError, RecursionError):
        found = None
    return ours if found is None else found == content


class CostUnknown(RuntimeError):
    """The promoted version's cost cannot be computed (a record of the model this release cannot read)."""


def promotion_cost(
    storage: Storage,
    cfg: PipelineConfig,
    record: RunRecord,
    move: history.Move,
    pointer: registry.ProductionPointer | None,
) -> VersionCost:
    """What the version `move` promotes cost: this run as `record` has it, and what the model's other runs spent
    since the previous promotion. `pointer` is the incumbent `move` replaces: one the first release wrote has
    no move in the history, so its promotion time bounds the window (else all of its run would be charged
    again). Records that cannot be read are named on the cost, never dropped in silence. The card states it;
    `models show` shows the card's."""
    stored, unreadable = records.list_records(storage)
    of_model, unknown = cost.records_of(stored, cfg.model.name)  # unknown: named on the card, never charged
    runs = [r for r in of_model if r.run_id != record.run_id] + [record]
    moves = [*registry.read_history(storage, cfg.model.name), move]
    side = cost.side_runs(storage, [r.run_id for r in runs])
    since = pointer.promoted_at if pointer is not None and pointer.move is None else None
    try:
        version = cost.version_costs(runs, moves, cfg.cost.prices, side, since)[-1]
    except ValidationError as e:  # a summary of another release, or hand-edited: named, not a raw traceback
        raise CostUnknown(
            f"the cost of {cfg.model.name} {move.to_version} cannot be computed: a record of one of its runs "
            f"({', '.join(r.run_id for r in runs)}) holds a summary this release cannot read: "
            f"{e.title}: {first_problem(e)}"
        ) from None
    lost = sorted(({row.run_id for row in unreadable} | set(unknown)) - {record.run_id})
    return version.model_copy(update={"unreadable": lost})


def as_stored(record: RunRecord, started: str, jobs: list[JobEntry]) -> RunRecord:
    """The run's record as the flow will store it once this promote stage ends: with the stage's jobs so far
    (the copy check's), so the card charges the run for them. A promotion without jobs (the override) adds none."""
    if not jobs:
        return record
    entry = StageEntry(
        stage="promote",
        status="succeeded",
        started_at=started,
        ended_at=now_iso(),
        jobs=list(jobs),
        invocation=len(record.invocations) or 1,
    )
    return record.model_copy(update={"stages": {**record.stages, "promote": entry}})


class CopyCheckFailed(RuntimeError):
    """The registry copy did not score like the evaluated export on the fixed slice (or could not be scored)."""


def copy_checker(call: StageCall, items: dict[str, list[str]], jobs: list[JobEntry]) -> Callable[[str], None]:
    """A check_copy for registry.promote: a Ray job (eval.copy_check) that loads the copy from the registry's
    bytes and scores `items` (copy_check_slice: the first COPY_CHECK_EXAMPLES items evaluate saved); its
    JobEntry goes to `jobs`."""

    def check(model_path: str) -> None:
        params = {"model": model_path, **items}
        spec = call.spec("eval.copy_check", params, suffix="copy-check", summary=CopyCheckSummary)
        runner = runner_for(call)
        job = runner.run(spec)
        # An earlier try of this job that left no verdict is replaced, and listed before it: it was paid for.
        jobs.extend([*runner.superseded, job])
        if job.result.status != "succeeded":
            raise CopyCheckFailed(f"copy check ({job.submission_id}): {job.result.cause}")

    return check


def copy_check_slice(storage: Storage, evaluation: EvaluateSummary | None) -> dict[str, list[str]] | None:
    """{"prompts", "references", "answers"}: the first saved predictions with a candidate answer (None: none)."""
    uri = evaluation.predictions_uri if evaluation else None
    prefix = storage.uri() + "/"
    if not uri or not uri.startswith(prefix):
        return None
    lines = storage.read_text(*uri.removeprefix(prefix).split("/")).splitlines()
    rows = [row for row in map(json.loads, filter(None, lines)) if row.get("candidate") is not None]
    rows = rows[:COPY_CHECK_EXAMPLES]
    if not rows:
        return None
    return {key: [row[field] for row in rows] for key, field in FIELDS.items()}


FIELDS = {"prompts": "prompt", "references": "reference", "answers": "candidate"}


def no_copy_check(cfg: PipelineConfig, evaluation: EvaluateSummary | None) -> str:
    """Why the registry copy cannot be scored: the evaluation saved no candidate answers to compare it with."""
    saved = evaluation.predictions_uri if evaluation else None
    where = f"in {saved}" if saved else "(no predictions file)"
    return (
        f"evaluate saved no candidate answers {where} to score the registry copy with (eval.predictions_cap is "
        f"{cfg.eval.predictions_cap}; the copy check needs {COPY_CHECK_EXAMPLES}): rerun evaluate with "
        f"eval.predictions_cap >= {COPY_CHECK_EXAMPLES}"
    )


def with_copy_check(entry: StageEntry, jobs: list[JobEntry]) -> StageEntry:
    """The promote entry with the copy check's job, and its summary in the promote summary."""
    if not jobs:
        return entry
    update: dict[str, Any] = {"jobs": [*entry.jobs, *jobs]}
    summary = entry.summary_as(PromoteSummary)
    if summary is not None and jobs[-1].result.summary is not None:
        checked = CopyCheckSummary.model_validate(jobs[-1].result.summary)
        update["summary"] = summary.model_copy(update={"copy_check": checked}).to_json()
    return entry.model_copy(update=update)


HOLD_WAIT_S = 120.0
"""How long a promotion waits for another flow's hold on the pointer (a rollback, another promotion)."""


def promoted_summary(
    pointer: registry.ProductionPointer, forced: Forced | None, approval: ApprovalAnswer | None = None
) -> PromoteSummary:
    """The promotion as the record keeps it: the pointer's fields (its move lives in the model's history)."""
    return PromoteSummary(promoted=True, forced=forced, approval=approval, **pointer.model_dump(exclude={"move"}))


def move_intent(record: RunRecord, forced: Forced | None, approval: ApprovalAnswer | None = None) -> MoveIntent:
    """Who moves the pointer and why: the override's author and reason, or the gates' pass with the
    hash of the evidence they judged, moved by the approver with their comment when one was asked."""
    if forced is not None:
        return MoveIntent(kind="forced-promote", by=forced.by, reason=forced.reason)
    passed = "every gate and the resume test passed"
    return MoveIntent(
        kind="promote",
        by=approval.by if approval else registry.current_user(),
        reason=f"{passed}; approved: {approval.comment or 'no comment'}" if approval else passed,
        evidence_sha256=evidence_sha256(record),
    )


def evidence_sha256(record: RunRecord) -> str:
    """sha256 of the summaries a promotion rests on (fine-tune export, resume test, evaluation). Pure."""
    judged = {stage: record.stages[stage].summary for stage in EVIDENCE_STAGES if stage in record.stages}
    return hashlib.sha256(json.dumps(judged, sort_keys=True).encode()).hexdigest()


EVIDENCE_STAGES = ("finetune", "resume", "evaluate")


def export_problem(storage: Storage, finetune: FinetuneSummary, forced: Forced | None) -> tuple[str | None, str | None]:
    """(why the stored export may not be promoted, its content hash): its files must match its manifest,
    and (unless forced past the gates) the manifest must be the content the fine-tune wrote and evaluate scored."""
    path = finetune.export_path or ""
    try:
        content = markers.verify_export(storage, path).content_sha256
    except markers.ExportUnverified as e:
        return f"the export is not what was judged: {e}", None
    if forced is None and content != finetune.export_sha256:
        return (
            f"{storage.uri(path)} is content {content[:12]}, not the evaluated {str(finetune.export_sha256)[:12]}",
            None,
        )
    return None, content


def approval_refused(started: str, answer: ApprovalAnswer) -> StageEntry:
    """The approver said no: nothing moved, and the record names who refused and why."""
    reason = f"approval refused by {answer.by}: {answer.comment or 'no comment'}"
    summary = PromoteSummary(promoted=False, reasons=[reason], approval=answer)
    return StageEntry.failed("promote", FailureClass.modeling, reason, started, summary=summary)


def already_served(started: str, serving: registry.AlreadyServing) -> StageEntry:
    """Production already serves the candidate's bytes under another run's version: a skipped stage, not a
    failure (the candidate is what serves), whose summary says which version serves them and that none was minted."""
    reason = str(serving)
    summary = PromoteSummary(promoted=False, reasons=[reason], content_sha256=serving.pointer.content_sha256)
    entry = StageEntry.skipped("promote", reason)
    return entry.model_copy(update={"started_at": started, "summary": summary.to_json()})


def refused(started: str, reasons: list[str], failure_class: FailureClass) -> StageEntry:
    return StageEntry.failed(
        "promote", failure_class, "; ".join(reasons), started, summary=PromoteSummary(promoted=False, reasons=reasons)
    )


def forced_promotion(
    cfg: PipelineConfig, run_id: str, reason: str, user: str, lease: Lease | None = None
) -> PromoteSummary:
    """`tuneproof promote RUN --force --reason`: bypass the gates, and say so in the record and the card. `lease`
    is the run's, held by the caller: the record is written only while it still holds the run. RecordUnreadable,
    before anything is written, for a record holding a stage summary its model refuses (hand-edited, another
    release's): the card and the bypassed gates are read from those."""
    storage = Storage.from_config(cfg.resolved().storage)
    record = records.load(storage, run_id)
    if problem := unreadable_summary(record):
        raise records.RecordUnreadable(problem)
    finetune = record.stages.get("finetune")
    if finetune is None or not finetune.ok:
        why = finetune.status if finetune else "did not run"
        return PromoteSummary(promoted=False, reasons=[f"run {run_id} has no exported model (finetune {why})"])
    forced = Forced(by=user, reason=reason, at=now_iso(), bypassed=refusal_reasons(cfg, record))
    if lease is not None:  # a holder that lost the run moves no pointer in its name either
        lease.fence()
    entry = move_pointer(cfg, record, now_iso(), forced)
    result = entry.summary_as(PromoteSummary) or PromoteSummary(promoted=False, reasons=[entry.cause or ""])
    bypassed = result.forced.bypassed if result.forced else forced.bypassed  # with a rollback it went past
    record.overrides.append(
        Override(action="promote --force", by=user, reason=reason, at=forced.at, bypassed=bypassed, result=result)
    )
    record.promotion = result
    records.save(storage, record, lease)
    return result


def unreadable_summary(record: RunRecord) -> str | None:
    """The first stage summary in the record that its model (the stage table's) refuses, named by stage and field
    as `runs show` names it; None when each one reads. Pure."""
    for stage in table.STAGES:
        try:
            record.summary(stage.name, stage.summary)
        except ValidationError as e:
            where = f"{stage.name}." if e.errors()[0]["loc"] else f"{stage.name}: "
            return f"run {record.run_id}: a stage summary in record.json is not readable: {where}{first_problem(e)}"
    return None


class RollbackResult(BaseModel):
    """What `tuneproof rollback` (and the rollback flow) did: the move, or why nothing moved."""

    model_config = ConfigDict(extra="forbid")

    rolled_back: bool
    model: str
    from_version: str | None = None
    to_version: str | None = None
    move: int | None = None
    """The move's number in the model's production history."""
    rolled_back_run: str | None = None
    """The run whose model was production before, whose record now names the rollback."""
    reasons: list[str] = []
    """Why it was refused (empty when it moved)."""
    warnings: list[str] = []
    """What failed once the pointer had moved (the rolled-back run's record not annotated, the history artifact
    not published), or that a retry found its rollback already made: the rollback stands; each says what is missing."""


def roll_back(
    cfg: PipelineConfig, name: str, reason: str, by: str, to_version: str | None, flow_run_id: str | None = None
) -> RollbackResult:
    """Move the pointer back (control.rollback) from the production version read here, and note it in the
    rolled-back run's record, under that run's lease so no flow writes the record meanwhile. Every refusal
    leaves the pointer where it was; a pointer that moved after this read (a promotion landing) is refused,
    never rolled back in its place. A retry of a rollback that already moved the pointer (rollback.repeats)
    moves nothing again. Once the pointer has moved, what fails after it is a warning in the result."""
    storage = Storage.from_config(cfg.resolved().storage)
    try:
        pointer, token = registry.read_pointer(storage, name)
    except registry.RegistryUnreadable as e:  # nothing to roll back from that anyone can name
        return RollbackResult(rolled_back=False, model=name, reasons=[str(e)])
    made = pointer.move if pointer and rollbacks.repeats(pointer.move, reason, by, to_version) else None
    run_id = rolled_back_run(storage, name, pointer, made)
    lease = None
    if run_id and storage.exists("runs", run_id, records.RECORD):
        lease = Lease(storage, run_id, flow_run_id, f"tuneproof rollback {name}")
    warnings: list[str] = []
    try:
        with lease.held(on_problem=warnings.append) if lease else nullcontext():
            if made is not None:  # a retry whose first attempt moved the pointer: that move, none again
                move = made
                warnings.append(
                    f"{name} is already at {move.to_version} by this rollback (#{move.seq}): not moved again"
                )
            else:
                seen = pointer.version if pointer else None
                new = rollbacks.rollback(storage, name, reason, by, to_version, seen, token, warnings.append)
                assert new.move is not None  # rollback always records its move
                move = new.move
            if lease is not None:
                warnings += noted(storage, lease, name, move)
    except registry.PromotionConflict as e:
        seen = pointer.version if pointer else None
        return RollbackResult(
            rolled_back=False,
            model=name,
            from_version=seen,
            reasons=[f"production moved after it was read ({seen} -> {e.seen_version}): nothing was rolled back"],
        )
    except (rollbacks.RollbackRefused, rollbacks.PointerHeld, registry.RegistryUnreadable, LeaseHeld) as e:
        return RollbackResult(
            rolled_back=False, model=name, from_version=pointer.version if pointer else None, reasons=[str(e)]
        )
    for warning in warnings:
        logging.getLogger("tuneproof.rollback").warning(warning)
    return RollbackResult(
        rolled_back=True,
        model=name,
        from_version=move.from_version,
        to_version=move.to_version,
        move=move.seq,
        rolled_back_run=run_id,
        warnings=warnings,
    )


def rolled_back_run(
    storage: Storage, name: str, pointer: registry.ProductionPointer | None, made: history.Move | None
) -> str | None:
    """The run whose model the rollback moves production away from: production's run; for a retry, the run of
    the version its first attempt (`made`) moved away from, as that version's card says (None: unreadable)."""
    if made is None or made.from_version is None:
        return pointer.run_id if pointer else None
    try:
        return registry.read_card(storage, name, made.from_version).run_id
    except (ValueError, OSError, RecursionError):
        return None


def noted(storage: Storage, lease: Lease, name: str, move: history.Move) -> list[str]:
    """note_rollback once the pointer has moved: a failure (a truncated record, a store error, the lease lost to
    another writer) is a warning."""
    try:
        note_rollback(storage, lease, name, move)
    except Exception as e:  # noqa: BLE001 - the rollback stands whatever becomes of its note
        return [f"run {lease.run_id}'s record does not name rollback #{move.seq}: {type(e).__name__}: {e}"]
    return []


def note_rollback(storage: Storage, lease: Lease, name: str, move: history.Move) -> None:
    """The run's record names the rollback, once (a retry's note finds it there), written only while `lease`
    still holds the run (a holder presumed dead and taken over writes nothing over its successor's record)."""
    record = records.load(storage, lease.run_id)
    if any((r.model, r.seq) == (name, move.seq) for r in record.rollbacks):
        return
    record.rollbacks.append(
        RolledBack(
            model=name,
            from_version=str(move.from_version),
            to_version=move.to_version,
            by=move.by,
            reason=move.reason,
            at=move.at,
            seq=move.seq,
        )
    )
    records.save(storage, record, lease)


@task(name="rollback", cache_policy=NO_CACHE)
def rollback(
    cfg: PipelineConfig, name: str, reason: str, by: str, to_version: str | None, flow_run_id: str
) -> RollbackResult:
    result = roll_back(cfg, name, reason, by, to_version, flow_run_id)
    storage = Storage.from_config(cfg.resolved().storage)
    return result.model_copy(update={"warnings": result.warnings + published(storage, name, f"rollback-{flow_run_id}")})
