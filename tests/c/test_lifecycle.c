/* Engines created and destroyed many times, each time with segments left
 * open, batches left allocated and buffers left mapped, leave nothing
 * behind: no file descriptor, no ZMQ or engine thread, no mapping. These are
 * counted by the kernel (/proc/self), independently of the engine's own
 * counters; LeakSanitizer checks the C heap separately. */
#include <dirent.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kvf_test.h"

#define CYCLES 30
#define BUF (8u << 20)

static int count_dir(const char *path) {
    DIR *d = opendir(path);
    CHECK(d != NULL, "opendir %s", path);
    int n = 0;
    struct dirent *de;
    while ((de = readdir(d)) != NULL)
        if (de->d_name[0] != '.') n++;
    closedir(d);
    return n;
}

static long vm_pages(void) {
    FILE *f = fopen("/proc/self/statm", "r");
    CHECK(f != NULL, "statm");
    long size = 0;
    CHECK(fscanf(f, "%ld", &size) == 1, "statm");
    fclose(f);
    return size;
}

static void cycle(int i) {
    kvf_engine a = kvft_engine(), b = kvft_engine();
    char an[128], bn[128];
    kvft_name(a, an, sizeof an);
    kvft_name(b, bn, sizeof bn);
    void *ab = NULL, *bb = NULL;
    CHECK_OK(kvf_alloc_buffer(a, BUF, NULL, &ab));
    CHECK_OK(kvf_alloc_buffer(b, BUF, NULL, &bb));
    kvf_segment s1 = NULL, s2 = NULL;
    CHECK_OK(kvf_open_segment(a, bn, 5000, &s1));
    CHECK_OK(kvf_open_segment(b, an, 5000, &s2));
    kvft_fill(ab, 65536, (uint32_t)i);
    kvf_request w = kvft_req(KVF_OP_WRITE, ab, s1, (uint64_t)(uintptr_t)bb, 65536, (uint64_t)i);
    CHECK_OK(kvf_transfer_sync(a, &w, 1, 10000, NULL));
    CHECK(kvft_verify(bb, 65536, (uint32_t)i) < 0, "cycle %d: data", i);
    kvf_request rd = kvft_req(KVF_OP_READ, bb, s2, (uint64_t)(uintptr_t)ab + 65536, 65536, (uint64_t)i);
    kvf_batch bt = NULL;
    CHECK_OK(kvf_batch_alloc(b, 8, &bt));
    CHECK_OK(kvf_batch_submit(bt, &rd, 1));
    if (i % 2 == 0) CHECK_OK(kvf_batch_wait(bt, 10000)); /* odd cycles destroy it in flight */
    /* Left for destroy: s1, s2, bt, ab, bb. */
    CHECK_OK(kvf_engine_destroy(b));
    CHECK_OK(kvf_engine_destroy(a));
}

int main(void) {
    cycle(0); /* warms up the Go runtime and ZMQ's process-wide context */
    int fds0 = count_dir("/proc/self/fd");
    int threads0 = count_dir("/proc/self/task");
    long vm0 = vm_pages();
    for (int i = 1; i <= CYCLES; i++) cycle(i);
    int fds = count_dir("/proc/self/fd");
    int threads = count_dir("/proc/self/task");
    long vm = vm_pages();
    fprintf(stderr, "after %d cycles: fds %d -> %d, threads %d -> %d, vm %ld -> %ld KiB\n", CYCLES, fds0, fds,
            threads0, threads, vm0 * 4, vm * 4);
    CHECK(fds == fds0, "file descriptors leaked: %d -> %d", fds0, fds);
    /* Go keeps idle runtime threads for reuse, so allow a few; a leaked ZMQ
     * context alone would cost 2 threads per engine, 120 here. */
    CHECK(threads <= threads0 + 16, "threads leaked: %d -> %d", threads0, threads);
    /* Each cycle maps 16 MiB of buffers: leaking them would add 480 MiB.
     * The Go runtime reserves heap address space 64 MiB at a time. */
    CHECK((vm - vm0) * 4096 < 240l << 20, "address space grew by %ld MiB", (vm - vm0) * 4096 >> 20);
    return kvft_done("test_lifecycle");
}
