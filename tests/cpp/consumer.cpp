// A C++ program using kvferry as an installed package (through CMake's
// find_package or pkg-config): two engines in one process move data both
// ways, failures arrive as kvferry::Error with code and message, and the
// owner aborts a request, fences pages, grants and revokes, and gets a
// notification through the wrappers (the C tests test_abort and test_fence
// cover those calls in depth).
#include <kvferry.hpp>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#define EXPECT(cond)                                                            \
    do {                                                                        \
        if (!(cond)) {                                                          \
            std::fprintf(stderr, "%s:%d: expected %s\n", __FILE__, __LINE__, #cond); \
            std::exit(1);                                                       \
        }                                                                       \
    } while (0)

int main() {
    try {
        EXPECT(kvf_version() == KVF_VERSION_NUMBER);
        kvferry::Options opts;
        opts.ignore_env = true;
        opts.log_level = KVF_LOG_OFF;
        kvferry::Engine a(opts), b(opts);
        kvferry::Buffer src = a.alloc_buffer(1 << 20);
        kvferry::Buffer dst = b.alloc_buffer(1 << 20);
        for (size_t i = 0; i < src.size(); i++) src.bytes()[i] = static_cast<uint8_t>(i * 7 + 3);

        kvferry::Segment seg = a.open_segment(b.name(), 5000);
        {
            std::string m = a.metrics_text();
            EXPECT(m.find("kvferry_info{engine=\"" + a.name() + "\"") != std::string::npos);
        }
        EXPECT(seg.buffer_count() == 1);
        EXPECT(seg.buffer(0).first == dst.addr());

        // WRITE with a batch of 16 requests.
        kvferry::Batch batch = a.batch(16);
        std::vector<kvf_request> reqs;
        for (size_t i = 0; i < 16; i++)
            reqs.push_back(seg.write(src.bytes() + i * 65536, dst.addr() + i * 65536, 65536, 1));
        batch.submit(reqs);
        EXPECT(batch.wait(10000));
        for (const kvf_task_status &t : batch.statuses()) EXPECT(t.state == KVF_TASK_COMPLETED);
        EXPECT(std::memcmp(src.data(), dst.data(), dst.size()) == 0);
        batch.free();

        // READ back synchronously into the other half.
        std::memset(src.data(), 0, 4096);
        a.transfer({seg.read(src.data(), dst.addr(), 4096, 2)}, 10000);
        for (size_t i = 0; i < 4096; i++) EXPECT(src.bytes()[i] == static_cast<uint8_t>(i * 7 + 3));
        EXPECT(a.stats().bytes_written >= (1u << 20));

        // Errors carry code and message.
        try {
            a.transfer({seg.write(src.data(), dst.addr() + dst.size() - 8, 64, 3)}, 5000);
            EXPECT(false);
        } catch (const kvferry::Error &e) {
            EXPECT(e.code() == KVF_ERR_REMOTE_RANGE);
            EXPECT(std::strstr(e.what(), "kvf_transfer_sync") != nullptr);
        }
        try {
            a.register_memory(nullptr, 16);
            EXPECT(false);
        } catch (const kvferry::Error &e) {
            EXPECT(e.code() == KVF_ERR_INVALID);
            EXPECT(std::string(e.code_str()) == "invalid argument");
        }
        // Authentication is off: no public key, no allowlist to reload.
        try {
            (void)a.public_key();
            EXPECT(false);
        } catch (const kvferry::Error &e) {
            EXPECT(e.code() == KVF_ERR_UNSUPPORTED);
        }
        try {
            a.reload_allowlist(1000);
            EXPECT(false);
        } catch (const kvferry::Error &e) {
            EXPECT(e.code() == KVF_ERR_INVALID);
        }
        // A scoped registration: registered while it lives, unregistered
        // (and registrable again) once it is gone; moving it moves the duty.
        {
            std::vector<char> mem(1 << 16);
            kvferry::Registration outer;
            {
                kvferry::Registration r = a.register_scoped(mem.data(), mem.size());
                EXPECT(r && r.addr() == mem.data());
                try {
                    a.register_memory(mem.data(), mem.size());
                    EXPECT(false);
                } catch (const kvferry::Error &e) {
                    EXPECT(e.code() == KVF_ERR_OVERLAP);
                }
                outer = std::move(r);
                EXPECT(!r && outer);
            }
            outer.reset();
            EXPECT(!outer);
            kvferry::Registration again = a.register_scoped(mem.data(), mem.size());
            EXPECT(again);
        }
        // Safe abort: b owns dst, a wrote request 1 into it. a hears of it
        // (an event, its fd readable) and can write request 1 no more.
        const int efd = a.event_fd();
        EXPECT(efd >= 0);
        kvferry::AbortResult ar = b.abort(1, {a.name()}, 5000);
        EXPECT(ar.safe && ar && ar.generation == 1 && ar.code == KVF_OK && ar.reason.empty());
        std::vector<kvf_event> evs = a.poll_events(5000);
        EXPECT(evs.size() == 1);
        EXPECT(evs[0].type == KVF_EVENT_ABORTED && evs[0].request_id == 1 && evs[0].generation == 1);
        EXPECT(b.name() == evs[0].peer);
        EXPECT(a.poll_events(0).empty());
        std::memset(src.data(), 0xee, 4096);
        try {
            a.transfer({seg.write(src.data(), dst.addr(), 4096, 1)}, 5000);
            EXPECT(false);
        } catch (const kvferry::Error &e) {
            EXPECT(e.code() == KVF_ERR_ABORTED);
        }
        EXPECT(dst.bytes()[0] == 3 && dst.bytes()[4095] == static_cast<uint8_t>(4095 * 7 + 3));
        try {
            (void)b.abort(0, {}, 1000);
            EXPECT(false);
        } catch (const kvferry::Error &e) {
            EXPECT(e.code() == KVF_ERR_INVALID);
        }

        // A grant lets a write request 4's first page only, until revoked.
        uint64_t g = b.grant(a.name(), 4, {{dst.addr(), 4096}});
        a.transfer({seg.write(src.data(), dst.addr(), 4096, 4)}, 5000);
        EXPECT(dst.bytes()[0] == 0xee);
        try {
            a.transfer({seg.write(src.data(), dst.addr() + 4096, 4096, 4)}, 5000);
            EXPECT(false);
        } catch (const kvferry::Error &e) {
            EXPECT(e.code() == KVF_ERR_REFUSED);
        }
        b.revoke(g, 5000);
        try {
            b.revoke(g, 5000);
            EXPECT(false);
        } catch (const kvferry::Error &e) {
            EXPECT(e.code() == KVF_ERR_INVALID);
        }

        // A fence of dst's first two pages, which a wrote with no request
        // id: safe, a was told; once a applied it (b counted its
        // acknowledgement), a's next write into the pages, planned after
        // the fence, lands.
        kvferry::FenceResult fr = b.fence({{dst.addr(), 8192}}, 5000);
        EXPECT(fr.safe && fr && fr.epoch == 1 && fr.code == KVF_OK && fr.reason.empty());
        EXPECT(fr.peers_told >= 1 && fr.peers_acked <= fr.peers_told && fr.peers_cut == 0);
        const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
        while (b.stats().fence_acks < 1) {
            EXPECT(std::chrono::steady_clock::now() < deadline);
            std::this_thread::sleep_for(std::chrono::milliseconds(1)); // a poll interval
        }
        EXPECT(a.stats().fences_received >= 1);
        std::memset(src.data(), 0x5c, 8192);
        a.transfer({seg.write(src.data(), dst.addr(), 8192, 0)}, 5000);
        EXPECT(dst.bytes()[0] == 0x5c && dst.bytes()[8191] == 0x5c);
        const uint64_t pages[2] = {dst.addr(), dst.addr() + 65536}, lens[2] = {4096, 4096};
        kvferry::FenceResult fr2 = b.fence(pages, lens, 2, 5000);
        EXPECT(fr2.safe && fr2.epoch == 2);
        EXPECT(b.stats().fences_safe == 2 && b.stats().fence_epoch == 2);
        // Memory b never registered, and no ranges, throw.
        try {
            (void)b.fence({{src.addr(), 4096}}, 1000);
            EXPECT(false);
        } catch (const kvferry::Error &e) {
            EXPECT(e.code() == KVF_ERR_NOT_REGISTERED);
            EXPECT(std::strstr(e.what(), "kvf_fence_memory") != nullptr);
        }
        try {
            (void)b.fence(std::vector<std::pair<uint64_t, uint64_t>>{}, 1000);
            EXPECT(false);
        } catch (const kvferry::Error &e) {
            EXPECT(e.code() == KVF_ERR_INVALID);
        }
        EXPECT(b.stats().fence_epoch == 2);

        // A notification reaches the owner as an event.
        EXPECT(seg.notify(5, "ready"));
        evs = b.poll_events(5000);
        EXPECT(evs.size() == 1 && evs[0].type == KVF_EVENT_NOTIFY && evs[0].request_id == 5);
        EXPECT(std::string(reinterpret_cast<const char *>(evs[0].data), evs[0].data_len) == "ready");
        EXPECT(a.name() == evs[0].peer);

        std::printf("consumer: ok (kvferry %s, %s)\n", kvferry::version().c_str(), a.name().c_str());
        // Destructors in reverse order: batch, segment, buffers, engines. A
        // buffer outliving its engine would find a stale handle, no crash.
    } catch (const kvferry::Error &e) {
        std::fprintf(stderr, "kvferry error %d (%s): %s\n", e.code(), e.code_str(), e.what());
        return 1;
    }
    return 0;
}
