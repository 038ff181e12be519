// streams.cpp — the stream queues, events and the two schedules of streams.h.
//
// One recursive lock serializes queueing and running: an operation runs under it, and running a stream wait
// runs the other stream's queue up to the waited-on position under the same lock. Positions are captured
// when a wait or record is issued, so the waits form no cycle: a wait only names work issued before it.
// The clocks of the stream-order check (streamorder.h) move at issue, in both schedules: each operation ticks
// its stream's, a record copies it into the event, a wait joins the event's into the stream's, and a
// synchronization joins what it waited for into the host's.

#include "streams.h"

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <deque>
#include <memory>
#include <mutex>

namespace emu::streams {
namespace {

using Clock = std::chrono::steady_clock;

struct Stream;

struct EventState {
    Stream* stream = nullptr;  // where it was last recorded; null: never recorded (complete, as in CUDA)
    uint64_t seq = 0;          // complete once that stream has run this many entries
    Clock::time_point at{};    // when the record ran
    order::Clock clock;        // what the record follows (stream-order check)
};

struct Event {
    std::shared_ptr<EventState> st = std::make_shared<EventState>();
};

struct Entry {
    Op op;                              // an operation, or (no run) one of the two markers below
    Stream* wait = nullptr;             // a stream wait: `wait` must first have run `wait_seq` entries
    uint64_t wait_seq = 0;
    std::shared_ptr<EventState> mark;   // an event record: stamps the time when it runs
};

struct Stream {
    std::string name;
    bool blocking = false;  // ordered with the legacy stream (created without CU_STREAM_NON_BLOCKING)
    std::deque<Entry> queue;
    uint64_t issued = 0, ran = 0;
    unsigned actor = 0;  // its index in the stream-order clocks
    order::Clock clock;
};

std::recursive_mutex g_lock;
constexpr unsigned kHost = 0, kLegacy = 1;
Stream g_legacy{"the legacy default stream", false, {}, 0, 0, kLegacy, {}};
order::Clock g_host;  // what the host has seen complete
std::deque<Stream> g_streams;  // created streams, never erased (waits may still name a destroyed one)
CUresult g_sticky = CUDA_SUCCESS;

Stream* of(CUstream s) {
    // 0, CU_STREAM_LEGACY and CU_STREAM_PER_THREAD all run on the legacy stream here: one host thread issues
    // the project's default-stream work, so the per-thread stream's extra freedom would go unused.
    if (s == nullptr || s == CU_STREAM_LEGACY || s == CU_STREAM_PER_THREAD) return &g_legacy;
    return reinterpret_cast<Stream*>(s);
}

void run_until(Stream* s, uint64_t upto);

void run_entry(Stream* s, Entry& e) {
    if (e.wait) {
        run_until(e.wait, e.wait_seq);
    } else if (e.mark) {
        if (e.mark->stream == s && e.mark->seq == s->ran + 1) e.mark->at = Clock::now();
    } else if (e.op.run) {
        const CUresult r = e.op.run();
        if (r != CUDA_SUCCESS && g_sticky == CUDA_SUCCESS) {
            std::fprintf(stderr, "emu: %s on %s failed (error %d); later synchronizing calls return it\n",
                         e.op.what.c_str(), s->name.c_str(), (int)r);
            g_sticky = r;
        }
    }
}

void run_until(Stream* s, uint64_t upto) {
    while (s->ran < upto && !s->queue.empty()) {
        Entry e = std::move(s->queue.front());
        s->queue.pop_front();
        run_entry(s, e);  // before `ran` moves on: a mark compares its position with ran + 1
        ++s->ran;
    }
}

void run_all() {
    run_until(&g_legacy, g_legacy.issued);
    for (Stream& s : g_streams) run_until(&s, s.issued);
}

// CUDA's implicit ordering of the legacy stream with blocking streams, as waits queued before an entry.
void order_with_legacy(Stream* s) {
    if (s == &g_legacy) {
        for (Stream& b : g_streams)
            if (b.blocking && b.issued > b.ran) s->queue.push_back(Entry{{}, &b, b.issued, {}}), ++s->issued;
    } else if (s->blocking && g_legacy.issued > g_legacy.ran) {
        s->queue.push_back(Entry{{}, &g_legacy, g_legacy.issued, {}});
        ++s->issued;
    }
}

void push(Stream* s, Entry e) {
    order_with_legacy(s);
    s->queue.push_back(std::move(e));
    ++s->issued;
}

bool complete(const EventState& st) { return st.stream == nullptr || st.stream->ran >= st.seq; }

// The next operation on s, in the clocks: after its stream's earlier ones, whatever the host has seen
// complete, and (CUDA's implicit order) the legacy stream's work for a blocking stream and the other way round.
const order::Clock& issue(Stream* s) {
    s->clock.join(g_host);
    if (s == &g_legacy) {
        for (const Stream& b : g_streams)
            if (b.blocking) s->clock.join(b.clock);
    } else if (s->blocking) {
        s->clock.join(g_legacy.clock);
    }
    s->clock.tick(s->actor);
    return s->clock;
}

// The host has seen everything s was issued complete (a synchronize, a query that found it idle).
void host_saw(const Stream* s) {
    g_host.join(s->clock);
    if (s == &g_legacy)
        for (const Stream& b : g_streams)
            if (b.blocking) g_host.join(b.clock);
}

// Checks the touches of `what`, issued on `where`, in the clocks as `actor` at `now`; a conflict is reported
// and made sticky. The operation's name is built only when there is something to check.
CUresult check_order(unsigned actor, const order::Clock& now, const std::string& what, const std::string& where,
                     const std::vector<order::Touch>& touches) {
    if (touches.empty() || !order_checked()) return CUDA_SUCCESS;
    auto who = std::make_shared<const std::string>("`" + what + "` on " + where);
    const std::string why = order::touch(actor, now, who, touches);
    if (why.empty()) return CUDA_SUCCESS;
    std::fprintf(stderr, "emu: stream race: %s\n", why.c_str());
    if (g_sticky == CUDA_SUCCESS) g_sticky = CUDA_ERROR_ILLEGAL_ADDRESS;
    return CUDA_ERROR_ILLEGAL_ADDRESS;
}

}  // namespace

bool env_choice(const char* var, const char* no, const char* yes) {
    const char* s = std::getenv(var);
    if (s == nullptr || std::string(s) == no) return false;
    if (std::string(s) == yes) return true;
    std::fprintf(stderr, "emu: %s=%s is neither %s nor %s; using %s\n", var, s, no, yes, no);
    return false;
}

bool lazy() {
    static const bool v = env_choice("EMU_STREAMS", "eager", "lazy");
    return v;
}

bool order_checked() {
    static const bool v = !env_choice("EMU_STREAM_ORDER", "on", "off");
    return v;
}

CUresult submit(CUstream s, Op op) {
    std::lock_guard<std::recursive_mutex> l(g_lock);
    Stream* st = of(s);
    if (CUresult r = check_order(st->actor, issue(st), op.what, st->name, op.touches)) return r;
    if (!lazy()) return op.run();
    push(st, Entry{std::move(op), nullptr, 0, {}});
    return CUDA_SUCCESS;
}

void fault(CUresult r) {
    std::lock_guard<std::recursive_mutex> l(g_lock);
    if (g_sticky == CUDA_SUCCESS) g_sticky = r;
}

CUresult host_touch(const char* what, std::vector<order::Touch> touches) {
    std::lock_guard<std::recursive_mutex> l(g_lock);
    g_host.tick(kHost);
    return check_order(kHost, g_host, what, "the host", touches);
}

CUresult synchronize(CUstream s) {
    std::lock_guard<std::recursive_mutex> l(g_lock);
    Stream* st = of(s);
    order_with_legacy(st);
    run_until(st, st->issued);
    host_saw(st);
    return g_sticky;
}

CUresult create(CUstream* s, unsigned flags) {
    std::lock_guard<std::recursive_mutex> l(g_lock);
    g_streams.push_back(Stream{"stream " + std::to_string(g_streams.size() + 1),
                               (flags & CU_STREAM_NON_BLOCKING) == 0, {}, 0, 0,
                               (unsigned)(kLegacy + 1 + g_streams.size()), {}});
    *s = reinterpret_cast<CUstream>(&g_streams.back());
    return CUDA_SUCCESS;
}

CUresult destroy(CUstream s) {
    // CUDA lets queued work finish after the destroy call returns; running it now is one such order.
    std::lock_guard<std::recursive_mutex> l(g_lock);
    Stream* st = of(s);
    run_until(st, st->issued);
    return CUDA_SUCCESS;
}

CUresult synchronize_all() {
    std::lock_guard<std::recursive_mutex> l(g_lock);
    run_all();
    host_saw(&g_legacy);
    for (const Stream& s : g_streams) host_saw(&s);
    return g_sticky;
}

CUresult query(CUstream s) {
    // Lazy: "not ready" while work is queued, and the work then runs, so a polling loop ends.
    std::lock_guard<std::recursive_mutex> l(g_lock);
    Stream* st = of(s);
    if (st->ran >= st->issued) {
        host_saw(st);
        return g_sticky;
    }
    run_until(st, st->issued);
    return g_sticky != CUDA_SUCCESS ? g_sticky : CUDA_ERROR_NOT_READY;
}

CUresult wait_event(CUstream s, CUevent e) {
    std::lock_guard<std::recursive_mutex> l(g_lock);
    const EventState& st = *reinterpret_cast<Event*>(e)->st;
    of(s)->clock.join(st.clock);
    if (lazy() && !complete(st)) push(of(s), Entry{{}, st.stream, st.seq, {}});
    return CUDA_SUCCESS;
}

CUresult event_create(CUevent* e) {
    *e = reinterpret_cast<CUevent>(new Event);
    return CUDA_SUCCESS;
}

CUresult event_destroy(CUevent e) {
    std::lock_guard<std::recursive_mutex> l(g_lock);
    delete reinterpret_cast<Event*>(e);  // a queued record keeps its state alive
    return CUDA_SUCCESS;
}

CUresult event_record(CUevent e, CUstream s) {
    std::lock_guard<std::recursive_mutex> l(g_lock);
    auto& st = reinterpret_cast<Event*>(e)->st;
    Stream* str = of(s);
    st->clock = issue(str);
    if (!lazy()) {
        st->stream = nullptr;
        st->at = Clock::now();
        return CUDA_SUCCESS;
    }
    push(str, Entry{{}, nullptr, 0, st});
    st->stream = str;
    st->seq = str->issued;
    return CUDA_SUCCESS;
}

CUresult event_synchronize(CUevent e) {
    std::lock_guard<std::recursive_mutex> l(g_lock);
    const EventState& st = *reinterpret_cast<Event*>(e)->st;
    if (st.stream) run_until(st.stream, st.seq);
    g_host.join(st.clock);
    return g_sticky;
}

CUresult event_query(CUevent e) {
    std::lock_guard<std::recursive_mutex> l(g_lock);
    const EventState& st = *reinterpret_cast<Event*>(e)->st;
    if (complete(st)) {
        g_host.join(st.clock);
        return g_sticky;
    }
    run_until(st.stream, st.seq);
    return g_sticky != CUDA_SUCCESS ? g_sticky : CUDA_ERROR_NOT_READY;
}

CUresult event_elapsed(float* ms, CUevent a, CUevent b) {
    std::lock_guard<std::recursive_mutex> l(g_lock);
    const EventState& sa = *reinterpret_cast<Event*>(a)->st;
    const EventState& sb = *reinterpret_cast<Event*>(b)->st;
    if (!complete(sa) || !complete(sb)) return CUDA_ERROR_NOT_READY;  // as CUDA: the caller must wait first
    *ms = std::chrono::duration<float, std::milli>(sb.at - sa.at).count();
    return CUDA_SUCCESS;
}

std::string pending_user(uintptr_t base, size_t bytes) {
    std::lock_guard<std::recursive_mutex> l(g_lock);
    auto scan = [&](const Stream& s) -> std::string {
        for (const Entry& e : s.queue)
            for (const order::Touch& t : e.op.touches)
                if (t.lo < base + bytes && base < t.hi) return "`" + e.op.what + "` queued on " + s.name;
        return {};
    };
    if (std::string u = scan(g_legacy); !u.empty()) return u;
    for (const Stream& s : g_streams)
        if (std::string u = scan(s); !u.empty()) return u;
    return {};
}

}  // namespace emu::streams
