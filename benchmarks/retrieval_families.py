"""Retrieval tasks in format families, split by construction into training and held-out families, and a natural
retrieval measure with no template.

A family is one syntax for planting a key and its value (``needle``) plus the query forms that ask for it; every
instance draws, independently, a naming scheme for the keys (snake, camel, dotted, kebab, upper; numeric or word
suffixes), a quote character, a value alphabet (hex, digits, upper case, base32, words) and length, a container
name, how many keys are planted (some of them near-miss variants of a queried key: one word or the suffix differs)
and where (line starts spread over 0-100% of the prompt). Queries come last and make the model write the value (an
assertion, a lookup, an expected output); only the value bytes are scored, teacher-forced, as in
``retrieval_tasks.score``. Multi-hop families plant the value under one key and an alias line naming that key;
the query asks for the alias.

``TRAIN_FAMILIES`` and ``HELDOUT_FAMILIES`` share the per-instance choices above but no template: no held-out
syntax or query form is a rewording of a training one (assignments, subscripts, keyword arguments, environment
lines, prose comments, registration calls, tuple lists, XML elements, command-line flags, log lines and aliases by
assignment train; YAML, JSON, table rows, typed function defaults, typed class attributes, SQL rows and
interpolated aliases are held out, each with query forms of its own: no ``key: value`` entry trains). Each
template's skeleton (``skeleton``: the template with names, values and quotes as character classes) is what
tests check: rendered training instances never contain a held-out skeleton.

Instances are ``retrieval_tasks.Instance`` objects (``task`` is the family, ``style`` its split, each answer's
``task`` the family), so ``retrieval_tasks.score`` and the benchmark's coverage diagnostics apply unchanged. Same
seed and filler give the same bytes.

The natural measure (``natural_positions``, ``score_natural``): in plain code, position ``i`` counts for the
bucket ``[D_k, D_k+1)`` when the ``ngram``-byte string ending at ``i`` occurred before and its most recent earlier
occurrence ends ``d`` bytes back with ``D_k <= d < D_k+1`` (so it occurred nowhere in the last ``D_k`` bytes): byte
``i`` is predictable by copying from at least ``D_k`` bytes back, and from no closer. Per bucket: dense accuracy
(argmax of the logits at ``i - 1`` equals byte ``i``) and bits per byte.
"""

from __future__ import annotations

import dataclasses
import random
import re
import string
from typing import Optional, Sequence

import torch

import retrieval_tasks as rt

__all__ = ["Family", "FAMILIES", "TRAIN_FAMILIES", "HELDOUT_FAMILIES", "SCHEMES", "ALPHABETS", "make_instance",
           "make_batch", "skeleton", "natural_positions", "score_natural", "NATURAL_DISTANCES", "NATURAL_NGRAM",
           "bucket_name", "compose", "training_weights"]

# names and values: separate vocabularies, so that a value never reads like a key
KEY_WORDS = ("max", "min", "retry", "count", "timeout", "buffer", "cache", "size", "limit", "user", "session",
             "token", "index", "offset", "batch", "queue", "worker", "pool", "shard", "region", "quota", "level",
             "page", "route", "node", "port", "host", "path", "mode", "flag", "rate", "window", "chunk", "layer",
             "stage", "slot", "epoch", "cursor", "lease", "bucket")
SUFFIX_WORDS = ("alpha", "beta", "gamma", "delta", "east", "west", "north", "south", "primary", "backup", "local",
                "remote", "draft", "final", "old", "new")
VALUE_WORDS = ("amber", "lotus", "cedar", "falcon", "quartz", "meadow", "harbor", "ember", "willow", "onyx",
               "summit", "glacier", "tundra", "saffron", "cobalt", "juniper", "marble", "violet", "canyon", "orchid",
               "pebble", "thistle", "zephyr", "basalt", "copper", "hazel", "indigo", "lagoon", "maple", "nectar")
CONTAINER_WORDS = ("settings", "config", "registry", "table", "options", "params", "env", "store", "lookup",
                   "defaults", "profile", "manifest")

#: naming schemes: words (plus a numeric or word suffix) -> a name
SCHEMES = {
    "snake": lambda w: "_".join(w),
    "camel": lambda w: w[0] + "".join(x[:1].upper() + x[1:] for x in w[1:]),
    "dotted": lambda w: ".".join(w),
    "kebab": lambda w: "-".join(w),
    "upper": lambda w: "_".join(w).upper(),
}
IDENTIFIER_SCHEMES = ("snake", "camel", "upper")  # usable as Python identifiers
ALPHABETS = {"hex": "0123456789abcdef", "digits": "0123456789", "upper": "ABCDEFGHIJKLMNOPQRSTUVWXYZ",
             "base32": "ABCDEFGHIJKLMNOPQRSTUVWXYZ234567", "words": None}
VALUE_LENGTHS = (8, 12, 16, 24, 32)  # characters; ``words`` values are 2-4 words joined by '-'


@dataclasses.dataclass(frozen=True)
class Family:
    """A needle syntax and its query forms.

    needle    the planted text (one or more lines, each ending in a newline); ``{key}``, ``{value}``, ``{q}`` (the
              instance's quote), ``{obj}`` (a container name), ``{Obj}`` (the same, capitalised), ``{fn}`` (a
              function named after the key); ``{ref}`` in ``alias`` and the queries of a multi-hop family is the queried alias
    queries   query forms, each with exactly one ``{value}`` (the scored bytes) and ending in a newline
    alias     multi-hop: a line naming ``{ref}`` as ``{key}``; the value stays on ``{key}``'s needle
    schemes   naming schemes its keys may use; quotes: the quote characters its ``{q}`` may be
    composed  the needle and query templates are drawn per instance (``compose``), not fixed: a syntax of random
              parts, so that what trains is "find the key, skip what separates it, copy the value" rather than
              one template; ``needle``/``queries`` are then only examples
    weight    its share of training draws relative to a fixed family (``training_weights``)
    """

    name: str
    split: str
    needle: str
    queries: tuple[str, ...]
    schemes: tuple[str, ...] = tuple(SCHEMES)
    quotes: tuple[str, ...] = ('"', "'")
    alias: Optional[str] = None
    composed: bool = False
    weight: float = 1.0


TRAIN_FAMILIES = (
    Family("assign", "train", "{key} = {q}{value}{q}\n",
           ("assert {key} == {q}{value}{q}\n", "print({key})  # {value}\n"), IDENTIFIER_SCHEMES),
    Family("subscript", "train", "{obj}[{q}{key}{q}] = {q}{value}{q}\n",
           ("assert {obj}[{q}{key}{q}] == {q}{value}{q}\n", "value = {obj}[{q}{key}{q}]  # {value}\n")),
    Family("kwargs", "train", "    {key}={q}{value}{q},\n",
           ("assert {obj}.{key} == {q}{value}{q}\n", "{obj}.check({key}={q}{value}{q})\n"), ("snake", "camel")),
    Family("env", "train", "export {key}={q}{value}{q}\n",
           ("assert os.environ[{q}{key}{q}] == {q}{value}{q}\n", "echo ${key}  # {value}\n"), ("upper",)),
    Family("comment", "train", "# {key} is set to {value}.\n",
           ("# Q: what is {key} set to? A: {value}.\n", "# Recall: {key} was {value}.\n"), quotes=("",)),
    Family("register", "train", "{obj}.register({q}{key}{q}, {q}{value}{q})\n",
           ("assert {obj}.lookup({q}{key}{q}) == {q}{value}{q}\n",)),
    Family("pairs", "train", "    ({q}{key}{q}, {q}{value}{q}),\n",
           ("assert dict({obj})[{q}{key}{q}] == {q}{value}{q}\n",)),
    Family("alias_assign", "train", "{key} = {q}{value}{q}\n", ("assert {ref} == {q}{value}{q}\n",),
           IDENTIFIER_SCHEMES, alias="{ref} = {key}\n"),
    Family("xml", "train", '<item name="{key}">{value}</item>\n',
           ('assert {obj}.find("{key}").text == "{value}"\n',), quotes=('"',)),
    Family("cli", "train", "    --{key} {value} \\\n", ("assert flags[{q}{key}{q}] == {q}{value}{q}\n",),
           ("kebab", "snake")),
    Family("log", "train", "[INFO] {key} initialised with {value}\n", ("grep {key} app.log  # {value}\n",),
           quotes=("",)),
    Family("composed", "train", "set {key} -> {q}{value}{q}\n", ("check {key} gives {q}{value}{q}\n",),
           composed=True, weight=11.0),
)
HELDOUT_FAMILIES = (
    Family("yaml", "heldout", "  {key}: {value}\n",
           ("self.assertEqual({obj}[{q}{key}{q}], {q}{value}{q})\n",), quotes=('"', "'")),
    Family("json", "heldout", '    "{key}": "{value}",\n',
           ('assert {obj}.get("{key}") == "{value}"\n', '# {obj}["{key}"] holds "{value}"\n'), quotes=('"',)),
    Family("table", "heldout", "| {key} | {value} |\n", ("# lookup({key}) -> {value}\n",), quotes=("",)),
    Family("func_default", "heldout", "def {fn}({key}: str = {q}{value}{q}) -> str:\n    return {key}\n",
           (">>> {fn}()\n{q}{value}{q}\n",), ("snake",)),
    Family("class_attr", "heldout", "class {Obj}:\n    {key}: str = {q}{value}{q}\n",
           ("assert getattr({Obj}, {q}{key}{q}) == {q}{value}{q}\n",), IDENTIFIER_SCHEMES),
    Family("sql", "heldout", "INSERT INTO {obj} VALUES ('{key}', '{value}');\n",
           ("-- SELECT v FROM {obj} WHERE k = '{key}'; => '{value}'\n",), quotes=("'",)),
    Family("alias_interp", "heldout", "  {key}: {value}\n", ("expect(resolve({q}{ref}{q})).toBe({q}{value}{q});\n",),
           ("snake", "dotted", "kebab"), alias="  {ref}: ${{{key}}}\n"),
)
FAMILIES = {f.name: f for f in TRAIN_FAMILIES + HELDOUT_FAMILIES}

# the parts ``compose`` draws from. None of them is a held-out family's separator or query word (no ": ", "|",
# "lookup", "->", "getattr", "INSERT", "resolve", "assertEqual", "def "): the held-out skeletons stay unseen, which
# tests check on rendered instances.
_LINE_LEADS = ("", "", "    ", "  ", "- ", "* ", "set ", "let ", "var ", "@", "#define ", "% ", "; ", "val ",
               "const ", ">> ")
_QUOTES = ("", "", '"', "'", "`", "[", "<", "(")  # around a key or a value, each drawn on its own
_CLOSE = {"": "", '"': '"', "'": "'", "`": "`", "[": "]", "<": ">", "(": ")"}
_SEPARATORS = (" = ", "=", " := ", " => ", ", ", " is ", " to ", " <- ", "\t", " ~ ", " as ", " ", " == ",
               "::", " <= ", " equals ", " maps to ", " / ", "; ")
_LINE_ENDS = ("", "", ";", ",", " .", " //", " #ok", ")")
_QUERY_LEADS = ("", "check ", "assert ", "# ", "// ", "echo ", "expect ", "print ", "fetch ", "read ", "query ",
                ">>> ", "-- ", "want ", "get ")
_QUERY_MIDS = (" == ", " gives ", " returns ", " is ", " = ", " => ", ": got ", " was ", ", ", " yields ", " says ")


def compose(rng: random.Random) -> tuple[str, tuple[str, ...]]:
    """A needle template and one query template of random parts: a line lead, the key quoted or not, a
    separator, the value quoted or not, a line end; the query quotes and separates independently of the needle."""
    kq, vq = rng.choice(_QUOTES), rng.choice(_QUOTES)
    needle = (f"{rng.choice(_LINE_LEADS)}{kq}{{key}}{_CLOSE[kq]}{rng.choice(_SEPARATORS)}{vq}{{value}}{_CLOSE[vq]}"
              f"{rng.choice(_LINE_ENDS)}\n")
    kq2, vq2 = rng.choice(_QUOTES), rng.choice(_QUOTES)
    mid = rng.choice(_QUERY_MIDS)
    query = f"{rng.choice(_QUERY_LEADS)}{kq2}{{key}}{_CLOSE[kq2]}{mid}{vq2}{{value}}{_CLOSE[vq2]}\n"
    return needle, (query,)  # the parts hold no braces: the templates format as they are


def training_weights(names: Sequence[str]) -> list[float]:
    """Each named family's share of training draws (``Family.weight``)."""
    return [FAMILIES[n].weight for n in names]


_CLASSES = {"key": r"[A-Za-z0-9_.\-]+", "ref": r"[A-Za-z0-9_.\-]+", "value": r"[A-Za-z0-9\-]+", "q": r"[\"']?",
            "obj": r"[A-Za-z_][A-Za-z0-9_]*", "Obj": r"[A-Za-z_][A-Za-z0-9_]*", "fn": r"[A-Za-z_][A-Za-z0-9_]*"}


def skeleton(template: str) -> re.Pattern:
    """The template as a multi-line regex: its literal text (the skeleton) with each placeholder a character
    class of names / values / quotes; each line anchored at a line start (any indentation) and a line end."""
    lines = []
    for line in template.rstrip("\n").split("\n"):
        pattern = ""
        for literal, field, _, _ in string.Formatter().parse(line.lstrip(" ")):
            pattern += re.escape(literal)
            if field is not None:
                pattern += _CLASSES[field]
        lines.append(pattern)
    return re.compile(r"^[ \t]*" + "\n[ \t]*".join(lines) + "$", re.M)


def _name(rng: random.Random, scheme: str, words: Optional[list] = None) -> tuple[str, list]:
    """A key in ``scheme``; returns (name, its words, suffix included) so that a near-miss can vary them."""
    if words is None:
        words = rng.sample(KEY_WORDS, rng.randint(2, 3))
        words.append(str(rng.randrange(1, 1000)) if rng.random() < 0.5 else rng.choice(SUFFIX_WORDS))
    return SCHEMES[scheme](words), words


def _near_miss(rng: random.Random, words: list) -> list:
    """The same words with one changed: the suffix (another number or word) or one of the key words."""
    out = list(words)
    i = rng.randrange(len(out))
    if i == len(out) - 1:
        out[i] = str(rng.randrange(1, 1000)) if out[i].isdigit() else rng.choice(SUFFIX_WORDS)
    else:
        out[i] = rng.choice(KEY_WORDS)
    return out


def _value(rng: random.Random, alphabet: str, length: int) -> str:
    if ALPHABETS[alphabet] is None:
        return "-".join(rng.choice(VALUE_WORDS) for _ in range(rng.randint(2, 4)))
    return "".join(rng.choice(ALPHABETS[alphabet]) for _ in range(length))


def _counts(length: int) -> tuple[int, int]:
    """(keys planted, keys queried): 12 and 3 from 16K bytes on, fewer in shorter prompts (CPU smoke runs)."""
    keys = max(2, min(12, length // 1365))
    return keys, max(1, min(3, keys // 4))


NEEDLE_LEAD = 16  # an answer's needle_start: this many bytes before its planted value (at most its line start)


def make_instance(family: str, filler: bytes, length: int, rng: random.Random, queries: Optional[int] = None
                  ) -> rt.Instance:
    """One instance of ``family`` (a name of ``FAMILIES``), ``length`` bytes: needles planted at line starts of
    ``filler`` (at least ``length`` bytes of code), the queries at the end. Deterministic in ``rng``'s state.
    ``queries`` (training: more supervised lookups per window): that many queries over at least twice as many
    keys, instead of ``_counts``'.

    Each answer's ``needle_start`` is ``NEEDLE_LEAD`` bytes before its planted value, or the value's line start if
    that is nearer (a long key or a function signature can put the value 60 bytes into its line): the coverage
    diagnostics then check the end of the key and the value, where the lookup reads."""
    if family not in FAMILIES:
        raise ValueError(f"unknown family {family!r}; valid: {list(FAMILIES)}")
    fam = FAMILIES[family]
    if fam.composed:
        needle, queries_ = compose(rng)
        fam = dataclasses.replace(fam, needle=needle, queries=queries_)
    scheme, quote = rng.choice(fam.schemes), rng.choice(fam.quotes)
    alphabet, value_len = rng.choice(sorted(ALPHABETS)), rng.choice(VALUE_LENGTHS)
    obj = rng.choice(CONTAINER_WORDS)
    ctx = {"q": quote, "obj": obj, "Obj": obj[:1].upper() + obj[1:]}
    n_keys, n_queries = _counts(length)
    if queries is not None:
        if queries < 1:
            raise ValueError(f"make_instance: queries must be >= 1, got {queries}")
        n_keys, n_queries = max(n_keys, 2 * queries), queries
    names, taken = [], set()
    while len(names) < n_keys:
        near = names and rng.random() < 0.5  # a near-miss of an earlier key: a distractor for it
        name, words = _name(rng, scheme, _near_miss(rng, rng.choice(names)[1]) if near else None)
        if name not in taken:
            taken.add(name)
            names.append((name, words))
    values = []
    while len(values) < n_keys:
        value = _value(rng, alphabet, value_len)
        if value not in values:
            values.append(value)
    queried = rng.sample(range(n_keys), n_queries)
    # needles: (text, index of the value it holds or None, where its answers' needle_start points in the text)
    needles = []
    for i, (name, _) in enumerate(names):
        text = fam.needle.format(key=name, value=values[i], fn=f"get_{name}", **ctx)
        at = text.index(values[i])
        needles.append((text, i, max(text.rfind("\n", 0, at) + 1, at - NEEDLE_LEAD)))
    refs = {}
    if fam.alias is not None:
        for i in queried:
            ref = name = names[i][0]
            while ref in taken:
                ref, _ = _name(rng, scheme)
            taken.add(ref)
            refs[i] = ref
            needles.append((fam.alias.format(ref=ref, key=name, **ctx), None, 0))
    rng.shuffle(needles)
    asks = []  # (text before the value, the value, text after it, the value's index)
    for i in queried:
        head, tail = rng.choice(fam.queries).split("{value}")
        fields = dict(key=names[i][0], ref=refs.get(i, ""), fn=f"get_{names[i][0]}", **ctx)
        asks.append((head.format(**fields), values[i], tail.format(**fields), i))
    query_bytes = [("\n" + h + v + t).encode() for h, v, t, _ in asks]
    body_len = length - sum(len(q) for q in query_bytes)
    code_len = body_len - sum(len(t) for t, _, _ in needles)
    if code_len < 64:
        raise ValueError(f"make_instance: length {length} is too short for family {family!r}")
    body, offsets = rt.plant_at_line_starts(filler[:code_len], [text.encode() for text, _, _ in needles], rng)
    assert len(body) == body_len
    value_needle = {index: offset + lead for (_, index, lead), offset in zip(needles, offsets) if index is not None}
    answers, base = [], body_len
    for (head, value, _, index), q in zip(asks, query_bytes):
        start = base + 1 + len(head)
        offset = value_needle[index]
        answers.append(rt.Answer(family, start, start + len(value), offset / max(body_len, 1), offset))
        base += len(q)
    data = body + b"".join(query_bytes)
    tokens = torch.frombuffer(bytearray(data), dtype=torch.uint8).clone()
    return rt.Instance(tokens, answers, family, fam.split)


def make_batch(families: Sequence[str], stream: bytes, length: int, rng: random.Random) -> list[rt.Instance]:
    """One instance per entry of ``families``, each on a random window of ``stream``."""
    out = []
    for family in families:
        start = rng.randrange(0, len(stream) - length - 1)
        out.append(make_instance(family, stream[start:start + length], length, rng))
    return out


# --- the natural measure ------------------------------------------------------------------------------------------
NATURAL_NGRAM = 16
NATURAL_DISTANCES = (4096, 16384)


def bucket_name(lo: int, hi: Optional[int]) -> str:
    def short(n: int) -> str:
        return f"{n // 1024}K" if n % 1024 == 0 and n >= 1024 else str(n)
    return f"{short(lo)}+" if hi is None else f"{short(lo)}-{short(hi)}"


def natural_positions(data: bytes, ngram: int = NATURAL_NGRAM,
                      distances: Sequence[int] = NATURAL_DISTANCES) -> dict[str, list[int]]:
    """Per distance bucket (``bucket_name``: ``[distances[k], distances[k+1])``, the last one open), the positions
    ``i`` whose ``ngram``-byte string ending at ``i`` (``data[i - ngram + 1 : i + 1]``) last occurred ending at
    ``j``, with ``i - j`` in the bucket. One pass, a dict of each n-gram's last end position: O(len(data))."""
    if ngram < 1 or not distances or list(distances) != sorted(set(distances)) or distances[0] < 1:
        raise ValueError(f"natural_positions: ngram >= 1 and increasing positive distances, got {ngram}, "
                         f"{list(distances)}")
    bounds = list(distances) + [None]
    names = [bucket_name(lo, hi) for lo, hi in zip(bounds, bounds[1:])]
    out = {name: [] for name in names}
    last: dict[bytes, int] = {}
    for i in range(ngram - 1, len(data)):
        gram = data[i - ngram + 1:i + 1]
        j = last.get(gram)
        last[gram] = i
        if j is None or i - j < distances[0]:
            continue
        k = 0
        while k + 1 < len(distances) and i - j >= distances[k + 1]:
            k += 1
        out[names[k]].append(i)
    return out


@torch.no_grad()
def score_natural(logits: torch.Tensor, tokens: torch.Tensor, positions: dict[str, list[int]]) -> dict[str, dict]:
    """Per bucket: the positions counted (position 0 has no prediction), argmax hits and the summed loss in bits.
    ``logits``: (length, vocab) of a teacher-forced forward over ``tokens`` (length,)."""
    import math

    import torch.nn.functional as F

    out = {}
    for name, where in positions.items():
        where = [i for i in where if i >= 1]
        if not where:
            out[name] = {"count": 0, "hits": 0, "bits": 0.0}
            continue
        index = torch.tensor(where, device=logits.device)
        rows = logits[index - 1].float()
        target = tokens.to(logits.device)[index].long()
        out[name] = {"count": len(where), "hits": int((rows.argmax(-1) == target).sum()),
                     "bits": float(F.cross_entropy(rows, target, reduction="sum")) / math.log(2)}
    return out
