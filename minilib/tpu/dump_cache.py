"""libtpu's dumps of earlier compiles, kept on disk: a program compiled again, in a later run,
reads them back instead of compiling. Off unless `MINILIB_TPU_DUMP_CACHE` names a folder.

Compiling for a compile-only device is most of the TPU tests' time (a few seconds for a small
kernel, half a minute for a whole program), and a test run compiles the same few hundred
programs as the run before it. What a compile gives depends on what it is given: the program
with its debug information (each op's source line and call stack, which libtpu writes into
its dumps), the chip, jax, jaxlib, libtpu, and the flags of libtpu and XLA. `entry_key`
hashes all of them, so an entry is found only by the same compile. An entry holds what that
compile left: the compiled program's HLO text and every file libtpu dumped for it.
`compiled` writes a found entry's files back into the dump folder, where they are read as a
fresh compile's are: a figure read from the cache is the one libtpu gave.

The source paths are part of the debug information, so a checkout in another folder keeps
entries of its own: it reads none of this one's.

JAX's own persistent compilation cache cannot serve here: a compile it finds writes no dumps.
`tasks.py test` turns this on for its TPU lanes (a folder per venv under
`~/.cache/minilib/libtpu`, emptied after a run that did not finish). A compile that fails is
not kept, and an entry that cannot be read is compiled again.
"""

from __future__ import annotations

import gzip
import hashlib
import importlib.metadata
import json
import os
from pathlib import Path

import jax

from minilib.tpu.dump_reader import DUMP_FLAGS, libtpu_version

__all__ = ["CACHE_ENV", "entry_key", "keep", "read_back"]

CACHE_ENV = "MINILIB_TPU_DUMP_CACHE"


def cache_folder() -> Path | None:
    """The folder `CACHE_ENV` names, made if missing; None when it is unset or empty, or
    cannot be made (then nothing is kept: a cache is never why a compile fails)."""
    folder = os.environ.get(CACHE_ENV, "")
    if not folder:
        return None
    try:
        Path(folder).mkdir(parents=True, exist_ok=True)
    except OSError:
        return None
    return Path(folder)


def entry_key(chip: str, program_text: str) -> str:
    """The name of the entry of `program_text` (a lowered program's text) compiled for `chip`
    by this jax, jaxlib and libtpu with this process's flags.

    >>> key = entry_key("v5e", "module @add {}")
    >>> key == entry_key("v5e", "module @add {}"), key == entry_key("v6e", "module @add {}")
    (True, False)
    """
    given = [chip, jax.__version__, importlib.metadata.version("jaxlib"), libtpu_version(),
             os.environ.get("LIBTPU_INIT_ARGS", ""), *DUMP_FLAGS,
             os.environ.get("XLA_FLAGS", ""), program_text]  # fmt: skip
    return hashlib.sha256("\0".join(map(str, given)).encode()).hexdigest()


def keep(key: str, hlo: str, folder: Path, names: list[str]) -> None:
    """Keep the compiled program's `hlo` and the dump files `names` in `folder` under `key`;
    written whole or not at all (to a temporary file, then renamed). Nothing without
    `CACHE_ENV`.

    >>> import tempfile
    >>> folder = Path(tempfile.mkdtemp())
    >>> _ = (folder / "0001-add.1-00-final_bundles.txt").write_text("bundles")
    >>> os.environ[CACHE_ENV] = str(folder / "cache")
    >>> key = entry_key("v5e", "module @add {}")
    >>> keep(key, "HloModule add", folder, ["0001-add.1-00-final_bundles.txt"])
    >>> (folder / "0001-add.1-00-final_bundles.txt").unlink()
    >>> read_back(key, folder), (folder / "0001-add.1-00-final_bundles.txt").read_text()
    (('HloModule add', ['0001-add.1-00-final_bundles.txt']), 'bundles')
    >>> del os.environ[CACHE_ENV]
    """
    cache = cache_folder()
    if cache is None:
        return
    files = {name: (folder / name).read_text(errors="replace") for name in names}
    entry = cache / f"{key}.json.gz"
    tmp = entry.with_suffix(f".{os.getpid()}.tmp")
    try:
        tmp.write_bytes(gzip.compress(json.dumps({"hlo": hlo, "files": files}).encode(), 3))
        os.replace(tmp, entry)
    except OSError:  # a full disk, say: the compile stands, unkept
        pass
    finally:
        tmp.unlink(missing_ok=True)


def read_back(key: str, folder: Path) -> tuple[str, list[str]] | None:
    """The entry `key`'s HLO text and the names of its dump files, written back into
    `folder`; None when there is no such entry (or it cannot be read).

    >>> import tempfile
    >>> os.environ[CACHE_ENV] = tempfile.mkdtemp()
    >>> read_back(entry_key("v5e", "module @nothing_compiled {}"), Path(tempfile.mkdtemp()))
    >>> del os.environ[CACHE_ENV]
    """
    cache = cache_folder()
    entry = cache / f"{key}.json.gz" if cache else None
    if entry is None or not entry.exists():
        return None
    try:
        kept = json.loads(gzip.decompress(entry.read_bytes()))
    except (OSError, EOFError, ValueError):  # cut short or damaged: compiled again, kept anew
        return None
    for name, text in kept["files"].items():
        (folder / name).write_text(text)
    return kept["hlo"], sorted(kept["files"])


def compiled(chip: str, lowered, folder: Path) -> tuple[str, list[str]]:
    """Compile `lowered` (a `jax.stages.Lowered` for `chip`): the compiled program's HLO text
    and the names of the files libtpu dumped for it into `folder`. Read back instead when an
    earlier run kept this compile; kept when not. Needs libtpu: tests/tpu/test_tpu_dump_cache.py.
    """
    key, before = entry_key(chip, lowered.as_text(debug_info=True)), set(os.listdir(folder))
    if (kept := read_back(key, folder)) is not None:
        return kept
    hlo = lowered.compile().as_text()
    names = sorted(set(os.listdir(folder)) - before)
    keep(key, hlo, folder, names)
    return hlo, names
