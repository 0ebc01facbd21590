/*
 * tierstore native I/O core: a small io_uring driver over the raw syscalls.
 *
 * No liburing, no libaio: the kernel ABI structures are declared below (they are stable since 5.1),
 * so the file builds with gcc and libc alone, whatever the installed kernel headers say.
 *
 * Model (see docs/io.md, [Note: ring ownership]):
 *   - any thread may call ts_submit_many(); the submission queue, the pending list and the in-flight count
 *     are guarded by ring->lock;
 *   - exactly one thread touches the completion queue: the native completion thread started by
 *     ts_reaper_start(). It reaps, resubmits short completions and refills the ring from the pending FIFO
 *     without ever needing Python (or the GIL), so the disk stays busy while Python threads are busy or
 *     descheduled. Finished requests go to a done-list that Python drains with ts_collect().
 *   - a request is a read or write of `len` bytes at `off`. It is kept in flight until every byte is
 *     done: a short completion is resubmitted for the remainder, -EINTR / -EAGAIN are retried, any other
 *     error ends the request with that -errno. A zero-byte read (end of file) ends it with the bytes done.
 *   - at most `depth` requests are in flight; the rest wait in a FIFO and enter as slots free up.
 * Every function returns 0 / a count, or -errno. Nothing here asserts on caller input.
 */
#define _GNU_SOURCE
#include <Python.h> /* only for the empty module init at the bottom */

#include <errno.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <sys/uio.h>
#include <stddef.h>
#include <unistd.h>

#include "uring.h"

/* ---- kernel ABI (include/uapi/linux/io_uring.h) --------------------------------------------- */

#ifndef __NR_io_uring_setup
#define __NR_io_uring_setup 425
#endif
#ifndef __NR_io_uring_enter
#define __NR_io_uring_enter 426
#endif
#ifndef __NR_io_uring_register
#define __NR_io_uring_register 427
#endif

struct k_sqe {
    uint8_t opcode;
    uint8_t flags;
    uint16_t ioprio;
    int32_t fd;
    uint64_t off;
    uint64_t addr;
    uint32_t len;
    uint32_t rw_flags;
    uint64_t user_data;
    uint16_t buf_index;
    uint16_t personality;
    int32_t splice_fd_in;
    uint64_t addr3;
    uint64_t pad2;
};

struct k_cqe {
    uint64_t user_data;
    int32_t res;
    uint32_t flags;
};

struct k_sq_offsets {
    uint32_t head, tail, ring_mask, ring_entries, flags, dropped, array, resv1;
    uint64_t user_addr;
};

struct k_cq_offsets {
    uint32_t head, tail, ring_mask, ring_entries, overflow, cqes, flags, resv1;
    uint64_t user_addr;
};

struct k_params {
    uint32_t sq_entries, cq_entries, flags, sq_thread_cpu, sq_thread_idle, features, wq_fd;
    uint32_t resv[3];
    struct k_sq_offsets sq_off;
    struct k_cq_offsets cq_off;
};

struct k_files_update {
    uint32_t offset;
    uint32_t resv;
    uint64_t fds; /* pointer to int32_t[] */
};

_Static_assert(sizeof(struct k_sqe) == 64, "io_uring sqe is 64 bytes");
_Static_assert(sizeof(struct k_cqe) == 16, "io_uring cqe is 16 bytes");
_Static_assert(sizeof(struct k_params) == 120, "io_uring_params is 120 bytes");

enum {
    OP_NOP = 0,
    OP_READ_FIXED = 4,
    OP_WRITE_FIXED = 5,
    OP_READ = 22,
    OP_WRITE = 23,
};
#define SQE_FIXED_FILE (1u << 0)
#define SETUP_CQSIZE (1u << 3)
#define SETUP_CLAMP (1u << 4)
#define FEAT_SINGLE_MMAP (1u << 0)
#define ENTER_GETEVENTS (1u << 0)
#define OFF_SQ_RING 0ULL
#define OFF_CQ_RING 0x8000000ULL
#define OFF_SQES 0x10000000ULL
#define REG_BUFFERS 0
#define REG_UNREGISTER_BUFFERS 1
#define REG_FILES 2
#define REG_FILES_UPDATE 6

/* ---- constants (the public ones are in uring.h) ------------------------------------------------ */

#define TS_WAKE_ID 0ULL /* user_data of the wake-up NOP; request ids are never 0 */

/* ---- ring --------------------------------------------------------------------------------- */

struct ts_req {
    uint64_t id;
    int op;          /* TS_READ / TS_WRITE */
    int fd;          /* plain fd, or index into the registered file table when fixed_file */
    int fixed_file;
    int buf_index;   /* registered buffer index, or -1 */
    char *buf;
    uint64_t len;    /* bytes */
    uint64_t off;    /* bytes */
    uint64_t done;   /* bytes completed so far */
    struct ts_req *next;
};

struct ts_ring {
    int fd;
    unsigned depth;  /* max requests in flight */
    /* submission side, guarded by lock */
    pthread_mutex_t lock;
    unsigned inflight;
    struct ts_req *pending_head, *pending_tail;
    uint32_t *sq_head, *sq_tail, *sq_mask, *sq_array;
    struct k_sqe *sqes;
    unsigned sq_entries;
    /* completion side, reaper thread only */
    uint32_t *cq_head, *cq_tail, *cq_mask;
    struct k_cqe *cqes;
    /* mappings */
    void *sq_ring;
    size_t sq_ring_sz;
    void *cq_ring;
    size_t cq_ring_sz;
    size_t sqes_sz;
    /* test-only fault injection: the fault_nth-th I/O completion (1-based) is altered */
    uint64_t completions;
    uint64_t fault_nth;
    int fault_kind;
    /* native completion thread and its done-list, guarded by done_lock */
    pthread_t reaper;
    int reaper_started;
    pthread_mutex_t done_lock;
    pthread_cond_t done_cond;
    uint64_t *done_ids;
    int64_t *done_res;
    size_t done_head, done_len, done_cap; /* entries [done_head, done_head + done_len) */
    int stop;     /* set by ts_reaper_stop() */
    int exited;   /* the completion thread has returned */
    int failed;   /* -errno when the ring itself failed */
};

static int sys_setup(unsigned entries, struct k_params *p)
{
    return (int)syscall(__NR_io_uring_setup, entries, p);
}

static int sys_enter(int fd, unsigned to_submit, unsigned min_complete, unsigned flags)
{
    return (int)syscall(__NR_io_uring_enter, fd, to_submit, min_complete, flags, NULL, 0);
}

static int sys_register(int fd, unsigned opcode, const void *arg, unsigned nr_args)
{
    return (int)syscall(__NR_io_uring_register, fd, opcode, arg, nr_args);
}

static unsigned round_pow2(unsigned v)
{
    unsigned p = 1;
    while (p < v)
        p <<= 1;
    return p;
}

static void ring_unmap(struct ts_ring *r)
{
    if (r->sqes && r->sqes != MAP_FAILED)
        munmap(r->sqes, r->sqes_sz);
    if (r->cq_ring && r->cq_ring != MAP_FAILED && r->cq_ring != r->sq_ring)
        munmap(r->cq_ring, r->cq_ring_sz);
    if (r->sq_ring && r->sq_ring != MAP_FAILED)
        munmap(r->sq_ring, r->sq_ring_sz);
}

/* Create a ring allowing `depth` requests in flight. Returns 0 and *out, or -errno. */
int ts_ring_create(unsigned depth, struct ts_ring **out)
{
    if (depth == 0 || depth > 4096 || out == NULL)
        return -EINVAL;
    struct ts_ring *r = calloc(1, sizeof(*r));
    if (!r)
        return -ENOMEM;
    struct k_params p;
    memset(&p, 0, sizeof(p));
    unsigned entries = round_pow2(depth + 1); /* + 1: room for a wake NOP beside a full window */
    /* One CQ slot per in-flight request plus the wake NOP can never overflow with 2x entries. */
    p.flags = SETUP_CQSIZE | SETUP_CLAMP;
    p.cq_entries = 2 * entries + 2;
    int fd = sys_setup(entries, &p);
    if (fd < 0) {
        int err = -errno;
        free(r);
        return err;
    }
    r->fd = fd;
    r->depth = depth < p.sq_entries ? depth : p.sq_entries;
    r->sq_entries = p.sq_entries;
    r->sq_ring_sz = p.sq_off.array + p.sq_entries * sizeof(uint32_t);
    r->cq_ring_sz = p.cq_off.cqes + p.cq_entries * sizeof(struct k_cqe);
    if (p.features & FEAT_SINGLE_MMAP) {
        if (r->cq_ring_sz > r->sq_ring_sz)
            r->sq_ring_sz = r->cq_ring_sz;
        r->cq_ring_sz = r->sq_ring_sz;
    }
    r->sq_ring = mmap(NULL, r->sq_ring_sz, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, fd, OFF_SQ_RING);
    if (r->sq_ring == MAP_FAILED)
        goto fail;
    if (p.features & FEAT_SINGLE_MMAP) {
        r->cq_ring = r->sq_ring;
    } else {
        r->cq_ring = mmap(NULL, r->cq_ring_sz, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, fd, OFF_CQ_RING);
        if (r->cq_ring == MAP_FAILED)
            goto fail;
    }
    r->sqes_sz = p.sq_entries * sizeof(struct k_sqe);
    r->sqes = mmap(NULL, r->sqes_sz, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, fd, OFF_SQES);
    if (r->sqes == MAP_FAILED)
        goto fail;

    char *sq = r->sq_ring, *cq = r->cq_ring;
    r->sq_head = (uint32_t *)(sq + p.sq_off.head);
    r->sq_tail = (uint32_t *)(sq + p.sq_off.tail);
    r->sq_mask = (uint32_t *)(sq + p.sq_off.ring_mask);
    r->sq_array = (uint32_t *)(sq + p.sq_off.array);
    r->cq_head = (uint32_t *)(cq + p.cq_off.head);
    r->cq_tail = (uint32_t *)(cq + p.cq_off.tail);
    r->cq_mask = (uint32_t *)(cq + p.cq_off.ring_mask);
    r->cqes = (struct k_cqe *)(cq + p.cq_off.cqes);
    pthread_mutex_init(&r->lock, NULL);
    pthread_mutex_init(&r->done_lock, NULL);
    pthread_cond_init(&r->done_cond, NULL);
    *out = r;
    return 0;

fail : {
    int err = -errno;
    ring_unmap(r);
    close(fd);
    free(r);
    return err;
}
}

/* Free the ring (stopping the completion thread). The caller guarantees no request is in flight. */
void ts_ring_destroy(struct ts_ring *r)
{
    if (!r)
        return;
    ts_reaper_stop(r);
    free(r->done_ids);
    free(r->done_res);
    pthread_mutex_destroy(&r->done_lock);
    pthread_cond_destroy(&r->done_cond);
    struct ts_req *q = r->pending_head;
    while (q) {
        struct ts_req *n = q->next;
        free(q);
        q = n;
    }
    ring_unmap(r);
    close(r->fd);
    pthread_mutex_destroy(&r->lock);
    free(r);
}

unsigned ts_ring_depth(struct ts_ring *r) { return r->depth; }

/* Fill one SQE for `q` (lock held). The SQ cannot be full: in flight <= depth <= sq_entries, and every
 * queued SQE is handed to the kernel by push_submit() before the lock is released. */
static void sqe_fill(struct ts_ring *r, struct ts_req *q)
{
    /* The kernel advances sq_head as it consumes entries: acquire pairs with its release. */
    uint32_t tail = *r->sq_tail;
    uint32_t idx = tail & *r->sq_mask;
    struct k_sqe *s = &r->sqes[idx];
    memset(s, 0, sizeof(*s));
    if (q == NULL) {
        s->opcode = OP_NOP;
        s->user_data = TS_WAKE_ID;
    } else {
        int fixed_buf = q->buf_index >= 0;
        if (q->op == TS_READ)
            s->opcode = fixed_buf ? OP_READ_FIXED : OP_READ;
        else
            s->opcode = fixed_buf ? OP_WRITE_FIXED : OP_WRITE;
        s->fd = q->fd;
        if (q->fixed_file)
            s->flags |= SQE_FIXED_FILE;
        uint64_t rest = q->len - q->done;
        /* one SQE moves at most 2 GiB - 4 KiB (the kernel's MAX_RW_COUNT); the rest resubmits */
        if (rest > 0x7ffff000ULL)
            rest = 0x7ffff000ULL;
        s->addr = (uint64_t)(uintptr_t)(q->buf + q->done);
        s->len = (uint32_t)rest;
        s->off = q->off + q->done;
        if (fixed_buf)
            s->buf_index = (uint16_t)q->buf_index;
        s->user_data = (uint64_t)(uintptr_t)q;
    }
    r->sq_array[idx] = idx;
    /* Publish the SQE contents before the new tail: the kernel reads the tail with acquire. */
    __atomic_store_n(r->sq_tail, tail + 1, __ATOMIC_RELEASE);
}

/* Hand every queued SQE to the kernel (lock held). Returns 0 or -errno. */
static int push_submit(struct ts_ring *r)
{
    for (;;) {
        uint32_t head = __atomic_load_n(r->sq_head, __ATOMIC_ACQUIRE);
        uint32_t queued = *r->sq_tail - head;
        if (queued == 0)
            return 0;
        int n = sys_enter(r->fd, queued, 0, 0);
        if (n < 0) {
            if (errno == EINTR || errno == EAGAIN || errno == EBUSY)
                continue;
            return -errno;
        }
    }
}

/* Move pending requests into free slots (lock held). */
static int fill_from_pending(struct ts_ring *r)
{
    int queued = 0;
    while (r->pending_head && r->inflight < r->depth) {
        struct ts_req *q = r->pending_head;
        r->pending_head = q->next;
        if (!r->pending_head)
            r->pending_tail = NULL;
        q->next = NULL;
        sqe_fill(r, q);
        r->inflight++;
        queued = 1;
    }
    return queued ? push_submit(r) : 0;
}

/* struct ts_io (uring.h) is mirrored by a numpy dtype in tierstore/io/_uring.py. */
_Static_assert(sizeof(struct ts_io) == 48, "ts_io layout is shared with Python");

/*
 * Queue `n` reads/writes with one lock and one io_uring_enter for the whole batch (a syscall per request
 * costs more than a small request's transfer). All or nothing: on -EINVAL / -ENOMEM none is queued.
 * Returns 0 (every completion will carry its id) or -errno.
 */
int ts_submit_many(struct ts_ring *r, const struct ts_io *ios, unsigned n)
{
    if (!r || (n > 0 && !ios))
        return -EINVAL;
    for (unsigned i = 0; i < n; i++) {
        const struct ts_io *io = &ios[i];
        if (io->id == TS_WAKE_ID || (io->op != TS_READ && io->op != TS_WRITE) || io->fd < 0 ||
            (io->len > 0 && io->addr == 0))
            return -EINVAL;
    }
    struct ts_req *head = NULL, *tail = NULL;
    for (unsigned i = 0; i < n; i++) {
        struct ts_req *q = calloc(1, sizeof(*q));
        if (!q) {
            while (head) {
                struct ts_req *next = head->next;
                free(head);
                head = next;
            }
            return -ENOMEM;
        }
        const struct ts_io *io = &ios[i];
        q->id = io->id;
        q->op = io->op;
        q->fd = io->fd;
        q->fixed_file = io->fixed_file != 0;
        q->buf_index = io->buf_index;
        q->buf = (char *)(uintptr_t)io->addr;
        q->len = io->len;
        q->off = io->off;
        if (tail)
            tail->next = q;
        else
            head = q;
        tail = q;
    }
    if (!head)
        return 0;
    pthread_mutex_lock(&r->lock);
    if (r->pending_tail)
        r->pending_tail->next = head;
    else
        r->pending_head = head;
    r->pending_tail = tail;
    int rc = fill_from_pending(r);
    pthread_mutex_unlock(&r->lock);
    return rc;
}

/* Wake the thread blocked in ts_reap(): it returns with *woken set. */
int ts_wake(struct ts_ring *r)
{
    pthread_mutex_lock(&r->lock);
    sqe_fill(r, NULL);
    int rc = push_submit(r);
    pthread_mutex_unlock(&r->lock);
    return rc;
}

/* Test-only: alter the nth I/O completion from now on (1-based) with `kind`; 0 disarms. Called from any
 * thread while the completion thread runs: kind is published before nth (release), read after (acquire). */
void ts_inject(struct ts_ring *r, uint64_t nth, int kind)
{
    __atomic_store_n(&r->fault_kind, kind, __ATOMIC_RELAXED);
    uint64_t seen = __atomic_load_n(&r->completions, __ATOMIC_RELAXED);
    __atomic_store_n(&r->fault_nth, nth ? seen + nth : 0, __ATOMIC_RELEASE);
}

static int32_t apply_fault(struct ts_ring *r, int32_t res)
{
    uint64_t count = __atomic_add_fetch(&r->completions, 1, __ATOMIC_RELAXED);
    uint64_t nth = __atomic_load_n(&r->fault_nth, __ATOMIC_ACQUIRE);
    if (nth == 0 || count != nth)
        return res;
    __atomic_store_n(&r->fault_nth, 0, __ATOMIC_RELAXED);
    switch (__atomic_load_n(&r->fault_kind, __ATOMIC_RELAXED)) {
    case TS_FAULT_EIO:
        return -EIO;
    case TS_FAULT_ENOSPC:
        return -ENOSPC;
    case TS_FAULT_SHORT:
        /* Pretend only part was done (kept 4 KiB aligned so an O_DIRECT remainder stays legal). The
         * remainder is resubmitted, so the request must still end complete and correct. */
        if (res >= 8192)
            return (res / 2) & ~4095;
        return res > 1 ? res / 2 : res;
    default:
        return res;
    }
}

/*
 * Reap finished requests into ids[] / results[] (at most `max`). A result is the bytes transferred
 * (equal to the length unless end of file was reached) or -errno. When `wait` is non-zero and nothing
 * has finished yet, block until something does. *woken is set when a ts_wake() NOP was consumed.
 * Returns the number of entries written, or -errno if the ring itself failed.
 * Only one thread may reap at a time.
 */
static int ts_reap(struct ts_ring *r, uint64_t *ids, int64_t *results, int max, int wait, int *woken)
{
    int n = 0;
    *woken = 0;
    for (;;) {
        /* The kernel publishes CQEs then the tail (release); acquire the tail before reading them. */
        uint32_t head = *r->cq_head;
        uint32_t tail = __atomic_load_n(r->cq_tail, __ATOMIC_ACQUIRE);
        int resubmit = 0;
        while (head != tail && n < max) {
            struct k_cqe *c = &r->cqes[head & *r->cq_mask];
            uint64_t ud = c->user_data;
            int32_t res = c->res;
            head++;
            if (ud == TS_WAKE_ID) {
                *woken = 1;
                continue;
            }
            struct ts_req *q = (struct ts_req *)(uintptr_t)ud;
            res = apply_fault(r, res);
            int finished = 0;
            int64_t result = 0;
            if (res == -EINTR || res == -EAGAIN) {
                resubmit = 1;
            } else if (res < 0) {
                finished = 1;
                result = res;
            } else if (res == 0 && q->done < q->len) {
                finished = 1; /* end of file (read) or a device that accepts nothing (write) */
                result = (int64_t)q->done;
            } else {
                q->done += (uint64_t)res;
                if (q->done >= q->len) {
                    finished = 1;
                    result = (int64_t)q->done;
                } else {
                    resubmit = 1;
                }
            }
            if (finished) {
                ids[n] = q->id;
                results[n] = result;
                n++;
                free(q);
                pthread_mutex_lock(&r->lock);
                r->inflight--;
                pthread_mutex_unlock(&r->lock);
            } else {
                /* Keep the slot: the same request goes back in for what is left. */
                pthread_mutex_lock(&r->lock);
                sqe_fill(r, q);
                pthread_mutex_unlock(&r->lock);
            }
        }
        /* Release the consumed CQEs to the kernel. */
        __atomic_store_n(r->cq_head, head, __ATOMIC_RELEASE);
        pthread_mutex_lock(&r->lock);
        int rc = fill_from_pending(r);
        if (rc == 0 && resubmit)
            rc = push_submit(r);
        pthread_mutex_unlock(&r->lock);
        if (rc < 0)
            return rc;
        if (n > 0 || *woken || !wait)
            return n;
        if (head != __atomic_load_n(r->cq_tail, __ATOMIC_ACQUIRE))
            continue;
        int e = sys_enter(r->fd, 0, 1, ENTER_GETEVENTS);
        if (e < 0 && errno != EINTR && errno != EAGAIN && errno != EBUSY)
            return -errno;
    }
}

/* Append finished requests to the done-list (done_lock held). Returns 0 or -ENOMEM. */
static int done_push(struct ts_ring *r, const uint64_t *ids, const int64_t *res, int n)
{
    if (r->done_head + r->done_len + (size_t)n > r->done_cap) {
        if (r->done_head) { /* slide the live entries to the front first */
            memmove(r->done_ids, r->done_ids + r->done_head, r->done_len * sizeof(uint64_t));
            memmove(r->done_res, r->done_res + r->done_head, r->done_len * sizeof(int64_t));
            r->done_head = 0;
        }
        if (r->done_len + (size_t)n > r->done_cap) {
            size_t cap = r->done_cap ? r->done_cap : 1024;
            while (cap < r->done_len + (size_t)n)
                cap *= 2;
            uint64_t *ni = realloc(r->done_ids, cap * sizeof(uint64_t));
            if (ni)
                r->done_ids = ni;
            int64_t *nr = realloc(r->done_res, cap * sizeof(int64_t));
            if (nr)
                r->done_res = nr;
            if (!ni || !nr)
                return -ENOMEM;
            r->done_cap = cap;
        }
    }
    memcpy(r->done_ids + r->done_head + r->done_len, ids, (size_t)n * sizeof(uint64_t));
    memcpy(r->done_res + r->done_head + r->done_len, res, (size_t)n * sizeof(int64_t));
    r->done_len += (size_t)n;
    return 0;
}

static void *reaper_main(void *arg)
{
    struct ts_ring *r = arg;
    uint64_t ids[256];
    int64_t res[256];
    for (;;) {
        int woken = 0;
        int n = ts_reap(r, ids, res, 256, 1, &woken);
        pthread_mutex_lock(&r->done_lock);
        if (n > 0 && done_push(r, ids, res, n) < 0)
            n = -ENOMEM; /* cannot record completions: treat as a ring failure, reported to every caller */
        if (n < 0)
            r->failed = n;
        int leave = n < 0 || (woken && r->stop);
        if (leave)
            r->exited = 1;
        if (n != 0 || leave)
            pthread_cond_broadcast(&r->done_cond);
        pthread_mutex_unlock(&r->done_lock);
        if (leave)
            return NULL;
    }
}

/* Start the native completion thread. Returns 0 or -errno. */
int ts_reaper_start(struct ts_ring *r)
{
    if (r->reaper_started)
        return 0;
    int rc = pthread_create(&r->reaper, NULL, reaper_main, r);
    if (rc != 0)
        return -rc;
    r->reaper_started = 1;
    return 0;
}

/* Stop the completion thread after what is in flight has finished (the caller waited for it). */
int ts_reaper_stop(struct ts_ring *r)
{
    if (!r->reaper_started)
        return 0;
    pthread_mutex_lock(&r->done_lock);
    r->stop = 1;
    int exited = r->exited;
    pthread_mutex_unlock(&r->done_lock);
    int rc = exited ? 0 : ts_wake(r);
    pthread_join(r->reaper, NULL);
    r->reaper_started = 0;
    pthread_mutex_lock(&r->done_lock);
    r->exited = 1;
    pthread_cond_broadcast(&r->done_cond); /* let a collector waiting on an empty list return */
    pthread_mutex_unlock(&r->done_lock);
    return rc;
}

/*
 * Take up to `max` finished requests (id, bytes or -errno) off the done-list, oldest first. With `wait`,
 * block until there is one. Returns the count; 0 with *state = 1 once the completion thread has exited
 * and nothing is left; -errno (the ring's failure) once a failed ring's list is drained.
 */
int ts_collect(struct ts_ring *r, uint64_t *ids, int64_t *results, int max, int wait, int *state)
{
    *state = 0;
    pthread_mutex_lock(&r->done_lock);
    while (wait && r->done_len == 0 && !r->exited)
        pthread_cond_wait(&r->done_cond, &r->done_lock);
    int n = r->done_len < (size_t)max ? (int)r->done_len : max;
    memcpy(ids, r->done_ids + r->done_head, (size_t)n * sizeof(uint64_t));
    memcpy(results, r->done_res + r->done_head, (size_t)n * sizeof(int64_t));
    r->done_head += (size_t)n;
    r->done_len -= (size_t)n;
    if (r->done_len == 0)
        r->done_head = 0;
    int ret = n;
    if (n == 0 && r->exited) {
        *state = 1;
        if (r->failed)
            ret = r->failed;
    }
    pthread_mutex_unlock(&r->done_lock);
    return ret;
}

/* Register [addrs[i], addrs[i]+lens[i]) as fixed buffers 0..n-1. Returns 0 or -errno. */
int ts_register_buffers(struct ts_ring *r, void **addrs, uint64_t *lens, unsigned n)
{
    if (n == 0)
        return -EINVAL;
    struct iovec *iov = calloc(n, sizeof(*iov));
    if (!iov)
        return -ENOMEM;
    for (unsigned i = 0; i < n; i++) {
        iov[i].iov_base = addrs[i];
        iov[i].iov_len = lens[i];
    }
    int rc = sys_register(r->fd, REG_BUFFERS, iov, n);
    int err = rc < 0 ? -errno : 0;
    free(iov);
    return err;
}

int ts_unregister_buffers(struct ts_ring *r)
{
    return sys_register(r->fd, REG_UNREGISTER_BUFFERS, NULL, 0) < 0 ? -errno : 0;
}

/* Create a sparse registered-file table of `n` slots (all -1). Returns 0 or -errno. */
int ts_register_file_table(struct ts_ring *r, unsigned n)
{
    int32_t *fds = malloc(n * sizeof(int32_t));
    if (!fds)
        return -ENOMEM;
    for (unsigned i = 0; i < n; i++)
        fds[i] = -1;
    int rc = sys_register(r->fd, REG_FILES, fds, n);
    int err = rc < 0 ? -errno : 0;
    free(fds);
    return err;
}

/* Put `fd` (or -1 to clear) into slot `slot` of the registered-file table. Returns 0 or -errno. */
int ts_update_file(struct ts_ring *r, unsigned slot, int fd)
{
    int32_t v = fd;
    struct k_files_update up;
    memset(&up, 0, sizeof(up));
    up.offset = slot;
    up.fds = (uint64_t)(uintptr_t)&v;
    int rc = sys_register(r->fd, REG_FILES_UPDATE, &up, 1);
    return rc < 0 ? -errno : 0;
}

/* Can this process set up a ring at all? 0 when yes, else -errno (ENOSYS, EPERM under seccomp...). */
int ts_probe(void)
{
    struct ts_ring *r = NULL;
    int rc = ts_ring_create(4, &r);
    if (rc == 0)
        ts_ring_destroy(r);
    return rc;
}

int ts_io_layout(uint64_t *out, unsigned n)
{
    const uint64_t layout[] = {
        sizeof(struct ts_io), offsetof(struct ts_io, id), offsetof(struct ts_io, op), offsetof(struct ts_io, fd),
        offsetof(struct ts_io, fixed_file), offsetof(struct ts_io, buf_index), offsetof(struct ts_io, addr),
        offsetof(struct ts_io, len), offsetof(struct ts_io, off),
    };
    const unsigned count = sizeof(layout) / sizeof(layout[0]);
    if (!out || n < count)
        return -EINVAL;
    memcpy(out, layout, sizeof(layout));
    return (int)count;
}

/* The module is loaded with ctypes; this init only lets the import system find the built file. */
static struct PyModuleDef moddef = {
    PyModuleDef_HEAD_INIT, "_native_uring", "tierstore io_uring core (ctypes)", -1, NULL, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__native_uring(void) { return PyModule_Create(&moddef); }
