/* Every documented failure returns its code and a message that says what
 * was wrong: NULL, garbage, wrong-kind and stale handles; NULL pointers;
 * zero lengths; ranges that wrap; memory that is not registered here or at
 * the peer; stale buffer keys; bad options; and what this build or library
 * version does not support (KVF_ERR_UNSUPPORTED). */
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "kvf_test.h"

static void test_strings(void) {
    for (int i = 0; i <= KVF_STATUS_MAX; i++) {
        const char *s = kvf_status_str(i);
        CHECK(s != NULL && s[0] != 0 && strcmp(s, "unknown status") != 0, "status %d", i);
        for (int j = 0; j < i; j++)
            CHECK(strcmp(s, kvf_status_str(j)) != 0, "statuses %d and %d share \"%s\"", i, j, s);
    }
    CHECK(strcmp(kvf_status_str(KVF_STATUS_MAX + 1), "unknown status") == 0, "past the last code");
    CHECK(strcmp(kvf_status_str(-1), "unknown status") == 0, "negative code");
    CHECK(strcmp(kvf_task_state_str(KVF_TASK_ABORTED), "ABORTED") == 0, "ABORTED");
    CHECK(strcmp(kvf_task_state_str(99), "UNKNOWN") == 0, "state 99");
}

static void test_handles(void) {
    int on_stack = 0;
    EXPECT_ERR(kvf_engine_destroy(NULL), KVF_ERR_HANDLE, "NULL engine handle");
    EXPECT_ERR(kvf_engine_destroy((kvf_engine)(uintptr_t)0x1234), KVF_ERR_HANDLE, "not a kvferry handle");
    EXPECT_ERR(kvf_engine_destroy((kvf_engine)(void *)&on_stack), KVF_ERR_HANDLE, "not a kvferry handle");
    EXPECT_ERR(kvf_engine_destroy((kvf_engine)(uintptr_t)0x6b76010000000000ull), KVF_ERR_HANDLE, "garbage");
    EXPECT_ERR(kvf_engine_destroy((kvf_engine)(uintptr_t)0x6b76ff0000000001ull), KVF_ERR_HANDLE, "garbage");
    EXPECT_ERR(kvf_engine_destroy((kvf_engine)(uintptr_t)0x6b760100ffffffffull), KVF_ERR_HANDLE, "garbage");
    EXPECT_ERR(kvf_close_segment(NULL), KVF_ERR_HANDLE, "NULL segment handle");
    EXPECT_ERR(kvf_batch_wait((kvf_batch)(uintptr_t)~0ull, 0), KVF_ERR_HANDLE, "not a kvferry handle");

    kvf_engine e = kvft_engine(), other = kvft_engine();
    char name[128];
    kvft_name(e, name, sizeof name);
    kvf_segment seg = NULL;
    CHECK_OK(kvf_open_segment(e, name, 5000, &seg));
    kvf_batch b = NULL;
    CHECK_OK(kvf_batch_alloc(e, 4, &b));

    /* Wrong kind. */
    EXPECT_ERR(kvf_engine_name((kvf_engine)seg, name, sizeof name, NULL), KVF_ERR_HANDLE,
               "is a segment handle, not an engine handle");
    EXPECT_ERR(kvf_batch_wait((kvf_batch)e, 0), KVF_ERR_HANDLE, "is an engine handle, not a batch handle");
    EXPECT_ERR(kvf_close_segment((kvf_segment)b), KVF_ERR_HANDLE, "is a batch handle, not a segment handle");
    EXPECT_ERR(kvf_engine_destroy((kvf_engine)b), KVF_ERR_HANDLE, "not an engine handle");

    /* A segment of another engine in a request. */
    void *buf = NULL;
    CHECK_OK(kvf_alloc_buffer(e, 65536, NULL, &buf));
    kvf_segment oseg = NULL;
    CHECK_OK(kvf_open_segment(other, name, 5000, &oseg));
    kvf_request r = kvft_req(KVF_OP_WRITE, buf, oseg, (uint64_t)(uintptr_t)buf + 4096, 64, 1);
    EXPECT_ERR(kvf_batch_submit(b, &r, 1), KVF_ERR_HANDLE, "request 0: invalid handle: segment");
    EXPECT_ERR(kvf_transfer_sync(e, &r, 1, 1000, NULL), KVF_ERR_HANDLE, "another engine");
    r.segment = (kvf_segment)(uintptr_t)0x99;
    EXPECT_ERR(kvf_batch_submit(b, &r, 1), KVF_ERR_HANDLE, "request 0");

    /* Stale: closed, freed, destroyed. */
    CHECK_OK(kvf_close_segment(oseg));
    EXPECT_ERR(kvf_close_segment(oseg), KVF_ERR_HANDLE, "stale");
    r.segment = oseg;
    EXPECT_ERR(kvf_batch_submit(b, &r, 1), KVF_ERR_HANDLE, "stale");
    CHECK_OK(kvf_batch_free(b));
    EXPECT_ERR(kvf_batch_free(b), KVF_ERR_HANDLE, "batch handle");
    EXPECT_ERR(kvf_batch_submit(b, &r, 1), KVF_ERR_HANDLE, "stale");
    EXPECT_ERR(kvf_batch_status(b, 0, NULL), KVF_ERR_HANDLE, "stale");
    CHECK_OK(kvf_engine_destroy(other));
    EXPECT_ERR(kvf_engine_name(other, name, sizeof name, NULL), KVF_ERR_HANDLE, "engine handle");
    EXPECT_ERR(kvf_engine_destroy(other), KVF_ERR_HANDLE, "stale");
    EXPECT_ERR(kvf_register_memory(other, buf, 64, NULL), KVF_ERR_HANDLE, "stale");

    CHECK_OK(kvf_close_segment(seg));
    CHECK_OK(kvf_engine_destroy(e));
}

static void test_options(void) {
    kvf_engine e = NULL;
    kvf_engine_options o;
    EXPECT_ERR(kvf_engine_create(NULL, NULL), KVF_ERR_INVALID, "out is NULL");
    kvf_engine_options_init(&o);
    o.struct_size = 0;
    EXPECT_ERR(kvf_engine_create(&o, &e), KVF_ERR_INVALID, "struct_size 0");
    kvf_engine_options_init(&o);
    o.log_level = 42;
    EXPECT_ERR(kvf_engine_create(&o, &e), KVF_ERR_INVALID, "log_level 42");
    kvf_engine_options_init(&o);
    o.flags = KVF_ENGINE_IGNORE_ENV;
    o.slice_size = 100;
    EXPECT_ERR(kvf_engine_create(&o, &e), KVF_ERR_INVALID, "slice size 100");
    kvf_engine_options_init(&o);
    o.flags = KVF_ENGINE_IGNORE_ENV;
    o.port = 70000;
    EXPECT_ERR(kvf_engine_create(&o, &e), KVF_ERR_INVALID, "port 70000");
    kvf_engine_options_init(&o);
    o.flags = KVF_ENGINE_IGNORE_ENV;
    o.metadata = "redis://127.0.0.1:6379";
    EXPECT_ERR(kvf_engine_create(&o, &e), KVF_ERR_INVALID, "etcd://host:port");
    kvf_engine_options_init(&o);
    o.flags = KVF_ENGINE_IGNORE_ENV;
    o.protocol = "rdma";
    if (access("/sys/class/infiniband_verbs/uverbs0", F_OK) == 0) {
        /* A machine with an RDMA device: forced rdma works there. */
        fprintf(stderr, "skip: protocol \"rdma\" without a device (this machine has one)\n");
    } else {
        EXPECT_ERR(kvf_engine_create(&o, &e), KVF_ERR_UNSUPPORTED, "rdma");
    }
    kvf_engine_options_init(&o);
    o.flags = 0x80;
    EXPECT_ERR(kvf_engine_create(&o, &e), KVF_ERR_UNSUPPORTED, "flags");
    kvf_engine_options_init(&o);
    o.default_timeout_ms = -5;
    EXPECT_ERR(kvf_engine_create(&o, &e), KVF_ERR_INVALID, "default_timeout_ms -5");

    /* A newer program's larger struct: fine while the unknown tail is zero. */
    struct {
        kvf_engine_options o;
        uint64_t newer_field;
    } big;
    memset(&big, 0, sizeof big);
    big.o.struct_size = sizeof big;
    big.o.flags = KVF_ENGINE_IGNORE_ENV;
    big.o.log_level = KVF_LOG_OFF;
    big.o.go_max_procs = 2;
    CHECK_OK(kvf_engine_create(&big.o, &e));
    CHECK_OK(kvf_engine_destroy(e));
    big.newer_field = 1;
    EXPECT_ERR(kvf_engine_create(&big.o, &e), KVF_ERR_UNSUPPORTED, "knows only");
    /* An older program's smaller struct: the missing fields are defaults. */
    kvf_engine_options_init(&o);
    o.struct_size = (uint32_t)offsetof(kvf_engine_options, port);
    CHECK_OK(kvf_engine_create(&o, &e));
    CHECK_OK(kvf_engine_destroy(e));
    CHECK_OK(kvf_engine_create(NULL, &e)); /* all defaults */
    CHECK_OK(kvf_engine_destroy(e));
}

static void test_memory(void) {
    kvf_engine e = kvft_engine();
    uint8_t *mem = NULL;
    CHECK(posix_memalign((void **)&mem, 4096, 65536) == 0, "posix_memalign");

    EXPECT_ERR(kvf_register_memory(e, NULL, 16, NULL), KVF_ERR_INVALID, "address is NULL");
    EXPECT_ERR(kvf_register_memory(e, mem, 0, NULL), KVF_ERR_INVALID, "length is 0");
    EXPECT_ERR(kvf_register_memory(e, (void *)(uintptr_t)(UINTPTR_MAX - 10), 100, NULL), KVF_ERR_INVALID,
               "wraps around");
    EXPECT_ERR(kvf_register_memory(e, (void *)(uintptr_t)16, 100, NULL), KVF_ERR_INVALID, "first page");
    EXPECT_ERR(kvf_register_memory(e, mem, 4096, "gpu"), KVF_ERR_INVALID, "location \"gpu\"");
    EXPECT_ERR(kvf_register_memory(e, mem, 4096, "cuda:0"), KVF_ERR_UNSUPPORTED, "cuda");
    CHECK_OK(kvf_register_memory(e, mem, 4096, NULL));
    EXPECT_ERR(kvf_register_memory(e, mem + 100, 16, NULL), KVF_ERR_OVERLAP, "overlaps");
    EXPECT_ERR(kvf_unregister_memory(e, mem + 8192), KVF_ERR_NOT_REGISTERED, "not registered");
    EXPECT_ERR(kvf_unregister_memory(e, NULL), KVF_ERR_INVALID, "NULL");

    /* Batches are all or none. */
    kvf_memory_range rs[3] = {{mem + 8192, 4096, NULL}, {mem + 16384, 4096, NULL}, {mem + 16384 + 100, 16, NULL}};
    EXPECT_ERR(kvf_register_memory_batch(e, rs, 3), KVF_ERR_OVERLAP, "same call");
    EXPECT_ERR(kvf_unregister_memory(e, mem + 8192), KVF_ERR_NOT_REGISTERED, "not registered");
    rs[2].len = 0;
    EXPECT_ERR(kvf_register_memory_batch(e, rs, 3), KVF_ERR_INVALID, "range 2 length is 0");
    EXPECT_ERR(kvf_register_memory_batch(e, NULL, 1), KVF_ERR_INVALID, "no ranges");
    EXPECT_ERR(kvf_register_memory_batch(e, rs, 0), KVF_ERR_INVALID, "no ranges");
    CHECK_OK(kvf_register_memory_batch(e, rs, 2));
    void *addrs[2] = {mem + 8192, mem + 24576};
    EXPECT_ERR(kvf_unregister_memory_batch(e, addrs, 2), KVF_ERR_NOT_REGISTERED, "not registered");
    addrs[1] = NULL;
    EXPECT_ERR(kvf_unregister_memory_batch(e, addrs, 2), KVF_ERR_INVALID, "address 1 is NULL");
    EXPECT_ERR(kvf_unregister_memory_batch(e, NULL, 2), KVF_ERR_INVALID, "no addresses");
    addrs[1] = mem + 16384;
    CHECK_OK(kvf_unregister_memory_batch(e, addrs, 2));

    void *p = NULL;
    EXPECT_ERR(kvf_alloc_buffer(e, 0, NULL, &p), KVF_ERR_INVALID, "length is 0");
    EXPECT_ERR(kvf_alloc_buffer(e, 4096, NULL, NULL), KVF_ERR_INVALID, "out is NULL");
    EXPECT_ERR(kvf_alloc_buffer(e, (size_t)1 << 50, NULL, &p), KVF_ERR_NO_MEMORY, "length");
    EXPECT_ERR(kvf_free_buffer(e, mem), KVF_ERR_INVALID, "not from AllocBuffer");
    CHECK_OK(kvf_alloc_buffer(e, 4096, NULL, &p));
    EXPECT_ERR(kvf_register_memory(e, p, 4096, NULL), KVF_ERR_OVERLAP, "overlaps");
    CHECK_OK(kvf_free_buffer(e, p));
    EXPECT_ERR(kvf_free_buffer(e, p), KVF_ERR_INVALID, "not from AllocBuffer");
    EXPECT_ERR(kvf_free_buffer(e, NULL), KVF_ERR_INVALID, "NULL");

    char small[4];
    size_t n = 0;
    EXPECT_ERR(kvf_engine_name(e, small, sizeof small, &n), KVF_ERR_TRUNCATED, "too small");
    CHECK(n > 8, "name length %zu reported on KVF_ERR_TRUNCATED", n);
    size_t n2 = 0;
    CHECK_OK(kvf_engine_name(e, NULL, 0, &n2));
    CHECK(n2 == n, "length query %zu vs %zu", n2, n);
    EXPECT_ERR(kvf_engine_name(e, NULL, 10, NULL), KVF_ERR_INVALID, "buf is NULL");

    kvf_stats st;
    EXPECT_ERR(kvf_engine_stats(e, NULL), KVF_ERR_INVALID, "out is NULL");
    memset(&st, 0, sizeof st);
    EXPECT_ERR(kvf_engine_stats(e, &st), KVF_ERR_INVALID, "struct_size 0");

    CHECK_OK(kvf_engine_destroy(e));
    free(mem);
}

static void test_segments(void) {
    kvf_engine e = kvft_engine();
    kvf_segment s = NULL;
    EXPECT_ERR(kvf_open_segment(e, NULL, 1000, &s), KVF_ERR_INVALID, "name is NULL");
    EXPECT_ERR(kvf_open_segment(e, "nocolon", 1000, &s), KVF_ERR_INVALID, "host:port");
    EXPECT_ERR(kvf_open_segment(e, "127.0.0.1:1", 0, &s), KVF_ERR_INVALID, "timeout 0");
    EXPECT_ERR(kvf_open_segment(e, "127.0.0.1:1", -7, &s), KVF_ERR_INVALID, "timeout -7");
    EXPECT_ERR(kvf_open_segment(e, "127.0.0.1:1", 1000, NULL), KVF_ERR_INVALID, "out is NULL");
    /* Nothing listens: the refused connection ends the wait at once. */
    double t0 = kvft_now_ms();
    EXPECT_ERR(kvf_open_segment(e, "127.0.0.1:1", 300, &s), KVF_ERR_UNREACHABLE, "connection refused");
    double took = kvft_now_ms() - t0;
    CHECK(took < 1500, "open of a refused port took %.0f ms for a 300 ms timeout", took);
    /* A host that does not answer: the call returns by its deadline. */
    t0 = kvft_now_ms();
    EXPECT_ERR(kvf_open_segment(e, "10.255.255.1:1", 300, &s), KVF_ERR_UNREACHABLE, "10.255.255.1:1");
    took = kvft_now_ms() - t0;
    CHECK(took >= 290 && took < 1500, "open of a silent peer took %.0f ms for a 300 ms timeout", took);

    char name[128];
    kvft_name(e, name, sizeof name);
    CHECK_OK(kvf_open_segment(e, name, 1000, &s));
    uint64_t a = 0;
    EXPECT_ERR(kvf_segment_buffer(s, 0, &a, NULL), KVF_ERR_INVALID, "has 0 buffers");
    EXPECT_ERR(kvf_segment_buffer_count(s, NULL), KVF_ERR_INVALID, "count is NULL");
    char small[3];
    EXPECT_ERR(kvf_segment_name(s, small, sizeof small, NULL), KVF_ERR_TRUNCATED, "too small");
    CHECK_OK(kvf_close_segment(s));
    CHECK_OK(kvf_engine_destroy(e));
}

static void test_requests(void) {
    kvf_engine e = kvft_engine(), peer = kvft_engine();
    char name[128], pname[128];
    kvft_name(e, name, sizeof name);
    kvft_name(peer, pname, sizeof pname);
    void *lp = NULL, *pp = NULL;
    CHECK_OK(kvf_alloc_buffer(e, 65536, NULL, &lp));
    CHECK_OK(kvf_alloc_buffer(peer, 65536, NULL, &pp));
    uint8_t *local = (uint8_t *)lp;
    uint64_t remote = (uint64_t)(uintptr_t)pp;
    kvf_segment self = NULL, ps = NULL;
    CHECK_OK(kvf_open_segment(e, name, 1000, &self));
    CHECK_OK(kvf_open_segment(e, pname, 5000, &ps));
    kvf_batch b = NULL;
    EXPECT_ERR(kvf_batch_alloc(e, 0, &b), KVF_ERR_INVALID, "capacity is 0");
    EXPECT_ERR(kvf_batch_alloc(e, 4, NULL), KVF_ERR_INVALID, "out is NULL");
    CHECK_OK(kvf_batch_alloc(e, 4, &b));

    kvf_request ok = kvft_req(KVF_OP_WRITE, local, ps, remote, 64, 1);
    kvf_request r[2] = {ok, ok};
    EXPECT_ERR(kvf_batch_submit(b, NULL, 1), KVF_ERR_INVALID, "reqs is NULL");
    EXPECT_ERR(kvf_batch_submit(b, r, 0), KVF_ERR_INVALID, "no requests");
    r[1].op = 7;
    EXPECT_ERR(kvf_batch_submit(b, r, 2), KVF_ERR_INVALID, "request 1: invalid argument: op 7");
    r[1] = ok;
    r[1].flags = 1;
    EXPECT_ERR(kvf_batch_submit(b, r, 2), KVF_ERR_INVALID, "request 1: invalid argument: flags");
    r[1] = ok;
    r[1].local = NULL;
    EXPECT_ERR(kvf_batch_submit(b, r, 2), KVF_ERR_INVALID, "request 1: invalid argument: local address is NULL");
    r[1] = ok;
    r[1].length = 0;
    EXPECT_ERR(kvf_batch_submit(b, r, 2), KVF_ERR_INVALID, "request 1: invalid argument: length is 0");
    r[1] = ok;
    r[1].remote = UINT64_MAX - 10;
    EXPECT_ERR(kvf_batch_submit(b, r, 2), KVF_ERR_INVALID, "remote range");
    r[1] = ok;
    r[1].local = (void *)(uintptr_t)(UINTPTR_MAX - 10);
    EXPECT_ERR(kvf_batch_submit(b, r, 2), KVF_ERR_INVALID, "local range");
    /* Not registered here, not registered at the peer, beyond a buffer's end. */
    r[1] = ok;
    r[1].local = local + 65536;
    EXPECT_ERR(kvf_batch_submit(b, r, 2), KVF_ERR_NOT_REGISTERED, "request 1: local memory");
    r[1] = ok;
    r[1].remote = remote + 65536 - 32;
    EXPECT_ERR(kvf_batch_submit(b, r, 2), KVF_ERR_REMOTE_RANGE, "request 1");
    r[1].segment = self; /* the engine's own segment: its memory is "local" too */
    EXPECT_ERR(kvf_batch_submit(b, r, 2), KVF_ERR_NOT_REGISTERED, "request 1: remote memory");
    /* None of the failed submits started anything. */
    size_t n = 99;
    CHECK_OK(kvf_batch_status_all(b, NULL, 0, &n));
    CHECK(n == 0, "failed submits left %zu tasks", n);
    EXPECT_ERR(kvf_batch_status_all(b, NULL, 3, &n), KVF_ERR_INVALID, "out is NULL");

    /* Capacity. */
    kvf_request five[5] = {ok, ok, ok, ok, ok};
    EXPECT_ERR(kvf_batch_submit(b, five, 5), KVF_ERR_BATCH_FULL, "capacity");
    CHECK_OK(kvf_batch_submit(b, five, 3));
    EXPECT_ERR(kvf_batch_submit(b, five, 2), KVF_ERR_BATCH_FULL, "holding 3 of 4");
    CHECK_OK(kvf_batch_wait(b, 5000));
    kvf_task_status ts;
    EXPECT_ERR(kvf_batch_status(b, 3, &ts), KVF_ERR_INVALID, "task 3");
    EXPECT_ERR(kvf_batch_status(b, (size_t)-1, &ts), KVF_ERR_INVALID, "task");
    EXPECT_ERR(kvf_batch_status(b, 0, NULL), KVF_ERR_INVALID, "out is NULL");
    EXPECT_ERR(kvf_batch_wait(b, -7), KVF_ERR_INVALID, "timeout -7");
    CHECK_OK(kvf_batch_free(b));

    EXPECT_ERR(kvf_transfer_sync(e, NULL, 1, 1000, NULL), KVF_ERR_INVALID, "reqs is NULL");
    EXPECT_ERR(kvf_transfer_sync(e, &ok, 0, 1000, NULL), KVF_ERR_INVALID, "no requests");
    EXPECT_ERR(kvf_transfer_sync(e, &ok, 1, 0, NULL), KVF_ERR_INVALID, "timeout 0");

    /* A stale buffer key: the peer registers its range again after we cached
     * its descriptor; the owner refuses the old key, and no retry routes
     * around the refusal (the next transfer is planned afresh). */
    CHECK_OK(kvf_transfer_sync(e, &ok, 1, 5000, NULL));
    uint8_t *pm = NULL;
    CHECK(posix_memalign((void **)&pm, 4096, 65536) == 0, "posix_memalign");
    CHECK_OK(kvf_register_memory(peer, pm, 65536, NULL));
    uint64_t pr = (uint64_t)(uintptr_t)pm;
    kvf_request k = kvft_req(KVF_OP_WRITE, local, ps, pr, 4096, 9);
    CHECK_OK(kvf_transfer_sync(e, &k, 1, 5000, NULL)); /* caches pm's key */
    CHECK_OK(kvf_unregister_memory(peer, pm));
    CHECK_OK(kvf_register_memory(peer, pm, 65536, NULL));
    kvf_task_status kst;
    EXPECT_ERR(kvf_transfer_sync(e, &k, 1, 5000, &kst), KVF_ERR_STALE_KEY, "task 0");
    CHECK(kst.state == KVF_TASK_FAILED && kst.error == KVF_ERR_STALE_KEY, "state %s error %s",
          kvf_task_state_str(kst.state), kvf_status_str(kst.error));
    /* The refusal made the segment refresh its descriptor: the next
     * transfer is planned under the new key and lands. */
    CHECK_OK(kvf_transfer_sync(e, &k, 1, 5000, NULL));
    CHECK_OK(kvf_unregister_memory(peer, pm));
    CHECK_OK(kvf_register_memory(peer, pm, 65536, NULL));
    CHECK_OK(kvf_batch_alloc(e, 1, &b));
    CHECK_OK(kvf_batch_submit(b, &k, 1));
    EXPECT_ERR(kvf_batch_wait(b, 5000), KVF_ERR_STALE_KEY, "task 0");
    char msg[512];
    size_t mlen = 0;
    CHECK_OK(kvf_batch_task_error(b, 0, msg, sizeof msg, &mlen));
    CHECK(mlen > 0 && strstr(msg, "stale") != NULL, "task error: %s", msg);
    CHECK_OK(kvf_batch_free(b));
    /* Unregistered at the peer but still in our cached descriptor. */
    CHECK_OK(kvf_unregister_memory(peer, pm));
    kvf_status gone = kvf_transfer_sync(e, &k, 1, 5000, &kst);
    CHECK(gone == KVF_ERR_STALE_KEY || gone == KVF_ERR_REFUSED || gone == KVF_ERR_REMOTE_RANGE,
          "WRITE into a range the peer unregistered: %s: %s", kvf_status_str(gone), kvf_last_error());

    CHECK_OK(kvf_engine_destroy(e));
    CHECK_OK(kvf_engine_destroy(peer));
    free(pm);
}

/* Argument errors of the abort, grant and event calls: each is an error
 * value with a message, never a crash. */
static void test_abort_args(void) {
    kvf_engine e = kvft_engine();
    kvf_abort_result ar;
    memset(&ar, 0, sizeof ar);
    ar.struct_size = sizeof ar;
    EXPECT_ERR(kvf_abort(e, 0, NULL, 0, 1000, &ar), KVF_ERR_INVALID, "request id 0");
    EXPECT_ERR(kvf_abort(e, 1, NULL, 1, 1000, &ar), KVF_ERR_INVALID, "initiators is NULL");
    const char *bad[] = {"no-port"};
    EXPECT_ERR(kvf_abort(e, 1, bad, 1, 1000, &ar), KVF_ERR_INVALID, "not a segment name");
    const char *nul[] = {NULL};
    EXPECT_ERR(kvf_abort(e, 1, nul, 1, 1000, &ar), KVF_ERR_INVALID, "initiators[0] is NULL");
    EXPECT_ERR(kvf_abort(e, 1, NULL, 0, 0, &ar), KVF_ERR_INVALID, "timeout 0");
    EXPECT_ERR(kvf_abort(e, 1, NULL, 0, 1000, NULL), KVF_ERR_INVALID, "out is NULL");
    ar.struct_size = 4;
    EXPECT_ERR(kvf_abort(e, 1, NULL, 0, 1000, &ar), KVF_ERR_INVALID, "struct_size");
    uint64_t gid;
    kvf_grant_range gr = {4096, 4096};
    EXPECT_ERR(kvf_grant(e, "127.0.0.1:1", 0, &gr, 1, &gid), KVF_ERR_INVALID, "request id 0");
    EXPECT_ERR(kvf_grant(e, "nohost", 1, &gr, 1, &gid), KVF_ERR_INVALID, "not a segment name");
    EXPECT_ERR(kvf_grant(e, "127.0.0.1:1", 1, NULL, 0, &gid), KVF_ERR_INVALID, "no ranges");
    EXPECT_ERR(kvf_grant(e, "127.0.0.1:1", 1, &gr, 1, NULL), KVF_ERR_INVALID, "grant_id is NULL");
    EXPECT_ERR(kvf_revoke(e, 12345, 1000), KVF_ERR_INVALID, "unknown grant");
    EXPECT_ERR(kvf_notify(NULL, 1, "x", 1), KVF_ERR_HANDLE, "kvf_notify");
    kvf_event ev[4];
    size_t n;
    EXPECT_ERR(kvf_poll_events(e, ev, 0, &n, 0), KVF_ERR_INVALID, "no room");
    EXPECT_ERR(kvf_poll_events(e, ev, 4, NULL, 0), KVF_ERR_INVALID, "n_out is NULL");
    EXPECT_ERR(kvf_poll_events(e, ev, 4, &n, -1), KVF_ERR_INVALID, "timeout");
    CHECK_OK(kvf_poll_events(e, ev, 4, &n, 0));
    CHECK(n == 0, "events on a fresh engine: %zu", n);
    EXPECT_ERR(kvf_event_fd(e, NULL), KVF_ERR_INVALID, "fd is NULL");
    CHECK_OK(kvf_engine_destroy(e));
}

static void test_last_error_sticks(void) {
    EXPECT_ERR(kvf_engine_destroy(NULL), KVF_ERR_HANDLE, "NULL engine handle");
    kvf_engine e = kvft_engine(); /* succeeds: the message stays */
    CHECK(strstr(kvf_last_error(), "kvf_engine_destroy: invalid handle: NULL engine handle") != NULL,
          "after a success the message is \"%s\"", kvf_last_error());
    CHECK_OK(kvf_engine_destroy(e));
}

int main(void) {
    test_strings();
    test_handles();
    test_options();
    test_memory();
    test_segments();
    test_requests();
    test_abort_args();
    test_last_error_sticks();
    return kvft_done("test_errors");
}
