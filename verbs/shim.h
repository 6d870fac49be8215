// C side of package verbs: libibverbs resolved at run time with dlopen and
// dlvsym (as NCCL does), and the calls Go makes through it. Work requests
// and completions cross the cgo boundary as arrays of the flat structs
// below, one call per batch; they hold addresses, never Go pointers.
#ifndef KVFV_VERBS_SHIM_H
#define KVFV_VERBS_SHIM_H

#include <stddef.h>
#include <stdint.h>

// Internal to libkvferry.so: none of this is exported (the library's ABI
// is kvf_* only).
#pragma GCC visibility push(hidden)

typedef struct kvfv_lib kvfv_lib;

// One work request to post. opcode: KVFV_OP_*; flags: KVFV_WR_*.
struct kvfv_wr {
	uint64_t wr_id;
	uint64_t local_addr;
	uint64_t remote_addr;
	uint32_t length;
	uint32_t lkey;
	uint32_t rkey;
	uint32_t imm;
	uint8_t opcode;
	uint8_t flags;
	uint8_t inline_len;
	uint8_t pad[5];
	uint8_t inline_data[64];
};

// One receive to post.
struct kvfv_recv_wr {
	uint64_t wr_id;
	uint64_t addr;
	uint32_t length;
	uint32_t lkey;
};

// One completion.
struct kvfv_wc {
	uint64_t wr_id;
	uint32_t status;
	uint32_t opcode;
	uint32_t byte_len;
	uint32_t imm;
	uint32_t qp_num;
	uint32_t vendor_err;
	uint32_t wc_flags;
	uint32_t pad;
};

enum {
	KVFV_OP_WRITE = 1,
	KVFV_OP_WRITE_IMM = 2,
	KVFV_OP_READ = 3,
	KVFV_OP_SEND = 4,
};

enum {
	KVFV_WR_SIGNALED = 1,
	KVFV_WR_INLINE = 2,
	KVFV_WR_FENCE = 4,
};

struct kvfv_device_attr {
	uint64_t max_mr_size;
	uint64_t node_guid;
	int32_t max_qp;
	int32_t max_qp_wr;
	int32_t max_sge;
	int32_t max_cq;
	int32_t max_cqe;
	int32_t max_mr;
	int32_t max_qp_rd_atom;
	int32_t max_qp_init_rd_atom;
	int32_t phys_port_cnt;
	char fw_ver[64];
};

struct kvfv_port_attr {
	int32_t state;
	int32_t max_mtu;
	int32_t active_mtu;
	int32_t gid_tbl_len;
	uint32_t max_msg_sz;
	uint16_t lid;
	uint8_t link_layer;
	uint8_t active_speed;
	uint8_t active_width;
	uint8_t pad[3];
};

// What a modify_qp call sets; mask is a set of IBV_QP_* bits.
struct kvfv_qp_attr {
	int32_t state;
	int32_t port;
	int32_t access;
	int32_t path_mtu;
	uint32_t dest_qpn;
	uint32_t rq_psn;
	uint32_t sq_psn;
	uint16_t dlid;
	uint8_t is_global;
	uint8_t sgid_index;
	uint8_t hop_limit;
	uint8_t traffic_class;
	uint8_t timeout;
	uint8_t retry_cnt;
	uint8_t rnr_retry;
	uint8_t min_rnr_timer;
	uint8_t max_rd_atomic;
	uint8_t max_dest_rd_atomic;
	uint8_t dgid[16];
};

// Library and devices.
int kvfv_open(const char *path, kvfv_lib **out, char *err, size_t errlen);
void kvfv_close(kvfv_lib *lib);
int kvfv_has(kvfv_lib *lib, const char *what);
int kvfv_device_count(kvfv_lib *lib);
int kvfv_device_names(kvfv_lib *lib, int i, char *name, size_t namelen, char *path, size_t pathlen, uint64_t *guid);
int kvfv_open_device(kvfv_lib *lib, int i, void **ctx);
int kvfv_close_device(kvfv_lib *lib, void *ctx);
int kvfv_query_device(kvfv_lib *lib, void *ctx, struct kvfv_device_attr *out);
int kvfv_query_port(kvfv_lib *lib, void *ctx, int port, struct kvfv_port_attr *out);
int kvfv_query_gid(kvfv_lib *lib, void *ctx, int port, int index, uint8_t gid[16]);
const char *kvfv_wc_status_str(kvfv_lib *lib, int status);
// Calls a test control entry point of a fake provider, int f(const char*).
int kvfv_control(kvfv_lib *lib, const char *sym, const char *cmd);

// Objects. Functions returning int return 0 or an errno value.
int kvfv_alloc_pd(kvfv_lib *lib, void *ctx, void **pd);
int kvfv_dealloc_pd(kvfv_lib *lib, void *pd);
int kvfv_reg_mr(kvfv_lib *lib, void *pd, uint64_t addr, uint64_t len, int access, int relaxed, void **mr, uint32_t *lkey, uint32_t *rkey);
int kvfv_reg_dmabuf_mr(kvfv_lib *lib, void *pd, uint64_t offset, uint64_t len, uint64_t iova, int fd, int access, void **mr, uint32_t *lkey, uint32_t *rkey);
int kvfv_dereg_mr(kvfv_lib *lib, void *mr);
int kvfv_create_cq(kvfv_lib *lib, void *ctx, int cqe, void **cq);
int kvfv_destroy_cq(kvfv_lib *lib, void *cq);
int kvfv_create_qp(kvfv_lib *lib, void *pd, void *send_cq, void *recv_cq, int max_send_wr, int max_recv_wr, int max_inline, void **qp, uint32_t *qpn);
int kvfv_modify_qp(kvfv_lib *lib, void *qp, const struct kvfv_qp_attr *attr, int mask);
int kvfv_query_qp_state(kvfv_lib *lib, void *qp, int *state);
int kvfv_destroy_qp(kvfv_lib *lib, void *qp);

// Data path: one cgo call per batch.
int kvfv_post_send(void *qp, const struct kvfv_wr *wrs, int n, int *posted);
int kvfv_post_recv(void *qp, const struct kvfv_recv_wr *wrs, int n, int *posted);
int kvfv_poll_cq(void *cq, struct kvfv_wc *out, int max);

#pragma GCC visibility pop

#endif
