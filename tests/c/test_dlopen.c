/* dlopen(RTLD_NOW) of the installed library: every symbol resolves at load
 * (no libibverbs, libcuda or libnvidia-ml is needed or loaded), the public
 * functions are found by name, an engine can be created and destroyed, and
 * dlclose does not unload the Go runtime (the library is NODELETE). */
#include <dlfcn.h>
#include <stdio.h>
#include <string.h>

#include "kvf_test.h"

typedef uint32_t (*version_fn)(void);
typedef kvf_status (*create_fn)(const kvf_engine_options *, kvf_engine *);
typedef kvf_status (*destroy_fn)(kvf_engine);
typedef const char *(*str_fn)(void);

static int mapped(const char *needle) {
    FILE *f = fopen("/proc/self/maps", "r");
    CHECK(f != NULL, "maps");
    char line[512];
    int found = 0;
    while (fgets(line, sizeof line, f) != NULL)
        if (strstr(line, needle) != NULL) found = 1;
    fclose(f);
    return found;
}

int main(int argc, char **argv) {
    CHECK(argc == 2, "usage: test_dlopen /path/to/libkvferry.so");
    CHECK(!mapped("libkvferry"), "the test must not link the library");
    void *h = dlopen(argv[1], RTLD_NOW | RTLD_LOCAL);
    CHECK(h != NULL, "dlopen(%s, RTLD_NOW): %s", argv[1], dlerror());
    const char *absent[] = {"libibverbs", "libcuda", "libnvidia-ml", "libmlx5"};
    for (size_t i = 0; i < sizeof absent / sizeof absent[0]; i++)
        CHECK(!mapped(absent[i]), "loading kvferry mapped %s", absent[i]);

    version_fn version = (version_fn)dlsym(h, "kvf_version");
    create_fn create = (create_fn)dlsym(h, "kvf_engine_create");
    destroy_fn destroy = (destroy_fn)dlsym(h, "kvf_engine_destroy");
    str_fn last_error = (str_fn)dlsym(h, "kvf_last_error");
    CHECK(version && create && destroy && last_error, "dlsym: %s", dlerror());
    CHECK(dlsym(h, "kvfgo_engine_create") == NULL, "internal symbols are exported");
    CHECK(dlsym(h, "crosscall2") == NULL, "cgo's symbols are exported");
    CHECK(version() == KVF_VERSION_NUMBER, "library %u, header %d", version(), KVF_VERSION_NUMBER);

    kvf_engine_options o;
    kvf_engine_options_init(&o);
    o.flags = KVF_ENGINE_IGNORE_ENV;
    o.log_level = KVF_LOG_OFF;
    kvf_engine e = NULL;
    kvf_status st = create(&o, &e);
    CHECK(st == KVF_OK, "create: %d %s", st, last_error());
    CHECK(destroy(e) == KVF_OK, "destroy: %s", last_error());
    CHECK(destroy(e) == KVF_ERR_HANDLE, "destroy twice");

    CHECK(dlclose(h) == 0, "dlclose: %s", dlerror());
    CHECK(mapped("libkvferry"), "dlclose unloaded the Go runtime");
    CHECK(version() == KVF_VERSION_NUMBER, "call after dlclose");
    return kvft_done("test_dlopen");
}
