// selftest: loads the fake libibverbs the way kvferry's verbs/ does (dlopen,
// dlvsym at rdma-core's ABI versions, data path through ctx->ops) and checks
// the behaviour kvferry's tests rely on, across two processes. The parent
// (A) drives; the forked child (B) is a peer that answers commands over a
// socketpair. Exit 0 when every check passed; each failure is printed.
//
// usage: selftest [path/to/libibverbs.so.1]
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <infiniband/verbs.h>
#include <poll.h>
#include <signal.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

static struct {
	struct ibv_device **(*get_device_list)(int *);
	void (*free_device_list)(struct ibv_device **);
	const char *(*get_device_name)(struct ibv_device *);
	__be64 (*get_device_guid)(struct ibv_device *);
	struct ibv_context *(*open_device)(struct ibv_device *);
	int (*close_device)(struct ibv_context *);
	int (*query_device)(struct ibv_context *, struct ibv_device_attr *);
	int (*query_port)(struct ibv_context *, uint8_t, struct ibv_port_attr *);
	int (*query_gid)(struct ibv_context *, uint8_t, int, union ibv_gid *);
	struct ibv_pd *(*alloc_pd)(struct ibv_context *);
	int (*dealloc_pd)(struct ibv_pd *);
	struct ibv_mr *(*reg_mr)(struct ibv_pd *, void *, size_t, int);
	struct ibv_mr *(*reg_mr_iova2)(struct ibv_pd *, void *, size_t, uint64_t, unsigned);
	struct ibv_mr *(*reg_dmabuf_mr)(struct ibv_pd *, uint64_t, size_t, uint64_t, int, int);
	int (*dereg_mr)(struct ibv_mr *);
	struct ibv_cq *(*create_cq)(struct ibv_context *, int, void *, struct ibv_comp_channel *, int);
	int (*destroy_cq)(struct ibv_cq *);
	struct ibv_qp *(*create_qp)(struct ibv_pd *, struct ibv_qp_init_attr *);
	int (*modify_qp)(struct ibv_qp *, struct ibv_qp_attr *, int);
	int (*query_qp)(struct ibv_qp *, struct ibv_qp_attr *, int, struct ibv_qp_init_attr *);
	int (*destroy_qp)(struct ibv_qp *);
	const char *(*wc_status_str)(enum ibv_wc_status);
	int (*fork_init)(void);
	int (*control)(const char *);
} V;

static const char *role = "A";
static int failures;

#define CHECK(cond, ...)                                                                                       \
	do {                                                                                                       \
		if (!(cond)) {                                                                                         \
			failures++;                                                                                        \
			fprintf(stderr, "[%s] FAIL line %d: %s: ", role, __LINE__, #cond);                                 \
			fprintf(stderr, __VA_ARGS__);                                                                      \
			fputc('\n', stderr);                                                                               \
		}                                                                                                      \
	} while (0)

static void die(const char *fmt, ...) {
	va_list ap;
	va_start(ap, fmt);
	fprintf(stderr, "[%s] FATAL: ", role);
	vfprintf(stderr, fmt, ap);
	fputc('\n', stderr);
	va_end(ap);
	exit(2);
}

static void *load(void *h, const char *name, const char *ver) {
	void *p = dlvsym(h, name, ver);
	if (p == NULL)
		die("dlvsym(%s, %s): %s", name, ver, dlerror());
	return p;
}

static void resolve(void *h) {
	const char *v = "IBVERBS_1.1";
#define L(f, n) *(void **)&V.f = load(h, n, v)
	L(get_device_list, "ibv_get_device_list");
	L(free_device_list, "ibv_free_device_list");
	L(get_device_name, "ibv_get_device_name");
	L(get_device_guid, "ibv_get_device_guid");
	L(open_device, "ibv_open_device");
	L(close_device, "ibv_close_device");
	L(query_device, "ibv_query_device");
	L(query_port, "ibv_query_port");
	L(query_gid, "ibv_query_gid");
	L(alloc_pd, "ibv_alloc_pd");
	L(dealloc_pd, "ibv_dealloc_pd");
	L(reg_mr, "ibv_reg_mr");
	L(dereg_mr, "ibv_dereg_mr");
	L(create_cq, "ibv_create_cq");
	L(destroy_cq, "ibv_destroy_cq");
	L(create_qp, "ibv_create_qp");
	L(modify_qp, "ibv_modify_qp");
	L(query_qp, "ibv_query_qp");
	L(destroy_qp, "ibv_destroy_qp");
	L(wc_status_str, "ibv_wc_status_str");
	L(fork_init, "ibv_fork_init");
	L(control, "fakeverbs_control");
#undef L
	*(void **)&V.reg_mr_iova2 = load(h, "ibv_reg_mr_iova2", "IBVERBS_1.8");
	*(void **)&V.reg_dmabuf_mr = load(h, "ibv_reg_dmabuf_mr", "IBVERBS_1.12");
}

static uint64_t now_ms(void) {
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (uint64_t)ts.tv_sec * 1000 + (uint64_t)ts.tv_nsec / 1000000;
}

static void sleep_ms(int ms) {
	struct timespec ts = {ms / 1000, (long)(ms % 1000) * 1000000};
	nanosleep(&ts, NULL);
}

static void pattern(uint8_t *p, size_t n, unsigned seed) {
	for (size_t i = 0; i < n; i++)
		p[i] = (uint8_t)((i * 131 + seed * 7919 + (i >> 9)) ^ seed);
}

static size_t pattern_bad(const uint8_t *p, size_t n, unsigned seed) {
	size_t bad = 0;
	for (size_t i = 0; i < n; i++)
		bad += p[i] != (uint8_t)((i * 131 + seed * 7919 + (i >> 9)) ^ seed);
	return bad;
}

static size_t fill_bad(const uint8_t *p, size_t n, int c) {
	size_t bad = 0;
	for (size_t i = 0; i < n; i++)
		bad += p[i] != (uint8_t)c;
	return bad;
}

// ---------------------------------------------------------------------------
// One process's verbs objects

#define BUF (1u << 20)

struct side {
	struct ibv_context *ctx;
	struct ibv_pd *pd;
	struct ibv_cq *scq, *rcq;
	struct ibv_qp *qp;
	uint8_t *buf;
	struct ibv_mr *mr;
	union ibv_gid gid;
};

static void side_open(struct side *s) {
	int n = 0;
	struct ibv_device **l = V.get_device_list(&n);
	if (l == NULL || n < 1)
		die("no device");
	s->ctx = V.open_device(l[0]);
	V.free_device_list(l);
	if (s->ctx == NULL)
		die("open_device: %s", strerror(errno));
	s->pd = V.alloc_pd(s->ctx);
	s->scq = V.create_cq(s->ctx, 256, NULL, NULL, 0);
	s->rcq = V.create_cq(s->ctx, 256, NULL, NULL, 0);
	s->buf = mmap(NULL, BUF, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
	if (!s->pd || !s->scq || !s->rcq || s->buf == MAP_FAILED)
		die("pd/cq/buffer: %s", strerror(errno));
	s->mr = V.reg_mr(s->pd, s->buf, BUF, IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ);
	if (s->mr == NULL)
		die("reg_mr: %s", strerror(errno));
	if (V.query_gid(s->ctx, 1, 0, &s->gid))
		die("query_gid");
}

static struct ibv_qp *make_qp(struct side *s, uint32_t max_send_wr) {
	struct ibv_qp_init_attr a;
	memset(&a, 0, sizeof(a));
	a.send_cq = s->scq;
	a.recv_cq = s->rcq;
	a.qp_type = IBV_QPT_RC;
	a.cap.max_send_wr = max_send_wr;
	a.cap.max_recv_wr = 64;
	a.cap.max_send_sge = a.cap.max_recv_sge = 1;
	a.cap.max_inline_data = 64;
	struct ibv_qp *q = V.create_qp(s->pd, &a);
	if (q == NULL)
		die("create_qp: %s", strerror(errno));
	return q;
}

static void new_qp(struct side *s) {
	if (s->qp)
		V.destroy_qp(s->qp);
	s->qp = make_qp(s, 64);
}

#define INIT_MASK (IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS)
#define RTR_MASK                                                                                          \
	(IBV_QP_STATE | IBV_QP_AV | IBV_QP_PATH_MTU | IBV_QP_DEST_QPN | IBV_QP_RQ_PSN | IBV_QP_MAX_DEST_RD_ATOMIC | \
	 IBV_QP_MIN_RNR_TIMER)
#define RTS_MASK                                                                                              \
	(IBV_QP_STATE | IBV_QP_SQ_PSN | IBV_QP_TIMEOUT | IBV_QP_RETRY_CNT | IBV_QP_RNR_RETRY | IBV_QP_MAX_QP_RD_ATOMIC)

static void attrs(struct ibv_qp_attr *a, enum ibv_qp_state st, uint32_t qpn, const union ibv_gid *gid) {
	memset(a, 0, sizeof(*a));
	a->qp_state = st;
	a->port_num = 1;
	a->qp_access_flags = IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ;
	a->path_mtu = IBV_MTU_4096;
	a->dest_qp_num = qpn;
	a->rq_psn = 1;
	a->sq_psn = 1;
	a->max_dest_rd_atomic = 16;
	a->max_rd_atomic = 16;
	a->min_rnr_timer = 12;
	a->timeout = 14;
	a->retry_cnt = 7;
	a->rnr_retry = 7;
	a->ah_attr.port_num = 1;
	a->ah_attr.is_global = 1;
	if (gid)
		a->ah_attr.grh.dgid = *gid;
	a->ah_attr.grh.hop_limit = 64;
}

static int connect_qp(struct ibv_qp *q, uint32_t qpn, const union ibv_gid *gid) {
	struct ibv_qp_attr a;
	int rc;
	attrs(&a, IBV_QPS_INIT, qpn, gid);
	if ((rc = V.modify_qp(q, &a, INIT_MASK)))
		return rc;
	attrs(&a, IBV_QPS_RTR, qpn, gid);
	if ((rc = V.modify_qp(q, &a, RTR_MASK)))
		return rc;
	attrs(&a, IBV_QPS_RTS, qpn, gid);
	return V.modify_qp(q, &a, RTS_MASK);
}

static int qp_state(struct ibv_qp *q) {
	struct ibv_qp_attr a;
	struct ibv_qp_init_attr i;
	if (V.query_qp(q, &a, IBV_QP_STATE, &i))
		return -1;
	return a.qp_state;
}

static int post(struct ibv_qp *q, enum ibv_wr_opcode op, uint64_t wr_id, void *local, uint32_t len, uint32_t lkey,
                uint64_t raddr, uint32_t rkey, unsigned flags) {
	struct ibv_sge sge = {(uintptr_t)local, len, lkey};
	struct ibv_send_wr wr, *bad = NULL;
	memset(&wr, 0, sizeof(wr));
	wr.wr_id = wr_id;
	wr.opcode = op;
	wr.sg_list = &sge;
	wr.num_sge = len ? 1 : 0;
	wr.send_flags = flags | IBV_SEND_SIGNALED;
	wr.wr.rdma.remote_addr = raddr;
	wr.wr.rdma.rkey = rkey;
	return q->context->ops.post_send(q, &wr, &bad);
}

// Polls one completion through ctx->ops; 0 on timeout.
static int poll1(struct ibv_cq *cq, struct ibv_wc *wc, int ms) {
	uint64_t end = now_ms() + (uint64_t)ms;
	do {
		int n = cq->context->ops.poll_cq(cq, 1, wc);
		if (n == 1)
			return 1;
		if (n < 0)
			return 0;
		sleep_ms(1);
	} while (now_ms() < end);
	return 0;
}

// ---------------------------------------------------------------------------
// A <-> B protocol

enum {
	C_HELLO = 1, C_NEWQP, C_CONNECT, C_FILL, C_CHECK, C_PATTERN, C_CHECKPAT, C_STATE, C_FENCE, C_CONTROL,
	C_POSTRECV, C_POLLRECV, C_WRITE, C_POLLSEND, C_MR2, C_DEREG2, C_EXIT,
};

struct msg {
	int cmd, rc;
	uint32_t a, b, c, d, qpn, rkey;
	uint64_t addr;
	uint8_t gid[16];
	char text[128];
};

static int sock;

static void xsend(const struct msg *m) {
	if (write(sock, m, sizeof(*m)) != (ssize_t)sizeof(*m))
		die("write: %s", strerror(errno));
}

static void xrecv(struct msg *m) {
	struct pollfd p = {sock, POLLIN, 0};
	if (poll(&p, 1, 30000) != 1)
		die("peer did not answer in 30 s");
	ssize_t n = recv(sock, m, sizeof(*m), MSG_WAITALL);
	if (n != (ssize_t)sizeof(*m))
		die("read: %zd %s", n, strerror(errno));
}

static struct msg call(struct msg m) {
	xsend(&m);
	struct msg r;
	xrecv(&r);
	return r;
}

static void peer_loop(void) {
	struct side b = {0};
	struct ibv_mr *mr2 = NULL;
	side_open(&b);
	for (;;) {
		struct msg m, r;
		xrecv(&m);
		memset(&r, 0, sizeof(r));
		r.cmd = m.cmd;
		switch (m.cmd) {
		case C_HELLO:
			r.addr = (uintptr_t)b.buf;
			r.rkey = b.mr->rkey;
			memcpy(r.gid, b.gid.raw, 16);
			break;
		case C_NEWQP:
			new_qp(&b);
			r.qpn = b.qp->qp_num;
			break;
		case C_CONNECT: {
			union ibv_gid g;
			memcpy(g.raw, m.gid, 16);
			r.rc = connect_qp(b.qp, m.qpn, &g);
			break;
		}
		case C_FILL: memset(b.buf + m.a, (int)m.c, m.b); break;
		case C_CHECK: r.a = (uint32_t)fill_bad(b.buf + m.a, m.b, (int)m.c); break;
		case C_PATTERN: pattern(b.buf + m.a, m.b, m.c); break;
		case C_CHECKPAT: r.a = (uint32_t)pattern_bad(b.buf + m.a, m.b, m.c); break;
		case C_STATE: r.a = (uint32_t)qp_state(b.qp); break;
		case C_FENCE: {
			struct ibv_qp_attr a;
			memset(&a, 0, sizeof(a));
			a.qp_state = IBV_QPS_ERR;
			r.rc = V.modify_qp(b.qp, &a, IBV_QP_STATE);
			break;
		}
		case C_CONTROL: r.rc = V.control(m.text); break;
		case C_POSTRECV: {
			struct ibv_sge sge = {(uintptr_t)(b.buf + m.a), m.b, b.mr->lkey};
			struct ibv_recv_wr wr = {.wr_id = m.c, .sg_list = &sge, .num_sge = 1}, *bad;
			r.rc = b.qp->context->ops.post_recv(b.qp, &wr, &bad);
			break;
		}
		case C_POLLRECV: {
			struct ibv_wc wc;
			if (!poll1(b.rcq, &wc, (int)m.a)) {
				r.rc = -1;
				break;
			}
			r.a = wc.status;
			r.b = wc.opcode;
			r.c = wc.byte_len;
			r.d = wc.wc_flags;
			r.rkey = ntohl(wc.imm_data);
			r.addr = wc.wr_id;
			// What arrived before the receive completion: the checks A asks for.
			r.qpn = (uint32_t)pattern_bad(b.buf, 100000, 5) + (uint32_t)pattern_bad(b.buf + 100000, 100000, 6);
			memcpy(r.text, b.buf + 900000, 16); // the receive buffer of C_POSTRECV tests
			break;
			break;
		}
		case C_WRITE:
			pattern(b.buf + m.a, m.b, m.c);
			r.rc = post(b.qp, IBV_WR_RDMA_WRITE, 42, b.buf + m.a, m.b, b.mr->lkey, m.addr, m.rkey, 0);
			break;
		case C_POLLSEND: {
			struct ibv_wc wc;
			r.rc = poll1(b.scq, &wc, (int)m.a) ? 0 : -1;
			r.a = wc.status;
			break;
		}
		case C_MR2: // a second MR over the upper half of the buffer
			mr2 = V.reg_mr(b.pd, b.buf + BUF / 2, BUF / 2, IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE);
			r.rc = mr2 ? 0 : errno;
			r.rkey = mr2 ? mr2->rkey : 0;
			break;
		case C_DEREG2: {
			// After ibv_dereg_mr returns, no byte of the range may change.
			r.rc = V.dereg_mr(mr2);
			uint8_t *snap = malloc(BUF / 2);
			memcpy(snap, b.buf + BUF / 2, BUF / 2);
			sleep_ms(300);
			for (size_t i = 0; i < BUF / 2; i++)
				r.a += snap[i] != b.buf[BUF / 2 + i];
			r.b = (uint32_t)(BUF / 2 - fill_bad(snap, BUF / 2, 0)); // bytes that had landed
			free(snap);
			break;
		}
		case C_EXIT: exit(0);
		default: die("bad command %d", m.cmd);
		}
		xsend(&r);
	}
}

// ---------------------------------------------------------------------------
// Tests (run in A)

static struct side A;
static struct msg Bhello; // B's buffer address, rkey, GID
static pid_t Bpid;

static void test_devices(void) {
	int n = -1;
	struct ibv_device **l = V.get_device_list(&n);
	CHECK(l != NULL && n == 2, "n=%d", n);
	if (l == NULL || n != 2)
		return;
	CHECK(l[2] == NULL, "list not NULL-terminated");
	for (int i = 0; i < 2; i++) {
		char want[16], path[512], text[256];
		snprintf(want, sizeof(want), "fake%d", i);
		CHECK(strcmp(V.get_device_name(l[i]), want) == 0, "name %s", V.get_device_name(l[i]));
		CHECK(l[i]->node_type == IBV_NODE_CA && l[i]->transport_type == IBV_TRANSPORT_IB, "types");
		CHECK(V.get_device_guid(l[i]) != 0, "guid");
		snprintf(path, sizeof(path), "%s/device/numa_node", l[i]->ibdev_path);
		FILE *f = fopen(path, "r");
		CHECK(f != NULL, "%s missing", path);
		if (f) {
			int numa = -1;
			CHECK(fscanf(f, "%d", &numa) == 1 && numa == i, "%s: %d (FAKEVERBS_NUMA=0,1)", path, numa);
			fclose(f);
		}
		snprintf(path, sizeof(path), "%s/device/uevent", l[i]->ibdev_path);
		f = fopen(path, "r");
		CHECK(f != NULL, "%s missing", path);
		if (f) {
			size_t k = fread(text, 1, sizeof(text) - 1, f);
			text[k] = 0;
			fclose(f);
			char line[64];
			snprintf(line, sizeof(line), "PCI_SLOT_NAME=0000:%02x:00.0", 0x10 + i);
			CHECK(strstr(text, line) != NULL, "%s: %s", path, text);
		}
	}
	CHECK(V.get_device_guid(l[0]) != V.get_device_guid(l[1]), "guids equal");
	V.free_device_list(l);

	struct ibv_device_attr da;
	CHECK(V.query_device(A.ctx, &da) == 0, "query_device");
	CHECK(da.max_qp_wr == 4096 && da.max_qp == 256 && da.max_cqe == 65536 && da.max_mr_size == (1ull << 30) &&
	          da.phys_port_cnt == 1 && da.max_qp_rd_atom == 16 && strcmp(da.fw_ver, "fake") == 0,
	      "device attrs");
	struct ibv_port_attr pa;
	memset(&pa, 0, sizeof(pa));
	CHECK(V.query_port(A.ctx, 1, &pa) == 0, "query_port");
	CHECK(pa.state == IBV_PORT_ACTIVE && pa.active_mtu == IBV_MTU_4096 && pa.link_layer == IBV_LINK_LAYER_ETHERNET &&
	          pa.gid_tbl_len == 4 && pa.lid == 0 && pa.max_msg_sz == (1u << 31) && pa.active_width == 2 &&
	          pa.active_speed == 64,
	      "port attrs");
	CHECK(V.query_port(A.ctx, 2, &pa) == EINVAL, "port 2");
	union ibv_gid g;
	CHECK(V.query_gid(A.ctx, 1, 1, &g) == 0 && g.global.interface_id == 0 && g.global.subnet_prefix == 0, "gid 1");
	CHECK(V.query_gid(A.ctx, 1, 4, &g) == EINVAL && V.query_gid(A.ctx, 2, 0, &g) == EINVAL, "gid range");
	CHECK(A.gid.global.interface_id != 0, "gid 0 zero");
	CHECK(memcmp(A.gid.raw, Bhello.gid, 16) != 0, "A and B share a GID");

	errno = 0;
	CHECK(V.reg_dmabuf_mr(A.pd, 0, 4096, 0, 3, IBV_ACCESS_LOCAL_WRITE) == NULL && errno == EOPNOTSUPP, "dmabuf");
	errno = 0;
	CHECK(V.reg_mr_iova2(A.pd, A.buf, 4096, (uintptr_t)A.buf + 4096, IBV_ACCESS_LOCAL_WRITE) == NULL && errno == EINVAL,
	      "iova2 with iova != addr");
	struct ibv_mr *m =
	    V.reg_mr_iova2(A.pd, A.buf, 4096, (uintptr_t)A.buf, IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_RELAXED_ORDERING);
	CHECK(m != NULL && m->lkey != 0 && m->lkey != A.mr->lkey, "iova2");
	if (m)
		CHECK(V.dereg_mr(m) == 0, "dereg");
	CHECK(V.reg_mr(A.pd, A.buf, 4096, IBV_ACCESS_REMOTE_WRITE) == NULL, "REMOTE_WRITE without LOCAL_WRITE");
	CHECK(V.control("bogus dev=fake0") == -1 && V.control("stall dev=fake9 ms=1") == -1 &&
	          V.control("stall dev=fake0 ms=x") == -1 && V.control("stall dev=fake0 ms=0") == 0,
	      "control parsing");
	CHECK(V.fork_init() == 0, "fork_init");
	CHECK(strcmp(V.wc_status_str(IBV_WC_REM_ACCESS_ERR), "remote access error") == 0, "status str");
}

static void test_masks(void) {
	struct ibv_qp *q = make_qp(&A, 16), *peer = make_qp(&A, 16);
	struct ibv_qp_attr a;
	struct {
		enum ibv_qp_state st;
		int mask, extra;
	} steps[] = {
	    {IBV_QPS_INIT, INIT_MASK, IBV_QP_AV},
	    {IBV_QPS_RTR, RTR_MASK, IBV_QP_SQ_PSN},
	    {IBV_QPS_RTS, RTS_MASK, IBV_QP_DEST_QPN},
	};
	int prev = IBV_QPS_RESET, rejected = 0;
	for (int s = 0; s < 3; s++) {
		attrs(&a, steps[s].st, peer->qp_num, &A.gid);
		for (int bit = 0; bit < 31; bit++) {
			if (!(steps[s].mask & (1 << bit)))
				continue;
			int rc = V.modify_qp(q, &a, steps[s].mask & ~(1 << bit));
			CHECK(rc == EINVAL, "to state %d without mask bit 0x%x: rc %d", steps[s].st, 1 << bit, rc);
			rejected += rc == EINVAL;
		}
		int rc = V.modify_qp(q, &a, steps[s].mask | steps[s].extra);
		CHECK(rc == EINVAL, "to state %d with extra bit 0x%x: rc %d", steps[s].st, steps[s].extra, rc);
		CHECK(qp_state(q) == prev, "state changed by a rejected modify: %d", qp_state(q));
		if (steps[s].st == IBV_QPS_RTR) {
			a.ah_attr.is_global = 0;
			CHECK(V.modify_qp(q, &a, steps[s].mask) == EINVAL, "RoCE without GRH accepted");
			a.ah_attr.is_global = 1;
			a.ah_attr.grh.dgid.raw[15] ^= 0xff;
			CHECK(V.modify_qp(q, &a, steps[s].mask) == EINVAL, "unknown dgid accepted");
			a.ah_attr.grh.dgid = A.gid;
		}
		CHECK(V.modify_qp(q, &a, steps[s].mask) == 0, "to state %d", steps[s].st);
		prev = steps[s].st;
	}
	CHECK(qp_state(q) == IBV_QPS_RTS && q->state == IBV_QPS_RTS, "RTS");
	// RESET -> RTS directly, INIT with a bad port, ERR -> INIT.
	struct ibv_qp *r = make_qp(&A, 16);
	attrs(&a, IBV_QPS_RTS, 0x100, &A.gid);
	CHECK(V.modify_qp(r, &a, RTS_MASK) == EINVAL, "RESET->RTS");
	attrs(&a, IBV_QPS_INIT, 0, NULL);
	a.port_num = 2;
	CHECK(V.modify_qp(r, &a, INIT_MASK) == EINVAL, "port 2");
	attrs(&a, IBV_QPS_ERR, 0, NULL);
	a.cur_qp_state = IBV_QPS_INIT;
	CHECK(V.modify_qp(r, &a, IBV_QP_STATE | IBV_QP_CUR_STATE) == EINVAL, "wrong CUR_STATE");
	CHECK(V.modify_qp(r, &a, IBV_QP_STATE) == 0 && qp_state(r) == IBV_QPS_ERR, "to ERR");
	attrs(&a, IBV_QPS_INIT, 0, NULL);
	CHECK(V.modify_qp(r, &a, INIT_MASK) == EINVAL, "ERR->INIT");
	attrs(&a, IBV_QPS_RESET, 0, NULL);
	CHECK(V.modify_qp(r, &a, IBV_QP_STATE) == 0, "ERR->RESET");
	attrs(&a, IBV_QPS_INIT, 0, NULL);
	CHECK(V.modify_qp(r, &a, INIT_MASK) == 0, "RESET->INIT after ERR");
	// Create-time checks.
	struct ibv_qp_init_attr ia;
	memset(&ia, 0, sizeof(ia));
	ia.send_cq = ia.recv_cq = A.scq;
	ia.qp_type = IBV_QPT_UD;
	ia.cap.max_send_wr = 1;
	errno = 0;
	CHECK(V.create_qp(A.pd, &ia) == NULL && errno == EINVAL, "UD QP");
	ia.qp_type = IBV_QPT_RC;
	ia.cap.max_send_wr = 4097;
	CHECK(V.create_qp(A.pd, &ia) == NULL, "max_send_wr 4097");
	ia.cap.max_send_wr = 1;
	ia.cap.max_inline_data = 65;
	CHECK(V.create_qp(A.pd, &ia) == NULL, "max_inline 65");
	CHECK(V.modify_qp(NULL, &a, INIT_MASK) == EINVAL && V.destroy_qp(NULL) == EINVAL, "NULL args");
	V.destroy_qp(q);
	V.destroy_qp(peer);
	V.destroy_qp(r);
	(void)rejected;
}

// Two QPs of A connected to each other: same-process path, ring full.
static void test_loopback(void) {
	struct ibv_qp *x = make_qp(&A, 2), *y = make_qp(&A, 2);
	CHECK(connect_qp(x, y->qp_num, &A.gid) == 0 && connect_qp(y, x->qp_num, &A.gid) == 0, "connect");
	pattern(A.buf, 200000, 11);
	memset(A.buf + 300000, 0, 200000);
	struct ibv_wc wc;
	CHECK(post(x, IBV_WR_RDMA_WRITE, 1, A.buf, 200000, A.mr->lkey, (uintptr_t)A.buf + 300000, A.mr->rkey, 0) == 0,
	      "post");
	CHECK(poll1(A.scq, &wc, 5000) && wc.status == IBV_WC_SUCCESS && wc.wr_id == 1, "loopback write: %s",
	      V.wc_status_str(wc.status));
	CHECK(pattern_bad(A.buf + 300000, 200000, 11) == 0, "loopback data");
	// Ring of 2 with a stalled responder: the third WR of a chain is refused.
	CHECK(V.control("stall dev=fake0 ms=150") == 0, "stall");
	struct ibv_sge sge[3];
	struct ibv_send_wr wr[3], *bad = NULL;
	memset(wr, 0, sizeof(wr));
	for (int i = 0; i < 3; i++) {
		sge[i] = (struct ibv_sge){(uintptr_t)A.buf, 64, A.mr->lkey};
		wr[i].wr_id = 10 + (uint64_t)i;
		wr[i].opcode = IBV_WR_RDMA_WRITE;
		wr[i].sg_list = &sge[i];
		wr[i].num_sge = 1;
		wr[i].send_flags = IBV_SEND_SIGNALED;
		wr[i].wr.rdma.remote_addr = (uintptr_t)A.buf + 600000 + 64 * (uint64_t)i;
		wr[i].wr.rdma.rkey = A.mr->rkey;
		wr[i].next = i < 2 ? &wr[i + 1] : NULL;
	}
	int rc = x->context->ops.post_send(x, wr, &bad);
	CHECK(rc == ENOMEM && bad == &wr[2], "ring full: rc %d bad %p", rc, (void *)bad);
	for (int i = 0; i < 2; i++)
		CHECK(poll1(A.scq, &wc, 5000) && wc.status == IBV_WC_SUCCESS && wc.wr_id == 10 + (uint64_t)i, "wr %d", i);
	V.control("reset");
	// An unsignaled success leaves no CQE; a signaled one after it does.
	struct ibv_sge s1 = {(uintptr_t)A.buf, 8, A.mr->lkey};
	struct ibv_send_wr u = {.wr_id = 20, .sg_list = &s1, .num_sge = 1, .opcode = IBV_WR_RDMA_WRITE};
	u.wr.rdma.remote_addr = (uintptr_t)A.buf + 700000;
	u.wr.rdma.rkey = A.mr->rkey;
	CHECK(x->context->ops.post_send(x, &u, &bad) == 0, "unsignaled post");
	CHECK(post(x, IBV_WR_RDMA_WRITE, 21, A.buf, 8, A.mr->lkey, (uintptr_t)A.buf + 700008, A.mr->rkey, 0) == 0, "post");
	CHECK(poll1(A.scq, &wc, 5000) && wc.wr_id == 21, "only the signaled WR completes (got %llu)",
	      (unsigned long long)wc.wr_id);
	// A bad lkey is refused at post.
	CHECK(post(x, IBV_WR_RDMA_WRITE, 22, A.buf, 8, A.mr->lkey ^ 0x77, (uintptr_t)A.buf, A.mr->rkey, 0) == EINVAL,
	      "bad lkey posted");
	V.destroy_qp(x);
	V.destroy_qp(y);
}

// A fresh QP pair A<->B.
static void pair(void) {
	new_qp(&A);
	struct msg m = {.cmd = C_NEWQP};
	struct msg r = call(m);
	union ibv_gid bg;
	memcpy(bg.raw, Bhello.gid, 16);
	CHECK(connect_qp(A.qp, r.qpn, &bg) == 0, "connect A");
	m = (struct msg){.cmd = C_CONNECT, .qpn = A.qp->qp_num};
	memcpy(m.gid, A.gid.raw, 16);
	CHECK(call(m).rc == 0, "connect B");
}

static uint32_t b_check(uint32_t cmd, uint32_t off, uint32_t len, uint32_t v) {
	return call((struct msg){.cmd = (int)cmd, .a = off, .b = len, .c = v}).a;
}

static void b_do(uint32_t cmd, uint32_t off, uint32_t len, uint32_t v) {
	call((struct msg){.cmd = (int)cmd, .a = off, .b = len, .c = v});
}

static int b_control(const char *text) {
	struct msg m = {.cmd = C_CONTROL};
	snprintf(m.text, sizeof(m.text), "%s", text);
	return call(m).rc;
}

static void test_write_read(void) {
	pair();
	struct ibv_wc wc;
	pattern(A.buf, 300000, 1);
	b_do(C_FILL, 0, 300000, 0);
	CHECK(post(A.qp, IBV_WR_RDMA_WRITE, 1, A.buf, 300000, A.mr->lkey, Bhello.addr, Bhello.rkey, 0) == 0, "post");
	CHECK(poll1(A.scq, &wc, 5000) && wc.status == IBV_WC_SUCCESS && wc.opcode == IBV_WC_RDMA_WRITE && wc.wr_id == 1 &&
	          wc.qp_num == A.qp->qp_num,
	      "write: %s", V.wc_status_str(wc.status));
	CHECK(b_check(C_CHECKPAT, 0, 300000, 1) == 0, "written data differs");
	b_do(C_PATTERN, 512 * 1024, 200000, 2);
	memset(A.buf + 400000, 0, 200000);
	CHECK(post(A.qp, IBV_WR_RDMA_READ, 2, A.buf + 400000, 200000, A.mr->lkey, Bhello.addr + 512 * 1024, Bhello.rkey,
	           0) == 0,
	      "post read");
	CHECK(poll1(A.scq, &wc, 5000) && wc.status == IBV_WC_SUCCESS && wc.opcode == IBV_WC_RDMA_READ &&
	          wc.byte_len == 200000,
	      "read: %s", V.wc_status_str(wc.status));
	CHECK(pattern_bad(A.buf + 400000, 200000, 2) == 0, "read data differs");
}

static void test_remote_access(void) {
	struct ibv_wc wc;
	// Bad rkey first, two good WRITEs behind it: error, then flushes.
	pair();
	b_do(C_FILL, 0, 8192, 0x5a);
	pattern(A.buf, 8192, 3);
	CHECK(post(A.qp, IBV_WR_RDMA_WRITE, 1, A.buf, 4096, A.mr->lkey, Bhello.addr, Bhello.rkey ^ 0x5a5a5a5a, 0) == 0 &&
	          post(A.qp, IBV_WR_RDMA_WRITE, 2, A.buf, 4096, A.mr->lkey, Bhello.addr, Bhello.rkey, 0) == 0 &&
	          post(A.qp, IBV_WR_RDMA_WRITE, 3, A.buf + 4096, 4096, A.mr->lkey, Bhello.addr + 4096, Bhello.rkey, 0) == 0,
	      "post");
	CHECK(poll1(A.scq, &wc, 5000) && wc.wr_id == 1 && wc.status == IBV_WC_REM_ACCESS_ERR, "bad rkey: %s",
	      V.wc_status_str(wc.status));
	for (uint64_t id = 2; id <= 3; id++)
		CHECK(poll1(A.scq, &wc, 5000) && wc.wr_id == id && wc.status == IBV_WC_WR_FLUSH_ERR, "wr %llu: %s",
		      (unsigned long long)id, V.wc_status_str(wc.status));
	CHECK(b_check(C_CHECK, 0, 8192, 0x5a) == 0, "flushed WRs moved data");
	CHECK(qp_state(A.qp) == IBV_QPS_ERR, "requester not in ERR");
	CHECK(call((struct msg){.cmd = C_STATE}).a == IBV_QPS_ERR, "responder not in ERR");
	CHECK(post(A.qp, IBV_WR_RDMA_WRITE, 4, A.buf, 64, A.mr->lkey, Bhello.addr, Bhello.rkey, 0) == 0, "post on ERR QP");
	CHECK(poll1(A.scq, &wc, 5000) && wc.wr_id == 4 && wc.status == IBV_WC_WR_FLUSH_ERR, "post on ERR: %s",
	      V.wc_status_str(wc.status));
	// Out of range.
	pair();
	CHECK(post(A.qp, IBV_WR_RDMA_WRITE, 5, A.buf, 4096, A.mr->lkey, Bhello.addr + BUF - 100, Bhello.rkey, 0) == 0,
	      "post");
	CHECK(poll1(A.scq, &wc, 5000) && wc.wr_id == 5 && wc.status == IBV_WC_REM_ACCESS_ERR, "out of range: %s",
	      V.wc_status_str(wc.status));
}

static void test_fence(void) {
	pair();
	struct ibv_wc wc;
	b_do(C_FILL, 0, 131072, 0);
	CHECK(b_control("stall dev=fake0 ms=400") == 0, "stall");
	pattern(A.buf, 131072, 7);
	CHECK(post(A.qp, IBV_WR_RDMA_WRITE, 1, A.buf, 131072, A.mr->lkey, Bhello.addr, Bhello.rkey, 0) == 0, "post");
	sleep_ms(100); // B's executor has claimed the WRITE and is stalled
	CHECK(call((struct msg){.cmd = C_FENCE}).rc == 0, "fence");
	sleep_ms(600);
	CHECK(b_check(C_CHECK, 0, 131072, 0) == 0, "bytes landed after the owner's fence");
	CHECK(poll1(A.scq, &wc, 3000) && wc.status == IBV_WC_RETRY_EXC_ERR, "requester got %s",
	      V.wc_status_str(wc.status));
	CHECK(qp_state(A.qp) == IBV_QPS_ERR, "requester not in ERR");
	b_control("reset");
}

static char proc_state(pid_t pid) {
	char path[64], buf[512];
	snprintf(path, sizeof(path), "/proc/%d/stat", (int)pid);
	FILE *f = fopen(path, "r");
	if (!f)
		return '?';
	size_t n = fread(buf, 1, sizeof(buf) - 1, f);
	fclose(f);
	buf[n] = 0;
	char *p = strrchr(buf, ')');
	return p && p[1] ? p[2] : '?';
}

// B posts a WRITE into A's memory and is stopped; A's executor still lands it.
static void test_sigstop(void) {
	pair();
	memset(A.buf, 0, 262144);
	CHECK(V.control("stall dev=fake0 ms=200") == 0, "stall");
	struct msg m = {.cmd = C_WRITE, .a = 0, .b = 262144, .c = 9, .addr = (uintptr_t)A.buf, .rkey = A.mr->rkey};
	CHECK(call(m).rc == 0, "B post");
	kill(Bpid, SIGSTOP);
	int st;
	CHECK(waitpid(Bpid, &st, WUNTRACED) == Bpid && WIFSTOPPED(st), "B not stopped");
	uint64_t end = now_ms() + 3000;
	while (pattern_bad(A.buf, 262144, 9) != 0 && now_ms() < end)
		sleep_ms(5);
	CHECK(pattern_bad(A.buf, 262144, 9) == 0, "WRITE of a stopped requester did not land");
	CHECK(proc_state(Bpid) == 'T', "B ran meanwhile (state %c)", proc_state(Bpid));
	kill(Bpid, SIGCONT);
	V.control("reset");
	struct msg r = call((struct msg){.cmd = C_POLLSEND, .a = 3000});
	CHECK(r.rc == 0 && r.a == IBV_WC_SUCCESS, "B's completion: rc %d %s", r.rc, V.wc_status_str(r.a));
}

static void test_send(void) {
	pair();
	struct ibv_wc wc;
	b_do(C_FILL, 0, 200000, 0);
	CHECK(call((struct msg){.cmd = C_POSTRECV, .a = 900000, .b = 256, .c = 77}).rc == 0, "post recv");
	pattern(A.buf, 100000, 5);
	pattern(A.buf + 100000, 100000, 6);
	char note[16] = "kvferry-notify!";
	CHECK(post(A.qp, IBV_WR_RDMA_WRITE, 1, A.buf, 100000, A.mr->lkey, Bhello.addr, Bhello.rkey, 0) == 0 &&
	          post(A.qp, IBV_WR_RDMA_WRITE, 2, A.buf + 100000, 100000, A.mr->lkey, Bhello.addr + 100000, Bhello.rkey,
	               0) == 0 &&
	          post(A.qp, IBV_WR_SEND, 3, note, 16, 0, 0, 0, IBV_SEND_INLINE) == 0,
	      "post");
	memset(note, 0, sizeof(note)); // inline: copied at post
	struct msg r = call((struct msg){.cmd = C_POLLRECV, .a = 5000});
	CHECK(r.rc == 0 && r.a == IBV_WC_SUCCESS && r.b == IBV_WC_RECV && r.c == 16 && r.addr == 77,
	      "recv: rc %d status %u opcode %u len %u", r.rc, r.a, r.b, r.c);
	CHECK(r.qpn == 0, "SEND arrived before the WRITEs' data (%u bytes differ)", r.qpn);
	CHECK(memcmp(r.text, "kvferry-notify!", 16) == 0, "SEND payload: %.16s", r.text);
	for (uint64_t id = 1; id <= 3; id++)
		CHECK(poll1(A.scq, &wc, 5000) && wc.wr_id == id && wc.status == IBV_WC_SUCCESS &&
		          wc.opcode == (id == 3 ? IBV_WC_SEND : IBV_WC_RDMA_WRITE),
		      "wr %llu: %s", (unsigned long long)id, V.wc_status_str(wc.status));
	// WRITE_WITH_IMM consumes a receive and carries the immediate.
	CHECK(call((struct msg){.cmd = C_POSTRECV, .a = 900000, .b = 256, .c = 78}).rc == 0, "post recv");
	struct ibv_sge sge = {(uintptr_t)A.buf, 4096, A.mr->lkey};
	struct ibv_send_wr w = {.wr_id = 4, .sg_list = &sge, .num_sge = 1, .opcode = IBV_WR_RDMA_WRITE_WITH_IMM,
	                        .send_flags = IBV_SEND_SIGNALED, .imm_data = htonl(0x12345678)},
	                   *bad;
	w.wr.rdma.remote_addr = Bhello.addr + 4096;
	w.wr.rdma.rkey = Bhello.rkey;
	CHECK(A.qp->context->ops.post_send(A.qp, &w, &bad) == 0, "post imm");
	r = call((struct msg){.cmd = C_POLLRECV, .a = 5000});
	CHECK(r.rc == 0 && r.a == IBV_WC_SUCCESS && r.b == IBV_WC_RECV_RDMA_WITH_IMM && (r.d & IBV_WC_WITH_IMM) &&
	          r.rkey == 0x12345678 && r.c == 4096 && r.addr == 78,
	      "imm recv: status %u opcode %u flags %u imm %x", r.a, r.b, r.d, r.rkey);
	CHECK(poll1(A.scq, &wc, 5000) && wc.wr_id == 4 && wc.status == IBV_WC_SUCCESS, "imm: %s",
	      V.wc_status_str(wc.status));
	// No receive posted: RNR after about 100 ms.
	uint64_t t0 = now_ms();
	CHECK(post(A.qp, IBV_WR_SEND, 5, A.buf, 8, A.mr->lkey, 0, 0, 0) == 0, "post send");
	CHECK(poll1(A.scq, &wc, 3000) && wc.wr_id == 5 && wc.status == IBV_WC_RNR_RETRY_EXC_ERR, "rnr: %s",
	      V.wc_status_str(wc.status));
	CHECK(now_ms() - t0 >= 90, "RNR after %llu ms", (unsigned long long)(now_ms() - t0));
}

// Fault injection: fail after N, partial placement.
static void test_faults(void) {
	struct ibv_wc wc;
	pair();
	CHECK(V.control("fail dev=fake0 after=2 status=21") == 0, "fail");
	for (uint64_t id = 1; id <= 3; id++)
		CHECK(post(A.qp, IBV_WR_RDMA_WRITE, id, A.buf, 64, A.mr->lkey, Bhello.addr, Bhello.rkey, 0) == 0, "post");
	static const int want[] = {IBV_WC_SUCCESS, IBV_WC_GENERAL_ERR, IBV_WC_WR_FLUSH_ERR};
	for (uint64_t id = 1; id <= 3; id++)
		CHECK(poll1(A.scq, &wc, 3000) && wc.wr_id == id && (int)wc.status == want[id - 1], "wr %llu: %s",
		      (unsigned long long)id, V.wc_status_str(wc.status));
	CHECK(qp_state(A.qp) == IBV_QPS_ERR, "not ERR after injected failure");
	pair();
	b_do(C_FILL, 0, 200000, 0);
	pattern(A.buf, 200000, 8);
	CHECK(b_control("partial dev=fake0 after=1") == 0, "partial");
	CHECK(post(A.qp, IBV_WR_RDMA_WRITE, 3, A.buf, 200000, A.mr->lkey, Bhello.addr, Bhello.rkey, 0) == 0, "post");
	CHECK(poll1(A.scq, &wc, 3000) && wc.status == IBV_WC_RETRY_EXC_ERR, "partial: %s", V.wc_status_str(wc.status));
	CHECK(b_check(C_CHECKPAT, 0, 100000, 8) == 0 && b_check(C_CHECK, 100000, 100000, 0) == 0,
	      "partial placement is not the first half");
	b_control("reset");
}

// The requester moves its own QP to ERR while a WRITE waits at the stalled
// responder: flushed at once; the bytes land only in late-land mode.
static void test_late_land(void) {
	struct ibv_wc wc;
	struct ibv_qp_attr err = {.qp_state = IBV_QPS_ERR};
	for (int late = 1; late >= 0; late--) {
		pair();
		b_do(C_FILL, 0, 65536, 0);
		CHECK(b_control("stall dev=fake0 ms=250") == 0, "stall");
		CHECK(V.control(late ? "late_land dev=fake0 on=1" : "late_land dev=fake0 on=0") == 0, "late_land");
		pattern(A.buf, 65536, 13);
		CHECK(post(A.qp, IBV_WR_RDMA_WRITE, 1, A.buf, 65536, A.mr->lkey, Bhello.addr, Bhello.rkey, 0) == 0, "post");
		sleep_ms(50);
		uint64_t t0 = now_ms();
		CHECK(V.modify_qp(A.qp, &err, IBV_QP_STATE) == 0, "to ERR");
		CHECK(poll1(A.scq, &wc, 2000) && wc.status == IBV_WC_WR_FLUSH_ERR, "late=%d: %s", late,
		      V.wc_status_str(wc.status));
		CHECK(now_ms() - t0 < 150, "flush took %llu ms", (unsigned long long)(now_ms() - t0));
		sleep_ms(500);
		uint32_t bad = b_check(C_CHECKPAT, 0, 65536, 13);
		if (late)
			CHECK(bad == 0, "late-land mode: the flushed WRITE did not land (%u bytes differ)", bad);
		else
			CHECK(b_check(C_CHECK, 0, 65536, 0) == 0, "a flushed WRITE landed without late-land mode");
		b_control("reset");
	}
	V.control("reset");
	// A device that is down fails every WQE; up again, it works.
	pair();
	CHECK(V.control("down dev=fake0") == 0, "down");
	CHECK(post(A.qp, IBV_WR_RDMA_WRITE, 2, A.buf, 64, A.mr->lkey, Bhello.addr, Bhello.rkey, 0) == 0, "post");
	CHECK(poll1(A.scq, &wc, 2000) && wc.status == IBV_WC_RETRY_EXC_ERR, "down: %s", V.wc_status_str(wc.status));
	CHECK(V.control("up dev=fake0") == 0, "up");
	pair();
	CHECK(post(A.qp, IBV_WR_RDMA_WRITE, 3, A.buf, 64, A.mr->lkey, Bhello.addr, Bhello.rkey, 0) == 0, "post");
	CHECK(poll1(A.scq, &wc, 2000) && wc.status == IBV_WC_SUCCESS, "up: %s", V.wc_status_str(wc.status));
}

// A hanging responder starts and completes no WQE, and the requester's QP
// going to ERR flushes none of them, until the hang ends: then they flush,
// having moved nothing. A hang that ends while the QP is still RTS lets its
// WQEs run.
static void test_hang(void) {
	struct ibv_wc wc;
	struct ibv_qp_attr err = {.qp_state = IBV_QPS_ERR};
	pair();
	b_do(C_FILL, 0, 131072, 0);
	pattern(A.buf, 131072, 15);
	CHECK(b_control("hang dev=fake0 on=1") == 0, "hang");
	CHECK(post(A.qp, IBV_WR_RDMA_WRITE, 1, A.buf, 65536, A.mr->lkey, Bhello.addr, Bhello.rkey, 0) == 0 &&
	          post(A.qp, IBV_WR_RDMA_WRITE, 2, A.buf + 65536, 65536, A.mr->lkey, Bhello.addr + 65536, Bhello.rkey,
	               0) == 0,
	      "post");
	CHECK(!poll1(A.scq, &wc, 300), "a WR completed at a hanging responder: %s", V.wc_status_str(wc.status));
	CHECK(V.modify_qp(A.qp, &err, IBV_QP_STATE) == 0, "to ERR");
	CHECK(!poll1(A.scq, &wc, 300), "a WR held by a hanging responder was flushed: %s", V.wc_status_str(wc.status));
	CHECK(b_check(C_CHECK, 0, 131072, 0) == 0, "a WR moved bytes at a hanging responder");
	CHECK(b_control("hang dev=fake0 on=0") == 0, "hang off");
	for (uint64_t id = 1; id <= 2; id++)
		CHECK(poll1(A.scq, &wc, 2000) && wc.wr_id == id && wc.status == IBV_WC_WR_FLUSH_ERR, "wr %llu after the hang: %s",
		      (unsigned long long)id, V.wc_status_str(wc.status));
	CHECK(b_check(C_CHECK, 0, 131072, 0) == 0, "a WR flushed after the hang moved bytes");
	// Ended (here by reset) with the QP still RTS: the WR runs.
	pair();
	CHECK(b_control("hang dev=fake0 on=1") == 0, "hang");
	CHECK(post(A.qp, IBV_WR_RDMA_WRITE, 3, A.buf, 65536, A.mr->lkey, Bhello.addr, Bhello.rkey, 0) == 0, "post");
	CHECK(!poll1(A.scq, &wc, 200), "a WR completed at a hanging responder: %s", V.wc_status_str(wc.status));
	CHECK(b_control("reset") == 0, "reset");
	CHECK(poll1(A.scq, &wc, 2000) && wc.wr_id == 3 && wc.status == IBV_WC_SUCCESS, "after reset: %s",
	      V.wc_status_str(wc.status));
	CHECK(b_check(C_CHECKPAT, 0, 65536, 15) == 0, "the WR run after the hang moved other data");
	CHECK(V.control("hang dev=fake9 on=1") == -1 && V.control("hang dev=fake0 on=2") == -1 &&
	          V.control("hang dev=fake0") == -1,
	      "bad hang commands accepted");
}

// Deregistration is a barrier: a WRITE whose chunks are delayed stops at the
// first chunk after ibv_dereg_mr, and nothing lands once it returned.
static void test_dereg(void) {
	struct ibv_wc wc;
	pair();
	b_do(C_FILL, BUF / 2, BUF / 2, 0);
	struct msg r = call((struct msg){.cmd = C_MR2});
	CHECK(r.rc == 0, "second MR: %d", r.rc);
	CHECK(b_control("delay dev=fake0 us=40000") == 0, "delay");
	pattern(A.buf, BUF / 2, 14);
	CHECK(post(A.qp, IBV_WR_RDMA_WRITE, 1, A.buf, BUF / 2, A.mr->lkey, Bhello.addr + BUF / 2, r.rkey, 0) == 0,
	      "post");
	sleep_ms(90);
	r = call((struct msg){.cmd = C_DEREG2});
	CHECK(r.rc == 0, "dereg: %d", r.rc);
	CHECK(r.a == 0, "%u bytes changed after ibv_dereg_mr returned", r.a);
	CHECK(r.b > 0 && r.b < BUF / 2, "dereg did not cut the WRITE in the middle (%u bytes had landed)", r.b);
	CHECK(poll1(A.scq, &wc, 2000) && wc.status == IBV_WC_REM_ACCESS_ERR, "after dereg: %s",
	      V.wc_status_str(wc.status));
	b_control("reset");
	// The MR's access flags count: it has no REMOTE_READ.
	pair();
	r = call((struct msg){.cmd = C_MR2});
	CHECK(post(A.qp, IBV_WR_RDMA_READ, 2, A.buf, 4096, A.mr->lkey, Bhello.addr + BUF / 2, r.rkey, 0) == 0, "post");
	CHECK(poll1(A.scq, &wc, 2000) && wc.status == IBV_WC_REM_ACCESS_ERR, "READ without REMOTE_READ: %s",
	      V.wc_status_str(wc.status));
}

int main(int argc, char **argv) {
	const char *lib = argc > 1 ? argv[1] : "build/fakeverbs/libibverbs.so.1";
	char fabric[64];
	snprintf(fabric, sizeof(fabric), "/kvferry-fakeverbs-selftest-%d", (int)getpid());
	setenv("FAKEVERBS_FABRIC", fabric, 1);
	setenv("FAKEVERBS_DEVICES", "2", 1);
	setenv("FAKEVERBS_NUMA", "0,1", 1);
	setenv("FAKEVERBS_LINK", "eth", 1);
	unsetenv("FAKEVERBS_CONTROL");
	unsetenv("FAKEVERBS_CHUNK");
	unsetenv("FAKEVERBS_MAX_MR_SIZE");
	void *h = dlopen(lib, RTLD_NOW | RTLD_LOCAL);
	if (h == NULL)
		die("dlopen %s: %s", lib, dlerror());
	resolve(h);
	alarm(120);
	int sv[2];
	if (socketpair(AF_UNIX, SOCK_STREAM, 0, sv) != 0)
		die("socketpair");
	// Fork first; each process then opens its own devices.
	Bpid = fork();
	if (Bpid < 0)
		die("fork");
	if (Bpid == 0) {
		role = "B";
		close(sv[0]);
		sock = sv[1];
		peer_loop();
	}
	close(sv[1]);
	sock = sv[0];
	side_open(&A);
	Bhello = call((struct msg){.cmd = C_HELLO});
	struct {
		const char *name;
		void (*fn)(void);
	} tests[] = {
	    {"devices", test_devices},       {"qp masks", test_masks},    {"loopback", test_loopback},
	    {"write/read", test_write_read}, {"remote access", test_remote_access}, {"owner fence", test_fence},
	    {"sigstop", test_sigstop},       {"send inline", test_send},  {"faults", test_faults},
	    {"late land, down", test_late_land}, {"dereg barrier", test_dereg}, {"hang", test_hang},
	};
	for (size_t i = 0; i < sizeof(tests) / sizeof(tests[0]); i++) {
		int before = failures;
		uint64_t t0 = now_ms();
		tests[i].fn();
		printf("%s %s (%llu ms)\n", failures == before ? "ok  " : "FAIL", tests[i].name,
		       (unsigned long long)(now_ms() - t0));
		fflush(stdout);
	}
	// The peer exits; its QP is gone, so a WRITE to it fails on our side.
	int before = failures;
	pair();
	xsend(&(struct msg){.cmd = C_EXIT});
	int st;
	waitpid(Bpid, &st, 0);
	CHECK(WIFEXITED(st) && WEXITSTATUS(st) == 0, "peer exit status %d", st);
	struct ibv_wc wc;
	CHECK(post(A.qp, IBV_WR_RDMA_WRITE, 9, A.buf, 64, A.mr->lkey, Bhello.addr, Bhello.rkey, 0) == 0, "post");
	CHECK(poll1(A.scq, &wc, 3000) && wc.status == IBV_WC_RETRY_EXC_ERR, "dead peer: %s", V.wc_status_str(wc.status));
	printf("%s dead responder\n", failures == before ? "ok  " : "FAIL");
	CHECK(V.destroy_qp(A.qp) == 0 && V.dereg_mr(A.mr) == 0 && V.destroy_cq(A.scq) == 0 && V.destroy_cq(A.rcq) == 0 &&
	          V.dealloc_pd(A.pd) == 0 && V.close_device(A.ctx) == 0,
	      "teardown");
	shm_unlink(fabric);
	if (failures) {
		printf("fakeverbs selftest: %d check(s) failed\n", failures);
		return 1;
	}
	printf("fakeverbs selftest: all passed\n");
	return 0;
}
