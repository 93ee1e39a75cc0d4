"""Checkpoint files built byte by byte, with valid checksums, for tests of
what a reader does with contents that flor never writes."""
import struct

from flor import _core

MAGIC = b"\x89FLR\r\n\x1a\n"


def _a8(x):
    return (x + 7) & ~7


def _a64(x):
    return (x + 63) & ~63


def craft(meta: bytes, table: bytes = None, data: bytes = b"", n_blobs=0, n_entries=0,
          tag: bytes = None, sig: bytes = None, n_sources=0) -> bytes:
    """A version-2 file holding `meta` (a pickle) and `table`, every CRC right."""
    if table is None:
        table = struct.pack("<IIII", n_blobs, n_entries, n_sources, 0)
    hs = 192
    table_off = _a8(hs + len(meta))
    data_off = _a64(table_off + len(table))
    size = data_off + len(data)
    h = bytearray(hs)
    h[0:8] = MAGIC
    struct.pack_into("<IIQQQQQQQIIII", h, 8, 2, hs, size, hs, len(meta), table_off, len(table),
                     data_off, len(data), n_blobs, n_entries, _core.crc32c(meta),
                     _core.crc32c(table))
    struct.pack_into("<II", h, 88, (1 if tag else 0) | (2 if sig else 0), n_sources)
    if tag:
        h[96:128] = tag
    if sig:
        h[128:160] = sig
    reseal(h)
    out = bytearray(size)
    out[:hs] = h
    out[hs:hs + len(meta)] = meta
    out[table_off:table_off + len(table)] = table
    out[data_off:] = data
    return bytes(out)


def reseal(b):
    """Fix the header CRC of a version-1 or version-2 header in place."""
    n = 124 if struct.unpack_from("<I", b, 8)[0] == 1 else 188
    struct.pack_into("<I", b, n, _core.crc32c(bytes(b[:n])))


def fix_checksums(b: bytearray) -> bytearray:
    """Recompute the metadata, table and header CRCs of a (mutated) file."""
    meta_off, meta_len, table_off, table_len = struct.unpack_from("<QQQQ", b, 24)
    if meta_off + meta_len <= len(b) and table_off + table_len <= len(b):
        struct.pack_into("<II", b, 80, _core.crc32c(bytes(b[meta_off:meta_off + meta_len])),
                         _core.crc32c(bytes(b[table_off:table_off + table_len])))
    reseal(b)
    return b


def zero_blobs(b: bytearray) -> bytearray:
    """Zero the data of every blob a version-2 file holds itself, with their
    CRCs and content hashes in the table recomputed, then every section's
    CRC: damage no checksum catches."""
    table_off, table_len, data_off = struct.unpack_from("<QQQ", b, 40)
    n_blobs, _, n_sources = struct.unpack_from("<III", b, table_off)
    p = table_off + 16
    for _ in range(n_sources):
        p += _a8(2 + struct.unpack_from("<H", b, p)[0])
    for _ in range(n_blobs):
        offset, nbytes, _, source = struct.unpack_from("<QQII", b, p)
        if source == 0 and nbytes:
            at = data_off + offset
            b[at:at + nbytes] = bytes(nbytes)
            struct.pack_into("<I", b, p + 16, _core.crc32c(bytes(nbytes)))
            struct.pack_into("<Q", b, p + 24, _core.hash64(bytes(nbytes)))
        p += 32
    return fix_checksums(b)
