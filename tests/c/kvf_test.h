/* Helpers shared by the C tests: checks that print the failing call with
 * kvferry's own message, and engine setup that ignores the environment. */
#ifndef KVF_TEST_H
#define KVF_TEST_H

#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kvferry.h"

static int kvft_failures;

/* CHECK_OK(call): the call must return KVF_OK, else the test stops. */
#define CHECK_OK(call)                                                                  \
    do {                                                                                \
        kvf_status st_ = (call);                                                        \
        if (st_ != KVF_OK) {                                                            \
            fprintf(stderr, "%s:%d: %s returned %d (%s): %s\n", __FILE__, __LINE__, #call, \
                    (int)st_, kvf_status_str(st_), kvf_last_error());                   \
            exit(1);                                                                    \
        }                                                                               \
    } while (0)

/* CHECK(cond, fmt, ...): a fatal assertion. */
#define CHECK(cond, ...)                                                        \
    do {                                                                        \
        if (!(cond)) {                                                          \
            fprintf(stderr, "%s:%d: check failed: %s: ", __FILE__, __LINE__, #cond); \
            fprintf(stderr, __VA_ARGS__);                                       \
            fprintf(stderr, "\n");                                              \
            exit(1);                                                            \
        }                                                                       \
    } while (0)

/* EXPECT_ERR(call, code, substring): the call must fail with code and a last
 * error message containing substring (NULL: any non-empty message). Counts a
 * failure and goes on otherwise. */
#define EXPECT_ERR(call, code, substr) \
    kvft_expect_err((call), (code), (substr), #call, __FILE__, __LINE__)

static inline void kvft_expect_err(kvf_status got, kvf_status want, const char *substr,
                                   const char *expr, const char *file, int line) {
    const char *msg = kvf_last_error();
    if (got != want) {
        fprintf(stderr, "%s:%d: %s: got %d (%s), want %d (%s); message: %s\n", file, line, expr,
                (int)got, kvf_status_str(got), (int)want, kvf_status_str(want), msg);
        kvft_failures++;
        return;
    }
    if (msg == NULL || msg[0] == 0 || (substr != NULL && strstr(msg, substr) == NULL)) {
        fprintf(stderr, "%s:%d: %s: message %s lacks \"%s\"\n", file, line, expr,
                msg ? msg : "(null)", substr ? substr : "");
        kvft_failures++;
        return;
    }
    if (getenv("KVFT_VERBOSE") != NULL) fprintf(stderr, "ok %-60.60s -> %s\n", expr, msg);
}

/* An engine on 127.0.0.1 with a free port, no logs, environment ignored,
 * over tcp: the tests state tcp's properties (the owner's code copies every
 * byte), which "auto" would not give on a machine with an RDMA device. */
static inline kvf_engine kvft_engine(void) {
    kvf_engine_options o;
    kvf_engine_options_init(&o);
    o.flags = KVF_ENGINE_IGNORE_ENV;
    o.protocol = "tcp";
    o.log_level = KVF_LOG_OFF;
    kvf_engine e = NULL;
    CHECK_OK(kvf_engine_create(&o, &e));
    return e;
}

static inline void kvft_name(kvf_engine e, char *buf, size_t cap) {
    size_t n = 0;
    CHECK_OK(kvf_engine_name(e, buf, cap, &n));
}

/* Fills buf with a pattern that depends on seed and the offset. */
static inline void kvft_fill(void *buf, size_t len, uint32_t seed) {
    uint8_t *p = (uint8_t *)buf;
    uint32_t x = seed * 2654435761u + 1;
    for (size_t i = 0; i < len; i++) {
        x ^= x << 13;
        x ^= x >> 17;
        x ^= x << 5;
        p[i] = (uint8_t)x;
    }
}

/* Returns the first offset where buf differs from the pattern, or -1. */
static inline long kvft_verify(const void *buf, size_t len, uint32_t seed) {
    const uint8_t *p = (const uint8_t *)buf;
    uint32_t x = seed * 2654435761u + 1;
    for (size_t i = 0; i < len; i++) {
        x ^= x << 13;
        x ^= x >> 17;
        x ^= x << 5;
        if (p[i] != (uint8_t)x) return (long)i;
    }
    return -1;
}

static inline kvf_request kvft_req(uint32_t op, void *local, kvf_segment seg, uint64_t remote,
                                   uint64_t len, uint64_t id) {
    kvf_request r;
    memset(&r, 0, sizeof r);
    r.op = op;
    r.local = local;
    r.segment = seg;
    r.remote = remote;
    r.length = len;
    r.request_id = id;
    return r;
}

static inline int kvft_done(const char *test) {
    if (kvft_failures != 0) {
        fprintf(stderr, "%s: %d failure(s)\n", test, kvft_failures);
        return 1;
    }
    fprintf(stderr, "%s: ok\n", test);
    return 0;
}

#endif
