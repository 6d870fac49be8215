// The CUDA driver API through dlopen. Types are declared here (no CUDA
// headers are needed to build); the values are the driver API's (cuda.h).
#define _GNU_SOURCE
#include "shim.h"

#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef int CUresult;
typedef int CUdevice;
typedef unsigned long long CUdeviceptr;
typedef void *CUcontext;

enum {
	CU_POINTER_ATTRIBUTE_MEMORY_TYPE = 2,
	CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL = 9,
	CU_MEMORYTYPE_DEVICE = 2,
	CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD = 1,
	CUDA_ERROR_INVALID_VALUE = 1,
	CUDA_ERROR_INVALID_DEVICE = 101,
};

#define MAXDEV 64

struct kvfc_lib {
	void *h;
	CUcontext ctx[MAXDEV]; // retained primary contexts
	void *stream[MAXDEV];  // per context: our copies' non-blocking stream, or NULL
	CUresult (*Init)(unsigned);
	CUresult (*DeviceGetCount)(int *);
	CUresult (*DeviceGet)(CUdevice *, int);
	CUresult (*DeviceGetName)(char *, int, CUdevice);
	CUresult (*DeviceGetPCIBusId)(char *, int, CUdevice);
	CUresult (*DeviceTotalMem)(size_t *, CUdevice);
	CUresult (*PrimaryCtxRetain)(CUcontext *, CUdevice);
	CUresult (*PrimaryCtxRelease)(CUdevice);
	CUresult (*CtxSetCurrent)(CUcontext);
	CUresult (*PointerGetAttributes)(unsigned, int *, void **, CUdeviceptr);
	CUresult (*MemGetAddressRange)(CUdeviceptr *, size_t *, CUdeviceptr);
	CUresult (*MemAlloc)(CUdeviceptr *, size_t);
	CUresult (*MemFree)(CUdeviceptr);
	CUresult (*MemHostRegister)(void *, size_t, unsigned);
	CUresult (*MemHostUnregister)(void *);
	CUresult (*MemcpyHtoD)(CUdeviceptr, const void *, size_t);
	CUresult (*MemcpyDtoH)(void *, CUdeviceptr, size_t);
	CUresult (*MemcpyDtoD)(CUdeviceptr, CUdeviceptr, size_t);
	CUresult (*GetHandle)(void *, CUdeviceptr, size_t, int, unsigned long long);
	// CUDA IPC (optional: the engine goes without it).
	CUresult (*IpcGetMemHandle)(void *, CUdeviceptr);
	CUresult (*IpcOpenMemHandle)(CUdeviceptr *, kvfc_ipc_handle, unsigned);
	CUresult (*IpcCloseMemHandle)(CUdeviceptr);
	CUresult (*CtxSynchronize)(void);
	// A stream of our own per context (optional: without them copies run
	// on the default stream and wait for the whole context).
	CUresult (*StreamCreate)(void **, unsigned);
	CUresult (*StreamSynchronize)(void *);
	CUresult (*StreamDestroy)(void *);
	CUresult (*MemcpyHtoDAsync)(CUdeviceptr, const void *, size_t, void *);
	CUresult (*MemcpyDtoHAsync)(void *, CUdeviceptr, size_t, void *);
	CUresult (*MemcpyDtoDAsync)(CUdeviceptr, CUdeviceptr, size_t, void *);
	CUresult (*GetErrorString)(CUresult, const char **);
};

static kvfc_lib *volatile kept[8] __attribute__((used));
static int nkept;

int kvfc_open(const char *path, kvfc_lib **out, char *err, size_t errlen) {
	*out = NULL;
	dlerror();
	void *h = dlopen(path, RTLD_NOW | RTLD_LOCAL);
	if (h == NULL) {
		const char *e = dlerror();
		snprintf(err, errlen, "%s", e ? e : "dlopen failed");
		return -1;
	}
	kvfc_lib *l = calloc(1, sizeof(*l));
	if (l == NULL) {
		snprintf(err, errlen, "out of memory");
		dlclose(h);
		return -1;
	}
	l->h = h;
#define SYM(f, name, req)                                                      \
	do {                                                                       \
		*(void **)&l->f = dlsym(h, name);                                      \
		if (l->f == NULL && (req)) {                                           \
			snprintf(err, errlen, "%s: symbol %s not found", path, name);      \
			free(l);                                                           \
			dlclose(h);                                                        \
			return -1;                                                         \
		}                                                                      \
	} while (0)
	SYM(Init, "cuInit", 1);
	SYM(DeviceGetCount, "cuDeviceGetCount", 1);
	SYM(DeviceGet, "cuDeviceGet", 1);
	SYM(DeviceGetName, "cuDeviceGetName", 1);
	SYM(DeviceGetPCIBusId, "cuDeviceGetPCIBusId", 1);
	SYM(DeviceTotalMem, "cuDeviceTotalMem_v2", 1);
	SYM(PrimaryCtxRetain, "cuDevicePrimaryCtxRetain", 1);
	SYM(PrimaryCtxRelease, "cuDevicePrimaryCtxRelease_v2", 1);
	SYM(CtxSetCurrent, "cuCtxSetCurrent", 1);
	SYM(PointerGetAttributes, "cuPointerGetAttributes", 1);
	SYM(MemGetAddressRange, "cuMemGetAddressRange_v2", 1);
	SYM(MemAlloc, "cuMemAlloc_v2", 1);
	SYM(MemFree, "cuMemFree_v2", 1);
	SYM(MemHostRegister, "cuMemHostRegister_v2", 1);
	SYM(MemHostUnregister, "cuMemHostUnregister", 1);
	SYM(MemcpyHtoD, "cuMemcpyHtoD_v2", 1);
	SYM(MemcpyDtoH, "cuMemcpyDtoH_v2", 1);
	SYM(MemcpyDtoD, "cuMemcpyDtoD_v2", 1);
	SYM(GetHandle, "cuMemGetHandleForAddressRange", 0); // CUDA 11.7+
	SYM(IpcGetMemHandle, "cuIpcGetMemHandle", 0);
	SYM(IpcOpenMemHandle, "cuIpcOpenMemHandle_v2", 0);
	SYM(IpcCloseMemHandle, "cuIpcCloseMemHandle", 0);
	SYM(CtxSynchronize, "cuCtxSynchronize", 0);
	SYM(StreamCreate, "cuStreamCreate", 0);
	SYM(StreamSynchronize, "cuStreamSynchronize", 0);
	SYM(StreamDestroy, "cuStreamDestroy_v2", 0);
	SYM(MemcpyHtoDAsync, "cuMemcpyHtoDAsync_v2", 0);
	SYM(MemcpyDtoHAsync, "cuMemcpyDtoHAsync_v2", 0);
	SYM(MemcpyDtoDAsync, "cuMemcpyDtoDAsync_v2", 0);
	SYM(GetErrorString, "cuGetErrorString", 1);
#undef SYM
	int i = __atomic_fetch_add(&nkept, 1, __ATOMIC_RELAXED);
	if (i < 8)
		kept[i] = l;
	*out = l;
	return 0;
}

int kvfc_init(kvfc_lib *l) { return l->Init(0); }

int kvfc_device_count(kvfc_lib *l, int *n) { return l->DeviceGetCount(n); }

int kvfc_device_info(kvfc_lib *l, int ordinal, char *name, int namelen, char *bus, int buslen, uint64_t *mem) {
	CUdevice d;
	CUresult r = l->DeviceGet(&d, ordinal);
	if (r)
		return r;
	if ((r = l->DeviceGetName(name, namelen, d)))
		return r;
	if ((r = l->DeviceGetPCIBusId(bus, buslen, d)))
		return r;
	size_t m = 0;
	r = l->DeviceTotalMem(&m, d);
	*mem = m;
	return r;
}

// current makes ordinal's retained primary context current on this thread.
static CUresult current(kvfc_lib *l, int ordinal) {
	if (ordinal < 0 || ordinal >= MAXDEV || l->ctx[ordinal] == NULL)
		return CUDA_ERROR_INVALID_DEVICE;
	return l->CtxSetCurrent(l->ctx[ordinal]);
}

int kvfc_pointer(kvfc_lib *l, uint64_t addr, int *ordinal, uint64_t *base, uint64_t *size) {
	// cuPointerGetAttributes needs no current context and answers host
	// memory with type 0 instead of an error.
	int attrs[2] = {CU_POINTER_ATTRIBUTE_MEMORY_TYPE, CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL};
	unsigned type = 0;
	int ord = -1;
	void *data[2] = {&type, &ord};
	*ordinal = -1;
	*base = 0;
	*size = 0;
	CUresult r = l->PointerGetAttributes(2, attrs, data, (CUdeviceptr)addr);
	if (r || type != CU_MEMORYTYPE_DEVICE)
		return r == CUDA_ERROR_INVALID_VALUE ? 0 : r;
	*ordinal = ord;
	// The range query wants the allocation's context current: the
	// caller's memory lives there, so that context exists already.
	if ((r = current(l, ord)))
		return r;
	CUdeviceptr b = 0;
	size_t s = 0;
	if ((r = l->MemGetAddressRange(&b, &s, (CUdeviceptr)addr)))
		return r;
	*base = b;
	*size = s;
	return 0;
}

int kvfc_retain(kvfc_lib *l, int ordinal) {
	if (ordinal < 0 || ordinal >= MAXDEV)
		return CUDA_ERROR_INVALID_DEVICE;
	if (l->ctx[ordinal] != NULL)
		return 0;
	CUdevice d;
	CUresult r = l->DeviceGet(&d, ordinal);
	if (r)
		return r;
	CUcontext c = NULL;
	if ((r = l->PrimaryCtxRetain(&c, d)))
		return r;
	// Our copies get a stream of their own that does not wait for the
	// default stream (CU_STREAM_NON_BLOCKING, 0x1): waiting for one of
	// them waits for it alone, not for the application's kernels.
	void *s = NULL;
	if (l->StreamCreate != NULL && l->StreamSynchronize != NULL && l->MemcpyHtoDAsync != NULL &&
	    l->MemcpyDtoHAsync != NULL && l->MemcpyDtoDAsync != NULL && l->CtxSetCurrent(c) == 0 &&
	    l->StreamCreate(&s, 0x1) != 0)
		s = NULL;
	l->stream[ordinal] = s;
	l->ctx[ordinal] = c;
	return 0;
}

int kvfc_release(kvfc_lib *l, int ordinal) {
	if (ordinal < 0 || ordinal >= MAXDEV || l->ctx[ordinal] == NULL)
		return 0;
	CUdevice d;
	CUresult r = l->DeviceGet(&d, ordinal);
	if (r)
		return r;
	if (l->stream[ordinal] != NULL && l->StreamDestroy != NULL && l->CtxSetCurrent(l->ctx[ordinal]) == 0)
		l->StreamDestroy(l->stream[ordinal]);
	l->stream[ordinal] = NULL;
	l->ctx[ordinal] = NULL;
	return l->PrimaryCtxRelease(d);
}

int kvfc_alloc(kvfc_lib *l, int ordinal, uint64_t n, uint64_t *ptr) {
	CUresult r = current(l, ordinal);
	if (r)
		return r;
	CUdeviceptr p = 0;
	r = l->MemAlloc(&p, n);
	*ptr = p;
	return r;
}

int kvfc_free(kvfc_lib *l, int ordinal, uint64_t ptr) {
	CUresult r = current(l, ordinal);
	return r ? r : l->MemFree(ptr);
}

int kvfc_host_register(kvfc_lib *l, int ordinal, void *p, uint64_t n) {
	CUresult r = current(l, ordinal);
	// Portable: staging buffers serve every device's copies.
	return r ? r : l->MemHostRegister(p, n, 0x1 /* CU_MEMHOSTREGISTER_PORTABLE */);
}

int kvfc_host_unregister(kvfc_lib *l, int ordinal, void *p) {
	CUresult r = current(l, ordinal);
	return r ? r : l->MemHostUnregister(p);
}

int kvfc_copy(kvfc_lib *l, int ordinal, int kind, uint64_t dst, uint64_t src, uint64_t n) {
	CUresult r = current(l, ordinal);
	if (r)
		return r;
	// Every copy has ended when this returns: the caller's guard must
	// cover all of it. (The synchronous calls may return early: a
	// host-to-device copy from pageable memory once the bytes are staged,
	// a device-to-device copy at once.)
	void *s = l->stream[ordinal];
	if (s != NULL) {
		switch (kind) {
		case 1:
			r = l->MemcpyHtoDAsync(dst, (const void *)(uintptr_t)src, n, s);
			break;
		case 2:
			r = l->MemcpyDtoHAsync((void *)(uintptr_t)dst, src, n, s);
			break;
		case 3:
			r = l->MemcpyDtoDAsync(dst, src, n, s);
			break;
		default:
			return CUDA_ERROR_INVALID_VALUE;
		}
		// Waited for even after an error: a copy may have started.
		CUresult w = l->StreamSynchronize(s);
		return r ? r : w;
	}
	switch (kind) {
	case 1:
		r = l->MemcpyHtoD(dst, (const void *)(uintptr_t)src, n);
		break;
	case 2:
		return l->MemcpyDtoH((void *)(uintptr_t)dst, src, n);
	case 3:
		r = l->MemcpyDtoD(dst, src, n);
		break;
	default:
		return CUDA_ERROR_INVALID_VALUE;
	}
	CUresult w = l->CtxSynchronize != NULL ? l->CtxSynchronize() : 0;
	return r ? r : w;
}

int kvfc_has_ipc(kvfc_lib *l) { return l->IpcGetMemHandle != NULL && l->IpcOpenMemHandle != NULL && l->IpcCloseMemHandle != NULL; }

int kvfc_ipc_get(kvfc_lib *l, int ordinal, uint64_t base, kvfc_ipc_handle *out) {
	if (l->IpcGetMemHandle == NULL)
		return 801; // CUDA_ERROR_NOT_SUPPORTED
	CUresult r = current(l, ordinal);
	if (r)
		return r;
	return l->IpcGetMemHandle(out, base);
}

int kvfc_ipc_open(kvfc_lib *l, int ordinal, const kvfc_ipc_handle *h, uint64_t *ptr) {
	if (l->IpcOpenMemHandle == NULL)
		return 801;
	CUresult r = current(l, ordinal);
	if (r)
		return r;
	CUdeviceptr p = 0;
	// CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS (0x1): the memory may live on
	// another device than the context's.
	r = l->IpcOpenMemHandle(&p, *h, 1);
	*ptr = p;
	return r;
}

int kvfc_ipc_close(kvfc_lib *l, int ordinal, uint64_t ptr) {
	if (l->IpcCloseMemHandle == NULL)
		return 801;
	CUresult r = current(l, ordinal);
	if (r)
		return r;
	return l->IpcCloseMemHandle(ptr);
}

int kvfc_dmabuf(kvfc_lib *l, int ordinal, uint64_t ptr, uint64_t n, int *fd) {
	if (l->GetHandle == NULL)
		return 801; // CUDA_ERROR_NOT_SUPPORTED
	CUresult r = current(l, ordinal);
	if (r)
		return r;
	*fd = -1;
	return l->GetHandle(fd, ptr, n, CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD, 0);
}

const char *kvfc_error_string(kvfc_lib *l, int result) {
	const char *s = NULL;
	if (l->GetErrorString(result, &s) || s == NULL)
		return "unknown CUDA error";
	return s;
}

long kvfc_stat(kvfc_lib *l, const char *sym, const char *what) {
	long (*f)(const char *) = NULL;
	*(void **)&f = dlsym(l->h, sym);
	return f ? f(what) : -1;
}

int kvfc_control(kvfc_lib *l, const char *sym, const char *cmd) {
	int (*f)(const char *) = NULL;
	*(void **)&f = dlsym(l->h, sym);
	if (f == NULL)
		return -2;
	return f(cmd);
}
