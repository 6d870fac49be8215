/* Transfers between two processes, with the data checked on both sides,
 * and what happens when the peer stops answering (SIGSTOP): a batch stays in
 * flight (kvf_batch_free is refused, kvf_batch_wait times out), cancel
 * returns promptly, a synchronous transfer returns by its deadline, and once
 * the peer runs again transfers work again.
 *
 * The same executable is the target: the initiator starts it with
 * posix_spawn (fork+exec in one step, safe in a process that already runs
 * the Go runtime) and talks to it over its stdin and stdout. */
#include "kvf_child.h"

#define MiB (1024u * 1024u)
#define SIZE (8 * MiB)

/* ---- target ------------------------------------------------------------- */

static int target(void) {
    kvf_engine e = kvft_engine();
    void *buf = NULL;
    CHECK_OK(kvf_alloc_buffer(e, SIZE, NULL, &buf));
    kvft_fill(buf, 4 * MiB, 1);
    char name[128];
    kvft_name(e, name, sizeof name);
    printf("READY %s %llu\n", name, (unsigned long long)(uintptr_t)buf);
    fflush(stdout);
    char line[256];
    while (fgets(line, sizeof line, stdin) != NULL) {
        unsigned long long off, len;
        unsigned seed;
        if (sscanf(line, "CHECK %llu %llu %u", &off, &len, &seed) == 3) {
            long bad = kvft_verify((uint8_t *)buf + off, len, seed);
            if (bad < 0)
                printf("OK\n");
            else
                printf("BAD %ld\n", bad);
            fflush(stdout);
        } else if (strncmp(line, "QUIT", 4) == 0) {
            CHECK_OK(kvf_free_buffer(e, buf));
            CHECK_OK(kvf_engine_destroy(e));
            return 0;
        }
    }
    fprintf(stderr, "target: initiator went away\n");
    kvf_engine_destroy(e);
    return 2;
}

/* ---- initiator ---------------------------------------------------------- */

static void ask_check(uint64_t off, uint64_t len, unsigned seed) {
    fprintf(kvft_child.to, "CHECK %llu %llu %u\n", (unsigned long long)off, (unsigned long long)len, seed);
    fflush(kvft_child.to);
    char line[128];
    CHECK(fgets(line, sizeof line, kvft_child.from) != NULL, "target went away");
    CHECK(strncmp(line, "OK", 2) == 0, "target memory [%llu, +%llu) seed %u: %s",
          (unsigned long long)off, (unsigned long long)len, seed, line);
}

int main(int argc, char **argv) {
    if (argc > 1 && strcmp(argv[1], "--target") == 0) return target();

    char *args[] = {argv[0], (char *)"--target", NULL};
    kvft_spawn_child(args);

    char line[256], tname[128];
    unsigned long long taddr;
    CHECK(fgets(line, sizeof line, kvft_child.from) != NULL, "target did not start");
    CHECK(sscanf(line, "READY %127s %llu", tname, &taddr) == 2, "target said %s", line);

    kvf_engine e = kvft_engine();
    void *buf = NULL;
    CHECK_OK(kvf_alloc_buffer(e, SIZE, NULL, &buf));
    uint8_t *mem = (uint8_t *)buf;
    kvf_segment seg = NULL;
    CHECK_OK(kvf_open_segment(e, tname, 5000, &seg));

    /* READ what the target wrote. */
    kvf_request r = kvft_req(KVF_OP_READ, mem, seg, taddr, 4 * MiB, 1);
    CHECK_OK(kvf_transfer_sync(e, &r, 1, 10000, NULL));
    long bad = kvft_verify(mem, 4 * MiB, 1);
    CHECK(bad < 0, "READ from the target differs at %ld", bad);

    /* WRITE through a batch of 16 requests; the target checks. */
    kvft_fill(mem + 4 * MiB, 4 * MiB, 2);
    kvf_batch b = NULL;
    CHECK_OK(kvf_batch_alloc(e, 16, &b));
    kvf_request reqs[16];
    for (int i = 0; i < 16; i++)
        reqs[i] = kvft_req(KVF_OP_WRITE, mem + 4 * MiB + (size_t)i * 256 * 1024, seg,
                           taddr + 4 * MiB + (uint64_t)i * 256 * 1024, 256 * 1024, 2);
    CHECK_OK(kvf_batch_submit(b, reqs, 16));
    CHECK_OK(kvf_batch_wait(b, 10000));
    CHECK_OK(kvf_batch_free(b));
    ask_check(4 * MiB, 4 * MiB, 2);

    /* The target stops: a WRITE cannot complete (the owner must answer). */
    kvft_signal_child(SIGSTOP);
    CHECK_OK(kvf_batch_alloc(e, 1, &b));
    kvf_request big = kvft_req(KVF_OP_WRITE, mem, seg, taddr, 4 * MiB, 3);
    CHECK_OK(kvf_batch_submit(b, &big, 1));
    EXPECT_ERR(kvf_batch_free(b), KVF_ERR_BUSY, "in flight");
    double t0 = kvft_now_ms();
    EXPECT_ERR(kvf_batch_wait(b, 200), KVF_ERR_TIMEOUT, "still in flight");
    double waited = kvft_now_ms() - t0;
    CHECK(waited >= 190 && waited < 2000, "kvf_batch_wait(200 ms) took %.0f ms", waited);
    kvf_task_status ts;
    CHECK_OK(kvf_batch_status(b, 0, &ts));
    CHECK(ts.state == KVF_TASK_PENDING || ts.state == KVF_TASK_WAITING, "state %s",
          kvf_task_state_str(ts.state));
    t0 = kvft_now_ms();
    CHECK_OK(kvf_batch_cancel(b));
    double canceled = kvft_now_ms() - t0;
    CHECK(canceled < 2000, "kvf_batch_cancel took %.0f ms", canceled);
    CHECK_OK(kvf_batch_status(b, 0, &ts));
    CHECK(ts.state == KVF_TASK_CANCELED && ts.error == KVF_ERR_CANCELED, "after cancel: %s, %s",
          kvf_task_state_str(ts.state), kvf_status_str(ts.error));
    EXPECT_ERR(kvf_batch_wait(b, 0), KVF_ERR_CANCELED, "task 0");
    CHECK_OK(kvf_batch_free(b));

    /* A synchronous transfer returns by its deadline. */
    t0 = kvft_now_ms();
    kvf_task_status sts;
    EXPECT_ERR(kvf_transfer_sync(e, &big, 1, 300, &sts), KVF_ERR_TIMEOUT, "task 0");
    double took = kvft_now_ms() - t0;
    CHECK(took >= 290 && took < 1500, "kvf_transfer_sync(300 ms) took %.0f ms", took);
    CHECK(sts.state == KVF_TASK_TIMEOUT, "state %s", kvf_task_state_str(sts.state));

    /* The target runs again; transfers work again. They go to pages the
     * canceled and timed-out WRITEs did not cover: bytes of those that were
     * already in the target's socket buffer may still land when it runs
     * (a TIMEOUT or CANCELED promises that the initiator's buffers are no
     * longer touched; an owner that reuses the pages protects them with
     * Abort or Fence, as test_abort and test_fence show). */
    kvft_signal_child(SIGCONT);
    kvft_fill(mem, MiB, 5);
    kvf_request again = kvft_req(KVF_OP_WRITE, mem, seg, taddr + 4 * MiB, MiB, 5);
    CHECK_OK(kvf_transfer_sync(e, &again, 1, 10000, NULL));
    ask_check(4 * MiB, MiB, 5);

    kvf_stats st;
    memset(&st, 0, sizeof st);
    st.struct_size = sizeof st;
    CHECK_OK(kvf_engine_stats(e, &st));
    CHECK(st.tasks_canceled >= 1 && st.tasks_failed >= 1, "canceled %llu failed %llu",
          (unsigned long long)st.tasks_canceled, (unsigned long long)st.tasks_failed);

    CHECK_OK(kvf_close_segment(seg));
    CHECK_OK(kvf_engine_destroy(e));
    kvft_quit_child();
    kvft_close_child();
    return kvft_done("test_two_process");
}
