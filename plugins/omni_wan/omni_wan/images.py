"""Load and validate the conditioning image: one clear InputError for anything that cannot be used.

`image_size` reads the header only (a downstream node's cheap check at submit); `open_image` decodes, once per
request, when the request is processed.
"""

from __future__ import annotations

import hashlib
import logging
import warnings
from contextlib import contextmanager
from pathlib import Path

from omni_kernel.core.errors import InputError

log = logging.getLogger("omni")

# A decompression-bomb guard: the pixel count is read from the header and checked before decoding. 40 MP
# admits an 8K frame (33 MP) and refuses the tiny files that claim gigapixels.
MAX_PIXELS = 40_000_000


def image_size(path: str | Path | None) -> tuple[int, int]:
    """(width, height) as the file's header states it, without decoding; raises InputError."""
    with _opened(path) as (img, _):
        return img.size


def open_image(path: str | Path | None):
    """Return the image as an RGB PIL image (EXIF orientation applied), or raise InputError."""
    from PIL import ImageOps

    with _opened(path) as (img, _):
        img.load()  # a decode error here is turned into an InputError by _opened
        return ImageOps.exif_transpose(img).convert("RGB")


def image_digest(image) -> str:
    """A content hash of the decoded pixels: the same picture in two files shares prepare-cache entries."""
    h = hashlib.sha256()
    h.update(f"{image.mode}:{image.width}x{image.height}:".encode())
    h.update(image.tobytes())
    return h.hexdigest()


@contextmanager
def _opened(path: str | Path | None):
    """The image file opened lazily (header read, pixels not decoded) and checked for size."""
    from PIL import Image, UnidentifiedImageError

    file = _image_file(path)
    try:
        if file.stat().st_size == 0:
            raise InputError(f"image {str(file)!r} is empty (0 bytes)")
        with warnings.catch_warnings(record=True) as caught:  # PIL's notes on odd files: the log, not stderr
            warnings.simplefilter("always")
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            try:
                with Image.open(file) as img:
                    _check_size(file, *img.size)
                    yield img, file
            finally:
                for w in caught:
                    log.debug("image %s: %s: %s", file, w.category.__name__, w.message)
    except InputError:
        raise
    except (Image.DecompressionBombError, Image.DecompressionBombWarning):
        raise InputError(f"image {str(file)!r} is larger than the {MAX_PIXELS // 1_000_000} MP limit") from None
    except UnidentifiedImageError:
        raise InputError(f"{str(file)!r} is not an image omni can read (PNG, JPEG, WebP, BMP, ...)") from None
    except (OSError, ValueError, SyntaxError) as exc:
        raise InputError(f"image {str(file)!r} cannot be read: {' '.join(str(exc).split())}") from None


def _image_file(path: str | Path | None) -> Path:
    """The image's path, or InputError when there is none or it names no file."""
    if path is None or str(path) == "":
        raise InputError("this pipeline needs an input image: pass --image PATH (PNG, JPEG, WebP, ...)")
    file = Path(path).expanduser()
    if not file.exists():
        raise InputError(f"image {str(file)!r} does not exist")
    if not file.is_file():
        raise InputError(f"image {str(file)!r} is not a file")
    return file


def _check_size(file: Path, width: int, height: int) -> None:
    if width == 0 or height == 0:
        raise InputError(f"image {str(file)!r} has zero size ({width}x{height})")
    if width * height > MAX_PIXELS:
        raise _too_large(file, width, height)


def _too_large(file: Path, width: int, height: int) -> InputError:
    return InputError(f"image {str(file)!r} is {width}x{height} ({width * height / 1e6:.0f} MP), over the "
                      f"{MAX_PIXELS // 1_000_000} MP limit; resize it first")
