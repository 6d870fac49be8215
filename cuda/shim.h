// C side of package cuda: the CUDA driver API (libcuda.so.1) resolved at
// run time with dlopen/dlsym, so libkvferry.so loads on machines without
// the NVIDIA driver. A context is current per OS thread: every call that
// needs one makes the device's primary context current on the calling
// thread first, inside the same cgo call, so Go's thread switching cannot
// run it under another context. Primary contexts are retained only for
// devices the caller named (never device 0 by default).
#ifndef KVF_CUDA_SHIM_H
#define KVF_CUDA_SHIM_H

#include <stddef.h>
#include <stdint.h>

#pragma GCC visibility push(hidden)

typedef struct kvfc_lib kvfc_lib;

// Returns 0, or -1 with err filled when the library or a symbol is missing.
int kvfc_open(const char *path, kvfc_lib **out, char *err, size_t errlen);
// CUresult values (0 success) from here on.
int kvfc_init(kvfc_lib *l);
int kvfc_device_count(kvfc_lib *l, int *n);
int kvfc_device_info(kvfc_lib *l, int ordinal, char *name, int namelen, char *bus, int buslen, uint64_t *mem);
// Is addr device memory? *ordinal is -1 for host memory.
int kvfc_pointer(kvfc_lib *l, uint64_t addr, int *ordinal, uint64_t *base, uint64_t *size);
int kvfc_retain(kvfc_lib *l, int ordinal);
int kvfc_release(kvfc_lib *l, int ordinal);
int kvfc_alloc(kvfc_lib *l, int ordinal, uint64_t n, uint64_t *ptr);
int kvfc_free(kvfc_lib *l, int ordinal, uint64_t ptr);
int kvfc_host_register(kvfc_lib *l, int ordinal, void *p, uint64_t n);
int kvfc_host_unregister(kvfc_lib *l, int ordinal, void *p);
// kind: 1 host->device, 2 device->host, 3 device->device.
int kvfc_copy(kvfc_lib *l, int ordinal, int kind, uint64_t dst, uint64_t src, uint64_t n);
int kvfc_dmabuf(kvfc_lib *l, int ordinal, uint64_t ptr, uint64_t n, int *fd);
// CUDA IPC: a handle of the allocation at base, opened in another process
// on ordinal's context, closed there.
typedef struct {
	unsigned char reserved[64];
} kvfc_ipc_handle;
int kvfc_has_ipc(kvfc_lib *l); // 1 when the driver exports the IPC entry points
int kvfc_ipc_get(kvfc_lib *l, int ordinal, uint64_t base, kvfc_ipc_handle *out);
int kvfc_ipc_open(kvfc_lib *l, int ordinal, const kvfc_ipc_handle *h, uint64_t *ptr);
int kvfc_ipc_close(kvfc_lib *l, int ordinal, uint64_t ptr);
const char *kvfc_error_string(kvfc_lib *l, int result);
long kvfc_stat(kvfc_lib *l, const char *sym, const char *what);
int kvfc_control(kvfc_lib *l, const char *sym, const char *cmd);

#pragma GCC visibility pop

#endif
