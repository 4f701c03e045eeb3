"""Synthetic long-range retrieval tasks planted in real code: what the retrieval model trains on and is judged by.

Every task plants assignment lines in a window of Python source (the small LM's corpus) and ends with assertions
whose right-hand side the model must copy from far back. Byte level, all ASCII, lines kept intact::

    _vkey_402913 = "9f1c0a6e5b2d47c8a1e03f5d6b7c8a90"     (a needle, somewhere in the code)
    ...
    assert _vkey_402913 == "9f1c0a6e5b2d47c8a1e03f5d6b7c8a90"   (a query; the value bytes are scored)

Three prompt styles (``STYLES``): ``vkey`` (above, 32 hex characters), ``dict`` (``registry['key-N'] = '...'``, 24
upper-case characters) and ``comment`` (``# The pass code of user N is ...``, 16 digits). Tasks (``TASKS``), each at
needle depths spread over 0-100% of the prompt:

* ``passkey``: one needle, one query.
* ``multikey``: eight needles whose keys share their first four digits (distractors), one of them queried.
* ``multivalue``: one key extended three times (``_vkey_X += ["..."]``) among distractor keys; the query asks
  for the list, in order.
* ``recall``: multi-query associative recall, 24 needles and 6 queries in random order.

Scoring is teacher-forced: the whole instance (answers included) is one prefill, and a value counts as retrieved
when the model's argmax predicts every one of its bytes (greedy decoding would then write it exactly). Training
instances take their code from the training stream and their randomness from the step's generator; evaluation
instances take held-out code and a separate seed space, so no evaluation instance (text or value) is trained on.
"""

from __future__ import annotations

import dataclasses
import random
from typing import Optional, Sequence

import torch

__all__ = ["TASKS", "EXTRA_TASK", "STYLES", "Style", "Answer", "Instance", "make_instance", "make_batch", "score",
           "DEPTH_BINS"]

TASKS = ("passkey", "multikey", "multivalue", "recall")
EXTRA_TASK = "extra"  # the answers of make_instance's extra_lookups (training only)
HEX = "0123456789abcdef"
VALUE_CHARS = 32
DEPTH_BINS = (0.0, 0.2, 0.4, 0.6, 0.8, 1.0001)


@dataclasses.dataclass(frozen=True)
class Style:
    """How needles and queries are written. ``{key}`` is the six-digit key, ``{value}`` a value.

    needle / first / extend   a needle line; the first and later entries of a multi-value key
    ask, close                 a query: ``ask`` + value + ``close``
    list_ask, list_open, list_sep, list_close   a multi-value query: list_ask, then each value between
                               list_open and list_close, separated by list_sep, then a newline
    """

    name: str
    needle: str
    first: str
    extend: str
    ask: str
    close: str
    list_ask: str
    list_open: str
    list_sep: str
    list_close: str
    alphabet: str = HEX
    value_chars: int = VALUE_CHARS


#: the prompt styles: ``vkey`` (the default, what the first results used) plus two others, so that a model trained
#: on all of them does not learn one assignment syntax only
STYLES = {style.name: style for style in (
    Style("vkey", needle='_vkey_{key} = "{value}"\n', first='_vkey_{key} = ["{value}"]\n',
          extend='_vkey_{key} += ["{value}"]\n', ask='assert _vkey_{key} == "', close='"\n',
          list_ask="assert _vkey_{key} == [", list_open='"', list_sep=", ", list_close='"'),
    Style("dict", needle="registry['key-{key}'] = '{value}'\n",
          first="registry.setdefault('key-{key}', []).append('{value}')\n",
          extend="registry['key-{key}'].append('{value}')\n", ask="assert registry['key-{key}'] == '",
          close="'\n", list_ask="assert registry['key-{key}'] == [", list_open="'", list_sep=", ", list_close="'",
          alphabet="ABCDEFGHJKLMNPQRSTUVWXYZ23456789", value_chars=24),
    Style("comment", needle="# The pass code of user {key} is {value}.\n",
          first="# User {key} gets pass codes, first {value}.\n", extend="# User {key} also gets {value}.\n",
          ask="# Q: what is the pass code of user {key}? A: it is ", close=".\n",
          list_ask="# Q: list the pass codes of user {key} in order. A: ", list_open="", list_sep=", then ",
          list_close="", alphabet="0123456789", value_chars=16),
)}


@dataclasses.dataclass(frozen=True)
class Answer:
    """One scored value: its bytes sit at ``[start, end)`` of the instance; ``depth`` is where its needle was
    planted (0 = start of the prompt, 1 = just before the queries); ``needle_start`` is the needle's byte offset."""

    task: str
    start: int
    end: int
    depth: float
    needle_start: int


@dataclasses.dataclass
class Instance:
    tokens: torch.Tensor  # (length,) uint8
    answers: list[Answer]
    task: str
    style: str = "vkey"


def _value(rng: random.Random, style: Style) -> str:
    return "".join(rng.choice(style.alphabet) for _ in range(style.value_chars))


def _keys(rng: random.Random, count: int, shared_prefix: bool) -> list[str]:
    """Distinct six-digit keys; with ``shared_prefix`` all share their first four digits (near-miss distractors)."""
    prefix = f"{rng.randrange(10_000):04d}"
    pool = [f"{prefix}{i:02d}" for i in range(100)] if shared_prefix else None
    keys: list[str] = []
    while len(keys) < count:
        key = rng.choice(pool) if pool else f"{rng.randrange(1_000_000):06d}"
        if key not in keys:
            keys.append(key)
    return keys


def _plan(task: str, rng: random.Random, length: int) -> tuple[list[tuple[str, Optional[tuple[str, int]]]], list[tuple[str, list[int]]]]:
    """(needle lines, each with (key, value index) or None; queries as (text before values, value indices)).

    Value indices point into the instance's value list, so a query's scored bytes are found after assembly.
    Below 4K bytes the needle counts shrink with the length (CPU smoke runs)."""
    def count(n: int) -> int:
        return max(2, min(n, n * length // 4096))

    if task == "passkey":
        key = _keys(rng, 1, False)[0]
        return [(key, 0)], [(key, [0])]
    if task == "multikey":
        keys = _keys(rng, count(8), True)
        target = rng.randrange(len(keys))
        return [(k, i) for i, k in enumerate(keys)], [(keys[target], [target])]
    if task == "multivalue":
        keys = _keys(rng, max(2, count(4)), True)
        target, others = keys[0], keys[1:]
        needles = [(target, i) for i in range(3)] + [(k, 3 + j) for j, k in enumerate(others)]
        order = rng.sample(needles, len(needles))
        _keep_entries_in_order(order, target)  # the target's extensions
        return order, [(target, [0, 1, 2])]
    if task == "recall":
        keys = _keys(rng, count(24), False)
        queried = rng.sample(range(len(keys)), max(1, count(6)) if len(keys) > 2 else 1)
        return [(k, i) for i, k in enumerate(keys)], [(keys[i], [i]) for i in queried]
    raise ValueError(f"unknown task {task!r}; valid: {list(TASKS)}")


def _keep_entries_in_order(needles: list, key: str) -> None:
    """Re-sort ``key``'s entries among the slots they hold in ``needles`` (in place), so that a multi-value key's
    list is planted in order: its value indices ascend in list order."""
    slots = [i for i, (k, _) in enumerate(needles) if k == key]
    for slot, index in zip(slots, sorted(needles[i][1] for i in slots)):
        needles[slot] = (key, index)


def _extra_lookups(needles, queries, count: int, rng: random.Random, list_share: float, near_miss_share: float):
    """``count`` more lookups under fresh random keys (training only: more supervised long-range lookups per window at
    no extra compute). Each is one value or, with probability ``list_share``, a three-value list (multi-value's
    form). With probability ``near_miss_share`` their keys share their first four digits (near-miss keys, as in
    multi-key). Their needles are interleaved at random among the task's (each list's entries in order), their
    queries come before the task's own, which stay last. Returns (needles, queries, extra query count, list keys)."""
    if count <= 0:
        return needles, queries, 0, set()
    taken = {key for key, _ in needles}
    index = max(i for _, i in needles) + 1
    extra_needles, extra_queries, list_keys = [], [], set()
    prefix = f"{rng.randrange(10_000):04d}" if near_miss_share > 0 and rng.random() < near_miss_share else None
    while len(extra_queries) < count:
        key = prefix + f"{rng.randrange(100):02d}" if prefix else f"{rng.randrange(1_000_000):06d}"
        if key in taken:
            continue
        taken.add(key)
        entries = 3 if rng.random() < list_share else 1
        if entries > 1:
            list_keys.add(key)
        indices = list(range(index, index + entries))
        index += entries
        extra_needles += [(key, i) for i in indices]
        extra_queries.append((key, indices))
    rng.shuffle(extra_needles)
    for key in list_keys:
        _keep_entries_in_order(extra_needles, key)
    # a random merge keeps the task's needles in their order (multi-value's extensions)
    total = len(needles) + len(extra_needles)
    extra_slots = set(rng.sample(range(total), len(extra_needles)))
    task_iter, extra_iter = iter(needles), iter(extra_needles)
    merged = [next(extra_iter) if i in extra_slots else next(task_iter) for i in range(total)]
    rng.shuffle(extra_queries)
    return merged, extra_queries + queries, count, list_keys


def plant_at_line_starts(code: bytes, lines: Sequence[bytes], rng: random.Random) -> tuple[bytes, list[int]]:
    """``code`` with ``lines`` planted in order at line starts, their depths spread over [0, 1] (sorted uniform
    positions, each moved to the next line start): the result and where each planted line starts in it."""
    cuts = sorted(rng.random() for _ in lines)
    positions = []
    for frac in cuts:
        newline = code.find(b"\n", int(frac * len(code)))
        positions.append(len(code) if newline < 0 else newline + 1)
    positions.sort()
    pieces, offsets, cursor, out_len = [], [], 0, 0
    for pos, line in zip(positions, lines):
        pieces.append(code[cursor:pos])
        out_len += pos - cursor
        offsets.append(out_len)
        pieces.append(line)
        out_len += len(line)
        cursor = pos
    pieces.append(code[cursor:])
    return b"".join(pieces), offsets


def make_instance(task: str, filler: bytes, length: int, rng: random.Random, style: str = "vkey",
                  extra_lookups: int = 0, extra_list_share: float = 0.0,
                  extra_near_miss_share: float = 0.0) -> Instance:
    """One instance of ``length`` bytes: needles planted at line starts in ``filler`` (at least ``length`` bytes of
    code), the queries at the end, written in ``style`` (``STYLES``).

    ``extra_lookups`` (training): that many more lookups under fresh keys, a share ``extra_list_share`` of them
    three-value lists, near-miss keys with probability ``extra_near_miss_share`` (``_extra_lookups``); their
    answers carry the task name ``EXTRA_TASK``."""
    if style not in STYLES:
        raise ValueError(f"unknown style {style!r}; valid: {list(STYLES)}")
    fmt = STYLES[style]
    needles, queries = _plan(task, rng, length)
    needles, queries, extra, list_keys = _extra_lookups(needles, queries, extra_lookups, rng, extra_list_share,
                                                        extra_near_miss_share)
    if task == "multivalue":
        list_keys.add(queries[-1][0])
    values = [_value(rng, fmt) for _ in range(max(i for _, i in needles) + 1)]
    first_entry = {}
    for key, index in needles:
        first_entry[key] = min(index, first_entry.get(key, index))
    needle_lines = []
    for key, index in needles:
        if key in list_keys:
            template = fmt.first if index == first_entry[key] else fmt.extend
        else:
            template = fmt.needle
        needle_lines.append(template.format(key=key, value=values[index]).encode())
    query_parts: list[tuple[bytes, list[tuple[int, int]]]] = []  # (bytes, value spans relative to the query)
    for key, indices in queries:
        if key in list_keys:
            text = fmt.list_ask.format(key=key)
            spans = []
            for j, index in enumerate(indices):
                text += fmt.list_open
                spans.append((len(text), len(text) + fmt.value_chars))
                text += values[index] + fmt.list_close + (fmt.list_sep if j + 1 < len(indices) else "")
            text += "]\n" if fmt.list_ask.endswith("[") else ".\n"
        else:
            text = fmt.ask.format(key=key)
            spans = [(len(text), len(text) + fmt.value_chars)]
            text += values[indices[0]] + fmt.close
        query_parts.append((("\n" + text).encode(), [(a + 1, b + 1) for a, b in spans]))
    tail = sum(len(q) for q, _ in query_parts)
    body_len = length - tail
    code_len = body_len - sum(len(n) for n in needle_lines)
    if code_len < 64:
        raise ValueError(f"make_instance: length {length} is too short for task {task!r}")
    body, needle_offsets = plant_at_line_starts(filler[:code_len], needle_lines, rng)
    assert len(body) == body_len
    data = body + b"".join(q for q, _ in query_parts)
    # where each value's needle sits (the value's first needle for multivalue lists)
    value_needle = {}
    for (key, index), offset in zip(needles, needle_offsets):
        value_needle.setdefault(index, offset)
    answers, base = [], body_len
    for number, ((key, indices), (text, spans)) in enumerate(zip(queries, query_parts)):
        for index, (a, b) in zip(indices, spans):
            offset = value_needle[index]
            answers.append(Answer(task if number >= extra else EXTRA_TASK, base + a, base + b,
                                  offset / max(body_len, 1), offset))
        base += len(text)
    tokens = torch.frombuffer(bytearray(data), dtype=torch.uint8).clone()
    return Instance(tokens, answers, task, style)


def make_batch(tasks: Sequence[str], stream: bytes, length: int, rng: random.Random,
               style: str = "vkey") -> list[Instance]:
    """One instance per entry of ``tasks``, each on a random window of ``stream`` (document separators, byte 0,
    left in place: the code is filler)."""
    out = []
    for task in tasks:
        start = rng.randrange(0, len(stream) - length - 1)
        out.append(make_instance(task, stream[start:start + length], length, rng, style))
    return out


@torch.no_grad()
def score(logits: torch.Tensor, instance: Instance) -> list[dict]:
    """Per answer: exact (every value byte is the argmax of the logits one position before it) and the share of
    its bytes predicted. ``logits``: (length, vocab) of the instance's forward pass."""
    predicted = logits.argmax(-1)
    out = []
    for answer in instance.answers:
        target = instance.tokens[answer.start:answer.end].to(predicted.device).long()
        guess = predicted[answer.start - 1:answer.end - 1]
        hits = (guess == target).float()
        out.append({"task": answer.task, "depth": answer.depth, "exact": bool(hits.all()),
                    "chars": float(hits.mean()), "needle_start": answer.needle_start})
    return out
