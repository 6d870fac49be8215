// kvferry.hpp - C++17 RAII wrapper of the kvferry C API (kvferry.h).
//
// Engine, Segment, Batch and Buffer own one C handle or buffer each and
// release it in their destructor; they are movable, not copyable. Every
// failure throws kvferry::Error, which carries the kvf_status code and the
// library's detailed message. Outcomes that are results rather than
// failures are returned instead: a batch still in flight (Batch::wait), an
// abort or a fence that is not safe (Engine::abort, Engine::fence), a
// peer's full event queue (Segment::notify). Destructors never throw: a
// Segment, Batch or Buffer that outlives its Engine finds its handle stale
// and does nothing (kvf_engine_destroy already released it).
//
// What a safe abort and a safe fence promise is kvferry's safety contract,
// docs/SAFETY.md in the source tree.
//
// Thread-safety is the C API's: every object may be used from any thread.
#ifndef KVFERRY_HPP
#define KVFERRY_HPP

#if !defined(__cplusplus) || __cplusplus < 201703L
#error "kvferry.hpp needs C++17 (CMake: set CMAKE_CXX_STANDARD 17 or target_compile_features(<target> PRIVATE cxx_std_17); GCC/Clang: -std=c++17); C code includes kvferry.h"
#endif

#include <cstddef>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "kvferry.h"

namespace kvferry {

// Error is what every failing call throws.
class Error : public std::runtime_error {
public:
    Error(kvf_status code, const std::string &message) : std::runtime_error(message), code_(code) {}
    // The status code (KVF_ERR_*).
    kvf_status code() const noexcept { return code_; }
    // The code's static name, e.g. "invalid argument".
    const char *code_str() const noexcept { return kvf_status_str(code_); }

private:
    kvf_status code_;
};

namespace detail {
// Throws the calling thread's last error when st is not KVF_OK.
inline void check(kvf_status st) {
    if (st != KVF_OK) throw Error(st, kvf_last_error());
}

template <typename H, typename F>
std::string name_of(H h, F f) {
    size_t n = 0;
    check(f(h, nullptr, 0, &n));
    std::string s(n + 1, '\0');
    check(f(h, &s[0], s.size(), &n));
    s.resize(n);
    return s;
}
} // namespace detail

// Options of an engine; zero and empty values take the defaults (see
// kvf_engine_options).
struct Options {
    std::string host;     // "" : 127.0.0.1; a host name is resolved, and kept as the segment name's host
    std::string protocol; // "" : auto (rdma when both ends have an RDMA device, else tcp)
    int port = 0;
    int paths_per_peer = 0;
    uint64_t slice_size = 0;
    int max_retries = 0;
    int default_timeout_ms = 0;
    int io_timeout_ms = 0;
    int heartbeat_ms = 0;
    int heartbeat_misses = 0;
    int log_level = KVF_LOG_DEFAULT;
    int go_max_procs = 0; // process-wide: see kvf_engine_options
    bool ignore_env = false;
    // Since 0.5: bind vs advertise, and authentication (off unless a
    // secret key file with an allowlist, or a cluster secret, is given).
    std::string advertise_host;      // "" : host (wildcard host: the machine's name or first address)
    std::string secret_key_file;     // our CURVE secret key (kvferry keygen), mode 0600
    std::string allowlist_file;      // peers' public keys; reread by Engine::reload_allowlist
    std::string cluster_secret_file; // instead of the two above: a secret the cluster shares
    std::string metrics_addr;        // "" : no metrics listener; "host:port" serves /metrics
    std::string metadata;            // "" : P2P; "etcd://host:port/prefix": segments found in etcd

    // The C struct; its strings point into this object.
    kvf_engine_options c() const {
        kvf_engine_options o;
        kvf_engine_options_init(&o);
        o.flags = ignore_env ? KVF_ENGINE_IGNORE_ENV : 0u;
        o.host = host.empty() ? nullptr : host.c_str();
        o.protocol = protocol.empty() ? nullptr : protocol.c_str();
        o.port = port;
        o.paths_per_peer = paths_per_peer;
        o.slice_size = slice_size;
        o.max_retries = max_retries;
        o.default_timeout_ms = default_timeout_ms;
        o.io_timeout_ms = io_timeout_ms;
        o.heartbeat_ms = heartbeat_ms;
        o.heartbeat_misses = heartbeat_misses;
        o.log_level = log_level;
        o.go_max_procs = go_max_procs;
        o.advertise_host = advertise_host.empty() ? nullptr : advertise_host.c_str();
        o.secret_key_file = secret_key_file.empty() ? nullptr : secret_key_file.c_str();
        o.allowlist_file = allowlist_file.empty() ? nullptr : allowlist_file.c_str();
        o.cluster_secret_file = cluster_secret_file.empty() ? nullptr : cluster_secret_file.c_str();
        o.metrics_addr = metrics_addr.empty() ? nullptr : metrics_addr.c_str();
        o.metadata = metadata.empty() ? nullptr : metadata.c_str();
        return o;
    }
};

// AbortResult is the outcome of Engine::abort (kvf_abort_result).
struct AbortResult {
    // No further byte of the request can touch the owner's memory, which
    // may be reused at once.
    bool safe = false;
    // The request id's generation after the abort.
    uint64_t generation = 0;
    // Lower bound of the bytes that landed, from the ACKs received in time.
    uint64_t bytes_confirmed = 0;
    // When not safe: why (KVF_ERR_TIMEOUT, ...) and the library's message.
    kvf_status code = KVF_OK;
    std::string reason;

    explicit operator bool() const noexcept { return safe; }
};

// FenceResult is the outcome of Engine::fence (kvf_fence_result).
struct FenceResult {
    // No transfer planned before the fence, whatever its request id (0
    // included) and initiator, can touch the ranges any more: they may be
    // reused at once.
    bool safe = false;
    // The fence's epoch: transfers planned from now on carry it and pass.
    uint64_t epoch = 0;
    // Peers sent the fence notice, those that acknowledged it by the
    // return, and rdma initiators whose QPs to us were cut.
    uint32_t peers_told = 0;
    uint32_t peers_acked = 0;
    uint32_t peers_cut = 0;
    // When not safe: why (KVF_ERR_TIMEOUT, ...) and the library's message.
    kvf_status code = KVF_OK;
    std::string reason;

    explicit operator bool() const noexcept { return safe; }
};

// Segment is an open peer (or the engine's own segment).
class Segment {
public:
    Segment() noexcept = default;
    explicit Segment(kvf_segment h) noexcept : h_(h) {}
    ~Segment() { reset(); }
    Segment(Segment &&o) noexcept : h_(std::exchange(o.h_, nullptr)) {}
    Segment &operator=(Segment &&o) noexcept {
        if (this != &o) {
            reset();
            h_ = std::exchange(o.h_, nullptr);
        }
        return *this;
    }
    Segment(const Segment &) = delete;
    Segment &operator=(const Segment &) = delete;

    kvf_segment handle() const noexcept { return h_; }
    explicit operator bool() const noexcept { return h_ != nullptr; }
    std::string name() const { return detail::name_of(h_, kvf_segment_name); }

    // Registered buffers of the peer, from its cached descriptor.
    size_t buffer_count() const {
        size_t n = 0;
        detail::check(kvf_segment_buffer_count(h_, &n));
        return n;
    }
    // Address and length of buffer i.
    std::pair<uint64_t, uint64_t> buffer(size_t i) const {
        uint64_t a = 0, n = 0;
        detail::check(kvf_segment_buffer(h_, i, &a, &n));
        return {a, n};
    }

    // Requests to this segment.
    kvf_request write(const void *local, uint64_t remote, uint64_t length, uint64_t request_id = 0) const {
        return make(KVF_OP_WRITE, const_cast<void *>(local), remote, length, request_id);
    }
    kvf_request read(void *local, uint64_t remote, uint64_t length, uint64_t request_id = 0) const {
        return make(KVF_OP_READ, local, remote, length, request_id);
    }

    // Sends the peer a small message about request_id (at most
    // KVF_EVENT_DATA_MAX bytes), which it gets as a KVF_EVENT_NOTIFY event.
    // Returns true once the peer queued it, false when the peer's event
    // queue is full (KVF_ERR_BUSY: backpressure, try again later).
    [[nodiscard]] bool notify(uint64_t request_id, const void *data, size_t len) const {
        kvf_status st = kvf_notify(h_, request_id, data, len);
        if (st == KVF_ERR_BUSY) return false;
        detail::check(st);
        return true;
    }
    [[nodiscard]] bool notify(uint64_t request_id, const std::string &data = std::string()) const {
        return notify(request_id, data.data(), data.size());
    }

    // Closes the handle now, reporting failure.
    void close() {
        if (h_ != nullptr) detail::check(kvf_close_segment(std::exchange(h_, nullptr)));
    }

private:
    kvf_request make(uint32_t op, void *local, uint64_t remote, uint64_t length, uint64_t id) const {
        kvf_request r{};
        r.op = op;
        r.local = local;
        r.segment = h_;
        r.remote = remote;
        r.length = length;
        r.request_id = id;
        return r;
    }
    void reset() noexcept {
        if (h_ != nullptr) (void)kvf_close_segment(std::exchange(h_, nullptr));
    }
    kvf_segment h_ = nullptr;
};

// Batch is a set of requests submitted and waited on together. Its
// destructor cancels tasks still in flight, then frees it.
class Batch {
public:
    Batch() noexcept = default;
    explicit Batch(kvf_batch h) noexcept : h_(h) {}
    ~Batch() { reset(); }
    Batch(Batch &&o) noexcept : h_(std::exchange(o.h_, nullptr)) {}
    Batch &operator=(Batch &&o) noexcept {
        if (this != &o) {
            reset();
            h_ = std::exchange(o.h_, nullptr);
        }
        return *this;
    }
    Batch(const Batch &) = delete;
    Batch &operator=(const Batch &) = delete;

    kvf_batch handle() const noexcept { return h_; }

    void submit(const kvf_request *reqs, size_t n) { detail::check(kvf_batch_submit(h_, reqs, n)); }
    void submit(const std::vector<kvf_request> &reqs) { submit(reqs.data(), reqs.size()); }

    // Waits until every task is final: true when all completed; false when
    // tasks are still in flight after timeout_ms. Throws the first failed
    // task's error.
    bool wait(int timeout_ms = KVF_TIMEOUT_DEFAULT) {
        kvf_status st = kvf_batch_wait(h_, timeout_ms);
        if (st == KVF_ERR_TIMEOUT) {
            std::string msg = kvf_last_error();
            for (const kvf_task_status &t : statuses())
                if (t.state == KVF_TASK_WAITING || t.state == KVF_TASK_PENDING) return false;
            throw Error(st, msg);
        }
        detail::check(st);
        return true;
    }

    kvf_task_status status(size_t i) const {
        kvf_task_status s{};
        detail::check(kvf_batch_status(h_, i, &s));
        return s;
    }
    std::vector<kvf_task_status> statuses() const {
        size_t n = 0;
        detail::check(kvf_batch_status_all(h_, nullptr, 0, &n));
        std::vector<kvf_task_status> v(n);
        detail::check(kvf_batch_status_all(h_, v.data(), v.size(), &n));
        v.resize(n < v.size() ? n : v.size());
        return v;
    }
    // The message of task i's error ("" when it completed or is in flight).
    std::string task_error(size_t i) const {
        size_t n = 0;
        detail::check(kvf_batch_task_error(h_, i, nullptr, 0, &n));
        std::string s(n + 1, '\0');
        detail::check(kvf_batch_task_error(h_, i, &s[0], s.size(), &n));
        s.resize(n);
        return s;
    }

    // Ends every task in flight as CANCELED; throws KVF_ERR_IN_USE when the
    // engine could not confirm in time that it stopped touching their memory.
    void cancel() { detail::check(kvf_batch_cancel(h_)); }
    // Frees the batch now; throws KVF_ERR_BUSY while tasks are in flight.
    void free() {
        if (h_ != nullptr) {
            detail::check(kvf_batch_free(h_));
            h_ = nullptr;
        }
    }

private:
    void reset() noexcept {
        if (h_ == nullptr) return;
        if (kvf_batch_free(h_) == KVF_ERR_BUSY) {
            (void)kvf_batch_cancel(h_);
            (void)kvf_batch_free(h_);
        }
        h_ = nullptr;
    }
    kvf_batch h_ = nullptr;
};

// Buffer is registered memory from the engine's allocator.
class Buffer {
public:
    Buffer() noexcept = default;
    Buffer(kvf_engine e, void *p, size_t n) noexcept : e_(e), p_(p), n_(n) {}
    ~Buffer() { reset(); }
    Buffer(Buffer &&o) noexcept
        : e_(std::exchange(o.e_, nullptr)), p_(std::exchange(o.p_, nullptr)), n_(std::exchange(o.n_, 0)) {}
    Buffer &operator=(Buffer &&o) noexcept {
        if (this != &o) {
            reset();
            e_ = std::exchange(o.e_, nullptr);
            p_ = std::exchange(o.p_, nullptr);
            n_ = std::exchange(o.n_, 0);
        }
        return *this;
    }
    Buffer(const Buffer &) = delete;
    Buffer &operator=(const Buffer &) = delete;

    void *data() const noexcept { return p_; }
    uint8_t *bytes() const noexcept { return static_cast<uint8_t *>(p_); }
    size_t size() const noexcept { return n_; }
    // The address as requests name remote memory.
    uint64_t addr() const noexcept { return static_cast<uint64_t>(reinterpret_cast<uintptr_t>(p_)); }

    void free() {
        if (p_ != nullptr) {
            detail::check(kvf_free_buffer(e_, p_));
            p_ = nullptr;
        }
    }

private:
    void reset() noexcept {
        if (p_ != nullptr) (void)kvf_free_buffer(e_, std::exchange(p_, nullptr));
    }
    kvf_engine e_ = nullptr;
    void *p_ = nullptr;
    size_t n_ = 0;
};

// Registration keeps [addr, addr+len) registered with an engine for its
// lifetime: the destructor unregisters it, returning once no transfer
// touches the range, after which the memory may be freed. Movable, not
// copyable; the engine must outlive it. An unregistration that fails in the
// destructor (the engine destroyed first) is ignored: call reset() to see
// the error as an exception.
class Registration {
public:
    Registration() = default;
    Registration(kvf_engine e, void *addr, size_t len, const char *location = nullptr) : e_(e) {
        detail::check(kvf_register_memory(e, addr, len, location));
        addr_ = addr;
    }
    ~Registration() {
        if (addr_ != nullptr) (void)kvf_unregister_memory(e_, addr_);
    }
    Registration(Registration &&o) noexcept : e_(o.e_), addr_(std::exchange(o.addr_, nullptr)) {}
    Registration &operator=(Registration &&o) noexcept {
        if (this != &o) {
            if (addr_ != nullptr) (void)kvf_unregister_memory(e_, addr_);
            e_ = o.e_;
            addr_ = std::exchange(o.addr_, nullptr);
        }
        return *this;
    }
    Registration(const Registration &) = delete;
    Registration &operator=(const Registration &) = delete;

    // Unregisters now (throws on failure); the registration is then empty.
    void reset() {
        if (addr_ != nullptr) detail::check(kvf_unregister_memory(e_, std::exchange(addr_, nullptr)));
    }
    void *addr() const noexcept { return addr_; }
    explicit operator bool() const noexcept { return addr_ != nullptr; }

private:
    kvf_engine e_ = nullptr;
    void *addr_ = nullptr;
};

// Engine is one transfer engine.
class Engine {
public:
    Engine() : Engine(Options{}) {}
    explicit Engine(const Options &opts) {
        kvf_engine_options o = opts.c();
        detail::check(kvf_engine_create(&o, &h_));
    }
    explicit Engine(const kvf_engine_options *opts) { detail::check(kvf_engine_create(opts, &h_)); }
    ~Engine() {
        if (h_ != nullptr) (void)kvf_engine_destroy(h_);
    }
    Engine(Engine &&o) noexcept : h_(std::exchange(o.h_, nullptr)) {}
    Engine &operator=(Engine &&o) noexcept {
        if (this != &o) {
            if (h_ != nullptr) (void)kvf_engine_destroy(h_);
            h_ = std::exchange(o.h_, nullptr);
        }
        return *this;
    }
    Engine(const Engine &) = delete;
    Engine &operator=(const Engine &) = delete;

    kvf_engine handle() const noexcept { return h_; }
    // The segment name peers open, "host:port".
    std::string name() const { return detail::name_of(h_, kvf_engine_name); }
    // This engine's public key (Z85), what peers list in their allowlists;
    // throws Error (KVF_ERR_UNSUPPORTED) when authentication is off.
    std::string public_key() const { return detail::name_of(h_, kvf_engine_public_key); }
    // The engine's metrics in the Prometheus text format (kvf_metrics_text),
    // to serve from the host process's own /metrics. The text may grow
    // between the length query and the copy: it is asked again then.
    std::string metrics_text() const {
        for (;;) {
            size_t n = 0;
            detail::check(kvf_metrics_text(h_, nullptr, 0, &n));
            std::string s(n + n / 4 + 4096, '\0');
            kvf_status st = kvf_metrics_text(h_, &s[0], s.size(), &n);
            if (st == KVF_ERR_TRUNCATED) continue;
            detail::check(st);
            s.resize(n);
            return s;
        }
    }
    // Where the metrics listener serves ("" when none does).
    std::string metrics_addr() const { return detail::name_of(h_, kvf_metrics_addr); }
    // Rereads the allowlist file and cuts the peers it no longer lists.
    void reload_allowlist(int timeout_ms = KVF_TIMEOUT_DEFAULT) {
        detail::check(kvf_engine_reload_allowlist(h_, timeout_ms));
    }

    void register_memory(void *addr, size_t len, const char *location = nullptr) {
        detail::check(kvf_register_memory(h_, addr, len, location));
    }
    void unregister_memory(void *addr) { detail::check(kvf_unregister_memory(h_, addr)); }
    // register_memory whose result unregisters when it goes out of scope.
    Registration register_scoped(void *addr, size_t len, const char *location = nullptr) {
        return Registration(h_, addr, len, location);
    }
    Buffer alloc_buffer(size_t len, const char *location = nullptr) {
        void *p = nullptr;
        detail::check(kvf_alloc_buffer(h_, len, location, &p));
        return Buffer(h_, p, len);
    }

    Segment open_segment(const std::string &name, int timeout_ms = KVF_TIMEOUT_DEFAULT) {
        kvf_segment s = nullptr;
        detail::check(kvf_open_segment(h_, name.c_str(), timeout_ms, &s));
        return Segment(s);
    }
    Batch batch(size_t capacity) {
        kvf_batch b = nullptr;
        detail::check(kvf_batch_alloc(h_, capacity, &b));
        return Batch(b);
    }

    // Runs the requests synchronously; throws the first failure. out, when
    // given, receives one state per request, also when it throws.
    void transfer(const kvf_request *reqs, size_t n, int timeout_ms = KVF_TIMEOUT_DEFAULT,
                  kvf_task_status *out = nullptr) {
        detail::check(kvf_transfer_sync(h_, reqs, n, timeout_ms, out));
    }
    void transfer(const std::vector<kvf_request> &reqs, int timeout_ms = KVF_TIMEOUT_DEFAULT) {
        transfer(reqs.data(), reqs.size(), timeout_ms);
    }

    // Safe abort, as the owner of the memory (kvf_abort): refuses every
    // access of request_id from now on and tells the initiators named
    // (segment names; none: refusal alone stops them). An abort that could
    // not be made safe by timeout_ms is a result (safe false, with code and
    // reason), not an exception; invalid arguments and a closed engine
    // throw.
    AbortResult abort(uint64_t request_id, const std::vector<std::string> &initiators = {},
                      int timeout_ms = KVF_TIMEOUT_DEFAULT) {
        std::vector<const char *> names;
        names.reserve(initiators.size());
        for (const std::string &n : initiators) names.push_back(n.c_str());
        kvf_abort_result r{};
        r.struct_size = sizeof r;
        // kvf_abort writes safe = 0 when it reached a result that is not
        // safe, and nothing when it failed: the sentinel tells them apart.
        r.safe = not_written;
        kvf_status st = kvf_abort(h_, request_id, names.empty() ? nullptr : names.data(), names.size(),
                                  timeout_ms, &r);
        AbortResult out;
        if (st != KVF_OK) {
            if (r.safe != 0) throw Error(st, kvf_last_error());
            out.code = st;
            out.reason = kvf_last_error();
        }
        out.safe = st == KVF_OK && r.safe == 1;
        out.generation = r.generation;
        out.bytes_confirmed = r.bytes_confirmed;
        return out;
    }

    // Fence by memory range, as the owner (kvf_fence_memory): from now on
    // every access to [addrs[i], addrs[i] + lengths[i]), i < n, planned
    // before the call is refused, whatever its request id (0 included) and
    // initiator; transfers planned after it pass. This is what protects
    // pages written by peers that pass no request id (Mooncake-based
    // frameworks): fence them before reusing them. A fence that could not
    // be made safe by timeout_ms is a result (safe false, with code and
    // reason), not an exception; invalid arguments (KVF_ERR_INVALID),
    // memory not registered (KVF_ERR_NOT_REGISTERED) and a closed engine
    // throw.
    FenceResult fence(const uint64_t *addrs, const uint64_t *lengths, size_t n,
                      int timeout_ms = KVF_TIMEOUT_DEFAULT) {
        kvf_fence_result r{};
        r.struct_size = sizeof r;
        // As in abort: the sentinel tells a result that is not safe (safe
        // written as 0) from a failure (nothing written).
        r.safe = not_written;
        kvf_status st = kvf_fence_memory(h_, addrs, lengths, n, timeout_ms, &r);
        FenceResult out;
        if (st != KVF_OK) {
            if (r.safe != 0) throw Error(st, kvf_last_error());
            out.code = st;
            out.reason = kvf_last_error();
        }
        out.safe = st == KVF_OK && r.safe == 1;
        out.epoch = r.epoch;
        out.peers_told = r.peers_told;
        out.peers_acked = r.peers_acked;
        out.peers_cut = r.peers_cut;
        return out;
    }
    // The same for (address, length) pairs, e.g. fence({{addr, len}}).
    FenceResult fence(const std::vector<std::pair<uint64_t, uint64_t>> &ranges,
                      int timeout_ms = KVF_TIMEOUT_DEFAULT) {
        std::vector<uint64_t> addrs, lengths;
        addrs.reserve(ranges.size());
        lengths.reserve(ranges.size());
        for (const auto &r : ranges) {
            addrs.push_back(r.first);
            lengths.push_back(r.second);
        }
        return fence(addrs.data(), lengths.data(), ranges.size(), timeout_ms);
    }

    // Lets initiator (a segment name) access ranges of our registered
    // memory for request_id (kvf_grant); returns the grant's id.
    uint64_t grant(const std::string &initiator, uint64_t request_id, const std::vector<kvf_grant_range> &ranges) {
        uint64_t id = 0;
        detail::check(kvf_grant(h_, initiator.c_str(), request_id, ranges.data(), ranges.size(), &id));
        return id;
    }
    // Withdraws a grant and waits until no copy of its request is in
    // progress (kvf_revoke). An unknown id throws KVF_ERR_INVALID.
    void revoke(uint64_t grant_id, int timeout_ms = KVF_TIMEOUT_DEFAULT) {
        detail::check(kvf_revoke(h_, grant_id, timeout_ms));
    }

    // Takes up to max (> 0) pending events, waiting up to timeout_ms (>= 0)
    // for the first; empty when none arrived in time.
    std::vector<kvf_event> poll_events(int timeout_ms = 0, size_t max = 64) {
        std::vector<kvf_event> v(max);
        size_t n = 0;
        detail::check(kvf_poll_events(h_, v.data(), v.size(), &n, timeout_ms));
        v.resize(n);
        return v;
    }
    // A descriptor that polls readable while events may be pending, for
    // event loops; the engine owns it (do not read or close it).
    int event_fd() const {
        int fd = -1;
        detail::check(kvf_event_fd(h_, &fd));
        return fd;
    }

    kvf_stats stats() const {
        kvf_stats s{};
        s.struct_size = sizeof s;
        detail::check(kvf_engine_stats(h_, &s));
        return s;
    }

    // Destroys the engine now, reporting failure.
    void destroy() {
        if (h_ != nullptr) detail::check(kvf_engine_destroy(std::exchange(h_, nullptr)));
    }

private:
    static constexpr uint32_t not_written = 0xffffffffu;
    kvf_engine h_ = nullptr;
};

// The library's version, e.g. "0.4.0".
inline std::string version() { return kvf_version_string(); }

} // namespace kvferry

#endif // KVFERRY_HPP
