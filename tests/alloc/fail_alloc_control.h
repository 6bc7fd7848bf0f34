/* fail_alloc_control.h: the test's handle on the counting allocators (fail_alloc.c). */
#ifndef TL_FAIL_ALLOC_CONTROL_H
#define TL_FAIL_ALLOC_CONTROL_H

/* Resets the count; the n-th allocation from now fails (0: none does). */
void tl_test_alloc_arm(long n);
long tl_test_alloc_count(void);  /* allocations since the last arm */
long tl_test_alloc_failed(void); /* how many were made to fail (0 or 1) */
/* The counting malloc, for the libraries the engine calls (cJSON's hooks): their allocations
   fail in turn too. */
void *tl_test_malloc(__SIZE_TYPE__ size);

#endif
