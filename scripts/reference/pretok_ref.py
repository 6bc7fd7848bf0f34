#!/usr/bin/python3
"""Independent pure-Python reference of a byte-level BPE tokenizer.json with the pre-tokenizers
Huginn-0125 and Ouro publish (Sequence, Split, Digits, ByteLevel), for the engine's tests.

Written from the Hugging Face `tokenizers` semantics (not from engine/src/pretokenizer.c), with
other means where it can: Python's `regex` module instead of PCRE2, unicodedata's categories for
Digits (Rust's char::is_numeric) instead of \\p{N}, list-of-strings pre-tokenization applied step
by step over all pieces instead of depth first, and GPT-2's classic "merge every occurrence of
the best pair" BPE instead of a heap. Needs only `regex` (no `tokenizers`, no network).

Usage:
  pretok_ref.py encode TOKENIZER_JSON TEXT...   ids of each TEXT, one line each
  pretok_ref.py fixtures OUT_DIR                (re)writes the test tokenizers and pretok.cases

The fixtures are small synthetic tokenizers (a BPE trained here on a built-in corpus) with the
published normalizer and pre_tokenizer settings; see engine/src/pretokenizer.c for where those
settings come from. pretok.cases holds the ids this reference computes; tests/c/test_pretokenizer.c
compares the engine's encode against them byte for byte.
"""
import json
import os
import sys
import unicodedata

import regex

GPT2_REGEX = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
# GPT-4's cl100k regex, as used by Dagan et al. (2024) / BPEasy; Huginn's own regex modifies it.
CL100K_REGEX = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}|"""
                r""" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+""")


def bytes_to_unicode():
    """GPT-2's byte -> printable character table."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAC + 1)) + list(range(0xAE, 0xFF + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


BYTE_CHAR = bytes_to_unicode()


# ----------------------------------------------------------------- pre-tokenizers

def find_matches(rx, s):
    """(start, end, is_match) spans covering s, as tokenizers' Pattern for a Regex: gaps and
    matches alternate; an empty match right at the end of the previous match is skipped by one
    character (the onig crate's find_iter)."""
    if s == "":
        return [(0, 0, False)]
    out, prev, last_end, last_match_end = [], 0, 0, None
    while last_end <= len(s):
        m = rx.search(s, last_end)
        if not m:
            break
        a, b = m.span()
        if a == b and last_match_end == last_end:
            last_end += 1
            continue
        last_end = last_match_end = b
        if prev != a:
            out.append((prev, a, False))
        out.append((a, b, True))
        prev = b
    if prev != len(s):
        out.append((prev, len(s), False))
    return out


def char_matches(pred, s):
    """tokenizers' Pattern for a char predicate: each matching char alone, runs of others."""
    out, last = [], 0
    for i, c in enumerate(s):
        if pred(c):
            if last < i:
                out.append((last, i, False))
            out.append((i, i + 1, True))
            last = i + 1
    if last < len(s):
        out.append((last, len(s), False))
    return out


def split_by(s, spans, behavior):
    """NormalizedString::split: spans (a, b, is_match) -> kept pieces (empty ones dropped)."""
    if behavior == "Removed":
        pieces = [(a, b) for a, b, m in spans if not m]
    elif behavior == "Isolated":
        pieces = [(a, b) for a, b, _ in spans]
    elif behavior == "Contiguous":
        pieces, prev = [], False
        for a, b, m in spans:
            if m == prev and pieces:
                pieces[-1] = (pieces[-1][0], b)
            else:
                pieces.append((a, b))
            prev = m
    elif behavior == "MergedWithPrevious":
        pieces, prev = [], False
        for a, b, m in spans:
            if m and not prev and pieces:
                pieces[-1] = (pieces[-1][0], b)
            else:
                pieces.append((a, b))
            prev = m
    elif behavior == "MergedWithNext":
        pieces, prev = [], False
        for a, b, m in reversed(spans):
            if m and not prev and pieces:
                pieces[-1] = (a, pieces[-1][1])
            else:
                pieces.append((a, b))
            prev = m
        pieces.reverse()
    else:
        raise ValueError("behavior " + behavior)
    return [s[a:b] for a, b in pieces if b > a]


def is_numeric(c):
    return unicodedata.category(c) in ("Nd", "Nl", "No")


def flatten(node):
    if node["type"] == "Sequence":
        return [s for c in node["pretokenizers"] for s in flatten(c)]
    return [node]


def pre_tokenize(text, node):
    """Pieces of text, each step applied to every piece before the next step; the ByteLevel
    step also maps each piece to the byte alphabet."""
    pieces = [text]
    for step in flatten(node):
        out = []
        for p in pieces:
            t = step["type"]
            if t == "Split":
                pat = step["pattern"]
                rx = regex.compile(pat["Regex"] if "Regex" in pat else regex.escape(pat["String"]))
                spans = find_matches(rx, p)
                if step.get("invert"):
                    spans = [(a, b, not m) for a, b, m in spans]
                out += split_by(p, spans, step["behavior"])
            elif t == "Digits":
                spans = char_matches(is_numeric, p)
                out += split_by(p, spans, "Isolated" if step.get("individual_digits") else "Contiguous")
            elif t == "ByteLevel":
                if step.get("add_prefix_space") and not p.startswith(" "):
                    p = " " + p
                subs = split_by(p, find_matches(regex.compile(GPT2_REGEX), p), "Isolated") \
                    if step.get("use_regex", True) else [p]
                out += ["".join(BYTE_CHAR[b] for b in q.encode("utf-8")) for q in subs]
            else:
                raise ValueError("pre-tokenizer " + t)
        pieces = [p for p in out if p]
    return pieces


# --------------------------------------------------------------------------- BPE

def bpe(word, ranks):
    """GPT-2's encoder.py: merge every occurrence of the lowest-ranked pair, left to right."""
    parts = list(word)
    while len(parts) > 1:
        pairs = [(ranks.get((parts[i], parts[i + 1]), None), i) for i in range(len(parts) - 1)]
        best = min((r for r, _ in pairs if r is not None), default=None)
        if best is None:
            break
        a, b = next((parts[i], parts[i + 1]) for r, i in pairs if r == best)
        merged, i = [], 0
        while i < len(parts):
            if i + 1 < len(parts) and parts[i] == a and parts[i + 1] == b:
                merged.append(a + b)
                i += 2
            else:
                merged.append(parts[i])
                i += 1
        parts = merged
    return parts


def encode(tok, text):
    vocab = tok["model"]["vocab"]
    ranks = {}
    for r, m in enumerate(tok["model"]["merges"]):
        a, b = m.split(" ") if isinstance(m, str) else m
        ranks[(a, b)] = r
    added = sorted(((t["content"], t["id"]) for t in tok.get("added_tokens") or []), key=lambda x: -len(x[0]))
    ids, start, i = [], 0, 0

    def plain(s):
        for piece in pre_tokenize(s, tok["pre_tokenizer"]):
            ids.extend(vocab[p] for p in bpe(piece, ranks))

    while i < len(text):  # added tokens: leftmost, then longest, literal matches
        hit = next(((c, t) for c, t in added if text.startswith(c, i)), None)
        if hit:
            if i > start:
                plain(text[start:i])
            ids.append(hit[1])
            i = start = i + len(hit[0])
        else:
            i += 1
    if start < len(text):
        plain(text[start:])
    return ids


# ---------------------------------------------------------------------- fixtures

CORPUS = """The quick brown fox jumps over the lazy dog. It's 2024; they'll say we've won 1,234,567 times!
I'M SURE YOU'RE RIGHT, DON'T WORRY. Numbers: 3.14159, 2.71828, 1000000, 42 and 007.
def tokenize(text):\n    return [t for t in text.split() if t]  # 4 spaces\n\tindented with a tab
\\frac{a}{b} + \\sqrt{x^2 + y^2} = $z$ \\\\ \\begin{align} x &= 1 \\end{align}
Café naïve résumé Ångström Straße Россия Українa Ελληνικά μάθημα
日本語のテキスト 中文文本测试 한국어 텍스트 emoji 😀👍🏽 ❤️ done.
   leading spaces, trailing spaces   \n\n\nnewlines\r\nwindows line\r\n
""" * 3

TEXTS = [
    "",
    "Hello world",
    "The quick brown fox jumps over the lazy dog.",
    "It's 2024; they'll say we've won 1,234,567 times!",
    "I'M SURE YOU'RE RIGHT, DON'T WORRY. 'Twas 'S 'LL",
    "3.14159 and 1000000 and 007 and 12345678901234567890",
    "x1y22z333w4444",
    "   leading and trailing   ",
    "a  b   c    d\t\te\n\nf",
    "\n\n\nnewlines\r\nwindows\r\n\r\n",
    " \n \n  x",
    "def tokenize(text):\n    return [t for t in text.split() if t]\n",
    "\\frac{a}{b} + \\sqrt{x^2 + y^2} = $z$ \\\\ {{{}}} ????///",
    "Café naïve résumé Ångström Straße",
    "Россия и Українa, Ελληνικά",
    "日本語のテキストとカタカナ 中文文本测试 한국어",
    "emoji 😀👍🏽🇺🇸 ❤️ and ZWJ 👨‍👩‍👧",
    "Punctuation!!! ??? ... --- (parens) [brackets] <angle>",
    "Roman Ⅻ and ½ ¾ and ² ³ and ١٢٣ and ৪৫",
    "tabs\tand\vvertical\fform feed",
    "nbsp\u00a0here and\u2003em space and\u3000ideographic",
    "<|endoftext|>Hello<|im_start|>user\nHi 42<|im_end|>",
    "<|begin_text|>Huginn<|end_text|> 123<|begin_text|>",
    "a-b--c---d",
    "xxaxxbxx",
    "   ",
    "9",
    "a\x1c\x1db \x1f c",
    "IT'\u017f and '\u212a done",
    "\u0085next line\u2028ls\u2029ps",
    "\ufeffbom",
    # Not here: U+180E, which PCRE2 10.42 counts as \s and Python's regex (like Oniguruma) not.
]


def byte_level_train(pretok_node, n_merges):
    """Classic BPE training on CORPUS: most frequent pair (ties: smallest pair) becomes the
    next merge."""
    counts = {}
    for piece in pre_tokenize(CORPUS, pretok_node):
        counts[piece] = counts.get(piece, 0) + 1
    words = {w: list(w) for w in counts}
    merges = []
    for _ in range(n_merges):
        pairs = {}
        for w, parts in words.items():
            for a, b in zip(parts, parts[1:]):
                pairs[(a, b)] = pairs.get((a, b), 0) + counts[w]
        if not pairs:
            break
        best = min(pairs, key=lambda p: (-pairs[p], p))
        merges.append(best)
        for w, parts in words.items():
            out, i = [], 0
            while i < len(parts):
                if i + 1 < len(parts) and (parts[i], parts[i + 1]) == best:
                    out.append(parts[i] + parts[i + 1])
                    i += 2
                else:
                    out.append(parts[i])
                    i += 1
            words[w] = out
    return merges


def make_tokenizer(pretok_node, specials, specials_first, n_merges=300):
    merges = byte_level_train(pretok_node, n_merges)
    vocab, added = {}, []
    if specials_first:
        for s in specials:
            vocab[s] = len(vocab)
    for b in range(256):
        vocab[BYTE_CHAR[b]] = len(vocab)
    for a, b in merges:
        vocab.setdefault(a + b, len(vocab))
    if not specials_first:
        for s in specials:
            vocab[s] = len(vocab)
    for s in specials:
        added.append({"id": vocab[s], "content": s, "single_word": False, "lstrip": False, "rstrip": False,
                      "normalized": False, "special": True})
    return {
        "version": "1.0", "truncation": None, "padding": None, "added_tokens": added,
        "normalizer": None, "pre_tokenizer": pretok_node, "post_processor": None,
        "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True},
        "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                  "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
                  "vocab": vocab, "merges": [a + " " + b for a, b in merges]},
    }


def byte_level(prefix=False, use_regex=True):
    return {"type": "ByteLevel", "add_prefix_space": prefix, "trim_offsets": True, "use_regex": use_regex}


def split(pattern, behavior, invert=False, literal=False):
    return {"type": "Split", "pattern": {"String" if literal else "Regex": pattern}, "behavior": behavior,
            "invert": invert}


# Ouro = SmolLM2; Huginn = BPEasy's conversion (regex: see CL100K_REGEX).
OURO = {"type": "Sequence", "pretokenizers": [{"type": "Digits", "individual_digits": True}, byte_level()]}
HUGINN = {"type": "Sequence", "pretokenizers": [split(CL100K_REGEX, "Isolated"), byte_level(use_regex=False)]}
# Every other behaviour, invert, String patterns, empty matches, contiguous Digits, nesting and a
# per-piece prefix space; these reuse Huginn's vocabulary (any byte-level vocabulary fits, and this
# one has multi-digit tokens, so Digits' two modes give different ids).
VARIANTS = {
    "digits_individual": {"type": "Sequence", "pretokenizers": [{"type": "Digits", "individual_digits": True},
                                                                byte_level()]},
    "removed": {"type": "Sequence", "pretokenizers": [split(r"\s+", "Removed"), byte_level()]},
    "merged_prev": {"type": "Sequence", "pretokenizers": [split("-", "MergedWithPrevious", literal=True),
                                                          byte_level(use_regex=False)]},
    "merged_next": {"type": "Sequence", "pretokenizers": [split(r"[ \n]+", "MergedWithNext"), byte_level(use_regex=False)]},
    "contiguous": {"type": "Sequence", "pretokenizers": [split(r"[aeiou]", "Contiguous"), byte_level(use_regex=False)]},
    "inverted": {"type": "Sequence", "pretokenizers": [split(r"\p{L}+", "Isolated", invert=True),
                                                       byte_level(use_regex=False)]},
    "inverted_removed": {"type": "Sequence", "pretokenizers": [split(r"\p{L}+", "Removed", invert=True),
                                                               byte_level(use_regex=False)]},
    "empty_matches": {"type": "Sequence", "pretokenizers": [split(r"x*", "Isolated"), byte_level(use_regex=False)]},
    "digits_runs_prefix": {"type": "Sequence", "pretokenizers": [
        {"type": "Sequence", "pretokenizers": [{"type": "Digits", "individual_digits": False}]},
        split(r"\s+", "MergedWithNext"), byte_level(prefix=True)]},
}


def escape(s):
    out = []
    for ch in s:
        c = ord(ch)
        if ch == "\\":
            out.append("\\\\")
        elif ch == "\n":
            out.append("\\n")
        elif ch == "\t":
            out.append("\\t")
        elif ch == "\r":
            out.append("\\r")
        elif c < 0x20 or c == 0x7f:
            out.append("\\x%02x" % c)
        else:
            out.append(ch)
    return "".join(out)


def write_fixtures(out_dir):
    os.makedirs(out_dir, exist_ok=True)
    toks = {"huginn": make_tokenizer(HUGINN, ["<|begin_text|>", "<|end_text|>", "<|pad|>"], False),
            "ouro": make_tokenizer(OURO, ["<|endoftext|>", "<|im_start|>", "<|im_end|>"], True)}
    for name, node in VARIANTS.items():
        t = dict(toks["huginn"])
        t["pre_tokenizer"] = node
        t["model"] = dict(t["model"], merges=t["model"]["merges"][:120])  # small files suffice
        toks[name] = t
    lines = ["# Generated by scripts/reference/pretok_ref.py fixtures (do not edit). Sections",
             "# '@ FILE' select a tokenizer in this folder; each case is the input with C escapes",
             "# (\\n \\t \\r \\\\ \\xNN), a TAB, then the reference ids separated by spaces."]
    for name, tok in toks.items():
        fn = name + ".json"
        with open(os.path.join(out_dir, fn), "w", encoding="utf-8") as f:
            json.dump(tok, f, ensure_ascii=False, indent=1)
            f.write("\n")
        lines.append("@ " + fn)
        for text in TEXTS:
            lines.append(escape(text) + "\t" + " ".join(str(i) for i in encode(tok, text)))
    with open(os.path.join(out_dir, "pretok.cases"), "w", encoding="utf-8") as f:
        f.write("\n".join(lines) + "\n")


def main(argv):
    if len(argv) >= 3 and argv[1] == "encode":
        with open(argv[2], encoding="utf-8") as f:
            tok = json.load(f)
        for text in argv[3:]:
            print(" ".join(str(i) for i in encode(tok, text)))
    elif len(argv) == 3 and argv[1] == "fixtures":
        write_fixtures(argv[2])
    else:
        sys.stderr.write(__doc__)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
