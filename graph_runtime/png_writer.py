"""PNG files encoded on several CPU threads, at the same zlib settings as PIL and about the same size.

PIL's PNG encoder runs one zlib stream on one thread; a 1024x1024 output at ComfyUI's SaveImage level is then a
visible part of a fast prompt. This writer filters the rows in numpy (PNG's adaptive per-row filter choice, as libpng
and PIL make it) and deflates the filtered bytes in pieces on a thread pool with pigz's scheme: each piece is a raw
deflate stream primed with the previous piece's last 32 KiB as its dictionary and ended on a byte boundary
(Z_SYNC_FLUSH), so the pieces concatenate into one valid zlib stream. zlib releases the GIL while it compresses (and
numpy while it filters), so the pieces run in parallel. Only 8-bit RGB and RGBA images without metadata of their own
take this path; anything else is saved by PIL. Text given to the writer (ComfyUI's "prompt" and "workflow") is
written as PIL's `PngInfo.add_text` writes it, in the same chunks.
"""

from __future__ import annotations

import io
import os
import struct
import zlib
from concurrent.futures import ThreadPoolExecutor
from typing import BinaryIO

import numpy as np

SIGNATURE = b"\x89PNG\r\n\x1a\n"
COMFYUI_COMPRESS_LEVEL = 4  # ComfyUI's SaveImage default
MAX_THREADS = 8
# Pieces smaller than this lose ratio to the restarts and gain little time from another thread (pigz's block size).
MIN_PIECE_BYTES = 128 * 1024
# Pieces larger than this are split further, however few the threads: filtering a piece holds several copies of it.
MAX_PIECE_BYTES = 4 * 1024 * 1024
MAX_CHUNK_BYTES = 2**31 - 1  # PNG's limit on a chunk's length
WINDOW_BYTES = 32 * 1024  # deflate's window: the most history a piece can use from the one before it
MAX_KEYWORD_CHARS = 79  # PNG's limit on a text chunk's keyword
BYTES_PER_PIXEL = {"RGB": 3, "RGBA": 4}
COLOR_TYPE = {"RGB": 2, "RGBA": 6}

FILTER_NONE, FILTER_SUB, FILTER_UP, FILTER_AVERAGE, FILTER_PAETH = range(5)
# The filters tried for each row, in PIL's order, which decides ties (the first smallest wins). PIL leaves Average out
# (it rarely wins on photographs, and where the heuristic picked it in our trials the stream compressed worse);
# trying the same filters in the same order gives the same choice per row, so the same file size.
CANDIDATE_FILTERS = (FILTER_NONE, FILTER_UP, FILTER_SUB, FILTER_PAETH)


def default_threads() -> int:
    return max(1, min(os.cpu_count() or 1, MAX_THREADS))


def neighbours(rows: np.ndarray, previous: np.ndarray, bpp: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """For every byte of `rows` (uint8, one image row per row): the byte one pixel to its left (a), above it (b) and
    above-left (c), zero outside the image; `previous` is the image row above the first (zeros at the top)."""
    up = np.concatenate([previous[None], rows[:-1]])
    left = np.zeros_like(rows)
    left[:, bpp:] = rows[:, :-bpp]
    up_left = np.zeros_like(rows)
    up_left[:, bpp:] = up[:, :-bpp]
    return left, up, up_left


def paeth_prediction(left: np.ndarray, up: np.ndarray, up_left: np.ndarray) -> np.ndarray:
    """The neighbour closest to a + b - c, ties to a, then b (the PNG specification's Paeth predictor)."""
    a, b, c = (x.astype(np.int16) for x in (left, up, up_left))
    pa, pb, pc = np.abs(b - c), np.abs(a - c), np.abs(a + b - 2 * c)
    return np.where((pa <= pb) & (pa <= pc), left, np.where(pb <= pc, up, up_left))


def _filtered(kind: int, rows: np.ndarray, left: np.ndarray, up: np.ndarray, up_left: np.ndarray) -> np.ndarray:
    if kind == FILTER_NONE:
        return rows
    if kind == FILTER_SUB:
        return rows - left
    if kind == FILTER_UP:
        return rows - up
    if kind == FILTER_AVERAGE:
        return rows - ((left.astype(np.int16) + up) >> 1).astype(np.uint8)
    return rows - paeth_prediction(left, up, up_left)


def filtered(kind: int, rows: np.ndarray, previous: np.ndarray, bpp: int) -> np.ndarray:
    """`rows` (without type bytes) filtered with filter `kind` for every row (uint8, mod 256)."""
    return _filtered(kind, rows, *neighbours(rows, previous, bpp))


def filter_rows(rows: np.ndarray, previous: np.ndarray, bpp: int) -> np.ndarray:
    """PNG's filtered scanlines for `rows` (H x row bytes, uint8): each row gets the filter of CANDIDATE_FILTERS whose
    output has the smallest sum of its bytes read as signed magnitudes (libpng's and PIL's heuristic), and is written
    as that filter's type byte and the row minus the prediction (mod 256). `previous` is the image row above `rows`
    (zeros for the first)."""
    around = neighbours(rows, previous, bpp)
    candidates = np.stack([_filtered(kind, rows, *around) for kind in CANDIDATE_FILTERS])
    # |int8| read back as uint8 is min(v, 256 - v) for every byte, -128 included (it stays 0x80 = 128).
    costs = np.abs(candidates.view(np.int8)).view(np.uint8).sum(axis=2, dtype=np.uint32)
    choice = costs.argmin(axis=0)  # the first smallest, as PIL breaks ties
    out = np.empty((rows.shape[0], rows.shape[1] + 1), dtype=np.uint8)
    out[:, 0] = np.asarray(CANDIDATE_FILTERS, dtype=np.uint8)[choice]
    out[:, 1:] = candidates[choice, np.arange(rows.shape[0])]
    return out


def _zlib_header(level: int) -> bytes:
    """CMF (deflate, 32 KiB window) and FLG with FLEVEL as zlib sets it for `level`, FCHECK making the pair a
    multiple of 31."""
    cmf = 0x78
    flevel = 0 if level < 2 else 1 if level < 6 else 2 if level == 6 else 3
    flg = flevel << 6
    flg |= 31 - (cmf * 256 + flg) % 31
    return bytes([cmf, flg])


def _deflate_piece(data: memoryview, dictionary: memoryview | None, level: int, last: bool) -> bytes:
    # Raw deflate (wbits -15: no header or checksum of its own); memory level and strategy as PIL sets them for PNG.
    settings = (level, zlib.DEFLATED, -15, 9, zlib.Z_FILTERED)
    if dictionary is not None and len(dictionary):
        compressor = zlib.compressobj(*settings, zdict=dictionary)
    else:
        compressor = zlib.compressobj(*settings)
    return compressor.compress(data) + compressor.flush(zlib.Z_FINISH if last else zlib.Z_SYNC_FLUSH)


def bands(height: int, row_bytes: int, threads: int) -> list[tuple[int, int]]:
    """Row ranges [start, stop) splitting the image into one band per thread, or more where a band would exceed
    MAX_PIECE_BYTES, each of at least MIN_PIECE_BYTES where the image has that much (and at least one row)."""
    total = height * row_bytes
    count = min(max(threads, -(-total // MAX_PIECE_BYTES)), height, max(1, total // MIN_PIECE_BYTES))
    edges = [round(i * height / count) for i in range(count + 1)]
    return list(zip(edges[:-1], edges[1:]))


def _chunks(kind: bytes, data: bytes) -> list[bytes]:
    """`data` as one chunk of type `kind`, or several where it exceeds a chunk's limit (IDAT may be split anywhere)."""
    parts = [data[start:start + MAX_CHUNK_BYTES] for start in range(0, len(data), MAX_CHUNK_BYTES)] or [b""]
    return [struct.pack(">I", len(part)) + kind + part + struct.pack(">I", zlib.crc32(part, zlib.crc32(kind)))
            for part in parts]


def _check_keyword(keyword) -> bytes:
    """A text chunk's keyword as PNG requires it (1-79 Latin-1 characters, no NUL), encoded."""
    if not isinstance(keyword, str) or not 1 <= len(keyword) <= MAX_KEYWORD_CHARS or "\0" in keyword:
        raise ValueError(f"text keyword {keyword!r}: expected 1 to {MAX_KEYWORD_CHARS} characters without NUL")
    try:
        return keyword.encode("latin-1")
    except UnicodeEncodeError:
        raise ValueError(f"text keyword {keyword!r}: expected Latin-1 characters only") from None


def text_chunks(text: dict[str, str]) -> list[bytes]:
    """`text` (keyword -> value) as PNG text chunks, in its order, as PIL's `PngInfo.add_text` writes them: tEXt
    where the value is Latin-1, else iTXt (uncompressed, UTF-8, no language tag or translated keyword)."""
    found = []
    for keyword, value in text.items():
        key = _check_keyword(keyword)
        if not isinstance(value, str):
            raise ValueError(f"text {keyword!r}: expected a str value, got {type(value).__name__}")
        try:
            found += _chunks(b"tEXt", key + b"\0" + value.encode("latin-1"))
        except UnicodeEncodeError:
            # compression flag 0, method 0, empty language tag, empty translated keyword
            found += _chunks(b"iTXt", key + b"\0\0\0\0\0" + value.encode("utf-8"))
    return found


def _pil_png(image, compress_level: int, text: dict[str, str]) -> bytes:
    from PIL import PngImagePlugin

    info = None
    if text:
        info = PngImagePlugin.PngInfo()
        for keyword, value in text.items():
            info.add_text(keyword, value)
    buffer = io.BytesIO()
    image.save(buffer, format="PNG", compress_level=compress_level, pnginfo=info)
    return buffer.getvalue()


def _check_level(compress_level: int) -> None:
    if isinstance(compress_level, bool) or not isinstance(compress_level, int) or not 0 <= compress_level <= 9:
        raise ValueError(f"compress_level: expected an integer from 0 to 9, got {compress_level!r}")


def encode_png(image, compress_level: int = COMFYUI_COMPRESS_LEVEL, threads: int | None = None,
               text: dict[str, str] | None = None) -> bytes:
    """The PNG file of PIL image `image` at zlib `compress_level` (0-9), deflated on `threads` threads (default:
    the CPU count, at most MAX_THREADS), with `text` (keyword -> value) in text chunks after the header. Decodes to
    exactly `image`'s pixels."""
    _check_level(compress_level)
    text = dict(text or {})
    metadata = text_chunks(text)  # checked before any work
    threads = default_threads() if threads is None else threads
    if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
        raise ValueError(f"threads: expected a positive integer or None, got {threads!r}")
    # Other modes (palette, grey, 16-bit) and images carrying metadata (text, ICC profile, transparency, dpi) fall
    # back to PIL's own encoder, which knows their chunks and what it keeps of them; this writer writes pixels only.
    # Empty images too: PIL refuses them with its own error.
    if image.mode not in BYTES_PER_PIXEL or image.info or 0 in image.size:
        return _pil_png(image, compress_level, text)

    width, height = image.size
    bpp = BYTES_PER_PIXEL[image.mode]
    pixels = np.asarray(image).reshape(height, width * bpp)
    row_bands = bands(height, width * bpp + 1, threads)
    zero_row = np.zeros(width * bpp, dtype=np.uint8)

    def filter_band(band: tuple[int, int]) -> np.ndarray:
        start, stop = band
        return filter_rows(pixels[start:stop], pixels[start - 1] if start else zero_row, bpp)

    def deflate_band(index: int) -> bytes:
        dictionary = memoryview(filtered[index - 1]).cast("B")[-WINDOW_BYTES:] if index else None
        return _deflate_piece(memoryview(filtered[index]).cast("B"), dictionary, compress_level,
                              last=index == len(row_bands) - 1)

    workers = min(threads, len(row_bands))
    if workers == 1:
        filtered = [filter_band(band) for band in row_bands]
        pieces = [deflate_band(index) for index in range(len(row_bands))]
    else:
        with ThreadPoolExecutor(max_workers=workers) as pool:
            filtered = list(pool.map(filter_band, row_bands))
            pieces = list(pool.map(deflate_band, range(len(row_bands))))
    adler = 1
    for band in filtered:
        adler = zlib.adler32(band, adler)

    pieces[0] = _zlib_header(compress_level) + pieces[0]
    pieces[-1] = pieces[-1] + struct.pack(">I", adler)
    header = struct.pack(">IIBBBBB", width, height, 8, COLOR_TYPE[image.mode], 0, 0, 0)
    idat = [chunk for piece in pieces for chunk in _chunks(b"IDAT", piece)]
    # Text right after the header, where PIL puts it for an image without other metadata.
    return b"".join([SIGNATURE, *_chunks(b"IHDR", header), *metadata, *idat, *_chunks(b"IEND", b"")])


def write_png(file: BinaryIO, image, compress_level: int = COMFYUI_COMPRESS_LEVEL, threads: int | None = None,
              text: dict[str, str] | None = None) -> None:
    """`encode_png(image, ...)` written to the open binary `file`."""
    file.write(encode_png(image, compress_level, threads, text))
