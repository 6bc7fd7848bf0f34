/* util.c: error reporting, aligned memory and the clock shared by the engine. */
#define _POSIX_C_SOURCE 200809L
#define _DEFAULT_SOURCE /* MAP_ANONYMOUS, MADV_HUGEPAGE */
#include <errno.h>
#include <fcntl.h>
#include <locale.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "internal.h"
#include "tokenizer.h" /* tl_tlz_utf8_seq */

/* ---------------------------------------------------------------- errors */

/* One message per thread: concurrent sessions must not see each other's errors. */
static _Thread_local char last_error[TL_ERROR_MAX];

/* The C locale, made once (glibc's is a static object: newlocale allocates nothing for it). */
static locale_t c_locale;
static pthread_once_t c_locale_once = PTHREAD_ONCE_INIT;
static void make_c_locale(void) { c_locale = newlocale(LC_ALL_MASK, "C", (locale_t)0); }

void *tl_enter_c_locale(void) {
    pthread_once(&c_locale_once, make_c_locale);
    /* (this thread's locale only, uselocale's: the host's other threads keep theirs; without
       the C locale, out of memory, the host's) */
    return c_locale ? (void *)uselocale(c_locale) : NULL;
}

void tl_leave_c_locale(void *callers) {
    if (callers) uselocale((locale_t)callers);
}

/* The start of the UTF-8 character text[at] is in (a cut there keeps whole characters). */
static size_t character_start(const char *text, size_t at) {
    while (at > 0 && ((unsigned char)text[at] & 0xC0) == 0x80) at--;
    return at;
}

/* Messages do not follow the host's locale either: a program that had called
   setlocale(LC_ALL, "") under a comma-decimal one read "top_p = 1,5 must be in (0, 1]", a
   comma beside the interval's own. A message longer than TL_ERROR_MAX keeps its start and
   its end, " ... " between them: most say "PATH: why", and a path may be PATH_MAX (4096)
   bytes long, where the first 1023 bytes had been a piece of the path and no reason. */
tl_status tl_fail(tl_status status, const char *fmt, ...) {
    void *callers = tl_enter_c_locale();
    char whole[2 * 4096]; /* (two paths and their words; longer, the message's end is lost) */
    va_list ap;
    va_start(ap, fmt);
    const int n = vsnprintf(whole, sizeof whole, fmt, ap);
    va_end(ap);
    tl_leave_c_locale(callers);
    size_t len = n < 0 ? 0 : (size_t)n < sizeof whole ? (size_t)n : sizeof whole - 1;
    if ((size_t)n > len && len > 0) { /* (cut by the buffer: not inside a character) */
        const size_t last = character_start(whole, len - 1);
        if (tl_tlz_utf8_seq((const unsigned char *)whole + last, len - last) == 0) len = last; /* (unfinished) */
        whole[len] = '\0';
    }
    if (len < sizeof last_error) {
        memcpy(last_error, whole, len + 1);
    } else {
        static const char cut[] = " ... ";
        const size_t head = character_start(whole, 256);
        size_t tail_from = len - (sizeof last_error - 1 - head - (sizeof cut - 1));
        while (tail_from < len && ((unsigned char)whole[tail_from] & 0xC0) == 0x80) tail_from++; /* (whole characters) */
        memcpy(last_error, whole, head);
        memcpy(last_error + head, cut, sizeof cut - 1);
        memcpy(last_error + head + sizeof cut - 1, whole + tail_from, len - tail_from + 1);
    }
    return status;
}

tl_status tl_fail_null(const char *fn, int count, ...) {
    va_list ap;
    va_start(ap, count);
    const char *which = NULL;
    for (int i = 0; i < count && !which; i++) {
        const char *name = va_arg(ap, const char *);
        const void *pointer = va_arg(ap, const void *);
        if (!pointer) which = name;
    }
    va_end(ap);
    return which ? tl_fail(TL_ERR_INVALID_ARGUMENT, "%s: %s must not be NULL", fn, which)
                 : tl_fail(TL_ERR_INVALID_ARGUMENT, "%s: a NULL argument", fn);
}

void tl_clear_error(void) { last_error[0] = '\0'; }

const char *tl_last_error(void) { return last_error; }

const char *tl_status_name(tl_status status) {
    switch (status) {
    case TL_OK: return "TL_OK";
    case TL_ERR_INVALID_ARGUMENT: return "TL_ERR_INVALID_ARGUMENT";
    case TL_ERR_IO: return "TL_ERR_IO";
    case TL_ERR_FORMAT: return "TL_ERR_FORMAT";
    case TL_ERR_NO_MEMORY: return "TL_ERR_NO_MEMORY";
    case TL_ERR_UNSUPPORTED: return "TL_ERR_UNSUPPORTED";
    case TL_ERR_HOOK: return "TL_ERR_HOOK";
    case TL_ERR_INTERNAL: return "TL_ERR_INTERNAL";
    default: return "TL_ERR_UNKNOWN";
    }
}

const char *tl_version(void) { return TINYLOOP_VERSION; }

/* ---------------------------------------------------------------- fork() */

static atomic_uint forks; /* fork()s that made this process, counted in each child */
static pthread_once_t fork_count_once = PTHREAD_ONCE_INIT;
static void count_fork(void) { atomic_fetch_add_explicit(&forks, 1, memory_order_relaxed); }
static void register_fork_count(void) { pthread_atfork(NULL, NULL, count_fork); }

unsigned tl_process_mark(void) {
    pthread_once(&fork_count_once, register_fork_count);
    return atomic_load_explicit(&forks, memory_order_relaxed);
}

bool tl_forked_since(unsigned mark) { return atomic_load_explicit(&forks, memory_order_relaxed) != mark; }

/* ---------------------------------------------------------------- memory / time */

void *tl_alloc_aligned(size_t bytes) {
    void *p = NULL;
    size_t rounded = (bytes + 63) & ~(size_t)63;
    if (rounded == 0) rounded = 64;
    if (posix_memalign(&p, 64, rounded) != 0) return NULL;
    memset(p, 0, rounded);
    return p;
}

void tl_free_aligned(void *ptr) { free(ptr); }

double tl_now_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec * 1e3 + (double)ts.tv_nsec * 1e-6;
}

void *tl_map_huge(size_t bytes, void **region, size_t *region_len) {
    const size_t huge = (size_t)2 << 20;
    const size_t len = (bytes + huge - 1) / huge * huge + huge; /* room to align the start */
    void *mapped = mmap(NULL, len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (mapped == MAP_FAILED) return NULL;
#ifdef MADV_HUGEPAGE
    madvise(mapped, len, MADV_HUGEPAGE); /* advisory: without it the memory still works */
#endif
    *region = mapped;
    *region_len = len;
    return (void *)(((uintptr_t)mapped + huge - 1) & ~(uintptr_t)(huge - 1));
}

/* ---------------------------------------------------------------- hashing */

#define HASH_PRIME 0x100000001b3ull /* FNV's 64-bit prime: odd, so multiplying is a bijection */

static uint64_t hash_word(uint64_t h, uint64_t word) {
    h = (h ^ word) * HASH_PRIME;
    return h ^ (h >> 29); /* also a bijection: high bits reach the low ones */
}

static uint64_t load_le64(const uint8_t *b) {
    uint64_t w = 0;
    for (int i = 7; i >= 0; i--) w = (w << 8) | b[i];
    return w;
}

void tl_hash_init(tl_hasher *hs) { *hs = (tl_hasher){.h = 0xcbf29ce484222325ull}; }

void tl_hash_add(tl_hasher *hs, const void *bytes, size_t n) {
    const uint8_t *b = bytes;
    hs->total += n;
    while (n && hs->n_tail) { /* finish a word begun by the previous piece */
        hs->tail[hs->n_tail++] = *b++;
        n--;
        if (hs->n_tail == 8) {
            hs->h = hash_word(hs->h, load_le64(hs->tail));
            hs->n_tail = 0;
        }
    }
    if (!n) return; /* the piece ended inside the unfinished word */
    for (; n >= 8; b += 8, n -= 8) hs->h = hash_word(hs->h, load_le64(b));
    memcpy(hs->tail, b, n);
    hs->n_tail = (int)n;
}

uint64_t tl_hash_final(const tl_hasher *hs) {
    uint8_t last[8] = {0};
    memcpy(last, hs->tail, (size_t)hs->n_tail);
    return hash_word(hash_word(hs->h, load_le64(last)), hs->total); /* the length: trailing zeros count */
}

/* ---------------------------------------------------------------- checkpoint files */

/* What a file that is not a regular one is, for the messages that refuse it. */
static const char *file_kind(mode_t mode) {
    return S_ISDIR(mode) ? "a directory" : S_ISFIFO(mode) ? "a FIFO" : S_ISCHR(mode) || S_ISBLK(mode) ? "a device"
         : S_ISSOCK(mode) ? "a socket" : "a special file";
}

tl_status tl_open_regular(const char *path, size_t max_bytes, int *fd, size_t *size) {
    *fd = -1;
    *size = 0;
    /* O_NONBLOCK: opening a FIFO for reading would otherwise wait for a writer forever;
       on a regular file it changes nothing. */
    int f = open(path, O_RDONLY | O_CLOEXEC | O_NONBLOCK);
    if (f < 0) {
        struct stat lsb;
        if (errno == ENOENT && lstat(path, &lsb) == 0 && S_ISLNK(lsb.st_mode))
            return tl_fail(TL_ERR_IO, "%s: is a dangling symbolic link", path);
        return tl_fail(TL_ERR_IO, "%s: cannot open: %s", path, strerror(errno));
    }
    struct stat sb;
    if (fstat(f, &sb) != 0) {
        int e = errno;
        close(f);
        return tl_fail(TL_ERR_IO, "%s: cannot stat: %s", path, strerror(e));
    }
    if (!S_ISREG(sb.st_mode)) {
        close(f);
        return tl_fail(TL_ERR_IO, "%s: is %s, not a regular file", path, file_kind(sb.st_mode));
    }
    if (sb.st_size < 0 || (unsigned long long)sb.st_size > max_bytes) {
        close(f);
        return tl_fail(TL_ERR_FORMAT, "%s: %lld bytes exceeds the limit of %zu bytes for this file",
                       path, (long long)sb.st_size, max_bytes);
    }
    *fd = f;
    *size = (size_t)sb.st_size;
    return TL_OK;
}

tl_status tl_read_exact(int fd, const char *path, void *buf, size_t size) {
    size_t got = 0;
    while (got < size) {
        ssize_t r = read(fd, (char *)buf + got, size - got);
        if (r < 0 && errno == EINTR) continue;
        if (r <= 0) break; /* an error, or the file shrank while we read it */
        got += (size_t)r;
    }
    if (got != size)
        return tl_fail(TL_ERR_IO, "%s: short read (%zu of %zu bytes; changed while loading?)", path, got, size);
    return TL_OK;
}

tl_status tl_read_regular(const char *path, size_t max_bytes, char **out, size_t *len) {
    *out = NULL;
    *len = 0;
    int fd;
    size_t size;
    tl_status st = tl_open_regular(path, max_bytes, &fd, &size);
    if (st != TL_OK) return st;
    char *buf = malloc(size + 1);
    if (!buf) {
        close(fd);
        return tl_fail(TL_ERR_NO_MEMORY, "out of memory reading %s (%zu bytes)", path, size);
    }
    st = tl_read_exact(fd, path, buf, size);
    close(fd);
    if (st != TL_OK) {
        free(buf);
        return st;
    }
    buf[size] = '\0';
    *out = buf;
    *len = size;
    return TL_OK;
}

/* A new file beside `path` (a state file, a quantised checkpoint), created like any file (mode 0666 less the umask;
   mkstemp would make it 0600), or, where it replaces a regular file, with that file's mode
   and owner: a state file (a conversation's tokens) its user had made 0600 became 0644 at the
   next save. Its name is unique in this process by a counter and across
   processes by the pid; O_EXCL refuses a leftover of an earlier crash, and the next name is
   tried. The name is hidden and holds at most 64 bytes of path's own (".NAME.tmp-PID-N": path's
   whole name and the suffix passed the file system's 255 bytes for names of 240 and more).
   What is at `path` must be a regular file or a symbolic link (the rename replaces the link,
   never writes through it), or nothing: renamed over a device or a FIFO, the file took its
   place (as root, `/dev/full` became a regular file) and the writer reported success. */
tl_status tl_create_beside(const char *path, int *fd, char **temp) {
    static atomic_uint counter;
    *fd = -1;
    *temp = NULL;
    struct stat sb;
    const bool found = lstat(path, &sb) == 0;
    if (found && !S_ISREG(sb.st_mode) && !S_ISLNK(sb.st_mode))
        return tl_fail(TL_ERR_IO, "%s: is %s, not a regular file: it is not replaced", path, file_kind(sb.st_mode));
    const bool replacing = found && S_ISREG(sb.st_mode); /* (a link is replaced by a file of our own) */
    const char *slash = strrchr(path, '/');
    const int dir_len = slash ? (int)(slash - path) + 1 : 0; /* with its '/' */
    const size_t n = (size_t)dir_len + 64 + 48;
    char *name = malloc(n);
    if (!name) return tl_fail(TL_ERR_NO_MEMORY, "out of memory");
    for (int attempt = 0; attempt < 100; attempt++) {
        snprintf(name, n, "%.*s.%.64s.tmp-%ld-%u", dir_len, path, path + dir_len, (long)getpid(),
                 atomic_fetch_add(&counter, 1));
        /* (replacing a file: created as its owner's bits alone, so that no one who may not
           read the file it replaces opens this one before its mode and owner are that
           file's: permissions are checked at open) */
        *fd = open(name, O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, replacing ? (sb.st_mode & 0700) : 0666);
        if (*fd >= 0) {
            if (replacing) {
                /* the owner first (another than ours only as root, else EPERM, and the group
                   alone where we are in it), then the mode, as sed -i and vim do */
                if (fchown(*fd, sb.st_uid, sb.st_gid) != 0) (void)fchown(*fd, (uid_t)-1, sb.st_gid);
                (void)fchmod(*fd, sb.st_mode & 0777); /* (no set-id bits on a file we wrote) */
            }
            *temp = name;
            return TL_OK;
        }
        if (errno != EEXIST) break;
    }
    const int failure = errno;
    free(name);
    return tl_fail(TL_ERR_IO, "%s: cannot create a file beside it: %s", path, strerror(failure));
}

/* Makes a rename in path's directory durable (best effort: some file systems refuse to
   sync a directory, and the file itself is already complete either way). */
void tl_sync_directory_of(const char *path) {
    const char *slash = strrchr(path, '/');
    char *dir = slash ? strndup(path, slash == path ? 1 : (size_t)(slash - path)) : strdup(".");
    if (!dir) return;
    const int fd = open(dir, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (fd >= 0) {
        (void)fsync(fd);
        close(fd);
    }
    free(dir);
}
