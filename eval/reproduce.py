"""The evaluation self-test's last check: the base model's greedy answers repeat on a split it answered before.

Called by eval/evaluate_job.py inside the evaluate job, after every model has answered. Greedy decoding
of one model on one set of prompts should give the same answers again; when it does not, the measuring
apparatus is not deterministic (sampling left on, a nondeterministic kernel, a changed generation
setting), so no gate it decides can be replayed: the evaluation ends "evaluation not reproducible: ..."
in the infrastructure class, like the rest of the self-test, never as a gate failure.

The reference is the latest earlier evaluation of the same base (its content hash, or for a base named by
hub id the commit it resolved to, as "hub-commit-<sha>") on the same eval split (its hash) with the same
eval.max_new_tokens (which bounds the answers), kept at one content-addressed path, so the lookup is one read
whatever the number of runs:

    evaluations/<split sha256>/base-<base content sha256 | hub-commit-<sha>>-tokens<max_new_tokens>.json

It holds a short digest of each of the base's answers, in split order, with the run, batch size and
device that produced them. Answers are compared, not scores: a changed answer that scores the same is
still a scorer that does not repeat itself. Up to eval.max_irreproducible_fraction of the items compared
(the first min(now, then) items: the split order is fixed) may differ, since across batch sizes and
devices greedy answers can flip on near-ties (lm-evaluation-harness#3357). A base with neither a content
hash nor a hub commit is not checked. A reproduced (or first) evaluation becomes the reference; a failed one
leaves the earlier reference in place.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, ValidationError

from eval.generation import pick_device
from training import jobkit
from tuneproof.core.config_eval import EvalConfig
from tuneproof.core.hashing import sha256_bytes
from tuneproof.core.results import FailureClass, StageFailure, now_iso
from tuneproof.core.storage import Storage
from tuneproof.core.summaries_eval import Reproduction

HUB_COMMIT = "hub-commit-"
"""How a base's identity reads when it is the hub commit it was loaded at, not a hash of local files."""

DIGEST_CHARS = 16
"""Hex characters kept of each answer's sha256: 64 bits, enough to tell two answers apart, a few bytes an item."""


class BaseAnswers(BaseModel):
    """One evaluation's base answers on one split, as the reference file stores them."""

    model_config = ConfigDict(extra="forbid")

    run_id: str
    written_at: str
    split_sha256: str
    base_sha256: str
    """The base's content hash, or HUB_COMMIT and the commit a base named by hub id loaded at."""
    max_new_tokens: int
    batch_size: int
    device: str
    answers: list[str]
    """answer_digest of each answer, in the split's order."""


def answer_digest(answer: str) -> str:
    return sha256_bytes(answer.encode())[:DIGEST_CHARS]


def reference_parts(split: str, base: str, max_new_tokens: int) -> tuple[str, ...]:
    return ("evaluations", split, f"base-{base}-tokens{max_new_tokens}.json")


def base_reproduction(
    storage: Storage, run_id: str, split: str, base_sha256: str | None, answers: list[str], cfg: EvalConfig
) -> Reproduction | None:
    """The check for this evaluation's base answers; None (logged) for a base with no identity: `base_sha256` is
    its content hash, or HUB_COMMIT and the hub commit it loaded at."""
    if base_sha256 is None:
        jobkit.log(
            "self-test: the base has neither a content hash nor a hub commit: its reproducibility is not checked"
        )
        return None
    now = BaseAnswers(
        run_id=run_id,
        written_at=now_iso(),
        split_sha256=split,
        base_sha256=base_sha256,
        max_new_tokens=cfg.max_new_tokens,
        batch_size=cfg.batch_size,
        device=str(pick_device()[0]),
        answers=[answer_digest(a) for a in answers],
    )
    return check_base_reproduces(storage, now, answers, cfg.max_irreproducible_fraction)


def check_base_reproduces(storage: Storage, now: BaseAnswers, answers: list[str], cap: float) -> Reproduction:
    """Compare `now` (digests of `answers`) with the reference, then make `now` the reference.

    Raises StageFailure (infrastructure) "evaluation not reproducible: ..." when more than `cap` of the
    items compared differ."""
    parts = reference_parts(now.split_sha256, now.base_sha256, now.max_new_tokens)
    earlier = read_reference(storage, parts)
    result = Reproduction(reference_uri=storage.uri(*parts))
    if earlier is None:
        jobkit.log(
            f"self-test: the base was not evaluated on this split with max_new_tokens={now.max_new_tokens} "
            f"before; its answers are the reference from now on ({result.reference_uri})"
        )
    else:
        result = compared(earlier, now, result.reference_uri)
        cause = irreproducible_cause(earlier, now, result, answers, cap)
        if cause:
            raise StageFailure(FailureClass.infrastructure, f"evaluation not reproducible: {cause}")
        jobkit.log(
            f"self-test: base answers {result.items - result.differing} of {result.items} items as in run "
            f"{earlier.run_id!r} (batch {earlier.batch_size} on {earlier.device}): reproduced"
        )
    storage.write_json(now.model_dump(), *parts)
    return result


def read_reference(storage: Storage, parts: tuple[str, ...]) -> BaseAnswers | None:
    """The reference at `parts`; None when there is none, or it cannot be read (then it is replaced)."""
    if not storage.exists(*parts):
        return None
    try:
        return BaseAnswers.model_validate(storage.read_json(*parts))
    except (OSError, ValueError, ValidationError) as e:
        jobkit.log(f"self-test: reference {storage.uri(*parts)} is unreadable ({type(e).__name__}); replacing it")
        return None


def compared(earlier: BaseAnswers, now: BaseAnswers, reference_uri: str) -> Reproduction:
    """How many of the items both answered (the first min(then, now)) now have a different answer."""
    pairs = list(zip(earlier.answers, now.answers))
    differing = sum(a != b for a, b in pairs)
    return Reproduction(reference_uri=reference_uri, earlier_run=earlier.run_id, items=len(pairs), differing=differing)


def irreproducible_cause(
    earlier: BaseAnswers, now: BaseAnswers, result: Reproduction, answers: list[str], cap: float
) -> str | None:
    """Why the base's answers do not reproduce, naming the run, the settings and the first changed item; None
    when at most `cap` of the items compared differ."""
    if not result.items or result.differing / result.items <= cap:
        return None
    first = next(i for i, (a, b) in enumerate(zip(earlier.answers, now.answers)) if a != b)
    return (
        f"the base ({identity_words(now.base_sha256)}) answered {result.differing} of {result.items} items "
        f"differently than in run {earlier.run_id!r} on the same split ({now.split_sha256[:12]}) with "
        f"max_new_tokens={now.max_new_tokens} (then batch {earlier.batch_size} on {earlier.device}, now batch "
        f"{now.batch_size} on {now.device}), over eval.max_irreproducible_fraction={cap:g}; first: item {first}, "
        f"now {answers[first][:60]!r}; greedy decoding should repeat its answers, so the scorer is not "
        "deterministic (sampling on, or a nondeterministic kernel)"
    )


def identity_words(base: str) -> str:
    """'content 0123456789ab' or 'hub commit 0123456789ab': a base's identity as a cause names it."""
    if base.startswith(HUB_COMMIT):
        return f"hub commit {base.removeprefix(HUB_COMMIT)[:12]}"
    return f"content {base[:12]}"
