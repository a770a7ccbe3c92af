"""Long-document questions: one fact placed in a long generated document of distractor text (needle style).

A problem is a document of about 1K to 128K tokens (``LONG_DOCUMENT_TOKENS``, by level; level 0, 1K, is the size a
CPU scores in seconds, for demonstrations and tests) of filler sentences about
made-up towns, with the fact asked for (``The access code of the archive in <town> is <code>.``) placed once at a
random depth, and distractor facts around it: other towns' archive codes, and other buildings' codes in the same
town. The question follows the document, so every completion of a group shares the whole document as its prompt
(what prefix sharing, :mod:`grpo_kit.model.prefix`, scores once). The answer is the five-digit code; the kit's
``correctness`` reward reads the completion's final number (:mod:`grpo_kit.tasks.answers`), so a distractor's code
earns nothing. Filler sentences carry numbers of their own (years, counts) that are never five-digit codes.

Deterministic for a seed: :func:`long_document_problem` draws everything from the ``random.Random`` it is given.
"""

from __future__ import annotations

import random

# Document sizes by level, in tokens of the embedded SmolLM2 tokenizer (~1.5 tokens a word of this text, its town
# names and numbers split in pieces); a document is built to size / TOKENS_PER_WORD words, so that it lands just
# under its size (tests hold it within 10%) and a prompt budget of the size plus the question and chat template fits.
LONG_DOCUMENT_TOKENS = {0: 1024, 1: 4096, 2: 16384, 3: 65536, 4: 131072}
LONG_DOCUMENT_LEVELS = {lv: f"a document of about {n // 1024}K tokens" for lv, n in LONG_DOCUMENT_TOKENS.items()}
TOKENS_PER_WORD = 1.5
QUESTION_TOKENS = 32  # the "Document:" header and the question proper, around the document's words
LONG_DOCUMENT_SYSTEM_PROMPT = (
    "Read the document, then answer the question with the number it asks for. End with the line: Answer: <number>"
)

_TOWNS = [
    "Aldmere",
    "Brackwater",
    "Cindervale",
    "Dunmore",
    "Eastholm",
    "Fernwick",
    "Glenrock",
    "Harrowgate",
    "Ivybridge",
    "Jarrowfield",
    "Kestrel Bay",
    "Larkspur",
    "Millbrook",
    "Northwold",
    "Oakhaven",
    "Pinecrest",
    "Queensferry",
    "Ravenscar",
    "Stonebridge",
    "Thornbury",
    "Umberleigh",
    "Valewood",
    "Westmarch",
    "Yarrow",
    "Ashford",
    "Bramblehurst",
    "Coldharbour",
    "Deepdale",
    "Elmstead",
    "Foxhollow",
    "Greyhaven",
    "Hollowmere",
]
_BUILDINGS = ["museum", "library", "town hall", "observatory", "granary", "lighthouse", "clinic", "mill"]
_SUBJECTS = [
    "The river",
    "The old market",
    "The northern road",
    "The harbour",
    "The valley",
    "The guild of weavers",
    "The council",
    "The orchard",
    "The bell tower",
    "The mountain pass",
    "The winter fair",
    "The ferry",
]
_VERBS = [
    "was rebuilt",
    "was first recorded",
    "flooded",
    "was widened",
    "hosted a festival",
    "was mapped",
    "changed hands",
    "was repaired",
    "grew quickly",
    "fell quiet",
    "was surveyed",
    "was renamed",
]
_DETAILS = [
    "after a long dry summer",
    "by a travelling scholar",
    "during the reign of a forgotten queen",
    "when the salt trade collapsed",
    "with stone from the eastern quarry",
    "to the delight of the farmers",
    "after the great storm",
    "under the guidance of the abbess",
    "before the railway arrived",
    "while the bridges were closed",
    "as the wool prices rose",
    "in a single busy season",
]


def _filler(rng: random.Random) -> str:
    """One sentence of distractor text; its numbers (years, counts) are never five digits."""
    town = rng.choice(_TOWNS)
    kind = rng.randrange(3)
    if kind == 0:
        return (
            f"{rng.choice(_SUBJECTS)} of {town} {rng.choice(_VERBS)} in {rng.randint(1200, 1899)} "
            f"{rng.choice(_DETAILS)}."
        )
    if kind == 1:
        return (
            f"Some {rng.randint(2, 950)} families lived near {town}, and {rng.choice(_SUBJECTS).lower()} "
            f"{rng.choice(_VERBS)} {rng.choice(_DETAILS)}."
        )
    return f"Travellers said that {town} {rng.choice(_VERBS)} {rng.choice(_DETAILS)}, though records disagree."


def _fact(town: str, building: str, code: int) -> str:
    return f"The access code of the {building} in {town} is {code}."


def long_document_problem(rng: random.Random, level: int) -> dict:
    """One question about a document of about ``LONG_DOCUMENT_TOKENS[level]`` tokens: ``{"question", "answer",
    "level", "depth"}``, the question holding the document then the question proper, the answer the code (a
    string of five digits), ``depth`` where the fact sits (0: start, 1: end)."""
    if level not in LONG_DOCUMENT_TOKENS:
        raise ValueError(f"level={level!r} is not allowed; choose one of {sorted(LONG_DOCUMENT_TOKENS)}")
    words = int((LONG_DOCUMENT_TOKENS[level] - QUESTION_TOKENS) / TOKENS_PER_WORD)
    towns = rng.sample(_TOWNS, 1 + min(len(_TOWNS) - 1, 3 + level * 4))
    target = towns[0]
    n_facts = 4 + LONG_DOCUMENT_TOKENS[level] // 2048  # distractor facts, denser than one per 2K tokens
    codes = rng.sample(range(10_000, 100_000), n_facts + 1)
    answer = codes[0]
    facts = [
        _fact(rng.choice(towns[1:]), "archive", c) if i % 2 else _fact(target, rng.choice(_BUILDINGS), c)
        for i, c in enumerate(codes[1:])
    ]
    needle = _fact(target, "archive", answer)
    sentences, count = [], sum(len(f.split()) for f in (*facts, needle))  # the facts count toward the size
    while count < words:
        s = _filler(rng)
        sentences.append(s)
        count += len(s.split())
    for fact in facts:
        sentences.insert(rng.randrange(len(sentences) + 1), fact)
    at = rng.randrange(len(sentences) + 1)
    sentences.insert(at, needle)
    paragraphs = [" ".join(sentences[i : i + 6]) for i in range(0, len(sentences), 6)]
    question = (
        "Document:\n\n" + "\n\n".join(paragraphs) + f"\n\nQuestion: What is the access code of the archive in {target}?"
    )
    return {"question": question, "answer": str(answer), "level": level, "depth": round(at / len(sentences), 3)}
