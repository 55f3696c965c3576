"""The threaded PNG writer (graph_runtime/png_writer.py).

Invariants: the file decodes (by PIL) to exactly the input's pixels for RGB and RGBA of any shape, on one thread or
several; its IDAT chunks concatenate into ONE zlib stream (one header, pieces joined by sync flushes, one final block
and one Adler-32 of the whole filtered stream), whose content is the filtered scanlines of the whole image, so the
pieces' row boundaries change nothing; each filter is the PNG specification's; the file is as small as PIL's at the
same level; whatever the writer does not handle (other modes, metadata, empty images) is PIL's own file.
"""

import io
import json
import re
import struct
import zlib

import numpy as np
import pytest
from PIL import Image, PngImagePlugin

from graph_runtime import png_writer
from graph_runtime.png_writer import (CANDIDATE_FILTERS, FILTER_AVERAGE, FILTER_NONE, FILTER_PAETH, FILTER_SUB,
                                      FILTER_UP, bands, encode_png, filter_rows, filtered, write_png)


def gradient_image(width: int, height: int, mode: str, seed: int = 0) -> Image.Image:
    """Photograph-like content: smooth gradients, mild noise, and flat shapes with hard edges."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width].astype(np.float32)
    x, y = x / max(width, 1), y / max(height, 1)
    rgb = np.stack([255 * (0.5 + 0.5 * np.sin(6 * x + 3 * y)), 255 * x * y, 255 * (1 - x) * (0.3 + 0.7 * y)], -1)
    rgb[(x - 0.5) ** 2 + (y - 0.5) ** 2 < 0.06] = [250, 40, 30]
    rgb[(y > 0.1) & (y < 0.3) & (x > 0.6) & (x < 0.9)] = [20, 200, 90]
    rgb = np.clip(rgb + rng.normal(0, 3, rgb.shape), 0, 255).astype(np.uint8)
    if mode == "RGBA":
        alpha = np.clip(255 * (0.2 + x + rng.normal(0, 0.02, x.shape)), 0, 255).astype(np.uint8)
        rgb = np.concatenate([rgb, alpha[..., None]], -1)
    return Image.fromarray(rgb, mode)


def noise_image(width: int, height: int, mode: str, seed: int = 0) -> Image.Image:
    """What a random-weights VAE gives: every byte independent."""
    channels = len(mode)
    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (height, width, channels), dtype=np.uint8),
                           mode)


def pil_png(image: Image.Image, level: int = 4, text: dict | None = None) -> bytes:
    """PIL's own file, with `text` added through `PngInfo.add_text` (the reference the writer is held to)."""
    info = PngImagePlugin.PngInfo()
    for keyword, value in (text or {}).items():
        info.add_text(keyword, value)
    buffer = io.BytesIO()
    image.save(buffer, format="PNG", compress_level=level, pnginfo=info)
    return buffer.getvalue()


def decoded(data: bytes) -> tuple[str, np.ndarray]:
    with Image.open(io.BytesIO(data)) as image:
        image.load()
        return image.mode, np.asarray(image)


def chunks(data: bytes) -> list[tuple[bytes, bytes]]:
    """(type, payload) of every chunk, each CRC checked."""
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    found, pos = [], 8
    while pos < len(data):
        length, kind = struct.unpack(">I4s", data[pos:pos + 8])
        payload = data[pos + 8:pos + 8 + length]
        assert struct.unpack(">I", data[pos + 8 + length:pos + 12 + length])[0] == zlib.crc32(kind + payload)
        found.append((kind, payload))
        pos += 12 + length
    return found


@pytest.mark.parametrize("mode", ["RGB", "RGBA"])
@pytest.mark.parametrize("width", [1, 3, 7, 1024])
@pytest.mark.parametrize("height", [1, 2, 513])
def test_decodes_to_exactly_the_input_pixels(mode, width, height):
    """Any width (a row shorter than a pixel's left neighbour reach included) and height, one band or several."""
    image = gradient_image(width, height, mode, seed=width * 1000 + height)
    out_mode, pixels = decoded(encode_png(image))
    assert out_mode == mode
    assert np.array_equal(pixels, np.asarray(image))


@pytest.mark.parametrize("threads", [1, 8])
@pytest.mark.parametrize("content", [gradient_image, noise_image])
def test_1024_square_on_one_thread_and_eight_decodes_equal(threads, content):
    """A full-size output through one band (threads 1 still splits at MAX_PIECE_BYTES) or eight, the eight as
    eight IDAT chunks."""
    image = content(1024, 1024, "RGBA")
    data = encode_png(image, threads=threads)
    assert np.array_equal(decoded(data)[1], np.asarray(image))
    pieces = len(bands(1024, 1024 * 4 + 1, threads))
    assert sum(kind == b"IDAT" for kind, _ in chunks(data)) == pieces
    assert (pieces >= 8) if threads == 8 else (pieces < 8)


@pytest.mark.parametrize("level", [0, 1, 4, 6, 9])
@pytest.mark.parametrize("threads", [1, 3, 8])
def test_idat_is_one_zlib_stream_of_the_whole_filtered_image(level, threads):
    """The concatenated IDAT payloads are a single zlib stream: zlib's header for the level, every piece decoding on
    into the next, one end, nothing after it; its content is the whole image filtered at once (band boundaries
    change no row's filter) and its trailer is that content's Adler-32."""
    image = gradient_image(700, 600, "RGB", seed=level)
    found = chunks(encode_png(image, compress_level=level, threads=threads))
    assert [kind for kind, _ in found][:1] == [b"IHDR"] and found[-1] == (b"IEND", b"")
    assert found[0][1] == struct.pack(">IIBBBBB", 700, 600, 8, 2, 0, 0, 0)
    stream = b"".join(payload for kind, payload in found if kind == b"IDAT")
    assert stream[:2] == zlib.compress(b"", level)[:2]  # CMF and FLG (FLEVEL) as zlib writes them for the level
    decompressor = zlib.decompressobj()
    content = decompressor.decompress(stream)
    assert decompressor.eof and decompressor.unused_data == b""
    pixels = np.asarray(image).reshape(600, -1)
    expected = filter_rows(pixels, np.zeros(pixels.shape[1], np.uint8), 3).tobytes()
    assert content == expected
    assert stream[-4:] == struct.pack(">I", zlib.adler32(expected))


def reference_filter(kind: int, row: list[int], above: list[int], bpp: int) -> list[int]:
    """The PNG specification's filters, byte by byte (section 9.2), on raw bytes."""
    out = []
    for i, x in enumerate(row):
        a = row[i - bpp] if i >= bpp else 0
        b = above[i]
        c = above[i - bpp] if i >= bpp else 0
        if kind == FILTER_NONE:
            prediction = 0
        elif kind == FILTER_SUB:
            prediction = a
        elif kind == FILTER_UP:
            prediction = b
        elif kind == FILTER_AVERAGE:
            prediction = (a + b) // 2
        else:
            p = a + b - c
            pa, pb, pc = abs(p - a), abs(p - b), abs(p - c)
            prediction = a if pa <= pb and pa <= pc else b if pb <= pc else c
        out.append((x - prediction) % 256)
    return out


@pytest.mark.parametrize("bpp", [3, 4])
@pytest.mark.parametrize("kind", [FILTER_NONE, FILTER_SUB, FILTER_UP, FILTER_AVERAGE, FILTER_PAETH])
def test_each_filter_matches_the_specification(kind, bpp):
    """The vectorized filter equals the per-byte reference on random rows, below a given row and at the top."""
    rng = np.random.default_rng(kind * 10 + bpp)
    for width, height in [(1, 1), (2, 3), (5, 4), (9, 6)]:
        rows = rng.integers(0, 256, (height, width * bpp), dtype=np.uint8)
        for previous in (np.zeros(width * bpp, np.uint8), rng.integers(0, 256, width * bpp, dtype=np.uint8)):
            got = filtered(kind, rows, previous, bpp)
            above = [previous.tolist()] + rows[:-1].tolist()
            expected = [reference_filter(kind, row, above[i], bpp) for i, row in enumerate(rows.tolist())]
            assert got.tolist() == expected


@pytest.mark.parametrize("bpp", [3, 4])
def test_each_row_takes_the_filter_with_the_smallest_signed_sum(bpp):
    """filter_rows writes, per row, the type byte of the candidate whose bytes read as signed have the smallest sum
    of magnitudes (the first such in CANDIDATE_FILTERS' order on a tie), then that filter's bytes."""
    rng = np.random.default_rng(bpp)
    noisy = rng.integers(0, 256, (6, 8 * bpp))
    ramps = np.cumsum(rng.integers(0, 3, (12, 8 * bpp)), axis=1) % 256  # smooth along the row: Sub or Paeth
    flat = np.full((3, 8 * bpp), 77)  # a solid row, then its repeats: None's cost ties with Sub's, then Up is 0
    rows = np.concatenate([noisy, ramps, flat, ramps[:2]]).astype(np.uint8)
    previous = rng.integers(0, 256, 8 * bpp, dtype=np.uint8)
    out = filter_rows(rows, previous, bpp)
    above = [previous.tolist()] + rows[:-1].tolist()
    seen = set()
    for i, row in enumerate(rows.tolist()):
        options = {kind: reference_filter(kind, row, above[i], bpp) for kind in CANDIDATE_FILTERS}
        costs = {kind: sum(min(v, 256 - v) for v in data) for kind, data in options.items()}
        best = min(CANDIDATE_FILTERS, key=lambda kind: (costs[kind], CANDIDATE_FILTERS.index(kind)))
        assert out[i, 0] == best and out[i, 1:].tolist() == options[best]
        seen.add(best)
    assert len(seen) >= 3  # the rows exercise more than one choice


@pytest.mark.parametrize("mode", ["RGB", "RGBA"])
def test_size_at_level_4_is_pils_within_one_percent(mode):
    """Same filters tried in the same order, same zlib level, memory level and strategy as PIL: the only extra
    bytes are each piece's sync-flush marker and restarted Huffman block, a few hundred bytes per piece against
    megabytes, so 1% is a loose bound that still catches a worse filter choice or strategy (each costs 5-10% on
    this content). On noise (nothing to gain) the same bound holds."""
    for image in (gradient_image(1024, 1024, mode), noise_image(512, 512, mode)):
        ours, theirs = len(encode_png(image, 4, threads=8)), len(pil_png(image, 4))
        assert ours <= 1.01 * theirs, (ours, theirs)


@pytest.mark.parametrize("mode", ["L", "LA", "P", "I;16", "1"])
def test_other_modes_are_pils_own_file(mode):
    """Modes the writer does not encode fall back to PIL's encoder: the same bytes PIL writes, the same pixels."""
    image = gradient_image(33, 17, "RGB").convert("L" if mode == "I;16" else mode)
    if mode == "I;16":
        image = Image.fromarray(np.asarray(image).astype("<u2") * 257)
        assert image.mode == "I;16"
    data = encode_png(image, 4)
    assert data == pil_png(image, 4)
    out_mode, pixels = decoded(data)
    assert np.array_equal(pixels, np.asarray(image))


def test_images_with_metadata_are_pils_own_file():
    """An image carrying an ICC profile or PNG text keeps whatever PIL's save keeps of it: the writer hands it over."""
    with_text = io.BytesIO()
    info = PngImagePlugin.PngInfo()
    info.add_text("parameters", "a prompt")
    gradient_image(20, 10, "RGB").save(with_text, format="PNG", pnginfo=info)
    text_image = Image.open(io.BytesIO(with_text.getvalue()))
    text_image.load()
    icc_image = gradient_image(20, 10, "RGBA")
    icc_image.info["icc_profile"] = b"not a real profile, but PIL writes it as given"
    for image in (text_image, icc_image):
        assert image.info
        data = encode_png(image, 4)
        assert data == pil_png(image, 4)
        assert np.array_equal(decoded(data)[1], np.asarray(image))
    assert Image.open(io.BytesIO(encode_png(icc_image))).info["icc_profile"] == icc_image.info["icc_profile"]


def test_empty_image_gets_pils_error():
    with pytest.raises(ValueError, match="empty"):
        encode_png(Image.new("RGB", (0, 4)))


@pytest.mark.parametrize("kwargs, named", [({"compress_level": 10}, "compress_level"),
                                           ({"compress_level": -1}, "compress_level"),
                                           ({"compress_level": 4.0}, "compress_level"),
                                           ({"threads": 0}, "threads"), ({"threads": True}, "threads")])
def test_bad_settings_are_refused_naming_the_setting(kwargs, named):
    with pytest.raises(ValueError, match=f"^{named}: expected"):
        encode_png(gradient_image(4, 4, "RGB"), **kwargs)


def test_bands_cover_the_rows_in_order_within_the_piece_limits():
    """Bands are contiguous and cover every row; a multi-band split keeps each band at least MIN_PIECE_BYTES (so a
    piece's dictionary, the previous piece's last 32 KiB, is always full) and at most MAX_PIECE_BYTES plus a row."""
    for height, row_bytes, threads in [(1, 10, 8), (1024, 4097, 1), (1024, 4097, 8), (1024, 4097, 64),
                                       (3, 10**6, 8), (4096, 12289, 2), (513, 22, 8)]:
        split = bands(height, row_bytes, threads)
        assert split[0][0] == 0 and split[-1][1] == height
        assert all(stop == next_start for (_, stop), (next_start, _) in zip(split, split[1:]))
        assert all(stop > start for start, stop in split)
        if len(split) > 1:
            sizes = [(stop - start) * row_bytes for start, stop in split]
            assert min(sizes) >= png_writer.MIN_PIECE_BYTES - row_bytes
            assert min(sizes) >= png_writer.WINDOW_BYTES
        assert max((stop - start) * row_bytes for start, stop in split) <= max(
            png_writer.MAX_PIECE_BYTES + row_bytes, row_bytes)
        assert len(split) <= max(threads, -(-height * row_bytes // png_writer.MAX_PIECE_BYTES))


def test_write_png_writes_the_encoded_bytes(tmp_path):
    image = gradient_image(40, 30, "RGBA")
    with open(tmp_path / "x.png", "wb") as file:
        write_png(file, image, 4, threads=2)
    assert (tmp_path / "x.png").read_bytes() == encode_png(image, 4, threads=2)


# -- text chunks (ComfyUI's "prompt" and "workflow") ---------------------------------------------------------------

COMFY_TEXT = {"prompt": json.dumps({"1": {"class_type": "KVGraphSampler", "inputs": {"seed": 7, "cfg": 1.0}}}),
              "workflow": json.dumps({"nodes": [{"id": 1, "type": "KVGraphSampler"}], "links": []})}
# Latin-1 beyond ASCII stays tEXt; a character outside Latin-1 makes that value iTXt (UTF-8).
MIXED_TEXT = {"Title": "café crème", "parameters": "a cat, 猫, ✓", "prompt": json.dumps("snow ❄", ensure_ascii=False)}


@pytest.mark.parametrize("text", [COMFY_TEXT, MIXED_TEXT], ids=["ascii-json", "non-latin-1"])
@pytest.mark.parametrize("mode", ["RGB", "RGBA"])
def test_text_reads_back_as_given_and_pixels_are_unchanged(text, mode):
    """PIL reads every keyword back with its exact value, in order, and the pixels are the input's; the file's
    pixel data is the same as without text (the text only adds chunks)."""
    image = gradient_image(300, 200, mode)
    data = encode_png(image, 4, threads=4, text=text)
    with Image.open(io.BytesIO(data)) as read:
        read.load()
        assert read.text == text and list(read.text) == list(text)
        assert np.array_equal(np.asarray(read), np.asarray(image))
    without = encode_png(image, 4, threads=4)
    assert [c for c in chunks(data) if c[0] not in (b"tEXt", b"iTXt")] == chunks(without)


@pytest.mark.parametrize("text", [COMFY_TEXT, MIXED_TEXT], ids=["ascii-json", "non-latin-1"])
def test_text_chunks_are_the_ones_pil_writes(text):
    """For the same text, the chunks (type and data, in order) are those PIL's `PngInfo.add_text` writes, placed
    right after IHDR as PIL places them on an image without other metadata."""
    image = gradient_image(64, 48, "RGB")
    ours, theirs = chunks(encode_png(image, 4, text=text)), chunks(pil_png(image, 4, text))
    text_kinds = (b"tEXt", b"iTXt")
    assert [c for c in ours if c[0] in text_kinds] == [c for c in theirs if c[0] in text_kinds]
    assert [kind for kind, _ in ours[:len(text) + 1]] == [kind for kind, _ in theirs[:len(text) + 1]]
    assert ours[0][0] == b"IHDR" and all(kind in text_kinds for kind, _ in ours[1:len(text) + 1])
    kinds = {kind for kind, _ in ours if kind in text_kinds}
    assert kinds == ({b"tEXt"} if text is COMFY_TEXT else {b"tEXt", b"iTXt"})


def test_text_on_an_image_pil_saves_is_pils_file():
    """An image the writer hands to PIL (a grey image here) gets the same text from PIL: the same bytes."""
    image = gradient_image(33, 17, "RGB").convert("L")
    assert encode_png(image, 4, text=MIXED_TEXT) == pil_png(image, 4, MIXED_TEXT)


@pytest.mark.parametrize("keyword", ["", "k" * 80, "a\0b", "猫", 7])
def test_bad_keywords_are_refused_naming_the_keyword(keyword):
    """PNG keywords are 1-79 Latin-1 characters without NUL; anything else is refused before any work, the error
    naming the keyword. 79 characters and Latin-1 beyond ASCII are accepted."""
    with pytest.raises(ValueError, match=re.escape(f"text keyword {keyword!r}: expected")):
        encode_png(gradient_image(4, 4, "RGB"), text={keyword: "value"})
    data = encode_png(gradient_image(4, 4, "RGB"), text={"k" * 79: "long", "Légende": "ok"})
    assert Image.open(io.BytesIO(data)).text == {"k" * 79: "long", "Légende": "ok"}


def test_a_value_that_is_not_a_string_is_refused_naming_its_keyword():
    with pytest.raises(ValueError, match=r"^text 'prompt': expected a str value, got dict"):
        encode_png(gradient_image(4, 4, "RGB"), text={"prompt": {"1": {}}})
