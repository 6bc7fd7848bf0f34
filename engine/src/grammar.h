/* grammar.h: grammars compiled to a byte-level pushdown automaton (internal).
 *
 * One internal form for every source: GBNF text (gbnf.c), and JSON Schema (json_schema.c),
 * regular expressions (regex.c) and Lua combinators, which all write GBNF, end up as a
 * `tl_gram_program`:
 *
 *   rules -> alternatives -> sequences of elements, each element either
 *     GE_BYTES  one byte out of a 256-bit set, or
 *     GE_REF    a call of another rule,
 *   every sequence closed by GE_END.
 *
 * Character classes over code points are compiled to UTF-8 byte sequences when the grammar is
 * built, so the matcher walks bytes: a token that ends in the middle of a code point is judged
 * like any other prefix, with no partial-UTF-8 bookkeeping.
 *
 * The matcher (grammar.c) is llama.cpp's set-of-stacks idea with two changes that make it cheap:
 * stacks are hash-consed persistent lists (a stack is a node id; equal stacks are equal ids) and
 * a matcher state (a set of stacks) is interned too, so a state is an int, advancing by a byte is
 * a memoised table lookup, rollback is keeping the old int, and masks can be cached per state.
 * Calls of a rule in tail position push nothing, so repetition does not grow the stacks. */
#ifndef TL_GRAMMAR_H
#define TL_GRAMMAR_H

#include <pthread.h>
#include <stdatomic.h>

#include "internal.h"
#include "strbuf.h"

enum { GE_END = 0, GE_BYTES = 1, GE_REF = 2, GE_TOKEN = 3 };

/* The value of a hex digit, or -1 (the GBNF and regex escapes' one reading). */
static inline int tl_gram_hex_digit(unsigned char h) {
    return h >= '0' && h <= '9' ? h - '0' : h >= 'a' && h <= 'f' ? h - 'a' + 10 : h >= 'A' && h <= 'F' ? h - 'A' + 10 : -1;
}

/* Grows *p to hold `need` items of `size` bytes (capacity *cap, doubled); false out of memory. */
bool tl_gram_grow(void **p, int *cap, int need, size_t size);
/* A malloc'ed, NUL-terminated copy of s[0..len) (a token reference's text); NULL out of memory. */
char *tl_gram_copy_text(const char *s, size_t len);

/* The most elements a program may have: a hostile grammar's error, not an abort. */
#define GRAM_MAX_ELEMS (1 << 22)
/* Stacks one token's mask may read in transitions not met before: a grammar that keeps tens of
   thousands of alternatives alive, each a step on every byte of the vocabulary's trie, took
   seconds a token on the engine thread (and every session batched with it waited). The
   largest mask of test_grammar and tinyloop-grammar-bench (the shipped JSON grammar, a large
   JSON Schema's, GPT-2's vocabulary) reads 27,488: this is 76 times that, some 50 ms. */
#define GRAM_MAX_MASK_WORK ((int64_t)1 << 21)

typedef struct tl_gram_elem {
    uint8_t kind;
    int32_t arg; /* GE_BYTES: index of the byte set; GE_REF: rule id */
} tl_gram_elem;

typedef struct tl_gram_byteset { uint64_t bits[4]; } tl_gram_byteset;

/* A token reference (llama.cpp's GBNF <[id]>, <text>, and their negations !<...>): one whole
   token of the vocabulary, that one (or, negated, any other but the end of sequence), matched
   by id and not by its bytes, so a special token that has none (a chat template's turn end, a
   thinking model's </think>) can be matched. <text> names the token whose text is exactly that
   (the brackets included), resolved against each vocabulary the grammar is used with. */
typedef struct tl_gram_token_ref {
    int32_t id;           /* <[id]>; -1 for <text> */
    char *text;           /* <text>'s whole text, brackets included; NULL for <[id]> */
    bool negated;         /* !<...> */
} tl_gram_token_ref;

static inline bool tl_gram_byteset_has(const tl_gram_byteset *s, unsigned b) {
    return (s->bits[b >> 6] >> (b & 63)) & 1u;
}

typedef struct tl_gram_program {
    tl_gram_elem *elems;     /* every alternative's elements, each closed by GE_END */
    int n_elems;
    int32_t *alt_start;   /* [n_alts] position of each alternative's first element */
    int32_t *rule_alts;   /* [n_rules + 1] rule r owns alternatives rule_alts[r]..rule_alts[r+1] */
    int n_rules, n_alts;
    tl_gram_byteset *sets;
    int n_sets;
    int root;
    char **rule_names;    /* [n_rules] for messages; generated rules are named after their parent */
    tl_gram_token_ref *tokens; /* [n_tokens] what GE_TOKEN elements name (their arg) */
    int n_tokens;
} tl_gram_program;

void tl_gram_program_free(tl_gram_program *p);
struct tl_compiled_grammar;
/* A compiled grammar around prog (which it owns from here, also on failure). */
tl_status tl_gram_wrap_program(tl_gram_program *prog, struct tl_compiled_grammar **out);

/* ---------------------------------------------------------------- the rule builder
   What parsers produce: rules of alternatives of elements, where a terminal is a set of code
   point ranges. tl_gram_build compiles it (UTF-8, checks) into a tl_gram_program. */

typedef struct tl_gram_range { uint32_t lo, hi; } tl_gram_range;

typedef struct tl_gram_item {
    int kind;             /* GE_BYTES: code point set; GE_REF: rule; GE_TOKEN: a token reference */
    int32_t arg;          /* GE_BYTES: index into the builder's ranges pool; GE_REF: rule;
                             GE_TOKEN: index into the builder's tokens */
    int32_t n_ranges;
} tl_gram_item;

typedef struct tl_gram_builder {
    /* rules[r] is alternatives alts[rule_first[r] ...] chained through alt_next */
    char **names;
    int64_t *defined_at;  /* [rule] "line:column" packed as line << 20 | column, -1 undefined
                             (64 bits: a grammar may have more lines than 2^11) */
    int32_t *used_line, *used_col; /* first use, for "undefined rule" messages */
    int n_rules, cap_rules;
    int32_t *by_name;     /* [name_slots] open-addressed table of rule ids by name, -1 empty */
    int name_slots;       /* a power of two, at least twice n_rules */
    /* alternatives: item lists */
    int32_t *alt_rule, *alt_first, *alt_len;
    int n_alts, cap_alts;
    tl_gram_item *items;
    int n_items, cap_items;
    tl_gram_range *ranges;
    int n_ranges, cap_ranges;
    tl_gram_token_ref *tokens;
    int n_tokens, cap_tokens;
} tl_gram_builder;

void tl_gram_builder_free(tl_gram_builder *b);
/* Rule id of `name` (created undefined on first sight); -1 out of memory. */
int tl_gram_builder_rule(tl_gram_builder *b, const char *name, size_t len);
/* A fresh rule named after `parent` (parent_1, parent_2...). */
int tl_gram_builder_fresh_rule(tl_gram_builder *b, int parent);

/* Compiles the builder (start rule "root") into *out. On failure a message in err. */
tl_status tl_gram_build(const tl_gram_builder *b, tl_gram_program **out, char *err, size_t errlen);

/* ---------------------------------------------------------------- GBNF (gbnf.c) */

/* Parses GBNF text into a program. Messages: "line L, column C: ... (in rule 'x')". */
tl_status tl_gram_parse_gbnf(const char *text, size_t len, tl_gram_program **out, char *err, size_t errlen);

/* Writing GBNF: a literal of the NUL-terminated bytes s; one code point inside a class. */
void tl_gram_gbnf_literal(strbuf *b, const char *s);
void tl_gram_gbnf_class_cp(strbuf *b, uint32_t cp);

/* ---------------------------------------------------------------- regular expressions (regex.c) */

/* Appends to out a parenthesised GBNF expression for the NUL-terminated pattern. text: it
   matches a whole text; false: the characters of a JSON string as JSON writes them (a
   schema's "pattern"). pad (or NULL: the pattern matches whole): a GBNF expression for any
   characters, written where a top-level alternative has no '^' or '$' (a searched pattern,
   JSON Schema's). Returns 0, or -1 with err saying what is wrong. */
int tl_gram_regex_expr(const char *pattern, bool text, const char *pad, strbuf *out, char *err, size_t errlen);

/* ---------------------------------------------------------------- JSON Schema (json_schema.c) */

/* GBNF text of a JSON Schema (malloc'ed, NUL-terminated). free_ws: allow whitespace between
   tokens instead of the compact form. */
tl_status tl_gram_json_schema_to_gbnf(const char *json, size_t len, int free_ws, int loose, char **gbnf, size_t *gbnf_len,
                                   char *err, size_t errlen);

/* ---------------------------------------------------------------- the matcher runtime */

/* A stack node: "match at `pos`, then continue with stack `parent`". Node 0 is the empty stack. */
typedef struct tl_gram_node { int32_t pos, parent; } tl_gram_node;

typedef struct tl_gram_hash { /* open addressing, keys != 0 */
    uint64_t *keys;
    int32_t *vals;
    size_t cap, n;
} tl_gram_hash;

/* The one open-addressing table of the grammar code (grammar.c): grows at half full. */
bool tl_gram_hash_reserve(tl_gram_hash *h);                      /* room for one more key; false: out of memory */
int32_t tl_gram_hash_get(const tl_gram_hash *h, uint64_t key);   /* -1 when absent */
bool tl_gram_hash_put(tl_gram_hash *h, uint64_t key, int32_t val);
void tl_gram_hash_clear(tl_gram_hash *h);                        /* no keys, capacity kept */
void tl_gram_hash_free(tl_gram_hash *h);

typedef struct tl_gram_mask_entry {
    int32_t state;
    int32_t count;
    /* The allowed tokens, held small (grammar_mask.c): caching a state's first mask writes fresh
       memory, and on a cold cache the first touch of its pages took longer than the trie walk.
       Either `bits`, a bitset of the vocabulary (token t is bit t % 64 of word t / 64; base -1),
       or, for a state resolved from its projection, the projection's entry `base` (which has
       bits) plus the tokens `extra` that the state's escapes add. */
    uint64_t *bits;
    int32_t base;
    int32_t *extra;
    int32_t n_extra;
    /* a projection's mask leaves out the subtrees of these trie nodes (at these depths), where
       its walk escaped; they are resolved per state (grammar_mask.c) */
    int32_t *esc;
    uint16_t *esc_depth;
    int32_t n_esc;
} tl_gram_mask_entry;

struct tl_gram_vocab;

/* Interned stacks and states of one program. Shared by the matchers on one generation of a
   compiled grammar's tables (so masks cached for one generation's states serve the next
   generation that meets them), under the grammar's lock. */
typedef struct tl_gram_runtime {
    const tl_gram_program *prog;
    tl_gram_node *nodes;
    int n_nodes, cap_nodes;
    tl_gram_hash node_ids;          /* (pos, parent) -> node */
    int32_t *state_members;      /* concatenated sorted node lists */
    size_t n_members, cap_members;
    int64_t *state_first;        /* [n_states + 1] offsets into state_members */
    uint8_t *state_flags;        /* bit 0: accepting; bit 1: loop bytes computed; bit 2: escaped
                                    (a stack popped into the stand-in of a projection) */
    tl_gram_byteset *state_loop;    /* bytes that lead from a state back to itself */
    tl_gram_byteset *state_takes;   /* bytes some stack of the state can take (bit 3 of flags: computed) */
    int n_states, cap_states;
    tl_gram_hash state_ids;         /* hash of members -> chain of candidate states */
    tl_gram_hash transitions;       /* state * 256 + byte + 1 -> state */
    int32_t initial;
    /* Projections (tl_gram_project): a stand-in for everything below a stack's top frames. */
    int32_t esc_node;            /* the stand-in, a node no byte matches */
    int32_t *state_proj;         /* [n_states] the state's projection, -1 not computed yet */
    /* calls already expanded in the current closure: (rule, stack below) -> closure number */
    tl_gram_hash called;
    int32_t closure;
    /* scratch */
    int32_t *scratch;
    size_t n_scratch, cap_scratch;
    int32_t *pending;            /* expand's work list: (pos, parent) pairs */
    size_t n_pending, cap_pending;
    /* The work of the mask being computed (tl_gram_mask): stacks read by transitions not met
       before, refused past work_budget (0: no budget, outside a mask). */
    int64_t work, work_budget;
} tl_gram_runtime;

#define GRAM_DEAD 0 /* the empty set of stacks: nothing can follow */

tl_status tl_gram_runtime_init(tl_gram_runtime *rt, const tl_gram_program *prog);
void tl_gram_runtime_destroy(tl_gram_runtime *rt);
/* The error of a runtime call that returned -1 (the calling thread's last one): a limit it
   met (a grammar too ambiguous for one byte, tables full), else out of memory. `what` names
   the call for the message. */
tl_status tl_gram_failure(const char *what);
/* The memory the runtime's tables hold. */
size_t tl_gram_runtime_bytes(const tl_gram_runtime *rt);
/* The state after `byte` (GRAM_DEAD when the byte is not allowed); -1 out of memory.
   Callers hold the grammar's lock when the runtime is shared. */
int32_t tl_gram_advance(tl_gram_runtime *rt, int32_t state, unsigned byte);
int32_t tl_gram_advance_bytes(tl_gram_runtime *rt, int32_t state, const void *bytes, size_t len);
/* Token references: whether a stack of the state waits for one (then the state's next after a
   whole token is more than its bytes' path). */
static inline bool tl_gram_has_refs(const tl_gram_runtime *rt, int32_t state) { return rt->state_flags[state] & 16; }
/* What token references are read against: the program's references resolved in a vocabulary,
   and the tokens that end the text there (eos, and a matcher's ends), which no negated
   reference takes. */
typedef struct tl_gram_token_set {
    const int32_t *ids;          /* [prog->n_tokens] */
    int32_t eos;
    const int32_t *ends;
    int n_ends;
} tl_gram_token_set;
/* The state after `token` given `by_bytes`, the state its bytes lead to (GRAM_DEAD for a token
   without bytes): that, with the stacks whose token reference takes the token. -1 out of
   memory. */
int32_t tl_gram_advance_refs(tl_gram_runtime *rt, int32_t state, int32_t by_bytes, int32_t token, const tl_gram_token_set *refs);
/* Adds to allowed[0..vocab_size) the tokens the state's token references take, returning count
   plus those newly allowed. */
int tl_gram_mask_refs(const tl_gram_runtime *rt, int32_t state, const tl_gram_token_set *refs, int vocab_size, uint8_t *allowed,
                   int count);
static inline bool tl_gram_accepting(const tl_gram_runtime *rt, int32_t state) { return rt->state_flags[state] & 1; }
/* Bytes some stack of the state can take (the others lead to GRAM_DEAD; computed once). */
const tl_gram_byteset *tl_gram_first_bytes(tl_gram_runtime *rt, int32_t state);
/* Bytes b with advance(state, b) == state (computed once per state). NULL out of memory. */
const tl_gram_byteset *tl_gram_loop_bytes(tl_gram_runtime *rt, int32_t state);
/* The projection of a state: each of its stacks cut to its top GRAM_PROJECT_DEPTH frames, the
   rest replaced by a stand-in node that no byte matches and that marks a state "escaped" when a
   stack pops into it. Stacks with the same top frames (the same place in a JSON value at any
   nesting, say) merge, so many states share one projection. Advancing the projection by a
   byte string that never escapes mirrors advancing the state itself (the cut-off frames are
   never looked at), so a token is allowed from the state exactly when it is allowed from the
   projection, as long as no state met on the way is escaped. Returns the state itself when no
   stack is deeper than the cut; -1 out of memory. */
#define GRAM_PROJECT_DEPTH 3
int32_t tl_gram_project(tl_gram_runtime *rt, int32_t state);
static inline bool tl_gram_escaped(const tl_gram_runtime *rt, int32_t state) { return rt->state_flags[state] & 4; }

/* ---------------------------------------------------------------- tokens (grammar_mask.c) */

/* A vocabulary as a trie of token byte strings, nodes numbered in preorder: node i's subtree is
   nodes i..sub_end[i]-1, its children are i+1, sub_end[i+1], ... (while < sub_end[i]). Tokens are
   listed in `order` by the node they end at, so the tokens ending at node i are
   order[tok_first[i]..tok_first[i+1]) and those of its whole subtree
   order[tok_first[i]..tok_first[sub_end[i]]): allowing a subtree in bulk is one loop. */
typedef struct tl_gram_vocab {
    int vocab_size;
    int eos;                     /* -1 none */
    uint64_t fingerprint;        /* a hash of every token's bytes: identifies the vocabulary */
    int n_nodes;
    uint8_t *node_byte;          /* [n_nodes] byte leading into node i (root: unused) */
    int32_t *sub_end;            /* [n_nodes] */
    int32_t *tok_first;          /* [n_nodes + 1] */
    int32_t *order;              /* [n_ordered] token ids */
    int n_ordered;
    tl_gram_byteset *sub_bytes;     /* [n_nodes] bytes on the edges below node i */
    const char **bytes;          /* [vocab] token bytes, into `text`; NULL: never allowed (special, empty) */
    uint32_t *lens;
    char *text;                  /* every allowed token's bytes, owned: a grammar outlives the model
                                    (and tokenizer) it was first used with */
    size_t memory;               /* bytes all of the above hold */
    int refs;                    /* compiled grammars holding it (under the registry's lock) */
    struct tl_gram_vocab *next;     /* the registry's list */
} tl_gram_vocab;

/* Vocabularies are shared by every compiled grammar in the process, found by fingerprint: a
   GPT-2 trie holds about 10 MB, which each of a server's cached grammars built again before.
   acquire finds or builds the tokenizer's (fp: its fingerprint), release drops a reference and
   frees it with the last. */
struct tl_tlz_tokenizer;
tl_status tl_gram_vocab_acquire(const struct tl_tlz_tokenizer *tok, int vocab_size, int eos, uint64_t fp, tl_gram_vocab **out);
void tl_gram_vocab_release(tl_gram_vocab *v);

/* The masks computed against one vocabulary a compiled grammar is used with. */
typedef struct tl_gram_binding {
    const tl_gram_vocab *vocab;     /* the grammar's (g->vocabs), not owned */
    tl_gram_mask_entry *masks;
    int n_masks, cap_masks;
    tl_gram_hash mask_ids;          /* state + 1 -> index in masks */
    size_t mask_bytes;           /* memory the cached masks hold */
    size_t mask_budget;          /* at most that much (MASK_CACHE_BYTES; tests set less), then start over */
} tl_gram_binding;

/* One generation of a compiled grammar's tables: the stacks and states interned so far, and
   the masks cached for them. A state is an index into these tables, so a matcher keeps the
   generation it started on; the grammar starts a new one when they outgrow its budget. */
typedef struct tl_gram_tables {
    tl_gram_runtime rt;
    tl_gram_binding *bindings;      /* [n_bindings] masks for the grammar's vocabs[i] */
    int n_bindings;
    int users;                   /* matchers on these tables */
    struct tl_gram_tables *next;    /* an old generation: the grammar's list of them */
} tl_gram_tables;

/* The tables' budget: past it, the next matcher (or tl_grammar_matches) starts a new
   generation. Without it, a grammar shared by a server's requests kept every stack any document
   ever met, until the interning limits refused every request ("out of memory") for good. */
#define GRAM_TABLE_BYTES ((size_t)128 << 20)

/* The compiled grammar of the public API. */
struct tl_compiled_grammar {
    atomic_int refs;
    tl_gram_program *prog;
    uint64_t fingerprint;        /* a hash of prog's rules (not their names): a state file records
                                    the grammar it was generated under by it (state_file.c) */
    pthread_mutex_t lock;        /* guards everything below, and every generation's tables */
    tl_gram_tables *tables;         /* the current generation: new matchers start on it; an older
                                    one lives until its last matcher is freed */
    tl_gram_tables *old_tables;     /* those older ones (listed for tl_grammar_memory_usage) */
    tl_gram_vocab **vocabs;         /* [n_vocabs] every vocabulary the grammar was used with */
    int32_t **ref_ids;           /* [n_vocabs][prog->n_tokens] the token references resolved in
                                    each (NULL when the program has none) */
    int n_vocabs;
    size_t table_budget;         /* GRAM_TABLE_BYTES; tests set less */
    int64_t generations;         /* how many times the tables started over */
    /* what tl_grammar_memory_usage found last, answered while another thread holds `lock`
       (a cache that asks every grammar must not wait behind a mask being computed) */
    pthread_mutex_t usage_lock;  /* guards last_usage only; taken under `lock` or alone */
    tl_grammar_memory last_usage;
};

/* The current tables, a new generation first when they are over budget (callers hold g->lock;
   out of memory for a new one, the full tables go on). */
tl_gram_tables *tl_gram_current_tables(tl_compiled_grammar *g);
/* A matcher leaves its tables (under g->lock): the last user of an old generation frees it. */
void tl_gram_tables_leave(tl_compiled_grammar *g, tl_gram_tables *t);

/* Writes allowed[0..vocab) for `state` (1 = allowed) and returns the count; < 0 out of memory.
   Callers hold the runtime's lock. */
int tl_gram_mask(tl_gram_runtime *rt, tl_gram_binding *b, int32_t state, uint8_t *allowed);
/* The same mask by a walk of the state itself: no cache, no projection (the tests' reference). */
int tl_gram_mask_full(tl_gram_runtime *rt, tl_gram_binding *b, int32_t state, uint8_t *allowed);
/* State after a whole token (GRAM_DEAD if it is not allowed; end of sequence keeps an
   accepting state): its bytes, and the token references that take it (refs: read against v;
   NULL when the program has none); -1 out of memory. Callers hold the grammar's lock. */
int32_t tl_gram_advance_token(tl_gram_runtime *rt, const tl_gram_vocab *v, const tl_gram_token_set *refs, int32_t state, int32_t token);
void tl_gram_binding_destroy(tl_gram_binding *b);


/* ---------------------------------------------------------------- matchers (per generation) */

#define GRAM_MAX_ENDS 16
struct tl_grammar_matcher {
    tl_compiled_grammar *g;
    tl_gram_tables *tables;         /* the generation its states belong to (one of its users) */
    int binding;                 /* index in tables->bindings and g->vocabs (read under g->lock:
                                    another thread's new binding moves the array) */
    const struct tl_gram_vocab *vocab; /* that vocabulary, which does not move */
    const int32_t *ref_ids;      /* the token references resolved in it (NULL: none) */
    int32_t *states;             /* history: states[0] initial, states[n-1] current */
    int n, cap;
    /* special tokens that end generation as eos does (a chat template's turn end, a one-token
       stop sequence): allowed wherever the grammar may end */
    int32_t ends[GRAM_MAX_ENDS];
    int n_ends;
};

struct tl_tlz_tokenizer;
/* A matcher for a vocabulary given by a tokenizer alone (the benchmark, the session). */
tl_status tl_gram_matcher_new(const tl_compiled_grammar *g, const struct tl_tlz_tokenizer *tok, int vocab_size, int eos,
                           tl_grammar_matcher **out);
/* An independent copy of a matcher: the same grammar and vocabulary, its own history (a
   forked or resumed session must not share, and then free, its parent's matcher). */
tl_status tl_gram_matcher_clone(const tl_grammar_matcher *src, tl_grammar_matcher **out);
/* The current state, and state-level calls for drafts (states are immutable ints, so a drafted
   path needs no rollback: it is just other ints). */
/* The tokens of the one-token stop sequences that have no text (special tokens, which no
   grammar writes): they end the text like eos, allowed where the grammar may end (the first
   GRAM_MAX_ENDS of them; text tokens are left to the grammar). */
void tl_gram_matcher_set_ends(tl_grammar_matcher *mt, const tl_token_seq *stops, int n_stops);
int32_t tl_gram_matcher_state(const tl_grammar_matcher *mt);
int tl_gram_matcher_mask_state(tl_grammar_matcher *mt, int32_t state, uint8_t *allowed);
int32_t tl_gram_matcher_advance_state(tl_grammar_matcher *mt, int32_t state, int32_t token);
/* The tl_grammar callbacks of a matcher (what the session runs). */
void tl_gram_matcher_as_grammar(tl_grammar_matcher *mt, tl_grammar *out);

#endif
