/*
 * The public kvf_* functions. Each is compiled against the hand-written
 * include/kvferry.h (so the compiler checks that the definitions match the
 * documented prototypes) and calls the Go export kvfgo_* declared in the
 * cgo-generated _cgo_export.h (so the compiler checks those calls too).
 * Handles and addresses cross as uintptr_t: the Go side never holds them in
 * pointer variables. What needs no Go (version, status strings, the
 * thread's last error) stays in C.
 */
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kvferry.h"
#include "_cgo_export.h"

_Static_assert(sizeof(void *) == 8, "kvferry needs a 64-bit platform");
_Static_assert(sizeof(kvf_engine) == sizeof(uintptr_t), "handles are uintptr_t ids");
_Static_assert(sizeof(kvf_request) == 48, "kvf_request layout is part of the ABI");
_Static_assert(sizeof(kvf_task_status) == 16, "kvf_task_status layout is part of the ABI");
_Static_assert(sizeof(kvf_engine_options) == 120, "kvf_engine_options layout is part of the ABI");
_Static_assert(sizeof(kvf_memory_range) == 24, "kvf_memory_range layout is part of the ABI");
_Static_assert(sizeof(kvf_event) == 152, "kvf_event layout is part of the ABI");
_Static_assert(sizeof(kvf_fence_result) == 32, "kvf_fence_result layout is part of the ABI");
_Static_assert(KVF_STATUS_MAX == KVF_ERR_UNAUTHENTICATED, "KVF_STATUS_MAX is the last code");

/* ---- the calling thread's last error ---------------------------------- */

#define KVFI_ERRMAX 2048

/* Each thread's message lives in a buffer malloc'd on its first failure and
 * freed by a pthread key destructor when the thread exits. Only the pointer
 * is thread-local: the Go runtime makes this library's TLS block static
 * (DF_STATIC_TLS), and a large one would make dlopen fail with "cannot
 * allocate memory in static TLS block". */
static __thread char *kvfi_err;
static pthread_key_t kvfi_key;
static pthread_once_t kvfi_once = PTHREAD_ONCE_INIT;

static void kvfi_key_init(void) { (void)pthread_key_create(&kvfi_key, free); }

/* Called by Go (on the caller's thread) with a message that is not
 * NUL-terminated and is not kept. Without memory the message is lost; the
 * status code still tells what happened. */
void kvfi_set_error(const char *msg, size_t len) {
    char *b = kvfi_err;
    if (b == NULL) {
        (void)pthread_once(&kvfi_once, kvfi_key_init);
        b = malloc(KVFI_ERRMAX);
        if (b == NULL) return;
        kvfi_err = b;
        (void)pthread_setspecific(kvfi_key, b);
    }
    if (len >= KVFI_ERRMAX) {
        len = KVFI_ERRMAX - 1;
        memcpy(b, msg, len);
        memcpy(b + len - 3, "...", 3);
    } else {
        memcpy(b, msg, len);
    }
    b[len] = 0;
}

const char *kvf_last_error(void) { return kvfi_err != NULL ? kvfi_err : ""; }

/* ---- version and strings ---------------------------------------------- */

uint32_t kvf_version(void) { return KVF_VERSION_NUMBER; }

const char *kvf_version_string(void) { return KVF_VERSION_STRING; }

const char *kvf_status_str(int status) {
    switch (status) {
    case KVF_OK: return "ok";
    case KVF_ERR_INVALID: return "invalid argument";
    case KVF_ERR_HANDLE: return "invalid handle";
    case KVF_ERR_OVERLAP: return "range overlaps a registered range";
    case KVF_ERR_NOT_REGISTERED: return "memory is not registered";
    case KVF_ERR_REMOTE_RANGE: return "remote range is not registered at the peer";
    case KVF_ERR_STALE_KEY: return "buffer key is stale";
    case KVF_ERR_REFUSED: return "refused by the owner";
    case KVF_ERR_TIMEOUT: return "timed out";
    case KVF_ERR_CANCELED: return "canceled";
    case KVF_ERR_CONNECTION: return "connection failed";
    case KVF_ERR_UNREACHABLE: return "peer unreachable";
    case KVF_ERR_BUSY: return "batch has transfers in flight";
    case KVF_ERR_BATCH_FULL: return "batch capacity exceeded";
    case KVF_ERR_CLOSED: return "engine closed";
    case KVF_ERR_UNSUPPORTED: return "not supported";
    case KVF_ERR_TRANSFER_FAILED: return "transfer failed";
    case KVF_ERR_NO_MEMORY: return "out of memory";
    case KVF_ERR_INTERNAL: return "internal error";
    case KVF_ERR_ABORTED: return "aborted by the owner";
    case KVF_ERR_PROTOCOL: return "protocol violation by a peer";
    case KVF_ERR_TRUNCATED: return "output buffer too small";
    case KVF_ERR_IN_USE: return "memory may still be touched";
    case KVF_ERR_FENCED: return "range fenced by the owner";
    case KVF_ERR_UNAUTHENTICATED: return "peer not authenticated";
    }
    return "unknown status";
}

const char *kvf_task_state_str(int state) {
    switch (state) {
    case KVF_TASK_WAITING: return "WAITING";
    case KVF_TASK_PENDING: return "PENDING";
    case KVF_TASK_COMPLETED: return "COMPLETED";
    case KVF_TASK_FAILED: return "FAILED";
    case KVF_TASK_TIMEOUT: return "TIMEOUT";
    case KVF_TASK_CANCELED: return "CANCELED";
    case KVF_TASK_ABORTED: return "ABORTED";
    }
    return "UNKNOWN";
}

/* ---- engine ------------------------------------------------------------ */

#define H(h) ((uintptr_t)(h))

kvf_status kvf_engine_create(const kvf_engine_options *opts, kvf_engine *out) {
    uintptr_t id = 0;
    kvf_status st = (kvf_status)kvfgo_engine_create((kvf_engine_options *)opts, out ? &id : NULL);
    if (st == KVF_OK) *out = (kvf_engine)id;
    return st;
}

kvf_status kvf_engine_destroy(kvf_engine engine) { return (kvf_status)kvfgo_engine_destroy(H(engine)); }

kvf_status kvf_engine_name(kvf_engine engine, char *buf, size_t cap, size_t *len_out) {
    return (kvf_status)kvfgo_engine_name(H(engine), buf, cap, len_out);
}

kvf_status kvf_metrics_text(kvf_engine engine, char *buf, size_t cap, size_t *len_out) {
    return (kvf_status)kvfgo_metrics_text(H(engine), buf, cap, len_out);
}

kvf_status kvf_metrics_addr(kvf_engine engine, char *buf, size_t cap, size_t *len_out) {
    return (kvf_status)kvfgo_metrics_addr(H(engine), buf, cap, len_out);
}

kvf_status kvf_engine_public_key(kvf_engine engine, char *buf, size_t cap, size_t *len_out) {
    return (kvf_status)kvfgo_engine_public_key(H(engine), buf, cap, len_out);
}

kvf_status kvf_engine_reload_allowlist(kvf_engine engine, int timeout_ms) {
    return (kvf_status)kvfgo_engine_reload_allowlist(H(engine), timeout_ms);
}

kvf_status kvf_engine_stats(kvf_engine engine, kvf_stats *out) {
    return (kvf_status)kvfgo_engine_stats(H(engine), out);
}

/* ---- memory ------------------------------------------------------------ */

kvf_status kvf_register_memory(kvf_engine engine, void *addr, size_t len, const char *location) {
    return (kvf_status)kvfgo_register_memory(H(engine), (uintptr_t)addr, len, (char *)location);
}

kvf_status kvf_unregister_memory(kvf_engine engine, void *addr) {
    return (kvf_status)kvfgo_unregister_memory(H(engine), (uintptr_t)addr);
}

kvf_status kvf_register_memory_batch(kvf_engine engine, const kvf_memory_range *ranges, size_t n) {
    return (kvf_status)kvfgo_register_memory_batch(H(engine), (kvf_memory_range *)ranges, n);
}

kvf_status kvf_unregister_memory_batch(kvf_engine engine, void *const *addrs, size_t n) {
    return (kvf_status)kvfgo_unregister_memory_batch(H(engine), (uintptr_t *)addrs, n);
}

kvf_status kvf_alloc_buffer(kvf_engine engine, size_t len, const char *location, void **out) {
    uintptr_t addr = 0;
    kvf_status st = (kvf_status)kvfgo_alloc_buffer(H(engine), len, (char *)location, out ? &addr : NULL);
    if (st == KVF_OK) *out = (void *)addr;
    return st;
}

kvf_status kvf_free_buffer(kvf_engine engine, void *addr) {
    return (kvf_status)kvfgo_free_buffer(H(engine), (uintptr_t)addr);
}

/* ---- segments ---------------------------------------------------------- */

kvf_status kvf_open_segment(kvf_engine engine, const char *name, int timeout_ms, kvf_segment *out) {
    uintptr_t id = 0;
    kvf_status st = (kvf_status)kvfgo_open_segment(H(engine), (char *)name, timeout_ms, out ? &id : NULL);
    if (st == KVF_OK) *out = (kvf_segment)id;
    return st;
}

kvf_status kvf_close_segment(kvf_segment segment) { return (kvf_status)kvfgo_close_segment(H(segment)); }

kvf_status kvf_segment_buffer_count(kvf_segment segment, size_t *count) {
    return (kvf_status)kvfgo_segment_buffer_count(H(segment), count);
}

kvf_status kvf_segment_buffer(kvf_segment segment, size_t index, uint64_t *addr, uint64_t *len) {
    return (kvf_status)kvfgo_segment_buffer(H(segment), index, addr, len);
}

kvf_status kvf_segment_name(kvf_segment segment, char *buf, size_t cap, size_t *len_out) {
    return (kvf_status)kvfgo_segment_name(H(segment), buf, cap, len_out);
}

/* ---- batches and transfers --------------------------------------------- */

kvf_status kvf_batch_alloc(kvf_engine engine, size_t capacity, kvf_batch *out) {
    uintptr_t id = 0;
    kvf_status st = (kvf_status)kvfgo_batch_alloc(H(engine), capacity, out ? &id : NULL);
    if (st == KVF_OK) *out = (kvf_batch)id;
    return st;
}

kvf_status kvf_batch_submit(kvf_batch batch, const kvf_request *reqs, size_t n) {
    return (kvf_status)kvfgo_batch_submit(H(batch), (kvf_request *)reqs, n);
}

kvf_status kvf_batch_status(kvf_batch batch, size_t index, kvf_task_status *out) {
    return (kvf_status)kvfgo_batch_status(H(batch), index, out);
}

kvf_status kvf_batch_status_all(kvf_batch batch, kvf_task_status *out, size_t cap, size_t *n_out) {
    return (kvf_status)kvfgo_batch_status_all(H(batch), out, cap, n_out);
}

kvf_status kvf_batch_task_error(kvf_batch batch, size_t index, char *buf, size_t cap, size_t *len_out) {
    return (kvf_status)kvfgo_batch_task_error(H(batch), index, buf, cap, len_out);
}

kvf_status kvf_batch_wait(kvf_batch batch, int timeout_ms) {
    return (kvf_status)kvfgo_batch_wait(H(batch), timeout_ms);
}

kvf_status kvf_batch_cancel(kvf_batch batch) { return (kvf_status)kvfgo_batch_cancel(H(batch)); }

kvf_status kvf_batch_free(kvf_batch batch) { return (kvf_status)kvfgo_batch_free(H(batch)); }

kvf_status kvf_transfer_sync(kvf_engine engine, const kvf_request *reqs, size_t n, int timeout_ms,
                             kvf_task_status *out) {
    return (kvf_status)kvfgo_transfer_sync(H(engine), (kvf_request *)reqs, n, timeout_ms, out);
}

/* ---- safe abort, grants, notifications, events -------------------------- */

kvf_status kvf_abort(kvf_engine engine, uint64_t request_id, const char *const *initiators, size_t n,
                     int timeout_ms, kvf_abort_result *out) {
    return (kvf_status)kvfgo_abort(H(engine), request_id, (char **)initiators, n, timeout_ms, out);
}

kvf_status kvf_grant(kvf_engine engine, const char *initiator, uint64_t request_id,
                     const kvf_grant_range *ranges, size_t n, uint64_t *grant_id) {
    return (kvf_status)kvfgo_grant(H(engine), (char *)initiator, request_id, (kvf_grant_range *)ranges, n,
                                   grant_id);
}

kvf_status kvf_revoke(kvf_engine engine, uint64_t grant_id, int timeout_ms) {
    return (kvf_status)kvfgo_revoke(H(engine), grant_id, timeout_ms);
}

kvf_status kvf_notify(kvf_segment segment, uint64_t request_id, const void *data, size_t len) {
    return (kvf_status)kvfgo_notify(H(segment), request_id, (void *)data, len);
}

kvf_status kvf_poll_events(kvf_engine engine, kvf_event *out, size_t cap, size_t *n_out, int timeout_ms) {
    return (kvf_status)kvfgo_poll_events(H(engine), out, cap, n_out, timeout_ms);
}

kvf_status kvf_event_fd(kvf_engine engine, int *fd) { return (kvf_status)kvfgo_event_fd(H(engine), fd); }

/* ---- fences by memory range --------------------------------------------- */

kvf_status kvf_fence_memory(kvf_engine engine, const uint64_t *addrs, const uint64_t *lengths, size_t n,
                            int timeout_ms, kvf_fence_result *out) {
    return (kvf_status)kvfgo_fence_memory(H(engine), (uint64_t *)addrs, (uint64_t *)lengths, n, timeout_ms, out);
}
