"""The output folder of tools/absorb.py: staged writes, a manifest of what the tool wrote, and
the commit that moves a verified checkpoint into place.

A run writes everything into a temporary folder `OUT_DIR/.absorb-tmp-*` (same file system, so
the commit is a rename per file) and moves it into OUT_DIR only after verification. The commit
also writes `OUT_DIR/openmla-absorb-manifest.json`: every file the run put there with its size
and modification time. A later run with --force removes exactly those files (refusing if one
changed since) before moving its own in, and refuses to write over, or next to, checkpoint
files it did not write. A temporary folder left by a run that was killed (SIGKILL, power loss)
is named in the next run's error instead of being kept or silently removed: another run may
still be writing into it.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import tempfile
from contextlib import contextmanager

from openmla.tools._checkpoint import CONFIG_NAME, AbsorbError

MANIFEST_NAME = "openmla-absorb-manifest.json"
TMP_PREFIX = ".absorb-tmp-"
_TOOL = "openmla tools/absorb.py"


def _stamp(path: str) -> list:
    """[size, mtime_ns] of a file or link (not followed): what 'unchanged since written' means."""
    st = os.lstat(path)
    return [st.st_size, st.st_mtime_ns]


def files_under(root: str) -> list:
    """Relative paths of every file and link under root (links to folders are not followed)."""
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        links = [d for d in dirnames if os.path.islink(os.path.join(dirpath, d))]
        dirnames[:] = [d for d in dirnames if d not in links]
        for fn in filenames + links:
            out.append(os.path.relpath(os.path.join(dirpath, fn), root))
    return sorted(out)


@contextmanager
def _signals_held():
    """SIGINT and SIGTERM wait (are delivered when the block ends): for the commit and the
    clean-up, which an interruption would leave half done."""
    if not hasattr(signal, "pthread_sigmask"):
        yield
        return
    old = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


def _is_checkpoint_file(name: str) -> bool:
    """Top-level names a loader reads as part of the checkpoint in a folder."""
    return name == CONFIG_NAME or name.endswith((".safetensors", ".safetensors.index.json"))


class OutDir:
    """OUT_DIR of one run. The constructor checks what is there (AbsorbError, nothing changed):
    not a file, not CHECKPOINT_DIR, no temporary folder of an unfinished run, empty unless
    force, and reads the manifest of an earlier run. check_targets() then checks the files the
    run will write against what is there; staged() yields the temporary folder and commits it."""

    def __init__(self, path: str, checkpoint_dir: str, force: bool):
        self.path, self.force = path, force
        self.existed = os.path.lexists(path)
        if self.existed and not os.path.isdir(path):
            raise AbsorbError(f"OUT_DIR {path}: exists and is not a directory")
        self.real = os.path.realpath(path)
        if os.path.realpath(checkpoint_dir) == self.real:
            raise AbsorbError("OUT_DIR is CHECKPOINT_DIR: write the absorbed checkpoint somewhere else")
        names = sorted(os.listdir(path)) if self.existed else []
        leftovers = [n for n in names if n.startswith(TMP_PREFIX)]
        if leftovers:
            raise AbsorbError(
                f"OUT_DIR {path}: holds {', '.join(leftovers)}, the unverified output of an absorb.py "
                "run that was killed or is still running; if none is running, remove it "
                f"(rm -r {os.path.join(path, leftovers[0])}) and run again")
        if names and not force:
            raise AbsorbError(f"OUT_DIR {path}: not empty (--force writes into it)")
        self.previous = self._read_manifest() if MANIFEST_NAME in names else {}

    def _read_manifest(self) -> dict:
        mpath = os.path.join(self.path, MANIFEST_NAME)
        try:
            with open(mpath) as f:
                m = json.load(f)
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise AbsorbError(f"{mpath}: unreadable ({e.__class__.__name__}); remove the files of the "
                              "earlier run by hand, or choose another OUT_DIR") from None
        files = m.get("files") if isinstance(m, dict) else None
        ok = isinstance(files, dict) and all(
            isinstance(rel, str) and not os.path.isabs(rel) and ".." not in rel.split(os.sep)
            and isinstance(st, list) and all(isinstance(s, list) and len(s) == 2
                                             and all(isinstance(x, int) for x in s) for s in st)
            for rel, st in files.items())
        if not ok:
            raise AbsorbError(f"{mpath}: not a manifest written by absorb.py (expected 'files': "
                              "{relative path: [[size, mtime_ns], ...]}); remove the files of the "
                              "earlier run by hand, or choose another OUT_DIR")
        return files

    def check_targets(self, planned) -> None:
        """AbsorbError unless the run may write the relative paths `planned` into OUT_DIR: every
        file the manifest lists that is still there is unchanged (it will be removed), and no
        planned path, parent folder of one or top-level checkpoint file (config.json,
        *.safetensors, *.safetensors.index.json) exists unless the manifest lists it."""
        if not self.existed:
            return
        ours = self.previous
        for rel, stamps in sorted(ours.items()):
            p = os.path.join(self.path, rel)
            if os.path.lexists(p) and (os.path.isdir(p) and not os.path.islink(p) or _stamp(p) not in stamps):
                raise AbsorbError(
                    f"OUT_DIR {self.path}: {rel} changed since absorb.py wrote it (size or time differ "
                    f"from {MANIFEST_NAME}); --force removes only files the tool wrote, unchanged: "
                    "move it away or remove it, then run again")
        theirs = set()
        for rel in planned:
            parts = rel.split("/")
            for k in range(1, len(parts) + 1):
                sub = "/".join(parts[:k])
                p = os.path.join(self.path, sub)
                last = k == len(parts)
                if os.path.lexists(p) and sub not in ours and (last or not os.path.isdir(p)):
                    theirs.add(sub)
        theirs |= {n for n in os.listdir(self.path) if _is_checkpoint_file(n) and n not in ours}
        if theirs:
            first = sorted(theirs)
            raise AbsorbError(
                f"OUT_DIR {self.path}: {', '.join(first[:5])}{' ...' if len(first) > 5 else ''} "
                f"{'was' if len(first) == 1 else 'were'} not written by absorb.py (not in "
                f"{MANIFEST_NAME}) and would be overwritten by or mixed with the new checkpoint: "
                "--force replaces only the tool's own files; move them away or choose another OUT_DIR")

    @contextmanager
    def staged(self):
        """Yield a new temporary folder inside OUT_DIR (made if missing). If the block completes,
        the commit replaces the earlier run's files with the temporary folder's; either way the
        temporary folder is removed, and so is OUT_DIR if this run made it and left it empty."""
        os.makedirs(self.path, exist_ok=True)
        tmp = tempfile.mkdtemp(prefix=TMP_PREFIX, dir=self.path)
        try:
            yield tmp
            with _signals_held():
                self._commit(tmp)
        finally:
            with _signals_held():
                shutil.rmtree(tmp, ignore_errors=True)
                if not self.existed:
                    try:
                        os.rmdir(self.path)  # only if empty: nothing was committed
                    except OSError:
                        pass

    def _write_manifest(self, files: dict, complete: bool) -> None:
        doc = {"tool": _TOOL, "complete": complete,
               "about": "the files absorb.py wrote into this folder, with [size, mtime_ns]; a rerun "
                        "with --force removes exactly these (when unchanged) before writing its own",
               "files": dict(sorted(files.items()))}
        part = os.path.join(self.path, MANIFEST_NAME + ".part")
        with open(part, "w") as f:
            json.dump(doc, f, indent=1)
            f.write("\n")
        os.replace(part, os.path.join(self.path, MANIFEST_NAME))

    def _commit(self, tmp: str) -> None:
        """Replace the earlier run's files by tmp's (staged() holds SIGINT/SIGTERM meanwhile, so
        OUT_DIR never holds half of each). The manifest written first lists the files of both
        runs, so that even a SIGKILL in between leaves every file the tool wrote listed for the
        next --force."""
        new = {rel: [_stamp(os.path.join(tmp, rel))] for rel in files_under(tmp)}
        union = {rel: list(st) for rel, st in self.previous.items()
                 if os.path.lexists(os.path.join(self.path, rel))}
        for rel, st in new.items():
            union[rel] = union.get(rel, []) + st
        self._write_manifest(union, complete=False)
        for rel in sorted(self.previous):
            p = os.path.join(self.path, rel)
            if os.path.lexists(p):
                os.remove(p)
                self._prune(os.path.dirname(rel))
        for rel in new:
            dst = os.path.join(self.path, rel)
            os.makedirs(os.path.dirname(dst), exist_ok=True)
            os.replace(os.path.join(tmp, rel), dst)
        self._write_manifest(new, complete=True)

    def _prune(self, rel_dir: str) -> None:
        """Remove rel_dir and its parents inside OUT_DIR while they are empty (never OUT_DIR)."""
        while rel_dir:
            try:
                os.rmdir(os.path.join(self.path, rel_dir))
            except OSError:
                return
            rel_dir = os.path.dirname(rel_dir)
