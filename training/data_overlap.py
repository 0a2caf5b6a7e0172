"""How much of what the fine-tune is judged on it also trains on: the eval split's and each suite's overlap.

Used by the data stage (training/data_prep.py) inside its Ray job, after the split and before encoding:
it reads every turn's text, less the template's literals and system texts training rows share, into one
index of the training split (training/contamination.py) that the eval split and each suite are measured
against, and fails the stage as a data failure when an overlap is above
data.max_contamination. Regression suites (eval.suites) are read with eval/suites.py.
"""

from __future__ import annotations

import re
from typing import Any

from eval.suites import read_suite
from training.contamination import TrainingIndex, shared_texts
from training.data_sources import Conversation
from training.modeling import special_token_finder
from tuneproof.core.config import PipelineConfig
from tuneproof.core.config_data import DataConfig
from tuneproof.core.results import FailureClass, StageFailure
from tuneproof.core.summaries_data import Contamination, DataSummary, SuiteFile


class TrainingSplit:
    """The training split as the overlap measure sees it: every turn's text, less what every row shares and so
    says nothing of a row (`literals`, the template's own text, and the system texts that training rows share:
    a data.fields.system column or system turns of one prompt for all), normalised and hashed once for the eval
    split and every regression suite."""

    def __init__(self, train: list[Conversation], literals: tuple[str, ...] = ()) -> None:
        self.literals, self.shared = literals, shared_system_texts(train)
        self.index = TrainingIndex.of(self.text(c) for c in train)

    def text(self, conv: Conversation) -> str:
        return conversation_text(conv, self.literals, self.shared)

    def overlap(self, eval_convs: list[Conversation]) -> Contamination:
        """Overlap of eval conversations with the training ones, each read as the training rows are."""
        return self.index.measure((f"{c.where}:{c.row}", self.text(c)) for c in eval_convs)


def suite_overlaps(cfg: PipelineConfig, train: TrainingSplit, tokenizer: Any) -> list[SuiteFile]:
    """Each regression suite (eval.suites) hashed and measured against the training split: a suite whose items
    the fine-tune trains on measures recall, not retention, so above data.max_contamination it is a data failure.
    So is an item holding a special token of the base's tokenizer (Suite.special_token), found here before any
    training rather than in the evaluate job."""
    find = special_token_finder(tokenizer)
    suites = [read_suite(name, suite_cfg, cfg.storage.endpoint_url) for name, suite_cfg in cfg.eval.suites.items()]
    for suite in suites:
        if problem := suite.special_token(find):
            raise StageFailure(FailureClass.data, problem)
    # Measured together: their short items cost one more pass over the training texts, not one per suite.
    overlaps = train.index.measure_all([suite.texts() for suite in suites])
    files = []
    for suite, found in zip(suites, overlaps, strict=True):
        files.append(
            SuiteFile(
                name=suite.name, source=suite.source, sha256=suite.sha256, items=len(suite.ids), contamination=found
            )
        )
        check_contamination(found, cfg.data.max_contamination, f"suite {suite.name} ({suite.source})")
    return files


def shared_system_texts(train: list[Conversation]) -> frozenset[str]:
    """System texts that two or more training rows carry: the dataset's boilerplate. One row's own system text
    is kept, since it may hold that row's content."""
    texts: list[str] = []
    for conv in train:
        if conv.messages is not None:
            texts += [turn.get("content", "") for turn in conv.messages if turn.get("role") == "system"]
        elif conv.parts.get("system"):
            texts.append(conv.parts["system"])
    return shared_texts(texts)


def conversation_text(conv: Conversation, literals: tuple[str, ...] = (), shared: frozenset[str] = frozenset()) -> str:
    """The row's text as the overlap measure sees it: every turn, less the template's literals and `shared`
    system texts."""
    if conv.messages is not None:
        kept = (t for t in conv.messages if not (t.get("role") == "system" and t.get("content") in shared))
        return " ".join(turn.get("content", "") for turn in kept)
    text = " \n ".join(v for k, v in conv.parts.items() if not (k == "system" and v in shared))
    for literal in literals:
        text = text.replace(literal, " \n ")
    return text


def template_literals(data: DataConfig) -> tuple[str, ...]:
    """The fixed text of the template shape's prompt and response (between its {column} fields), longest first."""
    if data.template is None:
        return ()
    pieces = re.split(r"\{[^{}]*\}", data.template.prompt + "\n" + data.template.response)
    return tuple(sorted({p.strip() for p in pieces if p.strip()}, key=len, reverse=True))


def check_contamination(found: Contamination | None, limit: float, what: str = "eval split") -> None:
    """A data failure naming the overlapping eval items when more than `limit` of them repeat training rows."""
    if found is None or found.fraction <= limit:
        return
    ids = ", ".join(found.overlapping_ids[:10]) + (" ..." if found.overlapping > 10 else "")
    raise StageFailure(
        FailureClass.data,
        f"{what} overlaps the training split: {found.overlapping} of {found.eval_items} eval items "
        f"({found.fraction:.1%}; {found.exact_matches} normalised exact matches, the rest a shared "
        f"{found.ngram}-word n-gram or a short item whole inside a training row) > data.max_contamination "
        f"{limit:g}: {ids}",
        DataSummary(contamination=found),
    )
