#!/usr/bin/env python3
"""The texts the demo, the scripts and the tests read: 233 State of the Union addresses (sotu/) and
Moby-Dick, all public domain, carried in the repository as data/texts.tar.xz (2.9 MB) and unpacked into
data/texts/ (gitignored, 12 MB). Python's standard library only.

    python3 scripts/texts.py            unpack (idempotent) and verify every file; prints the folder
    python3 scripts/texts.py pack SRC   rebuild the archive and data/texts.sha256 from SRC (maintainers)

Every file is checked against data/texts.sha256 (SHA-256), so a corrupt archive or an edited text fails
here instead of shifting a measured perplexity. The archive is deterministic (sorted names, mtime 0, uid 0),
so `pack` on the same texts gives the same bytes.
"""
import hashlib
import io
import lzma
import os
import shutil
import sys
import tarfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DATA = os.path.join(ROOT, "data")
ARCHIVE = os.path.join(DATA, "texts.tar.xz")
MANIFEST = os.path.join(DATA, "texts.sha256")
OUT = os.path.join(DATA, "texts")


def sha256(b):
    return hashlib.sha256(b).hexdigest()


def read_manifest():
    """{relative path: sha256} for every text, plus the archive's own entry."""
    want = {}
    with open(MANIFEST) as f:
        for line in f:
            if line.strip():
                digest, name = line.split(None, 1)
                want[name.strip()] = digest
    return want


def fail(msg):
    sys.exit(f"scripts/texts.py: {msg}")


def verify_folder(want):
    """Whether data/texts/ holds exactly the manifest's texts with their hashes."""
    for name, digest in want.items():
        if name == "texts.tar.xz":
            continue
        p = os.path.join(DATA, name)
        if not os.path.isfile(p):
            return False
        with open(p, "rb") as f:
            if sha256(f.read()) != digest:
                return False
    return True


def unpack():
    want = read_manifest()
    if verify_folder(want):
        print(OUT)
        return
    with open(ARCHIVE, "rb") as f:
        blob = f.read()
    if sha256(blob) != want.get("texts.tar.xz"):
        fail(f"{ARCHIVE} does not match its SHA-256 in {MANIFEST} (corrupt checkout?)")
    tmp = os.path.join(DATA, ".texts.partial")
    shutil.rmtree(tmp, ignore_errors=True)
    seen = set()
    with tarfile.open(fileobj=io.BytesIO(lzma.decompress(blob)), mode="r:") as t:
        for m in t:
            # Only the manifest's names, as regular files: nothing can land outside data/texts.
            if not m.isfile() or m.name not in want or m.name == "texts.tar.xz":
                fail(f"unexpected archive member {m.name!r}")
            b = t.extractfile(m).read()
            if sha256(b) != want[m.name]:
                fail(f"{m.name} in the archive does not match its SHA-256")
            dest = os.path.join(tmp, os.path.relpath(m.name, "texts"))
            os.makedirs(os.path.dirname(dest), exist_ok=True)
            with open(dest, "wb") as f:
                f.write(b)
            seen.add(m.name)
    missing = set(want) - seen - {"texts.tar.xz"}
    if missing:
        fail(f"the archive lacks {sorted(missing)[0]} (and {len(missing) - 1} more)")
    shutil.rmtree(OUT, ignore_errors=True)
    os.rename(tmp, OUT)
    print(f"unpacked {len(seen)} texts into {OUT}", file=sys.stderr)
    print(OUT)


def pack(src):
    names = sorted(
        os.path.relpath(os.path.join(d, f), src)
        for d, _, files in os.walk(src)
        for f in files
        if f.endswith(".txt")
    )
    buf = io.BytesIO()
    lines = []
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as t:
        for n in names:
            with open(os.path.join(src, n), "rb") as f:
                b = f.read()
            info = tarfile.TarInfo("texts/" + n)
            info.size, info.mtime, info.mode = len(b), 0, 0o644
            t.addfile(info, io.BytesIO(b))
            lines.append(f"{sha256(b)}  texts/{n}")
    blob = lzma.compress(buf.getvalue(), preset=9 | lzma.PRESET_EXTREME)
    os.makedirs(DATA, exist_ok=True)
    with open(ARCHIVE, "wb") as f:
        f.write(blob)
    with open(MANIFEST, "w") as f:
        f.write(f"{sha256(blob)}  texts.tar.xz\n" + "\n".join(lines) + "\n")
    print(f"{ARCHIVE}: {len(names)} texts, {len(blob)} bytes")


if __name__ == "__main__":
    if sys.argv[1:2] == ["pack"] and len(sys.argv) == 3:
        pack(sys.argv[2])
    elif len(sys.argv) == 1:
        unpack()
    else:
        fail("usage: scripts/texts.py [pack SRC]")
