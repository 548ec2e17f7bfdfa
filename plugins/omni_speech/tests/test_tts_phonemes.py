"""Text to phoneme ids as Piper makes them (phonemes.py, tts_voice.py).

The reference phonemes and ids below come from a real run of Piper's own code, piper-tts 1.8.0 (its wheel's
`PiperVoice.phonemize` and `phonemes_to_ids`, with the en_US-joe-medium voice), on 2026-12-07. piper-tts 1.8.0
bundles an espeak-ng snapshot after 1.52 ("1.52.0.1"); omni pins espeak-ng 1.52.0 (espeakng-loader 0.2.4). The two
agree on 27 of the 35 sentences tried; where they differ, the snapshot adds linking glides ("ðɪʲ ˈɛnd", "hˈaɪʲ ʌv")
and once stresses "has been" otherwise; those sentences are not among the references here.
"""

from __future__ import annotations

import json

import pytest

from omni_speech import phonemes
from omni_speech.phonemes import Clause, phoneme_ids, phoneme_list, sentences
from omni_speech.tts_voice import FIRST_CHUNK_SPLIT, MAX_CHUNK, Voice

# text -> Piper's phonemes, one string per sentence (piper-tts 1.8.0)
PIPER_PHONEMES = {
    "Hello world. This is a test, isn't it? Yes!": ["həlˈoʊ wˈɜːld.", "ðɪs ɪz ɐ tˈɛst, ˈɪzənt ɪt?", "jˈɛs!"],
    "The store is open.": ["ðə stˈɔːɹ ɪz ˈoʊpən."],
    "Dr. Smith paid $3.50 for 2 apples; then: he left...": [
        "dˈɑːktɚ.", "smˈɪθ pˈeɪd dˈɑːlɚ θɹˈiː pɔɪnt fˈaɪv zˈiəɹoʊ fɔːɹ tˈuː ˈæpəlz; ðˈɛn: hiː lˈɛft"],
    "Wait — what?! She said \"no.\" (Really.)": ["wˈeɪt; wˌʌt?", "ʃiː sˈɛd nˈoʊ.", "ɹˈiəli."],
    "Para one.\n\nPara two": ["pˈæɹə wˌʌn", "pˈæɹə tˈuː"],
    "e.g. this, and i.e. that": ["fˌɔːɹɛɡzˈæmpəl ðˈɪs, ænd ˌaɪˈiː ðˈæt"],
    "Hello. X": ["həlˈoʊ.", "ˈɛks"],
    "Café naïve résumé façade.": ["kæfˈeɪ naɪˈiːv ɹˈɛzuːmˌeɪ fəsˈɑːd."],
}
# text -> Piper's ids per sentence with the joe voice's map (piper-tts 1.8.0)
PIPER_IDS = {
    "Hello world. This is a test, isn't it? Yes!": [
        [1, 0, 20, 0, 59, 0, 24, 0, 120, 0, 27, 0, 100, 0, 3, 0, 35, 0, 120, 0, 62, 0, 122, 0, 24, 0, 17, 0, 10, 0,
         2],
        [1, 0, 41, 0, 74, 0, 31, 0, 3, 0, 74, 0, 38, 0, 3, 0, 50, 0, 3, 0, 32, 0, 120, 0, 61, 0, 31, 0, 32, 0, 8, 0,
         3, 0, 120, 0, 74, 0, 38, 0, 59, 0, 26, 0, 32, 0, 3, 0, 74, 0, 32, 0, 13, 0, 2],
        [1, 0, 22, 0, 120, 0, 61, 0, 31, 0, 4, 0, 2]],
    "The store is open.": [[1, 0, 41, 0, 59, 0, 3, 0, 31, 0, 32, 0, 120, 0, 54, 0, 122, 0, 88, 0, 3, 0, 74, 0, 38, 0,
                            3, 0, 120, 0, 27, 0, 100, 0, 28, 0, 59, 0, 26, 0, 10, 0, 2]],
}


def _piper_sentences(text: str) -> list[str]:
    clauses = phonemes.Espeak.shared().clauses(text, "en-us")
    return ["".join(phoneme_list(s)) for s in sentences(clauses) if phoneme_list(s)]


@pytest.mark.parametrize("text", list(PIPER_PHONEMES))
def test_phonemes_equal_pipers(text):
    assert _piper_sentences(text) == PIPER_PHONEMES[text]


def test_clause_terminators_are_kept_as_piper_keeps_them():
    clauses = phonemes.Espeak.shared().clauses("Well, wait: no; really? Yes! Fine. End", "en-us")
    assert [(c.terminator, c.sentence_end) for c in clauses] == [
        (",", False), (":", False), (";", False), ("?", True), ("!", True), (".", True), ("", True)]
    assert [c.text.strip() for c in clauses] == ["Well,", "wait:", "no;", "really?", "Yes!", "Fine.", "End"]
    assert clauses[0].piper_text().endswith(", ")  # the sentence goes on: Piper adds a space
    assert clauses[3].piper_text().endswith("?")


def test_ids_are_bos_pad_each_phoneme_pad_eos_and_unknown_phonemes_are_left_out():
    id_map = {"_": [0], "^": [1], "$": [2], "a": [5], "b": [6, 7]}
    assert phoneme_ids(["a", "x", "b"], id_map) == [1, 0, 5, 0, 6, 7, 0, 2]
    assert phoneme_list([Clause("ab", ".", True)]) == ["a", "b", "."]
    assert phoneme_list([Clause("é", "", True)]) == ["e", "\u0301"]  # NFD: the accent is a phoneme of its own


def test_vowel_clusters_merge_longest_first():
    merged = phonemes.merge_vowel_clusters(list("aɪoʊx"), frozenset({("a", "ɪ"), ("o", "ʊ")}))
    assert merged == ["aɪ", "oʊ", "x"]


def test_a_long_first_sentence_is_cut_at_a_clause_so_the_first_audio_comes_early(tmp_path):
    voice = _piper_voice(tmp_path)
    first = ("When the morning train finally arrived at the old station, everyone on the crowded platform pushed "
             "forward at once, hoping for a seat near the windows.")
    chunks = voice.chunks(first + " Then it left.")
    assert len(phoneme_list(phonemes.Espeak.shared().clauses(first, "en-us"))) > FIRST_CHUNK_SPLIT
    assert [c.text for c in chunks] == ["When the morning train finally arrived at the old station,",
                                        "everyone on the crowded platform pushed forward at once, hoping for a "
                                        "seat near the windows.", "Then it left."]
    short = voice.chunks("Short one, with a comma. Next.")
    assert [c.text for c in short] == ["Short one, with a comma.", "Next."]


def test_a_long_text_without_punctuation_is_cut_between_words(tmp_path):
    chunks = _piper_voice(tmp_path).chunks(("word " * 819)[:4096])
    assert len(chunks) > 1 and all(len(c.ids) <= 2 * MAX_CHUNK + 3 for c in chunks)
    assert sum(len(c.ids) for c in chunks) > 4000


def test_text_the_voice_cannot_speak_makes_no_chunk(tmp_path):
    voice = _piper_voice(tmp_path)
    assert voice.chunks("¡¿") == [] and voice.chunks("\u200b\u200b") == []


def test_a_missing_espeak_names_the_command_that_installs_it(monkeypatch):
    import builtins

    real_import = builtins.__import__

    def no_espeak(name, *args, **kwargs):
        if name == "espeakng_loader":
            raise ImportError(name)
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_espeak)
    with pytest.raises(phonemes.PhonemizerMissing) as caught:
        phonemes.Espeak()
    assert "pip install espeakng-loader==0.2.4" in str(caught.value) and "\n" not in str(caught.value)


def test_real_voice_ids_equal_pipers(voice_dir):
    voice = Voice.read(voice_dir)
    for text, ids in PIPER_IDS.items():
        assert [list(c.ids) for c in voice.chunks(text)] == ids


def _piper_voice(path):
    from tts_tiny import phoneme_map

    (path / "config.json").write_text(json.dumps({"sampling_rate": 16000}))
    voice = {"name": "v", "sample_rate": 16000, "espeak_voice": "en-us", "phoneme_id_map": phoneme_map(),
             "noise_scale": 0.667, "noise_w": 0.8, "length_scale": 1.0}
    (path / "omni_voice.json").write_text(json.dumps(voice, ensure_ascii=False))
    return Voice.read(path)
