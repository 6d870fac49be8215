/*
 * kvferry.h - C API of kvferry, a KV-cache transfer engine.
 *
 * kvferry moves bytes between the registered memory of engines ("segments")
 * with batches of one-sided READ and WRITE requests. Every request carries an
 * application request id, every synchronous call has a deadline, and when a
 * call that named memory returns, the engine no longer touches that memory.
 *
 * Conventions (the same for every function):
 *
 *  - Every function except the version and string functions returns a
 *    kvf_status: KVF_OK (0) on success, a positive KVF_ERR_* code otherwise.
 *    On failure, kvf_last_error() returns a detailed message for the calling
 *    thread. Output parameters are written only on success unless a function
 *    says otherwise.
 *  - Handles (kvf_engine, kvf_segment, kvf_batch) are opaque. They are not
 *    pointers to memory: the library validates each one on every call, so a
 *    NULL, stale (destroyed, closed, freed), garbage or wrong-kind handle
 *    returns KVF_ERR_HANDLE and never crashes. Destroying an engine makes its
 *    segment and batch handles stale.
 *  - Every function is thread-safe; handles may be used from any thread.
 *  - NULL pointers where an object is required, zero lengths and address
 *    ranges that wrap around return KVF_ERR_INVALID. The library cannot check
 *    that a non-NULL data pointer is valid: a wild address (into unmapped
 *    memory, or memory freed while registered) is the caller's fault, as in
 *    any C API, and may crash the process.
 *  - The library keeps no pointer to caller memory after a call returns,
 *    except registered memory (until it is unregistered) and buffers from
 *    kvf_alloc_buffer (owned by the engine).
 *  - Timeouts are in milliseconds; KVF_TIMEOUT_DEFAULT (-1) means the
 *    engine's default timeout (30 s unless configured). Nothing waits forever.
 *  - Structs that may grow start with `uint32_t struct_size`: set it to
 *    sizeof the struct (the *_init helpers do), so programs built against an
 *    older header keep working with a newer library.
 *
 * Process rules: the library contains the Go runtime. It is loaded once and
 * cannot be unloaded (dlclose is a no-op). After fork(), the child must not
 * call kvferry before exec (fork+exec and posix_spawn are fine). KVFERRY_*
 * environment variables are read from the environment the process was
 * started with (setenv calls, even before loading, are not seen); set
 * run-time settings through kvf_engine_options instead.
 *
 * This header compiles as C99 and later, and as C++ (extern "C").
 */
#ifndef KVFERRY_H
#define KVFERRY_H

#include <stddef.h>
#include <stdint.h>
#include <string.h>

#ifdef __cplusplus
extern "C" {
#endif

/* ------------------------------------------------------------------------ */
/* Version                                                                  */
/* ------------------------------------------------------------------------ */

#define KVF_VERSION_MAJOR 0
#define KVF_VERSION_MINOR 7
#define KVF_VERSION_PATCH 0
/* MAJOR * 10000 + MINOR * 100 + PATCH, as zstd's ZSTD_VERSION_NUMBER. */
#define KVF_VERSION_NUMBER \
    (KVF_VERSION_MAJOR * 10000 + KVF_VERSION_MINOR * 100 + KVF_VERSION_PATCH)
#define KVF_VERSION_STRING "0.7.0"

/* The library's KVF_VERSION_NUMBER, to check that header and library agree
 * (the major version must match; a library at least as new as the header is
 * required for the functions the header declares). Never fails. */
uint32_t kvf_version(void);

/* The library's version as "MAJOR.MINOR.PATCH"; a static string. */
const char *kvf_version_string(void);

/* ------------------------------------------------------------------------ */
/* Status codes                                                             */
/* ------------------------------------------------------------------------ */

typedef enum kvf_status {
    KVF_OK = 0,
    KVF_ERR_INVALID = 1,         /* invalid argument: NULL pointer, zero length,
                                    wrapping range, bad option or op, bad index */
    KVF_ERR_HANDLE = 2,          /* NULL, stale, garbage or wrong-kind handle, or
                                    a handle of another engine */
    KVF_ERR_OVERLAP = 3,         /* range overlaps a registered range */
    KVF_ERR_NOT_REGISTERED = 4,  /* local memory (or, on the engine's own
                                    segment, the target range) is not registered */
    KVF_ERR_REMOTE_RANGE = 5,    /* the peer has not registered the remote range */
    KVF_ERR_STALE_KEY = 6,       /* the range was unregistered (and maybe
                                    registered again) since the request was planned */
    KVF_ERR_REFUSED = 7,         /* the owner of the memory refused the access */
    KVF_ERR_TIMEOUT = 8,         /* a deadline passed */
    KVF_ERR_CANCELED = 9,        /* canceled by the caller or by destroy */
    KVF_ERR_CONNECTION = 10,     /* a data connection broke (after retries) */
    KVF_ERR_UNREACHABLE = 11,    /* the peer did not answer, or was declared
                                    dead after missed heartbeats */
    KVF_ERR_BUSY = 12,           /* the batch still has tasks in flight */
    KVF_ERR_BATCH_FULL = 13,     /* more requests than the batch's capacity */
    KVF_ERR_CLOSED = 14,         /* the engine is being destroyed */
    KVF_ERR_UNSUPPORTED = 15,    /* not supported by this build or version */
    KVF_ERR_TRANSFER_FAILED = 16,/* a transfer failed for another reason */
    KVF_ERR_NO_MEMORY = 17,      /* out of memory */
    KVF_ERR_INTERNAL = 18,       /* a bug in kvferry; the message says where */
    KVF_ERR_ABORTED = 19,        /* the owner aborted the request id */
    KVF_ERR_PROTOCOL = 20,       /* a peer sent a malformed or unexpected message */
    KVF_ERR_TRUNCATED = 21,      /* the output buffer is too small; the length
                                    needed was reported */
    KVF_ERR_IN_USE = 22,         /* the engine could not confirm in time that it
                                    stopped touching a transfer's memory (a NIC
                                    neither completed nor flushed its work):
                                    do not reuse that memory; its tasks stay
                                    in flight */
    KVF_ERR_FENCED = 23,         /* since 0.4: the owner fenced a range the
                                    transfer touches (kvf_fence_memory) after
                                    the transfer was planned; final for that
                                    transfer, never retried: plan a new one */
    KVF_ERR_UNAUTHENTICATED = 24 /* since 0.5: with authentication on, the
                                    peer did not prove a key our allowlist
                                    holds, or refused ours; nothing was sent
                                    to it */
} kvf_status;

/* Largest status code of this version. */
#define KVF_STATUS_MAX 24

/* A static, never NULL, English name of a status code, e.g. "invalid
 * argument"; "unknown status" for codes this version does not know. */
const char *kvf_status_str(int status);

/* The detailed message of the last failed call made by the calling thread,
 * e.g. "kvf_batch_submit: request 3: local memory: range is not registered:
 * [0x7f.., +64)". Successful calls leave it unchanged. Never NULL ("" when
 * this thread saw no failure). The string belongs to the library and stays
 * valid on this thread until its next failing kvferry call. Messages longer
 * than 2047 bytes are truncated. */
const char *kvf_last_error(void);

/* ------------------------------------------------------------------------ */
/* Handles and common types                                                 */
/* ------------------------------------------------------------------------ */

typedef struct kvf_engine_s *kvf_engine;   /* one transfer engine */
typedef struct kvf_segment_s *kvf_segment; /* an open peer, or the engine itself */
typedef struct kvf_batch_s *kvf_batch;     /* a set of requests waited on together */

#define KVF_TIMEOUT_DEFAULT (-1)

/* ------------------------------------------------------------------------ */
/* Engine                                                                   */
/* ------------------------------------------------------------------------ */

/* Log levels of kvf_engine_options.log_level. */
enum {
    KVF_LOG_DEFAULT = 0, /* KVFERRY_LOG_LEVEL, else warn (a host process's
                            log gets problems, not a line per peer) */
    KVF_LOG_DEBUG = 1,
    KVF_LOG_INFO = 2,
    KVF_LOG_WARN = 3,
    KVF_LOG_ERROR = 4,
    KVF_LOG_OFF = 5      /* no logs at all */
};

/* Flags of kvf_engine_options.flags. */
#define KVF_ENGINE_IGNORE_ENV 0x1u /* do not let KVFERRY_* variables override */

/* Options of kvf_engine_create. Zero (or NULL) fields take the defaults;
 * KVFERRY_* environment variables override fields unless
 * KVF_ENGINE_IGNORE_ENV is set. Initialise with kvf_engine_options_init. */
typedef struct kvf_engine_options {
    uint32_t struct_size;       /* sizeof(kvf_engine_options) */
    uint32_t flags;             /* KVF_ENGINE_* flags */
    const char *host;           /* listen address and host part of the segment
                                   name; NULL: "127.0.0.1". IPv6 bare: "::1".
                                   A host name ("localhost", the machine's
                                   name, an FQDN) is resolved at creation
                                   (its first IPv4 address, else its first)
                                   and stays the segment name's host */
    const char *protocol;       /* data-plane transport to remote segments:
                                   "auto" (shm with a peer on this host,
                                   rdma when both ends have an RDMA device,
                                   else tcp; logged once per peer), "tcp",
                                   "rdma" (creation fails with
                                   KVF_ERR_UNSUPPORTED without a device) or
                                   "shm" (peers on other hosts refused with
                                   KVF_ERR_UNSUPPORTED; creation fails so
                                   with authentication on);
                                   NULL: "auto". RDMA's library, devices,
                                   fence, retry count and completion timeout
                                   are set by KVFERRY_IBVERBS_LIBRARY,
                                   KVFERRY_RDMA_DEVICES, KVFERRY_RDMA_FENCE,
                                   KVFERRY_RDMA_RETRY_COUNT and
                                   KVFERRY_RDMA_COMPLETION_TIMEOUT_MS */
    int32_t port;               /* control port; 0: a free one (see kvf_engine_name) */
    int32_t paths_per_peer;     /* connections per peer, 1..64; 0: 4 */
    uint64_t slice_size;        /* largest piece of a request, 4 KiB..64 MiB;
                                   0: 1 MiB */
    int32_t max_retries;        /* re-posts of a slice after a broken path;
                                   0: 2, -1: none */
    int32_t default_timeout_ms; /* deadline of calls given KVF_TIMEOUT_DEFAULT;
                                   0: 30000 */
    int32_t io_timeout_ms;      /* bound on writing one frame to a socket
                                   (up to 4 MiB, or one READ answer); 0: 30000 */
    int32_t heartbeat_ms;       /* ping period of open segments; 0: 1000 */
    int32_t heartbeat_misses;   /* missed pings before a peer is dead; 0: 5 */
    int32_t log_level;          /* KVF_LOG_*; logs go to stderr */
    int32_t go_max_procs;       /* > 0: set the Go scheduler's thread count
                                   (GOMAXPROCS); 0: keep. It is PROCESS-WIDE,
                                   not per engine: one Go runtime serves every
                                   engine of the process, so the last engine
                                   created with a value sets it for all (a
                                   change of a value an earlier engine set is
                                   logged as a warning). Set it on one engine,
                                   or leave it 0 and set GOMAXPROCS in the
                                   environment. */
    int32_t reserved;           /* must be 0 */
    /* Since 0.5. Authentication is off unless secret_key_file with
     * allowlist_file, or cluster_secret_file, is set; then every peer, on
     * the control plane (CURVE) and on tcp data connections, must prove a
     * key the allowlist holds, and the engine talks to no peer that does
     * not. KVFERRY_ADVERTISE_HOST, KVFERRY_SECRET_KEY_FILE,
     * KVFERRY_ALLOWLIST_FILE and KVFERRY_CLUSTER_SECRET_FILE override. */
    const char *advertise_host;      /* host peers reach us at when it is not
                                        host (containers, NAT, multi-homed);
                                        names the segment and the data-plane
                                        addresses. NULL: host; for a wildcard
                                        host ("0.0.0.0", "::"), the machine's
                                        name or first non-loopback address */
    const char *secret_key_file;     /* our CURVE secret key, 40 Z85
                                        characters or a czmq certificate
                                        (`kvferry keygen`); mode 0600 */
    const char *allowlist_file;      /* peers' public keys, one Z85 key per
                                        line; read again by
                                        kvf_engine_reload_allowlist */
    const char *cluster_secret_file; /* instead of the two above: a secret
                                        (>= 16 bytes, mode 0600) every engine
                                        of the cluster shares */
    /* Since 0.6. KVFERRY_METRICS_ADDR overrides. */
    const char *metrics_addr;        /* serve the engine's metrics at
                                        http://metrics_addr/metrics (Prometheus
                                        text format); "host:0" picks a free
                                        port (kvf_metrics_addr says which).
                                        Engines of a process asking for one
                                        address share its listener; one that
                                        cannot listen (port in use) logs a
                                        warning and the engine starts anyway.
                                        NULL: no listener (kvf_metrics_text
                                        still gives the text) */
    /* Since 0.7. KVFERRY_METADATA overrides. */
    const char *metadata;            /* where segments are found:
                                        "etcd://host:port[,host:port]/prefix"
                                        keeps this engine's descriptor in etcd
                                        under the prefix (default prefix
                                        "kvferry"), with a lease (gone 10 s
                                        after the engine dies, at once when it
                                        is destroyed), and opens segments by
                                        name through it; creation fails with
                                        KVF_ERR_INVALID_ARG when the store
                                        does not take the entry within
                                        default_timeout_ms (at most 10 s).
                                        Transfers to open segments go on
                                        while the store is away; opening a
                                        segment then fails by its deadline.
                                        NULL or "p2p": ask each segment itself
                                        (P2P handshake) */
} kvf_engine_options;

/* Sets every field to its default (zero) and struct_size to the size this
 * program was compiled with. */
static inline void kvf_engine_options_init(kvf_engine_options *opts) {
    memset(opts, 0, sizeof *opts);
    opts->struct_size = (uint32_t)sizeof *opts;
}

/* Creates an engine: binds its control plane on host:port and its data plane
 * on host. opts may be NULL (all defaults). On success *out is the engine;
 * destroy it with kvf_engine_destroy. A struct_size larger than this library
 * knows is accepted when the unknown tail is all zero, else
 * KVF_ERR_UNSUPPORTED. A host that is not this machine's or a port in use
 * is KVF_ERR_INVALID, naming the address. Blocks for the binds only. */
kvf_status kvf_engine_create(const kvf_engine_options *opts, kvf_engine *out);

/* Destroys an engine: transfers in flight end CANCELED, open segments are
 * closed, batches freed, buffers from kvf_alloc_buffer that were not freed
 * are unmapped, and every handle of the engine becomes stale. Returns once no
 * thread, socket or copy of the engine remains (bounded by one socket write
 * or one copy chunk). Calls racing with it on the same engine return an
 * error (KVF_ERR_HANDLE once the handle is gone; KVF_ERR_CLOSED or
 * KVF_ERR_CANCELED while it closes), never crash. */
kvf_status kvf_engine_destroy(kvf_engine engine);

/* Copies the engine's segment name, "host:port" ("[::1]:port" for IPv6),
 * NUL-terminated, into buf of cap bytes. *len_out (may be NULL) receives the
 * name's length without the NUL, also on KVF_ERR_TRUNCATED (cap <= length;
 * nothing is written then). buf NULL with cap 0 is a length query and
 * returns KVF_OK. Peers open the engine by this name. */
kvf_status kvf_engine_name(kvf_engine engine, char *buf, size_t cap, size_t *len_out);

/* Copies the engine's public key (40 Z85 characters, what peers list in
 * their allowlist files), NUL-terminated, into buf of cap bytes, as
 * kvf_engine_name does. KVF_ERR_UNSUPPORTED when authentication is off. */
kvf_status kvf_engine_public_key(kvf_engine engine, char *buf, size_t cap, size_t *len_out);

/* Reads the allowlist file again. Peers whose keys it no longer lists are
 * cut before it returns: control and tcp data connections closed, rdma QPs
 * moved to the error state and destroyed, so no byte of theirs lands
 * afterwards; their next connection is refused. KVF_ERR_INVALID when the
 * engine has no allowlist file (authentication off, or a cluster secret)
 * or the file is unusable (the allowlist in force stays); KVF_ERR_TIMEOUT
 * when cutting did not finish within timeout_ms (KVF_TIMEOUT_DEFAULT: the
 * engine's default timeout). */
kvf_status kvf_engine_reload_allowlist(kvf_engine engine, int timeout_ms);

/* A snapshot of an engine's counters. Set struct_size before the call; the
 * library fills the fields it knows up to struct_size. */
typedef struct kvf_stats {
    uint32_t struct_size;      /* in: sizeof(kvf_stats) */
    uint32_t reserved;
    uint64_t bytes_written;    /* bytes of completed WRITE tasks we initiated */
    uint64_t bytes_read;       /* bytes of completed READ tasks we initiated */
    uint64_t tasks_completed;
    uint64_t tasks_failed;     /* FAILED, TIMEOUT and ABORTED tasks */
    uint64_t tasks_canceled;
    int64_t tasks_in_flight;
    uint64_t retries;          /* slices posted again after a broken path */
    uint64_t owner_bytes_in;   /* bytes peers wrote into our memory */
    uint64_t owner_bytes_out;  /* bytes peers read from our memory */
    uint64_t owner_refused;    /* peer accesses we refused */
    uint64_t refused_in_flight;/* refusals that struck mid-slice */
    uint64_t protocol_errors;  /* data connections dropped for malformed frames */
    uint64_t control_dropped;  /* malformed control messages dropped */
    uint64_t control_late;     /* control replies that matched no request */
    uint64_t registrations;    /* registered ranges */
    uint64_t open_segments;
    /* Since 0.2 (filled when struct_size covers them). */
    uint64_t aborts_safe;      /* kvf_abort calls that reported safe */
    uint64_t aborts_not_safe;  /* kvf_abort calls that did not */
    uint64_t abort_acks;       /* ABORT_ACKs that completed an initiator's part */
    uint64_t acks_unmatched;   /* ABORT_ACKs dropped: late, duplicate, unknown */
    uint64_t aborts_received;  /* ABORTs received as initiator (duplicates too) */
    uint64_t tasks_aborted;    /* our tasks that ended ABORTED */
    uint64_t tombstones;       /* aborted request ids remembered as owner */
    uint64_t events_dropped;   /* events dropped because the queue was full */
    /* Since 0.3: what peers make the engine spend (README: "What a peer
     * can make an engine spend"). */
    uint64_t control_conns; /* control connections peers hold to us now */
    uint64_t control_conns_refused; /* control connections closed at once at a cap */
    uint64_t control_conns_cut; /* control connections closed for a protocol error or a timeout */
    uint64_t control_over_budget; /* control messages dropped unread: buffer budget spent */
    uint64_t control_send_fails; /* control messages not sent (no connection for an answer, queue full) */
    uint64_t data_conns; /* tcp data connections peers hold to us now */
    uint64_t conns_refused; /* tcp data connections closed at once at a cap */
    uint64_t idle_closed; /* tcp data connections closed idle (with GOAWAY) */
    uint64_t frame_timeouts; /* tcp data connections closed for a frame too slow */
    uint64_t accept_errors; /* failed accepts on the data port, retried after a backoff */
    uint64_t aborts_dropped; /* ABORTs dropped unanswered for want of room (the owner resends) */
    uint64_t canceled_dropped; /* CANCELED messages from peers that could not touch the request */
    uint64_t rdma_responder_qps; /* QPs made for initiators connected to us */
    uint64_t rdma_connects_refused; /* rdma connect requests refused at the QP cap */
    /* Since 0.4: fences by memory range (kvf_fence_memory). */
    uint64_t fences_safe;          /* kvf_fence_memory calls that reported safe */
    uint64_t fences_not_safe;      /* kvf_fence_memory calls that did not */
    uint64_t fence_epoch;          /* the last fence's epoch (0: none yet) */
    uint64_t fence_refused;        /* accesses (peers' and our own to the local
                                      segment) refused as planned before a fence */
    uint64_t fence_acks;           /* fence notices acknowledged by the peers told */
    uint64_t fence_acks_unmatched; /* acknowledgements dropped: late, duplicate, unknown */
    uint64_t fences_received;      /* fence notices received from owners we write to or read from */
    uint64_t auth_refused;         /* since 0.5: peers refused for authentication (control
                                      and data connections), or cut when their key left the allowlist */
} kvf_stats;

/* Fills *out (struct_size set by the caller, at least 8). Never blocks. */
kvf_status kvf_engine_stats(kvf_engine engine, kvf_stats *out);

/* Since 0.6. Copies the engine's metrics in the Prometheus text format
 * (version 0.0.4: what a /metrics endpoint serves), NUL-terminated, into buf
 * of cap bytes, as kvf_engine_name does: *len_out (may be NULL) receives the
 * text's length without the NUL, also on KVF_ERR_TRUNCATED (nothing is
 * written then); buf NULL with cap 0 is a length query. The text is made
 * afresh at each call and may have grown since a length query: on
 * KVF_ERR_TRUNCATED call again with a larger buffer (some headroom, say a
 * quarter more, saves a third call). Every series carries the label
 * engine="<segment name>". Each text is one complete exposition, declaring
 * its families (# HELP, # TYPE): two engines' texts cannot simply be
 * appended. To serve several engines on one page, give them one
 * metrics_addr (they share its listener), or merge the parsed families
 * (Python: kvferry.register_prometheus per engine). A host process that
 * serves /metrics (SGLang, vLLM) adds this text's families to its own;
 * metrics_addr or KVFERRY_METRICS_ADDR has the library serve it instead.
 * Thread-safe; it reads counters and never blocks on transfers. */
kvf_status kvf_metrics_text(kvf_engine engine, char *buf, size_t cap, size_t *len_out);

/* Since 0.6. Copies the address the engine's metrics listener serves at
 * ("127.0.0.1:9400": GET http://<it>/metrics), as kvf_engine_name does; the
 * empty string when none does (metrics_addr unset, or its listener could not
 * start). */
kvf_status kvf_metrics_addr(kvf_engine engine, char *buf, size_t cap, size_t *len_out);

/* ------------------------------------------------------------------------ */
/* Memory                                                                   */
/* ------------------------------------------------------------------------ */

/* Locations: NULL or "cpu" (host memory), "cpu:N" (NUMA node N), "cuda:N"
 * (GPU N's memory, checked with the CUDA driver, libcuda.so.1 or
 * KVFERRY_CUDA_LIBRARY, loaded at run time), "*" (the engine finds out: GPU
 * memory and its device, else the NUMA node). "cuda:N" without a driver is
 * KVF_ERR_UNSUPPORTED; memory not on device N is KVF_ERR_INVALID. GPU
 * memory moves directly over rdma and through host staging buffers over
 * tcp. */

/* Registers [addr, addr+len) so that transfers may read or write it, locally
 * and by peers. The memory stays owned by the caller, who must keep it mapped
 * until kvf_unregister_memory returned. Ranges may not overlap a registered
 * range (KVF_ERR_OVERLAP). Addresses in the first page (< 4096) are refused.
 * Never blocks on the network. */
kvf_status kvf_register_memory(kvf_engine engine, void *addr, size_t len, const char *location);

/* Removes the registration starting at addr. Returns once no copy into or
 * out of the range is in progress and none can start: the memory may be
 * reused or freed at once. Transfers of it still queued fail. Blocks for at
 * most one copy chunk. KVF_ERR_NOT_REGISTERED when nothing starts at addr. */
kvf_status kvf_unregister_memory(kvf_engine engine, void *addr);

typedef struct kvf_memory_range {
    void *addr;
    size_t len;
    const char *location; /* as for kvf_register_memory; NULL: "cpu" */
} kvf_memory_range;

/* Registers n ranges, all or none. */
kvf_status kvf_register_memory_batch(kvf_engine engine, const kvf_memory_range *ranges, size_t n);

/* Unregisters n ranges by start address, all or none. */
kvf_status kvf_unregister_memory_batch(kvf_engine engine, void *const *addrs, size_t n);

/* Maps len bytes of shareable memory (a sealed memfd) outside any heap,
 * zero-filled, and registers them: an engine on the same host copies into
 * and out of them through a view of their pages (the shm transport). *out
 * receives the address. The engine owns the memory: free it with
 * kvf_free_buffer, or kvf_engine_destroy unmaps it. */
kvf_status kvf_alloc_buffer(kvf_engine engine, size_t len, const char *location, void **out);

/* Unregisters (waiting for copies in progress, as kvf_unregister_memory)
 * and unmaps a buffer from kvf_alloc_buffer. KVF_ERR_INVALID when addr is not
 * the start of such a buffer of this engine. */
kvf_status kvf_free_buffer(kvf_engine engine, void *addr);

/* ------------------------------------------------------------------------ */
/* Segments                                                                 */
/* ------------------------------------------------------------------------ */

/* Opens the segment called name ("host:port"; the host may be a name, resolved
 * when it is used): fetches its descriptor (its
 * registered buffers and transport addresses) from the peer itself. The
 * engine's own name opens the local segment (transfers become a checked
 * memcpy). Blocks up to timeout_ms (> 0, or KVF_TIMEOUT_DEFAULT: the
 * engine's default); a peer that does not answer in time gives
 * KVF_ERR_UNREACHABLE, and so does, at once, a name where nothing listens
 * (connection refused).
 * Each call returns a new handle; handles of the same name share one
 * connection set, which closes when the last of them is closed. */
kvf_status kvf_open_segment(kvf_engine engine, const char *name, int timeout_ms, kvf_segment *out);

/* Closes a segment handle. When it was the last handle of that name,
 * transfers to the segment still in flight fail and the connections close.
 * May wait for a kvf_open_segment of the same engine in progress. */
kvf_status kvf_close_segment(kvf_segment segment);

/* Number of registered buffers in the segment's cached descriptor (fetched
 * at open, refreshed when a request names a range it lacks). */
kvf_status kvf_segment_buffer_count(kvf_segment segment, size_t *count);

/* Address and length of the segment's buffer number index (in address
 * order) in the cached descriptor, e.g. to find the peer's first buffer as
 * Mooncake's get_first_buffer_address does. KVF_ERR_INVALID when index is
 * out of range. Either output may be NULL. */
kvf_status kvf_segment_buffer(kvf_segment segment, size_t index, uint64_t *addr, uint64_t *len);

/* Copies the segment's name like kvf_engine_name. */
kvf_status kvf_segment_name(kvf_segment segment, char *buf, size_t cap, size_t *len_out);

/* ------------------------------------------------------------------------ */
/* Requests, batches and transfers                                          */
/* ------------------------------------------------------------------------ */

typedef enum kvf_op {
    KVF_OP_READ = 0,  /* copy the segment's memory into ours */
    KVF_OP_WRITE = 1  /* copy our memory into the segment's */
} kvf_op;

/* One transfer: length bytes between our registered memory at local and the
 * segment's registered memory at remote. */
typedef struct kvf_request {
    uint32_t op;          /* kvf_op */
    uint32_t flags;       /* must be 0 */
    void *local;          /* in this process's registered memory */
    kvf_segment segment;  /* the peer, or the local segment */
    uint64_t remote;      /* address in the segment's registered memory */
    uint64_t length;      /* bytes, > 0 */
    uint64_t request_id;  /* the application's request id (0: none); aborts
                             act per request id */
} kvf_request;

/* Task states. WAITING and PENDING are in flight; the others are final. */
typedef enum kvf_task_state {
    KVF_TASK_WAITING = 0,   /* accepted, not yet posted */
    KVF_TASK_PENDING = 1,   /* posted, not all bytes landed */
    KVF_TASK_COMPLETED = 2, /* every byte landed (a WRITE was applied by the owner) */
    KVF_TASK_FAILED = 3,
    KVF_TASK_TIMEOUT = 4,   /* the deadline passed; its memory is untouched since */
    KVF_TASK_CANCELED = 5,  /* canceled; likewise */
    KVF_TASK_ABORTED = 6    /* the owner aborted its request id */
} kvf_task_state;

/* A static name of a task state ("COMPLETED", ...), "UNKNOWN" otherwise. */
const char *kvf_task_state_str(int state);

typedef struct kvf_task_status {
    int32_t state;        /* kvf_task_state */
    int32_t error;        /* kvf_status: why a final task did not complete;
                             KVF_OK while in flight or when COMPLETED. A
                             FAILED task the owner's fence stopped has
                             KVF_ERR_FENCED */
    uint64_t transferred; /* bytes confirmed moved; a lower bound if it failed */
} kvf_task_status;

/* Allocates a batch for up to capacity requests in total. Free it with
 * kvf_batch_free. */
kvf_status kvf_batch_alloc(kvf_engine engine, size_t capacity, kvf_batch *out);

/* Checks every request of reqs[0..n), then starts them all; if any request
 * is invalid (bad op or flags, NULL local, zero length, wrapping range,
 * memory not registered here or at the segment) none starts and the error
 * names the request's index ("request 3: ..."). Task i of the batch is the
 * i-th request ever submitted to it. The array is read during the call
 * only, converted in one pass. May block for a descriptor refresh or a
 * connection setup, up to the engine's default timeout; small copies to the
 * local segment run inside the call. */
kvf_status kvf_batch_submit(kvf_batch batch, const kvf_request *reqs, size_t n);

/* The state of task index (0-based, in submission order); KVF_ERR_INVALID
 * when index >= the number of submitted requests. Never blocks. */
kvf_status kvf_batch_status(kvf_batch batch, size_t index, kvf_task_status *out);

/* The states of all tasks, in submission order: out receives
 * min(cap, submitted) entries and *n_out (may be NULL) the number of
 * submitted tasks. out may be NULL when cap is 0. Never blocks. */
kvf_status kvf_batch_status_all(kvf_batch batch, kvf_task_status *out, size_t cap, size_t *n_out);

/* Copies the message of task index's error (NUL-terminated; "" while the
 * task is in flight or when it completed), like kvf_engine_name. */
kvf_status kvf_batch_task_error(kvf_batch batch, size_t index, char *buf, size_t cap, size_t *len_out);

/* Waits until every submitted task is final, or timeout_ms passed (0: do
 * not wait). Returns KVF_OK when every task COMPLETED; when all are final but
 * some did not complete, the error code of the first such task (its message
 * in kvf_last_error); KVF_ERR_TIMEOUT when tasks are still in flight: they
 * keep running - wait again, or cancel. timeout_ms: >= 0 or
 * KVF_TIMEOUT_DEFAULT. Costs O(tasks submitted to the batch) after the wait:
 * allocate a batch per set of requests rather than one huge batch. */
kvf_status kvf_batch_wait(kvf_batch batch, int timeout_ms);

/* Ends every task still in flight as CANCELED and returns once the engine no
 * longer touches their memory: one socket write or copy chunk (a staging
 * chunk for GPU memory); on rdma, work already posted completes or, after
 * 50 ms, the NIC paths holding it are flushed. KVF_ERR_IN_USE when a path
 * could not confirm it within about 6 s: the memory may still be touched. */
kvf_status kvf_batch_cancel(kvf_batch batch);

/* Frees the batch; refused with KVF_ERR_BUSY while tasks are in flight (wait
 * or cancel first). The handle is stale afterwards. */
kvf_status kvf_batch_free(kvf_batch batch);

/* Runs reqs[0..n) synchronously and returns when every request is final, or
 * at the deadline timeout_ms (> 0, or KVF_TIMEOUT_DEFAULT): then the
 * remaining tasks end TIMEOUT, and the call returns only after the engine
 * stopped touching their memory (as kvf_batch_cancel: KVF_ERR_IN_USE when
 * that could not be confirmed). Returns KVF_OK when
 * every request completed, else the error of the first that did not. out
 * (may be NULL) receives n task states, also on failure once the requests
 * were started; a request rejected before start (KVF_ERR_INVALID, ...)
 * leaves out untouched. */
kvf_status kvf_transfer_sync(kvf_engine engine, const kvf_request *reqs, size_t n, int timeout_ms,
                             kvf_task_status *out);

/* ------------------------------------------------------------------------ */
/* Safe abort, grants, notifications and events                            */
/* ------------------------------------------------------------------------ */
/* The promises these functions keep are kvferry's safety contract,
 * docs/SAFETY.md in the source tree: a safe abort means no further byte of
 * the request can be written into or read from our memory, whatever the
 * initiators do next (slow, paused, crashed, partitioned, retrying).
 *
 * Generations: the owner keeps a generation per request id, 0 at first and
 * bumped by each abort; accesses below it are refused. kvf_request carries no
 * generation in this ABI version, so from C a request id once aborted cannot
 * be used again: take a new one (as SGLang's bootstrap rooms are). */

/* Outcome of kvf_abort. */
typedef struct kvf_abort_result {
    uint32_t struct_size;     /* in: sizeof(kvf_abort_result) */
    uint32_t safe;            /* 1: no further byte of the request can touch our
                                 memory; 0: not safe (reason in kvf_last_error) */
    uint64_t generation;      /* the request id's generation after the abort */
    uint64_t bytes_confirmed; /* lower bound of the bytes that landed, from the
                                 initiators' ABORT_ACKs received by the return */
} kvf_abort_result;

/* Owner side: aborts request_id for the n initiators named (their segment
 * names; n == 0: name none, refusal alone stops every initiator). From the
 * call on, every access of the request (writes into our memory, reads served
 * from it) is refused chunk by chunk; the call returns once no copy of it is
 * in progress, which on tcp does not wait for the initiators. Each named
 * initiator is sent ABORT, resent until it answers ABORT_ACK or timeout_ms
 * passes; its transfers of the request end KVF_TASK_ABORTED and it gets a
 * KVF_EVENT_ABORTED event.
 * Returns KVF_OK with out->safe = 1, or, when safety could not be reached by
 * timeout_ms (> 0, or KVF_TIMEOUT_DEFAULT), out->safe = 0 and an error
 * (KVF_ERR_TIMEOUT, ...) whose kvf_last_error says why. Returns by the
 * deadline plus one copy chunk. After a safe abort the memory may be reused
 * at once. request_id 0 is KVF_ERR_INVALID: an abort stops only the
 * transfers that carry its request id. Transfers without one (request id 0,
 * as Mooncake-based frameworks send) are stopped by kvf_fence_memory of
 * their ranges, by unregistering the memory or by destroying the engine. */
kvf_status kvf_abort(kvf_engine engine, uint64_t request_id, const char *const *initiators, size_t n,
                     int timeout_ms, kvf_abort_result *out);

typedef struct kvf_grant_range {
    uint64_t addr;
    uint64_t len;
} kvf_grant_range;

/* Owner side: lets initiator (a segment name) access ranges[0..n) (n at most
 * 4096) of our registered memory for request_id. From a request id's first
 * grant on, every access of it must fall inside a live grant of its
 * initiator, or it is refused (KVF_ERR_REFUSED at the initiator); without
 * grants a registered range is open to every peer. *grant_id receives the
 * grant's id. Never blocks. */
kvf_status kvf_grant(kvf_engine engine, const char *initiator, uint64_t request_id,
                     const kvf_grant_range *ranges, size_t n, uint64_t *grant_id);

/* Owner side: withdraws a grant: accesses under it are refused from now on.
 * Returns once no copy of its request is in progress, or KVF_ERR_TIMEOUT at
 * timeout_ms (the grant stays withdrawn). An unknown grant_id is
 * KVF_ERR_INVALID. */
kvf_status kvf_revoke(kvf_engine engine, uint64_t grant_id, int timeout_ms);

/* Sends a small message (at most KVF_EVENT_DATA_MAX bytes; len 0 allowed)
 * about request_id to the segment's engine, which gets it as a
 * KVF_EVENT_NOTIFY event. Returns once the peer queued it; KVF_ERR_BUSY when
 * the peer's event queue is full (backpressure: retry later);
 * KVF_ERR_UNREACHABLE after the engine's default timeout. A notification
 * sent after a WRITE completed arrives after that WRITE's bytes are visible
 * at the peer. */
kvf_status kvf_notify(kvf_segment segment, uint64_t request_id, const void *data, size_t len);

#define KVF_EVENT_DATA_MAX 64
#define KVF_EVENT_PEER_MAX 64

typedef enum kvf_event_type {
    KVF_EVENT_NONE = 0,
    KVF_EVENT_ABORTED = 1, /* an owner (peer) aborted request_id below
                              generation: our transfers of it to that owner
                              end ABORTED, now and later */
    KVF_EVENT_NOTIFY = 2,  /* a peer's kvf_notify */
    KVF_EVENT_CANCELED = 3 /* since 0.2: a peer, initiator of request_id, gave
                              up on it (a deadline passed or it canceled) and
                              moves no more bytes of it; told best effort */
} kvf_event_type;

typedef struct kvf_event {
    uint32_t type;                    /* kvf_event_type */
    uint32_t data_len;                /* bytes used in data */
    uint64_t request_id;
    uint64_t generation;
    char peer[KVF_EVENT_PEER_MAX];    /* segment name of the peer, NUL-terminated */
    uint8_t data[KVF_EVENT_DATA_MAX];
} kvf_event;

/* Takes up to cap pending events into out (in arrival order); *n_out
 * receives how many. Waits up to timeout_ms (>= 0) for the first one; 0 does
 * not wait. *n_out = 0 with KVF_OK means none arrived in time. At most 4096
 * events wait (KVFERRY_EVENT_QUEUE sets another bound); when they are full, notifications are refused to their senders with
 * KVF_ERR_BUSY and abort events are dropped (counted in events_dropped; the
 * tasks still end ABORTED). */
kvf_status kvf_poll_events(kvf_engine engine, kvf_event *out, size_t cap, size_t *n_out, int timeout_ms);

/* Since 0.2. *fd receives a file descriptor (an eventfd) that polls readable
 * while events may be pending, for event loops (epoll, asyncio's add_reader).
 * kvf_poll_events resets it when it leaves no event pending; a spurious
 * wake-up is possible, a missed one is not. Do not read or close it:
 * kvf_engine_destroy closes it. */
kvf_status kvf_event_fd(kvf_engine engine, int *fd);

/* ------------------------------------------------------------------------ */
/* Fences by memory range                                                   */
/* ------------------------------------------------------------------------ */
/* Since 0.4. kvf_abort stops the transfers that carry one request id; a
 * fence stops every transfer into or out of ranges of our memory, whatever
 * its request id (0, "no request", included) and whichever peer initiated
 * it. It is what protects an owner whose peers pass no request id (SGLang's
 * and vLLM's Mooncake wrappers): decode fences a request's pages before it
 * frees or reuses them. A transfer is "planned before" a fence when it was
 * submitted under an earlier fence epoch, a number the owner issues (not a
 * matter of timing); a fence refuses exactly those, for the bytes it covers.
 * What a safe fence promises is written in docs/SAFETY.md. */

/* Largest n of kvf_fence_memory. */
#define KVF_FENCE_RANGES_MAX 524288

/* Outcome of kvf_fence_memory. */
typedef struct kvf_fence_result {
    uint32_t struct_size; /* in: sizeof(kvf_fence_result) */
    uint32_t safe;        /* 1: no transfer planned before the call can write
                             into or read from the ranges any more; 0: not
                             safe (reason in kvf_last_error) */
    uint64_t epoch;       /* the fence's epoch: transfers planned from now
                             on carry it (or a later one) and pass */
    uint32_t peers_told;  /* peers sent the fence notice: those that fetched
                             our descriptor or pinged us lately and hold a
                             control connection to us, and rdma initiators */
    uint32_t peers_acked; /* of those, the ones that acknowledged it by the
                             return: their next transfers carry the epoch */
    uint32_t peers_cut;   /* rdma initiators whose QPs to us were moved to
                             the error state (their other work is posted
                             again on new QPs) */
    uint32_t reserved;    /* written as 0 */
} kvf_fence_result;

/* Owner side: fences the ranges [addrs[i], addrs[i] + lengths[i]), i < n, of
 * our registered memory (1 <= n <= KVF_FENCE_RANGES_MAX; each range inside
 * one registration or several adjacent ones). From the call on, every access
 * to them planned before it is refused chunk by chunk, whatever its request
 * id (0 included) and initiator, and whatever that initiator does next
 * (paused, dead, partitioned, retrying, refreshing its descriptor): its task
 * ends KVF_TASK_FAILED with KVF_ERR_FENCED and is never retried. Accesses
 * to other memory go on untouched.
 *
 * Transfers planned after the call pass. The peers that may plan transfers
 * to us are told, and the call waits a little (KVFERRY_FENCE_GRACE_MS, 50 ms
 * by default) for their acknowledgements, so that when the application
 * tells a writer about the pages only after the call returned, the writer's
 * next transfers into them do not fail because of the fence. A peer that
 * did not acknowledge in time (paused, partitioned) is fenced all the same;
 * it learns the epoch from the notice, resent until the deadline, or from
 * the refusal of its first transfer planned before the fence.
 *
 * Returns KVF_OK with out->safe = 1 once no copy of a fenced access is in
 * progress (tcp, local) and no NIC can execute one (rdma: the responder QPs
 * of every initiator were moved to the error state). When that could not be
 * reached by timeout_ms (> 0, or KVF_TIMEOUT_DEFAULT), it returns an error
 * (KVF_ERR_TIMEOUT; KVF_ERR_UNSUPPORTED on an engine with the rdma transport
 * and KVFERRY_RDMA_FENCE=0, where initiators may hold rkeys that only the
 * QP fence revokes) with out->safe = 0 and the reason in
 * kvf_last_error; the other fields of *out are filled in both cases. Returns
 * by the deadline plus one copy chunk. After a safe fence the memory may be
 * reused at once.
 *
 * NULL addrs, lengths or out, n = 0 or above the maximum, a zero length, an
 * address in the first page, a range that wraps around or a bad timeout are
 * KVF_ERR_INVALID; a range not entirely in registered memory is
 * KVF_ERR_NOT_REGISTERED. The message names the range ("range 3 ..."); no
 * range is fenced then and *out is untouched. The arrays are read during
 * the call only. */
kvf_status kvf_fence_memory(kvf_engine engine, const uint64_t *addrs, const uint64_t *lengths, size_t n,
                            int timeout_ms, kvf_fence_result *out);

#ifdef __cplusplus
} /* extern "C" */
#endif

#endif /* KVFERRY_H */
