"""Which checkpoints may run code when they load.

A checkpoint's structure is a pickle, and a pickle can call anything.  So
flor unpickles a file in one of two ways:

- **safe** (the default of :func:`flor.load`): a restricted unpickler that
  admits only what flor itself writes for tensors and state dicts:
  containers, numbers, strings, flor's placeholders for tensors and arrays,
  torch dtypes, devices and sizes, and ``OrderedDict``/``defaultdict``.
  Anything else (numpy scalars included) raises :class:`UnsafeCheckpoint`.
  Every admitted callable builds its result from concrete arguments the
  pickle holds, so nothing it admits allocates beyond the file's size.
- **trusted**: the full unpickler.  ``flor.load(path, trusted=True)`` asks for
  it, and replay uses it for files whose signature verifies: every file flor
  writes carries an HMAC-SHA256 of its tag, metadata and tensor table (which
  holds each blob's CRC-32C, checked before the blob is used) under a
  per-user key kept outside the run store
  (``~/.config/flor/key``, mode 0600).  A file cannot declare itself
  trusted: only the key makes a signature, and the key never enters a
  checkpoint.
"""
from __future__ import annotations

import hashlib
import hmac
import io
import os
import pickle
import stat
import threading
import warnings

from . import _core
from .errors import FlorError

__all__ = ["UnsafeCheckpoint", "HookFailed", "Forged", "tag_of", "bound", "signer", "policy"]

KEY_BYTES = 32
_SIGN_CONTEXT = b"flor checkpoint v2\0"  # tag + metadata (files written before tables were signed)
_TABLE_CONTEXT = b"flor checkpoint v2 table\0"  # tag + metadata length + metadata + table


def _signature(key: bytes, tag, meta, table) -> bytes:
    if table is None:
        data = _SIGN_CONTEXT + (tag or b"") + bytes(meta)
    else:
        meta = bytes(meta)
        data = _TABLE_CONTEXT + (tag or b"") + len(meta).to_bytes(8, "little") + meta + \
            bytes(table)
    return hmac.new(key, data, hashlib.sha256).digest()


class UnsafeCheckpoint(pickle.UnpicklingError):
    """Safe loading refused a global that the checkpoint's metadata names
    (``global_name``, e.g. ``"posix.system"``)."""

    def __init__(self, message, global_name=""):
        super().__init__(message)
        self.global_name = global_name


def tag_of(*parts) -> bytes:
    """The 32-byte tag that says what a checkpoint is for (a block execution,
    an iteration), kept in its header so that a reader can check it before
    anything is unpickled."""
    h = hashlib.sha256(b"flor tag\0")
    for p in parts:
        h.update(str(p).encode("utf-8", "surrogatepass"))
        h.update(b"\0")
    return h.digest()


def bound(tag: bytes, run_id: str) -> bytes:
    """`tag` bound to the run that writes the checkpoint (a record's run id;
    its ranks share rank 0's): a file of another run, of the same script
    even, has another tag, and is refused before anything is unpickled."""
    return tag_of("run", run_id, tag.hex())


# -- the signing key ---------------------------------------------------------

def key_path() -> str:
    base = os.environ.get("XDG_CONFIG_HOME") or os.path.join(os.path.expanduser("~"), ".config")
    return os.path.join(base, "flor", "key")


_lock = threading.Lock()
_cached: dict = {}


def _read_key(path: str, create: bool):
    """The key's bytes; None if it is missing (and not created).  A key that
    others can read, or that belongs to someone else, is refused."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        if not create:
            return None
        os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
        key = os.urandom(KEY_BYTES)
        tmp = f"{path}.{os.getpid()}.tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        try:
            os.write(fd, key)
            os.fsync(fd)
        finally:
            os.close(fd)
        try:
            os.link(tmp, path)  # never replaces a key another process made
        except FileExistsError:
            pass
        finally:
            os.unlink(tmp)
        return _read_key(path, create=False)
    try:
        st = os.fstat(fd)
        if st.st_uid != os.geteuid() or st.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
            raise FlorError(
                f"flor's signing key {path} can be read or written by others (mode "
                f"{stat.S_IMODE(st.st_mode):o}, owner uid {st.st_uid}): checkpoints signed with "
                f"it prove nothing. Fix it with: chmod 600 {path} (or delete it to make a new "
                "key; checkpoints signed with the old one then load in safe mode)")
        key = os.read(fd, 4 * KEY_BYTES)
    finally:
        os.close(fd)
    if len(key) < KEY_BYTES:
        raise FlorError(f"flor's signing key {path} is shorter than {KEY_BYTES} bytes; "
                        "delete it to make a new one")
    return key


def signing_key(create: bool = False):
    """The user's key, or None where there is none (and create is False)."""
    path = key_path()
    with _lock:
        hit = _cached.get(path)
        if hit is None or (hit[1] is None and create):
            hit = (path, _read_key(path, create))
            _cached[path] = hit
        return hit[1]


def signer(create: bool = True, strict: bool = True):
    """sign(tag, meta) -> 32 bytes with the user's key, or None without one.
    A key that cannot be made or used raises, unless strict is False: then
    a warning says why, and files are written unsigned."""
    try:
        key = signing_key(create)
    except (OSError, FlorError) as e:
        if strict:
            raise
        warnings.warn(f"flor writes this checkpoint unsigned: {e}", stacklevel=3)
        return None
    if key is None:
        return None

    def sign(tag: bytes, meta, table) -> bytes:
        return _signature(key, tag, meta, table)

    return sign


def verifies(tag: bytes, sig: bytes, meta, table=None) -> bool:
    """Whether `sig` signs the tag, metadata and (where the file's signature
    covers it) tensor table with this user's key."""
    if not sig:
        return False
    key = signing_key(create=False)
    if key is None:
        return False
    return hmac.compare_digest(_signature(key, tag, meta, table), sig)


# -- safe unpickling ---------------------------------------------------------

# Types only (defaultdict factories, constructors of concrete arguments):
# no bytes/bytearray/range, which build large objects from one integer.
_SAFE = {
    "builtins": frozenset({"set", "frozenset", "list", "dict", "tuple", "int", "float", "str",
                           "bool"}),
    "collections": frozenset({"OrderedDict", "defaultdict"}),
    "flor._core": frozenset({"_rebuild"}),
    "flor.handles": frozenset({"Handle"}),  # a str and a dict of plain values
}
MAX_META_BYTES = 1 << 30


def _admitted(module: str, name: str) -> bool:
    return name in _SAFE.get(module, ())


class _SafeUnpickler(pickle.Unpickler):
    def __init__(self, data, path):
        super().__init__(io.BytesIO(data))
        self.path = path

    def find_class(self, module, name):
        if _admitted(module, name):
            return super().find_class(module, name)
        raise UnsafeCheckpoint(
            f"flor.load refused {self.path}: its metadata names the global {module}.{name}, "
            "which safe loading does not admit. Safe loading admits containers, numbers, "
            "strings, tensors, numpy arrays, and torch dtypes, devices and sizes. "
            "Loading it with flor.load(path, trusted=True) will likely succeed, but it runs "
            "whatever code the file names: do it only if you trust where the file came from.",
            f"{module}.{name}")


def _safe_loads(path):
    def loads(meta):
        if len(meta) > MAX_META_BYTES:
            raise _core.FormatError(path, "metadata", f"{len(meta)} bytes of metadata exceed "
                                    f"the {MAX_META_BYTES}-byte bound of safe loading")
        try:
            return _SafeUnpickler(meta, path).load()
        except (UnsafeCheckpoint, _core.FormatError, MemoryError, KeyboardInterrupt,
                HookFailed):
            raise
        except Exception as e:  # anything else is a malformed pickle
            raise _core.FormatError(path, "metadata",
                                    f"the pickle cannot be read: {e!r}") from None
    return loads


class HookFailed(Exception):
    """Carries an error of the caller's map_location hook through the
    unpickler unchanged."""


class Mismatch(FlorError):
    """The file's header tag says it belongs to something else."""


class Forged(FlorError):
    """A checkpoint of a run the user's key sealed, without a signature
    that verifies with that key: it changed after it was written."""


def policy(path: str, trusted: bool, expect_tag=None, seen=None, sealed=False):
    """The function _core.load calls, before anything is unpickled, with the
    file's version, tag, signature, metadata and (where the signature covers
    it) tensor table: returns the unpickler to use.

    trusted: True (full unpickler), False (safe), or "signed" (full where the
    signature verifies, safe otherwise).  expect_tag: refuse a file whose tag
    differs (Mismatch); a file without a tag is let through.  seen: a list
    that receives "trusted", "signed" or "safe", the way the file was read.
    sealed: this user's key signed the file's run (its seal verified), so a
    file without a signature that verifies changed after it was written: it
    is refused (Forged)."""
    def decide(version, tag, sig, meta, table=None):
        # An untagged file (format version 1, flor.save) is checked after
        # unpickling instead; unsigned, it is unpickled in safe mode.
        if expect_tag is not None and tag is not None and tag != expect_tag:
            raise Mismatch(f"{path} belongs to another run, block or iteration (its header "
                           "tag differs)")
        how = "safe"
        if trusted is True:
            how = "trusted"
        elif trusted == "signed" and verifies(tag, sig, meta, table):
            how = "signed"
        elif trusted == "signed" and sealed:
            what = "is signed, and its signature does not verify with the key that sealed its " \
                "run" if sig else "is not signed, though the key that sealed its run signs " \
                "every checkpoint the run writes"
            raise Forged(f"{path} {what}: it changed after the record wrote it (nothing of it "
                         "was unpickled)")
        if seen is not None:
            seen.append(how)
        return pickle.loads if how != "safe" else _safe_loads(path)
    return decide
