/* Two engines of one process for the C tests of the owner's calls (abort,
 * fence): an owner with OWNER_SIZE bytes of the caller's own memory,
 * registered, and an initiator with INIT_SIZE bytes from kvf_alloc_buffer
 * that has the owner open, over tcp on loopback. A third engine, in a child
 * process started from the same executable, plays a second initiator that
 * can be paused and killed. */
#ifndef KVF_PAIR_H
#define KVF_PAIR_H

#include "kvf_child.h"

#define KiB 1024u
#define MiB (1024u * 1024u)
#define OWNER_SIZE (32 * MiB)
#define INIT_SIZE (32 * MiB)

static kvf_engine owner, init;
static char oname[128], iname[128];
static uint8_t *omem; /* the owner's memory: the caller's own, registered */
static uint8_t *imem; /* the initiator's: from kvf_alloc_buffer */
static uint64_t obase;
static kvf_segment seg; /* the owner, opened by the initiator */

/* Creates the owner and the initiator and opens the owner from the
 * initiator. */
static inline void kvft_pair_open(void) {
    owner = kvft_engine();
    init = kvft_engine();
    kvft_name(owner, oname, sizeof oname);
    kvft_name(init, iname, sizeof iname);
    CHECK(posix_memalign((void **)&omem, 4096, OWNER_SIZE) == 0, "posix_memalign");
    memset(omem, 0, OWNER_SIZE);
    CHECK_OK(kvf_register_memory(owner, omem, OWNER_SIZE, NULL));
    obase = (uint64_t)(uintptr_t)omem;
    void *p = NULL;
    CHECK_OK(kvf_alloc_buffer(init, INIT_SIZE, NULL, &p));
    imem = (uint8_t *)p;
    CHECK_OK(kvf_open_segment(init, oname, 5000, &seg));
}

/* Closes the initiator's side: its segment and its engine. */
static inline void kvft_pair_close_initiator(void) {
    CHECK_OK(kvf_close_segment(seg));
    CHECK_OK(kvf_engine_destroy(init));
}

/* Closes the owner's side: its memory and its engine. */
static inline void kvft_pair_close_owner(void) {
    CHECK_OK(kvf_unregister_memory(owner, omem));
    CHECK_OK(kvf_engine_destroy(owner));
    free(omem);
}

/* Starts this executable as the child initiator, with mode as its first
 * argument and the owner's name and base address after it; waits for its
 * "READY name" line and stores its engine's name in child_name. */
static inline void kvft_spawn_initiator(const char *self, const char *mode, char *child_name, size_t cap) {
    char base[32];
    snprintf(base, sizeof base, "%llu", (unsigned long long)obase);
    char *args[] = {(char *)self, (char *)mode, oname, base, NULL};
    kvft_spawn_child(args);
    char line[256], fmt[32];
    CHECK(fgets(line, sizeof line, kvft_child.from) != NULL, "child did not start");
    snprintf(fmt, sizeof fmt, "READY %%%zus", cap - 1);
    CHECK(sscanf(line, fmt, child_name) == 1, "child said %s", line);
}

/* The child initiator: opens the owner owner_name (whose memory starts at
 * base), says "READY name", then for each "WRITE rid off len seed" line
 * writes that much of a pattern at base + off with request id rid in one
 * synchronous call and replies "DONE status state task_error"; "QUIT" ends
 * it. */
static inline int kvft_initiator_process(const char *owner_name, unsigned long long base) {
    kvf_engine e = kvft_engine();
    void *buf = NULL;
    CHECK_OK(kvf_alloc_buffer(e, INIT_SIZE, NULL, &buf));
    kvf_segment s = NULL;
    CHECK_OK(kvf_open_segment(e, owner_name, 5000, &s));
    char name[128];
    kvft_name(e, name, sizeof name);
    printf("READY %s\n", name);
    fflush(stdout);
    char line[256];
    while (fgets(line, sizeof line, stdin) != NULL) {
        unsigned long long rid, off, len;
        unsigned seed;
        if (sscanf(line, "WRITE %llu %llu %llu %u", &rid, &off, &len, &seed) == 4) {
            kvft_fill(buf, len, seed);
            kvf_request w = kvft_req(KVF_OP_WRITE, buf, s, base + off, len, rid);
            kvf_task_status ts;
            memset(&ts, 0, sizeof ts);
            kvf_status st = kvf_transfer_sync(e, &w, 1, 20000, &ts);
            printf("DONE %d %s %d\n", (int)st, kvf_task_state_str(ts.state), (int)ts.error);
            fflush(stdout);
        } else if (strncmp(line, "QUIT", 4) == 0) {
            break;
        }
    }
    CHECK_OK(kvf_close_segment(s));
    CHECK_OK(kvf_engine_destroy(e));
    return 0;
}

/* Sends the child initiator one WRITE; kvft_child_done reads its reply. */
static inline void kvft_child_write(uint64_t rid, size_t off, size_t len, uint32_t seed) {
    fprintf(kvft_child.to, "WRITE %llu %zu %zu %u\n", (unsigned long long)rid, off, len, seed);
    fflush(kvft_child.to);
}

/* Reads the child initiator's reply to a WRITE: the call's status, the
 * task's state (state holds 32 bytes) and the task's error. */
static inline void kvft_child_done(int *code, char *state, int *task_error) {
    char line[128];
    CHECK(fgets(line, sizeof line, kvft_child.from) != NULL, "child went away");
    CHECK(sscanf(line, "DONE %d %31s %d", code, state, task_error) == 3, "child said %s", line);
}

/* The start of a paused round: the child writes len bytes of pattern seed
 * at the owner's offset off with request id rid, and once a MiB of it
 * landed (counted from the owner's owner_bytes_in, which was bytes_in0
 * before) the child is stopped. Returns the bytes landed by the stop. */
static inline uint64_t kvft_child_write_then_stop(uint64_t rid, size_t off, size_t len, uint32_t seed,
                                                  uint64_t bytes_in0) {
    kvft_child_write(rid, off, len, seed);
    double deadline = kvft_now_ms() + 10000;
    while (kvft_stats(owner).owner_bytes_in - bytes_in0 < MiB)
        CHECK(kvft_now_ms() < deadline, "no MiB of the child's WRITE landed in 10 s");
    kvft_signal_child(SIGSTOP);
    return kvft_stats(owner).owner_bytes_in - bytes_in0;
}

#endif
