/* Helpers shared by the C tests: checks that print the failing call with
 * kvferry's own message, and engine setup that ignores the environment. */
#ifndef KVF_TEST_H
#define KVF_TEST_H

#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

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

/* Milliseconds on the monotonic clock. */
static inline double kvft_now_ms(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec * 1e3 + (double)t.tv_nsec / 1e6;
}

/* e's counters, in this header's layout. */
static inline kvf_stats kvft_stats(kvf_engine e) {
    kvf_stats s;
    memset(&s, 0, sizeof s);
    s.struct_size = sizeof s;
    CHECK_OK(kvf_engine_stats(e, &s));
    return s;
}

/* e's counters as a program built against an older header (named layout
 * in messages) asks for them, with struct_size = size: the library fills the
 * head and must neither change struct_size nor write a byte past size
 * (checked here). Only the head of the result is meaningful. */
static inline kvf_stats kvft_stats_sized(kvf_engine e, size_t size, const char *layout) {
    union {
        kvf_stats s;
        uint8_t b[sizeof(kvf_stats)];
    } u;
    memset(&u, 0xab, sizeof u);
    u.s.struct_size = (uint32_t)size;
    CHECK_OK(kvf_engine_stats(e, &u.s));
    CHECK(u.s.struct_size == size, "struct_size changed to %u", u.s.struct_size);
    for (size_t k = size; k < sizeof u; k++)
        CHECK(u.b[k] == 0xab, "byte %zu past the %s layout was written", k, layout);
    return u.s;
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

/* A request with flags 0. */
static inline kvf_request kvft_req(uint32_t op, void *local, kvf_segment seg, uint64_t remote,
                                   uint64_t len, uint64_t id) {
    kvf_request r = {.op = op, .flags = 0, .local = local, .segment = seg, .remote = remote, .length = len,
                     .request_id = id};
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
