/* cpu_arena.c: the CPU backend's buffers (tl_backend.alloc / free): small blocks carved
 * from 2 MiB chunks of transparent huge pages, larger ones from the C heap.
 *
 * Why: KV pages are allocated while decoding, 16 rows of one slot at a time. From the C
 * heap every fresh 4 KiB of them was a page fault on first touch; on a VM with costly
 * faults (~14 us each, measured) that was ~9 faults and ~120 us per token of the shipped
 * model, a quarter of its decode time. A chunk faults once per 2 MiB.
 *
 * A freed block waits on the free list of its exact size (a model's small buffers come in
 * a few sizes: the KV page, the workspace's rows) and is zeroed when handed out again;
 * chunk memory returns to the system when the backend closes. Every block, from a chunk
 * or the heap, has a 64-byte header before it saying which. */
#define _DEFAULT_SOURCE /* MAP_ANONYMOUS, MADV_HUGEPAGE */
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>

#include "cpu_backend.h"

#define CHUNK_BYTES ((size_t)2 << 20)
#define HEADER 64                         /* keeps the block 64-byte aligned */
#define ARENA_MAX_BLOCK ((size_t)256 << 10) /* larger blocks: the C heap */
#define SIZE_CLASSES 16                   /* distinct block sizes kept; others: the C heap */
#define FROM_HEAP UINT32_MAX

typedef struct block_header {
    uint32_t size_class; /* index into the arena's classes, or FROM_HEAP */
    void *next_free;     /* on its class's free list: the next free block (its header) */
} block_header;

typedef struct size_class {
    size_t bytes;     /* header included; 0 = unused */
    void *free_list;  /* headers of freed blocks */
} size_class;

struct tl_cpu_arena {
    pthread_mutex_t lock; /* two sessions on one model allocate from it at once */
    size_class classes[SIZE_CLASSES];
    void **chunks;        /* mappings, for unmapping at close */
    int n_chunks, cap_chunks;
    uint8_t *bump, *bump_end; /* the unused tail of the newest chunk */
};

tl_cpu_arena *tl_cpu_arena_new(void) {
    tl_cpu_arena *a = calloc(1, sizeof *a);
    if (a && pthread_mutex_init(&a->lock, NULL) != 0) {
        free(a);
        return NULL;
    }
    return a;
}

void tl_cpu_arena_free(tl_cpu_arena *a) {
    if (!a) return;
    for (int i = 0; i < a->n_chunks; i++) munmap(a->chunks[i], CHUNK_BYTES);
    free(a->chunks);
    pthread_mutex_destroy(&a->lock);
    free(a);
}

/* A new 2 MiB-aligned chunk as the bump region; false when out of memory. */
static bool new_chunk(tl_cpu_arena *a) {
    if (a->n_chunks == a->cap_chunks) {
        const int cap = a->cap_chunks ? a->cap_chunks * 2 : 16;
        void **grown = realloc(a->chunks, (size_t)cap * sizeof *grown);
        if (!grown) return false;
        a->chunks = grown;
        a->cap_chunks = cap;
    }
    /* Over-map by a chunk and trim, so that the chunk is aligned to a huge page. */
    uint8_t *raw = mmap(NULL, 2 * CHUNK_BYTES, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (raw == MAP_FAILED) return false;
    uint8_t *chunk = (uint8_t *)(((uintptr_t)raw + CHUNK_BYTES - 1) & ~(uintptr_t)(CHUNK_BYTES - 1));
    if (chunk > raw) munmap(raw, (size_t)(chunk - raw));
    munmap(chunk + CHUNK_BYTES, CHUNK_BYTES - (size_t)(chunk - raw));
#ifdef MADV_HUGEPAGE
    madvise(chunk, CHUNK_BYTES, MADV_HUGEPAGE); /* advisory: without it the chunk still works */
#endif
    a->chunks[a->n_chunks++] = chunk;
    a->bump = chunk;
    a->bump_end = chunk + CHUNK_BYTES;
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

/* A block of the arena (zeroed), or NULL to take the heap instead. */
static block_header *arena_block(tl_cpu_arena *a, size_t bytes) {
    pthread_mutex_lock(&a->lock);
    block_header *h = NULL;
    const int c = class_of(a, bytes);
    if (c >= 0 && a->classes[c].free_list) {
        h = a->classes[c].free_list;
        a->classes[c].free_list = h->next_free;
        memset(h, 0, bytes);
    } else if (c >= 0 && ((size_t)(a->bump_end - a->bump) >= bytes || new_chunk(a))) {
        h = (block_header *)a->bump; /* fresh mapping: already zero */
        a->bump += bytes;
    }
    if (h) h->size_class = (uint32_t)c;
    pthread_mutex_unlock(&a->lock);
    return h;
}

void *tl_cpu_arena_alloc(tl_cpu_arena *a, size_t bytes) {
    const size_t total = HEADER + ((bytes + 63) & ~(size_t)63);
    block_header *h = a && total <= ARENA_MAX_BLOCK ? arena_block(a, total) : NULL;
    if (!h) {
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
    pthread_mutex_lock(&a->lock);
    size_class *c = &a->classes[h->size_class];
    h->next_free = c->free_list;
    c->free_list = h;
    pthread_mutex_unlock(&a->lock);
}
