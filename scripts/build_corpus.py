#!/usr/bin/env python3
"""Build the offline training corpus for the embedded default model.

Everything comes from what is installed on the machine that runs this script, so no network
access is needed:

* ``stdlib``: the Python source (``Lib/**/*.py``) of the running CPython, PSF-2.0. Test suites
  (``test/``, ``tests/``, ``idle_test/``) are left out: they are 21 of the 34 MB and mostly
  repetitive ``unittest`` assertions. Codec charmap tables are left out too (data, not code).
* ``site``: the ``.py`` files of a fixed allow-list of installed, permissively licensed packages
  (``PACKAGES`` below; their licence string is read from the installed metadata and written to
  the manifest). Vendored third-party folders and test folders are skipped, and each package is
  capped (``--max-package-mb``) by a deterministic hash order so that the biggest ones
  (transformers, torch, sympy, scipy) do not drown the rest.
* ``chat``: a small synthetic set in the tokenizer's ChatML format, made from train-split
  functions that have a docstring (user: the signature and first docstring line; assistant: the
  function's source), so that the chat markers the chat template emits are not unseen tokens.

The split is BY FILE and deterministic: a held-out file is a stdlib (non-test) file whose
``sha256("stdlib/" + relpath)`` falls in the lowest ``--heldout-permille`` buckets, taken in hash
order until ``--heldout-kb`` is reached. Held-out files (and exact copies of them anywhere) never
enter the train split or the tokenizer.

Outputs:
* ``src/pagedmoe/data/heldout.jsonl`` (committed): one JSON object per file,
  ``{"source", "path", "license", "text"}``.
* ``<build-dir>/train.jsonl`` (not committed): same format, the train split.
* ``.carry/corpus_manifest.json``: files and bytes per source with licences.

Usage: python scripts/build_corpus.py [--build-dir /tmp/pagedmoe_corpus]
"""
from __future__ import annotations

import argparse
import ast
import hashlib
import importlib.metadata as md
import json
import os
import re
import sys
import sysconfig
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

# Allow-list: (distribution name, top-level import folder, licence as the project states it).
# The licence column is what the model card reports; the metadata string is recorded beside it.
PACKAGES = [
    ("numpy", "numpy", "BSD-3-Clause"),
    ("scipy", "scipy", "BSD-3-Clause"),
    ("sympy", "sympy", "BSD-3-Clause"),
    ("mpmath", "mpmath", "BSD-3-Clause"),
    ("networkx", "networkx", "BSD-3-Clause"),
    ("torch", "torch", "BSD-3-Clause"),
    ("transformers", "transformers", "Apache-2.0"),
    ("huggingface_hub", "huggingface_hub", "Apache-2.0"),
    ("matplotlib", "matplotlib", "Matplotlib License (PSF-based)"),
    ("pip", "pip", "MIT"),
    ("setuptools", "setuptools", "MIT"),
    ("pygments", "pygments", "BSD-2-Clause"),
    ("jinja2", "jinja2", "BSD-3-Clause"),
    ("click", "click", "BSD-3-Clause"),
    ("flask", "flask", "BSD-3-Clause"),
    ("werkzeug", "werkzeug", "BSD-3-Clause"),
    ("rich", "rich", "MIT"),
    ("attrs", "attr", "MIT"),
    ("packaging", "packaging", "Apache-2.0 OR BSD-2-Clause"),
    ("ipython", "IPython", "BSD-3-Clause"),
    ("jedi", "jedi", "MIT"),
    ("parso", "parso", "MIT"),
    ("prompt_toolkit", "prompt_toolkit", "BSD-3-Clause"),
    ("fastapi", "fastapi", "MIT"),
    ("starlette", "starlette", "BSD-3-Clause"),
    ("pydantic", "pydantic", "MIT"),
    ("httpx", "httpx", "BSD-3-Clause"),
    ("anyio", "anyio", "MIT"),
    ("urllib3", "urllib3", "MIT"),
    ("requests", "requests", "Apache-2.0"),
    ("pyparsing", "pyparsing", "MIT"),
    ("fsspec", "fsspec", "BSD-3-Clause"),
    ("pytest", "_pytest", "MIT"),
]
SKIP_DIRS = {"test", "tests", "idle_test", "testing", "_vendor", "vendor", "_distutils", "__pycache__",
             "site-packages", "third_party", "_vendored"}
MAX_FILE_BYTES = 400_000


def sha(s: str) -> int:
    return int.from_bytes(hashlib.sha256(s.encode()).digest()[:8], "big")


def is_code_file(text: str) -> bool:
    """Rejects data-like files: codec charmap tables, minified/generated blobs."""
    if "decoding_table = (" in text or "### Decoding Table" in text:
        return False
    lines = text.splitlines() or [""]
    long_lines = sum(len(l) > 300 for l in lines)
    return long_lines <= 0.02 * len(lines) + 2


def walk_py(root: Path):
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in SKIP_DIRS and not d.startswith("."))
        for f in sorted(filenames):
            if f.endswith(".py") and not f.startswith("_sysconfigdata"):
                yield Path(dirpath) / f


def read_ok(path: Path) -> str | None:
    try:
        if path.stat().st_size > MAX_FILE_BYTES or path.stat().st_size < 64:
            return None
        text = path.read_text(encoding="utf-8")
    except (UnicodeDecodeError, OSError):
        return None
    return text if is_code_file(text) else None


def collect_stdlib():
    lib = Path(sysconfig.get_paths()["stdlib"])
    for p in walk_py(lib):
        text = read_ok(p)
        if text is not None:
            yield {"source": "stdlib", "path": str(p.relative_to(lib)),
                   "license": "PSF-2.0", "text": text}


def collect_package(dist: str, top: str, license_name: str, cap_bytes: int):
    purelib = Path(sysconfig.get_paths()["purelib"])
    root = purelib / top
    if not root.is_dir():
        print(f"  {dist}: not installed, skipped", file=sys.stderr)
        return []
    docs = []
    for p in walk_py(root):
        text = read_ok(p)
        if text is not None:
            rel = str(p.relative_to(purelib))
            docs.append({"source": dist, "path": rel, "license": license_name, "text": text})
    # Deterministic cap: keep files in hash order until the package's budget is spent.
    docs.sort(key=lambda d: sha(d["path"]))
    kept, total = [], 0
    for d in docs:
        n = len(d["text"].encode())
        if total + n > cap_bytes:
            continue
        kept.append(d)
        total += n
    return kept


def chat_examples(docs, max_bytes: int):
    """ChatML pairs from functions with docstrings (train split only)."""
    out, total = [], 0
    for d in sorted(docs, key=lambda d: sha("chat/" + d["path"])):
        try:
            tree = ast.parse(d["text"])
        except (SyntaxError, ValueError):
            continue
        for node in tree.body:
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            doc = ast.get_docstring(node)
            src = ast.get_source_segment(d["text"], node)
            if not doc or not src or not (200 <= len(src) <= 2500) or node.name.startswith("_"):
                continue
            first = doc.strip().splitlines()[0].strip()
            if len(first) < 15:
                continue
            args = ", ".join(a.arg for a in node.args.args)
            ask = f"Write a Python function `{node.name}({args})`: {first}"
            text = (f"<|im_start|>user\n{ask}<|im_end|>\n"
                    f"<|im_start|>assistant\n```python\n{src}\n```<|im_end|>\n")
            out.append({"source": "chat-synth", "path": f"{d['path']}::{node.name}",
                        "license": d["license"], "text": text})
            total += len(text)
            break  # at most one example per file keeps the set varied
        if total >= max_bytes:
            break
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--build-dir", default="/tmp/pagedmoe_corpus")
    ap.add_argument("--heldout-out", default=str(REPO / "src/pagedmoe/data/heldout.jsonl"))
    ap.add_argument("--manifest-out", default=str(REPO / ".carry/corpus_manifest.json"))
    ap.add_argument("--heldout-permille", type=int, default=40)
    ap.add_argument("--heldout-kb", type=int, default=300)
    ap.add_argument("--heldout-max-file-kb", type=int, default=40)
    ap.add_argument("--max-package-mb", type=float, default=18.0)
    ap.add_argument("--chat-mb", type=float, default=2.0)
    args = ap.parse_args()

    print(f"Python {sys.version.split()[0]}, stdlib at {sysconfig.get_paths()['stdlib']}")
    stdlib = list(collect_stdlib())
    print(f"stdlib: {len(stdlib)} files")

    # Held-out: stdlib files in the lowest hash buckets, in hash order, up to the byte budget.
    cands = sorted((d for d in stdlib if sha("stdlib/" + d["path"]) % 1000 < args.heldout_permille
                    and len(d["text"].encode()) <= args.heldout_max_file_kb * 1024),
                   key=lambda d: sha("stdlib/" + d["path"]))
    heldout, hb = [], 0
    for d in cands:
        n = len(d["text"].encode())
        if hb + n > args.heldout_kb * 1024:
            continue
        heldout.append(d)
        hb += n
    heldout_paths = {d["path"] for d in heldout}
    heldout_hashes = {hashlib.sha256(d["text"].encode()).hexdigest() for d in heldout}

    train = [d for d in stdlib if d["path"] not in heldout_paths]
    manifest = {"python": sys.version.split()[0], "sources": {}}
    for dist, top, lic in PACKAGES:
        docs = collect_package(dist, top, lic, int(args.max_package_mb * 2**20))
        try:
            meta = md.metadata(dist)
            version = meta["Version"]
            meta_lic = ((meta.get("License-Expression") or meta.get("License") or "").strip().splitlines() or [""])[0][:80]
        except md.PackageNotFoundError:
            version, meta_lic = None, None
        if docs:
            manifest["sources"][dist] = {"version": version, "license": lic, "metadata_license": meta_lic}
        train += docs

    # Exact-duplicate removal (vendored copies), and no copy of a held-out file in train.
    seen, deduped = set(heldout_hashes), []
    for d in train:
        h = hashlib.sha256(d["text"].encode()).hexdigest()
        if h not in seen:
            seen.add(h)
            deduped.append(d)
    train = deduped
    chat = chat_examples(train, int(args.chat_mb * 2**20))
    train += chat

    manifest["sources"]["stdlib"] = {"version": sys.version.split()[0], "license": "PSF-2.0",
                                     "metadata_license": "PSF-2.0"}
    manifest["sources"]["chat-synth"] = {"version": None,
                                         "license": "derived from the train split (licences of its files)",
                                         "metadata_license": None}
    for name, info in manifest["sources"].items():
        ds = [d for d in train if d["source"] == name]
        info["train_files"] = len(ds)
        info["train_bytes"] = sum(len(d["text"].encode()) for d in ds)
    manifest["heldout"] = {"files": len(heldout), "bytes": hb, "source": "stdlib",
                           "rule": f"sha256('stdlib/'+path) % 1000 < {args.heldout_permille}, "
                                   f"<= {args.heldout_max_file_kb} KB per file, hash order up to "
                                   f"{args.heldout_kb} KB"}
    manifest["train"] = {"files": len(train), "bytes": sum(len(d["text"].encode()) for d in train)}

    os.makedirs(args.build_dir, exist_ok=True)
    with open(os.path.join(args.build_dir, "train.jsonl"), "w") as f:
        for d in train:
            f.write(json.dumps(d) + "\n")
    os.makedirs(os.path.dirname(args.heldout_out), exist_ok=True)
    with open(args.heldout_out, "w") as f:
        for d in heldout:
            f.write(json.dumps(d) + "\n")
    os.makedirs(os.path.dirname(args.manifest_out), exist_ok=True)
    with open(args.manifest_out, "w") as f:
        json.dump(manifest, f, indent=1)

    for name, info in sorted(manifest["sources"].items(), key=lambda kv: -kv[1]["train_bytes"]):
        print(f"  {name:16} {info['train_files']:6d} files {info['train_bytes'] / 2**20:7.2f} MB  {info['license']}")
    print(f"train: {manifest['train']['files']} files, {manifest['train']['bytes'] / 2**20:.1f} MB")
    print(f"held-out: {len(heldout)} files, {hb / 1024:.0f} KB -> {args.heldout_out}")


if __name__ == "__main__":
    main()
