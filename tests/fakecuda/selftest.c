// selftest: loads the fake libcuda as kvferry's cuda/ does (dlopen RTLD_NOW,
// dlsym by the driver's exported names) and checks what kvferry's tests rely
// on. Child processes (this program run again with --child) check the
// environment variables, FAKECUDA_DEVICES=0 included. Exit 0 when every
// check passed; each failure is printed.
//
// usage: selftest path/to/libcuda.so.1
#define _GNU_SOURCE
#include <dlfcn.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

typedef int CUresult;
typedef int CUdevice;
typedef unsigned long long CUdeviceptr;
typedef void *CUcontext, *CUstream, *CUevent;

static CUresult (*cuInit)(unsigned);
static CUresult (*cuDriverGetVersion)(int *);
static CUresult (*cuDeviceGetCount)(int *);
static CUresult (*cuDeviceGet)(CUdevice *, int);
static CUresult (*cuDeviceGetName)(char *, int, CUdevice);
static CUresult (*cuDeviceGetPCIBusId)(char *, int, CUdevice);
static CUresult (*cuDeviceGetAttribute)(int *, int, CUdevice);
static CUresult (*cuDeviceTotalMem_v2)(size_t *, CUdevice);
static CUresult (*cuDevicePrimaryCtxRetain)(CUcontext *, CUdevice);
static CUresult (*cuDevicePrimaryCtxRelease_v2)(CUdevice);
static CUresult (*cuCtxCreate_v2)(CUcontext *, unsigned, CUdevice);
static CUresult (*cuCtxDestroy_v2)(CUcontext);
static CUresult (*cuCtxSetCurrent)(CUcontext);
static CUresult (*cuCtxGetCurrent)(CUcontext *);
static CUresult (*cuCtxGetDevice)(CUdevice *);
static CUresult (*cuCtxSynchronize)(void);
static CUresult (*cuMemAlloc_v2)(CUdeviceptr *, size_t);
static CUresult (*cuMemFree_v2)(CUdeviceptr);
static CUresult (*cuMemGetAddressRange_v2)(CUdeviceptr *, size_t *, CUdeviceptr);
static CUresult (*cuPointerGetAttribute)(void *, int, CUdeviceptr);
static CUresult (*cuPointerGetAttributes)(unsigned, int *, void **, CUdeviceptr);
static CUresult (*cuMemHostAlloc)(void **, size_t, unsigned);
static CUresult (*cuMemFreeHost)(void *);
static CUresult (*cuMemHostRegister_v2)(void *, size_t, unsigned);
static CUresult (*cuMemHostUnregister)(void *);
static CUresult (*cuMemcpyHtoD_v2)(CUdeviceptr, const void *, size_t);
static CUresult (*cuMemcpyDtoH_v2)(void *, CUdeviceptr, size_t);
static CUresult (*cuMemcpyDtoD_v2)(CUdeviceptr, CUdeviceptr, size_t);
static CUresult (*cuMemcpy)(CUdeviceptr, CUdeviceptr, size_t);
static CUresult (*cuMemcpyHtoDAsync_v2)(CUdeviceptr, const void *, size_t, CUstream);
static CUresult (*cuMemcpyDtoHAsync_v2)(void *, CUdeviceptr, size_t, CUstream);
static CUresult (*cuStreamCreate)(CUstream *, unsigned);
static CUresult (*cuStreamSynchronize)(CUstream);
static CUresult (*cuStreamQuery)(CUstream);
static CUresult (*cuStreamDestroy_v2)(CUstream);
static CUresult (*cuEventCreate)(CUevent *, unsigned);
static CUresult (*cuEventRecord)(CUevent, CUstream);
static CUresult (*cuEventQuery)(CUevent);
static CUresult (*cuEventSynchronize)(CUevent);
static CUresult (*cuEventDestroy_v2)(CUevent);
typedef struct {
	char reserved[64];
} CUipcMemHandle;
static CUresult (*cuIpcGetMemHandle)(CUipcMemHandle *, CUdeviceptr);
static CUresult (*cuIpcOpenMemHandle_v2)(CUdeviceptr *, CUipcMemHandle, unsigned);
static CUresult (*cuIpcCloseMemHandle)(CUdeviceptr);
static long (*fakecuda_stats_fn)(const char *);
static CUresult (*cuMemGetHandleForAddressRange)(void *, CUdeviceptr, size_t, int, unsigned long long);
static CUresult (*cuGetErrorString)(CUresult, const char **);
static CUresult (*cuGetErrorName)(CUresult, const char **);
static int (*fakecuda_control)(const char *);
static long (*fakecuda_stats)(const char *);

// CUresult and attribute values (NVIDIA's cuda.h; see fakecuda.c).
enum {
	OK = 0, INVALID_VALUE = 1, OUT_OF_MEMORY = 2, NOT_INITIALIZED = 3, NO_DEVICE = 100, INVALID_DEVICE = 101,
	INVALID_CONTEXT = 201, INVALID_HANDLE = 400, NOT_FOUND = 500, CONTEXT_IS_DESTROYED = 709,
	ALREADY_REGISTERED = 712, NOT_REGISTERED = 713, NOT_SUPPORTED = 801, UNKNOWN = 999,
	A_PCI_BUS = 33, A_PCI_DEVICE = 34, A_PCI_DOMAIN = 50, A_DMA_BUF = 124,
	P_CONTEXT = 1, P_MEMORY_TYPE = 2, P_DEVICE_POINTER = 3, P_HOST_POINTER = 4, P_DEVICE_ORDINAL = 9,
	P_RANGE_START = 11, P_RANGE_SIZE = 12, MT_HOST = 1, MT_DEVICE = 2, DMA_BUF_FD = 1,
};

static int failures;

#define CHECK(cond)                                                                               \
	do {                                                                                          \
		if (!(cond)) {                                                                            \
			failures++;                                                                           \
			fprintf(stderr, "%s:%d: check failed: %s\n", __FILE__, __LINE__, #cond);              \
		}                                                                                         \
	} while (0)
// EQ(call or value, want): compares as long long and prints both on a mismatch.
#define EQ(got, want)                                                                             \
	do {                                                                                          \
		long long g_ = (long long)(got), w_ = (long long)(want);                                  \
		if (g_ != w_) {                                                                           \
			failures++;                                                                           \
			fprintf(stderr, "%s:%d: %s = %lld, want %lld\n", __FILE__, __LINE__, #got, g_, w_);   \
		}                                                                                         \
	} while (0)

static void *lib;

static void load(const char *path) {
	lib = dlopen(path, RTLD_NOW | RTLD_LOCAL);
	if (lib == NULL) {
		fprintf(stderr, "dlopen %s: %s\n", path, dlerror());
		exit(2);
	}
#define SYM(f)                                                                                    \
	do {                                                                                          \
		*(void **)&f = dlsym(lib, #f);                                                            \
		if (f == NULL) {                                                                          \
			fprintf(stderr, "%s: no symbol %s\n", path, #f);                                      \
			exit(2);                                                                              \
		}                                                                                         \
	} while (0)
	SYM(cuInit); SYM(cuDriverGetVersion); SYM(cuDeviceGetCount); SYM(cuDeviceGet); SYM(cuDeviceGetName);
	SYM(cuDeviceGetPCIBusId); SYM(cuDeviceGetAttribute); SYM(cuDeviceTotalMem_v2); SYM(cuDevicePrimaryCtxRetain);
	SYM(cuDevicePrimaryCtxRelease_v2); SYM(cuCtxCreate_v2); SYM(cuCtxDestroy_v2); SYM(cuCtxSetCurrent);
	SYM(cuCtxGetCurrent); SYM(cuCtxGetDevice); SYM(cuCtxSynchronize); SYM(cuMemAlloc_v2); SYM(cuMemFree_v2);
	SYM(cuMemGetAddressRange_v2); SYM(cuPointerGetAttribute); SYM(cuPointerGetAttributes); SYM(cuMemHostAlloc);
	SYM(cuMemFreeHost); SYM(cuMemHostRegister_v2); SYM(cuMemHostUnregister); SYM(cuMemcpyHtoD_v2);
	SYM(cuMemcpyDtoH_v2); SYM(cuMemcpyDtoD_v2); SYM(cuMemcpy); SYM(cuMemcpyHtoDAsync_v2); SYM(cuMemcpyDtoHAsync_v2);
	SYM(cuIpcGetMemHandle); SYM(cuIpcOpenMemHandle_v2); SYM(cuIpcCloseMemHandle);
	*(void **)&fakecuda_stats_fn = dlsym(lib, "fakecuda_stats");
	SYM(cuStreamCreate); SYM(cuStreamSynchronize); SYM(cuStreamQuery); SYM(cuStreamDestroy_v2); SYM(cuEventCreate);
	SYM(cuEventRecord); SYM(cuEventQuery); SYM(cuEventSynchronize); SYM(cuEventDestroy_v2);
	SYM(cuMemGetHandleForAddressRange); SYM(cuGetErrorString); SYM(cuGetErrorName); SYM(fakecuda_control);
	SYM(fakecuda_stats);
#undef SYM
	// The pre-3.2 names take 32-bit sizes in the real driver: a consumer that
	// asks for them has a bug, so the fake does not offer them.
	CHECK(dlsym(lib, "cuMemAlloc") == NULL && dlsym(lib, "cuCtxDestroy") == NULL);
	// Its soname is not libcuda.so.1, so the real driver can still be found.
	CHECK(dlopen("libcuda.so.1", RTLD_NOW | RTLD_NOLOAD) == NULL);
}

static double now(void) {
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return ts.tv_sec + ts.tv_nsec / 1e9;
}

static void fill(unsigned char *p, size_t n, unsigned seed) {
	for (size_t i = 0; i < n; i++)
		p[i] = (unsigned char)(i * 31 + seed);
}

static void check_devices(void) {
	int n = -1, v = -1;
	char s[64];
	size_t mem = 0;
	CUdevice d = -1;
	EQ(cuDeviceGetCount(&n), OK);
	EQ(n, 2);
	EQ(cuDeviceGet(&d, 1), OK);
	EQ(d, 1);
	EQ(cuDeviceGet(&d, 2), INVALID_DEVICE);
	EQ(cuDeviceGet(&d, -1), INVALID_DEVICE);
	EQ(cuDeviceGet(NULL, 0), INVALID_VALUE);
	EQ(cuDeviceGetName(s, sizeof(s), 1), OK);
	CHECK(strcmp(s, "kvferry fake GPU 1") == 0);
	EQ(cuDeviceGetName(s, 4, 0), OK); // truncated, terminated
	CHECK(strcmp(s, "kvf") == 0);
	EQ(cuDeviceGetName(NULL, 10, 0), INVALID_VALUE);
	EQ(cuDeviceGetPCIBusId(s, sizeof(s), 0), OK);
	CHECK(strcmp(s, "0000:20:00.0") == 0);
	EQ(cuDeviceGetPCIBusId(s, sizeof(s), 1), OK);
	CHECK(strcmp(s, "0000:21:00.0") == 0);
	EQ(cuDeviceGetAttribute(&v, A_PCI_BUS, 1), OK);
	EQ(v, 0x21);
	EQ(cuDeviceGetAttribute(&v, A_PCI_DEVICE, 1), OK);
	EQ(v, 0);
	EQ(cuDeviceGetAttribute(&v, A_PCI_DOMAIN, 1), OK);
	EQ(v, 0);
	EQ(cuDeviceGetAttribute(&v, A_DMA_BUF, 0), OK);
	EQ(v, 1);
	EQ(cuDeviceGetAttribute(&v, A_PCI_BUS, 5), INVALID_DEVICE);
	EQ(cuDeviceTotalMem_v2(&mem, 0), OK);
	EQ(mem, 1 << 30);
}

// Device memory, pointer queries, copies; runs on device 1's primary context.
static void check_memory(CUcontext ctx) {
	enum { N = 1 << 20, M = 4097 };
	static unsigned char src[N], dst[N];
	CUdeviceptr a = 0, b = 0, base = 0;
	size_t size = 0;
	int stack_var = 0;
	long copies = fakecuda_stats("copies");
	EQ(cuMemAlloc_v2(&a, N), OK);
	EQ(cuMemAlloc_v2(&b, M), OK);
	EQ(cuMemAlloc_v2(&base, 0), INVALID_VALUE);
	EQ(cuMemAlloc_v2(&base, (size_t)2 << 30), OUT_OF_MEMORY); // FAKECUDA_MEM is 1 GiB
	EQ(fakecuda_stats("allocs"), 2);
	EQ(fakecuda_stats("bytes"), N + M);

	// An address inside an allocation.
	CUdeviceptr in = a + 12345, dp = 0;
	unsigned type = 0;
	int ord = -1;
	CUcontext c = NULL;
	void *hp = NULL;
	EQ(cuMemGetAddressRange_v2(&base, &size, in), OK);
	EQ(base, a);
	EQ(size, N);
	EQ(cuMemGetAddressRange_v2(NULL, &size, b + M - 1), OK);
	EQ(size, M);
	EQ(cuPointerGetAttribute(&type, P_MEMORY_TYPE, in), OK);
	EQ(type, MT_DEVICE);
	EQ(cuPointerGetAttribute(&ord, P_DEVICE_ORDINAL, in), OK);
	EQ(ord, 1);
	EQ(cuPointerGetAttribute(&c, P_CONTEXT, in), OK);
	CHECK(c == ctx);
	EQ(cuPointerGetAttribute(&dp, P_DEVICE_POINTER, in), OK);
	EQ(dp, in);
	EQ(cuPointerGetAttribute(&base, P_RANGE_START, in), OK);
	EQ(base, a);
	EQ(cuPointerGetAttribute(&size, P_RANGE_SIZE, in), OK);
	EQ(size, N);
	EQ(cuPointerGetAttribute(&hp, P_HOST_POINTER, in), INVALID_VALUE);
	EQ(cuPointerGetAttribute(NULL, P_MEMORY_TYPE, in), INVALID_VALUE);
	int attrs[3] = {P_MEMORY_TYPE, P_DEVICE_ORDINAL, P_CONTEXT};
	void *data[3] = {&type, &ord, &c};
	type = 0, ord = -1, c = NULL;
	EQ(cuPointerGetAttributes(3, attrs, data, in), OK);
	CHECK(type == MT_DEVICE && ord == 1 && c == ctx);

	// Host addresses, and the byte just past an allocation, are not device memory.
	CUdeviceptr host = (CUdeviceptr)(uintptr_t)&stack_var;
	EQ(cuPointerGetAttribute(&type, P_MEMORY_TYPE, host), INVALID_VALUE);
	EQ(cuPointerGetAttribute(&type, P_MEMORY_TYPE, b + M), INVALID_VALUE);
	type = 7, ord = 7, c = ctx;
	EQ(cuPointerGetAttributes(3, attrs, data, host), OK);
	CHECK(type == 0 && ord == -2 && c == NULL);
	EQ(cuMemGetAddressRange_v2(&base, &size, host), NOT_FOUND);
	EQ(cuMemGetAddressRange_v2(&base, &size, a + N), NOT_FOUND);

	// H2D, D2H, D2D, unified, with the data checked. Device memory is host
	// memory of this process, readable directly.
	fill(src, N, 1);
	EQ(cuMemcpyHtoD_v2(a, src, N), OK);
	CHECK(memcmp((void *)(uintptr_t)a, src, N) == 0);
	EQ(cuMemcpyDtoH_v2(dst, a, N), OK);
	CHECK(memcmp(dst, src, N) == 0);
	EQ(cuMemcpyDtoD_v2(b, a + 100, M), OK);
	memset(dst, 0, M);
	EQ(cuMemcpyDtoH_v2(dst, b, M), OK);
	CHECK(memcmp(dst, src + 100, M) == 0);
	fill(src, 64, 9);
	EQ(cuMemcpy(b + 1, (CUdeviceptr)(uintptr_t)src, 64), OK);
	EQ(cuMemcpy((CUdeviceptr)(uintptr_t)dst, b + 1, 64), OK);
	CHECK(memcmp(dst, src, 64) == 0);
	EQ(fakecuda_stats("copies"), copies + 6);

	// Ranges must lie fully inside one allocation.
	EQ(cuMemcpyHtoD_v2(b, src, M + 1), INVALID_VALUE);
	EQ(cuMemcpyHtoD_v2(b + 1, src, M), INVALID_VALUE);
	EQ(cuMemcpyHtoD_v2(host, src, 4), INVALID_VALUE);
	EQ(cuMemcpyDtoH_v2(dst, a + N - 4, 8), INVALID_VALUE);
	EQ(cuMemcpyDtoD_v2(a, host, 4), INVALID_VALUE);
	EQ(cuMemcpyHtoD_v2(a, NULL, 4), INVALID_VALUE);
	EQ(cuMemcpy(a + N - 1, (CUdeviceptr)(uintptr_t)src, 2), INVALID_VALUE);
	EQ(fakecuda_stats("copies"), copies + 6);

	// Async copies and an event.
	CUstream st = NULL;
	CUevent ev = NULL;
	fill(src, N, 3);
	EQ(cuStreamCreate(&st, 0), OK);
	EQ(cuEventCreate(&ev, 0), OK);
	EQ(cuMemcpyHtoDAsync_v2(a, src, N, st), OK);
	EQ(cuEventRecord(ev, st), OK);
	EQ(cuEventQuery(ev), OK);
	EQ(cuEventSynchronize(ev), OK);
	EQ(cuMemcpyDtoHAsync_v2(dst, a, N, st), OK);
	EQ(cuStreamQuery(st), OK);
	EQ(cuStreamSynchronize(st), OK);
	CHECK(memcmp(dst, src, N) == 0);
	EQ(cuMemcpyHtoDAsync_v2(a, src, 8, NULL), OK); // the default stream
	EQ(cuMemcpyHtoDAsync_v2(a, src, 8, (CUstream)&stack_var), INVALID_HANDLE);
	EQ(cuEventQuery((CUevent)&stack_var), INVALID_HANDLE);
	EQ(cuStreamDestroy_v2(st), OK);
	EQ(cuStreamQuery(st), INVALID_HANDLE);
	EQ(cuEventDestroy_v2(ev), OK);
	EQ(cuEventQuery(ev), INVALID_HANDLE);

	// dma-buf: a real fd of the range's size; page-aligned ranges only.
	int fd = -1;
	struct stat sb;
	EQ(cuMemGetHandleForAddressRange(&fd, a, N, DMA_BUF_FD, 0), OK);
	CHECK(fd >= 0 && fstat(fd, &sb) == 0 && sb.st_size == N);
	close(fd);
	EQ(cuMemGetHandleForAddressRange(&fd, b, 4096, DMA_BUF_FD, 0), OK);
	close(fd);
	EQ(cuMemGetHandleForAddressRange(&fd, a + 1, 4096, DMA_BUF_FD, 0), INVALID_VALUE);
	EQ(cuMemGetHandleForAddressRange(&fd, a, 100, DMA_BUF_FD, 0), INVALID_VALUE);
	EQ(cuMemGetHandleForAddressRange(&fd, a, N + 4096, DMA_BUF_FD, 0), INVALID_VALUE);
	EQ(cuMemGetHandleForAddressRange(&fd, a, N, 2, 0), INVALID_VALUE);
	EQ(cuMemGetHandleForAddressRange(&fd, host & ~4095ULL, 4096, DMA_BUF_FD, 0), INVALID_VALUE);

	// Host memory: cuMemHostAlloc and registered memory are MEMORY_TYPE HOST.
	void *h = NULL;
	EQ(cuMemHostAlloc(&h, 65536, 0), OK);
	EQ(cuPointerGetAttribute(&type, P_MEMORY_TYPE, (CUdeviceptr)(uintptr_t)h + 10), OK);
	EQ(type, MT_HOST);
	EQ(cuPointerGetAttribute(&hp, P_HOST_POINTER, (CUdeviceptr)(uintptr_t)h + 10), OK);
	CHECK(hp == (char *)h + 10);
	EQ(cuMemFreeHost(h), OK);
	EQ(cuMemFreeHost(h), INVALID_VALUE);
	unsigned char *reg = mmap(NULL, 65536, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
	EQ(cuMemHostRegister_v2(reg, 65536, 0), OK);
	EQ(cuPointerGetAttribute(&type, P_MEMORY_TYPE, (CUdeviceptr)(uintptr_t)reg + 100), OK);
	EQ(type, MT_HOST);
	EQ(cuMemHostRegister_v2(reg + 4096, 10, 0), ALREADY_REGISTERED);
	EQ(cuMemHostRegister_v2((void *)(uintptr_t)a, 10, 0), INVALID_VALUE);
	EQ(cuMemHostUnregister(reg), OK);
	EQ(cuMemHostUnregister(reg), NOT_REGISTERED);
	munmap(reg + 32768, 32768);
	EQ(cuMemHostRegister_v2(reg, 65536, 0), INVALID_VALUE); // not all mapped
	munmap(reg, 32768);

	EQ(cuMemFree_v2(a + 1), INVALID_VALUE);
	EQ(cuMemFree_v2(a), OK);
	EQ(cuMemFree_v2(a), INVALID_VALUE);
	EQ(cuPointerGetAttribute(&type, P_MEMORY_TYPE, a), INVALID_VALUE);
	EQ(cuMemFree_v2(b), OK);
	EQ(fakecuda_stats("allocs"), 0);
	EQ(fakecuda_stats("bytes"), 0);
}

static void check_faults(void) {
	CUdeviceptr a = 0, b = 0;
	unsigned char x[16] = {1}, y[16] = {2}, z[16];
	int fd = -1, v = -1;
	EQ(cuMemAlloc_v2(&a, 4096), OK);
	EQ(cuMemcpyHtoD_v2(a, x, 16), OK);

	// The 2nd call from now fails, without doing anything; the 3rd works.
	EQ(fakecuda_control("fail op=cuMemcpyHtoD_v2 after=2"), 0);
	EQ(cuMemcpyHtoD_v2(a, x, 16), OK);
	EQ(cuMemcpyHtoD_v2(a, y, 16), UNKNOWN);
	EQ(cuMemcpyDtoH_v2(z, a, 16), OK);
	CHECK(memcmp(z, x, 16) == 0);
	EQ(cuMemcpyHtoD_v2(a, y, 16), OK);

	long allocs = fakecuda_stats("allocs");
	EQ(fakecuda_control("fail op=cuMemAlloc_v2 after=1 code=2; fail op=cuInit after=1 code=3"), 0);
	EQ(cuMemAlloc_v2(&b, 4096), OUT_OF_MEMORY);
	EQ(fakecuda_stats("allocs"), allocs);
	EQ(cuInit(0), NOT_INITIALIZED);
	EQ(cuInit(0), OK);

	EQ(fakecuda_control("delay op=cuMemcpyDtoH_v2 us=200000"), 0);
	double t = now();
	EQ(cuMemcpyDtoH_v2(z, a, 16), OK);
	CHECK(now() - t >= 0.19);
	EQ(fakecuda_control("delay op=cuMemcpyDtoH_v2 us=0"), 0);
	t = now();
	EQ(cuMemcpyDtoH_v2(z, a, 16), OK);
	CHECK(now() - t < 0.1);

	EQ(fakecuda_control("no_dmabuf on=1"), 0);
	EQ(cuMemGetHandleForAddressRange(&fd, a, 4096, DMA_BUF_FD, 0), NOT_SUPPORTED);
	EQ(cuDeviceGetAttribute(&v, A_DMA_BUF, 0), OK);
	EQ(v, 0);
	EQ(fakecuda_control("no_dmabuf on=0"), 0);
	EQ(cuMemGetHandleForAddressRange(&fd, a, 4096, DMA_BUF_FD, 0), OK);
	close(fd);

	EQ(fakecuda_control("fail op=cuStreamQuery after=1\nno_dmabuf on=1\nreset"), 0);
	EQ(cuStreamQuery(NULL), OK);
	EQ(cuMemGetHandleForAddressRange(&fd, a, 4096, DMA_BUF_FD, 0), OK);
	close(fd);

	// Bad commands are refused whole: nothing of them applies.
	const char *bad[] = {NULL, "bogus", "fail", "fail op=cuNothing after=1", "fail op=cuInit after=0",
	                     "fail op=cuInit", "fail op=cuInit after=1 code=x", "delay op=cuInit us=-1",
	                     "delay op=cuInit", "no_dmabuf on=2", "reset now", "fail op=cuMemFree_v2 after=1; bogus"};
	for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++)
		EQ(fakecuda_control(bad[i]), -1);
	EQ(cuMemFree_v2(a), OK);
	EQ(fakecuda_stats("nonsense"), -1);
}

// A copy delayed in another thread: counted in calls:<op> and running:<op>
// as soon as it entered (during its delay), out of running once it returned.
struct delayed_copy {
	CUcontext ctx;
	CUdeviceptr src;
	unsigned char dst[16];
	CUresult rc;
};

static void *delayed_copy(void *arg) {
	struct delayed_copy *d = arg;
	d->rc = cuCtxSetCurrent(d->ctx);
	if (d->rc == OK)
		d->rc = cuMemcpyDtoH_v2(d->dst, d->src, sizeof(d->dst));
	return NULL;
}

static void check_call_counters(CUcontext ctx) {
	struct delayed_copy d = {.ctx = ctx};
	EQ(cuMemAlloc_v2(&d.src, 4096), OK);
	long calls = fakecuda_stats("calls:cuMemcpyDtoH_v2"), htod = fakecuda_stats("calls:cuMemcpyHtoD_v2");
	EQ(fakecuda_stats("running:cuMemcpyDtoH_v2"), 0);
	EQ(fakecuda_control("delay op=cuMemcpyDtoH_v2 us=300000"), 0);
	pthread_t th;
	CHECK(pthread_create(&th, NULL, delayed_copy, &d) == 0);
	double t = now();
	while (fakecuda_stats("calls:cuMemcpyDtoH_v2") == calls && now() - t < 5)
		usleep(1000);
	EQ(fakecuda_stats("calls:cuMemcpyDtoH_v2"), calls + 1);
	EQ(fakecuda_stats("running:cuMemcpyDtoH_v2"), 1); // still in its 300 ms delay
	pthread_join(th, NULL);
	EQ(d.rc, OK);
	EQ(fakecuda_stats("running:cuMemcpyDtoH_v2"), 0);
	EQ(fakecuda_stats("calls:cuMemcpyDtoH_v2"), calls + 1);
	EQ(fakecuda_stats("calls:cuMemcpyHtoD_v2"), htod); // per entry point
	// A failed call is a call too, and leaves running as well.
	EQ(fakecuda_control("delay op=cuMemcpyDtoH_v2 us=0; fail op=cuMemcpyDtoH_v2 after=1"), 0);
	EQ(cuMemcpyDtoH_v2(d.dst, d.src, sizeof(d.dst)), UNKNOWN);
	EQ(fakecuda_stats("calls:cuMemcpyDtoH_v2"), calls + 2);
	EQ(fakecuda_stats("running:cuMemcpyDtoH_v2"), 0);
	EQ(fakecuda_stats("calls:cuInit") > 0, 1);
	EQ(fakecuda_stats("calls:cuNothing"), -1);
	EQ(fakecuda_stats("running:"), -1);
	EQ(cuMemFree_v2(d.src), OK);
}

// Per-thread current context: a new thread has none; threads copy at once.
static void *worker(void *arg) {
	CUdeviceptr p = 0;
	unsigned char in[512], out[512];
	long bad = 0;
	if (cuMemAlloc_v2(&p, 64) != INVALID_CONTEXT || cuCtxSetCurrent(arg) != OK)
		return (void *)1;
	for (int i = 0; i < 200; i++) {
		fill(in, sizeof(in), (unsigned)i);
		bad += cuMemAlloc_v2(&p, sizeof(in)) != OK || cuMemcpyHtoD_v2(p, in, sizeof(in)) != OK ||
		       cuMemcpyDtoH_v2(out, p, sizeof(out)) != OK || memcmp(in, out, sizeof(in)) != 0 ||
		       cuMemFree_v2(p) != OK;
	}
	return (void *)bad;
}

static void check_contexts(void) {
	CUcontext c1 = NULL, c1b = NULL, cur = NULL, c0 = NULL;
	CUdeviceptr p = 0;
	CUdevice d = -1;
	EQ(cuCtxGetCurrent(&cur), OK);
	CHECK(cur == NULL);
	EQ(cuMemAlloc_v2(&p, 64), INVALID_CONTEXT);
	EQ(cuCtxGetDevice(&d), INVALID_CONTEXT);
	EQ(fakecuda_stats("ctx_dev_mask"), 0);
	EQ(fakecuda_stats("ctx_created"), 0);

	// Only device 1 gets a context.
	EQ(cuDevicePrimaryCtxRetain(&c1, 1), OK);
	EQ(cuDevicePrimaryCtxRetain(&c1b, 1), OK);
	CHECK(c1 != NULL && c1 == c1b);
	EQ(fakecuda_stats("ctx_created"), 1);
	EQ(fakecuda_stats("ctx_dev_mask"), 2);
	EQ(cuCtxSetCurrent(c1), OK);
	EQ(cuCtxGetCurrent(&cur), OK);
	CHECK(cur == c1);
	EQ(cuCtxGetDevice(&d), OK);
	EQ(d, 1);
	EQ(cuCtxSynchronize(), OK);
	EQ(cuCtxSetCurrent((CUcontext)&d), INVALID_CONTEXT);

	check_memory(c1);
	check_faults();
	check_call_counters(c1);

	pthread_t th[4];
	for (int i = 0; i < 4; i++)
		CHECK(pthread_create(&th[i], NULL, worker, c1) == 0);
	for (int i = 0; i < 4; i++) {
		void *r = NULL;
		pthread_join(th[i], &r);
		EQ((long)r, 0);
	}
	EQ(fakecuda_stats("allocs"), 0);
	EQ(fakecuda_stats("ctx_dev_mask"), 2);

	// The last release resets the primary context: its memory is gone.
	EQ(cuMemAlloc_v2(&p, 4096), OK);
	EQ(cuDevicePrimaryCtxRelease_v2(1), OK);
	EQ(fakecuda_stats("allocs"), 1);
	EQ(cuDevicePrimaryCtxRelease_v2(1), OK);
	EQ(fakecuda_stats("allocs"), 0);
	EQ(cuMemAlloc_v2(&p, 64), CONTEXT_IS_DESTROYED);
	EQ(cuDevicePrimaryCtxRelease_v2(1), INVALID_CONTEXT);
	EQ(cuDevicePrimaryCtxRetain(&c1b, 1), OK);
	CHECK(c1b == c1);
	EQ(fakecuda_stats("ctx_created"), 2);
	EQ(cuMemAlloc_v2(&p, 64), OK); // current again: same handle
	EQ(cuDevicePrimaryCtxRelease_v2(1), OK);

	// cuCtxCreate_v2 exists (kvferry never calls it) and counts as a context.
	EQ(cuCtxCreate_v2(&c0, 0, 0), OK);
	EQ(fakecuda_stats("ctx_dev_mask"), 3);
	EQ(cuCtxGetDevice(&d), OK);
	EQ(d, 0);
	EQ(cuCtxDestroy_v2(c0), OK);
	EQ(cuCtxDestroy_v2(c0), INVALID_CONTEXT);
	EQ(cuCtxGetCurrent(&cur), OK);
	CHECK(cur == NULL);
}

static void check_errors(void) {
	const char *s = "x";
	EQ(cuGetErrorName(801, &s), OK);
	CHECK(s && strcmp(s, "CUDA_ERROR_NOT_SUPPORTED") == 0);
	EQ(cuGetErrorString(0, &s), OK);
	CHECK(s && strcmp(s, "no error") == 0);
	EQ(cuGetErrorString(12345, &s), INVALID_VALUE);
	CHECK(s == NULL);
	EQ(cuGetErrorName(1, NULL), INVALID_VALUE);
}

// Runs this program again with --child name and env set; returns its status.
static int child(const char *libpath, const char *name, const char *const *env) {
	pid_t pid = fork();
	if (pid == 0) {
		for (; *env; env += 2)
			setenv(env[0], env[1], 1);
		execl("/proc/self/exe", "selftest", libpath, "--child", name, (char *)NULL);
		_exit(127);
	}
	int st = 0;
	if (pid < 0 || waitpid(pid, &st, 0) != pid || !WIFEXITED(st))
		return -1;
	return WEXITSTATUS(st);
}

static int run_child(const char *name) {
	int n = -1, v = -1;
	char s[64];
	size_t mem = 0;
	CUdevice d;
	CUcontext c;
	CUdeviceptr p;
	if (strcmp(name, "nodev") == 0) {
		EQ(cuInit(0), NO_DEVICE);
		EQ(cuDeviceGetCount(&n), OK);
		EQ(n, 0);
		EQ(cuDeviceGet(&d, 0), NOT_INITIALIZED);
		EQ(cuInit(0), NO_DEVICE);
	} else if (strcmp(name, "env") == 0) {
		EQ(cuInit(0), OK);
		EQ(cuDeviceGetCount(&n), OK);
		EQ(n, 3);
		EQ(cuDeviceGetPCIBusId(s, sizeof(s), 2), OK);
		CHECK(strcmp(s, "0000:42:00.0") == 0);
		EQ(cuDeviceGetAttribute(&v, A_PCI_BUS, 2), OK);
		EQ(v, 0x42);
		EQ(cuDeviceTotalMem_v2(&mem, 0), OK);
		EQ(mem, 1 << 20);
		EQ(cuDevicePrimaryCtxRetain(&c, 2), OK);
		EQ(cuCtxSetCurrent(c), OK);
		EQ(cuMemAlloc_v2(&p, 4096), OUT_OF_MEMORY); // FAKECUDA_CONTROL's fault
		EQ(cuMemAlloc_v2(&p, 4096), OK);
		EQ(cuMemAlloc_v2(&p, 1 << 20), OUT_OF_MEMORY); // 4 KiB of 1 MiB used
		EQ(cuMemGetHandleForAddressRange(&n, p, 4096, DMA_BUF_FD, 0), NOT_SUPPORTED);
		EQ(fakecuda_stats("ctx_dev_mask"), 4);
	} else if (strcmp(name, "badenv") == 0) {
		EQ(cuInit(0), INVALID_VALUE);
		EQ(cuDeviceGetCount(&n), NOT_INITIALIZED);
	} else {
		return 2;
	}
	return failures ? 1 : 0;
}

// IPC: a handle of device memory opens in another process (a forked child)
// as device memory of its own, which reads what the exporter wrote and
// writes what the exporter then reads; the exporter itself may not open it,
// the memory cannot be freed through the import, and closing the import
// leaves the exporter's memory alive.
static void check_ipc(void) {
	enum { N = 3 * 4096 + 5 };
	CUcontext c = NULL;
	CUdeviceptr p = 0, q = 0;
	CUipcMemHandle h;
	EQ(cuDevicePrimaryCtxRetain(&c, 0), OK);
	EQ(cuCtxSetCurrent(c), OK);
	EQ(cuMemAlloc_v2(&p, N), OK);
	memset((void *)(uintptr_t)p, 0x5a, N);
	EQ(cuIpcGetMemHandle(&h, p + 1), INVALID_VALUE); // not the allocation's base
	EQ(cuIpcGetMemHandle(&h, p), OK);
	EQ(cuIpcOpenMemHandle_v2(&q, h, 1), INVALID_CONTEXT); // the exporter's own handle
	pid_t pid = fork();
	if (pid == 0) {
		// The child: a process of its own with the library's state copied;
		// it opens the parent's handle as another process would.
		int rc = 0;
		CUdeviceptr r = 0, base = 0;
		size_t size = 0;
		unsigned char b[N];
		rc |= cuIpcOpenMemHandle_v2(&r, h, 1) != OK;
		rc |= cuMemGetAddressRange_v2(&base, &size, r + 7) != OK || base != r || size != N;
		rc |= cuMemcpyDtoH_v2(b, r, N) != OK;
		for (int i = 0; i < N; i++)
			rc |= b[i] != 0x5a;
		memset(b, 0xc3, N);
		rc |= cuMemcpyHtoD_v2(r, b, N) != OK;
		rc |= cuMemFree_v2(r) != INVALID_VALUE; // an import is closed, not freed
		rc |= cuIpcCloseMemHandle(r) != OK;
		rc |= cuIpcCloseMemHandle(r) != INVALID_VALUE;
		_exit(rc ? 1 : 0);
	}
	int status = 0;
	EQ(waitpid(pid, &status, 0), pid);
	EQ(WIFEXITED(status) && WEXITSTATUS(status) == 0, 1);
	unsigned char *m = (unsigned char *)(uintptr_t)p;
	int seen = 1;
	for (int i = 0; i < N; i++)
		seen &= m[i] == 0xc3;
	EQ(seen, 1); // the child's bytes, in the exporter's memory
	if (fakecuda_stats_fn != NULL)
		EQ(fakecuda_stats_fn("ipc_exported") >= 1, 1);
	EQ(cuMemFree_v2(p), OK);
}

int main(int argc, char **argv) {
	if (argc < 2) {
		fprintf(stderr, "usage: %s path/to/libcuda.so.1\n", argv[0]);
		return 2;
	}
	if (argc == 4 && strcmp(argv[2], "--child") == 0) {
		load(argv[1]);
		return run_child(argv[3]);
	}
	static const char *const vars[] = {"FAKECUDA_DEVICES", "FAKECUDA_BUS_BASE", "FAKECUDA_MEM", "FAKECUDA_CONTROL"};
	for (int i = 0; i < 4; i++)
		unsetenv(vars[i]);
	load(argv[1]);

	int n = -1, v = 0;
	CUdeviceptr p = 0;
	EQ(cuDriverGetVersion(&v), OK); // needs no cuInit
	EQ(v, 12040);
	EQ(cuDeviceGetCount(&n), NOT_INITIALIZED);
	EQ(cuMemAlloc_v2(&p, 1), NOT_INITIALIZED);
	EQ(cuInit(1), INVALID_VALUE);
	EQ(cuInit(0), OK);
	EQ(cuInit(0), OK);
	check_devices();
	check_contexts();
	check_errors();
	check_ipc();

	static const char *const nodev[] = {"FAKECUDA_DEVICES", "0", NULL};
	static const char *const env[] = {"FAKECUDA_DEVICES", "3", "FAKECUDA_BUS_BASE", "0x40", "FAKECUDA_MEM", "1M",
	                                  "FAKECUDA_CONTROL", "no_dmabuf on=1; fail op=cuMemAlloc_v2 after=1 code=2",
	                                  NULL};
	static const char *const badenv[] = {"FAKECUDA_CONTROL", "fail op=cuBogus after=1", NULL};
	static const char *const baddev[] = {"FAKECUDA_DEVICES", "two", NULL};
	EQ(child(argv[1], "nodev", nodev), 0);
	EQ(child(argv[1], "env", env), 0);
	EQ(child(argv[1], "badenv", badenv), 0);
	EQ(child(argv[1], "badenv", baddev), 0);

	if (failures) {
		fprintf(stderr, "fakecuda selftest: %d check(s) failed\n", failures);
		return 1;
	}
	printf("fakecuda selftest: all checks passed\n");
	return 0;
}
