/* cpu_arena.c: the CPU backend's buffers (tl_backend.alloc / free): small blocks carved
 * from 2 MiB chunks of transparent huge pages, larger ones mapped on their own.
 *
 * Why: KV pages are allocated while decoding, 16 rows of one slot at a time. From the C
 * heap every fresh 4 KiB of them was a page fault on first touch; on a VM with costly
 * faults (~14 us each, measured) that was ~9 faults and ~120 us per token of the shipped
 * model, a quarter of its decode time. A chunk faults once per 2 MiB.
 *
 * A freed block waits on the free list of its exact size (a model's small buffers come in
 * a few sizes: the KV page, the workspace's rows) and is zeroed when handed out again.
 * Past ARENA_IDLE_BYTES of free blocks, memory goes back to the system (madvise
 * MADV_DONTNEED: the mapping stays, its pages read as zero when touched again): a chunk
 * whose blocks are all free whole (its blocks leave the free lists, and the chunk is the
 * next one blocks are carved from), else the whole pages inside the freed block. A burst
 * of sessions left the process at its peak for as long as the model lived (300 sessions
 * of the shipped model closed: 1.4 GB resident, where the model's K/V spares were 64
 * MiB). The chunks are unmapped when the backend closes. Larger blocks are mappings of their
 * own (MAP_MIN_BYTES and up) or from the C heap. Every block, from a chunk, a mapping or the
 * heap, has a 64-byte header before it saying which. */
#define _DEFAULT_SOURCE /* MAP_ANONYMOUS, MADV_HUGEPAGE */
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>

#include "cpu_backend.h"

#define CHUNK_BYTES ((size_t)2 << 20)
#define HEADER 64                         /* keeps the block 64-byte aligned */
/* Blocks up to a quarter chunk, header included (a 256 KiB buffer and its header, the
   shipped model's workspace rows, passed the 256 KiB this was and went to the heap) */
#define ARENA_MAX_BLOCK (CHUNK_BYTES / 4)
#define SIZE_CLASSES 16                   /* distinct block sizes kept; others: the C heap or a mapping */
#define FROM_HEAP UINT32_MAX
#define FROM_MAP (UINT32_MAX - 1)
/* A block past the arena's of this size or more is a mapping of its own, unmapped when freed:
   from glibc's heap, a session's buffers of 256 KiB to a few MiB came from sbrk's top once
   glibc had raised its mmap threshold to their size (at the first such block freed), and a
   burst of sessions, closed, left the heap at its peak behind a later small allocation (300
   sessions of the shipped model: 160 MB resident, in use 0.5) */
#define MAP_MIN_BYTES ((size_t)128 << 10)
/* Free blocks kept resident for the next allocations (beside the model's K/V spares,
   kv_cache.h, which are pages kept whole): past it, freed blocks are trimmed. */
#define ARENA_IDLE_BYTES ((size_t)16 << 20)
#define OS_PAGE ((uintptr_t)4096)

typedef struct block_header {
    uint32_t size_class; /* index into the arena's classes, FROM_HEAP or FROM_MAP */
    uint32_t chunk;      /* index into the arena's chunks */
    uint32_t trimmed;    /* on a free list: its whole pages past the header's were given back */
    struct block_header *next_free, *prev_free; /* on its class's free list */
    size_t mapped_bytes; /* FROM_MAP: the mapping's length */
} block_header;
_Static_assert(sizeof(block_header) <= HEADER, "the block header fits before the block");

typedef struct size_class {
    size_t bytes;             /* header included; 0 = unused */
    block_header *free_list;  /* freed blocks (doubly linked: a chunk given back leaves it) */
} size_class;

typedef struct chunk {
    uint8_t *base;  /* 2 MiB-aligned mapping */
    size_t used;    /* bytes carved from it, in blocks laid end to end */
    int live;       /* its blocks handed out and not released */
} chunk;

struct tl_cpu_arena {
    pthread_mutex_t lock; /* two sessions on one model allocate from it at once */
    size_class classes[SIZE_CLASSES];
    chunk *chunks;        /* every mapping, for unmapping at close */
    int n_chunks, cap_chunks;
    int current;          /* the chunk blocks are carved from; -1: none yet */
    int *empty;           /* chunks given back whole, carved from again before a new mapping */
    int n_empty;
    size_t idle_bytes;    /* resident bytes of the free blocks */
};

tl_cpu_arena *tl_cpu_arena_new(void) {
    tl_cpu_arena *a = calloc(1, sizeof *a);
    if (a && pthread_mutex_init(&a->lock, NULL) != 0) {
        free(a);
        return NULL;
    }
    if (a) a->current = -1;
    return a;
}

void tl_cpu_arena_free(tl_cpu_arena *a) {
    if (!a) return;
    for (int i = 0; i < a->n_chunks; i++) munmap(a->chunks[i].base, CHUNK_BYTES);
    free(a->chunks);
    free(a->empty);
    pthread_mutex_destroy(&a->lock);
    free(a);
}

/* The next chunk to carve from: one given back whole, else a new 2 MiB-aligned mapping;
   false when out of memory. */
static bool next_chunk(tl_cpu_arena *a) {
    if (a->n_empty > 0) {
        a->current = a->empty[--a->n_empty];
        return true;
    }
    if (a->n_chunks == a->cap_chunks) {
        const int cap = a->cap_chunks ? a->cap_chunks * 2 : 16;
        chunk *grown = realloc(a->chunks, (size_t)cap * sizeof *grown);
        if (!grown) return false;
        a->chunks = grown;
        int *empty = realloc(a->empty, (size_t)cap * sizeof *empty); /* (each chunk at most once) */
        if (!empty) return false;
        a->empty = empty;
        a->cap_chunks = cap;
    }
    /* Over-map by a chunk and trim, so that the chunk is aligned to a huge page. */
    uint8_t *raw = mmap(NULL, 2 * CHUNK_BYTES, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (raw == MAP_FAILED) return false;
    uint8_t *base = (uint8_t *)(((uintptr_t)raw + CHUNK_BYTES - 1) & ~(uintptr_t)(CHUNK_BYTES - 1));
    if (base > raw) munmap(raw, (size_t)(base - raw));
    munmap(base + CHUNK_BYTES, CHUNK_BYTES - (size_t)(base - raw));
#ifdef MADV_HUGEPAGE
    madvise(base, CHUNK_BYTES, MADV_HUGEPAGE); /* advisory: without it the chunk still works */
#endif
    a->chunks[a->n_chunks] = (chunk){base, 0, 0};
    a->current = a->n_chunks++;
    return true;
}

/* The class of blocks of `bytes` (header included), made when there is room; -1 if none. */
static int class_of(tl_cpu_arena *a, size_t bytes) {
    for (int i = 0; i < SIZE_CLASSES; i++) {
        if (a->classes[i].bytes == bytes) return i;
        if (a->classes[i].bytes == 0) {
            a->classes[i].bytes = bytes;
            return i;
        }
    }
    return -1;
}

/* The whole pages of a block of `bytes` (header included) past the page its header is on:
   [*from, *to), what trimming gives back (the header holds the free list's link, and the
   partial pages at either end hold other blocks too); false where there are none. */
static bool trimmable(const block_header *h, size_t bytes, uintptr_t *from, uintptr_t *to) {
    *from = ((uintptr_t)h + HEADER + OS_PAGE - 1) & ~(OS_PAGE - 1);
    *to = ((uintptr_t)h + bytes) & ~(OS_PAGE - 1);
    return *to > *from;
}

/* The bytes a free block keeps resident: all of them, or a trimmed one's partial pages. */
static size_t resident_bytes(const block_header *h, size_t bytes) {
    uintptr_t from, to;
    return h->trimmed && trimmable(h, bytes, &from, &to) ? bytes - (size_t)(to - from) : bytes;
}

/* Gives back the whole pages of a free block (under the lock); false where it has none. */
static bool trim_block(block_header *h, size_t bytes) {
    uintptr_t from, to;
    return trimmable(h, bytes, &from, &to) && madvise((void *)from, (size_t)(to - from), MADV_DONTNEED) == 0;
}

/* Zeroes a free block's buffer (past its header) for its next use: a trimmed one's
   given-back pages read as zero. */
static void zero_buffer(block_header *h, size_t bytes) {
    uint8_t *buffer = (uint8_t *)h + HEADER;
    uintptr_t from, to;
    if (h->trimmed && trimmable(h, bytes, &from, &to)) {
        memset(buffer, 0, (size_t)(from - (uintptr_t)buffer));
        memset((void *)to, 0, (size_t)((uintptr_t)h + bytes - to));
    } else {
        memset(buffer, 0, bytes - HEADER);
    }
    h->trimmed = 0;
}

static void unlink_free(size_class *c, block_header *h) {
    if (h->prev_free) h->prev_free->next_free = h->next_free;
    else c->free_list = h->next_free;
    if (h->next_free) h->next_free->prev_free = h->prev_free;
}

/* Gives chunk k back whole (every block of it free, under the lock): its blocks leave the
   free lists, its pages go, and it is carved from again (its pages then read as zero). */
static void give_back_chunk(tl_cpu_arena *a, int k) {
    chunk *ch = &a->chunks[k];
    for (uint8_t *at = ch->base; at < ch->base + ch->used;) {
        block_header *h = (block_header *)at;
        size_class *c = &a->classes[h->size_class];
        unlink_free(c, h);
        a->idle_bytes -= resident_bytes(h, c->bytes);
        at += c->bytes;
    }
    madvise(ch->base, CHUNK_BYTES, MADV_DONTNEED);
    ch->used = 0;
    a->empty[a->n_empty++] = k;
}

/* A block of the arena (zeroed), or NULL to take the heap instead. */
static block_header *arena_block(tl_cpu_arena *a, size_t bytes) {
    pthread_mutex_lock(&a->lock);
    block_header *h = NULL;
    const int c = class_of(a, bytes);
    if (c >= 0 && a->classes[c].free_list) {
        h = a->classes[c].free_list;
        unlink_free(&a->classes[c], h);
        a->idle_bytes -= resident_bytes(h, bytes);
        zero_buffer(h, bytes);
    } else if (c >= 0 && ((a->current >= 0 && CHUNK_BYTES - a->chunks[a->current].used >= bytes) || next_chunk(a))) {
        chunk *ch = &a->chunks[a->current];
        h = (block_header *)(ch->base + ch->used); /* fresh (or given back) pages: zero */
        h->chunk = (uint32_t)a->current;
        ch->used += bytes;
    }
    if (h) {
        h->size_class = (uint32_t)c;
        a->chunks[h->chunk].live++;
    }
    pthread_mutex_unlock(&a->lock);
    return h;
}

void *tl_cpu_arena_alloc(tl_cpu_arena *a, size_t bytes) {
    const size_t total = HEADER + ((bytes + 63) & ~(size_t)63);
    block_header *h = a && total <= ARENA_MAX_BLOCK ? arena_block(a, total) : NULL;
    if (!h && total >= MAP_MIN_BYTES) {
        const size_t length = (total + OS_PAGE - 1) & ~(size_t)(OS_PAGE - 1);
        void *mapped = mmap(NULL, length, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
        if (mapped == MAP_FAILED) return NULL;
#ifdef MADV_HUGEPAGE
        if (length >= CHUNK_BYTES) madvise(mapped, length, MADV_HUGEPAGE); /* (fewer faults; advisory) */
#endif
        h = mapped; /* (zero pages) */
        h->size_class = FROM_MAP;
        h->mapped_bytes = length;
    } else if (!h) {
        if (!(h = tl_alloc_aligned(total))) return NULL;
        h->size_class = FROM_HEAP;
    }
    return (uint8_t *)h + HEADER;
}

void tl_cpu_arena_release(tl_cpu_arena *a, void *p) {
    if (!p) return;
    block_header *h = (block_header *)((uint8_t *)p - HEADER);
    if (h->size_class == FROM_HEAP) {
        tl_free_aligned(h);
        return;
    }
    if (h->size_class == FROM_MAP) {
        munmap(h, h->mapped_bytes);
        return;
    }
    pthread_mutex_lock(&a->lock);
    size_class *c = &a->classes[h->size_class];
    const bool over = a->idle_bytes + c->bytes > ARENA_IDLE_BYTES;
    const int k = (int)h->chunk;
    const bool whole = --a->chunks[k].live == 0 && k != a->current;
    h->trimmed = over && !whole && trim_block(h, c->bytes); /* (a chunk given back whole: all its pages) */
    a->idle_bytes += resident_bytes(h, c->bytes);
    h->prev_free = NULL;
    h->next_free = c->free_list;
    if (c->free_list) c->free_list->prev_free = h;
    c->free_list = h;
    if (over && whole) give_back_chunk(a, k);
    pthread_mutex_unlock(&a->lock);
}
