/* fail_alloc.c: the counting allocators behind fail_alloc.h (compiled without it). Every
 * call counts; while armed, the call whose count equals fail_at fails (NULL, ENOMEM or
 * MAP_FAILED), once. Atomic: worker threads may allocate. */
#define _POSIX_C_SOURCE 200809L
#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>

#include "fail_alloc_control.h"

static long counter, fail_at, failed;

void tl_test_alloc_arm(long n) {
    __atomic_store_n(&counter, 0, __ATOMIC_SEQ_CST);
    __atomic_store_n(&failed, 0, __ATOMIC_SEQ_CST);
    __atomic_store_n(&fail_at, n, __ATOMIC_SEQ_CST);
}
long tl_test_alloc_count(void) { return __atomic_load_n(&counter, __ATOMIC_SEQ_CST); }
long tl_test_alloc_failed(void) { return __atomic_load_n(&failed, __ATOMIC_SEQ_CST); }

static int should_fail(void) {
    long n = __atomic_add_fetch(&counter, 1, __ATOMIC_SEQ_CST);
    if (n != __atomic_load_n(&fail_at, __ATOMIC_SEQ_CST)) return 0;
    __atomic_add_fetch(&failed, 1, __ATOMIC_SEQ_CST);
    errno = ENOMEM;
    return 1;
}

void *tl_test_malloc(size_t size) { return should_fail() ? NULL : malloc(size); }
void *tl_test_calloc(size_t n, size_t size) { return should_fail() ? NULL : calloc(n, size); }
void *tl_test_realloc(void *p, size_t size) { return should_fail() ? NULL : realloc(p, size); }
int tl_test_posix_memalign(void **p, size_t align, size_t size) {
    return should_fail() ? ENOMEM : posix_memalign(p, align, size);
}
char *tl_test_strdup(const char *s) { return should_fail() ? NULL : strdup(s); }
void *tl_test_mmap(void *addr, size_t len, int prot, int flags, int fd, long off) {
    return should_fail() ? MAP_FAILED : mmap(addr, len, prot, flags, fd, (off_t)off);
}
