"""Conversations into training rows: the chat template, tokenizing, the overflow policy and packing.

Used by the data stage (training/data_prep.py) inside its Ray job. `encode_splits` renders each split
through the base model's chat template (ChatRenderer: plain Python for a template tuneproof knows,
checked against jinja on a sample of every batch), tokenizes with the fast tokenizer's backend, masks
the prompt out of the labels (the messages shape: everything but the assistant turns) and fits each row
to data.max_seq_len; `pack_split` packs the training split when data.overflow is pack. From
POOL_MIN_ROWS conversations on, chunks run on Ray actors, one per free CPU of the cluster
(training/parallel.py), merged in order: the same bytes, drops and errors as one process.
"""

from __future__ import annotations

import contextlib
import hashlib
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jinja2
import pyarrow as pa

from training import parallel
from training.data_files import SCHEMA, Example, examples_table
from training.data_sources import Conversation
from training.jobkit import log
from training.modeling import SPECIAL_TOKEN, special_token_finder
from tuneproof.core import datahash, shapes
from tuneproof.core.config_data import DataConfig
from tuneproof.core.hashing import IGNORE_INDEX
from tuneproof.core.results import StageFailure

# Conversations per batched chat-template call: large enough that the call's set-up is noise, small
# enough that a conversation the template rejects sends only its own chunk down the one-by-one path.
RENDER_CHUNK = 1024


# Chat templates rendered in plain Python, by the sha256 of the exact template string: a template edited by
# one character is not one of these and goes through jinja. Even a known one is checked against jinja on
# every batch's sample (ChatRenderer); jinja is what defines the text.
CHATML_TEMPLATE_SHA256 = "2eefca287a0f008b170ce31bc2c4dabb398a64eb74716bf64db5d9a21da50da9"
"""Plain ChatML, no default system turn: the tiny Qwen2's (tuneproof/app/tiny_model.py CHAT_TEMPLATE)."""


POOL_MIN_ROWS = 20_000
"""Conversations from which encoding runs on Ray actors: below it, a job of a few thousand rows takes well
under a second here and starting and feeding actors would cost about what they save."""


POOL_CHUNK_ROWS = 4096
"""Conversations per actor task: thousands, so each task's batched template and tokenizer calls keep their
batching, and enough tasks that the workers finish close together."""


VERIFY_FIRST, VERIFY_SPREAD = 64, 16
"""Conversations of each plain-Python batch that jinja renders too: the first ones, and some spread through the rest."""


@dataclass
class Encoded:
    """One split encoded and fitted, its drops (or the StageFailure it raised) held until `take`."""

    tables: list[pa.Table]
    drops: datahash.Drops
    failure: tuple[str, str] | None = None
    """(failure class, cause) of the StageFailure that encoding the split raised, at its first failing row."""

    def take(self, drops: datahash.Drops) -> pa.Table:
        """The split's examples as one table, its drops added to `drops`; raises what encoding the split raised."""
        if self.failure is not None:
            raise StageFailure(*self.failure)
        drops.merge(self.drops)
        return pa.concat_tables(self.tables) if self.tables else SCHEMA.empty_table()


Chunk = tuple[str, list[Conversation]]
"""(split, some of its conversations in order): a task carries its own rows, so an actor is sent only those."""


EncodedChunk = tuple[pa.Table | None, datahash.Drops, tuple[str, str] | None]
"""(examples as a SCHEMA table, drops, failure): Arrow buffers cross a pipe as they are, no Python object per token."""


def encode_splits(
    tokenizer: Any,
    splits: dict[str, list[Conversation]],
    data: DataConfig,
    render: ChatRenderer,
    overflow: dict[str, str],
) -> dict[str, Encoded]:
    """Each split through encode_split and fit_rows (with the split's `overflow` policy).

    From POOL_MIN_ROWS conversations on, in chunks of POOL_CHUNK_ROWS on Ray actors, one per free CPU of
    the cluster (training/parallel.py), merged in the original order: a row's example and its
    drop depend on that row alone, and Drops.merge keeps each reason's first rows, so the merge is
    what one pass over each split gives. Encoding stops at the first chunk that fails, as one pass would.
    """
    rows = sum(len(convs) for convs in splits.values())
    pooled = rows >= POOL_MIN_ROWS
    step = POOL_CHUNK_ROWS if pooled else max([len(convs) for convs in splits.values()] + [1])
    chunks = [
        (name, convs[start : start + step]) for name, convs in splits.items() for start in range(0, len(convs), step)
    ]
    workers = parallel.ray_workers(len(chunks)) if pooled else 1
    if workers > 1:
        log(f"encoding {rows} conversations in {len(chunks)} chunks on {workers} Ray actors")
    encoded = {name: Encoded([], datahash.Drops()) for name in splits}
    work = parallel.map_in_order(encode_chunk, chunks, (tokenizer, data, render, overflow), workers)
    with contextlib.closing(work) as results:
        for (name, _), (examples, drops, failure) in zip(chunks, results):
            if failure is not None:
                encoded[name].failure = failure
                break
            encoded[name].tables.append(examples)
            encoded[name].drops.merge(drops)
    return encoded


def encode_chunk(shared: tuple[Any, DataConfig, ChatRenderer, dict[str, str]], chunk: Chunk) -> EncodedChunk:
    """One chunk through encode_split and fit_rows, in a Ray actor or in this process."""
    tokenizer, data, render, overflow = shared
    name, convs = chunk
    drops = datahash.Drops()
    try:
        examples = fit_rows(*encode_split(tokenizer, convs, data, drops, render), data, drops, overflow[name])
    except StageFailure as e:  # its own pickling does not survive the trip from an actor: sent as its two fields
        return None, drops, (e.failure_class.value, e.cause)
    return examples_table(examples), drops, None


def encode_split(
    tokenizer: Any,
    convs: list[Conversation],
    data: DataConfig,
    drops: datahash.Drops,
    render: ChatRenderer | None = None,
) -> tuple[list[Example], list[Conversation]]:
    """(examples, the conversations they came from): a conversation holding a special token's text, one the
    chat template rejects, or one whose assistant turns' tokens cannot be located (shapes.NotAPrefix) is dropped."""
    render = render or ChatRenderer(tokenizer)
    convs = without_special_tokens(special_token_finder(tokenizer), convs, data.system_prompt, drops)
    if not convs or convs[0].messages is None:
        return encode(tokenizer, convs, data.system_prompt, render), convs
    chats = [shapes.with_system(conv.messages or [], data.system_prompt) for conv in convs]
    rendered = render_conversations(render, chats, data.loss_on)
    wanted = [
        text if generation_prompt else text.rstrip() for r in rendered for (_, generation_prompt), text in r.items()
    ]
    unique = list(dict.fromkeys(wanted))
    ids = dict(zip(unique, token_ids(tokenizer, unique)))
    examples, kept = [], []
    for conv, texts in zip(convs, rendered):
        try:
            examples.append(encode_messages(tokenizer, conv.messages or [], data, texts, ids))
            kept.append(conv)
        except jinja2.TemplateError as e:
            drops.add("template_rejected", conv.where, conv.row, f"{type(e).__name__}: {e}")
        except shapes.NotAPrefix as e:
            # One row's reply can merge with the prompt's tokens; a template that re-renders earlier turns
            # drops every multi-turn row, and datahash.drop_failure then fails the stage with the remedy.
            drops.add("not_a_prefix", conv.where, conv.row, str(e))
    return examples, kept


def without_special_tokens(
    find: Callable[[str], re.Match[str] | None],
    convs: list[Conversation],
    system_prompt: str | None,
    drops: datahash.Drops,
) -> list[Conversation]:
    """The conversations none of whose texts holds a special token of the tokenizer (modeling.special_token_finder);
    the others dropped as special_token. The same token in data.system_prompt, on every row, is a data failure."""
    if system_prompt is not None and (hit := find(system_prompt)):
        raise StageFailure("data", f"data.system_prompt holds {hit.group()!r}, {SPECIAL_TOKEN}")
    kept = []
    for conv in convs:
        turns = conv.messages or [{"role": name, "content": text} for name, text in conv.parts.items()]
        for turn in turns:
            text = turn.get("content")
            if isinstance(text, str) and (hit := find(text)):
                around = text[max(hit.start() - 40, 0) : hit.end() + 20]
                drops.add("special_token", conv.where, conv.row, f"{turn.get('role')}: {hit.group()!r} in …{around}…")
                break
        else:
            kept.append(conv)
    return kept


def encode_messages(
    tokenizer: Any,
    messages: shapes.Messages,
    data: DataConfig,
    rendered: dict[tuple[int, bool], str] | None = None,
    token_cache: dict[str, list[int]] | None = None,
) -> Example:
    """One conversation rendered with the tokenizer's chat template; labels on its assistant turns only.

    `rendered` ({(prefix length, add_generation_prompt): text}) and `token_cache` ({text: ids}) hold what
    encode_split already rendered and tokenized in batches; anything not in them is rendered or
    tokenized here, one call at a time, so the result never depends on what was batched. Raises
    shapes.NotAPrefix where the assistant turns' tokens cannot be located.
    """
    messages = shapes.with_system(messages, data.system_prompt)
    rendered, token_cache = rendered or {}, token_cache or {}

    def render(turns: shapes.Messages, add_generation_prompt: bool) -> str:
        # shapes renders prefixes of this one conversation only, so a prefix's length names it.
        text = rendered.get((len(turns), add_generation_prompt))
        if text is None:
            text = tokenizer.apply_chat_template(turns, tokenize=False, add_generation_prompt=add_generation_prompt)
        return text

    def tokenize(text: str) -> list[int]:
        cached = token_cache.get(text)
        # A copy: two conversations with equal text must not share one list.
        return list(cached) if cached is not None else tokenizer(text, add_special_tokens=False)["input_ids"]

    ids, labels = shapes.assistant_labels(messages, render, tokenize, data.loss_on)
    prompt, reference = shapes.eval_pair(messages, render)
    return Example(ids, labels, prompt, reference)


def render_conversations(
    render: ChatRenderer, chats: list[shapes.Messages], loss_on: str
) -> list[dict[tuple[int, bool], str]]:
    """Each conversation's renderings (shapes.renderings), from batched template calls (render_batch)
    instead of several calls per row.

    A conversation the batch cannot render gets no renderings: encode_messages then renders it row by
    row, which drops it with the template's own error exactly as before. An empty prefix (a
    conversation that opens with the assistant, which check_messages drops as no_user_turn) is left to
    that path too.
    """
    rendered: list[dict[tuple[int, bool], str]] = [{} for _ in chats]
    failed: set[int] = set()
    for generation_prompt in (True, False):
        wanted = [
            (i, length)
            for i, chat in enumerate(chats)
            for length, flag in sorted(shapes.renderings(chat, loss_on))
            if flag is generation_prompt and length > 0
        ]
        for (i, length), text in zip(
            wanted, render_batch(render, [chats[i][:length] for i, length in wanted], generation_prompt)
        ):
            if text is None:
                failed.add(i)
            else:
                rendered[i][(length, generation_prompt)] = text
    for i in failed:
        rendered[i] = {}
    return rendered


def render_batch(render: ChatRenderer, chats: list[shapes.Messages], add_generation_prompt: bool) -> list[str | None]:
    """Many conversations' chat-template texts: in plain Python where `render` may (ChatRenderer.fast),
    otherwise apply_chat_template RENDER_CHUNK per call (the same strings as one call each, the call's
    own set-up paid once per chunk); where the template rejects one, that chunk is rendered one
    conversation at a time and None marks the rejected ones."""
    fast = render.fast(chats, add_generation_prompt)
    if fast is not None:
        return list(fast)
    texts: list[str | None] = []
    for start in range(0, len(chats), RENDER_CHUNK):
        chunk = chats[start : start + RENDER_CHUNK]
        try:
            texts.extend(render.jinja(chunk, add_generation_prompt))
        except jinja2.TemplateError:
            texts.extend(render_each(render.tokenizer, chunk, add_generation_prompt))
    return texts


class ChatRenderer:
    """The tokenizer's chat template over many conversations, for one run of the stage.

    Where the template is one tuneproof knows (CHATML_TEMPLATE_SHA256) it renders in plain Python,
    several times faster than jinja, but only after jinja renders a sample of the same batch (the
    first VERIFY_FIRST conversations and VERIFY_SPREAD spread through the rest) to the same text.
    One mismatch, or a sample jinja rejects, is logged and sends this batch and the rest of the run
    to jinja. The sample guards against a transformers release or environment that renders the
    template differently (the same difference shows on every row); that the Python rendering equals
    jinja's for any text, empty, unicode or template syntax included, is what the tests hold it to.
    """

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        template = getattr(tokenizer, "chat_template", None)
        known = isinstance(template, str) and hashlib.sha256(template.encode()).hexdigest() == CHATML_TEMPLATE_SHA256
        self.python = render_chatml if known else None

    def jinja(self, chats: list[shapes.Messages], add_generation_prompt: bool) -> list[str]:
        return self.tokenizer.apply_chat_template(chats, tokenize=False, add_generation_prompt=add_generation_prompt)

    def texts(self, chats: list[shapes.Messages], add_generation_prompt: bool) -> list[str]:
        """What one batched apply_chat_template call returns (or raises) for `chats`."""
        fast = self.fast(chats, add_generation_prompt)
        return fast if fast is not None else self.jinja(chats, add_generation_prompt)

    def fast(self, chats: list[shapes.Messages], add_generation_prompt: bool) -> list[str] | None:
        """The plain-Python texts, verified on a sample; None where jinja must render this batch."""
        # Anything but string roles and contents (None, numbers, parts lists) is for jinja and
        # transformers' own message normalisation to render or reject.
        if self.python is None or not all(plain_turns(chat) for chat in chats):
            return None
        texts = [self.python(chat, add_generation_prompt) for chat in chats]
        sample = verify_sample(len(texts))
        try:
            expected = self.jinja([chats[i] for i in sample], add_generation_prompt) if sample else []
        except jinja2.TemplateError as e:
            log(f"chat template: jinja rejects a sampled conversation ({type(e).__name__}: {e}); rendering with jinja")
            self.python = None
            return None
        for i, text in zip(sample, expected):
            if texts[i] != text:
                log(
                    f"chat template: the plain-Python rendering of conversation {i} differs from jinja's "
                    f"({texts[i][:80]!r} vs {text[:80]!r}); rendering the rest of this run with jinja"
                )
                self.python = None
                return None
        return texts


def plain_turns(chat: shapes.Messages) -> bool:
    return all(type(turn.get("role")) is str and type(turn.get("content")) is str for turn in chat)


def render_chatml(chat: shapes.Messages, add_generation_prompt: bool) -> str:
    """CHATML_TEMPLATE_SHA256's template in plain Python."""
    text = "".join(f"<|im_start|>{turn['role']}\n{turn['content']}<|im_end|>\n" for turn in chat)
    return text + "<|im_start|>assistant\n" if add_generation_prompt else text


def verify_sample(n: int) -> list[int]:
    """The first VERIFY_FIRST of n indices and VERIFY_SPREAD evenly spread through the rest, the last included."""
    rest = range(VERIFY_FIRST, n)
    spread = {rest[(len(rest) - 1) * k // max(VERIFY_SPREAD - 1, 1)] for k in range(VERIFY_SPREAD)} if rest else set()
    return sorted(set(range(min(n, VERIFY_FIRST))) | spread)


def render_each(tokenizer: Any, chats: list[shapes.Messages], add_generation_prompt: bool) -> list[str | None]:
    texts: list[str | None] = []
    for chat in chats:
        try:
            texts.append(
                tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=add_generation_prompt)
            )
        except jinja2.TemplateError:
            texts.append(None)
    return texts


def token_ids(tokenizer: Any, texts: list[str]) -> list[list[int]]:
    """tokenizer(texts, add_special_tokens=False)["input_ids"], read from the fast tokenizer's Rust backend.

    The wrapper turns every encoding into a Python BatchEncoding row first, about a third of the
    tokenizing time on short rows. One wrapper call on the first text sets the backend up exactly as
    the wrapper does (no truncation or padding, its special-token handling); `encode_batch` then
    encodes the lot, in parallel, to the same ids.

    Each distinct text is encoded once (a corpus repeats many of its short answers), so equal texts
    get the same list: copy one before changing it.
    """
    if not texts:
        return []
    unique = list(dict.fromkeys(texts))
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:  # a slow (pure Python) tokenizer: the wrapper is all there is
        encoded = tokenizer(unique, add_special_tokens=False)["input_ids"]
    else:
        tokenizer(unique[:1], add_special_tokens=False)
        encoded = [encoding.ids for encoding in backend.encode_batch(unique, add_special_tokens=False)]
    ids = dict(zip(unique, encoded))
    return [ids[text] for text in texts]


def encode(
    tokenizer: Any, convs: list[Conversation], system_prompt: str | None, render: ChatRenderer | None = None
) -> list[Example]:
    """Render each conversation with the chat template; labels are the response tokens only."""
    if not convs:
        return []
    render = render or ChatRenderer(tokenizer)
    chats = []
    for conv in convs:
        system = conv.parts.get("system") or system_prompt
        chats.append(
            ([{"role": "system", "content": system}] if system else [])
            + [{"role": "user", "content": conv.parts["prompt"]}]
        )
    # One batched call per rendering: the same strings as a call per row, the call's own set-up paid once.
    prompts = render.texts(chats, add_generation_prompt=True)
    fulls = render.texts(
        [chat + [{"role": "assistant", "content": conv.parts["response"]}] for chat, conv in zip(chats, convs)],
        add_generation_prompt=False,
    )
    completions = []
    for prompt, full in zip(prompts, fulls):
        if not full.startswith(prompt):
            raise StageFailure(
                "data",
                f"the chat template of the base model does not render the generation prompt "
                f"as a prefix of the full conversation (prompt {prompt[-60:]!r}, full {full[-80:]!r}); "
                "prompt tokens cannot be masked",
            )
        # What follows the end-of-turn token (a newline in ChatML) is not something to learn to generate.
        completions.append(full[len(prompt) :].rstrip())
    ids = token_ids(tokenizer, prompts + completions)
    prompt_ids, completion_ids = ids[: len(prompts)], ids[len(prompts) :]
    return [
        Example(p + c, [IGNORE_INDEX] * len(p) + c, prompt, conv.parts["response"])
        for p, c, prompt, conv in zip(prompt_ids, completion_ids, prompts, convs)
    ]


def fit_rows(
    examples: list[Example], convs: list[Conversation], data: DataConfig, drops: datahash.Drops, overflow: str
) -> list[Example]:
    """Apply the overflow policy row by row: too-long rows are dropped (counted) or truncated; under pack
    they are dropped too, since a row is packed whole (pack_split packs the rest)."""
    fitted = []
    for ex, conv in zip(examples, convs):
        result = datahash.fit(ex.input_ids, ex.labels, data.max_seq_len, overflow)
        if result is None:
            drops.add("too_long", conv.where, conv.row, f"{len(ex.input_ids)} tokens > {data.max_seq_len}")
        elif result[0] is ex.input_ids:
            fitted.append(ex)  # it fits as it is
        else:
            fitted.append(Example(result[0], result[1], ex.prompt, ex.reference))
    return fitted


def pack_split(examples: list[Example], max_seq_len: int) -> list[Example]:
    """The fitted examples packed together, in order, into rows of at most max_seq_len tokens, each row
    with the lengths of the examples in it (its segments)."""
    packed = datahash.pack(((ex.input_ids, ex.labels) for ex in examples), max_seq_len)
    rows, remaining = [], iter(examples)
    for ids, labels in packed:  # a row is the next few examples whole, in order: take lengths until it is full
        lengths: list[int] = []
        while sum(lengths) < len(ids):
            lengths.append(len(next(remaining).input_ids))
        rows.append(Example(ids, labels, "", "", lengths))
    return rows
