#!/usr/bin/python3
"""Builds the English training corpus from Debian packages (TRAINING-NOTES.md).

Sources
- The six Jane Austen novels in `r-cran-janeaustenr`, extracted with Rscript
  (`library(janeaustenr); austen_books()`).
- The English fortune files of `fortunes` and `fortunes-min` (the files those two packages
  install under /usr/share/games/fortunes; `.dat` indexes and `.u8` links skipped, and also
  `ascii-art` (drawings, not text) and `translate-me` (Latin and other non-English lines).
  Offensive fortunes live in `fortunes-off`, which is never used.

Normalisation (minimal; the text is kept as is otherwise)
- Austen: lines are stripped and the lines of a paragraph joined with one space; paragraphs are
  separated by a blank line ("\\n\\n"). A document is a chapter: a new one starts at a
  "CHAPTER x" / "Chapter x" / "VOLUME x" heading (a heading right after a heading stays in the
  same document), the title lines go with the first chapter.
- Fortunes: one document per fortune (entries separated by "%" lines). Terminal overstriking is
  applied (a backspace deletes the character before it: "___\\b\\b\\bnot" -> "not"), trailing
  spaces are stripped from lines, leading/trailing blank lines dropped; everything else (tabs,
  line breaks, the odd mojibake) is kept.

Split: the last ~3% (by characters, at paragraph / fortune boundaries) of each book and each
fortune file go to validation; a file too small to spare a whole entry stays in train.

Output (in --out, default build/corpus): train.txt and val.txt, UTF-8, each document followed by
the line "<|endoftext|>" (i.e. documents are joined by "\\n<|endoftext|>\\n"; read them back
with `read_docs`), and sources.txt (package names and versions from dpkg-query, files used,
sizes). The output is a pure function of the installed packages: running it again rewrites the
same bytes. Missing packages are installed with apt-get (needs root).
"""
import argparse
import hashlib
import os
import re
import subprocess
import sys
import tempfile

PACKAGES = ["r-base-core", "r-cran-janeaustenr", "fortunes", "fortunes-min"]
FORTUNE_PACKAGES = ["fortunes", "fortunes-min"]
FORTUNE_DIR = "/usr/share/games/fortunes/"
FORTUNE_SKIP = {"ascii-art": "drawings, not prose", "translate-me": "Latin / non-English"}
EOT = "<|endoftext|>"
DOC_END = "\n" + EOT + "\n"
VAL_FRACTION = 0.03
HEADING = re.compile(r"^(CHAPTER|Chapter|VOLUME) [IVXLC0-9]+\.?$")

R_EXTRACT = r'''
library(janeaustenr)
b <- austen_books()
out <- commandArgs(trailingOnly = TRUE)[1]
i <- 0
for (k in levels(b$book)) {
  i <- i + 1
  con <- file(file.path(out, sprintf("%d.txt", i)), "wb")
  writeLines(enc2utf8(k), con, useBytes = TRUE)
  writeLines(enc2utf8(as.character(b$text[b$book == k])), con, useBytes = TRUE)
  close(con)
}
cat(R.version.string, "\n")
'''


def read_docs(path):
    """train.txt / val.txt -> list of documents (strings without the separator)."""
    with open(path, encoding="utf-8") as f:
        text = f.read()
    if not text:
        return []
    if not text.endswith(DOC_END):
        raise ValueError(f"{path}: does not end with the document separator")
    return text[:-len(DOC_END)].split(DOC_END)


def dir_problem(path):
    """Why `path` is not, and cannot be made, a directory we can write in; None when it is or
    can. The training scripts check their --out with it before minutes of work, not at the end."""
    p = os.path.abspath(path)
    while not os.path.lexists(p):  # makedirs would create the rest
        p = os.path.dirname(p)
    shown = p if os.path.isabs(path) else os.path.relpath(p)
    if not os.path.isdir(p):
        return f"{shown} is not a directory"
    try:
        tempfile.TemporaryFile(dir=p).close()
    except OSError as e:
        return f"cannot write in {shown} ({e.strerror})"
    return None


def dpkg_versions(pkgs):
    out = {}
    for p in pkgs:
        r = subprocess.run(["dpkg-query", "-W", "-f=${Status}\t${Version}", p],
                           capture_output=True, text=True)
        if r.returncode == 0 and r.stdout.startswith("install ok installed"):
            out[p] = r.stdout.split("\t", 1)[1]
    return out


def ensure_packages():
    have = dpkg_versions(PACKAGES)
    missing = [p for p in PACKAGES if p not in have]
    if not missing:
        return
    print(f"corpus: installing {' '.join(missing)} with apt-get", flush=True)
    if os.geteuid() != 0:
        sys.exit(f"corpus: missing Debian packages {missing}; run as root or "
                 f"`apt-get install --no-install-recommends {' '.join(missing)}`")
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    cmd = ["apt-get", "install", "-y", "-q", "--no-install-recommends"] + missing
    if subprocess.run(cmd, env=env).returncode != 0:
        subprocess.run(["apt-get", "update", "-q"], env=env, check=True)
        subprocess.run(cmd, env=env, check=True)


def split_tail(units, fraction=VAL_FRACTION):
    """units: list of strings -> (train units, val units); val = the shortest tail holding at
    least `fraction` of the characters, never the whole list."""
    total = sum(len(u) for u in units)
    acc, k = 0, len(units)
    while k > 0 and acc < fraction * total:
        k -= 1
        acc += len(units[k])
    if k == 0:
        return units, []
    return units[:k], units[k:]


# ------------------------------------------------------------------------------- Austen

def austen_paragraphs(lines):
    paras, cur = [], []
    for line in lines:
        line = line.strip()
        if line:
            cur.append(line)
        elif cur:
            paras.append(" ".join(cur))
            cur = []
    if cur:
        paras.append(" ".join(cur))
    return paras


def austen_docs(paras):
    """Paragraphs -> chapters (lists of paragraphs)."""
    docs, cur, seen_heading, cur_has_text = [], [], False, False
    for p in paras:
        if HEADING.match(p):
            if cur_has_text:
                docs.append(cur)
                cur, cur_has_text = [], False
            seen_heading = True
        elif seen_heading:  # the front matter (title lines) stays with the first chapter
            cur_has_text = True
        cur.append(p)
    if cur:
        docs.append(cur)
    return docs


def paragraphs_to_docs(tagged):
    """[(doc_index, paragraph)] -> list of document strings (paragraphs joined by a blank line)."""
    docs, last = [], None
    for i, p in tagged:
        if i != last:
            docs.append([])
            last = i
        docs[-1].append(p)
    return ["\n\n".join(d) for d in docs]


def extract_austen(tmp):
    r = subprocess.run(["Rscript", "-e", R_EXTRACT, tmp], capture_output=True, text=True)
    if r.returncode != 0:
        sys.exit(f"corpus: Rscript failed:\n{r.stderr}")
    r_version = r.stdout.strip()
    books = []
    for i in range(1, 7):
        with open(os.path.join(tmp, f"{i}.txt"), encoding="utf-8") as f:
            lines = f.read().split("\n")
        title, lines = lines[0], lines[1:]
        books.append((title, lines))
    if len(books) != 6 or os.path.exists(os.path.join(tmp, "7.txt")):
        sys.exit("corpus: expected exactly six Austen books")
    return books, r_version


# ------------------------------------------------------------------------------- fortunes

def overstrike(text):
    out = []
    for ch in text:
        if ch == "\b":
            if out and out[-1] != "\n":
                out.pop()
        else:
            out.append(ch)
    return "".join(out)


def fortune_entries(text):
    entries, cur = [], []
    for line in text.split("\n") + ["%"]:
        if line.rstrip() == "%":
            while cur and not cur[0].strip():
                cur.pop(0)
            while cur and not cur[-1].strip():
                cur.pop()
            if cur:
                entries.append("\n".join(cur))
            cur = []
        else:
            cur.append(line.rstrip())
    return entries


def fortune_files():
    files = set()
    for p in FORTUNE_PACKAGES:
        r = subprocess.run(["dpkg", "-L", p], capture_output=True, text=True, check=True)
        for path in r.stdout.split("\n"):
            if (path.startswith(FORTUNE_DIR) and path.count("/") == FORTUNE_DIR.count("/")
                    and not path.endswith((".dat", ".u8")) and os.path.isfile(path)
                    and not os.path.islink(path)):
                files.add(path)
    return sorted(files)


def sha256(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        h.update(f.read())
    return h.hexdigest()


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0], allow_abbrev=False)
    ap.add_argument("--out", default="build/corpus", help="output directory")
    ap.add_argument("--no-install", action="store_true", help="never call apt-get")
    args = ap.parse_args()
    why = dir_problem(args.out)
    if why:
        ap.error(f"--out {args.out}: {why}")

    if not args.no_install:
        ensure_packages()
    versions = dpkg_versions(PACKAGES)
    missing = [p for p in PACKAGES if p not in versions]
    if missing:
        sys.exit(f"corpus: missing Debian packages: {missing}")

    train, val, rows = [], [], []
    with tempfile.TemporaryDirectory(prefix="tinyloop-corpus-") as tmp:
        books, r_version = extract_austen(tmp)
    for title, lines in books:
        docs = austen_docs(austen_paragraphs(lines))
        tagged = [(i, p) for i, d in enumerate(docs) for p in d]
        tr, va = split_tail(tagged)
        train += paragraphs_to_docs(tr)
        val += paragraphs_to_docs(va)
        rows.append((f"janeaustenr::austen_books() \"{title}\"", "r-cran-janeaustenr",
                     sum(len(p) for _, p in tr), sum(len(p) for _, p in va), len(docs)))

    skipped = []
    for path in fortune_files():
        name = os.path.basename(path)
        if name in FORTUNE_SKIP:
            skipped.append((path, FORTUNE_SKIP[name]))
            continue
        with open(path, encoding="utf-8") as f:
            entries = fortune_entries(overstrike(f.read()))
        tr, va = split_tail(entries)
        train += tr
        val += va
        owner = subprocess.run(["dpkg", "-S", path], capture_output=True, text=True,
                               check=True).stdout.split(":")[0]
        rows.append((path, owner, sum(map(len, tr)), sum(map(len, va)), len(entries)))

    for d in train + val:
        if EOT in d or not d:
            sys.exit("corpus: a document is empty or contains the separator token")

    os.makedirs(args.out, exist_ok=True)
    outputs = {}
    for name, docs in (("train.txt", train), ("val.txt", val)):
        path = os.path.join(args.out, name)
        with open(path + ".tmp", "w", encoding="utf-8", newline="\n") as f:
            f.write("".join(d + DOC_END for d in docs))
        os.replace(path + ".tmp", path)
        outputs[name] = (len(docs), sum(map(len, docs)), sha256(path))

    lines = ["# TinyLoop training corpus: sources (written by scripts/train/corpus.py)", "",
             "## Debian packages (dpkg-query -W)"]
    lines += [f"{p}\t{versions[p]}" for p in PACKAGES]
    lines += ["", f"R: {r_version}", "",
              "## Files (source, package, train chars, val chars, documents)"]
    lines += [f"{src}\t{pkg}\t{a}\t{b}\t{n}" for src, pkg, a, b, n in rows]
    lines += ["", "## Skipped fortune files"]
    lines += [f"{p}\t{why}" for p, why in skipped]
    lines += ["", "## Outputs (documents, characters, sha256)"]
    lines += [f"{k}\t{n}\t{c}\t{h}" for k, (n, c, h) in outputs.items()]
    with open(os.path.join(args.out, "sources.txt"), "w") as f:
        f.write("\n".join(lines) + "\n")

    for k, (n, c, _) in outputs.items():
        print(f"corpus: {os.path.join(args.out, k)}: {n} documents, {c} characters")


if __name__ == "__main__":
    main()
