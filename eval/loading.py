"""The models an evaluation loads: where each comes from, loading it from the very copy whose files are hashed,
what it is (a content hash, or the hub commit a hub id resolved to), and whether its tokenizer and chat template are
the ones the data stage prepared the eval split with.

Not run on its own: the evaluate job (eval/evaluate_job.py) and the registry copy check (eval/copy_check.py) load
their models through it, inside their Ray jobs. The candidate's and the base's tokenizer and template must be the
data's, else the evaluation is invalid (eval/selftest.py `invalid`), not a verdict on the model; an incumbent's may
differ (trained before a change of base model), which is logged and, for its loss, left out.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from eval.generation import pick_device
from eval.selftest import invalid
from training import jobkit
from training.checkpoint_listing import check_complete
from training.modeling import load_model, load_tokenizer, materialize
from tuneproof.core import markers
from tuneproof.core.hashing import chat_template_sha256
from tuneproof.core.metric_names import LOSS_METRICS
from tuneproof.core.results import FailureClass, StageFailure

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

    from training.jobkit import JobContext
    from tuneproof.core.config_eval import Gate
    from tuneproof.core.storage import Storage


@dataclass(frozen=True)
class ModelSource:
    """A model to load and name in the verdict: the candidate, the base, the incumbent or a registry copy."""

    role: str
    path: str
    """As recorded: storage-relative for candidate and incumbent, config.model.source for base."""
    uri: str
    """What from_pretrained loads (after materialize): a local dir, hub id or s3:// prefix."""
    revision: str | None = None
    manifest: bool = False
    """True for an export (candidate, incumbent): its files must match its tuneproof-export.json."""


def require_complete_export(ctx: JobContext, candidate: str) -> None:
    """Only a finished export counts: its completion marker lists every file with its size."""
    problem = check_complete(ctx.storage, candidate)
    if problem:
        raise StageFailure(FailureClass.infrastructure, f"candidate export is not complete: {problem}")


def load_for_eval(ctx: JobContext, source: ModelSource) -> tuple[PreTrainedModel, PreTrainedTokenizerBase, str | None]:
    """Model in eval mode on the device, its own tokenizer (the base model's when it ships none), and the
    content hash of the files it loaded from (checked before loading, on the very copy that loads)."""
    endpoint = ctx.config.storage.endpoint_url
    device, dtype = pick_device()
    ref = materialize(source.uri, endpoint)  # loads from the very copy that is hashed below
    local = Path(ref)
    content = model_hash(ctx.storage, source, local)
    model = load_model(ref, source.revision, endpoint, dtype=dtype)
    # ignore: transformers wraps PreTrainedModel.to with functools.wraps, which mypy reads as unbound (device as self).
    model.to(device).eval()  # type: ignore[arg-type]
    has_tokenizer = not local.is_dir() or (local / "tokenizer_config.json").exists()
    base = ctx.config.model
    tokenizer = (
        load_tokenizer(ref, source.revision, endpoint)
        if has_tokenizer
        else load_tokenizer(base.source, base.revision, endpoint)
    )
    return model, tokenizer, content


def model_hash(storage: Storage, source: ModelSource, local: Path) -> str | None:
    """The content hash of the model files that load from `local`: an export's manifest hash, after checking
    every file of the loaded copy against it; a plain directory's hash over its files; None for a hub id."""
    if source.manifest and (local / markers.EXPORT_MANIFEST).exists():
        try:
            return markers.verify_export(storage, source.path, local_dir=local).content_sha256
        except markers.ExportUnverified as e:
            raise StageFailure(FailureClass.infrastructure, f"{source.role} model: {e}") from None
    if source.role == "candidate":
        raise StageFailure(
            FailureClass.infrastructure,
            f"candidate export {storage.uri(source.path)} has no {markers.EXPORT_MANIFEST}: re-run finetune",
        )
    return markers.content_sha256(markers.local_digests(local)) if local.is_dir() else None


def hub_commit(model: PreTrainedModel) -> str | None:
    """The hub commit a model named by hub id was loaded at: from_pretrained records the revision it resolved to
    (a branch such as 'main' moves) in the model's config. None for a model loaded from local files."""
    commit = getattr(model.config, "_commit_hash", None)
    return commit if isinstance(commit, str) and commit else None


def check_template(role: str, tokenizer: PreTrainedTokenizerBase, rendered_with: str | None) -> str | None:
    """The hash of the chat template `role`'s tokenizer lays prompts out with. The eval prompts are the data
    stage's renderings: the candidate's and the base's template must be the one they were rendered with,
    else the model is scored on prompts laid out for another template and the evaluation is invalid. An
    incumbent's may differ (it was trained before a change of base model): logged, not refused."""
    mine = chat_template_sha256(getattr(tokenizer, "chat_template", None))
    if rendered_with is None or mine == rendered_with:
        return mine
    what = (
        f"the {role} model's chat template (sha256 {mine}) is not the one the data stage rendered the eval "
        f"prompts with (sha256 {rendered_with}, in the dataset manifest)"
    )
    if role == "incumbent":
        jobkit.log(f"note: {what}: the incumbent answers prompts laid out for another template")
        return mine
    raise invalid(f"{what}: prepare the data with the tokenizer the model is evaluated with (re-run data)")


def check_tokenizer(
    role: str,
    tokenizer: PreTrainedTokenizerBase,
    prompts: Sequence[str],
    input_ids: Sequence[Sequence[int]],
    gates: Mapping[str, Gate],
) -> bool:
    """Whether `role`'s tokenizer encodes the eval split's prompts to the ids the split's rows begin with (the data
    stage's tokenizer's), so that its eval loss may be read over the split's input_ids.

    Compared by what it does, on this split's own prompts, not by a hash of its saved files: those carry where it
    was loaded from (`is_local` in tokenizer_config.json), so a base named by hub id and an export read from
    storage hash apart with one vocabulary. The candidate's and the base's must agree: with another vocabulary
    their loss is over foreign ids and their answers decode other ids (cut off, or an IndexError), and the
    evaluation is invalid. An incumbent's may differ (trained before a change of base model): it answers the
    prompts as text with its own, but its eval loss and perplexity are left out (False) rather than reported
    over foreign ids; a gate comparing one with the incumbent then cannot judge, and the evaluation is invalid."""
    differs = first_foreign_row(tokenizer, prompts, input_ids)
    if differs is None:
        return True
    what = f"the {role}'s tokenizer does not encode the eval split's prompts to the split's ids ({differs})"
    if role != "incumbent":
        raise invalid(
            f"{what}: the split's ids are another tokenizer's, its eval loss over them means nothing, and a model "
            "trained on them decodes its answers wrongly; prepare the data with the tokenizer the model is evaluated "
            "with (re-run data)"
        )
    if gated := [
        f"{name}.max_regression" for name, g in gates.items() if name in LOSS_METRICS and g.max_regression is not None
    ]:
        raise invalid(
            f"{what}: its loss over the split's ids means nothing, so gate {', '.join(gated)} cannot compare the "
            "candidate with it"
        )
    jobkit.log(f"note: {what}: its eval loss and perplexity are left out (over another tokenizer's ids)")
    return False


def first_foreign_row(
    tokenizer: PreTrainedTokenizerBase, prompts: Sequence[str], input_ids: Sequence[Sequence[int]]
) -> str | None:
    """Where `tokenizer` first encodes a prompt otherwise than the split's row begins ('row 3, token 1: 87 vs
    266'); None when every prompt's ids are its row's first ids (a truncated row: as far as it goes)."""
    encoded = tokenizer(list(prompts), add_special_tokens=False)["input_ids"]
    for row, (mine, stored) in enumerate(zip(encoded, input_ids)):
        for at, (a, b) in enumerate(zip(mine, stored)):
            if a != b:
                return f"row {row}, token {at}: {a} vs {b}"
    return None
