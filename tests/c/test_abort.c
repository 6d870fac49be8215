/* Safe abort, grants, notifications and events through the C API, between
 * two engines of one process (owner and initiator, over tcp on loopback):
 *
 *  - an abort of a request the initiator wrote is safe at generation 1; the
 *    initiator gets a KVF_EVENT_ABORTED from the owner, its event fd polls
 *    readable until the event is taken, and later WRITEs, READs and batches
 *    of that request end KVF_TASK_ABORTED without touching owner memory;
 *  - an abort naming no initiator is safe too, and the initiator learns of
 *    it from the owner's refusal (an event, and ABORTED tasks);
 *  - aborts while a request's batch is in flight: after a safe return the
 *    owner reuses the slot at once and no byte of the old request lands;
 *  - grants restrict a request id to the ranges of one initiator; revoke
 *    withdraws them; a second revoke of the same id is invalid;
 *  - notifications arrive as events, in order, with their data; more than
 *    KVF_EVENT_DATA_MAX bytes is invalid;
 *  - kvf_stats counts all of it, and an 0.1-sized kvf_stats is filled up to
 *    its size only.
 *
 * Then the same executable, started with posix_spawn as an initiator in a
 * second process, is paused by SIGSTOP in the middle of a WRITE: the
 * owner's abort is safe by its deadline, the owner reuses the slot, and
 * after SIGCONT the slot stays intact and the initiator's task ends ABORTED.
 * The same with SIGKILL instead of SIGCONT.
 *
 * Argument errors of these calls are tested in test_errors.c. */
#include <poll.h>
#include <stddef.h>

#include "kvf_pair.h"

static int aborts_done; /* kvf_abort calls that returned safe */

/* Whether fd polls readable within timeout_ms: the contract of
 * kvf_event_fd is stated in poll(2) terms, so it is tested through poll. */
static int fd_readable(int fd, int timeout_ms) {
    struct pollfd p = {.fd = fd, .events = POLLIN, .revents = 0};
    int n;
    do {
        n = poll(&p, 1, timeout_ms);
    } while (n < 0 && errno == EINTR);
    CHECK(n >= 0, "poll: %s", strerror(errno));
    CHECK((p.revents & (POLLERR | POLLNVAL)) == 0, "poll revents %#x", (unsigned)p.revents);
    return n == 1 && (p.revents & POLLIN) != 0;
}

/* Takes exactly one event from e, waiting up to timeout_ms, and fails when
 * none or more than one is pending: every event of this test is expected. */
static kvf_event take_one(kvf_engine e, int timeout_ms, const char *what) {
    kvf_event ev[4];
    memset(ev, 0x5a, sizeof ev);
    size_t n = 99;
    CHECK_OK(kvf_poll_events(e, ev, 4, &n, timeout_ms));
    CHECK(n == 1, "%s: %zu events, want 1 (first type %u request %llu)", what, n, ev[0].type,
          (unsigned long long)ev[0].request_id);
    return ev[0];
}

/* Fails when an event is pending on e: used after the expected ones were
 * taken, so a duplicate or stray event is caught. */
static void expect_no_event(kvf_engine e, const char *what) {
    kvf_event ev;
    size_t n = 99;
    CHECK_OK(kvf_poll_events(e, &ev, 1, &n, 0));
    CHECK(n == 0, "%s: unexpected event type %u request %llu generation %llu from %s", what, ev.type,
          (unsigned long long)ev.request_id, (unsigned long long)ev.generation, ev.peer);
}

/* Checks an ABORTED event for rid at gen from the owner. */
static void check_aborted_event(const kvf_event *ev, uint64_t rid, uint64_t gen, const char *peer) {
    CHECK(ev->type == KVF_EVENT_ABORTED, "event type %u, want ABORTED", ev->type);
    CHECK(ev->request_id == rid, "event request %llu, want %llu", (unsigned long long)ev->request_id,
          (unsigned long long)rid);
    CHECK(ev->generation == gen, "event generation %llu, want %llu", (unsigned long long)ev->generation,
          (unsigned long long)gen);
    CHECK(strcmp(ev->peer, peer) == 0, "event peer %s, want %s", ev->peer, peer);
    CHECK(ev->data_len == 0, "ABORTED event with %u bytes of data", ev->data_len);
}

/* The owner aborts rid for the initiators named; it must be safe at gen. */
static void abort_safe(uint64_t rid, const char *const *names, size_t n, uint64_t gen) {
    kvf_abort_result ar;
    memset(&ar, 0xff, sizeof ar);
    ar.struct_size = sizeof ar;
    CHECK_OK(kvf_abort(owner, rid, names, n, 5000, &ar));
    CHECK(ar.safe == 1, "abort of %llu not safe", (unsigned long long)rid);
    CHECK(ar.generation == gen, "abort of %llu: generation %llu, want %llu", (unsigned long long)rid,
          (unsigned long long)ar.generation, (unsigned long long)gen);
    aborts_done++;
}

/* A synchronous WRITE of len bytes from the initiator's offset ioff to the
 * owner's offset ooff; returns its status and task state. */
static kvf_status write_sync(size_t ioff, size_t ooff, size_t len, uint64_t rid, kvf_task_status *ts) {
    kvf_request w = kvft_req(KVF_OP_WRITE, imem + ioff, seg, obase + ooff, len, rid);
    memset(ts, 0xff, sizeof *ts);
    return kvf_transfer_sync(init, &w, 1, 10000, ts);
}

/* ---- 1. abort of a request that wrote, and the initiator's events ------- */

static void test_abort_after_write(void) {
    const uint64_t R = 1001;
    const size_t len = 256 * KiB;
    kvf_task_status ts;

    /* The event fd exists before any event and is quiet. */
    int fd = -1, fd2 = -2;
    CHECK_OK(kvf_event_fd(init, &fd));
    CHECK(fd >= 0, "event fd %d", fd);
    CHECK_OK(kvf_event_fd(init, &fd2));
    CHECK(fd2 == fd, "event fd changed: %d then %d", fd, fd2);
    CHECK(!fd_readable(fd, 0), "event fd readable before any event");

    kvft_fill(imem, len, 11);
    CHECK_OK(write_sync(0, 0, len, R, &ts));
    CHECK(ts.state == KVF_TASK_COMPLETED && ts.transferred == len, "first WRITE: %s",
          kvf_task_state_str(ts.state));
    CHECK(kvft_verify(omem, len, 11) < 0, "first WRITE did not land");

    const char *names[1] = {iname};
    kvf_abort_result ar;
    memset(&ar, 0xff, sizeof ar);
    ar.struct_size = sizeof ar;
    CHECK_OK(kvf_abort(owner, R, names, 1, 5000, &ar));
    CHECK(ar.safe == 1 && ar.generation == 1, "abort: safe %u generation %llu", ar.safe,
          (unsigned long long)ar.generation);
    /* A lower bound of the request's bytes, from ACKs received in time. */
    CHECK(ar.bytes_confirmed <= len, "abort confirmed %llu bytes of %zu", (unsigned long long)ar.bytes_confirmed,
          len);
    aborts_done++;

    /* The ABORT reaches the initiator: its fd wakes, and one event waits. */
    CHECK(fd_readable(fd, 5000), "event fd not readable 5 s after the abort");
    kvf_event ev = take_one(init, 5000, "after abort");
    check_aborted_event(&ev, R, 1, oname);
    CHECK(!fd_readable(fd, 0), "event fd still readable after every event was taken");
    expect_no_event(init, "after abort");

    /* The request is over for this initiator: a WRITE, a READ and a batch
     * of it end ABORTED, and owner memory keeps the first WRITE's bytes. */
    kvft_fill(imem, len, 12);
    EXPECT_ERR(write_sync(0, 0, len, R, &ts), KVF_ERR_ABORTED, NULL);
    CHECK(ts.state == KVF_TASK_ABORTED && ts.error == KVF_ERR_ABORTED, "WRITE after abort: %s, %s",
          kvf_task_state_str(ts.state), kvf_status_str(ts.error));
    long bad = kvft_verify(omem, len, 11);
    CHECK(bad < 0, "owner memory changed by a WRITE after the abort, at %ld", bad);

    memset(imem + MiB, 0, len);
    kvf_request r = kvft_req(KVF_OP_READ, imem + MiB, seg, obase, len, R);
    EXPECT_ERR(kvf_transfer_sync(init, &r, 1, 10000, &ts), KVF_ERR_ABORTED, NULL);
    CHECK(ts.state == KVF_TASK_ABORTED, "READ after abort: %s", kvf_task_state_str(ts.state));
    for (size_t i = 0; i < len; i++)
        CHECK(imem[MiB + i] == 0, "a READ of an aborted request moved data: byte %zu", i);

    kvf_batch b = NULL;
    CHECK_OK(kvf_batch_alloc(init, 4, &b));
    kvf_request reqs[4];
    for (int i = 0; i < 4; i++)
        reqs[i] = kvft_req(KVF_OP_WRITE, imem + (size_t)i * 64 * KiB, seg, obase + (uint64_t)i * 64 * KiB,
                           64 * KiB, R);
    CHECK_OK(kvf_batch_submit(b, reqs, 4));
    EXPECT_ERR(kvf_batch_wait(b, 10000), KVF_ERR_ABORTED, NULL);
    kvf_task_status all[4];
    size_t nt = 0;
    CHECK_OK(kvf_batch_status_all(b, all, 4, &nt));
    CHECK(nt == 4, "%zu tasks", nt);
    for (size_t i = 0; i < nt; i++)
        CHECK(all[i].state == KVF_TASK_ABORTED && all[i].error == KVF_ERR_ABORTED, "batch task %zu: %s", i,
              kvf_task_state_str(all[i].state));
    char msg[512];
    CHECK_OK(kvf_batch_task_error(b, 0, msg, sizeof msg, NULL));
    CHECK(msg[0] != 0, "an ABORTED task has no error message");
    CHECK_OK(kvf_batch_free(b));
    bad = kvft_verify(omem, len, 11);
    CHECK(bad < 0, "owner memory changed by a batch after the abort, at %ld", bad);

    /* Aborts are per request id: another one still writes the same slot. */
    kvft_fill(imem, len, 13);
    CHECK_OK(write_sync(0, 0, len, R + 1, &ts));
    CHECK(kvft_verify(omem, len, 13) < 0, "WRITE of another request id did not land");

    /* Aborting again bumps the generation, and the initiator hears it. */
    abort_safe(R, names, 1, 2);
    ev = take_one(init, 5000, "after the second abort");
    check_aborted_event(&ev, R, 2, oname);
    expect_no_event(init, "after the second abort");
}

/* ---- 2. an abort that names no initiator ------------------------------ */

static void test_abort_no_initiator(void) {
    const uint64_t R = 1101;
    const size_t off = 4 * MiB, len = 128 * KiB;
    kvf_task_status ts;
    kvft_fill(imem + off, len, 21);
    CHECK_OK(write_sync(off, off, len, R, &ts));
    CHECK(kvft_verify(omem + off, len, 21) < 0, "WRITE did not land");
    kvf_stats before = kvft_stats(owner);

    abort_safe(R, NULL, 0, 1);
    /* Nobody was told; the refusal is the fence, and teaches the initiator. */
    expect_no_event(init, "abort naming no initiator");
    kvft_fill(imem + off, len, 22);
    EXPECT_ERR(write_sync(off, off, len, R, &ts), KVF_ERR_ABORTED, NULL);
    CHECK(ts.state == KVF_TASK_ABORTED, "WRITE after an unnamed abort: %s", kvf_task_state_str(ts.state));
    long bad = kvft_verify(omem + off, len, 21);
    CHECK(bad < 0, "owner memory changed after an unnamed abort, at %ld", bad);
    kvf_stats after = kvft_stats(owner);
    CHECK(after.owner_refused > before.owner_refused, "owner refused %llu -> %llu",
          (unsigned long long)before.owner_refused, (unsigned long long)after.owner_refused);
    kvf_event ev = take_one(init, 5000, "abort learned from a refusal");
    check_aborted_event(&ev, R, 1, oname);
    /* Learned once: the next WRITE ends ABORTED at submit, without an event. */
    EXPECT_ERR(write_sync(off, off, len, R, &ts), KVF_ERR_ABORTED, NULL);
    expect_no_event(init, "second WRITE after a learned abort");

    /* A request id that never moved a byte can be aborted too. */
    abort_safe(R + 50, NULL, 0, 1);
}

/* ---- 3. aborts while a request's batch is in flight -------------------- */

/* Each round the initiator submits a request's "layers" (many WRITEs into
 * one owner slot) and the owner aborts it after k of them completed, then
 * fills the slot with a new request's pattern at once, as PD serving reuses
 * KV slots. Whether the abort catches slices on the wire is up to timing;
 * what must hold every round is the promise: after a safe return no byte of
 * the old request lands. */
static void test_abort_in_flight(void) {
    enum { LAYERS = 32, ROUNDS = 8 };
    const size_t slot = 16 * MiB, layer = 256 * KiB, span = (size_t)LAYERS * layer;
    kvf_stats before = kvft_stats(owner);
    const char *names[1] = {iname};
    int caught = 0;
    int round = 0;
    /* Every round checks the promise; more rounds (bounded) only when none
     * has yet caught layers in flight, which a loaded machine can delay. */
    for (; round < ROUNDS || (caught == 0 && round < 4 * ROUNDS); round++) {
        const uint64_t R = 2000 + (uint64_t)round;
        const uint32_t old_seed = 100 + (uint32_t)round, new_seed = 200 + (uint32_t)round;
        const size_t k = (size_t)(round * 4) % LAYERS; /* completed layers before the abort */
        kvft_fill(imem + slot, span, old_seed);
        memset(omem + slot, 0, span);

        kvf_batch b = NULL;
        CHECK_OK(kvf_batch_alloc(init, LAYERS, &b));
        kvf_request reqs[LAYERS];
        for (size_t i = 0; i < LAYERS; i++)
            reqs[i] = kvft_req(KVF_OP_WRITE, imem + slot + i * layer, seg, obase + slot + i * layer, layer, R);
        CHECK_OK(kvf_batch_submit(b, reqs, LAYERS));
        double deadline = kvft_now_ms() + 10000;
        for (;;) {
            kvf_task_status st[LAYERS];
            size_t nt = 0, done = 0;
            CHECK_OK(kvf_batch_status_all(b, st, LAYERS, &nt));
            for (size_t i = 0; i < nt; i++) done += st[i].state == KVF_TASK_COMPLETED;
            if (done >= k) break;
            CHECK(kvft_now_ms() < deadline, "round %d: %zu of %zu layers completed in 10 s", round, done, k);
            usleep(20); /* leave the copying threads the CPU on small machines */
        }
        abort_safe(R, names, 1, 1);
        kvft_fill(omem + slot, span, new_seed); /* reuse at once */

        kvf_status ws = kvf_batch_wait(b, 10000);
        CHECK(ws == KVF_OK || ws == KVF_ERR_ABORTED, "round %d: batch wait %s: %s", round, kvf_status_str(ws),
              kvf_last_error());
        kvf_task_status st[LAYERS];
        size_t nt = 0;
        CHECK_OK(kvf_batch_status_all(b, st, LAYERS, &nt));
        size_t aborted = 0;
        for (size_t i = 0; i < nt; i++) {
            CHECK(st[i].state == KVF_TASK_COMPLETED || st[i].state == KVF_TASK_ABORTED,
                  "round %d layer %zu: %s (%s)", round, i, kvf_task_state_str(st[i].state),
                  kvf_status_str(st[i].error));
            aborted += st[i].state == KVF_TASK_ABORTED;
        }
        caught += aborted > 0;
        CHECK_OK(kvf_batch_free(b));

        /* An ABORTED task may end before its slices on the wire do: give
         * them time to (wrongly) land before the check. */
        usleep(10 * 1000);
        long bad = kvft_verify(omem + slot, span, new_seed);
        CHECK(bad < 0, "round %d: the reused slot was overwritten at %ld after a safe abort (k %zu, %zu aborted)",
              round, bad, k, aborted);
        kvf_event ev = take_one(init, 5000, "abort in flight");
        check_aborted_event(&ev, R, 1, oname);
        expect_no_event(init, "abort in flight");
    }
    kvf_stats after = kvft_stats(owner);
    fprintf(stderr, "in flight: %d of %d rounds aborted layers; owner refused %llu, in flight %llu\n", caught,
            round, (unsigned long long)(after.owner_refused - before.owner_refused),
            (unsigned long long)(after.refused_in_flight - before.refused_in_flight));
    /* Round 0 aborts as soon as its 8 MiB are queued: unless the machine
     * stalls this thread that long, some layers end ABORTED. */
    CHECK(caught >= 1, "none of %d rounds aborted a layer", round);
}

/* ---- 4. grants and revoke --------------------------------------------- */

static void test_grant(void) {
    const uint64_t R = 3001;
    const size_t off = MiB, len = 64 * KiB;
    kvf_task_status ts;
    memset(omem + off, 0, MiB);
    kvf_grant_range gr = {obase + off, len};
    uint64_t gid = 0;
    CHECK_OK(kvf_grant(owner, iname, R, &gr, 1, &gid));
    CHECK(gid != 0, "grant id 0");

    kvft_fill(imem + off, len, 31);
    CHECK_OK(write_sync(off, off, len, R, &ts));
    CHECK(ts.state == KVF_TASK_COMPLETED, "WRITE inside the grant: %s", kvf_task_state_str(ts.state));
    CHECK(kvft_verify(omem + off, len, 31) < 0, "WRITE inside the grant did not land");

    /* Outside, and straddling the end. */
    kvft_fill(imem + off + len, 8 * KiB, 32);
    EXPECT_ERR(write_sync(off + len, off + len, 4 * KiB, R, &ts), KVF_ERR_REFUSED, NULL);
    CHECK(ts.state == KVF_TASK_FAILED, "WRITE outside the grant: %s", kvf_task_state_str(ts.state));
    EXPECT_ERR(write_sync(off + len - 4 * KiB, off + len - 4 * KiB, 8 * KiB, R, &ts), KVF_ERR_REFUSED, NULL);
    for (size_t i = 0; i < 64 * KiB; i++)
        CHECK(omem[off + len + i] == 0, "a refused WRITE landed at +%zu past the grant", i);
    CHECK(kvft_verify(omem + off, len, 31) < 0, "a refused straddling WRITE changed the granted range");

    /* The grant is the initiator's own: a grant to another name lets this
     * one write nothing of that request. */
    uint64_t other = 0;
    CHECK_OK(kvf_grant(owner, "127.0.0.1:1", R + 1, &gr, 1, &other));
    EXPECT_ERR(write_sync(off, off, len, R + 1, &ts), KVF_ERR_REFUSED, NULL);
    CHECK(kvft_verify(omem + off, len, 31) < 0, "a WRITE under another initiator's grant landed");
    CHECK_OK(kvf_revoke(owner, other, 1000));

    /* Requests without grants still write anywhere registered. */
    kvft_fill(imem + off + len, 4 * KiB, 33);
    CHECK_OK(write_sync(off + len, off + len, 4 * KiB, R + 2, &ts));
    CHECK(kvft_verify(omem + off + len, 4 * KiB, 33) < 0, "ungranted request id did not land");

    /* Revoked: the range is closed to the request; a second revoke is
     * invalid. */
    CHECK_OK(kvf_revoke(owner, gid, 5000));
    kvft_fill(imem + off, len, 34);
    EXPECT_ERR(write_sync(off, off, len, R, &ts), KVF_ERR_REFUSED, NULL);
    long bad = kvft_verify(omem + off, len, 31);
    CHECK(bad < 0, "a WRITE after revoke landed at %ld", bad);
    EXPECT_ERR(kvf_revoke(owner, gid, 5000), KVF_ERR_INVALID, NULL);
    EXPECT_ERR(kvf_revoke(owner, other, 5000), KVF_ERR_INVALID, NULL);
    EXPECT_ERR(kvf_revoke(owner, gid + 1000, 5000), KVF_ERR_INVALID, NULL);
    /* Refusals are not aborts: the initiator got no event. */
    expect_no_event(init, "grants");
}

/* ---- 5. notifications --------------------------------------------------- */

static void test_notify(void) {
    const uint64_t R = 4001;
    CHECK_OK(kvf_notify(seg, R, "hello", 5));
    kvf_event ev = take_one(owner, 5000, "notify");
    CHECK(ev.type == KVF_EVENT_NOTIFY, "event type %u, want NOTIFY", ev.type);
    CHECK(ev.request_id == R, "request %llu", (unsigned long long)ev.request_id);
    CHECK(ev.data_len == 5 && memcmp(ev.data, "hello", 5) == 0, "data_len %u data %.5s", ev.data_len,
          (const char *)ev.data);
    CHECK(strcmp(ev.peer, iname) == 0, "peer %s, want %s", ev.peer, iname);
    CHECK(ev.generation == 0, "NOTIFY generation %llu", (unsigned long long)ev.generation);

    /* Three more, empty, full and in between; then the owner's event fd,
     * created while they wait, polls readable at once. */
    uint8_t full[KVF_EVENT_DATA_MAX + 1];
    for (size_t i = 0; i < sizeof full; i++) full[i] = (uint8_t)(i * 3 + 1);
    CHECK_OK(kvf_notify(seg, R + 1, NULL, 0));
    CHECK_OK(kvf_notify(seg, R + 2, full, KVF_EVENT_DATA_MAX));
    CHECK_OK(kvf_notify(seg, R + 3, "x", 1));
    EXPECT_ERR(kvf_notify(seg, R + 4, full, KVF_EVENT_DATA_MAX + 1), KVF_ERR_INVALID, NULL);
    int fd = -1;
    CHECK_OK(kvf_event_fd(owner, &fd));
    CHECK(fd_readable(fd, 0), "owner's event fd not readable with 3 events waiting");

    /* One at a time: the fd stays readable while some wait. */
    kvf_event evs[8];
    size_t n = 0;
    CHECK_OK(kvf_poll_events(owner, evs, 1, &n, 0));
    CHECK(n == 1 && evs[0].request_id == R + 1 && evs[0].data_len == 0, "first of three: n %zu request %llu", n,
          (unsigned long long)evs[0].request_id);
    CHECK(fd_readable(fd, 0), "event fd not readable with 2 events still waiting");
    CHECK_OK(kvf_poll_events(owner, evs, 8, &n, 1000));
    CHECK(n == 2, "%zu events, want the last 2", n);
    CHECK(evs[0].request_id == R + 2 && evs[0].data_len == KVF_EVENT_DATA_MAX &&
              memcmp(evs[0].data, full, KVF_EVENT_DATA_MAX) == 0,
          "second: request %llu data_len %u", (unsigned long long)evs[0].request_id, evs[0].data_len);
    CHECK(evs[1].request_id == R + 3 && evs[1].data_len == 1 && evs[1].data[0] == 'x', "third: request %llu",
          (unsigned long long)evs[1].request_id);
    CHECK(!fd_readable(fd, 0), "owner's event fd readable after every event was taken");

    /* Nothing pending: a bounded wait returns none. */
    double t0 = kvft_now_ms();
    CHECK_OK(kvf_poll_events(owner, evs, 8, &n, 50));
    CHECK(n == 0, "%zu events from nowhere", n);
    CHECK(kvft_now_ms() - t0 < 5000, "kvf_poll_events(50 ms) took %.0f ms", kvft_now_ms() - t0);

    /* Notifications go both ways: the owner opens the initiator. */
    kvf_segment back = NULL;
    CHECK_OK(kvf_open_segment(owner, iname, 5000, &back));
    CHECK_OK(kvf_notify(back, R + 5, "done", 4));
    ev = take_one(init, 5000, "notify to the initiator");
    CHECK(ev.type == KVF_EVENT_NOTIFY && ev.request_id == R + 5 && ev.data_len == 4 &&
              memcmp(ev.data, "done", 4) == 0 && strcmp(ev.peer, oname) == 0,
          "back: type %u request %llu peer %s", ev.type, (unsigned long long)ev.request_id, ev.peer);
    CHECK_OK(kvf_close_segment(back));
}

/* ---- 6. counters, and the 0.1 layout of kvf_stats ----------------------- */

static void test_stats(int tasks_aborted_min) {
    kvf_stats o = kvft_stats(owner), i = kvft_stats(init);
    CHECK(o.aborts_safe == (uint64_t)aborts_done, "owner aborts_safe %llu, want %d",
          (unsigned long long)o.aborts_safe, aborts_done);
    CHECK(o.aborts_not_safe == 0, "owner aborts_not_safe %llu", (unsigned long long)o.aborts_not_safe);
    /* Request ids aborted: 1001, 1101, 1151, 2000..2007. */
    CHECK(o.tombstones >= 11, "owner remembers %llu tombstones", (unsigned long long)o.tombstones);
    CHECK(o.owner_refused >= 1, "owner refused %llu", (unsigned long long)o.owner_refused);
    CHECK(o.events_dropped == 0 && i.events_dropped == 0, "events dropped: owner %llu initiator %llu",
          (unsigned long long)o.events_dropped, (unsigned long long)i.events_dropped);
    CHECK(i.aborts_received >= 10, "initiator received %llu ABORTs", (unsigned long long)i.aborts_received);
    CHECK(i.tasks_aborted >= (uint64_t)tasks_aborted_min, "initiator tasks_aborted %llu, want >= %d",
          (unsigned long long)i.tasks_aborted, tasks_aborted_min);
    CHECK(i.tasks_failed >= i.tasks_aborted, "tasks_failed %llu < tasks_aborted %llu",
          (unsigned long long)i.tasks_failed, (unsigned long long)i.tasks_aborted);
    CHECK(i.tasks_in_flight == 0, "initiator has %lld tasks in flight", (long long)i.tasks_in_flight);
    fprintf(stderr, "owner: aborts_safe %llu abort_acks %llu acks_unmatched %llu tombstones %llu refused %llu\n",
            (unsigned long long)o.aborts_safe, (unsigned long long)o.abort_acks,
            (unsigned long long)o.acks_unmatched, (unsigned long long)o.tombstones,
            (unsigned long long)o.owner_refused);

    /* A program built against 0.1 passes the smaller size: the head is
     * filled, the bytes past it are not touched. */
    kvf_stats v01 = kvft_stats_sized(owner, offsetof(kvf_stats, aborts_safe), "0.1");
    CHECK(v01.registrations == 1 && v01.open_segments == 0 && v01.owner_refused >= o.owner_refused,
          "0.1 layout: registrations %llu open_segments %llu", (unsigned long long)v01.registrations,
          (unsigned long long)v01.open_segments);
}

/* ---- 7. a paused or killed initiator in another process ----------------- */

/* One pause: the child writes a big request into the owner's slot; once
 * some of it landed, the child is stopped, the owner aborts (safe by its
 * deadline, whatever the stopped child holds) and reuses the slot; then the
 * child is continued or killed, and the slot must stay as the owner left it.
 * Returns whether the child's WRITE ended ABORTED, i.e. the stop caught it
 * in the middle (after SIGCONT; for SIGKILL there is no telling). A WRITE
 * that COMPLETED had every byte applied before the abort, else the slot
 * check fails. */
static int paused_round(const char *child_name, uint64_t rid, int then_kill) {
    const size_t slot = 0, len = OWNER_SIZE;
    const uint32_t old_seed = 300 + (uint32_t)rid, new_seed = 400 + (uint32_t)rid;
    memset(omem + slot, 0, len);
    kvf_stats s0 = kvft_stats(owner);
    uint64_t landed = kvft_child_write_then_stop(rid, slot, len, old_seed, s0.owner_bytes_in);

    const char *names[1] = {child_name};
    kvf_abort_result ar;
    memset(&ar, 0, sizeof ar);
    ar.struct_size = sizeof ar;
    double t0 = kvft_now_ms();
    kvf_status st = kvf_abort(owner, rid, names, 1, 2000, &ar);
    double took = kvft_now_ms() - t0;
    CHECK(st == KVF_OK && ar.safe == 1, "abort with the initiator stopped: %s (%s) after %.0f ms",
          kvf_status_str(st), kvf_last_error(), took);
    /* The deadline bound of the contract, with room for a loaded machine. */
    CHECK(took < 2000 + 1000, "abort took %.0f ms with a 2 s deadline", took);
    aborts_done++;
    kvft_fill(omem + slot, len, new_seed);

    int caught = 0;
    if (then_kill) {
        kvft_signal_child(SIGKILL);
    } else {
        kvft_signal_child(SIGCONT);
        int code = -1, task_error = -1;
        char state[32] = "";
        kvft_child_done(&code, state, &task_error);
        caught = code == KVF_ERR_ABORTED && strcmp(state, "ABORTED") == 0;
        CHECK(caught || (code == KVF_OK && strcmp(state, "COMPLETED") == 0), "child's WRITE: status %d (%s), %s",
              code, kvf_status_str(code), state);
    }
    /* Give anything still on its way time to (wrongly) land. */
    usleep(100 * 1000);
    long bad = kvft_verify(omem + slot, len, new_seed);
    CHECK(bad < 0, "%s: the reused slot was overwritten at %ld after a safe abort", then_kill ? "SIGKILL" : "SIGCONT",
          bad);
    kvf_stats s1 = kvft_stats(owner);
    fprintf(stderr,
            "%s: %llu of %zu bytes landed at the stop; abort took %.1f ms; owner refused %llu (%llu in flight)%s\n",
            then_kill ? "SIGKILL" : "SIGSTOP/SIGCONT", (unsigned long long)landed, len, took,
            (unsigned long long)(s1.owner_refused - s0.owner_refused),
            (unsigned long long)(s1.refused_in_flight - s0.refused_in_flight),
            then_kill ? "" : caught ? "; WRITE ABORTED" : "; WRITE had COMPLETED");
    return caught;
}

static void test_paused_initiator(const char *self) {
    char child_name[128];
    kvft_spawn_initiator(self, "--initiator", child_name, sizeof child_name);
    int caught = 0;
    uint64_t rid = 5000;
    for (int i = 0; i < 5 && !caught; i++) caught = paused_round(child_name, rid++, 0);
    CHECK(caught, "the SIGSTOP never caught a WRITE in the middle in 5 tries");
    /* The child still works after its request was aborted. */
    memset(omem + 16 * MiB, 0, MiB);
    kvft_child_write(rid, 16 * MiB, MiB, 77u);
    int code = -1, task_error = -1;
    char state[32] = "";
    kvft_child_done(&code, state, &task_error);
    CHECK(code == KVF_OK && strcmp(state, "COMPLETED") == 0, "child's WRITE of a new request: %d (%s), %s", code,
          kvf_status_str(code), state);
    CHECK(kvft_verify(omem + 16 * MiB, MiB, 77) < 0, "child's new WRITE did not land");
    rid++;

    /* SIGKILL: the child dies holding the request. */
    paused_round(child_name, rid++, 1);
    kvft_close_child();
}

int main(int argc, char **argv) {
    if (argc == 4 && strcmp(argv[1], "--initiator") == 0)
        return kvft_initiator_process(argv[2], strtoull(argv[3], NULL, 10));

    double t0 = kvft_now_ms();
    kvft_pair_open();

    test_abort_after_write();
    test_abort_no_initiator();
    test_abort_in_flight();
    test_grant();
    test_notify();
    /* At least: 1 + 1 + 4 from test 1, 2 from test 2, 1 per in-flight round. */
    test_stats(1 + 1 + 4 + 2 + 1);
    kvft_pair_close_initiator();

    test_paused_initiator(argv[0]);

    kvf_stats o = kvft_stats(owner);
    CHECK(o.aborts_safe == (uint64_t)aborts_done, "owner aborts_safe %llu, want %d",
          (unsigned long long)o.aborts_safe, aborts_done);
    kvft_pair_close_owner();
    fprintf(stderr, "test_abort: %.0f ms\n", kvft_now_ms() - t0);
    return kvft_done("test_abort");
}
