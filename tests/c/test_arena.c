/* test_arena.c: the CPU backend's buffer arena (cpu/cpu_arena.c), which every KV page and
 * workspace buffer comes from: blocks are 64-byte aligned, zeroed (fresh or reused), never
 * overlap (within a chunk, across chunks, among size classes), and blocks too large or of
 * too many distinct sizes come from the heap, as does everything without an arena. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>

#include "check.h"
#include "cpu/cpu_backend.h"

enum { PAGE = 16384, COUNT = 300 }; /* 300 KV-page-sized blocks: more than two chunks */

/* The process's resident memory, KiB (/proc/self/statm), or -1. */
static long resident_kib(void) {
    FILE *f = fopen("/proc/self/statm", "r");
    long total = 0, resident = -1;
    if (f) {
        if (fscanf(f, "%ld %ld", &total, &resident) != 2) resident = -1;
        fclose(f);
    }
    return resident < 0 ? -1 : resident * (sysconf(_SC_PAGESIZE) / 1024);
}

static bool all_zero(const unsigned char *p, size_t n) {
    for (size_t i = 0; i < n; i++)
        if (p[i]) return false;
    return true;
}

/* Blocks [from, to) still hold their own byte: no other block overlapped them. */
static void check_fills(void **blocks, const size_t *sizes, int from, int to, const char *what) {
    int overwritten = 0;
    for (int i = from; i < to; i++) {
        const unsigned char *p = blocks[i];
        for (size_t b = 0; b < sizes[i]; b++)
            if (p[b] != 1 + i % 250) { overwritten++; break; }
    }
    CHECK(overwritten == 0, "%s: %d blocks were overwritten by others", what, overwritten);
}

/* Allocates `count` blocks of the given sizes, checks each is aligned and zero, fills each
   with its own byte, then checks that no fill overwrote another block. */
static void alloc_fill_check(tl_cpu_arena *a, void **blocks, const size_t *sizes, int count, const char *what) {
    for (int i = 0; i < count; i++) {
        blocks[i] = tl_cpu_arena_alloc(a, sizes[i]);
        CHECK(blocks[i] != NULL, "%s: block %d", what, i);
        if (!blocks[i]) return;
        CHECK((uintptr_t)blocks[i] % 64 == 0, "%s: block %d at %p is not 64-byte aligned", what, i, blocks[i]);
        CHECK(all_zero(blocks[i], sizes[i]), "%s: block %d (%zu bytes) is not zeroed", what, i, sizes[i]);
        memset(blocks[i], 1 + i % 250, sizes[i]);
    }
    check_fills(blocks, sizes, 0, count, what);
}

static void release_all(tl_cpu_arena *a, void **blocks, int count) {
    for (int i = 0; i < count; i++) tl_cpu_arena_release(a, blocks[i]);
}

int main(void) {
    static void *blocks[COUNT];
    static size_t sizes[COUNT];
    tl_cpu_arena *a = tl_cpu_arena_new();
    CHECK(a != NULL, "tl_cpu_arena_new");
    if (!a) return check_summary();

    for (int i = 0; i < COUNT; i++) sizes[i] = PAGE;
    alloc_fill_check(a, blocks, sizes, COUNT, "fresh pages");
    /* Freed blocks are reused (the dirty ones): they must come back zeroed. */
    release_all(a, blocks, COUNT);
    alloc_fill_check(a, blocks, sizes, COUNT, "reused pages");
    release_all(a, blocks, COUNT);

    /* Freed blocks past the arena's idle bytes give their pages back (a burst of sessions
       kept the process at its peak while the model lived), and come back zeroed and apart.
       (Before the many sizes below, which fill the arena's size classes.) */
    {
        enum { BURST = 3000, BLOCK = 49152 }; /* a GPT-2 K/V page: 144 MiB */
        static void *burst[BURST];
        static size_t burst_sizes[BURST];
        for (int i = 0; i < BURST; i++) burst_sizes[i] = BLOCK;
        alloc_fill_check(a, burst, burst_sizes, BURST, "a burst");
        const long peak = resident_kib();
        release_all(a, burst, BURST);
        const long after = resident_kib();
        CHECK(peak - after > 100 * 1024, "a burst of 144 MiB freed: %ld KiB resident at its peak, %ld after (want at "
              "least 100 MiB fewer)", peak, after);
        alloc_fill_check(a, burst, burst_sizes, BURST, "a burst, again");
        /* every tenth block kept: no chunk is free whole, each freed block's whole pages go */
        const long full = resident_kib();
        static void *freed[BURST];
        static size_t freed_sizes[BURST];
        int n_freed = 0;
        for (int i = 0; i < BURST; i++)
            if (i % 10) {
                tl_cpu_arena_release(a, burst[i]);
                freed_sizes[n_freed] = BLOCK;
                freed[n_freed++] = NULL;
            }
        const long pinned = resident_kib();
        CHECK(full - pinned > 80 * 1024, "9 blocks in 10 freed, none a chunk whole: %ld KiB resident before, %ld after "
              "(want at least 80 MiB fewer)", full, pinned);
        alloc_fill_check(a, freed, freed_sizes, n_freed, "trimmed blocks, again");
        int kept_overwritten = 0;
        for (int i = 0; i < BURST; i += 10) {
            const unsigned char *p = burst[i];
            for (size_t b = 0; b < BLOCK; b++)
                if (p[b] != 1 + i % 250) { kept_overwritten++; break; }
        }
        CHECK(kept_overwritten == 0, "%d kept blocks were overwritten by the trimmed ones handed out again", kept_overwritten);
        for (int i = 0; i < BURST; i += 10) tl_cpu_arena_release(a, burst[i]);
        release_all(a, freed, n_freed);
    }

    /* Blocks larger than the arena's go back to the system when freed, also after a first
       burst of them freed (glibc then raised its mmap threshold to their size: the second
       burst came from its heap, whose top a small allocation made between them pinned, and
       300 sessions of the shipped model, closed, left 160 MB resident). */
    {
        enum { BIG = 200, BIG_BLOCK = 786432 }; /* a GPT-2 session's largest buffers: 150 MiB */
        static void *big[BIG], *pins[2][BIG];
        static size_t big_sizes[BIG];
        for (int i = 0; i < BIG; i++) big_sizes[i] = BIG_BLOCK;
        for (int round = 0; round < 2; round++) {
            for (int i = 0; i < BIG; i++) {
                big[i] = tl_cpu_arena_alloc(a, BIG_BLOCK);
                CHECK(big[i] && (uintptr_t)big[i] % 64 == 0 && all_zero(big[i], BIG_BLOCK), "large block %d", i);
                if (big[i]) memset(big[i], 1 + i % 250, BIG_BLOCK);
                pins[round][i] = malloc(64); /* (a session's small allocations, made between) */
            }
            check_fills(big, big_sizes, 0, BIG, "large blocks");
            const long peak = resident_kib();
            release_all(a, big, BIG);
            const long after = resident_kib();
            CHECK(peak - after > 120 * 1024, "round %d: 150 MiB of large blocks freed: %ld KiB resident at the peak, %ld "
                  "after (want at least 120 MiB fewer)", round + 1, peak, after);
            if (round == 0)
                for (int i = 0; i < BIG; i += 2) free(pins[0][i]); /* (the odd ones stay: the heap's top is in use) */
        }
        for (int i = 1; i < BIG; i += 2) free(pins[0][i]);
        for (int i = 0; i < BIG; i++) free(pins[1][i]);
    }

    /* Many distinct sizes (more than the arena keeps classes for), odd ones, a zero-byte
       one and ones above the arena's largest block, interleaved. */
    for (int i = 0; i < 60; i++) sizes[i] = i % 7 == 6 ? ((size_t)1 << 20) + (size_t)i : (size_t)(i * 1000 + i % 3);
    alloc_fill_check(a, blocks, sizes, 60, "mixed sizes");
    release_all(a, blocks, 30); /* half freed, then reallocated among the live half */
    alloc_fill_check(a, blocks, sizes, 30, "mixed sizes, reused");
    check_fills(blocks, sizes, 30, 60, "mixed sizes, the live half");
    release_all(a, blocks, 60);

    /* Without an arena every block is the heap's. */
    for (int i = 0; i < 4; i++) sizes[i] = PAGE;
    alloc_fill_check(NULL, blocks, sizes, 4, "no arena");
    release_all(NULL, blocks, 4);
    tl_cpu_arena_release(a, NULL); /* a no-op */

    tl_cpu_arena_free(a);
    tl_cpu_arena_free(NULL);
    return check_summary();
}
