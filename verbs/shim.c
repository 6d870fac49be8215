// libibverbs through dlopen: the shared library must load, and report "rdma
// not available", on machines without rdma-core, so no ibv_ symbol may be
// linked. verbs.h is used for its types only; none of its inline helpers
// that call exported functions (ibv_query_port, ibv_reg_mr) is used.
#define _GNU_SOURCE
#include "shim.h"

#include <dlfcn.h>
#include <errno.h>
#include <infiniband/verbs.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

struct kvfv_lib {
	void *handle;
	struct ibv_device **devices;
	int ndevices;

	struct ibv_device **(*get_device_list)(int *);
	void (*free_device_list)(struct ibv_device **);
	const char *(*get_device_name)(struct ibv_device *);
	uint64_t (*get_device_guid)(struct ibv_device *);
	struct ibv_context *(*open_device)(struct ibv_device *);
	int (*close_device)(struct ibv_context *);
	int (*query_device)(struct ibv_context *, struct ibv_device_attr *);
	int (*query_port)(struct ibv_context *, uint8_t, struct ibv_port_attr *);
	int (*query_gid)(struct ibv_context *, uint8_t, int, union ibv_gid *);
	struct ibv_pd *(*alloc_pd)(struct ibv_context *);
	int (*dealloc_pd)(struct ibv_pd *);
	struct ibv_mr *(*reg_mr)(struct ibv_pd *, void *, size_t, int);
	struct ibv_mr *(*reg_mr_iova2)(struct ibv_pd *, void *, size_t, uint64_t, unsigned int);
	struct ibv_mr *(*reg_dmabuf_mr)(struct ibv_pd *, uint64_t, size_t, uint64_t, int, int);
	int (*dereg_mr)(struct ibv_mr *);
	struct ibv_cq *(*create_cq)(struct ibv_context *, int, void *, struct ibv_comp_channel *, int);
	int (*destroy_cq)(struct ibv_cq *);
	struct ibv_qp *(*create_qp)(struct ibv_pd *, struct ibv_qp_init_attr *);
	int (*modify_qp)(struct ibv_qp *, struct ibv_qp_attr *, int);
	int (*query_qp)(struct ibv_qp *, struct ibv_qp_attr *, int, struct ibv_qp_init_attr *);
	int (*destroy_qp)(struct ibv_qp *);
	const char *(*wc_status_str)(enum ibv_wc_status);
};

// sym resolves name at the ABI version rdma-core exports it under, then
// unversioned (some providers of the ABI carry no versions).
static void *sym(void *h, const char *name, const char *version) {
	void *p = dlvsym(h, name, version);
	if (p == NULL)
		p = dlsym(h, name);
	return p;
}

// Opened libraries live as long as the process (Go caches them); they are
// also kept here, where leak checkers of C programs that load
// libkvferry.so can see them.
#define KEPT 32
static kvfv_lib *volatile kept[KEPT] __attribute__((used));
static int nkept;

static void remember(kvfv_lib *l) {
	int i = __atomic_fetch_add(&nkept, 1, __ATOMIC_RELAXED);
	if (i < KEPT)
		kept[i] = l;
}

int kvfv_open(const char *path, kvfv_lib **out, char *err, size_t errlen) {
	*out = NULL;
	dlerror();
	void *h = dlopen(path, RTLD_NOW | RTLD_LOCAL);
	if (h == NULL) {
		const char *e = dlerror();
		snprintf(err, errlen, "%s", e ? e : "dlopen failed");
		return ENOENT;
	}
	kvfv_lib *l = calloc(1, sizeof(*l));
	if (l == NULL) {
		dlclose(h);
		snprintf(err, errlen, "out of memory");
		return ENOMEM;
	}
	l->handle = h;
	const char *v = "IBVERBS_1.1";
#define REQ(field, name)                                                       \
	do {                                                                       \
		*(void **)&l->field = sym(h, name, v);                                 \
		if (l->field == NULL) {                                                \
			snprintf(err, errlen, "%s: symbol %s not found", path, name);      \
			dlclose(h);                                                        \
			free(l);                                                           \
			return ENOSYS;                                                     \
		}                                                                      \
	} while (0)
	REQ(get_device_list, "ibv_get_device_list");
	REQ(free_device_list, "ibv_free_device_list");
	REQ(get_device_name, "ibv_get_device_name");
	REQ(get_device_guid, "ibv_get_device_guid");
	REQ(open_device, "ibv_open_device");
	REQ(close_device, "ibv_close_device");
	REQ(query_device, "ibv_query_device");
	REQ(query_port, "ibv_query_port");
	REQ(query_gid, "ibv_query_gid");
	REQ(alloc_pd, "ibv_alloc_pd");
	REQ(dealloc_pd, "ibv_dealloc_pd");
	REQ(reg_mr, "ibv_reg_mr");
	REQ(dereg_mr, "ibv_dereg_mr");
	REQ(create_cq, "ibv_create_cq");
	REQ(destroy_cq, "ibv_destroy_cq");
	REQ(create_qp, "ibv_create_qp");
	REQ(modify_qp, "ibv_modify_qp");
	REQ(query_qp, "ibv_query_qp");
	REQ(destroy_qp, "ibv_destroy_qp");
	REQ(wc_status_str, "ibv_wc_status_str");
#undef REQ
	// Optional: relaxed ordering needs the iova2 entry point (rdma-core 28+).
	*(void **)&l->reg_mr_iova2 = sym(h, "ibv_reg_mr_iova2", "IBVERBS_1.8");
	// Optional: GPU memory through dma-buf (rdma-core 34+).
	*(void **)&l->reg_dmabuf_mr = sym(h, "ibv_reg_dmabuf_mr", "IBVERBS_1.12");

	int n = 0;
	l->devices = l->get_device_list(&n);
	if (l->devices == NULL) {
		// No kernel support reads as "no device", not as a broken library.
		n = 0;
	}
	l->ndevices = n;
	*out = l;
	remember(l);
	return 0;
}

void kvfv_close(kvfv_lib *l) {
	if (l == NULL)
		return;
	if (l->devices != NULL)
		l->free_device_list(l->devices);
	// The library stays mapped: a provider may have started threads or
	// registered atexit handlers that outlive us.
	free(l);
}

int kvfv_has(kvfv_lib *l, const char *what) {
	if (strcmp(what, "reg_mr_iova2") == 0)
		return l->reg_mr_iova2 != NULL;
	return dlsym(l->handle, what) != NULL;
}

int kvfv_device_count(kvfv_lib *l) { return l->ndevices; }

int kvfv_device_names(kvfv_lib *l, int i, char *name, size_t namelen, char *path, size_t pathlen, uint64_t *guid) {
	if (i < 0 || i >= l->ndevices)
		return EINVAL;
	struct ibv_device *d = l->devices[i];
	const char *n = l->get_device_name(d);
	snprintf(name, namelen, "%s", n ? n : "");
	snprintf(path, pathlen, "%s", d->ibdev_path);
	*guid = l->get_device_guid(d);
	return 0;
}

int kvfv_open_device(kvfv_lib *l, int i, void **ctx) {
	if (i < 0 || i >= l->ndevices)
		return EINVAL;
	errno = 0;
	struct ibv_context *c = l->open_device(l->devices[i]);
	if (c == NULL)
		return errno ? errno : EIO;
	*ctx = c;
	return 0;
}

int kvfv_close_device(kvfv_lib *l, void *ctx) { return l->close_device(ctx) ? (errno ? errno : EIO) : 0; }

int kvfv_query_device(kvfv_lib *l, void *ctx, struct kvfv_device_attr *out) {
	struct ibv_device_attr a;
	memset(&a, 0, sizeof(a));
	int rc = l->query_device(ctx, &a);
	if (rc)
		return rc;
	out->max_mr_size = a.max_mr_size;
	out->node_guid = a.node_guid;
	out->max_qp = a.max_qp;
	out->max_qp_wr = a.max_qp_wr;
	out->max_sge = a.max_sge;
	out->max_cq = a.max_cq;
	out->max_cqe = a.max_cqe;
	out->max_mr = a.max_mr;
	out->max_qp_rd_atom = a.max_qp_rd_atom;
	out->max_qp_init_rd_atom = a.max_qp_init_rd_atom;
	out->phys_port_cnt = a.phys_port_cnt;
	snprintf(out->fw_ver, sizeof(out->fw_ver), "%s", a.fw_ver);
	return 0;
}

int kvfv_query_port(kvfv_lib *l, void *ctx, int port, struct kvfv_port_attr *out) {
	// The exported symbol fills the compat prefix of the struct; the
	// header's macro zeroes the whole struct first, and so do we.
	struct ibv_port_attr a;
	memset(&a, 0, sizeof(a));
	int rc = l->query_port(ctx, (uint8_t)port, &a);
	if (rc)
		return rc;
	out->state = a.state;
	out->max_mtu = a.max_mtu;
	out->active_mtu = a.active_mtu;
	out->gid_tbl_len = a.gid_tbl_len;
	out->max_msg_sz = a.max_msg_sz;
	out->lid = a.lid;
	out->link_layer = a.link_layer;
	out->active_speed = a.active_speed;
	out->active_width = a.active_width;
	return 0;
}

int kvfv_query_gid(kvfv_lib *l, void *ctx, int port, int index, uint8_t gid[16]) {
	union ibv_gid g;
	int rc = l->query_gid(ctx, (uint8_t)port, index, &g);
	if (rc)
		return rc;
	memcpy(gid, g.raw, 16);
	return 0;
}

const char *kvfv_wc_status_str(kvfv_lib *l, int status) { return l->wc_status_str((enum ibv_wc_status)status); }

int kvfv_control(kvfv_lib *l, const char *name, const char *cmd) {
	int (*f)(const char *) = NULL;
	*(void **)&f = dlsym(l->handle, name);
	if (f == NULL)
		return ENOSYS;
	return f(cmd) == 0 ? 0 : EINVAL;
}

int kvfv_alloc_pd(kvfv_lib *l, void *ctx, void **pd) {
	errno = 0;
	struct ibv_pd *p = l->alloc_pd(ctx);
	if (p == NULL)
		return errno ? errno : ENOMEM;
	*pd = p;
	return 0;
}

int kvfv_dealloc_pd(kvfv_lib *l, void *pd) { return l->dealloc_pd(pd); }

int kvfv_reg_mr(kvfv_lib *l, void *pd, uint64_t addr, uint64_t len, int access, int relaxed, void **mr, uint32_t *lkey, uint32_t *rkey) {
	errno = 0;
	struct ibv_mr *m = NULL;
	if (relaxed && l->reg_mr_iova2 != NULL) {
		// An optional access bit: providers that lack relaxed ordering
		// ignore it rather than fail.
		m = l->reg_mr_iova2(pd, (void *)(uintptr_t)addr, len, addr, (unsigned)(access | IBV_ACCESS_RELAXED_ORDERING));
	} else {
		m = l->reg_mr(pd, (void *)(uintptr_t)addr, len, access);
	}
	if (m == NULL)
		return errno ? errno : ENOMEM;
	*mr = m;
	*lkey = m->lkey;
	*rkey = m->rkey;
	return 0;
}

int kvfv_reg_dmabuf_mr(kvfv_lib *l, void *pd, uint64_t offset, uint64_t len, uint64_t iova, int fd, int access, void **mr, uint32_t *lkey, uint32_t *rkey) {
	if (l->reg_dmabuf_mr == NULL)
		return EOPNOTSUPP;
	errno = 0;
	struct ibv_mr *m = l->reg_dmabuf_mr(pd, offset, len, iova, fd, access);
	if (m == NULL)
		return errno ? errno : EOPNOTSUPP;
	*mr = m;
	*lkey = m->lkey;
	*rkey = m->rkey;
	return 0;
}

int kvfv_dereg_mr(kvfv_lib *l, void *mr) { return l->dereg_mr(mr); }

int kvfv_create_cq(kvfv_lib *l, void *ctx, int cqe, void **cq) {
	errno = 0;
	struct ibv_cq *c = l->create_cq(ctx, cqe, NULL, NULL, 0);
	if (c == NULL)
		return errno ? errno : ENOMEM;
	*cq = c;
	return 0;
}

int kvfv_destroy_cq(kvfv_lib *l, void *cq) { return l->destroy_cq(cq); }

int kvfv_create_qp(kvfv_lib *l, void *pd, void *send_cq, void *recv_cq, int max_send_wr, int max_recv_wr, int max_inline, void **qp, uint32_t *qpn) {
	struct ibv_qp_init_attr a;
	memset(&a, 0, sizeof(a));
	a.send_cq = send_cq;
	a.recv_cq = recv_cq;
	a.qp_type = IBV_QPT_RC;
	a.sq_sig_all = 0;
	a.cap.max_send_wr = (uint32_t)max_send_wr;
	a.cap.max_recv_wr = (uint32_t)max_recv_wr;
	a.cap.max_send_sge = 1;
	a.cap.max_recv_sge = 1;
	a.cap.max_inline_data = (uint32_t)max_inline;
	errno = 0;
	struct ibv_qp *q = l->create_qp(pd, &a);
	if (q == NULL)
		return errno ? errno : ENOMEM;
	*qp = q;
	*qpn = q->qp_num;
	return 0;
}

int kvfv_modify_qp(kvfv_lib *l, void *qp, const struct kvfv_qp_attr *in, int mask) {
	struct ibv_qp_attr a;
	memset(&a, 0, sizeof(a));
	a.qp_state = (enum ibv_qp_state)in->state;
	a.port_num = (uint8_t)in->port;
	a.pkey_index = 0;
	a.qp_access_flags = (unsigned)in->access;
	a.path_mtu = (enum ibv_mtu)in->path_mtu;
	a.dest_qp_num = in->dest_qpn;
	a.rq_psn = in->rq_psn;
	a.sq_psn = in->sq_psn;
	a.max_rd_atomic = in->max_rd_atomic;
	a.max_dest_rd_atomic = in->max_dest_rd_atomic;
	a.min_rnr_timer = in->min_rnr_timer;
	a.timeout = in->timeout;
	a.retry_cnt = in->retry_cnt;
	a.rnr_retry = in->rnr_retry;
	a.ah_attr.dlid = in->dlid;
	a.ah_attr.port_num = (uint8_t)in->port;
	a.ah_attr.is_global = in->is_global;
	if (in->is_global) {
		memcpy(a.ah_attr.grh.dgid.raw, in->dgid, 16);
		a.ah_attr.grh.sgid_index = in->sgid_index;
		a.ah_attr.grh.hop_limit = in->hop_limit ? in->hop_limit : 64;
		a.ah_attr.grh.traffic_class = in->traffic_class;
	}
	return l->modify_qp(qp, &a, mask);
}

int kvfv_query_qp_state(kvfv_lib *l, void *qp, int *state) {
	struct ibv_qp_attr a;
	struct ibv_qp_init_attr i;
	memset(&a, 0, sizeof(a));
	memset(&i, 0, sizeof(i));
	int rc = l->query_qp(qp, &a, IBV_QP_STATE, &i);
	if (rc)
		return rc;
	*state = a.qp_state;
	return 0;
}

int kvfv_destroy_qp(kvfv_lib *l, void *qp) { return l->destroy_qp(qp); }

// Chains of at most this many requests are built on the stack.
#define CHAIN 32

int kvfv_post_send(void *qpv, const struct kvfv_wr *wrs, int n, int *posted) {
	struct ibv_qp *qp = qpv;
	struct ibv_send_wr w[CHAIN];
	struct ibv_sge s[CHAIN];
	*posted = 0;
	for (int base = 0; base < n; base += CHAIN) {
		int m = n - base < CHAIN ? n - base : CHAIN;
		for (int i = 0; i < m; i++) {
			const struct kvfv_wr *in = &wrs[base + i];
			memset(&w[i], 0, sizeof(w[i]));
			w[i].wr_id = in->wr_id;
			w[i].next = i + 1 < m ? &w[i + 1] : NULL;
			if (in->flags & KVFV_WR_INLINE) {
				s[i].addr = (uintptr_t)in->inline_data;
				s[i].length = in->inline_len;
				s[i].lkey = 0;
			} else {
				s[i].addr = in->local_addr;
				s[i].length = in->length;
				s[i].lkey = in->lkey;
			}
			w[i].sg_list = &s[i];
			w[i].num_sge = s[i].length ? 1 : 0;
			switch (in->opcode) {
			case KVFV_OP_WRITE: w[i].opcode = IBV_WR_RDMA_WRITE; break;
			case KVFV_OP_WRITE_IMM: w[i].opcode = IBV_WR_RDMA_WRITE_WITH_IMM; break;
			case KVFV_OP_READ: w[i].opcode = IBV_WR_RDMA_READ; break;
			case KVFV_OP_SEND: w[i].opcode = IBV_WR_SEND; break;
			default: return EINVAL;
			}
			if (in->opcode == KVFV_OP_WRITE_IMM)
				w[i].imm_data = in->imm;
			w[i].send_flags = ((in->flags & KVFV_WR_SIGNALED) ? IBV_SEND_SIGNALED : 0) |
			                  ((in->flags & KVFV_WR_INLINE) ? IBV_SEND_INLINE : 0) |
			                  ((in->flags & KVFV_WR_FENCE) ? IBV_SEND_FENCE : 0);
			w[i].wr.rdma.remote_addr = in->remote_addr;
			w[i].wr.rdma.rkey = in->rkey;
		}
		struct ibv_send_wr *bad = NULL;
		int rc = qp->context->ops.post_send(qp, w, &bad);
		if (rc) {
			// Requests before the bad one were posted.
			int ok = 0;
			for (struct ibv_send_wr *p = w; p != NULL && p != bad; p = p->next)
				ok++;
			*posted += bad ? ok : 0;
			return rc;
		}
		*posted += m;
	}
	return 0;
}

int kvfv_post_recv(void *qpv, const struct kvfv_recv_wr *wrs, int n, int *posted) {
	struct ibv_qp *qp = qpv;
	struct ibv_recv_wr w[CHAIN];
	struct ibv_sge s[CHAIN];
	*posted = 0;
	for (int base = 0; base < n; base += CHAIN) {
		int m = n - base < CHAIN ? n - base : CHAIN;
		for (int i = 0; i < m; i++) {
			memset(&w[i], 0, sizeof(w[i]));
			s[i].addr = wrs[base + i].addr;
			s[i].length = wrs[base + i].length;
			s[i].lkey = wrs[base + i].lkey;
			w[i].wr_id = wrs[base + i].wr_id;
			w[i].sg_list = &s[i];
			w[i].num_sge = 1;
			w[i].next = i + 1 < m ? &w[i + 1] : NULL;
		}
		struct ibv_recv_wr *bad = NULL;
		int rc = qp->context->ops.post_recv(qp, w, &bad);
		if (rc) {
			int ok = 0;
			for (struct ibv_recv_wr *p = w; p != NULL && p != bad; p = p->next)
				ok++;
			*posted += bad ? ok : 0;
			return rc;
		}
		*posted += m;
	}
	return 0;
}

int kvfv_poll_cq(void *cqv, struct kvfv_wc *out, int max) {
	struct ibv_cq *cq = cqv;
	struct ibv_wc w[CHAIN];
	int total = 0;
	while (total < max) {
		int want = max - total < CHAIN ? max - total : CHAIN;
		int n = cq->context->ops.poll_cq(cq, want, w);
		if (n < 0)
			return total ? total : n;
		for (int i = 0; i < n; i++) {
			struct kvfv_wc *o = &out[total + i];
			o->wr_id = w[i].wr_id;
			o->status = w[i].status;
			o->opcode = w[i].opcode;
			o->byte_len = w[i].byte_len;
			o->imm = w[i].imm_data;
			o->qp_num = w[i].qp_num;
			o->vendor_err = w[i].vendor_err;
			o->wc_flags = w[i].wc_flags;
			o->pad = 0;
		}
		total += n;
		if (n < want)
			break;
	}
	return total;
}
