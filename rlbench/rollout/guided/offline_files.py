"""Offline preference files (``rollout=offline rollout.offline.file=<path>``): the readers, the checks and the
groups they give (docs/preference.md, "Offline files").

A file is JSON Lines (``.jsonl``, read line by line) or any local file ``datasets`` loads (``.json``,
``.parquet``, ``.csv``: ``datasets.load_dataset(<format>, data_files=<path>)``, never the Hub). One record, one
group, in one of the formats (``rollout.offline.format``; ``auto`` reads the first record's keys):

``pairs``      ``{prompt, chosen, rejected}``: a group of two, rewards (1, 0);
``responses``  ``{prompt, responses: [{text, reward}, ...]}``: the responses with their rewards;
``ranking``    ``{prompt, ranking: [best, ..., worst]}``: k responses, rewards by rank ``(k-1-i)/(k-1)`` (a pair
               is a ranking of two), so ``pairing: all|adjacent`` and PRO's listwise loss see the order;
``traces``     what ``rlbench mode=generate`` writes (``uid``, ``text`` or ``response_ids``): read by the guidance
               library (rlbench/guidance/traces.py), graded by the run's grader.

A record names its prompt by ``prompt`` (the problem statement) or by ``uid`` (a training problem of the run's
dataset, whose statement, answer and template fields it then takes; so does a ``prompt`` equal to a training
problem's statement). Either way the prompt is templated as an
online prompt is: the dataset's ``prompt`` (system message, user template) and the model's chat template. In
CSV files the ``responses`` and ``ranking`` columns hold JSON lists. Optional fields: ``tokenizer`` (the
fingerprint of rlbench.utils.tokenizer_fingerprint) and ``chat_template`` (:func:`chat_template_fingerprint`),
checked against the run's when present.

Conversational records (TRL's conversational format: a field holds a list of chat messages ``{role, content}``
instead of text) are read as the text record they stand for: a ``prompt`` of one user message is that message's
content (the problem statement, templated as above), and ``chosen``, ``rejected``, a ``ranking``'s entry or a
``responses`` entry's ``text`` of one assistant message is that message's content. A pairs or ranking record
without ``prompt`` whose responses are whole conversations with the same leading messages (TRL's implicit prompt)
takes those messages as its prompt and the last message of each as the responses. In CSV files only the
``responses`` and ``ranking`` columns (JSON text) may hold messages: the other cells are text as written.

Bad input (:data:`BAD_KINDS`) is counted, not trained on: a record or a response entry without its fields
(``missing_fields``; a message without a text ``content``, a conversational prompt without a user message or
an implicit prompt whose conversations' leading messages differ count here too), a conversational prompt of more
than one user turn or with an assistant (or any other role's) turn (``multi_turn_prompt``), a conversational
prompt with a system message (``system_message``: the run's prompt template supplies its own, and dropping the
record's would silently change the prompt), a conversational response that is not one assistant message
(``multi_turn_response``: several messages or another role; a ``responses`` entry is left out, a pair or ranking
record is), a record that names its prompt only by a ``uid`` the dataset does not hold (``unknown_uid``), an
empty response (``empty``), a text labelled two ways (``identical``: chosen = rejected, a text twice in a
ranking or with two rewards; every copy is dropped), a response longer than
``rollout.max_new_tokens`` tokens (``too_long``), a record written with another tokenizer or chat template
(``tokenizer_mismatch``, ``chat_template_mismatch``), a prompt that already carries a chat template's markup
(``templated_prompt``: it would be templated twice) and a record left without a pair, i.e. two responses with
different rewards, for no reason counted already (``no_pair``). :func:`read_offline_file` checks what needs no tokenizer (before the model
loads); :func:`offline_groups` checks everything and builds the groups.
"""

from __future__ import annotations

import csv
import hashlib
import json
import math
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from rlbench.dataset.base import Problem
from rlbench.dataset.jsonl import iter_jsonl
from rlbench.errors import ConfigError, DataError
from rlbench.guidance.traces import text_token_ids
from rlbench.utils import tokenizer_fingerprint

FORMATS = ("auto", "pairs", "responses", "ranking", "traces")
DATASETS_BUILDERS = {".json": "json", ".parquet": "parquet", ".csv": "csv"}  # suffix -> datasets' packaged builder
BAD_KINDS = ("missing_fields", "multi_turn_prompt", "system_message", "multi_turn_response", "unknown_uid", "empty", "identical",
             "too_long", "tokenizer_mismatch", "chat_template_mismatch", "templated_prompt", "no_pair")
# markup of common chat templates (ChatML, Llama 3, Llama 2/Mistral, Gemma, Zephyr/Phi, DeepSeek): a prompt that
# holds one was written after templating
CHAT_MARKERS = ("<|im_start|>", "<|start_header_id|>", "[INST]", "<start_of_turn>", "<|user|>", "<|assistant|>",
                "<｜User｜>", "<|begin_of_text|>")


@dataclass(frozen=True)
class OfflineGroup:
    """One record's group: its prompt (``prompt`` text, or ``uid`` of a dataset problem), the responses'
    texts and rewards, and where it is in the file."""

    where: str
    prompt: str | None
    uid: str | None
    texts: tuple[str, ...]
    rewards: tuple[float, ...]
    tokenizer: str | None = None
    chat_template: str | None = None


@dataclass
class OfflineFile:
    """A file's groups that passed the checks so far, with the counts of what was left out."""

    path: str
    format: str
    records: int = 0
    groups: list[OfflineGroup] = field(default_factory=list)
    counts: dict[str, int] = field(default_factory=lambda: {kind: 0 for kind in BAD_KINDS})
    examples: dict[str, str] = field(default_factory=dict)

    def reject(self, kind: str, where: str, n: int = 1) -> None:
        self.counts[kind] += n
        self.examples.setdefault(kind, where)

    def no_pair(self, where: str, counted_before: int) -> None:
        """Count a record left without a pair, unless something else of it was counted since ``counted_before``
        (the total of the counts then): chosen = rejected is counted once, as ``identical``."""
        if sum(self.counts.values()) == counted_before:
            self.reject("no_pair", where)

    @property
    def bad(self) -> dict[str, int]:
        return {kind: n for kind, n in self.counts.items() if n}

    def summary(self) -> str:
        """The one report line: what was read, what is kept, what was left out (with an example each)."""
        left_out = ", ".join(f"{kind} {n} (e.g. {self.examples[kind]})" for kind, n in self.bad.items()) or "nothing"
        return (f"rollout.offline.file={self.path} ({self.format}): {self.records} records, {len(self.groups)} groups "
                f"kept; left out: {left_out}")

    def check(self, on_bad: str) -> None:
        """Refuse an empty set always, and any bad input under ``on_bad=stop`` (DataError with :meth:`summary`)."""
        if not self.groups:
            raise DataError(f"{self.summary()}: nothing to train on")
        if self.bad and on_bad == "stop":
            raise DataError(f"{self.summary()}; fix the file or set rollout.offline.on_bad=skip to train without them")


def rank_rewards(k: int) -> tuple[float, ...]:
    """The rewards of a ranking of ``k`` responses, best first: ``(k-1-i)/(k-1)`` (1 for the best, 0 for the
    worst; a pair gets (1, 0))."""
    return tuple((k - 1 - i) / (k - 1) for i in range(k)) if k > 1 else (1.0,) * k


def chat_template_fingerprint(tokenizer: Any) -> str:
    """A short hash of the tokenizer's chat template (the text that turns messages into a prompt)."""
    return hashlib.sha256(str(getattr(tokenizer, "chat_template", None)).encode("utf-8")).hexdigest()[:16]


def read_records(path: str) -> list[tuple[str, dict[str, Any]]]:
    """(where, record) for each record of the file: JSONL line by line (``file:line``), the other formats through
    ``datasets``' packaged builders into a temporary cache (``file:row N``)."""
    file = Path(path).expanduser()
    if not file.is_file():
        raise DataError(f"rollout.offline.file={path}: no such file")
    suffix = file.suffix.lower()
    if suffix == ".jsonl":
        return [(f"{path}:{lineno}", record) for lineno, record in iter_jsonl(file)]
    builder = DATASETS_BUILDERS.get(suffix)
    if builder is None:
        raise ConfigError(f"rollout.offline.file={path}: reads .jsonl and {sorted(DATASETS_BUILDERS)} files")
    import datasets

    options: dict[str, Any] = {}
    if builder == "csv":  # every column as text, as written ("5" stays "5", an empty cell "")
        with file.open(newline="", encoding="utf-8") as handle:
            columns = next(csv.reader(handle), [])
        options = {"features": datasets.Features({c: datasets.Value("string") for c in columns}), "na_filter": False}
    bars = datasets.is_progress_bar_enabled()
    datasets.disable_progress_bars()
    try:
        with tempfile.TemporaryDirectory(prefix="rlbench-offline-") as cache:
            table = datasets.load_dataset(builder, data_files=str(file), split="train", cache_dir=cache, keep_in_memory=True,
                                          **options)
            return [(f"{path}:row {i + 1}", dict(row)) for i, row in enumerate(table)]
    except Exception as exc:  # the builders raise their own parse errors
        raise DataError(f"rollout.offline.file={path}: datasets cannot read it as {builder}: {exc}") from exc
    finally:
        if bars:
            datasets.enable_progress_bars()


def detect_format(record: dict[str, Any], where: str) -> str:
    """The format a record's keys say (``auto``); DataError when they say none."""
    if "chosen" in record and "rejected" in record:
        return "pairs"
    for name in ("responses", "ranking"):
        if name in record:
            return name
    if "uid" in record and ("text" in record or "response_ids" in record):
        return "traces"
    raise DataError(f"{where}: cannot tell the file's format from the keys {sorted(record)}; write {{prompt, chosen, rejected}}, "
                    "{prompt, responses: [{text, reward}]} or {prompt, ranking: [best, ..., worst]}, or set rollout.offline.format")


def file_format(records: Sequence[tuple[str, dict[str, Any]]], fmt: str, path: str) -> str:
    if fmt != "auto":
        return fmt
    if not records:
        raise DataError(f"rollout.offline.file={path} holds no record: nothing to train on")
    return detect_format(records[0][1], records[0][0])


def _list_field(value: Any) -> Any:
    """A list column as a list (CSV files hold it as JSON text)."""
    if isinstance(value, str) and value.lstrip().startswith("["):
        try:
            return json.loads(value)
        except json.JSONDecodeError:
            return value
    return value


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _is_messages(value: Any) -> bool:
    """Whether ``value`` is a conversation: a non-empty list of messages (dicts with a ``role``)."""
    return isinstance(value, list) and bool(value) and all(isinstance(m, dict) and "role" in m for m in value)


def _well_formed(messages: list[dict[str, Any]]) -> bool:
    """Whether every message has a text ``content`` (a list of content parts, or none, is not read)."""
    return all(isinstance(m.get("content"), str) for m in messages)


def _prompt_text(value: Any) -> tuple[Any, str | None]:
    """A record's prompt as text, and the bad kind when it cannot be: a conversational prompt (a list of messages)
    is read when it is one user message, whose content is the problem statement (``missing_fields`` without a
    user message or a text content, ``multi_turn_prompt`` with several user turns or any other role,
    ``system_message`` with a system message: the run's prompt template supplies its own). Other values pass
    through."""
    if not _is_messages(value):
        return value, None
    roles = [m["role"] for m in value]
    if not _well_formed(value) or "user" not in roles:
        return None, "missing_fields"
    if roles.count("user") > 1 or any(role not in ("system", "user") for role in roles):
        return None, "multi_turn_prompt"
    if "system" in roles:
        return None, "system_message"
    return value[0]["content"], None


def _response_text(value: Any) -> tuple[Any, str | None]:
    """A response as text, and the bad kind when it cannot be: a conversational response (a list of messages) is
    read when it is one assistant message, whose content is the text (``missing_fields`` without a text content,
    ``multi_turn_response`` for several messages or another role). Other values pass through."""
    if not _is_messages(value):
        return value, None
    if not _well_formed(value):
        return None, "missing_fields"
    if len(value) != 1 or value[0]["role"] != "assistant":
        return None, "multi_turn_response"
    return value[0]["content"], None


def _turns(messages: list[dict[str, Any]]) -> list[tuple[Any, Any]]:
    """The (role, content) of each message (the keys ``datasets`` adds to a row's messages left out)."""
    return [(m.get("role"), m.get("content")) for m in messages]


def _implicit_prompt(conversations: list[Any]) -> tuple[list[dict[str, Any]], list[list[dict[str, Any]]]] | None:
    """TRL's implicit prompt: whole conversations (of a record without ``prompt``) sharing their leading messages
    give the prompt (those messages) and the responses (the last message of each); None when they are not
    conversations of more than one message with the same leading messages."""
    if not (conversations and all(_is_messages(c) and len(c) > 1 for c in conversations)):
        return None
    leading = _turns(conversations[0][:-1])
    if any(_turns(c[:-1]) != leading for c in conversations[1:]):
        return None
    return conversations[0][:-1], [c[-1:] for c in conversations]


def _with_implicit_prompt(record: dict[str, Any], fmt: str) -> dict[str, Any]:
    """A pairs or ranking record without ``prompt`` whose responses are whole conversations sharing their leading
    messages (TRL's implicit prompt) with those messages as its ``prompt`` and the last message of each as the
    response; any other record as it is."""
    if record.get("prompt") is not None or fmt not in ("pairs", "ranking"):
        return record
    conversations = [record.get("chosen"), record.get("rejected")] if fmt == "pairs" else _list_field(record.get("ranking"))
    implicit = _implicit_prompt(conversations) if isinstance(conversations, list) else None
    if implicit is None:
        return record
    prompt, answers = implicit
    if fmt == "pairs":
        return {**record, "prompt": prompt, "chosen": answers[0], "rejected": answers[1]}
    return {**record, "prompt": prompt, "ranking": answers}


def _text_record(record: dict[str, Any], fmt: str, where: str, out: OfflineFile) -> dict[str, Any] | None:
    """The record with its conversational fields (TRL's conversational format: lists of chat messages) as text:
    the prompt, ``chosen``/``rejected`` and the ``ranking``'s entries (the ``responses``' texts are read with
    their entries, :func:`_record_responses`); TRL's implicit prompt is read too (:func:`_with_implicit_prompt`).
    None, the record counted, when one of them cannot be read; a text record comes back as it is."""
    record = _with_implicit_prompt(record, fmt)
    if record.get("prompt") is None and not record.get("uid"):
        return record  # no prompt (nor conversations sharing one): missing_fields
    prompt, kind = _prompt_text(record.get("prompt"))
    texts: dict[str, Any] = {"prompt": prompt}
    if fmt == "pairs":
        for name in ("chosen", "rejected"):
            texts[name], bad = _response_text(record.get(name))
            kind = kind or bad
    ranking = _list_field(record.get("ranking"))
    if fmt == "ranking" and isinstance(ranking, list):
        entries = [_response_text(entry) for entry in ranking]
        texts["ranking"] = [text for text, _ in entries]
        kind = kind or next((bad for _, bad in entries if bad), None)
    if kind is not None:
        out.reject(kind, where)
        return None
    return {**record, **texts}


def _record_responses(record: dict[str, Any], fmt: str, where: str, out: OfflineFile) -> list[tuple[str, float]] | None:
    """The record's (text, reward) responses (a ``responses`` entry's conversational text read as
    :func:`_response_text` reads it), the entries without their fields counted; None when the record lacks the
    format's own fields."""
    if fmt == "pairs":
        chosen, rejected = record.get("chosen"), record.get("rejected")
        if not (isinstance(chosen, str) and isinstance(rejected, str)):
            return None
        return list(zip((chosen, rejected), rank_rewards(2)))
    if fmt == "ranking":
        ranking = _list_field(record.get("ranking"))
        if not (isinstance(ranking, list) and ranking and all(isinstance(t, str) for t in ranking)):
            return None
        return list(zip(ranking, rank_rewards(len(ranking))))
    responses = _list_field(record.get("responses"))
    if not isinstance(responses, list) or not responses:
        return None
    kept = []
    for entry in responses:
        text, kind = _response_text(entry.get("text")) if isinstance(entry, dict) else (None, None)
        if kind is not None:
            out.reject(kind, where)
        elif isinstance(text, str) and _is_number(entry.get("reward")):
            kept.append((text, float(entry["reward"])))
        else:
            out.reject("missing_fields", where)
    return kept


def _labelled_once(responses: list[tuple[str, float]], fmt: str, where: str, out: OfflineFile) -> list[tuple[str, float]]:
    """The responses without the texts labelled two ways (every copy dropped, each distinct text counted once);
    a text repeated with one reward in a ``responses`` record is a repeated sample and kept."""
    labels: dict[str, set[float]] = {}
    for text, reward in responses:
        labels.setdefault(text.strip(), set()).add(reward)
    seen = {text: sum(1 for t, _ in responses if t.strip() == text) for text in labels}
    conflicted = {text for text, rewards in labels.items() if len(rewards) > 1 or (fmt != "responses" and seen[text] > 1)}
    if conflicted:
        out.reject("identical", where, len(conflicted))
    return [(text, reward) for text, reward in responses if text.strip() not in conflicted]


def read_offline_file(path: str, fmt: str = "auto") -> OfflineFile:
    """The file's groups after the checks that need no tokenizer (missing fields, conversational records that are
    not one user prompt and one assistant message a response, empty responses, texts labelled two ways, records
    without a pair); ``traces`` files are the guidance library's and hold no group here."""
    if fmt not in FORMATS:
        raise ConfigError(f"rollout.offline.format={fmt!r}: choose one of {list(FORMATS)}")
    records = read_records(path)
    out = OfflineFile(path, file_format(records, fmt, path), records=len(records))
    if out.format == "traces":
        return out
    for where, record in records:
        counted_before = sum(out.counts.values())
        record = _text_record(record, out.format, where, out)
        if record is None:
            continue
        prompt, uid = record.get("prompt"), record.get("uid")
        prompt = prompt if isinstance(prompt, str) and prompt.strip() else None
        uid = uid if isinstance(uid, str) and uid else None
        responses = _record_responses(record, out.format, where, out)
        if (prompt is None and uid is None) or responses is None:
            out.reject("missing_fields", where)
            continue
        empty = [text for text, _ in responses if not text.strip()]
        if empty:
            out.reject("empty", where, len(empty))
        responses = _labelled_once([r for r in responses if r[0].strip()], out.format, where, out)
        if out.format == "ranking":  # the rewards of the ranking that is left
            responses = list(zip((t for t, _ in responses), rank_rewards(len(responses))))
        if len({reward for _, reward in responses}) < 2:
            out.no_pair(where, counted_before)
            continue
        out.groups.append(OfflineGroup(where, prompt, uid, tuple(t for t, _ in responses), tuple(r for _, r in responses),
                                       record.get("tokenizer"), record.get("chat_template")))
    return out


@dataclass(frozen=True)
class TokenizedGroup:
    """A kept group as the strategy trains on it: its problem (uid ``offline/<k>``), the responses' token ids
    (EOS appended) and texts, and their rewards."""

    problem: Problem
    token_ids: tuple[tuple[int, ...], ...]
    texts: tuple[str, ...]
    rewards: tuple[float, ...]


def templated(prompt: str, tokenizer: Any) -> bool:
    """Whether ``prompt`` already holds chat-template markup (a known marker or one of the tokenizer's
    multi-character special tokens)."""
    specials = [t for t in getattr(tokenizer, "all_special_tokens", []) or [] if len(t) > 3 and t.startswith("<")]
    return any(marker in prompt for marker in (*CHAT_MARKERS, *specials))


def offline_groups(source: OfflineFile, problems: Sequence[Problem], tokenizer: Any, max_tokens: int) -> list[TokenizedGroup]:
    """``source``'s groups after the checks that need the run: the prompt resolved (a ``uid`` of ``problems``,
    or a ``prompt`` equal to one's statement, takes that problem; else the record's ``prompt`` is the statement), the record's tokenizer and chat template
    against the run's, templated prompts, responses over ``max_tokens`` tokens, and again no pair. Counts into
    ``source`` (its ``groups`` become the kept ones); the caller reports and checks (:meth:`OfflineFile.check`)."""
    by_uid = {p.uid: p for p in problems}
    by_statement = {p.prompt: p for p in problems}
    own_tokenizer = tokenizer_fingerprint(tokenizer) if any(g.tokenizer for g in source.groups) else None
    own_template = chat_template_fingerprint(tokenizer)
    kept: list[OfflineGroup] = []
    built: list[TokenizedGroup] = []
    for group in source.groups:
        counted_before = sum(source.counts.values())
        dataset_problem = by_uid.get(group.uid) if group.uid else by_statement.get(group.prompt)
        if dataset_problem is None and group.prompt is None:  # a uid the dataset does not hold, and no prompt text
            source.reject("unknown_uid", group.where)
            continue
        if group.tokenizer and group.tokenizer != own_tokenizer:
            source.reject("tokenizer_mismatch", group.where)
            continue
        if group.chat_template and group.chat_template != own_template:
            source.reject("chat_template_mismatch", group.where)
            continue
        statement = dataset_problem.prompt if dataset_problem is not None else group.prompt
        if templated(statement, tokenizer):
            source.reject("templated_prompt", group.where)
            continue
        responses = []
        for text, reward in zip(group.texts, group.rewards):
            ids = text_token_ids(tokenizer, text)
            if len(ids) > max_tokens:
                source.reject("too_long", group.where)
            else:
                responses.append((text.strip(), ids, reward))
        if source.format == "ranking":  # the rewards of the ranking that is left
            responses = [(text, ids, reward) for (text, ids, _), reward in zip(responses, rank_rewards(len(responses)))]
        if len({reward for *_, reward in responses}) < 2:
            source.no_pair(group.where, counted_before)
            continue
        k = len(built)
        meta = {**(dataset_problem.meta if dataset_problem is not None else {}), "offline_record": group.where}
        if dataset_problem is not None:
            problem = replace(dataset_problem, uid=f"offline/{k}", meta={**meta, "dataset_uid": dataset_problem.uid})
        else:
            problem = Problem(uid=f"offline/{k}", prompt=statement, answer="", meta=meta)
        kept.append(group)
        built.append(TokenizedGroup(problem, tuple(ids for _, ids, _ in responses), tuple(t for t, _, _ in responses),
                                    tuple(r for *_, r in responses)))
    source.groups = kept
    return built
