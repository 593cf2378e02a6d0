"""A per-user cache of prepared weights folders, shared by the clones of one machine (like pip's wheel cache).

`attnlab prepare` converts packaged weights (GGUF, ONNX, CTranslate2) into safetensors folders and checks them: 20 to
60 s a model. A second clone on the same machine would repeat exactly that work. After a model is prepared and checked,
its finished folder is kept here under a key; before converting, an entry with the same key is put in place instead:
hard links when the cache and weights/ share a filesystem (no extra disk), else copies, through weights/<id>.tmp and
one rename, as a conversion does.

Where: ATTNLAB_WEIGHTS_CACHE (a folder, or `off`), else $XDG_CACHE_HOME/attnlab/weights, else
~/.cache/attnlab/weights. `make clean` leaves it; `rm -rf ~/.cache/attnlab` empties it.

The key is a SHA-256 over everything the folder's bytes can depend on: the model id, each source file's name, size
and SHA-256 (read once per preparation, shared with its prepared.json: models/preparing.SourceHashes; a lookup
happens only when weights/<id> is not already up to date), the installed
versions of the libraries the conversions use, the preparation code itself (CODE_FILES) and ATTNLAB_WEIGHTS_CACHE_SALT
(any text; a change of it is a miss). A change of any of them is a miss.

Entries are written whole (a temporary folder, then one rename; of two clones storing the same key at once, the
second discards its copy) and never modified: their files are read-only (0444), and so are weights/' links to them.
At most KEEP_PER_MODEL entries are kept per model id, the least recently used removed first. The cache is an
optimisation only: a cache that is absent, unreadable or unwritable is skipped with one line of log.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import time
from collections.abc import Callable, Iterable
from importlib import metadata
from pathlib import Path

from models.preparing import replace_folder, sha256_file  # the renames a conversion ends with; sources' hashes

ROOT = Path(__file__).resolve().parent.parent
# The repository's files whose change can change a prepared folder (what the conversions import from the checkout).
# models/probe.py gives gguf.py layer_facts, which uses nothing else of ours: the modules probe.py imports for the
# server's probe (models/hooks.py, edited often) are left out, so that their changes keep the cache.
CODE_FILES = ("attnlab_prepare.py", "models/gguf.py", "models/ctranslate2.py", "models/whisper_front.py",
              "models/probe.py", "models/preparing.py", "models/weights_cache.py")
# The libraries whose version can change a prepared folder's bytes or its check.
LIBRARIES = ("torch", "transformers", "safetensors", "tokenizers", "numpy", "gguf", "onnx", "onnxruntime",
             "ctranslate2")
KEEP_PER_MODEL = 2
KEY_FILE = ".cache-key.json"  # beside each entry (not inside it): what its key was made of, for a reader


def cache_root() -> Path | None:
    """The cache folder, or None when ATTNLAB_WEIGHTS_CACHE is `off`."""
    setting = os.environ.get("ATTNLAB_WEIGHTS_CACHE", "").strip()
    if setting.lower() == "off":
        return None
    if setting:
        return Path(setting).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "attnlab" / "weights"


def code_digest(files: Iterable[Path] | None = None) -> str:
    """SHA-256 over the preparation code's files (their repository paths and bytes)."""
    digest = hashlib.sha256()
    for path in files if files is not None else (ROOT / name for name in CODE_FILES):
        path = Path(path)
        digest.update(path.name.encode() + b"\0")
        digest.update(path.read_bytes() if path.is_file() else b"<absent>")
        digest.update(b"\0")
    return digest.hexdigest()


def library_versions() -> dict[str, str]:
    versions = {}
    for name in LIBRARIES:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = "absent"
    return versions


def key_inputs(model_id: str, sources: Iterable[Path], extra: object = None,
               sha256: Callable[[Path], str] = sha256_file) -> dict:
    """What a key is made of (stored beside the entry as KEY_FILE); `sha256`: a preparation's SourceHashes."""
    return {
        "model_id": model_id,
        "sources": [[Path(p).name, Path(p).stat().st_size, sha256(Path(p))] for p in sources],
        "libraries": library_versions(),
        "code": code_digest(),
        "salt": os.environ.get("ATTNLAB_WEIGHTS_CACHE_SALT", ""),
        "extra": extra,
    }


def make_key(inputs: dict) -> str:
    return hashlib.sha256(json.dumps(inputs, sort_keys=True).encode()).hexdigest()[:32]


def _link_or_copy(source: str, target: str) -> None:
    try:
        os.link(source, target)
    except OSError:  # another filesystem, or links refused: a copy
        shutil.copy2(source, target)


def _remove(folder: Path) -> None:
    """Out of sight by one rename first (a reader sees the entry whole or not at all), then deleted."""
    trash = folder.with_name(f".trash-{folder.name}-{os.getpid()}-{time.monotonic_ns()}")
    with contextlib.suppress(OSError):
        folder.rename(trash)
        shutil.rmtree(trash, ignore_errors=True)


class WeightsCache:
    """One model's lookups and stores; `log` takes one line."""

    def __init__(self, model_id: str, sources: Iterable[Path], log: Callable[[str], None], extra: object = None,
                 sha256: Callable[[Path], str] = sha256_file):
        started = time.time()
        self.model_id = model_id
        self.log = log
        self.root = cache_root()
        self.inputs = key_inputs(model_id, list(sources), extra, sha256) if self.root is not None else None
        self.key = make_key(self.inputs) if self.inputs is not None else None
        self.key_s = time.time() - started  # mostly the sources' SHA-256

    @property
    def entry(self) -> Path | None:
        return self.root / self.model_id / self.key if self.root is not None else None

    def restore(self, out: Path, record_update: dict) -> bool:
        """Put the entry for this key in place of `out` (through `out`.tmp and a rename), its prepared.json rewritten
        with this checkout's source stats (`record_update`: what the model's up-to-date check compares). False on a
        miss, or when the entry cannot be used (then the caller converts)."""
        entry = self.entry
        if entry is None or not (entry / "prepared.json").is_file():
            return False
        started = time.time()
        tmp = out.with_name(out.name + ".tmp")
        try:
            if tmp.exists():
                shutil.rmtree(tmp)
            shutil.copytree(entry, tmp, copy_function=_link_or_copy, ignore=shutil.ignore_patterns("prepared.json"))
            record = json.loads((entry / "prepared.json").read_text())
            (tmp / "prepared.json").write_text(json.dumps({**record, **record_update}, indent=2) + "\n")
            (tmp / "prepared.json").chmod(0o644)
            replace_folder(tmp, out)
            with contextlib.suppress(OSError):
                os.utime(entry)  # most recently used: kept longest
        except (OSError, ValueError) as exc:
            shutil.rmtree(tmp, ignore_errors=True)
            self.log(f"{self.model_id}: weights cache entry {entry} not usable ({exc}); converting")
            return False
        self.log(f"{self.model_id}: from cache ({entry}) in {time.time() - started:.2f} s "
                 f"(its key, with the sources' SHA-256: {self.key_s:.2f} s)")
        return True

    def store(self, out: Path, refresh: bool = False) -> None:
        """Keep the finished `out` as this key's entry (links; read-only), written whole; `refresh` (--force)
        replaces an entry already there. Never raises: a cache that cannot be written is skipped."""
        entry = self.entry
        if entry is None:
            return
        try:
            if entry.exists() and not refresh:
                return
            entry.parent.mkdir(parents=True, exist_ok=True)
            tmp = entry.with_name(f".tmp-{self.key}-{os.getpid()}")
            shutil.rmtree(tmp, ignore_errors=True)
            shutil.copytree(out, tmp, copy_function=_link_or_copy)
            for path in tmp.rglob("*"):
                if path.is_file():
                    path.chmod(0o444)  # also weights/' links: an edit there cannot change the cache
            os.utime(tmp)  # copytree gave it out's mtime; the pruning orders entries by their last use
            (entry.parent / f".{self.key}{KEY_FILE}").write_text(json.dumps(self.inputs, indent=2) + "\n")
            if refresh and entry.exists():
                _remove(entry)
            try:
                tmp.rename(entry)
            except OSError:  # another clone stored the same key meanwhile: theirs stays, ours goes
                shutil.rmtree(tmp, ignore_errors=True)
            self._prune()
        except OSError as exc:
            self.log(f"{self.model_id}: weights cache {self.root} not written ({exc.strerror or exc}); skipped")

    def _prune(self) -> None:
        """At most KEEP_PER_MODEL entries of this model, the least recently used removed first."""
        folder = self.root / self.model_id
        entries = sorted((p for p in folder.iterdir() if p.is_dir() and not p.name.startswith(".")),
                         key=lambda p: p.stat().st_mtime, reverse=True)
        for old in entries[KEEP_PER_MODEL:]:
            _remove(old)
            with contextlib.suppress(OSError):
                (folder / f".{old.name}{KEY_FILE}").unlink()


def weights_cache(model_id: str, sources: Iterable[Path], log: Callable[[str], None],
                  extra: object = None, sha256: Callable[[Path], str] = sha256_file) -> WeightsCache | None:
    """The cache for one model, or None when it is off or its key cannot be made (a source unreadable)."""
    try:
        return WeightsCache(model_id, sources, log, extra, sha256)
    except (OSError, RuntimeError) as exc:  # RuntimeError: no home folder to find (a container's user without one)
        log(f"{model_id}: weights cache skipped ({getattr(exc, 'strerror', None) or exc})")
        return None


def restore_or_convert(model_id: str, out: Path, sources: Iterable[Path], this_checkout: dict,
                       convert: Callable[[], None], log: Callable[[str], None], *, force: bool = False,
                       extra: object = None, sha256: Callable[[Path], str] = sha256_file) -> bool:
    """One preparation of `out` through the cache. Unless `force`, the entry for these sources is put in place
    (`this_checkout`: restore's record_update) and True returned; otherwise `convert()` makes, checks and installs
    `out`, which is then stored as the entry (`force` replaces one already there) and False returned. `sha256`: the
    preparation's SourceHashes, so that the key and the conversion's record read each source once."""
    cache = weights_cache(model_id, sources, log, extra, sha256)
    if not force and cache is not None and cache.restore(out, this_checkout):
        return True
    convert()
    if cache is not None:
        cache.store(out, refresh=force)
    return False
