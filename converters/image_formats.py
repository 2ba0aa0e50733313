"""Which image formats a dataset may hold, recognised by their first bytes.

DALI's decoder (``fn.decoders.image``) picks its codec from the file's content, not
its name, and so does the conversion: a JPEG named ``.png`` is a JPEG, and a
``.jp2`` or ``.pgm`` file is as welcome as a ``.jpg``. Every format listed in
:data:`ACCEPTED` is read both by DALI's CPU decoder and by the conversion's Pillow
check (``tests/test_image_formats.py`` decodes a real file of each through both).
"""

from __future__ import annotations

#: Bytes read from the start of a file to tell its format.
HEAD_BYTES = 16

#: The formats a dataset may hold, as named in messages and the README.
ACCEPTED: tuple[str, ...] = ("JPEG", "PNG", "BMP", "TIFF", "WebP", "JPEG 2000", "PNM")

# (format, prefix) pairs for the accepted formats with a fixed signature.
_SIGNATURES: tuple[tuple[str, bytes], ...] = (
    ("JPEG", b"\xff\xd8\xff"),
    ("PNG", b"\x89PNG\r\n\x1a\n"),
    ("TIFF", b"II*\x00"),
    ("TIFF", b"MM\x00*"),
    ("JPEG 2000", b"\x00\x00\x00\x0cjP  \r\n\x87\n"),  # the JP2 container
    ("JPEG 2000", b"\xff\x4f\xff\x51"),  # a bare codestream (.j2k, .j2c): SOC then SIZ
    ("BMP", b"BM"),
)

# Other formats worth naming when they are refused (Pillow may read some, DALI does not).
_OTHERS: tuple[tuple[str, bytes], ...] = (
    ("GIF", b"GIF8"),
    ("ICO", b"\x00\x00\x01\x00"),
    ("PSD", b"8BPS"),
    ("BigTIFF", b"II+\x00"),
    ("BigTIFF", b"MM\x00+"),
    ("PDF", b"%PDF"),
    ("ZIP", b"PK\x03\x04"),
)


def image_format(head: bytes) -> str | None:
    """The accepted format whose signature ``head`` (a file's first bytes) starts with, or ``None``."""
    for name, prefix in _SIGNATURES:
        if head.startswith(prefix):
            return name
    if head[:4] == b"RIFF" and head[8:12] == b"WEBP":
        return "WebP"
    if len(head) >= 3 and head[:1] == b"P" and head[1:2] in b"123456" and head[2:3].isspace():
        return "PNM"  # P1-P3 plain (ASCII), P4-P6 raw: bitmap, greymap, pixmap
    return None


def refusal(head: bytes) -> str:
    """Why a file whose first bytes are ``head`` is not taken as an image (for ``errors.jsonl``)."""
    accepted = ", ".join(ACCEPTED)
    if not head:
        return "empty file (0 bytes)"
    for name, prefix in _OTHERS:
        if head.startswith(prefix):
            return f"a {name} file, not a format DALI's decoder reads (accepted: {accepted})"
    return f"not an image file (starts with {head[:8]!r}; accepted formats: {accepted})"
