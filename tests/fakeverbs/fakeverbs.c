// fakeverbs: a fake libibverbs for kvferry's CI, on machines without RDMA
// hardware. It models an RC NIC in which the RESPONDER executes: a requester
// only queues work requests in shared memory and rings a doorbell; an
// executor thread in the process that owns the destination QP copies the
// bytes (process_vm_readv/writev), chunk by chunk, after checking its own
// memory registrations. That makes the two properties kvferry's safety
// contract relies on testable (docs/SAFETY.md, "How each transport keeps
// promises 1 and 7"): the owner can fence by moving its responder QP to ERR, and
// ibv_dereg_mr returns only when no byte moves to or from the range any
// more. It also means a WRITE posted by a process that is then stopped still
// lands, as with a real NIC. See README.md in this directory.
#define _GNU_SOURCE
#include <infiniband/verbs.h>
// verbs.h turns these into inline wrappers; we define the exported symbols.
#undef ibv_query_port
#undef ibv_reg_mr
#undef ibv_get_device_list

#include <dirent.h>
#include <endian.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <linux/futex.h>
#include <pthread.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/uio.h>
#include <time.h>
#include <unistd.h>

#define EXPORT __attribute__((visibility("default")))

// ---------------------------------------------------------------------------
// Fabric layout (POSIX shm, shared by every process of one FAKEVERBS_FABRIC)

#define FV_MAGIC 0x3153524556464b46ULL // "FKFVERS1"
enum {
	FV_LAYOUT = 2,        // bump when a struct below changes
	FV_NDEV = 64,         // devices fabric-wide
	FV_NEXEC = 8,         // contexts (executors) per device and process
	FV_NMR = 65536,       // memory regions fabric-wide
	FV_NCQ = 1024,        // completion queues fabric-wide
	FV_NQP = 2048,        // queue pairs fabric-wide
	FV_PAGE = 4096,       // heap allocation unit (rings)
	FV_INLINE = 64,       // max_inline_data
	FV_MAX_WR = 4096,     // max_qp_wr
	FV_MAX_CQE = 65536,   // max_cqe
	FV_MAX_SHM_MB = 1024, // FAKEVERBS_SHM_MB upper bound
	FV_MAX_PAGES = FV_MAX_SHM_MB * (1048576 / FV_PAGE),
	FV_QPN_BASE = 0x100,
	FV_LOCK_MS = 5000,    // bound on any lock wait in an API call
	FV_RNR_MS = 100,      // how long a SEND waits for a posted receive
	FV_MIN_TIMEOUT_MS = 50,
};

// One fabric device: one per process and local index ("fake0" of pid P).
struct fv_sdev {
	int32_t in_use;
	pid_t pid;
	uint32_t serial; // fabric-unique, in GID and GUID; distinguishes reuses of a slot
	int32_t local_idx;
	uint32_t doorbell; // futex word: bumped when work for this device's QPs is posted
	uint16_t lid;
	uint8_t gid[16];
	// Fault state; read by executors of every process.
	int32_t down, fail_after, fail_status, stall_ms, delay_us, partial_after, late_land, hang;
	int32_t exec_used[FV_NEXEC];
	// MR slots (+1) an executor of this device touches right now, so that
	// ibv_dereg_mr can tell a dead toucher from a live one.
	int32_t touch[FV_NEXEC][2];
};

struct fv_smr {
	int32_t in_use, valid;
	uint32_t key; // lkey == rkey
	int32_t access;
	int32_t dev;
	uint32_t dev_serial;
	pid_t pid;
	int32_t users; // chunks copying into or out of this MR right now
	uint64_t pd, ctx, addr, len;
};

struct fv_scq {
	int32_t in_use;
	uint32_t gen;
	pid_t pid;
	int32_t dev;
	uint64_t ctx;
	uint32_t cap, page, npages;
	int32_t overflow;
	uint64_t head, tail;
	pthread_mutex_t lock;
};

// A send work request as the executor sees it; inline data travels in it.
struct fv_wqe {
	uint64_t wr_id, laddr, raddr, post_ns;
	uint32_t len, lkey, rkey, imm;
	uint32_t flags;
	int32_t status;
	uint8_t opcode, inl, noexec, done;
	uint32_t byte_len;
	uint8_t data[FV_INLINE];
};

struct fv_rwqe {
	uint64_t wr_id, addr;
	uint32_t len, lkey;
};

struct fv_sqp {
	int32_t in_use; // 1 live, 2 being destroyed
	uint32_t gen;   // bumped on RESET and destroy: executors drop stale work
	pid_t pid;
	int32_t dev;
	uint32_t dev_serial;
	uint32_t qpn;
	int32_t state;
	int32_t sq_sig_all;
	uint64_t ctx, pd;
	int32_t send_cq, recv_cq;
	uint32_t send_cq_gen, recv_cq_gen;
	// Attributes from modify_qp.
	int32_t port, access, pkey_index, path_mtu;
	uint32_t dest_qpn, rq_psn, sq_psn;
	int32_t dest_dev; // resolved from dgid/dlid at RTR; -1 if none
	uint32_t dest_serial;
	int32_t timeout, retry_cnt, rnr_retry, min_rnr_timer, max_rd_atomic, max_dest_rd_atomic;
	struct ibv_ah_attr ah;
	// Rings in the heap. Send ring counters: shead (posted), sexec (next the
	// executor claims), scq (next to report in the CQ); a slot is free once
	// both sexec and scq passed it.
	uint32_t scap, rcap, spage, snpages, rpage, rnpages;
	uint64_t shead, sexec, scq, rhead, rtail;
	int32_t busy; // an executor runs this QP's oldest claimed WQE
	pid_t busy_pid;
	uint64_t rnr_since;
	pthread_mutex_t lock;      // state, rings; never held across a copy
	pthread_mutex_t exec_lock; // held per chunk by this QP's responder executor; the fence
};

struct fv_shm {
	uint64_t magic;
	uint32_t layout, npages;
	uint64_t size, heap_off;
	pthread_mutex_t lock; // tables and heap
	uint32_t next_serial, next_qpn, next_key;
	uint64_t bitmap[FV_MAX_PAGES / 64];
	struct fv_sdev dev[FV_NDEV];
	struct fv_scq cq[FV_NCQ];
	struct fv_sqp qp[FV_NQP];
	struct fv_smr mr[FV_NMR];
};

// ---------------------------------------------------------------------------
// Process-local objects

struct fv_device {
	struct ibv_device ibv;
	int gidx;
	uint32_t serial;
};

struct fv_ctx {
	struct ibv_context ibv;
	struct fv_device *dev;
	pthread_t thr;
	int thr_ok;
	int stop;
	int exec_slot;
};

struct fv_pd {
	struct ibv_pd ibv;
	int refs;
};

struct fv_mr {
	struct ibv_mr ibv;
	int slot;
};

struct fv_cq {
	struct ibv_cq ibv;
	int slot;
	uint32_t gen;
	uint64_t last_check;
};

struct fv_qp {
	struct ibv_qp ibv;
	int slot;
};

static struct {
	pthread_mutex_t mu; // process init
	int ready;
	struct fv_shm *shm;
	int ndev;
	struct fv_device *devs;
	char dir[PATH_MAX];
	pid_t dir_pid;
	int atexit_set;
	int link_ib;
	uint32_t chunk;
	uint64_t max_mr_size;
	unsigned long rejected_modify, executed, failed;
} G = {.mu = PTHREAD_MUTEX_INITIALIZER};

#define LD(p) __atomic_load_n((p), __ATOMIC_SEQ_CST)
#define ST(p, v) __atomic_store_n((p), (v), __ATOMIC_SEQ_CST)
#define ADD(p, v) __atomic_add_fetch((p), (v), __ATOMIC_SEQ_CST)

static int control_one(const char *cmd);

// ---------------------------------------------------------------------------
// Small helpers

static uint64_t now_ns(void) {
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

static void sleep_us(uint64_t us) {
	struct timespec ts = {(time_t)(us / 1000000), (long)(us % 1000000) * 1000};
	while (nanosleep(&ts, &ts) == -1 && errno == EINTR) {
	}
}

// Robust, bounded lock: a lock left by a dead process is taken over; one
// held by a stopped process makes the caller fail after ms, not hang.
static int fv_lock(pthread_mutex_t *m, int ms) {
	struct timespec ts;
	clock_gettime(CLOCK_REALTIME, &ts);
	ts.tv_sec += ms / 1000;
	ts.tv_nsec += (long)(ms % 1000) * 1000000;
	if (ts.tv_nsec >= 1000000000) {
		ts.tv_sec++;
		ts.tv_nsec -= 1000000000;
	}
	int rc = pthread_mutex_timedlock(m, &ts);
	if (rc == EOWNERDEAD) {
		pthread_mutex_consistent(m);
		rc = 0;
	}
	return rc;
}

static void fv_unlock(pthread_mutex_t *m) { pthread_mutex_unlock(m); }

// A zombie still answers kill(pid, 0), so /proc decides that case.
static int pid_dead(pid_t pid) {
	if (pid <= 0)
		return 1;
	if (pid == getpid())
		return 0;
	if (kill(pid, 0) == -1 && errno == ESRCH)
		return 1;
	char path[64], buf[512];
	snprintf(path, sizeof(path), "/proc/%d/stat", (int)pid);
	int fd = open(path, O_RDONLY | O_CLOEXEC);
	if (fd < 0)
		return errno == ENOENT;
	ssize_t n = read(fd, buf, sizeof(buf) - 1);
	close(fd);
	if (n <= 0)
		return 0;
	buf[n] = 0;
	char *p = strrchr(buf, ')');
	return p != NULL && p[1] == ' ' && (p[2] == 'Z' || p[2] == 'X');
}

static void futex_wake(uint32_t *w) { syscall(SYS_futex, w, FUTEX_WAKE, INT_MAX, NULL, NULL, 0); }

static void futex_wait_1ms(uint32_t *w, uint32_t seen) {
	struct timespec ts = {0, 1000000};
	syscall(SYS_futex, w, FUTEX_WAIT, seen, &ts, NULL, 0);
}

static int fail(int e) {
	errno = e;
	return e;
}

static void *fail_null(int e) {
	errno = e;
	return NULL;
}

static void *heap_at(uint32_t page) { return (char *)G.shm + G.shm->heap_off + (size_t)page * FV_PAGE; }
static struct fv_wqe *sring(struct fv_sqp *q) { return heap_at(q->spage); }
static struct fv_rwqe *rring(struct fv_sqp *q) { return heap_at(q->rpage); }
static struct ibv_wc *cring(struct fv_scq *c) { return heap_at(c->page); }

// Keys: a bijection of a fabric-wide counter, so they look random, are never
// 0, are never reused while the fabric lives, and map back to their slot.
#define KEY_MUL 0x9E3779B1u
#define KEY_XOR 0x5BD1E995u
static uint32_t key_of(uint32_t c) { return (c * KEY_MUL) ^ KEY_XOR; }
static uint32_t ctr_of(uint32_t k) {
	uint32_t inv = KEY_MUL;
	for (int i = 0; i < 5; i++)
		inv *= 2 - KEY_MUL * inv;
	return (k ^ KEY_XOR) * inv;
}

static int env_int(const char *name, long dflt, long lo, long hi, long *out) {
	const char *s = getenv(name);
	*out = dflt;
	if (s == NULL || *s == 0)
		return 0;
	char *end;
	errno = 0;
	long long v = strtoll(s, &end, 0);
	if (errno || *end || v < lo || v > hi) {
		fprintf(stderr, "fakeverbs: %s=%s: want an integer in [%ld, %ld]\n", name, s, lo, hi);
		return -1;
	}
	*out = (long)v;
	return 0;
}

// ---------------------------------------------------------------------------
// Fabric: open, initialise once, heap, reclaim entries of dead processes

static void init_mutex(pthread_mutex_t *m) {
	pthread_mutexattr_t a;
	pthread_mutexattr_init(&a);
	pthread_mutexattr_setpshared(&a, PTHREAD_PROCESS_SHARED);
	pthread_mutexattr_setrobust(&a, PTHREAD_MUTEX_ROBUST);
	pthread_mutex_init(m, &a);
	pthread_mutexattr_destroy(&a);
}

static int fabric_open(void) {
	if (G.shm != NULL)
		return 0;
	char name[256];
	const char *f = getenv("FAKEVERBS_FABRIC");
	if (f != NULL && *f)
		snprintf(name, sizeof(name), "%s%s", f[0] == '/' ? "" : "/", f);
	else
		snprintf(name, sizeof(name), "/kvferry-fakeverbs-%u", (unsigned)getuid());
	long mb;
	if (env_int("FAKEVERBS_SHM_MB", 64, 16, FV_MAX_SHM_MB, &mb))
		return EINVAL;
	int fd = shm_open(name, O_RDWR | O_CREAT | O_CLOEXEC, 0600);
	if (fd < 0) {
		fprintf(stderr, "fakeverbs: shm_open %s: %s\n", name, strerror(errno));
		return errno;
	}
	// flock serialises the one initialisation; the kernel drops it if the
	// initialiser dies, so nobody waits on a dead process.
	if (flock(fd, LOCK_EX) != 0) {
		int e = errno;
		close(fd);
		return e;
	}
	struct stat st;
	int rc = 0;
	void *p = MAP_FAILED;
	if (fstat(fd, &st) != 0) {
		rc = errno;
		goto out;
	}
	size_t size = (size_t)st.st_size;
	if (size == 0) {
		size = (size_t)mb << 20;
		if (ftruncate(fd, (off_t)size) != 0) {
			rc = errno;
			goto out;
		}
	}
	if (size < sizeof(struct fv_shm) + 64 * FV_PAGE) {
		rc = EPROTO;
		goto out;
	}
	p = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
	if (p == MAP_FAILED) {
		rc = errno;
		goto out;
	}
	struct fv_shm *s = p;
	if (LD(&s->magic) == 0) {
		init_mutex(&s->lock);
		for (int i = 0; i < FV_NCQ; i++)
			init_mutex(&s->cq[i].lock);
		for (int i = 0; i < FV_NQP; i++) {
			init_mutex(&s->qp[i].lock);
			init_mutex(&s->qp[i].exec_lock);
		}
		s->layout = FV_LAYOUT;
		s->size = size;
		s->heap_off = (sizeof(struct fv_shm) + FV_PAGE - 1) / FV_PAGE * FV_PAGE;
		uint64_t pages = (size - s->heap_off) / FV_PAGE;
		s->npages = (uint32_t)(pages > FV_MAX_PAGES ? FV_MAX_PAGES : pages);
		s->next_serial = 1;
		s->next_key = 1;
		ST(&s->magic, FV_MAGIC);
	} else if (s->magic != FV_MAGIC || s->layout != FV_LAYOUT || s->size != size) {
		rc = EPROTO;
	}
out:
	if (rc == EPROTO)
		fprintf(stderr, "fakeverbs: fabric /dev/shm%s has another layout or size; remove it\n", name);
	if (rc && p != MAP_FAILED)
		munmap(p, size);
	else if (rc == 0)
		G.shm = p;
	flock(fd, LOCK_UN);
	close(fd);
	return rc;
}

// First fit in the page bitmap; fabric lock held. Pages come back dirty:
// every ring entry is written before it is read.
static int heap_alloc(uint32_t n, uint32_t *page) {
	struct fv_shm *s = G.shm;
	if (n == 0) {
		*page = 0;
		return 0;
	}
	uint32_t run = 0;
	for (uint32_t i = 0; i < s->npages; i++) {
		if (s->bitmap[i / 64] & (1ull << (i % 64))) {
			run = 0;
			continue;
		}
		if (++run == n) {
			uint32_t first = i + 1 - n;
			for (uint32_t j = first; j <= i; j++)
				s->bitmap[j / 64] |= 1ull << (j % 64);
			*page = first;
			return 0;
		}
	}
	return ENOMEM;
}

static void heap_free(uint32_t page, uint32_t n) {
	for (uint32_t j = page; j < page + n; j++)
		G.shm->bitmap[j / 64] &= ~(1ull << (j % 64));
}

struct pid_cache {
	pid_t pid[32];
	int dead[32], n;
};

static int cached_dead(struct pid_cache *c, pid_t pid) {
	for (int i = 0; i < c->n && i < 32; i++)
		if (c->pid[i] == pid)
			return c->dead[i];
	int d = pid_dead(pid);
	c->pid[c->n % 32] = pid;
	c->dead[c->n % 32] = d;
	c->n++;
	return d;
}

static void qp_free_locked(struct fv_sqp *q) {
	heap_free(q->spage, q->snpages);
	heap_free(q->rpage, q->rnpages);
	ADD(&q->gen, 1);
	ST(&q->in_use, 0);
}

// Entries of dead processes go back to the pool; fabric lock held.
static void reclaim_locked(void) {
	struct fv_shm *s = G.shm;
	struct pid_cache pc = {.n = 0};
	for (int i = 0; i < FV_NDEV; i++)
		if (s->dev[i].in_use && cached_dead(&pc, s->dev[i].pid)) {
			memset(s->dev[i].touch, 0, sizeof(s->dev[i].touch));
			ST(&s->dev[i].in_use, 0);
		}
	for (int i = 0; i < FV_NQP; i++) {
		struct fv_sqp *q = &s->qp[i];
		if (q->in_use && cached_dead(&pc, q->pid) && fv_lock(&q->lock, 100) == 0) {
			ST(&q->state, IBV_QPS_ERR);
			qp_free_locked(q);
			fv_unlock(&q->lock);
		}
	}
	for (int i = 0; i < FV_NCQ; i++) {
		struct fv_scq *c = &s->cq[i];
		if (c->in_use && cached_dead(&pc, c->pid) && fv_lock(&c->lock, 100) == 0) {
			heap_free(c->page, c->npages);
			ADD(&c->gen, 1);
			ST(&c->in_use, 0);
			fv_unlock(&c->lock);
		}
	}
	// An MR with users is being copied by a live executor right now; the
	// slot waits for the next pass.
	for (int i = 0; i < FV_NMR; i++) {
		struct fv_smr *m = &s->mr[i];
		if (m->in_use && LD(&m->users) == 0 && cached_dead(&pc, m->pid)) {
			ST(&m->valid, 0);
			ST(&m->in_use, 0);
		}
	}
}

static void ring_doorbell(int gidx) {
	if (gidx < 0 || gidx >= FV_NDEV)
		return;
	uint32_t *w = &G.shm->dev[gidx].doorbell;
	ADD(w, 1);
	futex_wake(w);
}

// ---------------------------------------------------------------------------
// Process init: devices, their sysfs-like directories, FAKEVERBS_CONTROL

// Removes what make_dirs created under dir (only those files: never a
// recursive delete of something else).
static void remove_tree(const char *dir) {
	char p[PATH_MAX + 128];
	DIR *d = opendir(dir);
	if (d == NULL)
		return;
	for (struct dirent *e; (e = readdir(d)) != NULL;) {
		if (strncmp(e->d_name, "fake", 4) != 0)
			continue;
		snprintf(p, sizeof(p), "%s/%s/device/numa_node", dir, e->d_name);
		unlink(p);
		snprintf(p, sizeof(p), "%s/%s/device/uevent", dir, e->d_name);
		unlink(p);
		snprintf(p, sizeof(p), "%s/%s/device", dir, e->d_name);
		rmdir(p);
		snprintf(p, sizeof(p), "%s/%s", dir, e->d_name);
		rmdir(p);
	}
	closedir(d);
	rmdir(dir);
}

static void remove_dir(void) {
	if (G.dir[0] != 0 && G.dir_pid == getpid())
		remove_tree(G.dir);
}

// Processes that exit without atexit (Go programs do) leave their directory;
// the next process removes those of dead pids.
static void remove_stale_dirs(const char *tmp) {
	DIR *d = opendir(tmp);
	if (d == NULL)
		return;
	char p[PATH_MAX];
	for (struct dirent *e; (e = readdir(d)) != NULL;) {
		const char *pre = "kvferry-fakeverbs-";
		char *end;
		if (strncmp(e->d_name, pre, strlen(pre)) != 0)
			continue;
		long pid = strtol(e->d_name + strlen(pre), &end, 10);
		if (*end || pid <= 0 || pid > INT_MAX || !pid_dead((pid_t)pid))
			continue;
		snprintf(p, sizeof(p), "%s/%s", tmp, e->d_name);
		remove_tree(p);
	}
	closedir(d);
}

static int write_file(const char *path, const char *text) {
	FILE *f = fopen(path, "w");
	if (f == NULL)
		return -1;
	fputs(text, f);
	return fclose(f);
}

static int numa_of(int i) {
	const char *s = getenv("FAKEVERBS_NUMA");
	for (int k = 0; k < i && s; k++) {
		s = strchr(s, ',');
		if (s)
			s++;
	}
	return s && *s ? atoi(s) : 0;
}

// $TMPDIR/kvferry-fakeverbs-<pid>/<name>/device/{numa_node,uevent}, where
// topology code looks for the NUMA node and the PCI address.
static void make_dirs(void) {
	const char *tmp = getenv("TMPDIR");
	// ibdev_path holds 256 bytes: a long TMPDIR falls back to /tmp.
	if (tmp == NULL || *tmp == 0 || strlen(tmp) > 180)
		tmp = "/tmp";
	remove_stale_dirs(tmp);
	snprintf(G.dir, sizeof(G.dir), "%s/kvferry-fakeverbs-%d", tmp, (int)getpid());
	G.dir_pid = getpid();
	mkdir(G.dir, 0700);
	char p[PATH_MAX + 128], text[96];
	for (int i = 0; i < G.ndev; i++) {
		struct fv_device *d = &G.devs[i];
		snprintf(p, sizeof(p), "%s/%s", G.dir, d->ibv.name);
		mkdir(p, 0700);
		size_t n = strlen(p);
		if (n >= sizeof(d->ibv.ibdev_path))
			n = sizeof(d->ibv.ibdev_path) - 1;
		memcpy(d->ibv.ibdev_path, p, n);
		d->ibv.ibdev_path[n] = 0;
		snprintf(p, sizeof(p), "%s/%s/device", G.dir, d->ibv.name);
		mkdir(p, 0700);
		snprintf(p, sizeof(p), "%s/%s/device/numa_node", G.dir, d->ibv.name);
		snprintf(text, sizeof(text), "%d\n", numa_of(i));
		write_file(p, text);
		snprintf(p, sizeof(p), "%s/%s/device/uevent", G.dir, d->ibv.name);
		snprintf(text, sizeof(text), "DRIVER=fakeverbs\nPCI_SLOT_NAME=0000:%02x:00.0\n", 0x10 + i);
		write_file(p, text);
	}
}

static void at_exit(void) { remove_dir(); }

static void atfork_prepare(void) { pthread_mutex_lock(&G.mu); }
static void atfork_parent(void) { pthread_mutex_unlock(&G.mu); }
// The child owns none of the parent's devices, contexts or threads: it
// registers devices of its own on first use (the fabric mapping is kept).
static void atfork_child(void) {
	pthread_mutex_init(&G.mu, NULL);
	G.ready = 0;
	G.ndev = 0;
	G.devs = NULL;
	G.dir[0] = 0;
}

static int proc_init_locked(void) {
	if (G.ready)
		return 0;
	long ndev, chunk, mrsz;
	if (env_int("FAKEVERBS_DEVICES", 2, 0, 16, &ndev) || env_int("FAKEVERBS_CHUNK", 65536, 64, 1 << 30, &chunk) ||
	    env_int("FAKEVERBS_MAX_MR_SIZE", 1l << 30, 4096, LONG_MAX, &mrsz))
		return EINVAL;
	const char *link = getenv("FAKEVERBS_LINK");
	if (link != NULL && *link && strcmp(link, "eth") != 0 && strcmp(link, "ib") != 0) {
		fprintf(stderr, "fakeverbs: FAKEVERBS_LINK=%s: want eth or ib\n", link);
		return EINVAL;
	}
	G.link_ib = link != NULL && strcmp(link, "ib") == 0;
	G.chunk = (uint32_t)chunk;
	G.max_mr_size = (uint64_t)mrsz;
	int rc = fabric_open();
	if (rc)
		return rc;
	struct fv_device *devs = calloc((size_t)ndev + 1, sizeof(*devs));
	if (devs == NULL)
		return ENOMEM;
	struct fv_shm *s = G.shm;
	if ((rc = fv_lock(&s->lock, FV_LOCK_MS)) != 0) {
		free(devs);
		return rc;
	}
	reclaim_locked();
	int got = 0;
	for (int g = 0; g < FV_NDEV && got < ndev; g++) {
		struct fv_sdev *e = &s->dev[g];
		if (e->in_use)
			continue;
		memset(e, 0, sizeof(*e));
		e->pid = getpid();
		e->serial = s->next_serial++;
		e->local_idx = got;
		e->lid = (uint16_t)(g + 1);
		// fe80::00ff:fe<serial>: a link-local GID unique per device incarnation.
		e->gid[0] = 0xfe;
		e->gid[1] = 0x80;
		e->gid[11] = 0xff;
		e->gid[12] = 0xfe;
		e->gid[13] = (uint8_t)(e->serial >> 16);
		e->gid[14] = (uint8_t)(e->serial >> 8);
		e->gid[15] = (uint8_t)e->serial;
		e->fail_status = IBV_WC_RETRY_EXC_ERR;
		ST(&e->in_use, 1);
		struct fv_device *d = &devs[got];
		d->gidx = g;
		d->serial = e->serial;
		d->ibv.node_type = IBV_NODE_CA;
		d->ibv.transport_type = IBV_TRANSPORT_IB;
		snprintf(d->ibv.name, sizeof(d->ibv.name), "fake%d", got);
		snprintf(d->ibv.dev_name, sizeof(d->ibv.dev_name), "uverbs%d", got);
		snprintf(d->ibv.dev_path, sizeof(d->ibv.dev_path), "/sys/class/infiniband_verbs/uverbs%d", got);
		got++;
	}
	fv_unlock(&s->lock);
	if (got < ndev) {
		// Give back what we took: a partial device set would be surprising.
		for (int i = 0; i < got; i++)
			ST(&s->dev[devs[i].gidx].in_use, 0);
		free(devs);
		fprintf(stderr, "fakeverbs: fabric has no room for %ld more devices\n", ndev);
		return ENOMEM;
	}
	G.devs = devs;
	G.ndev = (int)ndev;
	make_dirs();
	if (!G.atexit_set) {
		G.atexit_set = 1;
		atexit(at_exit);
		pthread_atfork(atfork_prepare, atfork_parent, atfork_child);
	}
	G.ready = 1;
	const char *ctl = getenv("FAKEVERBS_CONTROL");
	if (ctl != NULL && *ctl) {
		char *copy = strdup(ctl), *save = NULL;
		for (char *c = copy ? strtok_r(copy, ";", &save) : NULL; c; c = strtok_r(NULL, ";", &save))
			if (control_one(c) != 0)
				fprintf(stderr, "fakeverbs: FAKEVERBS_CONTROL: bad command \"%s\"\n", c);
		free(copy);
	}
	return 0;
}

static int proc_init(void) {
	pthread_mutex_lock(&G.mu);
	int rc = proc_init_locked();
	pthread_mutex_unlock(&G.mu);
	return rc;
}

static struct fv_device *our_device(struct ibv_device *d) {
	for (int i = 0; i < G.ndev; i++)
		if (&G.devs[i].ibv == d)
			return &G.devs[i];
	return NULL;
}

static struct fv_sdev *sdev_of(struct fv_device *d) { return &G.shm->dev[d->gidx]; }

// ---------------------------------------------------------------------------
// Devices

EXPORT struct ibv_device **ibv_get_device_list(int *num) {
	int rc = proc_init();
	if (rc)
		return fail_null(rc);
	struct ibv_device **l = calloc((size_t)G.ndev + 1, sizeof(*l));
	if (l == NULL)
		return fail_null(ENOMEM);
	for (int i = 0; i < G.ndev; i++)
		l[i] = &G.devs[i].ibv;
	if (num)
		*num = G.ndev;
	return l;
}

EXPORT void ibv_free_device_list(struct ibv_device **list) { free(list); }

EXPORT const char *ibv_get_device_name(struct ibv_device *d) {
	if (d == NULL)
		return fail_null(EINVAL);
	return d->name;
}

EXPORT __be64 ibv_get_device_guid(struct ibv_device *d) {
	struct fv_device *fd = our_device(d);
	if (fd == NULL) {
		errno = EINVAL;
		return 0;
	}
	return htobe64(0x020000fffe000000ull | fd->serial);
}

static void *executor(void *arg);
static int fv_post_send(struct ibv_qp *, struct ibv_send_wr *, struct ibv_send_wr **);
static int fv_post_recv(struct ibv_qp *, struct ibv_recv_wr *, struct ibv_recv_wr **);
static int fv_poll_cq(struct ibv_cq *, int, struct ibv_wc *);
static int fv_req_notify_cq(struct ibv_cq *cq, int solicited) {
	(void)cq;
	(void)solicited;
	return 0;
}

EXPORT struct ibv_context *ibv_open_device(struct ibv_device *d) {
	struct fv_device *dev = our_device(d);
	if (dev == NULL)
		return fail_null(EINVAL);
	struct fv_sdev *e = sdev_of(dev);
	struct fv_ctx *c = calloc(1, sizeof(*c));
	if (c == NULL)
		return fail_null(ENOMEM);
	c->dev = dev;
	c->exec_slot = -1;
	for (int i = 0; i < FV_NEXEC; i++) {
		int32_t zero = 0;
		if (__atomic_compare_exchange_n(&e->exec_used[i], &zero, 1, 0, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST)) {
			c->exec_slot = i;
			break;
		}
	}
	if (c->exec_slot < 0) {
		free(c);
		return fail_null(EMFILE);
	}
	c->ibv.device = d;
	c->ibv.cmd_fd = -1;
	c->ibv.async_fd = -1;
	c->ibv.num_comp_vectors = 1;
	c->ibv.abi_compat = NULL;
	pthread_mutex_init(&c->ibv.mutex, NULL);
	c->ibv.ops.post_send = fv_post_send;
	c->ibv.ops.post_recv = fv_post_recv;
	c->ibv.ops.poll_cq = fv_poll_cq;
	c->ibv.ops.req_notify_cq = fv_req_notify_cq;
	// Executors of other processes read and write our memory with
	// process_vm_readv/writev; under Yama ptrace_scope 1 that needs this.
	prctl(PR_SET_PTRACER, PR_SET_PTRACER_ANY, 0, 0, 0);
	// The executor takes no signals: they belong to the application's
	// threads (a Go runtime, for one).
	sigset_t all, old;
	sigfillset(&all);
	pthread_sigmask(SIG_SETMASK, &all, &old);
	int prc = pthread_create(&c->thr, NULL, executor, c);
	pthread_sigmask(SIG_SETMASK, &old, NULL);
	if (prc != 0) {
		ST(&e->exec_used[c->exec_slot], 0);
		free(c);
		return fail_null(EAGAIN);
	}
	c->thr_ok = 1;
	return &c->ibv;
}

static void qp_destroy_slot(int slot);
static void mr_dereg_slot(int slot);

EXPORT int ibv_close_device(struct ibv_context *ctx) {
	if (ctx == NULL)
		return fail(EINVAL);
	struct fv_ctx *c = (struct fv_ctx *)ctx;
	struct fv_sdev *e = sdev_of(c->dev);
	ST(&c->stop, 1);
	ring_doorbell(c->dev->gidx);
	if (c->thr_ok)
		pthread_join(c->thr, NULL);
	// What the application did not destroy goes now, as the kernel does when
	// the uverbs file closes: QPs first (peers then see them gone), then MRs.
	struct fv_shm *s = G.shm;
	uint64_t id = (uintptr_t)ctx;
	pid_t me = getpid();
	for (int i = 0; i < FV_NQP; i++)
		if (LD(&s->qp[i].in_use) == 1 && s->qp[i].pid == me && s->qp[i].ctx == id)
			qp_destroy_slot(i);
	for (int i = 0; i < FV_NMR; i++)
		if (LD(&s->mr[i].in_use) == 1 && s->mr[i].pid == me && s->mr[i].ctx == id)
			mr_dereg_slot(i);
	if (fv_lock(&s->lock, FV_LOCK_MS) == 0) {
		for (int i = 0; i < FV_NCQ; i++) {
			struct fv_scq *q = &s->cq[i];
			if (q->in_use && q->pid == me && q->ctx == id) {
				heap_free(q->page, q->npages);
				ADD(&q->gen, 1);
				ST(&q->in_use, 0);
			}
		}
		fv_unlock(&s->lock);
	}
	e->touch[c->exec_slot][0] = e->touch[c->exec_slot][1] = 0;
	ST(&e->exec_used[c->exec_slot], 0);
	pthread_mutex_destroy(&c->ibv.mutex);
	free(c);
	return 0;
}

EXPORT int ibv_query_device(struct ibv_context *ctx, struct ibv_device_attr *a) {
	if (ctx == NULL || a == NULL)
		return fail(EINVAL);
	struct fv_ctx *c = (struct fv_ctx *)ctx;
	memset(a, 0, sizeof(*a));
	snprintf(a->fw_ver, sizeof(a->fw_ver), "fake");
	a->node_guid = ibv_get_device_guid(ctx->device);
	a->sys_image_guid = a->node_guid;
	a->max_mr_size = G.max_mr_size;
	a->page_size_cap = 0xfffff000u;
	a->vendor_id = 0x1af4; // not a real RDMA vendor
	a->vendor_part_id = (uint32_t)c->dev->gidx;
	a->max_qp = 256;
	a->max_qp_wr = FV_MAX_WR;
	a->max_sge = 1;
	a->max_sge_rd = 1;
	a->max_cq = 256;
	a->max_cqe = FV_MAX_CQE;
	a->max_mr = 65536;
	a->max_pd = 1024;
	a->max_qp_rd_atom = 16;
	a->max_qp_init_rd_atom = 16;
	a->max_res_rd_atom = 256 * 16;
	a->atomic_cap = IBV_ATOMIC_NONE;
	a->max_pkeys = 1;
	a->local_ca_ack_delay = 16;
	a->phys_port_cnt = 1;
	return 0;
}

// The exported symbol takes the compat struct; callers pass a zeroed full
// struct ibv_port_attr (what verbs.h's wrapper does), so we fill all of it.
struct _compat_ibv_port_attr;
EXPORT int ibv_query_port(struct ibv_context *ctx, uint8_t port, struct _compat_ibv_port_attr *out) {
	if (ctx == NULL || out == NULL || port != 1)
		return fail(EINVAL);
	struct fv_ctx *c = (struct fv_ctx *)ctx;
	struct ibv_port_attr *a = (struct ibv_port_attr *)out;
	memset(a, 0, sizeof(*a));
	a->state = IBV_PORT_ACTIVE;
	a->max_mtu = IBV_MTU_4096;
	a->active_mtu = IBV_MTU_4096;
	a->gid_tbl_len = 4;
	a->max_msg_sz = 1u << 31;
	a->pkey_tbl_len = 1;
	a->lid = G.link_ib ? (uint16_t)(c->dev->gidx + 1) : 0;
	a->sm_lid = G.link_ib ? 1 : 0;
	a->max_vl_num = 1;
	a->active_width = 2;
	a->active_speed = 64;
	a->phys_state = 5; // LinkUp
	a->link_layer = G.link_ib ? IBV_LINK_LAYER_INFINIBAND : IBV_LINK_LAYER_ETHERNET;
	return 0;
}

EXPORT int ibv_query_gid(struct ibv_context *ctx, uint8_t port, int index, union ibv_gid *gid) {
	if (ctx == NULL || gid == NULL || port != 1 || index < 0 || index >= 4)
		return fail(EINVAL);
	struct fv_ctx *c = (struct fv_ctx *)ctx;
	memset(gid, 0, sizeof(*gid));
	if (index == 0)
		memcpy(gid->raw, sdev_of(c->dev)->gid, 16);
	return 0;
}

// ---------------------------------------------------------------------------
// PD and MR

EXPORT struct ibv_pd *ibv_alloc_pd(struct ibv_context *ctx) {
	if (ctx == NULL)
		return fail_null(EINVAL);
	struct fv_pd *p = calloc(1, sizeof(*p));
	if (p == NULL)
		return fail_null(ENOMEM);
	p->ibv.context = ctx;
	p->ibv.handle = (uint32_t)(uintptr_t)p;
	return &p->ibv;
}

EXPORT int ibv_dealloc_pd(struct ibv_pd *pd) {
	if (pd == NULL)
		return fail(EINVAL);
	struct fv_pd *p = (struct fv_pd *)pd;
	if (LD(&p->refs) != 0)
		return fail(EBUSY);
	free(p);
	return 0;
}

#define FV_ACCESS_KNOWN                                                                                       \
	(IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ | IBV_ACCESS_REMOTE_ATOMIC | \
	 IBV_ACCESS_MW_BIND | IBV_ACCESS_HUGETLB | IBV_ACCESS_OPTIONAL_RANGE)

static struct ibv_mr *reg(struct ibv_pd *pd, void *addr, size_t len, unsigned access) {
	if (pd == NULL || addr == NULL || len == 0 || len > G.max_mr_size || (access & ~(unsigned)FV_ACCESS_KNOWN) ||
	    ((access & (IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_ATOMIC)) && !(access & IBV_ACCESS_LOCAL_WRITE)) ||
	    (uintptr_t)addr + len < (uintptr_t)addr)
		return fail_null(EINVAL);
	struct fv_ctx *c = (struct fv_ctx *)pd->context;
	struct fv_mr *m = calloc(1, sizeof(*m));
	if (m == NULL)
		return fail_null(ENOMEM);
	struct fv_shm *s = G.shm;
	if (fv_lock(&s->lock, FV_LOCK_MS) != 0) {
		free(m);
		return fail_null(EAGAIN);
	}
	int slot = -1;
	uint32_t key = 0;
	for (int pass = 0; pass < 2 && slot < 0; pass++) {
		if (pass == 1)
			reclaim_locked();
		for (int tries = 0; tries < FV_NMR && slot < 0; tries++) {
			uint32_t ctr = s->next_key++;
			if (ctr == 0 || key_of(ctr) == 0)
				continue;
			if (!s->mr[ctr % FV_NMR].in_use) {
				slot = (int)(ctr % FV_NMR);
				key = key_of(ctr);
			}
		}
	}
	if (slot < 0) {
		fv_unlock(&s->lock);
		free(m);
		return fail_null(ENOMEM);
	}
	struct fv_smr *e = &s->mr[slot];
	ST(&e->valid, 0);
	e->key = key;
	e->access = (int32_t)(access & ~(unsigned)IBV_ACCESS_OPTIONAL_RANGE);
	e->dev = c->dev->gidx;
	e->dev_serial = c->dev->serial;
	e->pid = getpid();
	e->pd = (uintptr_t)pd;
	e->ctx = (uintptr_t)pd->context;
	e->addr = (uintptr_t)addr;
	e->len = len;
	ST(&e->in_use, 1);
	ST(&e->valid, 1);
	fv_unlock(&s->lock);
	ADD(&((struct fv_pd *)pd)->refs, 1);
	m->slot = slot;
	m->ibv.context = pd->context;
	m->ibv.pd = pd;
	m->ibv.addr = addr;
	m->ibv.length = len;
	m->ibv.handle = (uint32_t)slot;
	m->ibv.lkey = m->ibv.rkey = key;
	return &m->ibv;
}

EXPORT struct ibv_mr *ibv_reg_mr(struct ibv_pd *pd, void *addr, size_t len, int access) {
	return reg(pd, addr, len, (unsigned)access);
}

EXPORT struct ibv_mr *ibv_reg_mr_iova2(struct ibv_pd *pd, void *addr, size_t len, uint64_t iova, unsigned int access) {
	if (iova != (uintptr_t)addr)
		return fail_null(EINVAL);
	return reg(pd, addr, len, access);
}

EXPORT struct ibv_mr *ibv_reg_dmabuf_mr(struct ibv_pd *pd, uint64_t offset, size_t len, uint64_t iova, int fd,
                                        int access) {
	(void)pd, (void)offset, (void)len, (void)iova, (void)fd, (void)access;
	return fail_null(EOPNOTSUPP);
}

// Does any live executor touch MR slot right now?
static int touched_by_live(int slot) {
	struct fv_shm *s = G.shm;
	for (int g = 0; g < FV_NDEV; g++) {
		struct fv_sdev *d = &s->dev[g];
		if (!LD(&d->in_use))
			continue;
		for (int x = 0; x < FV_NEXEC; x++)
			for (int k = 0; k < 2; k++)
				if (LD(&d->touch[x][k]) == slot + 1 && !pid_dead(d->pid))
					return 1;
	}
	return 0;
}

// Invalidate, then wait until no chunk copies into or out of the range: after
// this returns no byte moves there (the property kvferry's unregistration
// relies on). Bounded: a toucher that died mid-chunk is detected.
static int mr_wait_unused(int slot) {
	struct fv_smr *e = &G.shm->mr[slot];
	ST(&e->valid, 0);
	uint64_t start = now_ns();
	while (LD(&e->users) > 0) {
		uint64_t waited = now_ns() - start;
		if (waited > 200000000ull && !touched_by_live(slot)) {
			ST(&e->users, 0); // the toucher died holding it
			break;
		}
		if (waited > 60000000000ull)
			return EBUSY; // a live, stopped executor holds it; the MR stays (invalid)
		sleep_us(50);
	}
	return 0;
}

static void mr_dereg_slot(int slot) {
	if (mr_wait_unused(slot) == 0)
		ST(&G.shm->mr[slot].in_use, 0);
}

EXPORT int ibv_dereg_mr(struct ibv_mr *mr) {
	if (mr == NULL)
		return fail(EINVAL);
	struct fv_mr *m = (struct fv_mr *)mr;
	if (m->slot < 0 || m->slot >= FV_NMR)
		return fail(EINVAL);
	struct fv_smr *e = &G.shm->mr[m->slot];
	if (LD(&e->in_use) != 1 || e->key != mr->lkey || e->pid != getpid())
		return fail(EINVAL);
	int rc = mr_wait_unused(m->slot);
	if (rc)
		return fail(rc);
	ST(&e->in_use, 0);
	ADD(&((struct fv_pd *)mr->pd)->refs, -1);
	free(m);
	return 0;
}

// Looks up an MR by key for a post (no pin): owned by this process, same PD.
static struct fv_smr *mr_local(uint32_t key, struct ibv_pd *pd, uint64_t addr, uint64_t len) {
	struct fv_smr *m = &G.shm->mr[ctr_of(key) % FV_NMR];
	if (LD(&m->in_use) != 1 || !LD(&m->valid) || m->key != key || m->pid != getpid() || m->pd != (uintptr_t)pd)
		return NULL;
	if (addr < m->addr || len > m->len || addr - m->addr > m->len - len)
		return NULL;
	return m;
}

// ---------------------------------------------------------------------------
// CQ

static struct fv_scq *cq_check(struct fv_cq *c) {
	if (c == NULL || c->slot < 0 || c->slot >= FV_NCQ)
		return NULL;
	struct fv_scq *q = &G.shm->cq[c->slot];
	if (LD(&q->in_use) != 1 || LD(&q->gen) != c->gen || q->pid != getpid())
		return NULL;
	return q;
}

EXPORT struct ibv_cq *ibv_create_cq(struct ibv_context *ctx, int cqe, void *cq_context,
                                    struct ibv_comp_channel *channel, int comp_vector) {
	(void)comp_vector;
	if (ctx == NULL || cqe < 1 || cqe > FV_MAX_CQE)
		return fail_null(EINVAL);
	if (channel != NULL)
		return fail_null(EOPNOTSUPP); // completion events are not modelled
	struct fv_ctx *c = (struct fv_ctx *)ctx;
	uint32_t cap = 1;
	while (cap < (uint32_t)cqe)
		cap <<= 1;
	struct fv_cq *l = calloc(1, sizeof(*l));
	if (l == NULL)
		return fail_null(ENOMEM);
	struct fv_shm *s = G.shm;
	if (fv_lock(&s->lock, FV_LOCK_MS) != 0) {
		free(l);
		return fail_null(EAGAIN);
	}
	int slot = -1, mine = 0;
	for (int pass = 0; pass < 2 && slot < 0; pass++) {
		if (pass == 1)
			reclaim_locked();
		mine = 0;
		for (int i = 0; i < FV_NCQ; i++) {
			if (s->cq[i].in_use)
				mine += s->cq[i].dev == c->dev->gidx;
			else if (slot < 0)
				slot = i;
		}
	}
	uint32_t npages = (uint32_t)(((uint64_t)cap * sizeof(struct ibv_wc) + FV_PAGE - 1) / FV_PAGE), page = 0;
	if (slot < 0 || mine >= 256 || heap_alloc(npages, &page) != 0) {
		fv_unlock(&s->lock);
		free(l);
		return fail_null(ENOMEM);
	}
	struct fv_scq *q = &s->cq[slot];
	q->pid = getpid();
	q->dev = c->dev->gidx;
	q->ctx = (uintptr_t)ctx;
	q->cap = cap;
	q->page = page;
	q->npages = npages;
	q->overflow = 0;
	q->head = q->tail = 0;
	ST(&q->in_use, 1);
	l->slot = slot;
	l->gen = LD(&q->gen);
	fv_unlock(&s->lock);
	l->ibv.context = ctx;
	l->ibv.cq_context = cq_context;
	l->ibv.handle = (uint32_t)slot;
	l->ibv.cqe = (int)cap;
	pthread_mutex_init(&l->ibv.mutex, NULL);
	pthread_cond_init(&l->ibv.cond, NULL);
	return &l->ibv;
}

EXPORT int ibv_destroy_cq(struct ibv_cq *cq) {
	struct fv_cq *l = (struct fv_cq *)cq;
	struct fv_scq *q = cq_check(l);
	if (q == NULL)
		return fail(EINVAL);
	struct fv_shm *s = G.shm;
	if (fv_lock(&s->lock, FV_LOCK_MS) != 0)
		return fail(EAGAIN);
	for (int i = 0; i < FV_NQP; i++) {
		struct fv_sqp *p = &s->qp[i];
		if (p->in_use && ((p->send_cq == l->slot && p->send_cq_gen == l->gen) ||
		                  (p->recv_cq == l->slot && p->recv_cq_gen == l->gen))) {
			fv_unlock(&s->lock);
			return fail(EBUSY);
		}
	}
	if (fv_lock(&q->lock, FV_LOCK_MS) == 0) {
		heap_free(q->page, q->npages);
		ADD(&q->gen, 1);
		ST(&q->in_use, 0);
		fv_unlock(&q->lock);
	}
	fv_unlock(&s->lock);
	pthread_mutex_destroy(&cq->mutex);
	pthread_cond_destroy(&cq->cond);
	free(l);
	return 0;
}

// Appends a completion; overflow loses it and the next poll reports an error.
static void cq_push(int slot, uint32_t gen, const struct ibv_wc *wc) {
	if (slot < 0 || slot >= FV_NCQ)
		return;
	struct fv_scq *q = &G.shm->cq[slot];
	if (fv_lock(&q->lock, FV_LOCK_MS) != 0)
		return;
	if (q->in_use == 1 && q->gen == gen) {
		if (q->head - q->tail >= q->cap)
			q->overflow = 1;
		else
			cring(q)[q->head++ % q->cap] = *wc;
	}
	fv_unlock(&q->lock);
}

// ---------------------------------------------------------------------------
// QP rings: completion in order, flush

static enum ibv_wc_opcode wc_opcode(int wr_op) {
	switch (wr_op) {
	case IBV_WR_RDMA_READ: return IBV_WC_RDMA_READ;
	case IBV_WR_SEND: return IBV_WC_SEND;
	default: return IBV_WC_RDMA_WRITE;
	}
}

// Reports finished WQEs in post order; QP lock held. Unsignaled successes
// produce no CQE (sq_sig_all=0), errors always do.
static void reap_locked(struct fv_sqp *q) {
	while (q->scq < q->shead) {
		struct fv_wqe *w = &sring(q)[q->scq % q->scap];
		if (!w->done)
			break;
		if (w->status != IBV_WC_SUCCESS || q->sq_sig_all || (w->flags & IBV_SEND_SIGNALED)) {
			struct ibv_wc wc = {0};
			wc.wr_id = w->wr_id;
			wc.status = (enum ibv_wc_status)w->status;
			wc.opcode = wc_opcode(w->opcode);
			wc.byte_len = w->byte_len;
			wc.qp_num = q->qpn;
			cq_push(q->send_cq, q->send_cq_gen, &wc);
		}
		ST(&q->scq, q->scq + 1);
	}
}

static void skip_noexec_locked(struct fv_sqp *q) {
	while (q->sexec < q->shead && sring(q)[q->sexec % q->scap].noexec)
		ST(&q->sexec, q->sexec + 1);
}

static int late_land(int gidx) { return gidx >= 0 && gidx < FV_NDEV && LD(&G.shm->dev[gidx].late_land); }

// Does responder device gidx hold its work (the hang fault): it starts no
// WQE, completes none and lets none be flushed?
static int hung(int gidx) { return gidx >= 0 && gidx < FV_NDEV && LD(&G.shm->dev[gidx].hang); }

// Moves a QP to ERR; QP lock held. Every outstanding send WQE completes with
// FLUSH_ERR now (one being executed stops at its next chunk); those not yet
// started are not executed, except in late-land mode where the executor
// still runs them (bytes land after the initiator saw its QP fail). Posted
// receives complete with FLUSH_ERR. While the responder device hangs, the
// send WQEs stay outstanding, unflushed, until the hang ends (release_hung).
static void qp_err_locked(struct fv_sqp *q) {
	ST(&q->state, IBV_QPS_ERR);
	int late = late_land(q->dev), hold = hung(q->dest_dev);
	for (uint64_t k = q->scq; k < q->shead; k++) {
		struct fv_wqe *w = &sring(q)[k % q->scap];
		if (!w->done && !hold) {
			w->status = IBV_WC_WR_FLUSH_ERR;
			w->byte_len = 0;
			w->done = 1;
		}
		if (!late && k >= q->sexec)
			w->noexec = 1;
	}
	skip_noexec_locked(q);
	reap_locked(q);
	for (; q->rtail < q->rhead; ST(&q->rtail, q->rtail + 1)) {
		struct ibv_wc wc = {0};
		wc.wr_id = rring(q)[q->rtail % q->rcap].wr_id;
		wc.status = IBV_WC_WR_FLUSH_ERR;
		wc.opcode = IBV_WC_RECV;
		wc.qp_num = q->qpn;
		cq_push(q->recv_cq, q->recv_cq_gen, &wc);
	}
}

static struct fv_sqp *qp_by_qpn(uint32_t qpn) {
	if (qpn < FV_QPN_BASE)
		return NULL;
	struct fv_sqp *q = &G.shm->qp[(qpn - FV_QPN_BASE) % FV_NQP];
	if (LD(&q->in_use) != 1 || LD(&q->qpn) != qpn)
		return NULL;
	return q;
}

static struct fv_sqp *qp_check(struct fv_qp *l) {
	if (l == NULL || l->slot < 0 || l->slot >= FV_NQP)
		return NULL;
	struct fv_sqp *q = &G.shm->qp[l->slot];
	if (LD(&q->in_use) != 1 || q->qpn != l->ibv.qp_num || q->pid != getpid())
		return NULL;
	return q;
}

// ---------------------------------------------------------------------------
// QP create, modify, query, destroy

EXPORT struct ibv_qp *ibv_create_qp(struct ibv_pd *pd, struct ibv_qp_init_attr *a) {
	if (pd == NULL || a == NULL || a->qp_type != IBV_QPT_RC || a->srq != NULL || a->send_cq == NULL ||
	    a->recv_cq == NULL || a->cap.max_send_wr > FV_MAX_WR || a->cap.max_recv_wr > FV_MAX_WR ||
	    a->cap.max_send_sge > 1 || a->cap.max_recv_sge > 1 || a->cap.max_inline_data > FV_INLINE)
		return fail_null(EINVAL);
	struct fv_cq *scq = (struct fv_cq *)a->send_cq, *rcq = (struct fv_cq *)a->recv_cq;
	if (cq_check(scq) == NULL || cq_check(rcq) == NULL)
		return fail_null(EINVAL);
	struct fv_ctx *c = (struct fv_ctx *)pd->context;
	struct fv_qp *l = calloc(1, sizeof(*l));
	if (l == NULL)
		return fail_null(ENOMEM);
	struct fv_shm *s = G.shm;
	if (fv_lock(&s->lock, FV_LOCK_MS) != 0) {
		free(l);
		return fail_null(EAGAIN);
	}
	int slot = -1, mine = 0;
	uint32_t ctr = 0;
	for (int pass = 0; pass < 2 && slot < 0; pass++) {
		if (pass == 1)
			reclaim_locked();
		mine = 0;
		for (int i = 0; i < FV_NQP; i++)
			mine += s->qp[i].in_use && s->qp[i].dev == c->dev->gidx;
		for (int tries = 0; tries < FV_NQP && slot < 0; tries++) {
			ctr = s->next_qpn++;
			if (ctr >= 0xffffff - FV_QPN_BASE)
				s->next_qpn = ctr = 0;
			if (!s->qp[ctr % FV_NQP].in_use)
				slot = (int)(ctr % FV_NQP);
		}
	}
	uint32_t sn = (uint32_t)(((uint64_t)a->cap.max_send_wr * sizeof(struct fv_wqe) + FV_PAGE - 1) / FV_PAGE);
	uint32_t rn = (uint32_t)(((uint64_t)a->cap.max_recv_wr * sizeof(struct fv_rwqe) + FV_PAGE - 1) / FV_PAGE);
	uint32_t sp = 0, rp = 0;
	if (slot < 0 || mine >= 256 || heap_alloc(sn, &sp) != 0) {
		fv_unlock(&s->lock);
		free(l);
		return fail_null(ENOMEM);
	}
	if (heap_alloc(rn, &rp) != 0) {
		heap_free(sp, sn);
		fv_unlock(&s->lock);
		free(l);
		return fail_null(ENOMEM);
	}
	struct fv_sqp *q = &s->qp[slot];
	// Keep the locks and the generation; everything else starts from zero.
	size_t keep = offsetof(struct fv_sqp, lock);
	uint32_t gen = q->gen;
	memset(q, 0, keep);
	q->gen = gen + 1;
	q->pid = getpid();
	q->dev = c->dev->gidx;
	q->dev_serial = c->dev->serial;
	q->qpn = FV_QPN_BASE + ctr;
	q->state = IBV_QPS_RESET;
	q->sq_sig_all = a->sq_sig_all != 0;
	q->ctx = (uintptr_t)pd->context;
	q->pd = (uintptr_t)pd;
	q->send_cq = scq->slot;
	q->send_cq_gen = scq->gen;
	q->recv_cq = rcq->slot;
	q->recv_cq_gen = rcq->gen;
	q->dest_dev = -1;
	q->scap = a->cap.max_send_wr;
	q->rcap = a->cap.max_recv_wr;
	q->spage = sp;
	q->snpages = sn;
	q->rpage = rp;
	q->rnpages = rn;
	ST(&q->in_use, 1);
	fv_unlock(&s->lock);
	ADD(&((struct fv_pd *)pd)->refs, 1);
	a->cap.max_send_sge = a->cap.max_recv_sge = 1;
	a->cap.max_inline_data = FV_INLINE;
	l->slot = slot;
	l->ibv.context = pd->context;
	l->ibv.qp_context = a->qp_context;
	l->ibv.pd = pd;
	l->ibv.send_cq = a->send_cq;
	l->ibv.recv_cq = a->recv_cq;
	l->ibv.handle = (uint32_t)slot;
	l->ibv.qp_num = q->qpn;
	l->ibv.state = IBV_QPS_RESET;
	l->ibv.qp_type = IBV_QPT_RC;
	pthread_mutex_init(&l->ibv.mutex, NULL);
	pthread_cond_init(&l->ibv.cond, NULL);
	return &l->ibv;
}

#define A(x) IBV_QP_##x
static const struct {
	int cur, next, req, opt;
} rules[] = {
    {IBV_QPS_RESET, IBV_QPS_INIT, A(STATE) | A(PKEY_INDEX) | A(PORT) | A(ACCESS_FLAGS), 0},
    {IBV_QPS_INIT, IBV_QPS_INIT, 0, A(STATE) | A(PKEY_INDEX) | A(PORT) | A(ACCESS_FLAGS)},
    {IBV_QPS_INIT, IBV_QPS_RTR,
     A(STATE) | A(AV) | A(PATH_MTU) | A(DEST_QPN) | A(RQ_PSN) | A(MAX_DEST_RD_ATOMIC) | A(MIN_RNR_TIMER),
     A(ALT_PATH) | A(ACCESS_FLAGS) | A(PKEY_INDEX)},
    {IBV_QPS_RTR, IBV_QPS_RTS, A(STATE) | A(SQ_PSN) | A(TIMEOUT) | A(RETRY_CNT) | A(RNR_RETRY) | A(MAX_QP_RD_ATOMIC),
     A(CUR_STATE) | A(ACCESS_FLAGS) | A(MIN_RNR_TIMER) | A(ALT_PATH) | A(PATH_MIG_STATE)},
    {IBV_QPS_RTS, IBV_QPS_RTS, 0,
     A(STATE) | A(CUR_STATE) | A(ACCESS_FLAGS) | A(MIN_RNR_TIMER) | A(ALT_PATH) | A(PATH_MIG_STATE)},
};

// Checks mask and values of one transition; resolves the destination device.
static int check_modify(struct fv_sqp *q, int cur, int next, int mask, const struct ibv_qp_attr *a, int *dest,
                        uint32_t *dserial) {
	int req, opt;
	if (next == IBV_QPS_RESET || next == IBV_QPS_ERR) {
		req = A(STATE);
		opt = A(CUR_STATE);
	} else {
		size_t i;
		for (i = 0; i < sizeof(rules) / sizeof(rules[0]); i++)
			if (rules[i].cur == cur && rules[i].next == next)
				break;
		if (i == sizeof(rules) / sizeof(rules[0]))
			return EINVAL;
		req = rules[i].req;
		opt = rules[i].opt;
	}
	if ((mask & req) != req || (mask & ~(req | opt)))
		return EINVAL;
	if ((mask & A(CUR_STATE)) && (int)a->cur_qp_state != cur)
		return EINVAL;
	if ((mask & A(PORT)) && a->port_num != 1)
		return EINVAL;
	if ((mask & A(PKEY_INDEX)) && a->pkey_index != 0)
		return EINVAL;
	if ((mask & A(ACCESS_FLAGS)) &&
	    (a->qp_access_flags & ~(unsigned)(IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ |
	                                      IBV_ACCESS_REMOTE_ATOMIC)))
		return EINVAL;
	if ((mask & A(PATH_MTU)) && (a->path_mtu < IBV_MTU_256 || a->path_mtu > IBV_MTU_4096))
		return EINVAL;
	if ((mask & A(DEST_QPN)) && a->dest_qp_num > 0xffffff)
		return EINVAL;
	if (((mask & A(RQ_PSN)) && a->rq_psn > 0xffffff) || ((mask & A(SQ_PSN)) && a->sq_psn > 0xffffff))
		return EINVAL;
	if (((mask & A(MAX_DEST_RD_ATOMIC)) && a->max_dest_rd_atomic > 16) ||
	    ((mask & A(MAX_QP_RD_ATOMIC)) && a->max_rd_atomic > 16))
		return EINVAL;
	if (((mask & A(TIMEOUT)) && a->timeout > 31) || ((mask & A(RETRY_CNT)) && a->retry_cnt > 7) ||
	    ((mask & A(RNR_RETRY)) && a->rnr_retry > 7) || ((mask & A(MIN_RNR_TIMER)) && a->min_rnr_timer > 31))
		return EINVAL;
	*dest = q->dest_dev;
	*dserial = q->dest_serial;
	if (mask & A(AV)) {
		const struct ibv_ah_attr *ah = &a->ah_attr;
		if (ah->port_num != 1)
			return EINVAL;
		*dest = -1;
		struct fv_shm *s = G.shm;
		if (!G.link_ib) {
			// RoCE: the GID names the peer; only index 0 holds a GID.
			if (!ah->is_global || ah->grh.sgid_index != 0)
				return EINVAL;
			for (int g = 0; g < FV_NDEV && *dest < 0; g++)
				if (LD(&s->dev[g].in_use) && memcmp(s->dev[g].gid, ah->grh.dgid.raw, 16) == 0)
					*dest = g;
			if (*dest < 0)
				return EINVAL;
		} else {
			if (ah->dlid == 0)
				return EINVAL;
			int g = ah->dlid - 1;
			if (g < FV_NDEV && LD(&s->dev[g].in_use))
				*dest = g;
		}
		if (*dest >= 0)
			*dserial = s->dev[*dest].serial;
	}
	return 0;
}

static void apply_modify(struct fv_sqp *q, int next, int mask, const struct ibv_qp_attr *a, int dest, uint32_t ds) {
	if (next == IBV_QPS_ERR) {
		if (q->state != IBV_QPS_ERR)
			qp_err_locked(q);
		return;
	}
	if (next == IBV_QPS_RESET) {
		// Queues are dropped without completions; executors see the new
		// generation and forget work they claimed.
		ADD(&q->gen, 1);
		ST(&q->shead, 0);
		ST(&q->sexec, 0);
		ST(&q->scq, 0);
		ST(&q->rhead, 0);
		ST(&q->rtail, 0);
		q->busy = 0;
		q->rnr_since = 0;
		q->port = q->access = q->pkey_index = q->path_mtu = 0;
		ST(&q->dest_qpn, 0);
		ST(&q->dest_dev, -1);
		ST(&q->state, IBV_QPS_RESET);
		return;
	}
	if (mask & A(PORT))
		q->port = a->port_num;
	if (mask & A(ACCESS_FLAGS))
		q->access = (int32_t)a->qp_access_flags;
	if (mask & A(PKEY_INDEX))
		q->pkey_index = a->pkey_index;
	if (mask & A(PATH_MTU))
		q->path_mtu = a->path_mtu;
	if (mask & A(DEST_QPN))
		ST(&q->dest_qpn, a->dest_qp_num);
	if (mask & A(RQ_PSN))
		q->rq_psn = a->rq_psn;
	if (mask & A(SQ_PSN))
		q->sq_psn = a->sq_psn;
	if (mask & A(MAX_DEST_RD_ATOMIC))
		q->max_dest_rd_atomic = a->max_dest_rd_atomic;
	if (mask & A(MAX_QP_RD_ATOMIC))
		q->max_rd_atomic = a->max_rd_atomic;
	if (mask & A(MIN_RNR_TIMER))
		q->min_rnr_timer = a->min_rnr_timer;
	if (mask & A(TIMEOUT))
		q->timeout = a->timeout;
	if (mask & A(RETRY_CNT))
		q->retry_cnt = a->retry_cnt;
	if (mask & A(RNR_RETRY))
		q->rnr_retry = a->rnr_retry;
	if (mask & A(AV)) {
		q->ah = a->ah_attr;
		ST(&q->dest_dev, dest);
		q->dest_serial = ds;
	}
	ST(&q->state, next);
}

EXPORT int ibv_modify_qp(struct ibv_qp *qp, struct ibv_qp_attr *a, int mask) {
	struct fv_qp *l = (struct fv_qp *)qp;
	struct fv_sqp *q = qp_check(l);
	if (q == NULL || a == NULL)
		return fail(EINVAL);
	// ERR and RESET take the exec lock: once this returns no chunk of a WQE
	// for which this QP is the responder runs any more (the owner's fence).
	int fence = (mask & A(STATE)) && (a->qp_state == IBV_QPS_ERR || a->qp_state == IBV_QPS_RESET);
	if (fence && fv_lock(&q->exec_lock, FV_LOCK_MS) != 0)
		return fail(EAGAIN);
	if (fv_lock(&q->lock, FV_LOCK_MS) != 0) {
		if (fence)
			fv_unlock(&q->exec_lock);
		return fail(EAGAIN);
	}
	int cur = q->state, next = (mask & A(STATE)) ? (int)a->qp_state : cur, dest;
	uint32_t ds;
	int rc = check_modify(q, cur, next, mask, a, &dest, &ds);
	if (rc == 0)
		apply_modify(q, next, mask, a, dest, ds);
	else
		__atomic_add_fetch(&G.rejected_modify, 1, __ATOMIC_RELAXED);
	fv_unlock(&q->lock);
	if (fence)
		fv_unlock(&q->exec_lock);
	if (rc)
		return fail(rc);
	qp->state = (enum ibv_qp_state)next;
	return 0;
}
#undef A

EXPORT int ibv_query_qp(struct ibv_qp *qp, struct ibv_qp_attr *a, int mask, struct ibv_qp_init_attr *init) {
	(void)mask; // everything stored is returned
	struct fv_qp *l = (struct fv_qp *)qp;
	struct fv_sqp *q = qp_check(l);
	if (q == NULL || a == NULL || init == NULL)
		return fail(EINVAL);
	if (fv_lock(&q->lock, FV_LOCK_MS) != 0)
		return fail(EAGAIN);
	memset(a, 0, sizeof(*a));
	memset(init, 0, sizeof(*init));
	a->qp_state = a->cur_qp_state = (enum ibv_qp_state)q->state;
	a->path_mtu = (enum ibv_mtu)q->path_mtu;
	a->qp_access_flags = (unsigned)q->access;
	a->pkey_index = (uint16_t)q->pkey_index;
	a->port_num = (uint8_t)q->port;
	a->dest_qp_num = q->dest_qpn;
	a->rq_psn = q->rq_psn;
	a->sq_psn = q->sq_psn;
	a->ah_attr = q->ah;
	a->timeout = (uint8_t)q->timeout;
	a->retry_cnt = (uint8_t)q->retry_cnt;
	a->rnr_retry = (uint8_t)q->rnr_retry;
	a->min_rnr_timer = (uint8_t)q->min_rnr_timer;
	a->max_rd_atomic = (uint8_t)q->max_rd_atomic;
	a->max_dest_rd_atomic = (uint8_t)q->max_dest_rd_atomic;
	a->cap.max_send_wr = q->scap;
	a->cap.max_recv_wr = q->rcap;
	a->cap.max_send_sge = a->cap.max_recv_sge = 1;
	a->cap.max_inline_data = FV_INLINE;
	init->cap = a->cap;
	init->send_cq = qp->send_cq;
	init->recv_cq = qp->recv_cq;
	init->qp_type = IBV_QPT_RC;
	init->sq_sig_all = q->sq_sig_all;
	init->qp_context = qp->qp_context;
	fv_unlock(&q->lock);
	qp->state = a->qp_state;
	return 0;
}

// Like ERR (with the fence), then the entry is freed.
static void qp_destroy_slot(int slot) {
	struct fv_shm *s = G.shm;
	struct fv_sqp *q = &s->qp[slot];
	int ex = fv_lock(&q->exec_lock, FV_LOCK_MS) == 0;
	if (fv_lock(&q->lock, FV_LOCK_MS) == 0) {
		if (q->state != IBV_QPS_ERR && q->state != IBV_QPS_RESET)
			qp_err_locked(q);
		ST(&q->state, IBV_QPS_ERR);
		ADD(&q->gen, 1);
		ST(&q->in_use, 2);
		fv_unlock(&q->lock);
	}
	if (ex)
		fv_unlock(&q->exec_lock);
	if (fv_lock(&s->lock, FV_LOCK_MS) == 0) {
		qp_free_locked(q);
		fv_unlock(&s->lock);
	}
}

EXPORT int ibv_destroy_qp(struct ibv_qp *qp) {
	struct fv_qp *l = (struct fv_qp *)qp;
	if (qp_check(l) == NULL)
		return fail(EINVAL);
	qp_destroy_slot(l->slot);
	ADD(&((struct fv_pd *)qp->pd)->refs, -1);
	pthread_mutex_destroy(&qp->mutex);
	pthread_cond_destroy(&qp->cond);
	free(l);
	return 0;
}

// ---------------------------------------------------------------------------
// Data path: post_send, post_recv, poll_cq (called through ctx->ops)

static int build_wqe(struct fv_qp *l, const struct ibv_send_wr *wr, struct fv_wqe *w) {
	memset(w, 0, offsetof(struct fv_wqe, data));
	if (wr->opcode != IBV_WR_RDMA_WRITE && wr->opcode != IBV_WR_RDMA_WRITE_WITH_IMM && wr->opcode != IBV_WR_SEND &&
	    wr->opcode != IBV_WR_RDMA_READ)
		return EINVAL;
	if (wr->num_sge < 0 || wr->num_sge > 1 || (wr->num_sge == 1 && wr->sg_list == NULL))
		return EINVAL;
	if (wr->send_flags & ~(unsigned)(IBV_SEND_FENCE | IBV_SEND_SIGNALED | IBV_SEND_SOLICITED | IBV_SEND_INLINE))
		return EINVAL;
	uint32_t len = wr->num_sge ? wr->sg_list[0].length : 0;
	uint64_t addr = wr->num_sge ? wr->sg_list[0].addr : 0;
	if (len > (1u << 31))
		return EINVAL;
	w->wr_id = wr->wr_id;
	w->opcode = (uint8_t)wr->opcode;
	w->flags = wr->send_flags;
	w->len = len;
	w->laddr = addr;
	w->raddr = wr->wr.rdma.remote_addr;
	w->rkey = wr->wr.rdma.rkey;
	w->imm = wr->imm_data;
	w->post_ns = now_ns();
	if (wr->send_flags & IBV_SEND_INLINE) {
		// The data is copied now: the caller may reuse its buffer at once.
		if (wr->opcode == IBV_WR_RDMA_READ || len > FV_INLINE || (len && addr == 0))
			return EINVAL;
		w->inl = 1;
		if (len)
			memcpy(w->data, (const void *)(uintptr_t)addr, len);
	} else if (len) {
		struct fv_smr *m = mr_local(wr->sg_list[0].lkey, l->ibv.pd, addr, len);
		if (m == NULL)
			return EINVAL;
		w->lkey = wr->sg_list[0].lkey;
	}
	return 0;
}

static int fv_post_send(struct ibv_qp *qp, struct ibv_send_wr *wr, struct ibv_send_wr **bad) {
	struct ibv_send_wr *dummy;
	if (bad == NULL)
		bad = &dummy;
	*bad = NULL;
	struct fv_qp *l = (struct fv_qp *)qp;
	struct fv_sqp *q = qp_check(l);
	if (q == NULL) {
		*bad = wr;
		return EINVAL;
	}
	if (fv_lock(&q->lock, FV_LOCK_MS) != 0) {
		*bad = wr;
		return EAGAIN;
	}
	int st = q->state, rc = 0, posted = 0, dest = q->dest_dev;
	if (st != IBV_QPS_RTS && st != IBV_QPS_ERR) {
		rc = EINVAL;
		*bad = wr;
	}
	for (; rc == 0 && wr != NULL; wr = wr->next) {
		struct fv_wqe w;
		uint64_t base = q->scq < q->sexec ? q->scq : q->sexec; // oldest slot still in use
		rc = build_wqe(l, wr, &w);
		if (rc == 0 && q->shead - base >= q->scap)
			rc = ENOMEM;
		if (rc) {
			*bad = wr;
			break;
		}
		if (st == IBV_QPS_ERR) {
			w.status = IBV_WC_WR_FLUSH_ERR;
			w.done = w.noexec = 1;
		}
		size_t n = offsetof(struct fv_wqe, data) + (w.inl ? w.len : 0);
		memcpy(&sring(q)[q->shead % q->scap], &w, n);
		ST(&q->shead, q->shead + 1);
		posted++;
	}
	if (st == IBV_QPS_ERR) {
		skip_noexec_locked(q);
		reap_locked(q);
	}
	fv_unlock(&q->lock);
	if (posted && st == IBV_QPS_RTS)
		ring_doorbell(dest);
	return rc;
}

static int fv_post_recv(struct ibv_qp *qp, struct ibv_recv_wr *wr, struct ibv_recv_wr **bad) {
	struct ibv_recv_wr *dummy;
	if (bad == NULL)
		bad = &dummy;
	*bad = NULL;
	struct fv_qp *l = (struct fv_qp *)qp;
	struct fv_sqp *q = qp_check(l);
	if (q == NULL) {
		*bad = wr;
		return EINVAL;
	}
	if (fv_lock(&q->lock, FV_LOCK_MS) != 0) {
		*bad = wr;
		return EAGAIN;
	}
	int st = q->state, rc = 0;
	if (st == IBV_QPS_RESET) {
		rc = EINVAL;
		*bad = wr;
	}
	for (; rc == 0 && wr != NULL; wr = wr->next) {
		if (wr->num_sge < 0 || wr->num_sge > 1 || (wr->num_sge == 1 && wr->sg_list == NULL)) {
			rc = EINVAL;
		} else {
			struct fv_rwqe r = {wr->wr_id, 0, 0, 0};
			if (wr->num_sge) {
				r.addr = wr->sg_list[0].addr;
				r.len = wr->sg_list[0].length;
				r.lkey = wr->sg_list[0].lkey;
			}
			if (r.len && mr_local(r.lkey, qp->pd, r.addr, r.len) == NULL)
				rc = EINVAL;
			else if (st == IBV_QPS_ERR) {
				struct ibv_wc wc = {0};
				wc.wr_id = r.wr_id;
				wc.status = IBV_WC_WR_FLUSH_ERR;
				wc.opcode = IBV_WC_RECV;
				wc.qp_num = q->qpn;
				cq_push(q->recv_cq, q->recv_cq_gen, &wc);
			} else if (q->rhead - q->rtail >= q->rcap)
				rc = ENOMEM;
			else {
				rring(q)[q->rhead % q->rcap] = r;
				ST(&q->rhead, q->rhead + 1);
			}
		}
		if (rc)
			*bad = wr;
	}
	fv_unlock(&q->lock);
	ring_doorbell(q->dev); // a SEND may be waiting for this receive (RNR)
	return rc;
}

// Is the responder of requester QP q gone: its process dead, its QP in
// ERR/RESET or destroyed? Requester side, for poll_cq.
static int responder_gone(struct fv_sqp *q) {
	struct fv_shm *s = G.shm;
	int g = q->dest_dev;
	if (g < 0 || g >= FV_NDEV || !LD(&s->dev[g].in_use) || s->dev[g].serial != q->dest_serial ||
	    pid_dead(s->dev[g].pid))
		return 1;
	struct fv_sqp *r = qp_by_qpn(q->dest_qpn);
	if (r == NULL || r->dev != g || r->dev_serial != q->dest_serial || r->dest_qpn != q->qpn)
		return 1;
	int st = LD(&r->state);
	return st != IBV_QPS_RTR && st != IBV_QPS_RTS;
}

// A dead responder executes nothing, so the requester notices: the oldest
// outstanding WQE older than max(50 ms, the QP's timeout) whose responder is
// gone completes with RETRY_EXC_ERR, the rest flush.
static void detect_dead_responders(struct fv_cq *l) {
	struct fv_shm *s = G.shm;
	pid_t me = getpid();
	uint64_t now = now_ns();
	for (int i = 0; i < FV_NQP; i++) {
		struct fv_sqp *q = &s->qp[i];
		if (LD(&q->in_use) != 1 || q->pid != me || q->send_cq != l->slot || q->send_cq_gen != l->gen ||
		    LD(&q->scq) >= LD(&q->shead))
			continue;
		if (fv_lock(&q->lock, 5) != 0)
			continue;
		if (q->in_use == 1 && q->scq < q->shead && q->state == IBV_QPS_RTS && !hung(q->dest_dev)) {
			struct fv_wqe *w = &sring(q)[q->scq % q->scap];
			uint64_t limit = (uint64_t)FV_MIN_TIMEOUT_MS * 1000000ull;
			uint64_t t = q->timeout ? 4096ull << q->timeout : 0;
			if (t > limit)
				limit = t;
			if (!w->done && now - w->post_ns > limit && responder_gone(q)) {
				w->status = IBV_WC_RETRY_EXC_ERR;
				w->byte_len = 0;
				w->done = 1;
				if (q->scq == q->sexec) {
					w->noexec = 1;
					ST(&q->sexec, q->sexec + 1);
				} else if (q->busy && pid_dead(q->busy_pid)) {
					q->busy = 0;
				}
				qp_err_locked(q);
			}
		}
		fv_unlock(&q->lock);
	}
}

static int fv_poll_cq(struct ibv_cq *cq, int n, struct ibv_wc *wc) {
	struct fv_cq *l = (struct fv_cq *)cq;
	struct fv_scq *q = cq_check(l);
	if (q == NULL || n < 0 || (n > 0 && wc == NULL)) {
		errno = EINVAL;
		return -1;
	}
	for (int round = 0; round < 2; round++) {
		if (fv_lock(&q->lock, FV_LOCK_MS) != 0)
			return 0;
		if (q->overflow) {
			q->overflow = 0;
			fv_unlock(&q->lock);
			fprintf(stderr, "fakeverbs: CQ %d (capacity %u) overflowed: completions were lost\n", l->slot,
			        q->cap);
			errno = EOVERFLOW;
			return -1;
		}
		int k = 0;
		for (; k < n && q->tail < q->head; k++)
			wc[k] = cring(q)[q->tail++ % q->cap];
		fv_unlock(&q->lock);
		if (k > 0 || n == 0)
			return k;
		// Nothing there: at most every 2 ms, look for dead responders.
		uint64_t now = now_ns();
		if (round == 1 || now - l->last_check < 2000000ull)
			return 0;
		l->last_check = now;
		detect_dead_responders(l);
	}
	return 0;
}

// ---------------------------------------------------------------------------
// Executor: the responder side of the fabric, one thread per context

struct job {
	struct fv_ctx *c;
	struct fv_sdev *me;
	struct fv_sqp *s, *r;
	uint32_t sgen, rgen, sqpn, rqpn;
	pid_t spid;
	int sdev;
	struct fv_wqe w;
	uint64_t idx;
	int32_t *touch; // this executor's two touch slots
};

static void ex_sleep_ms(struct fv_ctx *c, int ms) {
	for (int i = 0; i < ms && !LD(&c->stop); i++)
		sleep_us(1000);
}

// Pins MR `key` for one chunk (users count up) if it is valid, matches the
// owner constraints and covers the range with `need` access. k: touch slot.
static struct fv_smr *pin(struct job *j, int k, uint32_t key, int dev, uint32_t serial, pid_t pid, uint64_t addr,
                          uint64_t len, int need) {
	int slot = (int)(ctr_of(key) % FV_NMR);
	struct fv_smr *m = &G.shm->mr[slot];
	ST(&j->touch[k], slot + 1);
	ADD(&m->users, 1);
	if (LD(&m->in_use) == 1 && LD(&m->valid) && m->key == key && (dev < 0 || (m->dev == dev && m->dev_serial == serial)) &&
	    (pid == 0 || m->pid == pid) && addr >= m->addr && len <= m->len && addr - m->addr <= m->len - len &&
	    (m->access & need) == need)
		return m;
	ADD(&m->users, -1);
	ST(&j->touch[k], 0);
	return NULL;
}

static void unpin(struct job *j, int k, struct fv_smr *m) {
	if (m == NULL)
		return;
	ADD(&m->users, -1);
	ST(&j->touch[k], 0);
}

// Moves bytes between the requester (spid) and this process.
static int xfer(pid_t spid, int into_me, void *mine, uint64_t theirs, size_t n) {
	if (spid == getpid()) {
		if (into_me)
			memcpy(mine, (const void *)(uintptr_t)theirs, n);
		else
			memcpy((void *)(uintptr_t)theirs, mine, n);
		return 0;
	}
	size_t done = 0;
	while (done < n) {
		struct iovec lv = {(char *)mine + done, n - done}, rv = {(void *)(uintptr_t)(theirs + done), n - done};
		ssize_t got = into_me ? process_vm_readv(spid, &lv, 1, &rv, 1, 0) : process_vm_writev(spid, &lv, 1, &rv, 1, 0);
		if (got <= 0)
			return -1;
		done += (size_t)got;
	}
	return 0;
}

static int lock_exec(struct job *j) {
	while (fv_lock(&j->r->exec_lock, 50) != 0)
		if (LD(&j->c->stop))
			return -1;
	return 0;
}

// Is the requester still allowed to have bytes moved? Under the exec lock.
static int requester_ok(struct job *j) {
	int st = LD(&j->s->state);
	return LD(&j->s->gen) == j->sgen && LD(&j->s->in_use) == 1 &&
	       (st == IBV_QPS_RTS || (st == IBV_QPS_ERR && late_land(j->sdev)));
}

static int responder_ok(struct job *j) {
	int st = LD(&j->r->state);
	return LD(&j->r->gen) == j->rgen && LD(&j->r->in_use) == 1 && LD(&j->r->qpn) == j->rqpn &&
	       (st == IBV_QPS_RTR || st == IBV_QPS_RTS);
}

enum { MINE_RKEY, MINE_RECV };

// Copies [0, stop) of the WQE in FAKEVERBS_CHUNK pieces. For each chunk: the
// responder QP's exec lock, both QPs' states, both MRs pinned. mine: address
// in this process (rkey's or the receive buffer's); into_me: WRITE/SEND.
static int move(struct job *j, uint64_t mine, uint32_t mkey, int mkind, uint64_t mlen, int into_me, uint64_t stop,
                int *resp_err) {
	struct fv_wqe *w = &j->w;
	int need = mkind == MINE_RECV ? IBV_ACCESS_LOCAL_WRITE : (into_me ? IBV_ACCESS_REMOTE_WRITE : IBV_ACCESS_REMOTE_READ);
	uint32_t delay = 0;
	for (uint64_t off = 0; off < stop;) {
		uint64_t n = stop - off < G.chunk ? stop - off : G.chunk;
		if (off > 0 && (delay = (uint32_t)LD(&j->me->delay_us)) > 0)
			sleep_us(delay);
		if (lock_exec(j) != 0)
			return IBV_WC_WR_FLUSH_ERR;
		int status = IBV_WC_SUCCESS;
		struct fv_smr *mm = NULL, *tm = NULL;
		if (!responder_ok(j))
			status = IBV_WC_RETRY_EXC_ERR; // fenced: nothing more is acknowledged
		else if (!requester_ok(j))
			status = IBV_WC_WR_FLUSH_ERR;
		else if ((mm = pin(j, 0, mkey, j->c->dev->gidx, j->c->dev->serial, mkind == MINE_RECV ? getpid() : 0, mine,
		                   mlen, need)) == NULL) {
			status = mkind == MINE_RECV ? IBV_WC_REM_OP_ERR : IBV_WC_REM_ACCESS_ERR;
			*resp_err = 1;
		} else if (!w->inl && (tm = pin(j, 1, w->lkey, -1, 0, j->spid, w->laddr, w->len,
		                                into_me ? 0 : IBV_ACCESS_LOCAL_WRITE)) == NULL)
			status = IBV_WC_LOC_PROT_ERR;
		else if (w->inl)
			memcpy((void *)(uintptr_t)(mine + off), w->data + off, n);
		else if (xfer(j->spid, into_me, (void *)(uintptr_t)(mine + off), w->laddr + off, n) != 0)
			status = IBV_WC_LOC_PROT_ERR;
		unpin(j, 1, tm);
		unpin(j, 0, mm);
		fv_unlock(&j->r->exec_lock);
		if (status != IBV_WC_SUCCESS)
			return status;
		off += n;
	}
	return IBV_WC_SUCCESS;
}

// Counts down a fault counter; true when this call made it reach zero.
static int count_down(int32_t *p) {
	int32_t v = LD(p);
	while (v > 0)
		if (__atomic_compare_exchange_n(p, &v, v - 1, 0, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST))
			return v == 1;
	return 0;
}

static void post_recv_cqe(struct job *j, const struct fv_rwqe *rw, int status, uint32_t len, int imm) {
	struct ibv_wc wc = {0};
	wc.wr_id = rw->wr_id;
	wc.status = (enum ibv_wc_status)status;
	wc.opcode = imm ? IBV_WC_RECV_RDMA_WITH_IMM : IBV_WC_RECV;
	wc.byte_len = len;
	wc.qp_num = j->r->qpn;
	wc.src_qp = j->sqpn;
	if (imm) {
		wc.wc_flags = IBV_WC_WITH_IMM;
		wc.imm_data = j->w.imm;
	}
	wc.slid = G.link_ib ? (uint16_t)(j->sdev + 1) : 0;
	cq_push(j->r->recv_cq, j->r->recv_cq_gen, &wc);
}

// Executes one WQE; returns its completion status. *resp_err: the responder
// QP goes to ERR too.
static int run(struct job *j, int rnr_exceeded, uint32_t *byte_len, int *resp_err) {
	struct fv_shm *s = G.shm;
	struct fv_wqe *w = &j->w;
	*byte_len = 0;
	int stall = LD(&j->me->stall_ms);
	if (stall > 0)
		ex_sleep_ms(j->c, stall);
	if (!responder_ok(j))
		return IBV_WC_RETRY_EXC_ERR;
	if (rnr_exceeded)
		return IBV_WC_RNR_RETRY_EXC_ERR;
	struct fv_sdev *sd = &s->dev[j->sdev];
	if (LD(&sd->down) || LD(&j->me->down))
		return IBV_WC_RETRY_EXC_ERR;
	if (count_down(&sd->fail_after))
		return LD(&sd->fail_status);
	uint64_t stop = w->len;
	int partial = count_down(&j->me->partial_after);
	if (partial)
		stop = w->len / 2;
	int need_qp = w->opcode == IBV_WR_RDMA_READ ? IBV_ACCESS_REMOTE_READ
	              : w->opcode == IBV_WR_SEND    ? 0
	                                            : IBV_ACCESS_REMOTE_WRITE;
	if ((LD(&j->r->access) & need_qp) != need_qp) {
		*resp_err = 1;
		return IBV_WC_REM_ACCESS_ERR;
	}
	int status;
	if (w->opcode == IBV_WR_RDMA_READ) {
		status = w->len ? move(j, w->raddr, w->rkey, MINE_RKEY, w->len, 0, stop, resp_err) : IBV_WC_SUCCESS;
	} else if (w->opcode == IBV_WR_RDMA_WRITE) {
		status = w->len ? move(j, w->raddr, w->rkey, MINE_RKEY, w->len, 1, stop, resp_err) : IBV_WC_SUCCESS;
	} else {
		// SEND and WRITE_WITH_IMM consume the responder's next receive.
		struct fv_rwqe rw;
		if (fv_lock(&j->r->lock, FV_LOCK_MS) != 0)
			return IBV_WC_RETRY_EXC_ERR;
		if (!responder_ok(j)) {
			fv_unlock(&j->r->lock);
			return IBV_WC_RETRY_EXC_ERR;
		}
		if (j->r->rtail == j->r->rhead) {
			fv_unlock(&j->r->lock);
			return IBV_WC_RNR_RETRY_EXC_ERR;
		}
		rw = rring(j->r)[j->r->rtail % j->r->rcap];
		ST(&j->r->rtail, j->r->rtail + 1);
		fv_unlock(&j->r->lock);
		int imm = w->opcode == IBV_WR_RDMA_WRITE_WITH_IMM;
		if (imm)
			status = w->len ? move(j, w->raddr, w->rkey, MINE_RKEY, w->len, 1, stop, resp_err) : IBV_WC_SUCCESS;
		else if (w->len > rw.len) {
			status = IBV_WC_REM_INV_REQ_ERR;
			*resp_err = 1;
			post_recv_cqe(j, &rw, IBV_WC_LOC_LEN_ERR, 0, 0);
			return status;
		} else
			status = w->len ? move(j, rw.addr, rw.lkey, MINE_RECV, w->len, 1, stop, resp_err) : IBV_WC_SUCCESS;
		if (partial && status == IBV_WC_SUCCESS)
			status = IBV_WC_RETRY_EXC_ERR;
		post_recv_cqe(j, &rw, status == IBV_WC_SUCCESS ? IBV_WC_SUCCESS
		                       : status == IBV_WC_REM_OP_ERR ? IBV_WC_LOC_PROT_ERR
		                                                     : IBV_WC_WR_FLUSH_ERR,
		              status == IBV_WC_SUCCESS ? w->len : 0, imm);
	}
	if (partial && status == IBV_WC_SUCCESS)
		status = IBV_WC_RETRY_EXC_ERR;
	if (status == IBV_WC_SUCCESS)
		*byte_len = w->len;
	return status;
}

// Claims the oldest unclaimed WQE of requester QP s (if s talks to a QP of
// this device), executes it and completes it. Returns 1 if it did work.
static int exec_one(struct fv_ctx *c, struct fv_sqp *s) {
	struct fv_sdev *me = sdev_of(c->dev);
	struct job j = {.c = c, .me = me, .s = s, .touch = me->touch[c->exec_slot]};
	if (LD(&me->hang))
		return 0; // hang: nothing starts
	if (fv_lock(&s->lock, 2) != 0)
		return 0;
	int ok = s->in_use == 1 && s->dest_dev == c->dev->gidx && s->dest_serial == c->dev->serial;
	if (ok && s->busy) {
		if (s->busy_pid != getpid() && pid_dead(s->busy_pid))
			s->busy = 0;
		else
			ok = 0;
	}
	if (ok) {
		skip_noexec_locked(s);
		ok = s->sexec < s->shead &&
		     (s->state == IBV_QPS_RTS || (s->state == IBV_QPS_ERR && late_land(s->dev)));
	}
	if (!ok) {
		fv_unlock(&s->lock);
		return 0;
	}
	j.idx = s->sexec;
	j.w = sring(s)[j.idx % s->scap];
	j.sgen = s->gen;
	j.sqpn = s->qpn;
	j.spid = s->pid;
	j.sdev = s->dev;
	j.rqpn = s->dest_qpn;
	j.r = qp_by_qpn(j.rqpn);
	j.rgen = j.r ? LD(&j.r->gen) : 0;
	int rnr_exceeded = 0, rst = j.r ? LD(&j.r->state) : IBV_QPS_ERR;
	if (j.r != NULL && (j.r->dev != c->dev->gidx || j.r->dev_serial != c->dev->serial))
		j.r = NULL; // no such QP on this device: executes as "destroyed"
	if (j.r != NULL && rst != IBV_QPS_ERR && (rst == IBV_QPS_RESET || rst == IBV_QPS_INIT || j.r->dest_qpn != s->qpn)) {
		// Not connected (yet) to this requester: packets are dropped and the
		// requester's poll_cq gives up after its timeout.
		fv_unlock(&s->lock);
		return 0;
	}
	if (j.r != NULL && rst != IBV_QPS_ERR && (j.w.opcode == IBV_WR_SEND || j.w.opcode == IBV_WR_RDMA_WRITE_WITH_IMM) &&
	    LD(&j.r->rtail) == LD(&j.r->rhead)) {
		// RNR: wait for a receive without blocking the other QPs.
		uint64_t now = now_ns();
		if (s->rnr_since == 0)
			s->rnr_since = now;
		if (now - s->rnr_since < (uint64_t)FV_RNR_MS * 1000000ull) {
			fv_unlock(&s->lock);
			return 0;
		}
		rnr_exceeded = 1;
	}
	s->rnr_since = 0;
	ST(&s->sexec, s->sexec + 1);
	s->busy = 1;
	s->busy_pid = getpid();
	fv_unlock(&s->lock);

	uint32_t byte_len = 0;
	int resp_err = 0, status;
	if (j.r == NULL) {
		status = IBV_WC_RETRY_EXC_ERR; // no such QP here: nobody acknowledges
	} else {
		status = run(&j, rnr_exceeded, &byte_len, &resp_err);
	}
	__atomic_add_fetch(&G.executed, 1, __ATOMIC_RELAXED);
	if (status != IBV_WC_SUCCESS)
		__atomic_add_fetch(&G.failed, 1, __ATOMIC_RELAXED);

	// The requester's lock can be held by a stopped process; give up only
	// when closing (the QP then stays busy until its owner exits).
	for (int tries = 0; fv_lock(&s->lock, 50) != 0;)
		if (LD(&c->stop) && ++tries > 20)
			return 1;
	if (s->in_use == 1 && s->gen == j.sgen) {
		struct fv_wqe *w = &sring(s)[j.idx % s->scap];
		if (!w->done) {
			w->status = status;
			w->byte_len = byte_len;
			w->done = 1;
		}
		s->busy = 0;
		if (status != IBV_WC_SUCCESS && s->state != IBV_QPS_ERR)
			qp_err_locked(s);
		reap_locked(s);
	}
	fv_unlock(&s->lock);
	if (resp_err && j.r != NULL && fv_lock(&j.r->lock, FV_LOCK_MS) == 0) {
		if (j.r->gen == j.rgen && j.r->state != IBV_QPS_ERR)
			qp_err_locked(j.r);
		fv_unlock(&j.r->lock);
	}
	return 1;
}

static void *executor(void *arg) {
	struct fv_ctx *c = arg;
	struct fv_sdev *me = sdev_of(c->dev);
	struct fv_shm *s = G.shm;
	int g = c->dev->gidx;
	while (!LD(&c->stop)) {
		uint32_t seen = LD(&me->doorbell);
		int did = 0;
		for (int i = 0; i < FV_NQP && !LD(&c->stop); i++) {
			struct fv_sqp *q = &s->qp[i];
			if (LD(&q->in_use) == 1 && LD(&q->dest_dev) == g && LD(&q->sexec) < LD(&q->shead))
				did |= exec_one(c, q);
		}
		if (!did)
			futex_wait_1ms(&me->doorbell, seen);
	}
	return NULL;
}

// ---------------------------------------------------------------------------
// Faults

static int parse_kv(const char *tok, const char *key, long *out) {
	size_t n = strlen(key);
	if (strncmp(tok, key, n) != 0 || tok[n] != '=')
		return 0;
	char *end;
	errno = 0;
	long v = strtol(tok + n + 1, &end, 0);
	if (errno || *end || v < 0 || v > INT32_MAX)
		return -1;
	*out = v;
	return 1;
}

// The hang of responder device g ended: requester QPs that went to ERR
// meanwhile flush the WQEs it held; the executor takes up the others.
static void release_hung(int g) {
	for (int i = 0; i < FV_NQP; i++) {
		struct fv_sqp *q = &G.shm->qp[i];
		if (LD(&q->in_use) != 1 || LD(&q->dest_dev) != g || LD(&q->scq) >= LD(&q->shead))
			continue;
		if (fv_lock(&q->lock, FV_LOCK_MS) != 0)
			continue;
		if (q->in_use == 1 && q->dest_dev == g && q->state == IBV_QPS_ERR)
			qp_err_locked(q);
		fv_unlock(&q->lock);
	}
	ring_doorbell(g);
}

static int control_one(const char *cmd) {
	char buf[256], *save = NULL;
	if (cmd == NULL || strlen(cmd) >= sizeof(buf))
		return -1;
	strcpy(buf, cmd);
	char *verb = strtok_r(buf, " \t\n", &save);
	if (verb == NULL)
		return 0;
	if (strcmp(verb, "stats") == 0) {
		fprintf(stderr, "fakeverbs[%d]: rejected_modify_qp=%lu executed=%lu failed=%lu\n", (int)getpid(),
		        LD(&G.rejected_modify), LD(&G.executed), LD(&G.failed));
		return 0;
	}
	if (strcmp(verb, "reset") == 0) {
		for (int i = 0; i < G.ndev; i++) {
			struct fv_sdev *e = sdev_of(&G.devs[i]);
			ST(&e->down, 0);
			ST(&e->fail_after, 0);
			ST(&e->fail_status, IBV_WC_RETRY_EXC_ERR);
			ST(&e->stall_ms, 0);
			ST(&e->delay_us, 0);
			ST(&e->partial_after, 0);
			ST(&e->late_land, 0);
			if (LD(&e->hang)) {
				ST(&e->hang, 0);
				release_hung(G.devs[i].gidx);
			}
		}
		return 0;
	}
	long after = -1, status = IBV_WC_RETRY_EXC_ERR, ms = -1, us = -1, on = -1, v;
	struct fv_sdev *e = NULL;
	for (char *t = strtok_r(NULL, " \t\n", &save); t; t = strtok_r(NULL, " \t\n", &save)) {
		if (strncmp(t, "dev=", 4) == 0) {
			for (int i = 0; i < G.ndev; i++)
				if (strcmp(G.devs[i].ibv.name, t + 4) == 0)
					e = sdev_of(&G.devs[i]);
			if (e == NULL)
				return -1;
			continue;
		}
		int r = 0;
		if ((r = parse_kv(t, "after", &v)) > 0)
			after = v;
		else if (r == 0 && (r = parse_kv(t, "status", &v)) > 0)
			status = v;
		else if (r == 0 && (r = parse_kv(t, "ms", &v)) > 0)
			ms = v;
		else if (r == 0 && (r = parse_kv(t, "us", &v)) > 0)
			us = v;
		else if (r == 0 && (r = parse_kv(t, "on", &v)) > 0)
			on = v;
		if (r <= 0)
			return -1;
	}
	if (e == NULL)
		return -1;
	if (strcmp(verb, "fail") == 0 && after >= 1 && status >= IBV_WC_LOC_LEN_ERR && status <= IBV_WC_GENERAL_ERR) {
		ST(&e->fail_status, (int32_t)status);
		ST(&e->fail_after, (int32_t)after);
	} else if (strcmp(verb, "down") == 0 && after < 0)
		ST(&e->down, 1);
	else if (strcmp(verb, "up") == 0 && after < 0)
		ST(&e->down, 0);
	else if (strcmp(verb, "stall") == 0 && ms >= 0)
		ST(&e->stall_ms, (int32_t)ms);
	else if (strcmp(verb, "delay") == 0 && us >= 0)
		ST(&e->delay_us, (int32_t)us);
	else if (strcmp(verb, "partial") == 0 && after >= 1)
		ST(&e->partial_after, (int32_t)after);
	else if (strcmp(verb, "late_land") == 0 && (on == 0 || on == 1))
		ST(&e->late_land, (int32_t)on);
	else if (strcmp(verb, "hang") == 0 && (on == 0 || on == 1)) {
		ST(&e->hang, (int32_t)on);
		if (!on)
			release_hung((int)(e - G.shm->dev));
	} else
		return -1;
	return 0;
}

// fakeverbs_control("cmd"): test-only fault injection; see README.md.
// Several commands may be separated by ';'. 0 ok, -1 (errno EINVAL) if any
// command is bad.
EXPORT int fakeverbs_control(const char *cmd) {
	int rc = proc_init();
	if (rc) {
		errno = rc;
		return -1;
	}
	if (cmd == NULL) {
		errno = EINVAL;
		return -1;
	}
	char *copy = strdup(cmd), *save = NULL;
	if (copy == NULL) {
		errno = ENOMEM;
		return -1;
	}
	rc = 0;
	for (char *c = strtok_r(copy, ";", &save); c; c = strtok_r(NULL, ";", &save))
		if (control_one(c) != 0)
			rc = -1;
	free(copy);
	if (rc)
		errno = EINVAL;
	return rc;
}

// ---------------------------------------------------------------------------
// Odds and ends

EXPORT int ibv_fork_init(void) { return 0; }

EXPORT const char *ibv_wc_status_str(enum ibv_wc_status status) {
	static const char *const str[] = {
	    [IBV_WC_SUCCESS] = "success",
	    [IBV_WC_LOC_LEN_ERR] = "local length error",
	    [IBV_WC_LOC_QP_OP_ERR] = "local QP operation error",
	    [IBV_WC_LOC_EEC_OP_ERR] = "local EE context operation error",
	    [IBV_WC_LOC_PROT_ERR] = "local protection error",
	    [IBV_WC_WR_FLUSH_ERR] = "Work Request Flushed Error",
	    [IBV_WC_MW_BIND_ERR] = "memory management operation error",
	    [IBV_WC_BAD_RESP_ERR] = "bad response error",
	    [IBV_WC_LOC_ACCESS_ERR] = "local access error",
	    [IBV_WC_REM_INV_REQ_ERR] = "remote invalid request error",
	    [IBV_WC_REM_ACCESS_ERR] = "remote access error",
	    [IBV_WC_REM_OP_ERR] = "remote operation error",
	    [IBV_WC_RETRY_EXC_ERR] = "transport retry counter exceeded",
	    [IBV_WC_RNR_RETRY_EXC_ERR] = "RNR retry counter exceeded",
	    [IBV_WC_LOC_RDD_VIOL_ERR] = "local RDD violation error",
	    [IBV_WC_REM_INV_RD_REQ_ERR] = "remote invalid RD request",
	    [IBV_WC_REM_ABORT_ERR] = "aborted error",
	    [IBV_WC_INV_EECN_ERR] = "invalid EE context number",
	    [IBV_WC_INV_EEC_STATE_ERR] = "invalid EE context state",
	    [IBV_WC_FATAL_ERR] = "fatal error",
	    [IBV_WC_RESP_TIMEOUT_ERR] = "response timeout error",
	    [IBV_WC_GENERAL_ERR] = "general error",
	    [IBV_WC_TM_ERR] = "TM error",
	    [IBV_WC_TM_RNDV_INCOMPLETE] = "TM software rendezvous",
	};
	if ((unsigned)status >= sizeof(str) / sizeof(str[0]) || str[status] == NULL)
		return "unknown";
	return str[status];
}
