/* fail_alloc.h: force-included (-include) into every library object of the allocation-
 * failure build (test_alloc_fail), so that each allocation the engine makes goes through a
 * counting wrapper (fail_alloc.c) that can make the N-th one fail, without touching the
 * engine's sources. No system header here: it comes before each file's feature macros; the
 * macros rename the libc declarations too, which keeps them consistent. free and munmap are
 * not wrapped (the wrappers return real libc memory). */
#ifndef TL_FAIL_ALLOC_H
#define TL_FAIL_ALLOC_H

void *tl_test_malloc(__SIZE_TYPE__ size);
void *tl_test_calloc(__SIZE_TYPE__ n, __SIZE_TYPE__ size);
void *tl_test_realloc(void *p, __SIZE_TYPE__ size);
int tl_test_posix_memalign(void **p, __SIZE_TYPE__ align, __SIZE_TYPE__ size);
char *tl_test_strdup(const char *s);
void *tl_test_mmap(void *addr, __SIZE_TYPE__ len, int prot, int flags, int fd, long off);

#define malloc tl_test_malloc
#define calloc tl_test_calloc
#define realloc tl_test_realloc
#define posix_memalign tl_test_posix_memalign
#define strdup tl_test_strdup
#define mmap tl_test_mmap

#endif
