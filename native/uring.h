/*
 * tierstore io_uring core: the ABI that tierstore/io/_uring.py binds with ctypes.
 *
 * This header is the one declaration of that ABI. native/uring.c includes it (so the compiler checks the
 * definitions against it) and tests/io/test_native_abi.py checks the ctypes bindings against it: every
 * function's argument and result types, every constant, and the layout of struct ts_io as the compiler
 * laid it out (ts_io_layout). Every function returns 0 / a count, or -errno.
 */
#ifndef TIERSTORE_URING_H
#define TIERSTORE_URING_H

#include <stdint.h>

#define TS_READ 0
#define TS_WRITE 1

/* test-only fault injection kinds (ts_inject) */
#define TS_FAULT_NONE 0
#define TS_FAULT_EIO 1
#define TS_FAULT_SHORT 2
#define TS_FAULT_ENOSPC 3

struct ts_ring; /* opaque */

/* One request of a batch (ts_submit_many); Python builds arrays of it with numpy (IO_DTYPE). */
struct ts_io {
    uint64_t id;       /* returned with the completion; never 0 */
    int32_t op;        /* TS_READ / TS_WRITE */
    int32_t fd;        /* plain descriptor, or registered-file index when fixed_file != 0 */
    int32_t fixed_file;
    int32_t buf_index; /* registered buffer holding [addr, addr+len), or -1 */
    uint64_t addr;
    uint64_t len;      /* bytes */
    uint64_t off;      /* bytes */
};

int ts_ring_create(unsigned depth, struct ts_ring **out);
void ts_ring_destroy(struct ts_ring *r);
unsigned ts_ring_depth(struct ts_ring *r);
int ts_submit_many(struct ts_ring *r, const struct ts_io *ios, unsigned n);
int ts_wake(struct ts_ring *r);
void ts_inject(struct ts_ring *r, uint64_t nth, int kind);
int ts_reaper_start(struct ts_ring *r);
int ts_reaper_stop(struct ts_ring *r);
int ts_collect(struct ts_ring *r, uint64_t *ids, int64_t *results, int max, int wait, int *state);
int ts_register_buffers(struct ts_ring *r, void **addrs, uint64_t *lens, unsigned n);
int ts_unregister_buffers(struct ts_ring *r);
int ts_register_file_table(struct ts_ring *r, unsigned n);
int ts_update_file(struct ts_ring *r, unsigned slot, int fd);
int ts_probe(void);
/* sizeof(struct ts_io), then the offset of each field in declaration order, into out[0..n); returns the
 * count written, or -EINVAL when n is too small. */
int ts_io_layout(uint64_t *out, unsigned n);

#endif
