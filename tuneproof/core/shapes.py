"""Pure logic of the data shapes: which shape a source has, prompt templates, conversation checks, the label mask.

- columns: one prompt column and one response column (`datahash.check_row`), as before shapes existed.
- template: a prompt laid out from named columns (`render_template`: an empty optional column leaves
  no stray header or blank line), plus a response column.
- messages: a list of {role, content} turns, rendered with the tokenizer's own chat template; the
  loss covers assistant turns only (`assistant_labels`), evaluation answers the last one.

No I/O and no tokenizer import: training/data_prep.py passes the template's render and the
tokenizer's encode in as plain functions, so the mask logic is tested with the real tiny tokenizer
and with toy ones alike.
"""

from __future__ import annotations

import re
import string
from collections.abc import Callable
from typing import Any

from tuneproof.core.datahash import check_row
from tuneproof.core.hashing import IGNORE_INDEX, sha256_json

ROLES = ("system", "user", "assistant")
PARAGRAPH_BREAK = re.compile(r"\n[ \t]*\n")

Messages = list[dict[str, str]]
Render = Callable[[Messages, bool], str]  # (messages, add_generation_prompt) -> text
Tokenize = Callable[[str], list[int]]


class NotAPrefix(ValueError):
    """A conversation's prefix does not tokenize to a prefix of the whole: the chat template re-renders earlier turns,
    or the tokenizer merges a turn's first characters with the text before it."""


def resolve_shape(configured: str, first_row: Any, messages_column: str, has_template: bool) -> str:
    """The shape to read rows as: the configured one, or for auto, decided from the first decodable row."""
    if configured != "auto":
        return configured
    if isinstance(first_row, dict) and isinstance(first_row.get(messages_column), list):
        return "messages"
    return "template" if has_template else "columns"


def shape_identity(
    shape: str, template: dict[str, str] | None, messages_column: str, loss_on: str
) -> dict[str, Any] | None:
    """What the content hash adds for a shape; None for columns, whose hash predates shapes and must not move."""
    if shape == "columns":
        return None
    if shape == "template":
        return {"shape": "template", "template_sha256": sha256_json(template or {})}
    return {"shape": "messages", "messages_column": messages_column, "loss_on": loss_on}


# ---- template ----------------------------------------------------------------------------------


def template_columns(prompt: str) -> list[str]:
    """The column names a format string refers to, in order, each once."""
    names = [name for _, name, _, _ in string.Formatter().parse(prompt) if name is not None]
    return list(dict.fromkeys(names))


def render_template(prompt: str, values: dict[str, str]) -> str:
    """The prompt with its columns filled in; a paragraph, then a line, whose columns are all empty is left out.

    "### Instruction:\\n{instruction}\\n\\n### Input:\\n{input}" with an empty input renders as the
    instruction paragraph alone: no "### Input:" header, no trailing blank line.
    """
    paragraphs = []
    for paragraph in PARAGRAPH_BREAK.split(prompt):
        if _all_empty(paragraph, values):
            continue
        lines = [line.format_map(values) for line in paragraph.split("\n") if not _all_empty(line, values)]
        text = "\n".join(lines).strip("\n")
        if text.strip():
            paragraphs.append(text)
    return "\n\n".join(paragraphs).strip()


def _all_empty(text: str, values: dict[str, str]) -> bool:
    names = template_columns(text)
    return bool(names) and all(not values[name].strip() for name in names)


def check_template_row(
    row: Any, prompt: str, response_column: str, system_column: str | None
) -> tuple[str | None, dict[str, str]]:
    """(reason, {}) for a row to drop, or (None, {prompt, response[, system]}) with the prompt rendered.

    Every column the template names must be present; null or blank is an empty (optional) part, but a row
    whose named columns are all empty is dropped as empty: its prompt would be the template's fixed text alone.
    """
    if not isinstance(row, dict):
        return "wrong_type", {}
    values = {}
    for name in template_columns(prompt):
        if name not in row:
            return "missing_template_column", {}
        value = "" if row[name] is None else row[name]
        if not isinstance(value, str):
            return "wrong_type", {}
        values[name] = value
    reason, parts = check_row(row, {"response": response_column, "system": system_column})
    if reason:
        return reason, {}
    if not any(value.strip() for value in values.values()):
        return "empty", {}
    return None, {"prompt": render_template(prompt, values), **parts}


# ---- messages ----------------------------------------------------------------------------------


def check_messages(row: Any, column: str) -> tuple[str | None, Messages]:
    """(reason, []) for a row to drop, or (None, turns) cut after the last assistant turn.

    Turns keep only role and content; what follows the last assistant turn has nothing to learn
    and nothing to evaluate, so it is left out. A kept user or assistant turn that is blank is empty
    (the labels would teach a blank reply), and the first turn after any system turn must be the user's:
    an assistant turn before it answers nothing, and with no turn before it the chat template has nothing
    to render as its prompt.
    """
    if not isinstance(row, dict):
        return "wrong_type", []
    turns = row.get(column)
    if turns is None:
        return "missing_field", []
    if not isinstance(turns, list):
        return "wrong_type", []
    if not turns:
        return "empty_conversation", []
    messages = []
    for turn in turns:
        if not isinstance(turn, dict) or "role" not in turn or "content" not in turn:
            return "bad_turn", []
        if turn["role"] not in ROLES:
            return "unknown_role", []
        if not isinstance(turn["content"], str):
            return "non_string_content", []
        messages.append({"role": turn["role"], "content": turn["content"]})
    last = last_assistant(messages)
    if last is None:
        return "no_assistant_turn", []
    kept = messages[: last + 1]
    spoken = [turn for turn in kept if turn["role"] != "system"]
    if spoken[0]["role"] != "user":
        return "no_user_turn", []
    if any(not turn["content"].strip() for turn in spoken):
        return "empty", []
    return None, kept


def last_assistant(messages: Messages) -> int | None:
    return next((i for i in range(len(messages) - 1, -1, -1) if messages[i]["role"] == "assistant"), None)


def with_system(messages: Messages, system_prompt: str | None) -> Messages:
    """data.system_prompt as the first turn of a conversation that brings no system turn of its own."""
    if not system_prompt or (messages and messages[0]["role"] == "system"):
        return messages
    return [{"role": "system", "content": system_prompt}, *messages]


def eval_pair(messages: Messages, render: Render) -> tuple[str, str]:
    """(prompt, reference): everything before the last assistant turn with the generation prompt, and that turn."""
    last = last_assistant(messages)
    if last is None:
        raise ValueError("a conversation without an assistant turn has no reference")
    return render(messages[:last], True), messages[last]["content"]


def labelled_turns(messages: Messages, loss_on: str) -> list[int]:
    """Indices of the assistant turns the loss covers: every one, or the last."""
    turns = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    return turns[-1:] if loss_on == "last_assistant" else turns


def renderings(messages: Messages, loss_on: str) -> set[tuple[int, bool]]:
    """Every (prefix length, add_generation_prompt) that `assistant_labels` and `eval_pair` render.

    The data stage renders them for many conversations in one batched call before it builds labels,
    so each conversation is rendered once per distinct prefix (eval_pair's prompt is the last turn's
    start, and the last turn's end is the whole conversation).
    """
    keys = {(len(messages), False)}
    for i in labelled_turns(messages, loss_on):
        keys |= {(i, True), (i + 1, False)}
    last = last_assistant(messages)
    if last is not None:
        keys.add((last, True))
    return keys


def assistant_labels(
    messages: Messages, render: Render, tokenize: Tokenize, loss_on: str = "all_assistant"
) -> tuple[list[int], list[int]]:
    """(input_ids, labels) of a conversation that ends with an assistant turn; labels are -100 except on
    the assistant turns the loss covers (every one, or the last), whose content and end-of-turn token they keep.

    Each turn's tokens are found by diffing token prefixes: the conversation before the turn rendered
    with the generation prompt, and the conversation through the turn, must both tokenize to prefixes
    of the whole, and the turn is what lies between. Whitespace after a turn's end (ChatML's newline)
    is not the turn's to generate, so it stays unlabelled. A template that rewrites earlier turns
    when more follow, or a tokenizer that merges a turn's first characters with the text before it
    (a reply opening with "\\n" where "\\n\\n" is one token), raises NotAPrefix: the turn cannot be told
    apart by position.
    """
    ids = tokenize(render(messages, False).rstrip())
    labels = [IGNORE_INDEX] * len(ids)
    for i in labelled_turns(messages, loss_on):
        start = tokenize(render(messages[:i], True))
        end = tokenize(render(messages[: i + 1], False).rstrip())
        if ids[: len(start)] != start or ids[: len(end)] != end or len(end) <= len(start):
            raise NotAPrefix(
                f"assistant turn {i} {messages[i]['content'][:30]!r}: the conversation up to or through it does not "
                "tokenize to a prefix of the whole, so its tokens cannot be located"
            )
        labels[len(start) : len(end)] = ids[len(start) : len(end)]
    return ids, labels
