/* The metrics listener from C: an engine created with metrics_addr serves
 * http://<kvf_metrics_addr>/metrics, and an HTTP GET of it (plain sockets
 * here, as a scraper would) returns the Prometheus text naming the engine. */
#include <arpa/inet.h>
#include <netinet/in.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <unistd.h>

#include "kvf_test.h"

/* http_get sends GET /metrics to host:port and returns the whole response
 * (malloc'd, NUL-terminated), or NULL. */
static char *http_get(const char *addr) {
    char host[64];
    const char *colon = strrchr(addr, ':');
    if (colon == NULL || (size_t)(colon - addr) >= sizeof host) return NULL;
    memcpy(host, addr, (size_t)(colon - addr));
    host[colon - addr] = 0;
    struct sockaddr_in sa;
    memset(&sa, 0, sizeof sa);
    sa.sin_family = AF_INET;
    sa.sin_port = htons((uint16_t)atoi(colon + 1));
    if (inet_pton(AF_INET, host, &sa.sin_addr) != 1) return NULL;
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    if (fd < 0) return NULL;
    struct timeval tv = {10, 0};
    setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
    if (connect(fd, (struct sockaddr *)&sa, sizeof sa) != 0) {
        close(fd);
        return NULL;
    }
    const char req[] = "GET /metrics HTTP/1.0\r\nHost: kvferry\r\n\r\n";
    if (write(fd, req, sizeof req - 1) != (ssize_t)(sizeof req - 1)) {
        close(fd);
        return NULL;
    }
    size_t cap = 1 << 16, n = 0;
    char *buf = malloc(cap);
    for (;;) {
        if (n + 1 == cap) {
            cap *= 2;
            buf = realloc(buf, cap);
        }
        ssize_t r = read(fd, buf + n, cap - n - 1);
        if (r <= 0) break;
        n += (size_t)r;
    }
    close(fd);
    buf[n] = 0;
    return buf;
}

int main(void) {
    kvf_engine_options o;
    kvf_engine_options_init(&o);
    o.flags = KVF_ENGINE_IGNORE_ENV;
    o.log_level = KVF_LOG_OFF;
    o.metrics_addr = "127.0.0.1:0";
    kvf_engine e = NULL;
    CHECK_OK(kvf_engine_create(&o, &e));
    char name[128], addr[64];
    CHECK_OK(kvf_engine_name(e, name, sizeof name, NULL));
    size_t alen = 0;
    CHECK_OK(kvf_metrics_addr(e, addr, sizeof addr, &alen));
    CHECK(alen > 0 && strncmp(addr, "127.0.0.1:", 10) == 0 && strcmp(addr, "127.0.0.1:0") != 0,
          "metrics address %s: want 127.0.0.1 and the port chosen", addr);

    char *resp = http_get(addr);
    CHECK(resp != NULL, "GET http://%s/metrics failed", addr);
    CHECK(strncmp(resp, "HTTP/1.0 200", 12) == 0 || strncmp(resp, "HTTP/1.1 200", 12) == 0,
          "response: %.80s", resp);
    char want[256];
    snprintf(want, sizeof want, "kvferry_info{engine=\"%s\",version=\"%s\"} 1", name, KVF_VERSION_STRING);
    CHECK(strstr(resp, want) != NULL, "no %s in:\n%s", want, resp);
    free(resp);

    /* A second engine asking for the address the first got shares its
     * listener: both are served there. */
    kvf_engine_options o2 = o;
    o2.metrics_addr = addr;
    kvf_engine e2 = NULL;
    CHECK_OK(kvf_engine_create(&o2, &e2));
    char name2[128], addr2[64];
    CHECK_OK(kvf_engine_name(e2, name2, sizeof name2, NULL));
    CHECK_OK(kvf_metrics_addr(e2, addr2, sizeof addr2, NULL));
    CHECK(strcmp(addr, addr2) == 0, "second engine's metrics address %s, want %s", addr2, addr);
    resp = http_get(addr);
    CHECK(resp != NULL, "GET http://%s/metrics failed", addr);
    snprintf(want, sizeof want, "kvferry_info{engine=\"%s\"", name2);
    CHECK(resp != NULL && strstr(resp, want) != NULL, "the second engine is not served at %s", addr);
    free(resp);

    /* Destroying the first leaves the listener to the second. */
    CHECK_OK(kvf_engine_destroy(e));
    resp = http_get(addr);
    snprintf(want, sizeof want, "kvferry_info{engine=\"%s\"", name);
    CHECK(resp != NULL && strstr(resp, want) == NULL, "the destroyed engine is still served");
    free(resp);
    CHECK_OK(kvf_engine_destroy(e2));
    resp = http_get(addr);
    CHECK(resp == NULL || resp[0] == 0, "the listener answers after its engine was destroyed: %.80s",
          resp ? resp : "");
    free(resp);
    return kvft_done("test_metrics");
}
