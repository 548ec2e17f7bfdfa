"""Round trip on the real weights: varied English sentences spoken by omni's `tts` pipeline (the Piper voice joe,
fixed seeds, all requests at once so they batch) and the audio transcribed by omni's `asr` pipeline (Whisper
tiny.en, all at once) come back at a word error rate of at most 5 % (issue 52).

The word error rate is the Levenshtein distance over words (substitutions, deletions, insertions) summed over the
sentences, divided by the number of words they should say. Both sides are normalized first: lowercased; curly
apostrophes made straight; hyphens and every punctuation mark but the apostrophe become spaces; a whole number
written in digits under a thousand is spelled in words ("42" -> "forty two"), so "forty-two" and "42" are one form;
apostrophes at a word's edges are dropped, inside it kept (contractions stay: "don't" is not "dont"). Ordinals,
times and larger numbers are not normalized; the sentences have none.
"""

from __future__ import annotations

import re

import pytest

from omni_kernel import Omni
from omni_kernel.core.events import RequestFinished
from omni_kernel.core.request import AUDIO

MAX_WER = 0.05
SEED = 1234

# Picked before the first run, not tuned to it: questions, statements, names, numbers as words, contractions, one
# word to twenty-odd words. None starts with "Speech" (tiny.en hears it as "Stage" there: ../shared/FACTS.md).
SENTENCES = (
    "Good morning, how are you feeling today?",
    "The weather in London has been cold and rainy all week.",
    "Could you please close the window before you leave?",
    "My sister Anna moved to Paris three years ago.",
    "We need seven apples, two loaves of bread and a bottle of milk.",
    "Which bus goes to the airport?",
    "The meeting starts at ten tomorrow morning.",
    "Peter doesn't like coffee, but he drinks a lot of tea.",
    "Thank you very much for your help.",
    "It's a beautiful day for a walk in the park.",
    "The children played football in the garden until it got dark.",
    "Have you ever read a book that changed the way you think?",
    "Please turn left at the next traffic light.",
    "The library opens early on weekdays and closes late on Fridays.",
    "I would like a table for four people, please.",
    "Our flight was delayed by almost two hours.",
    "The doctor told him to rest and drink plenty of water.",
    "She plays the piano beautifully.",
    "What time does the museum close on Sunday?",
    "A small dog was sleeping under the kitchen table.",
    "Learning a new language takes time, patience and practice.",
    "Welcome home.",
    "When the rain finally stopped, we packed our bags, said goodbye to our friends, and drove back to the city "
    "along the coast.",
)

ONES = ("zero one two three four five six seven eight nine ten eleven twelve thirteen fourteen fifteen sixteen "
        "seventeen eighteen nineteen").split()
TENS = "_ _ twenty thirty forty fifty sixty seventy eighty ninety".split()


def spell(n: int) -> str:
    """A whole number under a thousand in words ("forty two"); larger ones stay digits."""
    if n < 20:
        return ONES[n]
    if n < 100:
        return TENS[n // 10] + ("" if n % 10 == 0 else " " + ONES[n % 10])
    if n < 1000:
        return ONES[n // 100] + " hundred" + ("" if n % 100 == 0 else " " + spell(n % 100))
    return str(n)


def words(text: str) -> list[str]:
    """The text's words after the normalization the module docstring describes."""
    text = re.sub(r"[^a-z0-9']+", " ", text.lower().replace("\u2019", "'"))
    text = re.sub(r"\d+", lambda m: f" {spell(int(m.group()))} ", text)
    return [w.strip("'") for w in text.split() if w.strip("'")]


def word_errors(reference: str, hypothesis: str) -> int:
    """The fewest word substitutions, deletions and insertions that turn the hypothesis into the reference."""
    ref, hyp = words(reference), words(hypothesis)
    previous = list(range(len(hyp) + 1))
    for i, r in enumerate(ref, 1):
        current = [i]
        for j, h in enumerate(hyp, 1):
            current.append(min(previous[j] + 1, current[j - 1] + 1, previous[j - 1] + (r != h)))
        previous = current
    return previous[-1]


@pytest.mark.parametrize(("reference", "hypothesis", "errors"), [
    ("the cat sat", "The cat sat.", 0),
    ("the cat sat", "the bat sat", 1),  # a substitution
    ("the cat sat", "the sat", 1),  # a deletion
    ("the cat sat", "the cat sat down", 1),  # an insertion
    ("the cat sat", "", 3),
    ("", "a b", 2),
    ("Forty-two apples, please!", "42 apples please", 0),
    ("I'll be there at seven.", "I\u2019ll be there at 7", 0),
    ("Don't stop.", "dont stop", 1),  # contractions are kept
    ("one hundred and five", "105", 1),  # "and" is a word
    ("Anna moved to Paris", "Ana moved Paris too", 3),
])
def test_word_errors(reference, hypothesis, errors):
    assert word_errors(reference, hypothesis) == errors


def test_spoken_sentences_come_back_as_their_words(voice_dir, whisper_dir):
    with Omni("tts", tts_model=str(voice_dir), tts_device="cpu") as tts:
        requests = [tts.request(text, seed=SEED) for text in SENTENCES]
        spoken = {e.request_id: e.result for e in tts.run(requests) if isinstance(e, RequestFinished)}
    audios = [spoken[r.request_id].output.data[AUDIO] for r in requests]
    assert all(audio.seconds > 0.3 for audio in audios)
    assert max(result.trace["tts.batch_max"] for result in spoken.values()) > 1  # the requests shared forwards
    from omni_speech.audio_out import encode

    with Omni("asr", asr_model=str(whisper_dir), asr_device="cpu") as asr:
        requests = [asr.request(audio=encode(audio, "wav")) for audio in audios]
        heard = {e.request_id: e.result for e in asr.run(requests) if isinstance(e, RequestFinished)}
    hypotheses = [heard[r.request_id].text for r in requests]
    assert max(result.trace["asr.batch_max"] for result in heard.values()) > 1
    errors = [word_errors(said, got) for said, got in zip(SENTENCES, hypotheses)]
    total = sum(len(words(said)) for said in SENTENCES)
    wer = sum(errors) / total
    misses = [f"{n} error(s): {said!r} -> {got.strip()!r}"
              for said, got, n in zip(SENTENCES, hypotheses, errors) if n]
    print(f"\nround trip: WER {sum(errors)}/{total} = {wer:.2%} over {len(SENTENCES)} sentences", *misses, sep="\n")
    assert wer <= MAX_WER, f"WER {sum(errors)}/{total} = {wer:.2%} > {MAX_WER:.0%}:\n" + "\n".join(misses)
