"""The model registry: versioned copies under models/<name>/ and a production pointer moved by compare-and-swap.

Runs on the Prefect side (the promote task, `tuneproof models list|show`); the evaluate job only
reads the pointer. Layout under the storage root:

    models/<name>/<version>/        HF model files + MODEL_CARD.md + card.json (card.json last: the completion marker)
    models/<name>/<version>/adapter/  a LoRA run's peft adapter (adapter_config.json, adapter_model.safetensors);
                                    the version's own files are then the merged model
    models/<name>/production.json   the pointer, written last, only on promotion or rollback
    models/<name>/history/          every move of the pointer, append-only (tuneproof.control.history)
    models/<name>/.hold.json        a flow moving the pointer holds it (tuneproof.control.rollback)

Versions are `v<NNNN>-<run_id>`, NNNN one above the highest existing version, so they sort in
promotion order. The pointer names the model's content hash (the export manifest's content_sha256,
checked again on the copy) and moves only if it is still what the caller evaluated against (its
token from `read_pointer`), through tuneproof.core.cas: on a local or FSx/NFS root under an O_EXCL
lock file, on S3 with a conditional PutObject (If-None-Match: * for the first pointer, If-Match:
<ETag> afterwards). On a conflict the pointer is re-read: if it already names this version (a retry
whose first write landed), that is success; otherwise the loser raises PromotionConflict and removes
its own version copy. The winner removes its run's earlier copies that production never served (an attempt
that died between its card and the swap), so no card claims a promotion that never happened.
"""

from __future__ import annotations

import getpass
import json
import logging
import os
import posixpath
import re
import socket
from collections.abc import Callable
from typing import Any, TypeGuard

from pydantic import ValidationError

from tuneproof.control import history
from tuneproof.control.cost import VersionCost, card_notes
from tuneproof.control.history import MODELS, Move, MoveIntent
from tuneproof.core import cas, markers
from tuneproof.core.config_train import LORA_ADAPTER_DIR
from tuneproof.core.files import read_stored
from tuneproof.core.names import slug_problem
from tuneproof.core.results import Model, first_problem, now_iso, one_line
from tuneproof.core.storage import Storage
from tuneproof.core.summaries_eval import ApprovalAnswer, Forced, SuiteRow

POINTER = "production.json"
CARD_JSON = "card.json"
CARD_MD = "MODEL_CARD.md"
MAX_CARD_BYTES = 16 << 20
"""A card is kilobytes (metrics, gate lines, provenance, history); a bigger one, or a FIFO in its place, is refused
by name (tuneproof.core.files.FileRefused) instead of read until memory runs out."""
_VERSION = re.compile(r"^v(\d{4,})-(.+)$")


# ---- the documents (the images registry's are in tuneproof.control.images: the same pattern) -------------------


class ProductionPointer(Model):
    """models/<name>/production.json: the version that serves, the run and the content it was judged on, and
    the move that put it there."""

    name: str
    version: str
    path: str
    """The version's folder, storage-relative (models/<name>/<version>)."""
    run_id: str
    promoted_at: str
    previous_version: str | None = None
    content_sha256: str | None = None
    """The export manifest's content hash the evaluation scored (checked again on the copy)."""
    move: Move | None = None
    """The move that put the pointer here (None in a pointer written before moves were recorded)."""


class Replayed(Model):
    """The data.replay file the training split mixed in, as the data stage hashed it."""

    source: str
    sha256: str
    share: float


class Restored(Model):
    """The resume test as the card states it."""

    restored_step: int | None = None
    max_loss_diff: float | None = None


class CardFacts(Model):
    """What a run's record says about the model it promotes (tasks/promote.model_card), before the registry
    gives it a version."""

    name: str
    run_id: str
    base_model: str | None = None
    base_content_hash: str | None = None
    base_recipe: dict[str, Any] | None = None
    method: str | None = None
    trainable_params: int | None = None
    total_params: int | None = None
    adapter: str | None = None
    """A LoRA version's adapter folder, relative to the version (None for full fine-tunes)."""
    metrics: dict[str, dict[str, float | None] | None] = {}
    """Per role (candidate, base, incumbent), its task metrics (None: that model was not scored)."""
    incumbent_version: str | None = None
    gates: list[str] = []
    suites: list[SuiteRow] = []
    dataset_hash: str | None = None
    replay: Replayed | None = None
    image: str | None = None
    image_digest: str | None = None
    environment_digest: str | None = None
    code_sha: str | None = None
    code_dirty: bool = False
    working_dir_hash: str | None = None
    config_hash: str | None = None
    resume: Restored | None = None
    forced: Forced | None = None
    approval: ApprovalAnswer | None = None
    """Who approved the promotion, and why, when promote.require_approval asked."""
    content_sha256: str | None = None


class ModelCard(CardFacts):
    """models/<name>/<version>/card.json: the facts, the version, what it cost and the pointer's history up to
    its promotion (MODEL_CARD.md is rendered from it)."""

    version: str
    source_path: str
    cost: VersionCost | None = None
    history: list[Move] = []


class RegistryUnreadable(ValueError):
    """A registry file (pointer or card) that exists but cannot be read as one: corrupt, truncated, wrong shape."""


class AlreadyServing(RuntimeError):
    """Production already serves the candidate's bytes (its content hash) as another run's version: a promotion
    would mint a duplicate version, whose rollback would change nothing that serves. Nothing was copied or moved."""

    def __init__(self, pointer: ProductionPointer):
        self.pointer = pointer
        super().__init__(
            f"{pointer.name} {pointer.version} (run {pointer.run_id}) already serves this content "
            f"({str(pointer.content_sha256)[:12]}): no duplicate version minted"
        )


class PromotionConflict(RuntimeError):
    """The production pointer moved since the candidate was evaluated; nothing was pointed at the candidate."""

    def __init__(self, name: str, expected_token: str | None, seen_token: str | None, seen_version: str | None):
        self.name, self.expected_token, self.seen_token, self.seen_version = (
            name,
            expected_token,
            seen_token,
            seen_version,
        )
        expected = "no production model" if expected_token is None else f"pointer token {expected_token}"
        seen = "no production model" if seen_token is None else f"{seen_version} (token {seen_token})"
        super().__init__(
            f"models/{name}/{POINTER}: expected {expected}, found {seen}: another promotion won; "
            "re-evaluate the candidate against the new incumbent"
        )


# ---- reading ---------------------------------------------------------------------------------


def read_pointer(storage: Storage, name: str) -> tuple[ProductionPointer | None, str | None]:
    """(pointer, token) for models/<name>/production.json, or (None, None) when there is none.

    The token is opaque (a content hash locally, the ETag on S3); pass it back to `promote`
    as expected_token to say "the incumbent I evaluated against".
    """
    where = storage.uri(*_pointer_parts(name))
    try:
        data, token = cas.read_versioned(storage, *_pointer_parts(name))
    except NotADirectoryError:  # models/<name> is a stray file, not a model
        return None, None
    except OSError as e:
        raise RegistryUnreadable(f"{where}: cannot be read as the production pointer: {e.strerror or e}") from None
    return (_parse_pointer(where, name, data), token) if data is not None else (None, None)


def _parse_pointer(where: str, name: str, data: bytes) -> ProductionPointer:
    """The pointer document of model `name`, or RegistryUnreadable naming the file: a promotion must never act on a
    guess. A pointer naming another model, or whose path is not models/<name>/<version>, is refused too: evaluate
    loads `path` as the incumbent, so a foreign one would score another model while the record names this one."""
    try:
        pointer = ProductionPointer.model_validate_json(data)
    except ValidationError as e:
        kind = "JSON production pointer" if e.errors()[0]["type"] == "json_invalid" else "production pointer"
        raise RegistryUnreadable(f"{where}: not a {kind} ({first_problem(e)})") from None
    problem = _pointer_problem(pointer, name)
    if problem is not None:
        raise RegistryUnreadable(f"{where}: not a usable production pointer ({problem})")
    return pointer


def _pointer_problem(pointer: ProductionPointer, name: str) -> str | None:
    """Why a well-formed pointer document cannot be model `name`'s pointer, or None (pure). Its versions must be
    one folder each (a '/' or '..' in one would make a matching path lead out of models/<name>/), and its run_id
    the run its version was promoted from: a rollback notes that run's record, so '../../x' left the store and
    another run's id noted a run production never served."""
    if pointer.name != name:
        return f"name is {pointer.name!r}, expected {name!r}"
    for field, version in (("version", pointer.version), ("previous_version", pointer.previous_version)):
        if version is not None and not _is_version_name(version):
            return f"{field} is {version!r}, expected v<NNNN>-<run id>"
    if pointer.run_id != _run_of(pointer.version):
        return f"run_id is {pointer.run_id!r}, expected {_run_of(pointer.version)!r}, the run of {pointer.version}"
    expected_path = posixpath.join(MODELS, name, pointer.version)
    if pointer.path != expected_path:
        return f"path is {pointer.path!r}, expected {expected_path!r} for version {pointer.version!r}"
    return None


def _is_version_name(version: str) -> bool:
    run = _run_of(version)
    return run is not None and slug_problem(run) is None


def list_models(storage: Storage) -> list[dict]:
    """One row per registered name, as `models list --json` prints it: {"name", "production": the pointer as
    JSON or None, "versions": [names]}, plus "problem" when its pointer is unreadable. Anything under models/
    that is not a folder is skipped."""
    rows = []
    for name in storage.listdir(MODELS):
        if not storage.fs.isdir(storage.path(MODELS, name)):
            continue  # a stray file (notes, a lock) is not a registered model
        row: dict[str, Any] = {"name": name, "production": None, "versions": versions(storage, name)}
        try:
            pointer = read_pointer(storage, name)[0]
            row["production"] = pointer.to_json() if pointer else None
        except RegistryUnreadable as e:
            row["problem"] = str(e)
        rows.append(row)
    return rows


def show_model(storage: Storage, name: str) -> dict:
    """{"name", "pointer", "token", "versions": [{"version", "production", "served", "complete", "card"}],
    "history": [moves]}, as `models show` prints it (the pointer and cards as their JSON).

    A version without card.json is an incomplete copy (a promotion that crashed while copying). "served" says
    whether production ever served the version (history.served); a complete one it never served is a copy whose
    promotion stopped before the pointer's swap, and its "problem" says so, since its card claims a promotion.
    Raises FileNotFoundError for a name with no versions and no pointer.
    """
    names = versions(storage, name)
    pointer, token = read_pointer(storage, name)
    if not names and pointer is None:
        known = ", ".join(storage.listdir(MODELS)) or "none"
        raise FileNotFoundError(f"no model {name!r} under {storage.uri(MODELS)} (registered: {known})")
    moves = history.read(storage, name, pointer.move if pointer else None)
    served = history.served(moves, names, unrecorded_version(pointer))
    current = pointer.version if pointer else None
    return {
        "name": name,
        "pointer": pointer.to_json() if pointer else None,
        "token": token,
        "versions": [_version_row(storage, name, v, current, v in served) for v in names],
        "history": [m.model_dump() for m in moves],
    }


def _version_row(storage: Storage, name: str, version: str, current: str | None, served: bool) -> dict:
    complete = storage.exists(MODELS, name, version, CARD_JSON)
    row: dict[str, Any] = {
        "version": version,
        "production": version == current,
        "served": served,
        "complete": complete,
        **model_parts(storage, name, version),
        "card": None,
    }
    if complete and not served:
        row["problem"] = (
            f"{version} was never production (no move in {storage.uri(MODELS, name, history.HISTORY)}/ puts it "
            "there): its promotion stopped before the pointer's swap, and its card's promotion never happened"
        )
    if complete:
        try:
            row["card"] = read_card(storage, name, version).to_json()
        except (ValueError, OSError, RecursionError) as e:
            unreadable = f"{storage.uri(MODELS, name, version, CARD_JSON)} is unreadable: {one_line(str(e), 200)}"
            row["problem"] = "; ".join(filter(None, [row.get("problem"), unreadable]))
    return row


def unrecorded_version(pointer: ProductionPointer | None) -> str | None:
    """The version of a pointer written before moves were recorded (None for any other): history.served counts it."""
    return pointer.version if pointer is not None and pointer.move is None else None


def version_costs(rows: list[dict]) -> list[dict]:
    """What each promoted version cost, as its card states it (one computation, at promotion, after the copy
    check: tuneproof.control.cost.VersionCost as JSON), oldest first; versions whose card has none are left out,
    and so are copies production never served (their card's cost is of a promotion that never happened).
    `rows` are show_model's version rows."""
    return [row["card"]["cost"] for row in rows if row["served"] and row.get("card") and row["card"].get("cost")]


def read_card(storage: Storage, name: str, version: str) -> ModelCard:
    """A version's card.json: FileRefused (not a regular file, over MAX_CARD_BYTES), ValueError (not a card,
    naming its first problem, or one whose run_id is not its version's run: a rollback points production at
    that run)."""
    data = read_stored(storage, (MODELS, name, version, CARD_JSON), MAX_CARD_BYTES)
    try:
        card = ModelCard.model_validate_json(data)
    except ValidationError as e:
        raise ValueError(f"not a model card ({first_problem(e)})") from None
    if card.run_id != _run_of(card.version):
        raise ValueError(f"not a model card (run_id is {card.run_id!r}, not the run of its version {card.version!r})")
    return card


def model_parts(storage: Storage, name: str, version: str) -> dict[str, str | None]:
    """Where a version's models are: "merged" (the full HF model the version is, what evaluation and
    serving load) and "adapter" (a LoRA run's peft adapter, in its adapter/ folder; None for full fine-tunes)."""
    path = posixpath.join(MODELS, name, version)
    adapter = posixpath.join(path, LORA_ADAPTER_DIR)
    return {
        "merged": path if storage.exists(path, "config.json") else None,
        "adapter": adapter if storage.exists(adapter, "adapter_config.json") else None,
    }


def versions(storage: Storage, name: str) -> list[str]:
    """Version directories in promotion order."""
    numbered = [(int(m.group(1)), v) for v in storage.listdir(MODELS, name) if (m := _VERSION.match(v))]
    return [v for _, v in sorted(numbered)]


def next_version(existing: list[str], run_id: str) -> str:
    """v<NNNN>-<run_id> with NNNN one above the highest existing number (pure)."""
    numbers = [int(m.group(1)) for m in map(_VERSION.match, existing) if m]
    return f"v{max(numbers, default=0) + 1:04d}-{run_id}"


# ---- promotion -------------------------------------------------------------------------------


def promote(
    storage: Storage,
    name: str,
    run_id: str,
    source_path: str,
    card: CardFacts,
    expected_token: str | None,
    *,
    lock_timeout_s: float = 30.0,
    stale_lock_s: float = 60.0,
    content_sha256: str | None = None,
    intent: MoveIntent | None = None,
    check_copy: Callable[[str], None] | None = None,
    cost_of: Callable[[Move], VersionCost] | None = None,
) -> ProductionPointer:
    """Copy the model at `source_path` to a new version, write its card, then move the pointer to it.

    content_sha256, when given, is the hash the caller's evidence is about: the copy must carry an
    export manifest with exactly that content (checked file by file on the copy), and the pointer names it.
    check_copy, when given, is called with the version's path after the copy and before the swap; what
    it raises (or anything else raises before the swap: cost_of, the card's write) stops the promotion with
    the pointer unchanged and the copy removed. An unreadable history refuses before anything is copied.
    cost_of, when given, is called after the check with the move about to be made: the card's `cost`, so
    the card states what the version cost up to and including its copy check, over the move's own window.
    intent says who promotes and why; the pointer and the history record it as the move (default: a
    promotion by this process's user).

    expected_token is read_pointer's token for the incumbent the candidate was evaluated against
    (None: there was none). If the pointer has moved since, PromotionConflict is raised, before
    copying when it is already visible, else at the swap; the loser's version copy is removed.
    A retry of a run that is already production returns the current pointer unchanged; another run's model with
    the content production already serves raises AlreadyServing, before the token check (whatever the candidate
    was evaluated against, those bytes serve now) and before copying. Once the pointer names
    the new version, this run's earlier copies that production never served are removed (_remove_leftovers).
    Returns the new pointer.
    """
    pointer, token = read_pointer(storage, name)
    if is_promotion_of(pointer, run_id, content_sha256):
        return pointer
    if serves_content(pointer, content_sha256):
        raise AlreadyServing(pointer)
    if token != expected_token:
        raise PromotionConflict(name, expected_token, token, _version_of(pointer))
    last = pointer.move if pointer else None
    history.backfill(storage, name, last)
    earlier = history.read(storage, name, last)  # before the copy: an unreadable history leaves nothing behind
    version = next_version(storage.listdir(MODELS, name), run_id)
    _copy_model(storage, source_path, (MODELS, name, version))
    try:
        if content_sha256 is not None:
            _check_copy(storage, name, version, content_sha256)
        if check_copy is not None:
            check_copy(posixpath.join(MODELS, name, version))
        move = history.next_move(last, _version_of(pointer), intent or default_intent(), version, run_id, now_iso())
        full_card = ModelCard(
            **{**dict(card), "name": name, "run_id": run_id},
            version=version,
            source_path=source_path,
            cost=cost_of(move) if cost_of is not None else None,
            history=[*earlier, move],
        )
        storage.write_bytes(render_model_card(full_card).encode(), MODELS, name, version, CARD_MD)
        storage.write_json(full_card.to_json(), MODELS, name, version, CARD_JSON)
    except Exception:
        # Whatever stops the promotion between the copy and the swap (a failed check, a cost that cannot be
        # computed, a card that cannot be written) leaves no version behind: the pointer never named it.
        storage.remove(MODELS, name, version, recursive=True)
        raise
    new_pointer = pointer_doc(name, version, run_id, content_sha256, move)
    try:
        swap_pointer(storage, name, new_pointer, expected_token, lock_timeout_s, stale_lock_s)
    except PromotionConflict:
        _remove_unpointed(storage, name, version)
        raise
    try:
        history.append(storage, name, move)
    except (history.HistoryUnreadable, OSError) as e:  # the move is in the pointer: readers and movers backfill it
        logging.getLogger("tuneproof.registry").warning(f"{name}: promotion #{move.seq} is not yet in its history: {e}")
    _remove_leftovers(storage, name, run_id, version, [*earlier, move])
    return new_pointer


def default_intent() -> MoveIntent:
    return MoveIntent(kind="promote", by=current_user(), reason="every gate and the resume test passed")


def current_user() -> str:
    """Who is moving the pointer: the user this process runs as (from the environment, else the password
    database, as a worker's process may have no USER), on which host."""
    try:
        user = getpass.getuser()
    except (KeyError, OSError):  # a uid with no passwd entry (some containers)
        user = "unknown"
    return f"{user}@{socket.gethostname()}"


def pointer_doc(name: str, version: str, run_id: str, content_sha256: str | None, move: Move) -> ProductionPointer:
    return ProductionPointer(
        name=name,
        version=version,
        path=posixpath.join(MODELS, name, version),
        run_id=run_id,
        promoted_at=move.at,
        previous_version=move.from_version,
        content_sha256=content_sha256,
        move=move,
    )


def is_promotion_of(
    pointer: ProductionPointer | None, run_id: str, content_sha256: str | None
) -> TypeGuard[ProductionPointer]:
    """The pointer already names this run's model with this content (a retry's or a continuation's
    second promotion is then the first one, unchanged). Pure."""
    return pointer is not None and pointer.run_id == run_id and pointer.content_sha256 == content_sha256


def serves_content(pointer: ProductionPointer | None, content_sha256: str | None) -> TypeGuard[ProductionPointer]:
    """Production serves exactly `content_sha256`, whichever run promoted it (a pointer or a promotion without a
    content hash says nothing). Pure."""
    return pointer is not None and content_sha256 is not None and pointer.content_sha256 == content_sha256


def _copy_model(storage: Storage, source_path: str, dest_parts: tuple[str, ...]) -> None:
    """File by file (server-side copies on S3), so a large model never passes through this process."""
    if not storage.exists(source_path, "config.json"):
        raise FileNotFoundError(
            f"{storage.uri(source_path)} has no config.json: expected an exported Hugging Face model"
        )
    src = storage.path(source_path).rstrip("/")
    for remote in storage.fs.find(src):
        dest = storage.path(*dest_parts, remote[len(src) :].lstrip("/"))
        if not storage.is_s3:
            os.makedirs(os.path.dirname(dest), exist_ok=True)
        storage.fs.copy(remote, dest)


def _check_copy(storage: Storage, name: str, version: str, content_sha256: str) -> None:
    """The version's files must be exactly the content that was judged (ExportUnverified otherwise)."""
    manifest = markers.verify_export(storage, MODELS, name, version)
    if manifest.content_sha256 != content_sha256:
        raise markers.ExportUnverified(
            f"{storage.uri(MODELS, name, version)} has content {manifest.content_sha256[:12]}, "
            f"expected {content_sha256[:12]}"
        )


def _remove_leftovers(storage: Storage, name: str, run_id: str, version: str, moves: list[Move]) -> None:
    """Once `version` is production, remove this run's earlier copies that production never served: an attempt of
    this same promotion that died between its card and the swap left them, with a card claiming a move that never
    happened. Another run's copies are never touched.

    Removed rather than reused: reusing one would give production a version numbered below copies made since,
    and promotion order is version order (a rollback goes back by it). Done after the swap, not before the copy:
    a concurrent attempt of this run still between its card and its swap read the pointer before this swap, so its
    swap can only lose, whereas removing its copy before this swap could leave a pointer to a removed folder.
    `moves` is the whole history with this promotion's move (this swap won from the last of the others).
    A store that fails here is a warning: the promotion stands, and listings name the copies left."""
    try:
        names = versions(storage, name)
        earlier = names[: names.index(version)] if version in names else []
        served = history.served(moves, names, None)
        for leftover in [v for v in earlier if v not in served and _run_of(v) == run_id]:
            storage.remove(MODELS, name, leftover, CARD_JSON)  # the completion marker first: never a half-removed
            storage.remove(MODELS, name, leftover, recursive=True)  # copy that looks complete
    except OSError as e:
        logging.getLogger("tuneproof.registry").warning(
            f"{name}: copies of run {run_id} that never served could not all be removed: {e}"
        )


def _run_of(version: str) -> str | None:
    match = _VERSION.match(version)
    return match.group(2) if match else None


def _remove_unpointed(storage: Storage, name: str, version: str) -> None:
    """Remove a losing copy unless the pointer names it (a concurrent retry of the same run won)."""
    pointer, _ = read_pointer(storage, name)
    if pointer is None or pointer.version != version:
        storage.remove(MODELS, name, version, recursive=True)


def swap_pointer(
    storage: Storage,
    name: str,
    pointer: ProductionPointer,
    expected_token: str | None,
    lock_timeout_s: float,
    stale_lock_s: float,
) -> None:
    data = json.dumps(pointer.to_json(), indent=2, sort_keys=True).encode()
    if cas.write_if(
        storage, data, expected_token, *_pointer_parts(name), lock_timeout_s=lock_timeout_s, stale_lock_s=stale_lock_s
    ):
        return
    current, token = read_pointer(storage, name)
    if current is not None and current.version == pointer.version:
        return  # our own earlier write landed (a retry whose response was lost): already points at this version
    raise PromotionConflict(name, expected_token, token, _version_of(current))


def _version_of(pointer: ProductionPointer | None) -> str | None:
    return pointer.version if pointer else None


def _pointer_parts(name: str) -> tuple[str, str, str]:
    return (MODELS, name, POINTER)


def read_history(storage: Storage, name: str) -> list[Move]:
    """Every move of the model's production pointer, oldest first (tuneproof.control.history)."""
    pointer = read_pointer(storage, name)[0]
    return history.read(storage, name, pointer.move if pointer else None)


# ---- the model card (pure) -------------------------------------------------------------------


def render_model_card(card: ModelCard) -> str:
    """MODEL_CARD.md from a card (pure): provenance, metrics, gate lines, and the suites table, cost and
    production history when it has them."""
    return "\n".join(
        [
            f"# {card.name} {card.version}",
            "",
            _promotion_sentence(card),
            "",
            "## Provenance",
            "",
            "| | |",
            "|---|---|",
            *_provenance_rows(card),
            "",
            "## Metrics",
            "",
            *_metric_table(card.metrics, card.incumbent_version),
            "",
            "## Gates",
            "",
            *([f"- {line}" for line in card.gates] or ["- no gate lines recorded"]),
            "",
            *(["## Regression suites", "", *suite_table(card.suites), ""] if card.suites else []),
            *(["## Cost", "", *_cost_section(card.cost, card.run_id), ""] if card.cost else []),
            *(["## Production history", "", *history.render(card.history), ""] if card.history else []),
        ]
    )


def _promotion_sentence(card: ModelCard) -> str:
    replaced = f"replacing {card.incumbent_version}" if card.incumbent_version else "the first production model"
    forced = card.forced
    if not forced:
        approved = (
            f" and {card.approval.by} approved it ({card.approval.comment or 'no comment'})" if card.approval else ""
        )
        return f"Promoted from run `{card.run_id}` after every gate and the resume test passed{approved}, {replaced}."
    bypassed = "; ".join(forced.bypassed) or "nothing (all checks had passed)"
    return (
        f"Promoted by override from run `{card.run_id}`, {replaced}, by {forced.by}: "
        f"{forced.reason}. Checks bypassed: {bypassed}."
    )


def _provenance_rows(card: ModelCard) -> list[str]:
    replay, resume = card.replay, card.resume
    rows = [
        ("run", card.run_id),
        ("source", card.source_path),
        ("base model", card.base_model),
        ("base content hash", card.base_content_hash),
        ("base recipe", card.base_recipe and json.dumps(card.base_recipe, sort_keys=True)),
        ("method", card.method and _method_line(card)),
        ("dataset hash", card.dataset_hash),
        (
            "replayed",
            replay and f"{replay.share:.0%} of training rows from {replay.source} (sha256 {replay.sha256[:12]})",
        ),
        ("image digest", card.image_digest),
        ("code SHA", card.code_sha and card.code_sha + (" (dirty)" if card.code_dirty else "")),
        ("config hash", card.config_hash),
        (
            "resume",
            resume is not None
            and resume.restored_step is not None
            and f"restored at step {resume.restored_step}, max replay loss diff {resume.max_loss_diff}",
        ),
    ]
    return [f"| {label} | {f'`{value}`' if value else 'not recorded'} |" for label, value in rows]


def _method_line(card: ModelCard) -> str:
    """'lora: 12,345 of 1,234,567 parameters trained; adapter in adapter/' (pure)."""
    trainable, total = card.trainable_params, card.total_params
    counted = trainable is not None and total is not None
    line = f"{card.method}" + (f": {trainable:,} of {total:,} parameters trained" if counted else "")
    return line + (f"; adapter in {card.adapter}/" if card.adapter else "")


def _metric_table(metrics: dict[str, dict[str, float | None] | None], incumbent_version: str | None) -> list[str]:
    cand, base, inc = metrics.get("candidate") or {}, metrics.get("base") or {}, metrics.get("incumbent") or {}
    head = f"incumbent {incumbent_version}" if incumbent_version else "incumbent (none)"
    rows = [f"| metric | candidate | base | {head} | vs base | vs incumbent |", "|---|---|---|---|---|---|"]
    for metric in sorted(cand):
        c, b, i = cand.get(metric), base.get(metric), inc.get(metric)
        rows.append(f"| {metric} | {_num(c)} | {_num(b)} | {_num(i)} | {_delta(c, b)} | {_delta(c, i)} |")
    return rows


def suite_table(rows: list[SuiteRow]) -> list[str]:
    """Markdown suites x models: one row per suite (the task's split first) and metric, with its verdicts (pure)."""
    lines = ["| suite | metric | candidate | base | incumbent | verdict |", "|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(
            f"| {r.suite} | {r.metric} | {_num(r.candidate)} | {_num(r.base)} | {_num(r.incumbent)} | {r.verdict} |"
        )
    return lines


def _num(x: Any) -> str:
    return "–" if x is None else f"{float(x):.4g}"


def _delta(a: Any, b: Any) -> str:
    return "–" if a is None or b is None else f"{float(a) - float(b):+.4g}"


def _cost_section(cost: VersionCost, run_id: str) -> list[str]:
    """The version's cost: every charged run, totals, goodput."""
    resources = sorted({r for run in cost.charged for r in run.resource_seconds} | {"CPU"})
    rows = [
        f"| run | outcome | {' | '.join(f'{r}-seconds' for r in resources)} | cost | fine-tune steps |",
        "|---|---|" + "---|" * (len(resources) + 2),
    ]
    for run in cost.charged:
        outcome = "promoted as this version" if run.run_id == run_id else run.status
        seconds = " | ".join(f"{run.resource_seconds.get(r, 0.0):.1f}" for r in resources)
        rows.append(f"| {run.run_id} | {outcome} | {seconds} | {_money(run.money)} | {run.steps} |")
    total = " | ".join(f"**{cost.resource_seconds.get(r, 0.0):.1f}**" for r in resources)
    rows.append(f"| **total** | {len(cost.charged)} run(s) | {total} | **{_money(cost.money)}** | {cost.steps_paid} |")
    goodput = "n/a (no fine-tune step paid for)" if cost.goodput is None else f"{cost.goodput:.2f}"
    priced = ", ".join(f"{r} {p:g}" for r, p in sorted(cost.prices.items()))
    rows += [
        "",
        f"Goodput: {cost.promoted_steps} fine-tune steps in this model / {cost.steps_paid} paid for = {goodput}.",
        f"Prices per resource-hour (the run's cost.prices): {priced}." if priced else "No price table: seconds only.",
        *card_notes(cost),
    ]
    if cost.apart:
        rows.append(f"Canary and comparison runs in the same period, not charged: {', '.join(cost.apart)}.")
    return rows


def _money(value: float | None) -> str:
    return "no price table" if value is None else f"{value:.4f}"
