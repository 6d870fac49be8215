/* Authentication through the C API: two engines sharing a cluster secret
 * (cluster_secret_file) move data and report the same public key; an
 * engine holding another secret is refused with KVF_ERR_UNAUTHENTICATED
 * before anything moves (it does not know the owner's key, and the owner
 * would not let it in), and the refusal is counted; reloading without an
 * allowlist file is KVF_ERR_INVALID; an engine without authentication has
 * no public key (KVF_ERR_UNSUPPORTED). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "kvf_test.h"

static void write_secret(const char *path, const char *text) {
    FILE *f = fopen(path, "w");
    CHECK(f != NULL, "create %s", path);
    CHECK(fputs(text, f) >= 0, "write %s", path);
    CHECK(fclose(f) == 0, "close %s", path);
    CHECK(chmod(path, 0600) == 0, "chmod %s", path);
}

static kvf_engine engine_with_secret(const char *secret_file) {
    kvf_engine_options o;
    kvf_engine_options_init(&o);
    o.flags = KVF_ENGINE_IGNORE_ENV;
    o.protocol = "tcp";
    o.log_level = KVF_LOG_OFF;
    o.cluster_secret_file = secret_file;
    kvf_engine e = NULL;
    CHECK_OK(kvf_engine_create(&o, &e));
    return e;
}

int main(void) {
    char dir[] = "/tmp/kvf_test_auth_XXXXXX";
    CHECK(mkdtemp(dir) != NULL, "mkdtemp");
    char shared[256], other[256];
    snprintf(shared, sizeof shared, "%s/shared", dir);
    snprintf(other, sizeof other, "%s/other", dir);
    write_secret(shared, "a cluster secret of thirty-two bytes\n");
    write_secret(other, "another secret, of thirty-two bytes\n");

    kvf_engine a = engine_with_secret(shared), b = engine_with_secret(shared), c = engine_with_secret(other);
    char ka[64], kb[64], kc[64];
    size_t n = 0;
    CHECK_OK(kvf_engine_public_key(a, ka, sizeof ka, &n));
    CHECK(n == 40, "public key of %zu characters", n);
    CHECK_OK(kvf_engine_public_key(b, kb, sizeof kb, NULL));
    CHECK_OK(kvf_engine_public_key(c, kc, sizeof kc, NULL));
    CHECK(strcmp(ka, kb) == 0 && strcmp(ka, kc) != 0, "keys: %s %s %s", ka, kb, kc);

    char an[128], bn[128];
    kvft_name(a, an, sizeof an);
    kvft_name(b, bn, sizeof bn);
    void *src = NULL, *dst = NULL;
    CHECK_OK(kvf_alloc_buffer(a, 1 << 20, NULL, &src));
    CHECK_OK(kvf_alloc_buffer(b, 1 << 20, NULL, &dst));
    kvf_segment s = NULL;
    CHECK_OK(kvf_open_segment(a, bn, 5000, &s));
    kvft_fill(src, 1 << 20, 9);
    kvf_request w = kvft_req(KVF_OP_WRITE, src, s, (uint64_t)(uintptr_t)dst, 1 << 20, 0);
    CHECK_OK(kvf_transfer_sync(a, &w, 1, 10000, NULL));
    CHECK(kvft_verify(dst, 1 << 20, 9) < 0, "data");

    kvf_segment sc = NULL;
    kvf_status st = kvf_open_segment(c, an, 5000, &sc);
    CHECK(st == KVF_ERR_UNAUTHENTICATED, "another cluster's engine opened the segment: %s (%s)", kvf_status_str(st),
          kvf_last_error());
    CHECK(strcmp(kvf_status_str(KVF_ERR_UNAUTHENTICATED), "peer not authenticated") == 0, "status string");
    kvf_stats stats;
    memset(&stats, 0, sizeof stats);
    stats.struct_size = sizeof stats;
    CHECK_OK(kvf_engine_stats(c, &stats)); /* c does not know a's key: it refuses to talk */
    CHECK(stats.auth_refused >= 1, "auth_refused %llu", (unsigned long long)stats.auth_refused);
    CHECK(kvf_engine_reload_allowlist(a, 1000) == KVF_ERR_INVALID, "reload without an allowlist file");

    kvf_engine open = kvft_engine();
    CHECK(kvf_engine_public_key(open, ka, sizeof ka, NULL) == KVF_ERR_UNSUPPORTED, "a public key without authentication");

    CHECK_OK(kvf_engine_destroy(open));
    CHECK_OK(kvf_engine_destroy(c));
    CHECK_OK(kvf_engine_destroy(b));
    CHECK_OK(kvf_engine_destroy(a));
    unlink(shared);
    unlink(other);
    rmdir(dir);
    printf("test_auth: ok\n");
    return 0;
}
