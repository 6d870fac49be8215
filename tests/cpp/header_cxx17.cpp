// Compiled, not run: kvferry.h and kvferry.hpp must build as C++17 with
// -Wall -Wextra -Werror -pedantic.
#include "kvferry.h"
#include "kvferry.hpp"

int kvf_header_cxx17_check();

int kvf_header_cxx17_check() {
    kvf_engine_options o;
    kvf_engine_options_init(&o);
    kvferry::Options opts;
    kvf_engine_options c = opts.c();
    kvferry::Segment s;
    kvf_request r = s.write(nullptr, 0, 64, 1);
    kvferry::Error e(KVF_ERR_INVALID, "x");
    kvferry::AbortResult ar;
    return static_cast<int>(o.struct_size + c.struct_size + r.op) + e.code() + (s ? 1 : 0) + (ar ? 1 : 0);
}

// The abort, grant, notify and event wrappers, instantiated (not run).
int kvf_header_cxx17_abort(kvferry::Engine &owner, kvferry::Engine &init, const kvferry::Segment &seg);

int kvf_header_cxx17_abort(kvferry::Engine &owner, kvferry::Engine &init, const kvferry::Segment &seg) {
    kvferry::AbortResult ar = owner.abort(1, {init.name()}, 1000);
    kvferry::AbortResult ar0 = owner.abort(2);
    uint64_t g = owner.grant(init.name(), 3, {{0x10000, 4096}});
    owner.revoke(g, 1000);
    bool queued = seg.notify(4, "hello") && seg.notify(5) && seg.notify(6, "x", 1);
    std::vector<kvf_event> evs = init.poll_events(10, 8);
    int fd = init.event_fd();
    int n = 0;
    for (const kvf_event &ev : evs) n += ev.type == KVF_EVENT_ABORTED ? 1 : 0;
    return n + fd + (queued ? 1 : 0) + (ar.safe ? 1 : 0) + static_cast<int>(ar.generation + ar0.bytes_confirmed) +
           ar.code + static_cast<int>(ar.reason.size());
}

// The fence wrappers, instantiated (not run).
int kvf_header_cxx17_fence(kvferry::Engine &owner);

int kvf_header_cxx17_fence(kvferry::Engine &owner) {
    kvferry::FenceResult fr = owner.fence({{0x10000, 4096}, {0x20000, 8192}}, 1000);
    const uint64_t addrs[1] = {0x10000}, lengths[1] = {4096};
    kvferry::FenceResult fr0 = owner.fence(addrs, lengths, 1);
    return (fr ? 1 : 0) + (fr0.safe ? 1 : 0) + static_cast<int>(fr.epoch + fr.peers_told + fr.peers_acked +
                                                                  fr.peers_cut) +
           fr.code + static_cast<int>(fr0.reason.size());
}
