// fakecuda: a fake libcuda (the CUDA driver API) for kvferry's CI, on machines
// without a GPU. kvferry's cuda/ package dlopen()s it in place of
// libcuda.so.1 (KVFERRY_CUDA_LIBRARY=build/fakecuda/libcuda.so.1) and
// dlsym()s the entry points by the names the real driver exports.
//
// "Device memory" is shared memory of the process (a memfd mapped, with a
// PROT_NONE guard page after each allocation) that the fake records as
// memory of the device of the context current at cuMemAlloc. Its memfd is
// what an IPC handle names: another process opens the handle by opening
// the exporter's descriptor through /proc and mapping it. The fake
// libibverbs, process_vm_readv and plain loads can all reach it, which is
// what lets GPU-memory transfers be tested without a GPU. Copies run
// synchronously in the calling thread, so every stream is always idle and
// every event complete. Faults and delays are injected per entry point with
// fakecuda_control(); fakecuda_stats() reads counters. See README.md here.
#define _GNU_SOURCE
#include <errno.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#define EXPORT __attribute__((visibility("default")))

typedef int CUresult;
typedef int CUdevice;
typedef unsigned long long CUdeviceptr;
typedef struct fc_ctx *CUcontext;
typedef struct fc_stream *CUstream;
typedef struct fc_event *CUevent;

// Values as in NVIDIA's cuda.h of CUDA 12.6, vendored in the GitHub repository
// zspace/system.cuda-12.6, include/cuda.h (commit b3d92c83): enum
// cudaError_enum (CUresult), CUdevice_attribute_enum, CUpointer_attribute_enum,
// CUmemorytype_enum, CUmemRangeHandleType_enum, CU_MEMHOSTALLOC_* (0x1, 0x2,
// 0x4) and CU_MEMHOSTREGISTER_* (0x1, 0x2, 0x4, 0x8).
enum {
	CUDA_SUCCESS = 0, CUDA_ERROR_INVALID_VALUE = 1, CUDA_ERROR_OUT_OF_MEMORY = 2, CUDA_ERROR_NOT_INITIALIZED = 3,
	CUDA_ERROR_NO_DEVICE = 100, CUDA_ERROR_INVALID_DEVICE = 101, CUDA_ERROR_INVALID_CONTEXT = 201,
	CUDA_ERROR_INVALID_HANDLE = 400, CUDA_ERROR_NOT_FOUND = 500, CUDA_ERROR_CONTEXT_IS_DESTROYED = 709,
	CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED = 712, CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED = 713,
	CUDA_ERROR_NOT_SUPPORTED = 801, CUDA_ERROR_UNKNOWN = 999,
	// CUdevice_attribute; PCI_DEVICE_ID (34) and PCI_DOMAIN_ID (50) are answered 0 like the rest
	CU_DEVICE_ATTRIBUTE_PCI_BUS_ID = 33, CU_DEVICE_ATTRIBUTE_UNIFIED_ADDRESSING = 41,
	CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED = 124,
	// CUpointer_attribute
	CU_POINTER_ATTRIBUTE_CONTEXT = 1, CU_POINTER_ATTRIBUTE_MEMORY_TYPE = 2, CU_POINTER_ATTRIBUTE_DEVICE_POINTER = 3,
	CU_POINTER_ATTRIBUTE_HOST_POINTER = 4, CU_POINTER_ATTRIBUTE_BUFFER_ID = 7, CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL = 9,
	CU_POINTER_ATTRIBUTE_RANGE_START_ADDR = 11, CU_POINTER_ATTRIBUTE_RANGE_SIZE = 12,
	CU_MEMORYTYPE_HOST = 1, CU_MEMORYTYPE_DEVICE = 2, CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD = 1,
	FC_HOSTALLOC_FLAGS = 0x7, FC_HOSTREGISTER_FLAGS = 0xf,
};
// Not in that header: CU_MEM_RANGE_FLAG_DMA_BUF_MAPPING_TYPE_PCIE, added in
// CUDA 12.8, is 0x1 (as compatibility headers that define it for older
// toolkits give it), the one flag cuMemGetHandleForAddressRange accepts.
// From Blender's cuew.h (generated from cuda.h 12.1): CU_STREAM_LEGACY 0x1,
// CU_STREAM_PER_THREAD 0x2, CU_STREAM_NON_BLOCKING 0x1, CU_EVENT_* flags
// 0x1|0x2|0x4, CU_CTX_FLAGS_MASK 0xff, CU_DEVICE_INVALID -2.
#define FC_RANGE_FLAGS 0x1ULL
#define FC_STREAM_FLAGS 0x1u
#define FC_EVENT_FLAGS 0x7u
#define FC_DEVICE_INVALID (-2)

enum {
	FC_DRIVER_VERSION = 12040, // CUDA 12.4
	FC_MAX_DEV = 32,           // FAKECUDA_DEVICES upper bound (ctx_dev_mask bits)
	FC_MAX_CTX = 256,          // cuCtxCreate_v2 contexts
	FC_MAX_STREAMS = 4096,
	FC_MAX_EVENTS = 16384,
	FC_MAX_RANGES = 1 << 20, // allocations + registrations
	FC_MAX_RULES = 64,       // fail/delay rules
	FC_MAX_CMDS = 32,        // commands in one fakecuda_control string
	FC_MAX_DELAY_US = 10000000,
};

// Handles are pointers into these static arrays, so a stale handle never
// points at freed memory. g_ctx[d] is device d's primary context.
struct fc_ctx {
	int used, active, primary, dev;
	unsigned refs; // primary: retain count
};
struct fc_stream {
	struct fc_ctx *ctx; // NULL: free slot
};
struct fc_event {
	struct fc_ctx *ctx; // NULL: free slot
};
enum { R_DEV = 1, R_HOSTALLOC, R_HOSTREG };
// A recorded address range; g_ranges is sorted by base, ranges are disjoint.
struct fc_range {
	uintptr_t base;
	size_t size;   // as requested
	size_t mapped; // page-rounded bytes we mapped (guard page not counted); 0: registration
	int kind, dev;
	struct fc_ctx *ctx;
	unsigned long long id;
	int fd;       // R_DEV: the memfd behind the mapping (-1: none)
	int imported; // R_DEV: mapped from another process's IPC handle
};
struct fc_rule {
	int used, delay; // delay: sleep us per call; else the left-th call fails with code
	char op[40];
	long left, us;
	CUresult code;
};

static pthread_mutex_t g_mu = PTHREAD_MUTEX_INITIALIZER; // guards everything below but t_cur
enum { ST_NONE, ST_OK, ST_NODEV };
static int g_state, g_nrules, g_no_dmabuf; // also read with atomics, without g_mu
static int g_ndev, g_bus_base;
static size_t g_mem, g_page, g_used[FC_MAX_DEV];
static struct fc_ctx g_ctx[FC_MAX_DEV + FC_MAX_CTX];
static struct fc_stream g_streams[FC_MAX_STREAMS];
static struct fc_event g_events[FC_MAX_EVENTS];
static struct fc_range *g_ranges;
static size_t g_nranges, g_capranges;
static struct fc_rule g_rules[FC_MAX_RULES];
static unsigned long long g_next_id = 1;
static long s_allocs, s_bytes, s_copies, s_ctx_created, s_ctx_mask, s_host_allocs, s_host_bytes, s_registered,
    s_dmabufs, s_ipc_exported, s_ipc_opened, s_ipc_open;
static __thread struct fc_ctx *t_cur;

// Every cu* entry point, for validating fault commands.
static const char *const k_ops[] = {
	"cuInit", "cuDriverGetVersion", "cuDeviceGetCount", "cuDeviceGet", "cuDeviceGetName",
	"cuDeviceGetPCIBusId", "cuDeviceGetAttribute", "cuDeviceTotalMem_v2", "cuDevicePrimaryCtxRetain",
	"cuDevicePrimaryCtxRelease_v2", "cuCtxCreate_v2", "cuCtxDestroy_v2", "cuCtxSetCurrent",
	"cuCtxGetCurrent", "cuCtxGetDevice", "cuCtxSynchronize", "cuMemAlloc_v2", "cuMemFree_v2",
	"cuMemGetAddressRange_v2", "cuPointerGetAttribute", "cuPointerGetAttributes", "cuMemHostAlloc",
	"cuMemFreeHost", "cuMemHostRegister_v2", "cuMemHostUnregister", "cuMemcpyHtoD_v2",
	"cuMemcpyDtoH_v2", "cuMemcpyDtoD_v2", "cuMemcpy", "cuMemcpyHtoDAsync_v2", "cuMemcpyDtoHAsync_v2",
	"cuStreamCreate", "cuStreamSynchronize", "cuStreamQuery", "cuStreamDestroy_v2", "cuEventCreate",
	"cuEventRecord", "cuEventQuery", "cuEventSynchronize", "cuEventDestroy_v2",
	"cuMemGetHandleForAddressRange", "cuGetErrorString", "cuGetErrorName",
	"cuIpcGetMemHandle", "cuIpcOpenMemHandle_v2", "cuIpcCloseMemHandle", "cuMemcpyDtoDAsync_v2",
};

// Per entry point (index in k_ops): calls so far, counted on entry before any
// delay, and calls that entered and have not returned yet. Atomics.
static long s_op_calls[sizeof(k_ops) / sizeof(k_ops[0])], s_op_running[sizeof(k_ops) / sizeof(k_ops[0])];

#define E(code, text) {code, #code, text}
static const struct {
	CUresult code;
	const char *name, *text;
} k_errors[] = {
	E(CUDA_SUCCESS, "no error"), E(CUDA_ERROR_INVALID_VALUE, "invalid argument"),
	E(CUDA_ERROR_OUT_OF_MEMORY, "out of memory"), E(CUDA_ERROR_NOT_INITIALIZED, "initialization error"),
	E(CUDA_ERROR_NO_DEVICE, "no CUDA-capable device is detected"),
	E(CUDA_ERROR_INVALID_DEVICE, "invalid device ordinal"), E(CUDA_ERROR_INVALID_CONTEXT, "invalid device context"),
	E(CUDA_ERROR_INVALID_HANDLE, "invalid resource handle"), E(CUDA_ERROR_NOT_FOUND, "named symbol not found"),
	E(CUDA_ERROR_CONTEXT_IS_DESTROYED, "context is destroyed"),
	E(CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED, "part or all of the requested memory range is already mapped"),
	E(CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED, "pointer does not correspond to a registered memory region"),
	E(CUDA_ERROR_NOT_SUPPORTED, "operation not supported"), E(CUDA_ERROR_UNKNOWN, "unknown error"),
};

#define NELEM(a) (sizeof(a) / sizeof((a)[0]))
#define LOCK() pthread_mutex_lock(&g_mu)
#define UNLOCK() pthread_mutex_unlock(&g_mu)

// ---------------------------------------------------------------------------
// Faults

// Counts a call of entry point op in (calls, running); *idx caches op's
// index in k_ops per call site. Returns the index, or -1.
static int op_enter(const char *op, int *idx) {
	int i = __atomic_load_n(idx, __ATOMIC_RELAXED);
	if (i == -1) {
		i = -2;
		for (size_t k = 0; k < NELEM(k_ops); k++)
			if (strcmp(k_ops[k], op) == 0)
				i = (int)k;
		__atomic_store_n(idx, i, __ATOMIC_RELAXED);
	}
	if (i < 0)
		return -1;
	__atomic_add_fetch(&s_op_calls[i], 1, __ATOMIC_SEQ_CST);
	__atomic_add_fetch(&s_op_running[i], 1, __ATOMIC_SEQ_CST);
	return i;
}

// Counts the call out of running when its entry point returns (cleanup).
static void op_leave(const int *i) {
	if (*i >= 0)
		__atomic_sub_fetch(&s_op_running[*i], 1, __ATOMIC_SEQ_CST);
}

// First statement of every entry point that counts its calls: counts this
// call in, and out again at whichever return.
#define COUNT_CALL()                                                                              \
	static int op_idx_ = -1;                                                                      \
	__attribute__((cleanup(op_leave), unused)) const int op_ = op_enter(__func__, &op_idx_)

// Called first by every entry point: sleeps for op's delay rule and counts
// down its fail rules. Returns the code to fail with, or CUDA_SUCCESS.
static CUresult fault_enter(const char *op) {
	if (__atomic_load_n(&g_nrules, __ATOMIC_ACQUIRE) == 0)
		return CUDA_SUCCESS;
	CUresult rc = CUDA_SUCCESS;
	long us = 0;
	LOCK();
	for (int i = 0; i < FC_MAX_RULES; i++) {
		struct fc_rule *r = &g_rules[i];
		if (!r->used || strcmp(r->op, op) != 0)
			continue;
		if (r->delay) {
			us = r->us;
		} else if (--r->left == 0) {
			if (rc == CUDA_SUCCESS)
				rc = r->code;
			r->used = 0;
			__atomic_sub_fetch(&g_nrules, 1, __ATOMIC_RELEASE);
		}
	}
	UNLOCK();
	struct timespec ts = {us / 1000000, (us % 1000000) * 1000};
	while (us > 0 && nanosleep(&ts, &ts) != 0 && errno == EINTR) {
	}
	return rc;
}

// Fault check, then: the driver must be initialised (cuInit succeeded).
#define BEGIN()                                                                                   \
	COUNT_CALL();                                                                                 \
	do {                                                                                          \
		CUresult fault_ = fault_enter(__func__);                                                  \
		if (fault_ != CUDA_SUCCESS || __atomic_load_n(&g_state, __ATOMIC_ACQUIRE) != ST_OK)       \
			return fault_ != CUDA_SUCCESS ? fault_ : CUDA_ERROR_NOT_INITIALIZED;                  \
	} while (0)

enum { C_FAIL = 1, C_DELAY, C_NODMABUF, C_RESET };
struct fc_cmd {
	int kind, on;
	char op[40];
	long after, us;
	CUresult code;
};

static int parse_long(const char *s, int base, long min, long max, long *out) {
	char *end;
	errno = 0;
	long v = strtol(s, &end, base);
	if (errno || end == s || *end || v < min || v > max)
		return -1;
	*out = v;
	return 0;
}

static int known_op(const char *op) {
	for (size_t i = 0; i < NELEM(k_ops); i++)
		if (strcmp(k_ops[i], op) == 0)
			return 1;
	return 0;
}

// Parses one command ("fail op=X after=N [code=C]", "delay op=X us=U",
// "no_dmabuf on=1|0", "reset"); s is modified. 1: parsed, 0: blank, -1: bad.
static int parse_cmd(char *s, struct fc_cmd *c) {
	static const char *const names[] = {"", "fail", "delay", "no_dmabuf", "reset"};
	char *save = NULL, *tok = strtok_r(s, " \t\r", &save);
	if (tok == NULL)
		return 0;
	*c = (struct fc_cmd){.code = CUDA_ERROR_UNKNOWN, .on = -1, .after = -1, .us = -1};
	for (int k = C_FAIL; k <= C_RESET; k++)
		if (strcmp(tok, names[k]) == 0)
			c->kind = k;
	if (c->kind == 0)
		return -1;
	while ((tok = strtok_r(NULL, " \t\r", &save)) != NULL) {
		char *v = strchr(tok, '=');
		long n = 0;
		if (v == NULL)
			return -1;
		*v++ = 0;
		if (strcmp(tok, "op") == 0 && c->kind <= C_DELAY && known_op(v))
			snprintf(c->op, sizeof(c->op), "%s", v);
		else if (strcmp(tok, "after") == 0 && c->kind == C_FAIL && !parse_long(v, 10, 1, 1000000000L, &n))
			c->after = n;
		else if (strcmp(tok, "code") == 0 && c->kind == C_FAIL && !parse_long(v, 10, 1, 100000, &n))
			c->code = (CUresult)n;
		else if (strcmp(tok, "us") == 0 && c->kind == C_DELAY && !parse_long(v, 10, 0, FC_MAX_DELAY_US, &n))
			c->us = n;
		else if (strcmp(tok, "on") == 0 && c->kind == C_NODMABUF && !parse_long(v, 10, 0, 1, &n))
			c->on = (int)n;
		else
			return -1;
	}
	if ((c->kind == C_FAIL && (!c->op[0] || c->after < 0)) || (c->kind == C_DELAY && (!c->op[0] || c->us < 0)) ||
	    (c->kind == C_NODMABUF && c->on < 0))
		return -1;
	return 1;
}

// Parses every command of cmds (';' or newline separated) and applies them
// only if all are valid and the rules fit. g_mu held.
static int control_locked(const char *cmds) {
	static struct fc_cmd cv[FC_MAX_CMDS];
	char buf[4096], *save = NULL;
	int n = 0, need = 0, used = 0;
	if (cmds == NULL || strlen(cmds) >= sizeof(buf))
		return -1;
	snprintf(buf, sizeof(buf), "%s", cmds);
	for (char *s = strtok_r(buf, ";\n", &save); s; s = strtok_r(NULL, ";\n", &save)) {
		int r = n < FC_MAX_CMDS ? parse_cmd(s, &cv[n]) : -1;
		if (r < 0)
			return -1;
		need += r > 0 && cv[n].kind <= C_DELAY;
		n += r;
	}
	for (int i = 0; i < FC_MAX_RULES; i++)
		need -= !g_rules[i].used;
	if (need > 0)
		return -1;
	for (struct fc_cmd *c = cv; c < cv + n; c++) {
		if (c->kind == C_RESET) {
			memset(g_rules, 0, sizeof(g_rules));
			g_no_dmabuf = 0;
		} else if (c->kind == C_NODMABUF) {
			g_no_dmabuf = c->on;
		} else {
			for (int i = 0; i < FC_MAX_RULES; i++) // one delay per op: a new one replaces it
				if (c->kind == C_DELAY && g_rules[i].used && g_rules[i].delay && !strcmp(g_rules[i].op, c->op))
					g_rules[i].used = 0;
			for (int i = 0; i < FC_MAX_RULES && (c->kind == C_FAIL || c->us > 0); i++) {
				if (g_rules[i].used)
					continue;
				g_rules[i] = (struct fc_rule){.used = 1, .delay = c->kind == C_DELAY, .left = c->after,
				                              .us = c->us, .code = c->code};
				snprintf(g_rules[i].op, sizeof(g_rules[i].op), "%s", c->op);
				break;
			}
		}
	}
	for (int i = 0; i < FC_MAX_RULES; i++)
		used += g_rules[i].used;
	__atomic_store_n(&g_nrules, used, __ATOMIC_RELEASE);
	return 0;
}

EXPORT int fakecuda_control(const char *cmd) {
	LOCK();
	int r = control_locked(cmd);
	UNLOCK();
	return r;
}

EXPORT long fakecuda_stats(const char *what) {
	static const struct {
		const char *name;
		long *v;
	} k[] = {
		{"allocs", &s_allocs},           {"bytes", &s_bytes},
		{"copies", &s_copies},           {"ctx_created", &s_ctx_created},
		{"ctx_dev_mask", &s_ctx_mask},   {"host_allocs", &s_host_allocs},
		{"host_bytes", &s_host_bytes},   {"registered", &s_registered},
		{"dmabufs", &s_dmabufs},
		{"ipc_exported", &s_ipc_exported}, {"ipc_opened", &s_ipc_opened},
		{"ipc_open", &s_ipc_open},
	};
	long r = -1;
	// "calls:<op>" and "running:<op>": per entry point, without the lock.
	long *per_op = NULL;
	const char *op = NULL;
	if (what != NULL && strncmp(what, "calls:", 6) == 0)
		per_op = s_op_calls, op = what + 6;
	else if (what != NULL && strncmp(what, "running:", 8) == 0)
		per_op = s_op_running, op = what + 8;
	for (size_t i = 0; per_op != NULL && i < NELEM(k_ops); i++)
		if (strcmp(k_ops[i], op) == 0)
			return __atomic_load_n(&per_op[i], __ATOMIC_SEQ_CST);
	LOCK();
	for (size_t i = 0; what && i < NELEM(k); i++)
		if (strcmp(k[i].name, what) == 0)
			r = *k[i].v;
	UNLOCK();
	return r;
}

// ---------------------------------------------------------------------------
// Address ranges, contexts, streams, events (g_mu held)

// Index of the last range with base <= a, or -1.
static long range_floor(uintptr_t a) {
	long lo = 0, hi = (long)g_nranges - 1, r = -1;
	while (lo <= hi) {
		long mid = lo + (hi - lo) / 2;
		if (g_ranges[mid].base <= a)
			r = mid, lo = mid + 1;
		else
			hi = mid - 1;
	}
	return r;
}

// The range containing address a, or NULL.
static struct fc_range *range_at(uintptr_t a) {
	long i = range_floor(a);
	return i >= 0 && a - g_ranges[i].base < g_ranges[i].size ? &g_ranges[i] : NULL;
}

// A range overlapping [a, a+n), n > 0, or NULL: ranges are disjoint and
// sorted, so the last one starting before a+n is the only candidate.
static struct fc_range *range_overlap(uintptr_t a, size_t n) {
	long i = range_floor(a + n - 1);
	return i >= 0 && g_ranges[i].base + g_ranges[i].size > a ? &g_ranges[i] : NULL;
}

static CUresult range_insert(struct fc_range r) {
	if (g_nranges == g_capranges) {
		size_t cap = g_capranges ? g_capranges * 2 : 256;
		struct fc_range *p = cap <= FC_MAX_RANGES ? realloc(g_ranges, cap * sizeof(*p)) : NULL;
		if (p == NULL)
			return CUDA_ERROR_OUT_OF_MEMORY;
		g_ranges = p;
		g_capranges = cap;
	}
	size_t i = (size_t)(range_floor(r.base) + 1);
	memmove(&g_ranges[i + 1], &g_ranges[i], (g_nranges - i) * sizeof(r));
	r.id = g_next_id++;
	g_ranges[i] = r;
	g_nranges++;
	*(r.kind == R_DEV ? &s_allocs : r.kind == R_HOSTALLOC ? &s_host_allocs : &s_registered) += 1;
	if (r.kind == R_DEV) {
		g_used[r.dev] += r.size;
		s_bytes += (long)r.size;
	} else if (r.kind == R_HOSTALLOC) {
		s_host_bytes += (long)r.size;
	}
	return CUDA_SUCCESS;
}

// Drops range i and unmaps what we mapped for it.
static void range_remove(size_t i) {
	struct fc_range r = g_ranges[i];
	memmove(&g_ranges[i], &g_ranges[i + 1], (g_nranges - i - 1) * sizeof(r));
	g_nranges--;
	*(r.kind == R_DEV ? &s_allocs : r.kind == R_HOSTALLOC ? &s_host_allocs : &s_registered) -= 1;
	if (r.kind == R_DEV) {
		g_used[r.dev] -= r.size;
		s_bytes -= (long)r.size;
	} else if (r.kind == R_HOSTALLOC) {
		s_host_bytes -= (long)r.size;
	}
	if (r.mapped)
		munmap((void *)r.base, r.mapped + g_page);
	if (r.kind == R_DEV && r.fd >= 0)
		close(r.fd);
	if (r.imported)
		s_ipc_open--;
}

// Maps n bytes (rounded up to pages) plus a PROT_NONE guard page after them
// and records the range; the caller has checked n > 0. Device memory
// (R_DEV) is a memfd of its own, so that an IPC handle can name it; r.fd,
// when it is already one (an imported handle), is mapped instead.
static CUresult map_range(struct fc_range r, void **out) {
	if (r.size > SIZE_MAX - 2 * g_page)
		return CUDA_ERROR_OUT_OF_MEMORY;
	r.mapped = (r.size + g_page - 1) / g_page * g_page;
	void *p = mmap(NULL, r.mapped + g_page, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE,
	               -1, 0);
	if (p == MAP_FAILED)
		return CUDA_ERROR_OUT_OF_MEMORY;
	int own = 0;
	if (r.kind == R_DEV && r.fd < 0) {
		r.fd = memfd_create("fakecuda-device-memory", MFD_CLOEXEC);
		own = r.fd >= 0;
		if (r.fd < 0 || ftruncate(r.fd, (off_t)r.mapped) != 0) {
			if (own)
				close(r.fd);
			munmap(p, r.mapped + g_page);
			return CUDA_ERROR_OUT_OF_MEMORY;
		}
	}
	if (r.kind == R_DEV &&
	    mmap(p, r.mapped, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_FIXED | MAP_NORESERVE, r.fd, 0) == MAP_FAILED) {
		if (own)
			close(r.fd);
		munmap(p, r.mapped + g_page);
		return CUDA_ERROR_OUT_OF_MEMORY;
	}
	r.base = (uintptr_t)p;
	if (mprotect((char *)p + r.mapped, g_page, PROT_NONE) != 0 || range_insert(r) != CUDA_SUCCESS) {
		if (own)
			close(r.fd);
		munmap(p, r.mapped + g_page);
		return CUDA_ERROR_OUT_OF_MEMORY;
	}
	*out = p;
	return CUDA_SUCCESS;
}

// Whether every page of [a, a+n) is mapped in this process.
static int is_mapped(uintptr_t a, size_t n) {
	unsigned char vec[256];
	for (uintptr_t p = a & ~(uintptr_t)(g_page - 1), end = a + n, len; p < end; p += len) {
		len = end - p < sizeof(vec) * g_page ? (end - p + g_page - 1) / g_page * g_page : sizeof(vec) * g_page;
		if (mincore((void *)p, len, vec) != 0)
			return 0;
	}
	return 1;
}

static struct fc_ctx *ctx_of(CUcontext h) {
	uintptr_t p = (uintptr_t)h, b = (uintptr_t)g_ctx;
	return p >= b && p < b + sizeof(g_ctx) && (p - b) % sizeof(g_ctx[0]) == 0 && h->used ? h : NULL;
}

// The calling thread's current context, which must be alive.
static CUresult current(struct fc_ctx **out) {
	*out = t_cur;
	return t_cur == NULL ? CUDA_ERROR_INVALID_CONTEXT : !t_cur->active ? CUDA_ERROR_CONTEXT_IS_DESTROYED : 0;
}

static void ctx_create(struct fc_ctx *c, int dev, int primary) {
	*c = (struct fc_ctx){.used = 1, .active = 1, .primary = primary, .dev = dev, .refs = c->refs};
	s_ctx_created++;
	s_ctx_mask |= 1L << dev;
}

// Destroys c as the driver does: its memory, registrations, streams and
// events go with it.
static void ctx_teardown(struct fc_ctx *c) {
	for (size_t i = g_nranges; i-- > 0;)
		if (g_ranges[i].ctx == c)
			range_remove(i);
	for (int i = 0; i < FC_MAX_STREAMS; i++)
		if (g_streams[i].ctx == c)
			g_streams[i].ctx = NULL;
	for (int i = 0; i < FC_MAX_EVENTS; i++)
		if (g_events[i].ctx == c)
			g_events[i].ctx = NULL;
	c->active = 0;
	c->refs = 0;
}

// Checks a stream handle. The default streams (NULL, CU_STREAM_LEGACY,
// CU_STREAM_PER_THREAD) belong to the current context, which must be alive.
static CUresult stream_ok(CUstream h) {
	uintptr_t p = (uintptr_t)h, b = (uintptr_t)g_streams;
	struct fc_ctx *c;
	if (p <= 2)
		return current(&c);
	return p >= b && p < b + sizeof(g_streams) && (p - b) % sizeof(g_streams[0]) == 0 && h->ctx
	           ? CUDA_SUCCESS
	           : CUDA_ERROR_INVALID_HANDLE;
}

static struct fc_event *event_of(CUevent h) {
	uintptr_t p = (uintptr_t)h, b = (uintptr_t)g_events;
	return p >= b && p < b + sizeof(g_events) && (p - b) % sizeof(g_events[0]) == 0 && h->ctx ? h : NULL;
}

// ---------------------------------------------------------------------------
// Initialisation and devices

static int env_bad(const char *name, const char *v) {
	fprintf(stderr, "fakecuda: bad %s=%s\n", name, v);
	return -1;
}

// Reads FAKECUDA_DEVICES, FAKECUDA_BUS_BASE and FAKECUDA_MEM.
static int read_env(void) {
	const char *v;
	long n;
	g_ndev = 2;
	g_bus_base = 0x20;
	g_mem = 1UL << 30;
	if ((v = getenv("FAKECUDA_DEVICES")) && *v) {
		if (parse_long(v, 10, 0, FC_MAX_DEV, &n))
			return env_bad("FAKECUDA_DEVICES", v);
		g_ndev = (int)n;
	}
	if ((v = getenv("FAKECUDA_BUS_BASE")) && *v) {
		if (parse_long(v, 16, 0, 0xff, &n) || n + g_ndev - 1 > 0xff)
			return env_bad("FAKECUDA_BUS_BASE", v);
		g_bus_base = (int)n;
	}
	if ((v = getenv("FAKECUDA_MEM")) && *v) {
		char *end;
		errno = 0;
		unsigned long long m = strtoull(v, &end, 10), mul = 1;
		const char *units = "kKmMgG", *u = *end ? strchr(units, *end) : NULL;
		if (u != NULL)
			mul = 1ULL << (10 * (1 + (u - units) / 2)), end++;
		if (errno || end == v || *end || m == 0 || m > (1ULL << 50) / mul)
			return env_bad("FAKECUDA_MEM", v);
		g_mem = (size_t)(m * mul);
	}
	return 0;
}

// Reads the environment at the first call; FAKECUDA_CONTROL is applied
// then. A bad variable fails cuInit with CUDA_ERROR_INVALID_VALUE (and a
// message on stderr) rather than letting a test run with the wrong fakes.
EXPORT CUresult cuInit(unsigned int flags) {
	COUNT_CALL();
	CUresult rc = fault_enter(__func__);
	if (rc != CUDA_SUCCESS)
		return rc;
	if (flags != 0)
		return CUDA_ERROR_INVALID_VALUE;
	LOCK();
	if (g_state == ST_NODEV) {
		rc = CUDA_ERROR_NO_DEVICE;
	} else if (g_state == ST_NONE) {
		const char *ctl = getenv("FAKECUDA_CONTROL");
		g_page = (size_t)sysconf(_SC_PAGESIZE);
		if (read_env() != 0)
			rc = CUDA_ERROR_INVALID_VALUE;
		else if (g_ndev == 0)
			rc = CUDA_ERROR_NO_DEVICE, __atomic_store_n(&g_state, ST_NODEV, __ATOMIC_RELEASE);
		else if (ctl && control_locked(ctl) != 0)
			rc = CUDA_ERROR_INVALID_VALUE, env_bad("FAKECUDA_CONTROL", ctl);
		else
			__atomic_store_n(&g_state, ST_OK, __ATOMIC_RELEASE);
	}
	UNLOCK();
	return rc;
}

EXPORT CUresult cuDriverGetVersion(int *v) {
	COUNT_CALL();
	CUresult rc = fault_enter(__func__);
	if (rc == CUDA_SUCCESS && v == NULL)
		rc = CUDA_ERROR_INVALID_VALUE;
	if (rc == CUDA_SUCCESS)
		*v = FC_DRIVER_VERSION;
	return rc;
}

// After a cuInit that found no device (FAKECUDA_DEVICES=0) this answers 0.
EXPORT CUresult cuDeviceGetCount(int *n) {
	COUNT_CALL();
	CUresult rc = fault_enter(__func__);
	int st = __atomic_load_n(&g_state, __ATOMIC_ACQUIRE);
	if (rc != CUDA_SUCCESS)
		return rc;
	if (st == ST_NONE)
		return CUDA_ERROR_NOT_INITIALIZED;
	if (n == NULL)
		return CUDA_ERROR_INVALID_VALUE;
	*n = st == ST_OK ? g_ndev : 0;
	return CUDA_SUCCESS;
}

#define NEED(cond, err) do { if (!(cond)) return (err); } while (0)
#define NEED_DEV(d) NEED((d) >= 0 && (d) < g_ndev, CUDA_ERROR_INVALID_DEVICE)

EXPORT CUresult cuDeviceGet(CUdevice *d, int ordinal) {
	BEGIN();
	NEED(d != NULL, CUDA_ERROR_INVALID_VALUE);
	NEED_DEV(ordinal);
	*d = ordinal;
	return CUDA_SUCCESS;
}

EXPORT CUresult cuDeviceGetName(char *name, int len, CUdevice d) {
	BEGIN();
	NEED(name != NULL && len > 0, CUDA_ERROR_INVALID_VALUE);
	NEED_DEV(d);
	snprintf(name, (size_t)len, "kvferry fake GPU %d", d);
	return CUDA_SUCCESS;
}

EXPORT CUresult cuDeviceGetPCIBusId(char *bus, int len, CUdevice d) {
	BEGIN();
	NEED(bus != NULL && len > 0, CUDA_ERROR_INVALID_VALUE);
	NEED_DEV(d);
	snprintf(bus, (size_t)len, "0000:%02x:00.0", g_bus_base + d);
	return CUDA_SUCCESS;
}

EXPORT CUresult cuDeviceGetAttribute(int *v, int attrib, CUdevice d) {
	BEGIN();
	NEED(v != NULL, CUDA_ERROR_INVALID_VALUE);
	NEED_DEV(d);
	if (attrib == CU_DEVICE_ATTRIBUTE_PCI_BUS_ID)
		*v = g_bus_base + d;
	else if (attrib == CU_DEVICE_ATTRIBUTE_UNIFIED_ADDRESSING)
		*v = 1;
	else if (attrib == CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED)
		*v = !__atomic_load_n(&g_no_dmabuf, __ATOMIC_RELAXED);
	else // PCI device and domain ids included
		*v = 0;
	return CUDA_SUCCESS;
}

EXPORT CUresult cuDeviceTotalMem_v2(size_t *bytes, CUdevice d) {
	BEGIN();
	NEED(bytes != NULL, CUDA_ERROR_INVALID_VALUE);
	NEED_DEV(d);
	*bytes = g_mem;
	return CUDA_SUCCESS;
}

// ---------------------------------------------------------------------------
// Contexts

EXPORT CUresult cuDevicePrimaryCtxRetain(CUcontext *pctx, CUdevice d) {
	BEGIN();
	NEED(pctx != NULL, CUDA_ERROR_INVALID_VALUE);
	NEED_DEV(d);
	LOCK();
	if (g_ctx[d].refs++ == 0)
		ctx_create(&g_ctx[d], d, 1);
	*pctx = &g_ctx[d];
	UNLOCK();
	return CUDA_SUCCESS;
}

// The last release resets the primary context, freeing what it held.
EXPORT CUresult cuDevicePrimaryCtxRelease_v2(CUdevice d) {
	BEGIN();
	NEED_DEV(d);
	CUresult rc = CUDA_SUCCESS;
	LOCK();
	if (g_ctx[d].refs == 0)
		rc = CUDA_ERROR_INVALID_CONTEXT;
	else if (--g_ctx[d].refs == 0)
		ctx_teardown(&g_ctx[d]);
	UNLOCK();
	return rc;
}

// Exported because the real driver exports it; kvferry must never need it.
EXPORT CUresult cuCtxCreate_v2(CUcontext *pctx, unsigned int flags, CUdevice d) {
	BEGIN();
	NEED(pctx != NULL && flags <= 0xff, CUDA_ERROR_INVALID_VALUE);
	NEED_DEV(d);
	CUresult rc = CUDA_ERROR_OUT_OF_MEMORY;
	LOCK();
	for (struct fc_ctx *c = &g_ctx[FC_MAX_DEV]; c < g_ctx + NELEM(g_ctx) && rc; c++) {
		if (!c->active) {
			ctx_create(c, d, 0);
			*pctx = t_cur = c;
			rc = CUDA_SUCCESS;
		}
	}
	UNLOCK();
	return rc;
}

EXPORT CUresult cuCtxDestroy_v2(CUcontext h) {
	BEGIN();
	CUresult rc = CUDA_ERROR_INVALID_CONTEXT;
	LOCK();
	struct fc_ctx *c = ctx_of(h);
	if (c != NULL && !c->primary && c->active) {
		ctx_teardown(c);
		if (t_cur == c)
			t_cur = NULL;
		rc = CUDA_SUCCESS;
	}
	UNLOCK();
	return rc;
}

EXPORT CUresult cuCtxSetCurrent(CUcontext h) {
	BEGIN();
	LOCK();
	struct fc_ctx *c = ctx_of(h);
	CUresult rc = h == NULL || (c != NULL && c->active) ? CUDA_SUCCESS : CUDA_ERROR_INVALID_CONTEXT;
	if (rc == CUDA_SUCCESS)
		t_cur = c;
	UNLOCK();
	return rc;
}

EXPORT CUresult cuCtxGetCurrent(CUcontext *pctx) {
	BEGIN();
	NEED(pctx != NULL, CUDA_ERROR_INVALID_VALUE);
	*pctx = t_cur;
	return CUDA_SUCCESS;
}

EXPORT CUresult cuCtxGetDevice(CUdevice *d) {
	BEGIN();
	NEED(d != NULL, CUDA_ERROR_INVALID_VALUE);
	struct fc_ctx *c;
	LOCK();
	CUresult rc = current(&c);
	if (rc == CUDA_SUCCESS)
		*d = c->dev;
	UNLOCK();
	return rc;
}

EXPORT CUresult cuCtxSynchronize(void) {
	BEGIN();
	struct fc_ctx *c;
	LOCK();
	CUresult rc = current(&c);
	UNLOCK();
	return rc;
}

// ---------------------------------------------------------------------------
// Memory

EXPORT CUresult cuMemAlloc_v2(CUdeviceptr *dptr, size_t bytesize) {
	BEGIN();
	NEED(dptr != NULL && bytesize > 0, CUDA_ERROR_INVALID_VALUE);
	struct fc_ctx *c;
	void *p = NULL;
	LOCK();
	CUresult rc = current(&c);
	if (rc == CUDA_SUCCESS && bytesize > g_mem - g_used[c->dev])
		rc = CUDA_ERROR_OUT_OF_MEMORY;
	if (rc == CUDA_SUCCESS)
		rc = map_range((struct fc_range){.size = bytesize, .kind = R_DEV, .dev = c->dev, .ctx = c, .fd = -1}, &p);
	if (rc == CUDA_SUCCESS)
		*dptr = (CUdeviceptr)(uintptr_t)p;
	UNLOCK();
	return rc;
}

// Frees the range of the given kind that starts at p; bad when there is none.
static CUresult free_range(uintptr_t p, int kind, CUresult bad) {
	LOCK();
	long i = range_floor(p);
	int ok = i >= 0 && g_ranges[i].base == p && g_ranges[i].kind == kind && !g_ranges[i].imported;
	if (ok)
		range_remove((size_t)i);
	UNLOCK();
	return ok ? CUDA_SUCCESS : bad;
}

EXPORT CUresult cuMemFree_v2(CUdeviceptr dptr) {
	BEGIN();
	return free_range((uintptr_t)dptr, R_DEV, CUDA_ERROR_INVALID_VALUE);
}

EXPORT CUresult cuMemGetAddressRange_v2(CUdeviceptr *pbase, size_t *psize, CUdeviceptr dptr) {
	BEGIN();
	LOCK();
	struct fc_range *r = range_at((uintptr_t)dptr);
	int ok = r != NULL && r->kind == R_DEV;
	if (ok && pbase)
		*pbase = r->base;
	if (ok && psize)
		*psize = r->size;
	UNLOCK();
	return ok ? CUDA_SUCCESS : CUDA_ERROR_NOT_FOUND;
}

// Writes attribute a of pointer p, which lies in r (NULL: memory the driver
// does not know). strict: cuPointerGetAttribute, which fails for unknown
// memory and for the host pointer of device memory; else the defaults of
// cuPointerGetAttributes (type 0, NULL context, ordinal CU_DEVICE_INVALID).
static CUresult pointer_attr(int a, void *data, CUdeviceptr p, const struct fc_range *r, int strict) {
	int dev = r && r->kind == R_DEV;
	if (data == NULL || (strict && r == NULL) || (strict && dev && a == CU_POINTER_ATTRIBUTE_HOST_POINTER))
		return CUDA_ERROR_INVALID_VALUE;
	switch (a) {
	case CU_POINTER_ATTRIBUTE_CONTEXT:
		*(CUcontext *)data = r ? r->ctx : NULL;
		break;
	case CU_POINTER_ATTRIBUTE_MEMORY_TYPE:
		*(unsigned int *)data = r == NULL ? 0 : dev ? CU_MEMORYTYPE_DEVICE : CU_MEMORYTYPE_HOST;
		break;
	case CU_POINTER_ATTRIBUTE_DEVICE_POINTER:
		*(CUdeviceptr *)data = r ? p : 0;
		break;
	case CU_POINTER_ATTRIBUTE_HOST_POINTER:
		*(void **)data = r && !dev ? (void *)(uintptr_t)p : NULL;
		break;
	case CU_POINTER_ATTRIBUTE_BUFFER_ID:
		*(unsigned long long *)data = r ? r->id : 0;
		break;
	case CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL:
		*(int *)data = r ? r->dev : FC_DEVICE_INVALID;
		break;
	case CU_POINTER_ATTRIBUTE_RANGE_START_ADDR:
		*(CUdeviceptr *)data = r ? r->base : 0;
		break;
	case CU_POINTER_ATTRIBUTE_RANGE_SIZE:
		*(size_t *)data = r ? r->size : 0;
		break;
	default:
		return CUDA_ERROR_INVALID_VALUE;
	}
	return CUDA_SUCCESS;
}

EXPORT CUresult cuPointerGetAttribute(void *data, int attribute, CUdeviceptr ptr) {
	BEGIN();
	LOCK();
	CUresult rc = pointer_attr(attribute, data, ptr, range_at((uintptr_t)ptr), 1);
	UNLOCK();
	return rc;
}

EXPORT CUresult cuPointerGetAttributes(unsigned int n, int *attrs, void **data, CUdeviceptr ptr) {
	BEGIN();
	NEED(n > 0 && attrs != NULL && data != NULL, CUDA_ERROR_INVALID_VALUE);
	CUresult rc = CUDA_SUCCESS;
	LOCK();
	const struct fc_range *r = range_at((uintptr_t)ptr);
	for (unsigned int i = 0; i < n && rc == CUDA_SUCCESS; i++)
		rc = pointer_attr(attrs[i], data[i], ptr, r, 0);
	UNLOCK();
	return rc;
}

EXPORT CUresult cuMemHostAlloc(void **pp, size_t bytesize, unsigned int flags) {
	BEGIN();
	NEED(pp != NULL && bytesize > 0 && !(flags & ~FC_HOSTALLOC_FLAGS), CUDA_ERROR_INVALID_VALUE);
	struct fc_ctx *c;
	LOCK();
	CUresult rc = current(&c);
	if (rc == CUDA_SUCCESS)
		rc = map_range((struct fc_range){.size = bytesize, .kind = R_HOSTALLOC, .dev = c->dev, .ctx = c}, pp);
	UNLOCK();
	return rc;
}

EXPORT CUresult cuMemFreeHost(void *p) {
	BEGIN();
	return free_range((uintptr_t)p, R_HOSTALLOC, CUDA_ERROR_INVALID_VALUE);
}

EXPORT CUresult cuMemHostRegister_v2(void *p, size_t bytesize, unsigned int flags) {
	BEGIN();
	uintptr_t a = (uintptr_t)p;
	NEED(p != NULL && bytesize > 0 && bytesize <= UINTPTR_MAX - a && !(flags & ~FC_HOSTREGISTER_FLAGS),
	     CUDA_ERROR_INVALID_VALUE);
	struct fc_ctx *c;
	LOCK();
	CUresult rc = current(&c);
	struct fc_range *o = rc == CUDA_SUCCESS ? range_overlap(a, bytesize) : NULL;
	if (o != NULL)
		rc = o->kind == R_DEV ? CUDA_ERROR_INVALID_VALUE : CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED;
	else if (rc == CUDA_SUCCESS && !is_mapped(a, bytesize)) // the driver pins the pages
		rc = CUDA_ERROR_INVALID_VALUE;
	else if (rc == CUDA_SUCCESS)
		rc = range_insert((struct fc_range){.base = a, .size = bytesize, .kind = R_HOSTREG, .dev = c->dev, .ctx = c});
	UNLOCK();
	return rc;
}

EXPORT CUresult cuMemHostUnregister(void *p) {
	BEGIN();
	return free_range((uintptr_t)p, R_HOSTREG, CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED);
}

// ---------------------------------------------------------------------------
// Copies

enum { K_HOST, K_DEV, K_ANY };

// One side of a copy: a device pointer must lie fully inside one live
// allocation; host pointers are trusted (but not NULL); K_ANY (cuMemcpy)
// decides by the address.
static int side_ok(uintptr_t p, size_t n, int kind) {
	struct fc_range *r = kind == K_HOST ? NULL : range_at(p);
	if (r != NULL && r->kind == R_DEV)
		return n <= r->size - (p - r->base);
	return kind != K_DEV && p != 0;
}

// Validates under g_mu, then copies outside it (freeing memory under a
// running copy is the caller's bug). hs: the stream of an async copy, which
// runs synchronously all the same.
static CUresult copy(uintptr_t dst, int dkind, uintptr_t src, int skind, size_t n, int async, CUstream hs) {
	struct fc_ctx *c;
	LOCK();
	CUresult rc = current(&c);
	if (rc == CUDA_SUCCESS && async)
		rc = stream_ok(hs);
	if (rc == CUDA_SUCCESS && n > 0 && (!side_ok(dst, n, dkind) || !side_ok(src, n, skind)))
		rc = CUDA_ERROR_INVALID_VALUE;
	UNLOCK();
	if (rc != CUDA_SUCCESS)
		return rc;
	if (n > 0)
		memmove((void *)dst, (const void *)src, n);
	LOCK();
	s_copies++;
	UNLOCK();
	return CUDA_SUCCESS;
}

EXPORT CUresult cuMemcpyHtoD_v2(CUdeviceptr dst, const void *src, size_t n) {
	BEGIN();
	return copy((uintptr_t)dst, K_DEV, (uintptr_t)src, K_HOST, n, 0, NULL);
}

EXPORT CUresult cuMemcpyDtoH_v2(void *dst, CUdeviceptr src, size_t n) {
	BEGIN();
	return copy((uintptr_t)dst, K_HOST, (uintptr_t)src, K_DEV, n, 0, NULL);
}

EXPORT CUresult cuMemcpyDtoD_v2(CUdeviceptr dst, CUdeviceptr src, size_t n) {
	BEGIN();
	return copy((uintptr_t)dst, K_DEV, (uintptr_t)src, K_DEV, n, 0, NULL);
}

EXPORT CUresult cuMemcpy(CUdeviceptr dst, CUdeviceptr src, size_t n) {
	BEGIN();
	return copy((uintptr_t)dst, K_ANY, (uintptr_t)src, K_ANY, n, 0, NULL);
}

EXPORT CUresult cuMemcpyHtoDAsync_v2(CUdeviceptr dst, const void *src, size_t n, CUstream st) {
	BEGIN();
	return copy((uintptr_t)dst, K_DEV, (uintptr_t)src, K_HOST, n, 1, st);
}

EXPORT CUresult cuMemcpyDtoHAsync_v2(void *dst, CUdeviceptr src, size_t n, CUstream st) {
	BEGIN();
	return copy((uintptr_t)dst, K_HOST, (uintptr_t)src, K_DEV, n, 1, st);
}

EXPORT CUresult cuMemcpyDtoDAsync_v2(CUdeviceptr dst, CUdeviceptr src, size_t n, CUstream st) {
	BEGIN();
	return copy((uintptr_t)dst, K_DEV, (uintptr_t)src, K_DEV, n, 1, st);
}

// ---------------------------------------------------------------------------
// Streams and events: all work is done when enqueued, so a stream is always
// idle and a recorded event complete at once (after the copies before it).

EXPORT CUresult cuStreamCreate(CUstream *ph, unsigned int flags) {
	BEGIN();
	NEED(ph != NULL && !(flags & ~FC_STREAM_FLAGS), CUDA_ERROR_INVALID_VALUE);
	struct fc_ctx *c;
	LOCK();
	CUresult rc = current(&c);
	int i = 0;
	while (rc == CUDA_SUCCESS && i < FC_MAX_STREAMS && g_streams[i].ctx != NULL)
		i++;
	if (rc == CUDA_SUCCESS && i == FC_MAX_STREAMS)
		rc = CUDA_ERROR_OUT_OF_MEMORY;
	if (rc == CUDA_SUCCESS) {
		g_streams[i].ctx = c;
		*ph = &g_streams[i];
	}
	UNLOCK();
	return rc;
}

static CUresult stream_check(CUstream h, int destroy) {
	LOCK();
	CUresult rc = stream_ok(h);
	if (destroy && rc == CUDA_SUCCESS && (uintptr_t)h <= 2)
		rc = CUDA_ERROR_INVALID_HANDLE;
	if (destroy && rc == CUDA_SUCCESS)
		h->ctx = NULL;
	UNLOCK();
	return rc;
}

EXPORT CUresult cuStreamSynchronize(CUstream h) {
	BEGIN();
	return stream_check(h, 0);
}

EXPORT CUresult cuStreamQuery(CUstream h) {
	BEGIN();
	return stream_check(h, 0);
}

EXPORT CUresult cuStreamDestroy_v2(CUstream h) {
	BEGIN();
	return stream_check(h, 1);
}

EXPORT CUresult cuEventCreate(CUevent *ph, unsigned int flags) {
	BEGIN();
	NEED(ph != NULL && !(flags & ~FC_EVENT_FLAGS), CUDA_ERROR_INVALID_VALUE);
	struct fc_ctx *c;
	LOCK();
	CUresult rc = current(&c);
	int i = 0;
	while (rc == CUDA_SUCCESS && i < FC_MAX_EVENTS && g_events[i].ctx != NULL)
		i++;
	if (rc == CUDA_SUCCESS && i == FC_MAX_EVENTS)
		rc = CUDA_ERROR_OUT_OF_MEMORY;
	if (rc == CUDA_SUCCESS) {
		g_events[i].ctx = c;
		*ph = &g_events[i];
	}
	UNLOCK();
	return rc;
}

// op: 0 query/synchronize, 1 destroy, 2 record on hs (of the event's context).
static CUresult event_op(CUevent h, int op, CUstream hs) {
	LOCK();
	struct fc_event *ev = event_of(h);
	CUresult rc = ev ? CUDA_SUCCESS : CUDA_ERROR_INVALID_HANDLE;
	if (rc == CUDA_SUCCESS && op == 2)
		rc = stream_ok(hs);
	if (rc == CUDA_SUCCESS && op == 2 && (uintptr_t)hs > 2 && hs->ctx != ev->ctx)
		rc = CUDA_ERROR_INVALID_HANDLE;
	if (rc == CUDA_SUCCESS && op == 1)
		ev->ctx = NULL;
	UNLOCK();
	return rc;
}

EXPORT CUresult cuEventRecord(CUevent h, CUstream hs) {
	BEGIN();
	return event_op(h, 2, hs);
}

EXPORT CUresult cuEventQuery(CUevent h) {
	BEGIN();
	return event_op(h, 0, NULL);
}

EXPORT CUresult cuEventSynchronize(CUevent h) {
	BEGIN();
	return event_op(h, 0, NULL);
}

EXPORT CUresult cuEventDestroy_v2(CUevent h) {
	BEGIN();
	return event_op(h, 1, NULL);
}

// ---------------------------------------------------------------------------
// dma-buf export and error strings

// Gives a real fd of the right size (a memfd, not the device memory itself):
// kvferry only hands it to ibv_reg_dmabuf_mr, which the fake libibverbs
// refuses. As the driver documents, dptr and size must be page aligned.
EXPORT CUresult cuMemGetHandleForAddressRange(void *handle, CUdeviceptr dptr, size_t size, int type,
                                              unsigned long long flags) {
	BEGIN();
	NEED(handle != NULL, CUDA_ERROR_INVALID_VALUE);
	NEED(!__atomic_load_n(&g_no_dmabuf, __ATOMIC_RELAXED), CUDA_ERROR_NOT_SUPPORTED);
	NEED(type == CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD && !(flags & ~FC_RANGE_FLAGS) && size > 0 &&
	         dptr % g_page == 0 && size % g_page == 0,
	     CUDA_ERROR_INVALID_VALUE);
	LOCK();
	struct fc_range *r = range_at((uintptr_t)dptr);
	int ok = r && r->kind == R_DEV && size <= r->mapped - ((uintptr_t)dptr - r->base);
	UNLOCK();
	NEED(ok, CUDA_ERROR_INVALID_VALUE);
	int fd = memfd_create("kvferry-fakecuda-dmabuf", MFD_CLOEXEC);
	if (fd < 0 || ftruncate(fd, (off_t)size) != 0) {
		if (fd >= 0)
			close(fd);
		return CUDA_ERROR_OUT_OF_MEMORY;
	}
	*(int *)handle = fd;
	LOCK();
	s_dmabufs++;
	UNLOCK();
	return CUDA_SUCCESS;
}

// Unknown codes: CUDA_ERROR_INVALID_VALUE and *out = NULL, as the driver.
static CUresult error_text(CUresult e, const char **out, int name) {
	CUresult rc = fault_enter(name ? "cuGetErrorName" : "cuGetErrorString");
	if (rc != CUDA_SUCCESS || out == NULL)
		return rc ? rc : CUDA_ERROR_INVALID_VALUE;
	*out = NULL;
	for (size_t i = 0; i < NELEM(k_errors); i++)
		if (k_errors[i].code == e)
			*out = name ? k_errors[i].name : k_errors[i].text;
	return *out ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}

EXPORT CUresult cuGetErrorString(CUresult e, const char **out) { return error_text(e, out, 0); }

EXPORT CUresult cuGetErrorName(CUresult e, const char **out) { return error_text(e, out, 1); }

// ---------------------------------------------------------------------------
// IPC: a handle names the exporter's process, the memfd behind the
// allocation and its size; the importer opens that descriptor through
// /proc (which needs the same user, as the driver's IPC does) and maps it
// as memory of its current context's device. The layout is the fake's own:
// the handle is opaque to its users, as the driver's is. As the driver
// does, the fake refuses a handle of the calling process itself.

typedef struct {
	char reserved[64];
} CUipcMemHandle;

struct fc_ipc {
	char magic[8]; // "FCIPC1"
	int32_t pid, fd;
	uint64_t size, mapped, id;
};

EXPORT CUresult cuIpcGetMemHandle(CUipcMemHandle *h, CUdeviceptr dptr) {
	BEGIN();
	NEED(h != NULL, CUDA_ERROR_INVALID_VALUE);
	LOCK();
	struct fc_range *r = range_at((uintptr_t)dptr);
	int ok = r != NULL && r->kind == R_DEV && r->base == (uintptr_t)dptr && !r->imported && r->fd >= 0;
	if (ok) {
		struct fc_ipc in = {.magic = "FCIPC1", .pid = getpid(), .fd = r->fd, .size = r->size, .mapped = r->mapped,
		                    .id = r->id};
		memset(h, 0, sizeof(*h));
		memcpy(h, &in, sizeof(in));
		s_ipc_exported++;
	}
	UNLOCK();
	return ok ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}

EXPORT CUresult cuIpcOpenMemHandle_v2(CUdeviceptr *pdptr, CUipcMemHandle h, unsigned int flags) {
	BEGIN();
	NEED(pdptr != NULL && flags <= 1, CUDA_ERROR_INVALID_VALUE); // CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS = 0x1
	struct fc_ipc in;
	memcpy(&in, &h, sizeof(in));
	NEED(memcmp(in.magic, "FCIPC1", 7) == 0 && in.size > 0 && in.mapped >= in.size, CUDA_ERROR_INVALID_VALUE);
	if (in.pid == getpid())
		return CUDA_ERROR_INVALID_CONTEXT;
	char path[64];
	snprintf(path, sizeof(path), "/proc/%d/fd/%d", (int)in.pid, (int)in.fd);
	int fd = open(path, O_RDWR | O_CLOEXEC);
	if (fd < 0)
		return CUDA_ERROR_INVALID_VALUE;
	struct stat st;
	if (fstat(fd, &st) != 0 || st.st_size < 0 || (uint64_t)st.st_size != in.mapped) {
		close(fd);
		return CUDA_ERROR_INVALID_VALUE;
	}
	struct fc_ctx *c;
	void *p = NULL;
	LOCK();
	CUresult rc = current(&c);
	if (rc == CUDA_SUCCESS)
		rc = map_range((struct fc_range){.size = in.size, .kind = R_DEV, .dev = c->dev, .ctx = c, .fd = fd, .imported = 1}, &p);
	if (rc == CUDA_SUCCESS) {
		*pdptr = (CUdeviceptr)(uintptr_t)p;
		s_ipc_opened++;
		s_ipc_open++;
		// Imported memory is not an allocation of this process.
		g_used[c->dev] -= in.size;
		s_bytes -= (long)in.size;
		s_allocs--;
	}
	UNLOCK();
	if (rc != CUDA_SUCCESS)
		close(fd);
	return rc;
}

EXPORT CUresult cuIpcCloseMemHandle(CUdeviceptr dptr) {
	BEGIN();
	LOCK();
	long i = range_floor((uintptr_t)dptr);
	int ok = i >= 0 && g_ranges[i].base == (uintptr_t)dptr && g_ranges[i].imported;
	if (ok) {
		g_used[g_ranges[i].dev] += g_ranges[i].size; // range_remove takes them off again
		s_bytes += (long)g_ranges[i].size;
		s_allocs++;
		range_remove((size_t)i);
	}
	UNLOCK();
	return ok ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}
