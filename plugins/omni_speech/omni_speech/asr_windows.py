"""How a request's audio is cut into Whisper's 30-second windows, and what one decoded window gives (no torch).

The rule is transformers' (and OpenAI's) sequential long-form decoding, so a request's tokens equal
`WhisperForConditionalGeneration.generate` on the clip alone:
- The log-mel is computed once over the whole clip (audio up to 30 s is padded to 30 s first, as the feature
  extractor does). A window is the 3,000 frames (30 s) from the request's `seek`, zero-padded at the end.
- Audio up to 30 s is one window, decoded without timestamps unless the request asks for segments. Longer audio is
  always decoded with timestamps: a window that ends on a complete segment (a timestamp pair) is cut there and the
  next window starts at that segment's end; the unfinished words after it are decoded again in the next window.
  A window that ends on a single timestamp (no speech after it) or has no segment boundary moves the seek by the
  whole window. The request is done when its seek reaches the end of its frames.
- Without timestamps a window is one segment over the whole window (its end is cut to the audio's end when the
  segments are reported). A model that writes timestamp tokens anyway is cut at them as with timestamps, since
  transformers does so.
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs

SECONDS_PER_FRAME = 0.01  # the feature extractor's hop: 160 samples at 16 kHz
FRAMES_PER_POSITION = 2  # the encoder's stride: one timestamp step (0.02 s) is two frames
WINDOW_FRAMES = 3000
TIME_PRECISION = SECONDS_PER_FRAME * FRAMES_PER_POSITION


@attrs.frozen
class WindowSegment:
    """A stretch of one window's tokens (timestamp tokens included) and its times in the audio, in seconds."""

    start: float
    end: float
    tokens: tuple[int, ...]


@attrs.frozen
class WindowResult:
    """What a decoded window adds to its request: its segments, and how many frames the seek moves on."""

    segments: tuple[WindowSegment, ...]
    advance: int


def split_window(tokens: Sequence[int], timestamp_begin: int, seek: int, window_frames: int) -> WindowResult:
    """A window's generated tokens (EOS removed) cut into segments at Whisper's timestamp pairs, as transformers'
    `_retrieve_segment`; `window_frames` is the window's frames of audio (at most 3,000)."""
    tokens = tuple(tokens)
    offset = seek * SECONDS_PER_FRAME
    stamps = [token >= timestamp_begin for token in tokens]
    single_ending = stamps[-2:] == [False, True]
    pairs = [i + 1 for i in range(len(tokens) - 1) if stamps[i] and stamps[i + 1]]
    if not pairs:
        end = window_frames // FRAMES_PER_POSITION  # the window's last whole timestamp step
        last = [token for token, stamp in zip(tokens, stamps) if stamp]
        if last and last[-1] != timestamp_begin:
            end = last[-1] - timestamp_begin
        return WindowResult((WindowSegment(offset, offset + end * TIME_PRECISION, tokens),), window_frames)
    slices = list(pairs)
    if single_ending:
        slices.append(len(tokens))
    else:
        slices[-1] += 1  # the last segment keeps its closing timestamp
    segments = []
    start = 0
    for i, stop in enumerate(slices):
        piece = tokens[start:stop]
        closing = -1 if i < len(slices) - 1 or single_ending else -2
        segments.append(WindowSegment(offset + (piece[0] - timestamp_begin) * TIME_PRECISION,
                                      offset + (piece[closing] - timestamp_begin) * TIME_PRECISION, piece))
        start = stop
    if single_ending:
        advance = window_frames
    else:
        advance = (tokens[start - 2] - timestamp_begin) * FRAMES_PER_POSITION
    return WindowResult(tuple(segments), advance if advance > 0 else window_frames)

