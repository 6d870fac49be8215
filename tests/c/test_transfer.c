/* Transfers between two engines in one process, and to an engine's own
 * segment, through every transfer entry point, with the data checked. */
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kvf_test.h"

#define MiB (1024u * 1024u)

static void test_version(void) {
    CHECK(kvf_version() == KVF_VERSION_NUMBER, "library %u, header %u", kvf_version(),
          (unsigned)KVF_VERSION_NUMBER);
    CHECK(strcmp(kvf_version_string(), KVF_VERSION_STRING) == 0, "%s", kvf_version_string());
    CHECK(kvf_version() / 10000 == KVF_VERSION_MAJOR, "major");
}

int main(void) {
    test_version();

    kvf_engine a = kvft_engine(), b = kvft_engine();
    char bname[128], aname[128];
    kvft_name(b, bname, sizeof bname);
    kvft_name(a, aname, sizeof aname);
    CHECK(strcmp(aname, bname) != 0, "two engines share the name %s", aname);

    /* b's memory is the caller's own (registered), a's comes from the engine. */
    const size_t size = 8 * MiB;
    uint8_t *bmem = NULL;
    CHECK(posix_memalign((void **)&bmem, 4096, size) == 0, "posix_memalign");
    memset(bmem, 0, size);
    CHECK_OK(kvf_register_memory(b, bmem, size, "cpu"));
    void *abuf = NULL;
    CHECK_OK(kvf_alloc_buffer(a, size, "*", &abuf));
    uint8_t *amem = (uint8_t *)abuf;

    kvf_segment sb = NULL;
    CHECK_OK(kvf_open_segment(a, bname, 5000, &sb));
    size_t nbuf = 0;
    CHECK_OK(kvf_segment_buffer_count(sb, &nbuf));
    CHECK(nbuf == 1, "peer has %zu buffers, want 1", nbuf);
    uint64_t raddr = 0, rlen = 0;
    CHECK_OK(kvf_segment_buffer(sb, 0, &raddr, &rlen));
    CHECK(raddr == (uint64_t)(uintptr_t)bmem && rlen == size, "buffer 0 is [%#llx, +%llu)",
          (unsigned long long)raddr, (unsigned long long)rlen);
    char sname[128];
    CHECK_OK(kvf_segment_name(sb, sname, sizeof sname, NULL));
    CHECK(strcmp(sname, bname) == 0, "segment name %s", sname);

    /* 1. A synchronous WRITE of an odd size spanning many slices. */
    const size_t wlen = 3 * MiB + 1;
    kvft_fill(amem, wlen, 1);
    kvf_request w = kvft_req(KVF_OP_WRITE, amem, sb, raddr, wlen, 42);
    kvf_task_status ts;
    memset(&ts, 0xff, sizeof ts);
    CHECK_OK(kvf_transfer_sync(a, &w, 1, 10000, &ts));
    CHECK(ts.state == KVF_TASK_COMPLETED && ts.error == KVF_OK && ts.transferred == wlen,
          "state %s error %d transferred %llu", kvf_task_state_str(ts.state), ts.error,
          (unsigned long long)ts.transferred);
    long bad = kvft_verify(bmem, wlen, 1);
    CHECK(bad < 0, "WRITE: peer memory differs at %ld", bad);

    /* 2. READ through a batch: 64 requests of 16 KiB in two submits. */
    kvft_fill(bmem + 4 * MiB, MiB, 2);
    memset(amem + 4 * MiB, 0, MiB);
    kvf_batch batch = NULL;
    CHECK_OK(kvf_batch_alloc(a, 64, &batch));
    kvf_request reqs[64];
    for (int i = 0; i < 64; i++)
        reqs[i] = kvft_req(KVF_OP_READ, amem + 4 * MiB + (size_t)i * 16384, sb,
                           raddr + 4 * MiB + (uint64_t)i * 16384, 16384, 100 + (uint64_t)i);
    CHECK_OK(kvf_batch_submit(batch, reqs, 32));
    CHECK_OK(kvf_batch_submit(batch, reqs + 32, 32));
    CHECK_OK(kvf_batch_wait(batch, 10000));
    kvf_task_status all[70];
    size_t nt = 0;
    CHECK_OK(kvf_batch_status_all(batch, all, 70, &nt));
    CHECK(nt == 64, "%zu tasks", nt);
    for (size_t i = 0; i < nt; i++)
        CHECK(all[i].state == KVF_TASK_COMPLETED && all[i].transferred == 16384, "task %zu: %s",
              i, kvf_task_state_str(all[i].state));
    CHECK_OK(kvf_batch_status(batch, 63, &ts));
    CHECK(ts.state == KVF_TASK_COMPLETED, "task 63");
    size_t elen = 99;
    CHECK_OK(kvf_batch_task_error(batch, 5, NULL, 0, &elen));
    CHECK(elen == 0, "completed task has an error message of %zu bytes", elen);
    CHECK_OK(kvf_batch_free(batch));
    bad = kvft_verify(amem + 4 * MiB, MiB, 2);
    CHECK(bad < 0, "READ: local memory differs at %ld", bad);

    /* 3. The local segment: a copies within its own buffer. */
    kvf_segment self = NULL;
    CHECK_OK(kvf_open_segment(a, aname, KVF_TIMEOUT_DEFAULT, &self));
    kvft_fill(amem + 6 * MiB, 65536, 3);
    kvf_request lc = kvft_req(KVF_OP_WRITE, amem + 6 * MiB, self, (uint64_t)(uintptr_t)(amem + 7 * MiB), 65536, 0);
    CHECK_OK(kvf_transfer_sync(a, &lc, 1, KVF_TIMEOUT_DEFAULT, NULL));
    bad = kvft_verify(amem + 7 * MiB, 65536, 3);
    CHECK(bad < 0, "local WRITE differs at %ld", bad);

    /* 4. Several requests to two segments in one call. */
    kvft_fill(amem, 4096, 4);
    kvft_fill(amem + 8192, 4096, 5);
    kvf_request two[2] = {
        kvft_req(KVF_OP_WRITE, amem, sb, raddr + 2 * MiB, 4096, 7),
        kvft_req(KVF_OP_WRITE, amem + 8192, self, (uint64_t)(uintptr_t)(amem + 5 * MiB), 4096, 7),
    };
    kvf_task_status two_st[2];
    CHECK_OK(kvf_transfer_sync(a, two, 2, 10000, two_st));
    CHECK(kvft_verify(bmem + 2 * MiB, 4096, 4) < 0, "two segments: peer");
    CHECK(kvft_verify(amem + 5 * MiB, 4096, 5) < 0, "two segments: local");

    /* 5. Batch registration of caller memory; the peer sees it after a refresh. */
    uint8_t *extra = NULL;
    CHECK(posix_memalign((void **)&extra, 4096, 2 * 65536) == 0, "posix_memalign");
    kvf_memory_range rs[2] = {{extra, 65536, NULL}, {extra + 65536, 65536, "cpu"}};
    CHECK_OK(kvf_register_memory_batch(b, rs, 2));
    kvft_fill(amem, 65536, 6);
    kvf_request we = kvft_req(KVF_OP_WRITE, amem, sb, (uint64_t)(uintptr_t)(extra + 65536), 65536, 8);
    CHECK_OK(kvf_transfer_sync(a, &we, 1, 10000, NULL)); /* refreshes the descriptor */
    CHECK(kvft_verify(extra + 65536, 65536, 6) < 0, "WRITE into newly registered memory");
    CHECK_OK(kvf_segment_buffer_count(sb, &nbuf));
    CHECK(nbuf == 3, "after refresh the peer has %zu buffers, want 3", nbuf);
    void *ea[2] = {extra, extra + 65536};
    CHECK_OK(kvf_unregister_memory_batch(b, ea, 2));
    free(extra);

    /* 6. Counters. */
    kvf_stats sa, sbs;
    memset(&sa, 0, sizeof sa);
    sa.struct_size = sizeof sa;
    CHECK_OK(kvf_engine_stats(a, &sa));
    CHECK(sa.bytes_written >= wlen + 65536 + 2 * 4096 + 65536, "bytes_written %llu",
          (unsigned long long)sa.bytes_written);
    CHECK(sa.bytes_read >= MiB, "bytes_read %llu", (unsigned long long)sa.bytes_read);
    CHECK(sa.tasks_completed >= 68 && sa.tasks_failed == 0 && sa.tasks_in_flight == 0,
          "completed %llu failed %llu in flight %lld", (unsigned long long)sa.tasks_completed,
          (unsigned long long)sa.tasks_failed, (long long)sa.tasks_in_flight);
    CHECK(sa.registrations == 1 && sa.open_segments == 2, "registrations %llu segments %llu",
          (unsigned long long)sa.registrations, (unsigned long long)sa.open_segments);
    memset(&sbs, 0, sizeof sbs);
    sbs.struct_size = sizeof sbs;
    CHECK_OK(kvf_engine_stats(b, &sbs));
    CHECK(sbs.owner_bytes_in >= wlen && sbs.owner_bytes_out >= MiB, "owner in %llu out %llu",
          (unsigned long long)sbs.owner_bytes_in, (unsigned long long)sbs.owner_bytes_out);
    /* A program built with an older, shorter kvf_stats gets only its prefix. */
    memset(&sbs, 0xab, sizeof sbs);
    sbs.struct_size = (uint32_t)offsetof(kvf_stats, tasks_completed);
    CHECK_OK(kvf_engine_stats(b, &sbs));
    CHECK(sbs.tasks_completed == 0xababababababababull, "stats wrote past struct_size");

    /* 6b. Metrics text: a length query, a buffer too small, then the text,
     * which names the library's version and counts what A wrote to B. */
    size_t mlen = 0;
    CHECK_OK(kvf_metrics_text(a, NULL, 0, &mlen));
    CHECK(mlen > 1000, "metrics text of %zu bytes", mlen);
    char small[16];
    EXPECT_ERR(kvf_metrics_text(a, small, sizeof small, &mlen), KVF_ERR_TRUNCATED, "too small");
    EXPECT_ERR(kvf_metrics_text(a, NULL, 8, NULL), KVF_ERR_INVALID, "buf is NULL");
    size_t mcap = mlen + mlen / 4 + 4096;
    char *mtext = malloc(mcap);
    CHECK(mtext != NULL, "malloc");
    CHECK_OK(kvf_metrics_text(a, mtext, mcap, &mlen));
    CHECK(strlen(mtext) == mlen, "length %zu vs %zu", strlen(mtext), mlen);
    CHECK(strstr(mtext, "kvferry_info{engine=\"") != NULL, "no kvferry_info");
    CHECK(strstr(mtext, "version=\"" KVF_VERSION_STRING "\"") != NULL, "the text names another version");
    char want[512];
    snprintf(want, sizeof want, "kvferry_transfers_total{engine=\"%s\",op=\"write\",peer=\"%s\",status=\"completed\",transport=\"", aname, bname);
    CHECK(strstr(mtext, want) != NULL, "no completed writes to B in:\n%s", mtext);
    free(mtext);
    char maddr[64];
    CHECK_OK(kvf_metrics_addr(a, maddr, sizeof maddr, NULL));
    CHECK(maddr[0] == 0, "a metrics listener at %s without metrics_addr", maddr);

    /* 7. Two handles of one segment share it; closing one keeps the other. */
    kvf_segment sb2 = NULL;
    CHECK_OK(kvf_open_segment(a, bname, 5000, &sb2));
    CHECK(sb2 != sb, "each open returns its own handle");
    CHECK_OK(kvf_close_segment(sb2));
    w.length = 4096;
    CHECK_OK(kvf_transfer_sync(a, &w, 1, 10000, NULL));

    /* 8. Destroy with handles still open: they become stale. */
    kvf_batch left = NULL;
    CHECK_OK(kvf_batch_alloc(a, 4, &left));
    CHECK_OK(kvf_engine_destroy(a));
    EXPECT_ERR(kvf_close_segment(sb), KVF_ERR_HANDLE, "stale");
    EXPECT_ERR(kvf_batch_free(left), KVF_ERR_HANDLE, "stale");
    EXPECT_ERR(kvf_close_segment(self), KVF_ERR_HANDLE, "stale");
    EXPECT_ERR(kvf_engine_destroy(a), KVF_ERR_HANDLE, "stale");

    CHECK_OK(kvf_unregister_memory(b, bmem));
    CHECK_OK(kvf_engine_destroy(b));
    free(bmem);
    return kvft_done("test_transfer");
}
