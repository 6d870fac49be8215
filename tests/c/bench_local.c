/* Per-request cost of the C API plus the engine: submit + wait of batches of
 * 1, 64 and 1024 requests of 64 B and 4 KiB to the engine's own segment (a
 * checked memcpy), in ns per request. Built, not run by ctest.
 *
 *   bench_local [seconds per case, default 1] [go_max_procs, default 0] [NxSIZE, e.g. 1024x64: one case]
 *
 * Columns, in ns per request:
 *   total   kvf_batch_alloc + kvf_batch_submit + kvf_batch_wait + kvf_batch_free
 *   submit  the kvf_batch_submit part of total (small local copies run inside it)
 *   wait    the kvf_batch_wait part of total
 *   sync    kvf_transfer_sync of the same requests (a separate loop)
 * The target is at most 300 ns per request at 1024 x 64 B (total). */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "kvferry.h"

#define CK(call)                                                                                  \
    do {                                                                                          \
        kvf_status st_ = (call);                                                                  \
        if (st_ != KVF_OK) {                                                                      \
            fprintf(stderr, "%s: %s: %s\n", #call, kvf_status_str(st_), kvf_last_error());        \
            exit(1);                                                                              \
        }                                                                                         \
    } while (0)

static double now_s(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + (double)t.tv_nsec / 1e9;
}

struct result {
    double total, submit, wait;
};

static struct result run_batches(kvf_engine e, const kvf_request *reqs, size_t n, double seconds) {
    size_t done = 0;
    double t0 = now_s(), t = t0, in_submit = 0, in_wait = 0;
    while (t - t0 < seconds) {
        kvf_batch b;
        CK(kvf_batch_alloc(e, n, &b));
        double a = now_s();
        CK(kvf_batch_submit(b, reqs, n));
        double s = now_s();
        CK(kvf_batch_wait(b, KVF_TIMEOUT_DEFAULT));
        t = now_s();
        CK(kvf_batch_free(b));
        in_submit += s - a;
        in_wait += t - s;
        done += n;
    }
    t = now_s();
    struct result r = {(t - t0) * 1e9 / (double)done, in_submit * 1e9 / (double)done, in_wait * 1e9 / (double)done};
    return r;
}

static double run_sync(kvf_engine e, const kvf_request *reqs, size_t n, double seconds) {
    size_t done = 0;
    double t0 = now_s(), t = t0;
    for (int iter = 0; t - t0 < seconds; iter++) {
        CK(kvf_transfer_sync(e, reqs, n, KVF_TIMEOUT_DEFAULT, NULL));
        done += n;
        if ((iter & 7) == 7) t = now_s();
    }
    t = now_s();
    return (t - t0) * 1e9 / (double)done;
}

int main(int argc, char **argv) {
    double seconds = argc > 1 ? atof(argv[1]) : 1.0;
    kvf_engine_options o;
    kvf_engine_options_init(&o);
    o.flags = KVF_ENGINE_IGNORE_ENV;
    o.log_level = KVF_LOG_WARN;
    o.go_max_procs = argc > 2 ? atoi(argv[2]) : 0;
    kvf_engine e;
    CK(kvf_engine_create(&o, &e));
    char name[128];
    CK(kvf_engine_name(e, name, sizeof name, NULL));
    const size_t maxn = 1024, maxlen = 4096;
    void *buf;
    CK(kvf_alloc_buffer(e, 2 * maxn * maxlen, NULL, &buf));
    memset(buf, 1, 2 * maxn * maxlen);
    kvf_segment self;
    CK(kvf_open_segment(e, name, KVF_TIMEOUT_DEFAULT, &self));
    kvf_request *reqs = calloc(maxn, sizeof *reqs);

    printf("kvferry %s bench_local: submit + wait to the local segment, ns per request\n", kvf_version_string());
    printf("%-6s %-6s %10s %10s %10s %10s\n", "batch", "size", "total", "submit", "wait", "sync");
    const size_t sizes[] = {64, 4096};
    const size_t batches[] = {1, 64, 1024};
    for (size_t si = 0; si < 2; si++) {
        for (size_t bi = 0; bi < 3; bi++) {
            size_t n = batches[bi], len = sizes[si];
            char tag[32];
            snprintf(tag, sizeof tag, "%zux%zu", n, len);
            if (argc > 3 && strcmp(argv[3], tag) != 0) continue;
            for (size_t i = 0; i < n; i++) {
                memset(&reqs[i], 0, sizeof reqs[i]);
                reqs[i].op = KVF_OP_WRITE;
                reqs[i].local = (char *)buf + i * len;
                reqs[i].segment = self;
                reqs[i].remote = (uint64_t)(uintptr_t)buf + maxn * maxlen + i * len;
                reqs[i].length = len;
                reqs[i].request_id = i + 1;
            }
            run_batches(e, reqs, n, seconds / 10); /* warm up */
            struct result r = run_batches(e, reqs, n, seconds);
            double ns = run_sync(e, reqs, n, seconds);
            printf("%-6zu %-6zu %10.0f %10.0f %10.0f %10.0f\n", n, len, r.total, r.submit, r.wait, ns);
            fflush(stdout);
        }
    }
    free(reqs);
    CK(kvf_close_segment(self));
    CK(kvf_engine_destroy(e));
    return 0;
}
