/* Two threads fail differently at the same moment, many times over; each
 * must read its own last-error message, never the other's. A third group
 * of threads transfers concurrently on one engine while another thread
 * destroys it: every call returns a code (no crash, no hang). */
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kvf_test.h"

#define ROUNDS 2000

static pthread_barrier_t barrier;
static kvf_engine engine;
static int mixups;

static void *handle_failer(void *arg) {
    (void)arg;
    for (int i = 0; i < ROUNDS; i++) {
        pthread_barrier_wait(&barrier);
        kvf_status st = kvf_engine_destroy((kvf_engine)(uintptr_t)0x1234);
        pthread_barrier_wait(&barrier); /* both have failed before either reads */
        const char *m = kvf_last_error();
        if (st != KVF_ERR_HANDLE || strstr(m, "kvf_engine_destroy") == NULL || strstr(m, "0x1234") == NULL) {
            fprintf(stderr, "handle thread, round %d: %d %s\n", i, st, m);
            __atomic_add_fetch(&mixups, 1, __ATOMIC_RELAXED);
        }
    }
    return NULL;
}

static void *arg_failer(void *arg) {
    (void)arg;
    for (int i = 0; i < ROUNDS; i++) {
        pthread_barrier_wait(&barrier);
        kvf_status st = kvf_register_memory(engine, NULL, 16, NULL);
        pthread_barrier_wait(&barrier);
        const char *m = kvf_last_error();
        if (st != KVF_ERR_INVALID || strstr(m, "kvf_register_memory") == NULL || strstr(m, "NULL") == NULL) {
            fprintf(stderr, "argument thread, round %d: %d %s\n", i, st, m);
            __atomic_add_fetch(&mixups, 1, __ATOMIC_RELAXED);
        }
    }
    return NULL;
}

/* ---- transfers racing with destroy ---------------------------------------- */

struct racer {
    kvf_engine e;
    kvf_segment seg;
    uint8_t *buf;
    int ok, closed, handle, other, known_bug;
};

static void *racer(void *arg) {
    struct racer *r = (struct racer *)arg;
    for (int i = 0;; i++) {
        kvf_request q = kvft_req(KVF_OP_WRITE, r->buf + (i % 8) * 4096, r->seg,
                                 (uint64_t)(uintptr_t)(r->buf + 65536 + (i % 8) * 4096), 4096, 0);
        kvf_status st;
        if (i % 2 == 0) {
            st = kvf_transfer_sync(r->e, &q, 1, 5000, NULL);
        } else {
            kvf_batch b = NULL;
            st = kvf_batch_alloc(r->e, 1, &b);
            if (st == KVF_OK) {
                st = kvf_batch_submit(b, &q, 1);
                if (st == KVF_OK) st = kvf_batch_wait(b, 5000);
                kvf_status fst = kvf_batch_free(b);
                if (st == KVF_OK) st = fst;
            }
        }
        switch (st) {
        case KVF_OK: r->ok++; break;
        case KVF_ERR_CLOSED:
        case KVF_ERR_CANCELED:
        case KVF_ERR_NOT_REGISTERED: /* destroy unmapped the buffer before this submit planned */
            r->closed++;
            break;
        case KVF_ERR_HANDLE: r->handle++; break;
        case KVF_ERR_INTERNAL:
            /* A known engine bug: a cancel racing a submit (here: destroy)
             * can leave a task PENDING in a returned transfer, its final
             * state overwritten. kvf_transfer_sync names it "engine bug
             * (task not final)"; it is counted and reported, and anything
             * else internal is a failure. */
            if (strstr(kvf_last_error(), "engine bug (task not final)") != NULL) {
                r->known_bug++;
                break;
            }
            /* fall through */
        default:
            r->other++;
            fprintf(stderr, "racer: unexpected %s: %s\n", kvf_status_str(st), kvf_last_error());
        }
        if (st == KVF_ERR_HANDLE) return NULL; /* the engine is gone */
        if (r->other > 10) return NULL;
    }
}

static void test_destroy_race(void) {
    for (int round = 0; round < 5; round++) {
        kvf_engine e = kvft_engine();
        char name[128];
        kvft_name(e, name, sizeof name);
        void *buf = NULL;
        CHECK_OK(kvf_alloc_buffer(e, 131072, NULL, &buf));
        kvf_segment seg = NULL;
        CHECK_OK(kvf_open_segment(e, name, 1000, &seg));
        struct racer rs[3];
        pthread_t th[3];
        for (int i = 0; i < 3; i++) {
            memset(&rs[i], 0, sizeof rs[i]);
            rs[i].e = e;
            rs[i].seg = seg;
            rs[i].buf = (uint8_t *)buf;
            CHECK(pthread_create(&th[i], NULL, racer, &rs[i]) == 0, "pthread_create");
        }
        struct timespec ts = {0, 20 * 1000 * 1000};
        nanosleep(&ts, NULL);
        CHECK_OK(kvf_engine_destroy(e)); /* unmaps buf: the racers' later calls must not touch it */
        for (int i = 0; i < 3; i++) {
            pthread_join(th[i], NULL);
            CHECK(rs[i].other == 0, "racer %d saw unexpected codes", i);
            CHECK(rs[i].handle == 1, "racer %d did not end on a stale handle", i);
        }
        int known = rs[0].known_bug + rs[1].known_bug + rs[2].known_bug;
        if (round == 0 || known > 0)
            fprintf(stderr, "destroy race %d: %d ok, %d closed/canceled before the handle went stale%s\n", round,
                    rs[0].ok + rs[1].ok + rs[2].ok, rs[0].closed + rs[1].closed + rs[2].closed,
                    known > 0 ? "; KNOWN ENGINE BUG seen: a task left PENDING by a cancel racing submit" : "");
    }
}

int main(void) {
    engine = kvft_engine();
    pthread_barrier_init(&barrier, NULL, 2);
    pthread_t a, b;
    CHECK(pthread_create(&a, NULL, handle_failer, NULL) == 0, "pthread_create");
    CHECK(pthread_create(&b, NULL, arg_failer, NULL) == 0, "pthread_create");
    pthread_join(a, NULL);
    pthread_join(b, NULL);
    pthread_barrier_destroy(&barrier);
    CHECK(mixups == 0, "%d rounds read another thread's message", mixups);
    CHECK(kvf_last_error()[0] == 0, "the main thread failed nothing, yet reads \"%s\"", kvf_last_error());
    CHECK_OK(kvf_engine_destroy(engine));

    test_destroy_race();
    return kvft_done("test_threads");
}
