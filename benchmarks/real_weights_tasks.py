"""The real-weights benchmark's tasks and text (``bench_real_weights.py``): RULER-style retrieval instances built
to an exact token length, and windows of real text for the next-token loss.

**Tasks** (RULER's synthetic tasks; haystack = real text, alternating per instance between Python standard-library
source and English prose): ``passkey`` ("The pass key is 71432. Remember it. 71432 is the pass key."),
``multikey`` (four "One of the special magic numbers for <word> is: <7 digits>." lines, one queried) and
``vartrack`` (a chain ``VAR ABCDE = 12345``, ``VAR FGHIJ = VAR ABCDE``, ... of four variables and a distractor chain
of three, scattered; the question asks which variables hold the value; answer: the four names in chain order, as
"A, B, C, and D").
Each instance is exactly the target length in tokens (the haystack trimmed), needles start on a new line, and the
target needle's depth is spread uniformly over 10-90% of the prompt (``by_depth`` bins; ``by_haystack`` splits code
from prose). Prompts follow RULER's wording with its answer prefixes, in the model's chat template (``--prompt-style
chat``; ``plain`` puts the same words in plain text). Scoring is teacher-forced: prompt and gold answer in one
forward; an instance is correct when the argmax at every answer position reproduces the answer's tokens (a bare
space token before digits belongs to the prompt: the model writes " a" there, "is a 5-digit ...", and then the
digits). Dense at 2K on the CPU (float32, 8 instances per task, 2026-11-27): chat template passkey 1.00, multikey
0.88, vartrack 0.00; plain text 1.00, 0.75, 0.00. Variable tracking fails at the answer's first token in every
wording tried (the model starts a list on a new line and gets the first token of most names wrong), so its cells are
"not judged" on this model: the report marks a retrieval cell whose ``dense`` accuracy is below 0.5 that way.

**Next-token loss** (``nll_code``, ``nll_prose``): windows of the target length of concatenated standard-library
source files (``sysconfig.get_paths()["stdlib"]``, Python Software Foundation License) and of English prose: the
Python documentation's topic texts that the standard library ships as ``pydoc_data.topics`` (the text of the
Python Language Reference, PSF License). Documents are concatenated in a seeded random order per window, so windows
differ even where a length needs more text than the prose source holds. Loss = mean over the last 1,024 tokens of
each window (nats/token); rows carry dense's ``nll`` and every contender's ``delta_nll`` against it, per kind.
"""

from __future__ import annotations

import functools
import random
import string
import sysconfig
from dataclasses import dataclass, field
from pathlib import Path

import torch

TASKS = ("passkey", "multikey", "vartrack")
NLL_KINDS = ("nll_code", "nll_prose")
DEPTH_RANGE = (0.1, 0.9)
DEPTH_BINS = (0.1, 0.26, 0.42, 0.58, 0.74, 0.9001)
PROMPT_STYLES = ("chat", "plain")
#: the instances' and windows' seed of the published rows (``bench_real_weights.py --seed``'s default)
DEFAULT_SEED = 20261127
CODE_SOURCE = "Python standard library source (sysconfig stdlib, top-level *.py), PSF License"
PROSE_SOURCE = "pydoc_data.topics (Python Language Reference topic texts, in the stdlib), PSF License"


# ---------------------------------------------------------------------------------------------------------------
# text


class Documents:
    """A text source as documents tokenized on first use, and streams of them in a seeded order."""

    def __init__(self, tokenizer, texts: list, name: str):
        if not texts:
            raise SystemExit(f"no text found for {name}")
        self.tokenizer, self.texts, self.name = tokenizer, texts, name
        self._tokens: dict = {}
        self.separator = tokenizer("\n\n", add_special_tokens=False).input_ids

    def tokens(self, i: int) -> list:
        if i not in self._tokens:
            self._tokens[i] = self.tokenizer(self.texts[i], add_special_tokens=False).input_ids
        return self._tokens[i]

    def stream(self, length: int, rng: random.Random, line_starts: set) -> list:
        """``length`` tokens: documents in a random order, joined by a blank line, from a random line of the first
        (documents repeat, reshuffled, when the source is shorter than ``length``)."""
        out: list = []
        first = True
        while len(out) < length:
            for i in rng.sample(range(len(self.texts)), len(self.texts)):
                doc = self.tokens(i)
                if first:
                    starts = [j for j in range(len(doc)) if doc[j] in line_starts] or [0]
                    doc = doc[rng.choice(starts[: max(1, len(starts) * 3 // 4)]):]
                    first = False
                out += doc + self.separator
                if len(out) >= length:
                    break
        return out[:length]


def code_texts() -> list:
    """The standard library's top-level modules, by name (deterministic for one Python version)."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    texts = []
    for path in sorted(stdlib.glob("*.py")):
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        if len(text) > 2000:
            texts.append(text)
    return texts


def prose_texts() -> list:
    try:
        from pydoc_data.topics import topics
    except ImportError as exc:
        raise SystemExit(f"the prose source, the standard library's pydoc_data.topics, is missing from this Python "
                         f"({exc}); --tasks without nll_prose still needs it for the prose haystacks") from exc

    return [topics[key].strip() for key in sorted(topics)]


def line_start_tokens(tokenizer) -> set:
    """Token ids whose text begins with a newline: a needle inserted before one sits on its own line."""
    vocab = tokenizer.get_vocab()
    out = set()
    for token, index in vocab.items():
        text = tokenizer.convert_tokens_to_string([token])
        if text.startswith("\n"):
            out.add(index)
    return out


# ---------------------------------------------------------------------------------------------------------------
# tasks

WORDS = ("apple", "river", "candle", "violin", "tiger", "harbor", "pepper", "lantern", "marble", "falcon", "garden",
         "rocket", "saddle", "thunder", "velvet", "walnut", "anchor", "blossom", "compass", "dolphin", "ember",
         "feather", "glacier", "hammock", "island", "jasmine", "kettle", "lemon", "meadow", "nectar", "orchid",
         "pillow", "quartz", "ribbon", "sparrow", "tulip", "umbrella", "valley", "willow", "yarn", "zebra",
         "biscuit", "cactus", "daisy", "engine", "forest", "guitar", "horizon", "igloo", "jungle", "kitten", "ladder",
         "mirror", "needle", "oyster", "parrot", "quiver", "raccoon", "shadow", "trumpet")


@dataclass
class Prompt:
    """One task's words: the instruction before the haystack, the question and answer prefix after it."""

    instruction: str
    question: str
    answer_prefix: str


def passkey_prompt() -> Prompt:
    return Prompt("There is an important pass key hidden inside a lot of irrelevant text. Find it and memorize it. "
                  "I will quiz you about the pass key.",
                  "What is the pass key?", "The pass key is")


def multikey_prompt(key: str) -> Prompt:
    return Prompt("Some special magic numbers are hidden within the following text. Make sure to memorize them. "
                  "I will quiz you about the numbers afterwards.",
                  f"What is the special magic number for {key} mentioned in the provided text?",
                  f"The special magic number for {key} mentioned in the provided text is")


def vartrack_prompt(value: str, count: int) -> Prompt:
    return Prompt("Memorize and track the chain(s) of variable assignment hidden in the following text.",
                  f"Question: Find all variables that are assigned the value {value} in the text above.",
                  f"Answer: According to the chain(s) of variable assignment in the text above, {count} variables "
                  f"are assigned the value {value}, they are:")


def vartrack_answer(names: list) -> str:
    """The names as the model lists them: "A, B, C, and D"."""
    return " " + ", ".join(names[:-1]) + ", and " + names[-1]


@dataclass
class Instance:
    task: str
    tokens: torch.Tensor  # (length,): prompt and answer
    answer_len: int  # the answer is the last answer_len tokens
    depth: float  # where the queried needle starts, as a share of the prompt
    haystack: str  # "code" or "prose"


@dataclass
class PromptBuilder:
    """Turns (prompt words, needles, answer) into exactly ``length`` tokens around a real-text haystack."""

    tokenizer: object
    style: str
    sources: dict  # "code" / "prose" -> Documents
    line_starts: set = field(default_factory=set)

    def frame(self, prompt: Prompt) -> tuple[list, list]:
        """Token ids before and after the haystack (the answer prefix last)."""
        marker = "\x00HAYSTACK\x00"
        if self.style == "chat":
            content = f"{prompt.instruction}\n\n{marker}\n\n{prompt.question}"
            text = self.tokenizer.apply_chat_template([{"role": "user", "content": content}], tokenize=False,
                                                      add_generation_prompt=True)
            text += prompt.answer_prefix
        else:
            text = f"{prompt.instruction}\n\n{marker}\n\n{prompt.question} {prompt.answer_prefix}"
        head, tail = text.split(marker)
        encode = functools.partial(self.tokenizer, add_special_tokens=False)
        return encode(head).input_ids, encode(tail).input_ids

    def answer_tokens(self, tail: list, answer: str) -> list:
        """``answer``'s tokens as they follow the answer prefix (tokenized together, so the boundary merges as in
        running text)."""
        encode = functools.partial(self.tokenizer, add_special_tokens=False)
        tail_text = self.tokenizer.decode(tail)
        joined = encode(tail_text + answer).input_ids
        if joined[:len(tail)] == tail and len(joined) > len(tail):
            return joined[len(tail):]
        return encode(answer).input_ids

    def build(self, task: str, length: int, prompt: Prompt, needles: list, answer: str, haystack: str,
              rng: random.Random) -> Instance:
        """``needles``: (depth, sentence) pairs, the queried one first; depths are shares of the haystack."""
        head, tail = self.frame(prompt)
        answer_ids = self.answer_tokens(tail, answer)
        # a bare space before digits is its own token, which the model often writes as " a" ("is a 5-digit ..."):
        # formatting, not retrieval, so it goes with the prompt and only the answer's text is scored
        while len(answer_ids) > 1 and not self.tokenizer.decode(answer_ids[:1]).strip():
            tail = tail + answer_ids[:1]
            answer_ids = answer_ids[1:]
        needle_ids = [self.tokenizer("\n" + sentence, add_special_tokens=False).input_ids for _, sentence in needles]
        hay_len = length - len(head) - len(tail) - len(answer_ids) - sum(map(len, needle_ids))
        if hay_len < length // 2:
            raise ValueError(f"{task}: a {length}-token instance leaves only {hay_len} tokens of haystack")
        hay = self.sources[haystack].stream(hay_len, rng, self.line_starts)
        # insertion points on line starts, nearest at or after the target depth
        points = []
        for depth, _ in needles:
            p = max(1, min(hay_len - 1, round(depth * hay_len)))
            after = next((j for j in range(p, min(hay_len, p + 512)) if hay[j] in self.line_starts), None)
            before = next((j for j in range(p, max(0, p - 512), -1) if hay[j] in self.line_starts), None)
            points.append(after if after is not None else before if before is not None else p)
        order = sorted(range(len(needles)), key=lambda i: points[i])
        body, previous, start_of = [], 0, {}
        for i in order:
            body += hay[previous:points[i]]
            start_of[i] = len(head) + len(body)
            body += needle_ids[i]
            previous = points[i]
        body += hay[previous:]
        tokens = head + body + tail + answer_ids
        assert len(tokens) == length, (len(tokens), length)
        return Instance(task, torch.tensor(tokens, dtype=torch.long), len(answer_ids), start_of[0] / length, haystack)


def target_depths(count: int) -> list:
    lo, hi = DEPTH_RANGE
    return [lo + (hi - lo) * (i + 0.5) / count for i in range(count)]


def digits(rng: random.Random, n: int) -> str:
    return str(rng.randrange(10 ** (n - 1), 10 ** n))


def make_instances(task: str, length: int, count: int, builder: PromptBuilder, seed: int) -> list:
    """``count`` instances of ``task`` at ``length`` tokens; instance i's needle at depth 0.1 + 0.8 (i + 1/2) /
    count, its haystack code for even i and prose for odd i."""
    out = []
    for i, depth in enumerate(target_depths(count)):
        rng = random.Random(f"{seed}/{task}/{length}/{i}")
        haystack = "code" if i % 2 == 0 else "prose"
        if task == "passkey":
            key = digits(rng, 5)
            needles = [(depth, f"The pass key is {key}. Remember it. {key} is the pass key.")]
            out.append(builder.build(task, length, passkey_prompt(), needles, f" {key}", haystack, rng))
        elif task == "multikey":
            keys = rng.sample(WORDS, 4)
            values = [digits(rng, 7) for _ in keys]
            needles = [(depth, f"One of the special magic numbers for {keys[0]} is: {values[0]}.")]
            needles += [(rng.uniform(*DEPTH_RANGE), f"One of the special magic numbers for {k} is: {v}.")
                        for k, v in zip(keys[1:], values[1:])]
            out.append(builder.build(task, length, multikey_prompt(keys[0]), needles, f" {values[0]}", haystack,
                                     rng))
        elif task == "vartrack":
            names = set()
            while len(names) < 7:
                names.add("".join(rng.choice(string.ascii_uppercase) for _ in range(5)))
            names = sorted(names)
            rng.shuffle(names)
            chain, other = names[:4], names[4:]
            value, other_value = digits(rng, 5), digits(rng, 5)
            # the chain's links in order after its first, which sits at the target depth
            depths = [depth] + sorted(rng.uniform(depth, DEPTH_RANGE[1]) for _ in chain[1:])
            needles = [(depths[0], f"VAR {chain[0]} = {value}")]
            needles += [(d, f"VAR {name} = VAR {prev}") for d, name, prev in zip(depths[1:], chain[1:], chain)]
            other_depths = sorted(rng.uniform(*DEPTH_RANGE) for _ in other)
            needles += [(other_depths[0], f"VAR {other[0]} = {other_value}")]
            needles += [(d, f"VAR {name} = VAR {prev}") for d, name, prev in zip(other_depths[1:], other[1:], other)]
            out.append(builder.build(task, length, vartrack_prompt(value, len(chain)), needles,
                                     vartrack_answer(chain), haystack, rng))
        else:
            raise ValueError(f"unknown task {task!r}; valid: {list(TASKS)}")
    return out


def make_windows(kind: str, length: int, count: int, sources: dict, line_starts: set, seed: int) -> list:
    source = sources["code" if kind == "nll_code" else "prose"]
    return [torch.tensor(source.stream(length, random.Random(f"{seed}/{kind}/{length}/{w}"), line_starts))
            for w in range(count)]


# ---------------------------------------------------------------------------------------------------------------
# scoring
