#!/usr/bin/python3
"""Learns a GPT-2-style byte-level BPE on the training corpus and writes a Hugging Face
tokenizer.json that the engine's tokenizer (engine/src/tokenizer.c) and HF `tokenizers` load.

    scripts/train/bpe.py [--corpus build/corpus/train.txt] [--out build/corpus/tokenizer.json]
                         [--vocab-size 4096]

Layout of the vocabulary (vocab_size = V, default 4096):
- ids 0..255: the 256 single bytes, id = byte value, spelled with GPT-2's bytes_to_unicode map
  ("Ġ" is the space byte 0x20, "Ċ" the newline 0x0A), so every byte string can be encoded;
- ids 256..V-2: the merge results in merge order (V - 257 merges, one more for each merge that
  rebuilds an already known spelling from another split; the merges list keeps those too);
- id V-1: "<|endoftext|>", an added special token (also in model.vocab, as in GPT-2's file).
  It separates documents in the training token stream and serves as BOS and EOS.

Pre-tokenisation is GPT-2's regex, run with the `regex` module (Debian `python3-regex`), which
has the \\p{L} / \\p{N} classes that Python's `re` lacks; it is the same pattern the engine runs
with PCRE2 (UCP). The `regex` module is required: an approximation with `unicodedata` would
silently split differently from the engine, so none is attempted. Merges never cross
pre-token boundaries, and "<|endoftext|>" never enters training (documents are read apart).

Training: classic BPE on the pre-token counts; at each step the most frequent adjacent pair is
merged; ties are broken by the pair's spelling (smallest (left, right) string pair first), so the
result depends only on the corpus: the same input gives the same file byte for byte. Pair counts
are updated incrementally (only words containing the merged pair are revisited), which takes
well under a minute on the ~6 M character corpus.

The module also provides `Tokenizer`, a small exact encoder/decoder for tokenizer.json files of
this shape, used by train.py and eval.py (so Python and the engine see the same ids).
"""
import argparse
import collections
import hashlib
import heapq
import json
import os
import sys
import time

try:
    import regex
except ImportError:  # pragma: no cover
    sys.exit("bpe.py needs the `regex` module: apt-get install python3-regex")

GPT2_PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
PRETOKENIZE = regex.compile(GPT2_PATTERN)
EOT = "<|endoftext|>"
HERE = os.path.dirname(os.path.abspath(__file__))


def bytes_to_unicode():
    """GPT-2's reversible byte -> printable unicode character map."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) \
        + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


BYTE_TO_CHAR = bytes_to_unicode()
CHAR_TO_BYTE = {c: b for b, c in BYTE_TO_CHAR.items()}


def spell(text):
    """text -> its byte-level spelling (one character per UTF-8 byte)."""
    return "".join(BYTE_TO_CHAR[b] for b in text.encode("utf-8"))


# ------------------------------------------------------------------------------- training

def count_words(docs):
    counts = collections.Counter()
    for d in docs:
        counts.update(PRETOKENIZE.findall(d))
    return counts


def learn_bpe(word_counts, n_tokens, log_every=500):
    """word_counts: {pre-token string: count} -> (merges [(left, right)], tokens [spelling]):
    merges until there are n_tokens distinct tokens (bytes included)."""
    tokens = [BYTE_TO_CHAR[b] for b in range(256)]    # id -> spelling
    token_id = {s: i for i, s in enumerate(tokens)}
    # words in a fixed order (by spelling) so that nothing depends on dict/hash order
    items = sorted((spell(w), c) for w, c in word_counts.items())
    words = [[token_id[ch] for ch in s] for s, _ in items]
    freqs = [c for _, c in items]

    pair_count = collections.defaultdict(int)
    where = collections.defaultdict(set)
    for wi, w in enumerate(words):
        f = freqs[wi]
        for a, b in zip(w, w[1:]):
            pair_count[(a, b)] += f
            where[(a, b)].add(wi)
    heap = [(-c, tokens[a], tokens[b], a, b) for (a, b), c in pair_count.items()]
    heapq.heapify(heap)

    merges = []
    t0 = time.time()
    while len(tokens) < n_tokens:
        if not heap:
            print(f"bpe: only {len(merges)} merges possible", file=sys.stderr)
            break
        negc, _, _, a, b = heapq.heappop(heap)
        if pair_count.get((a, b), 0) != -negc or negc == 0:
            continue  # stale heap entry
        if -negc < 2:
            print(f"bpe: stopping at {len(merges)} merges (no pair occurs twice)", file=sys.stderr)
            break
        new = tokens[a] + tokens[b]
        if new in token_id:
            c = token_id[new]
        else:
            c = len(tokens)
            tokens.append(new)
            token_id[new] = c
        merges.append((tokens[a], tokens[b]))
        touched = set()
        for wi in sorted(where.pop((a, b))):
            w = words[wi]
            f = freqs[wi]
            if len(w) < 2:
                continue
            i, out, hit = 0, [], False
            while i < len(w):
                if i + 1 < len(w) and w[i] == a and w[i + 1] == b:
                    out.append(c)
                    i += 2
                    hit = True
                else:
                    out.append(w[i])
                    i += 1
            if not hit:
                continue
            for p in zip(w, w[1:]):
                pair_count[p] -= f
                touched.add(p)
            for p in zip(out, out[1:]):
                pair_count[p] += f
                where[p].add(wi)
                touched.add(p)
            words[wi] = out
        pair_count.pop((a, b), None)
        touched.discard((a, b))
        for p in touched:
            cnt = pair_count.get(p, 0)
            if cnt > 0:
                heapq.heappush(heap, (-cnt, tokens[p[0]], tokens[p[1]], p[0], p[1]))
            else:
                pair_count.pop(p, None)
        if log_every and len(merges) % log_every == 0:
            print(f"bpe: {len(merges)} merges, last {merges[-1]!r} x{-negc}, "
                  f"{time.time() - t0:.1f}s", flush=True)
    return merges, tokens


def tokenizer_json(tokens, merges):
    """tokens: id -> spelling for ids 0..V-2 (bytes then merges); EOT gets id V-1."""
    eot_id = len(tokens)
    vocab = {s: i for i, s in enumerate(tokens)}
    vocab[EOT] = eot_id
    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True,
                  "use_regex": True}
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": [{"id": eot_id, "content": EOT, "single_word": False, "lstrip": False,
                          "rstrip": False, "normalized": False, "special": True}],
        "normalizer": None,
        "pre_tokenizer": byte_level,
        "post_processor": dict(byte_level, trim_offsets=False),
        "decoder": byte_level,
        "model": {"type": "BPE", "dropout": None, "unk_token": None,
                  "continuing_subword_prefix": None, "end_of_word_suffix": None,
                  "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
                  "vocab": vocab, "merges": [f"{l} {r}" for l, r in merges]},
    }


# ------------------------------------------------------------------------------- encoding

class Tokenizer:
    """Exact encoder/decoder for a byte-level BPE tokenizer.json of this shape (no normalizer,
    ByteLevel pre-tokenizer without prefix space, added tokens matched literally)."""

    def __init__(self, path):
        with open(path, encoding="utf-8") as f:
            j = json.load(f)
        m = j["model"]
        self.vocab = dict(m["vocab"])
        merges = [tuple(x.split(" ")) if isinstance(x, str) else tuple(x) for x in m["merges"]]
        self.ranks = {}
        for r, p in enumerate(merges):
            self.ranks[p] = r  # a repeated pair: the last one wins, as in HF and the engine
        self.added = {t["content"]: t["id"] for t in j.get("added_tokens", [])}
        self.special_ids = {t["id"] for t in j.get("added_tokens", []) if t.get("special")}
        self.vocab.update(self.added)
        self.vocab_size = max(self.vocab.values()) + 1
        self.id_to_bytes = {}
        for s, i in m["vocab"].items():
            self.id_to_bytes[i] = bytes(CHAR_TO_BYTE[ch] for ch in s) if s not in self.added \
                else s.encode("utf-8")
        for s, i in self.added.items():
            self.id_to_bytes[i] = s.encode("utf-8")
        self.eot_id = self.added.get(EOT)
        self.cache = {}
        if self.added:
            self.added_re = regex.compile("|".join(
                regex.escape(s) for s in sorted(self.added, key=lambda s: (-len(s), s))))
        else:
            self.added_re = None

    def _bpe(self, word):
        ids = self.cache.get(word)
        if ids is not None:
            return ids
        parts = list(spell(word))
        ranks = self.ranks
        while len(parts) > 1:
            best, best_rank = None, None
            for i in range(len(parts) - 1):
                r = ranks.get((parts[i], parts[i + 1]))
                if r is not None and (best_rank is None or r < best_rank):
                    best, best_rank = i, r
            if best is None:
                break
            a, b = parts[best], parts[best + 1]
            out, i = [], 0
            while i < len(parts):
                if i + 1 < len(parts) and parts[i] == a and parts[i + 1] == b:
                    out.append(a + b)
                    i += 2
                else:
                    out.append(parts[i])
                    i += 1
            parts = out
        ids = [self.vocab[p] for p in parts]
        if len(self.cache) < 500000:
            self.cache[word] = ids
        return ids

    def encode_ordinary(self, text):
        """Encodes text with added tokens treated as plain text."""
        out = []
        for w in PRETOKENIZE.findall(text):
            out += self._bpe(w)
        return out

    def encode(self, text):
        if self.added_re is None:
            return self.encode_ordinary(text)
        out, pos = [], 0
        for m in self.added_re.finditer(text):
            out += self.encode_ordinary(text[pos:m.start()])
            out.append(self.added[m.group()])
            pos = m.end()
        return out + self.encode_ordinary(text[pos:])

    def decode_bytes(self, ids):
        return b"".join(self.id_to_bytes[i] for i in ids)

    def decode(self, ids):
        return self.decode_bytes(ids).decode("utf-8", errors="replace")


def encode_docs(tok, docs):
    """Documents -> one token stream: EOT doc_1 EOT doc_2 ... EOT doc_n EOT (EOT = BOS = EOS)."""
    out = [tok.eot_id]
    for d in docs:
        out += tok.encode_ordinary(d)
        out.append(tok.eot_id)
    return out


# ------------------------------------------------------------------------------- main

def file_sha256(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        h.update(f.read())
    return h.hexdigest()


def main():
    sys.path.insert(0, HERE)
    from corpus import dir_problem, read_docs

    ap = argparse.ArgumentParser(description="learn a byte-level BPE, write tokenizer.json", allow_abbrev=False)
    ap.add_argument("--corpus", default="build/corpus/train.txt")
    ap.add_argument("--out", default="build/corpus/tokenizer.json")
    ap.add_argument("--vocab-size", type=int, default=4096,
                    help="total ids: 256 bytes + merges + <|endoftext|>")
    ap.add_argument("--force", action="store_true", help="retrain even if up to date")
    args = ap.parse_args()
    if args.vocab_size < 258:
        ap.error(f"--vocab-size must be at least 258 (256 bytes, a merge, <|endoftext|>), "
                 f"got {args.vocab_size}")
    # (both were tracebacks: a missing corpus at the stamp's hash, a bad --out after training)
    if not os.path.isfile(args.corpus):
        ap.error(f"--corpus {args.corpus}: no such file (scripts/train/corpus.py makes train.txt)")
    if os.path.isdir(args.out):
        ap.error(f"--out {args.out} is a directory; it names the tokenizer.json to write")
    why = dir_problem(os.path.dirname(args.out) or ".")
    if why:
        ap.error(f"--out {args.out}: {why}")

    # up-to-date check: same corpus, same size, same script -> same output (training is
    # deterministic), so an existing file is kept
    with open(os.path.abspath(__file__), "rb") as f:
        script_hash = hashlib.sha256(f.read()).hexdigest()
    stamp = {"corpus_sha256": file_sha256(args.corpus), "vocab_size": args.vocab_size,
             "script_sha256": script_hash}
    stamp_path = args.out + ".stamp"
    if not args.force and os.path.exists(args.out) and os.path.exists(stamp_path):
        with open(stamp_path) as f:
            if json.load(f) == stamp:
                print(f"bpe: {args.out} is up to date")
                return

    t0 = time.time()
    docs = read_docs(args.corpus)
    counts = count_words(docs)
    print(f"bpe: {len(docs)} documents, {sum(counts.values())} pre-tokens, "
          f"{len(counts)} distinct, {time.time() - t0:.1f}s", flush=True)
    merges, tokens = learn_bpe(counts, args.vocab_size - 1)
    if len(tokens) != args.vocab_size - 1:
        sys.exit(f"bpe: the corpus only supports {len(tokens)} tokens")
    j = tokenizer_json(tokens, merges)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out + ".tmp", "w", encoding="utf-8") as f:
        json.dump(j, f, ensure_ascii=False, indent=None, separators=(",", ":"))
        f.write("\n")
    os.replace(args.out + ".tmp", args.out)

    # statistics on the corpus with the finished tokenizer (and an exact round trip check)
    tok = Tokenizer(args.out)
    n_chars = sum(map(len, docs))
    n_tok = sum(c * len(tok._bpe(w)) for w, c in counts.items())
    sample = "".join(d + "\n" for d in docs[:50])
    if tok.decode(tok.encode(sample)) != sample:
        sys.exit("bpe: round trip failed")
    print(f"bpe: wrote {args.out}: {tok.vocab_size} ids ({len(merges)} merges), "
          f"{n_chars} chars -> {n_tok} tokens on {args.corpus} "
          f"({n_chars / n_tok:.3f} chars/token), {time.time() - t0:.1f}s")
    with open(stamp_path, "w") as f:
        json.dump(stamp, f)


if __name__ == "__main__":
    main()
