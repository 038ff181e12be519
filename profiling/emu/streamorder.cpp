// streamorder.cpp — the happens-before shadow of streamorder.h: for each touched byte range, the last write
// and the reads since it (at most one per actor: a newer read of one actor supersedes its older ones), as
// segments of an interval map that splits where touches begin and end and merges again where neighbours
// agree.
#include "streamorder.h"

#include <algorithm>
#include <cstdio>
#include <map>
#include <mutex>

namespace emu::order {
namespace {

struct Access {
    unsigned actor = 0;
    uint64_t epoch = 0;  // 0: none
    std::shared_ptr<const std::string> who;
    bool same(const Access& o) const { return actor == o.actor && epoch == o.epoch; }
};

struct Seg {
    uintptr_t hi = 0;
    Access write;
    std::vector<Access> reads;
};

std::mutex g_mu;  // the driver allocates (forget) from host threads other than the one issuing work
std::map<uintptr_t, Seg> g_segs;  // lo → segment [lo, hi); the segments never overlap

bool ordered(const Access& then, unsigned actor, const Clock& now) {
    return then.epoch == 0 || then.actor == actor || then.epoch <= now[then.actor];
}

// Makes x a segment boundary.
void split(uintptr_t x) {
    auto it = g_segs.upper_bound(x);
    if (it == g_segs.begin()) return;
    --it;
    if (it->first < x && x < it->second.hi) {
        Seg right = it->second;
        it->second.hi = x;
        g_segs.emplace(x, std::move(right));
    }
}

bool same(const Seg& a, const Seg& b) {
    if (!a.write.same(b.write) || a.reads.size() != b.reads.size()) return false;
    for (size_t i = 0; i < a.reads.size(); ++i)
        if (!a.reads[i].same(b.reads[i])) return false;
    return true;
}

// Merges the segments that meet and agree, from the one before lo to the one at hi.
void merge(uintptr_t lo, uintptr_t hi) {
    auto it = g_segs.lower_bound(lo);
    if (it != g_segs.begin()) --it;
    while (it != g_segs.end() && it->first <= hi) {
        auto next = std::next(it);
        if (next != g_segs.end() && it->second.hi == next->first && same(it->second, next->second)) {
            it->second.hi = next->second.hi;
            g_segs.erase(next);
        } else {
            it = next;
        }
    }
}

void record(Seg& s, const Access& me, bool write, const Clock& now) {
    if (write) {
        s.write = me;
        s.reads.clear();
        return;
    }
    // Reads ordered before this one need no keeping: whatever comes after this read comes after them too.
    std::erase_if(s.reads, [&](const Access& r) { return ordered(r, me.actor, now); });
    s.reads.push_back(me);
}

std::string conflict(const Touch& t, uintptr_t lo, uintptr_t hi, const std::string& who, const Access& then,
                     const char* then_did) {
    char buf[160];
    std::snprintf(buf, sizeof buf, " bytes [%zu, %zu) of the allocation at 0x%zx that ", (size_t)(lo - t.base),
                  (size_t)(hi - t.base), (size_t)t.base);
    return who + (t.write ? " writes" : " reads") + buf + *then.who + " " + then_did +
           ", and nothing orders the two: no event recorded after the one was waited for before the other, and "
           "the host did not synchronize between them";
}

}  // namespace

void Clock::tick(unsigned a) {
    if (at.size() <= a) at.resize(a + 1, 0);
    ++at[a];
}

void Clock::join(const Clock& o) {
    if (at.size() < o.at.size()) at.resize(o.at.size(), 0);
    for (size_t i = 0; i < o.at.size(); ++i) at[i] = std::max(at[i], o.at[i]);
}

std::string touch(unsigned actor, const Clock& now, const std::shared_ptr<const std::string>& who,
                  const std::vector<Touch>& touches) {
    std::lock_guard<std::mutex> l(g_mu);
    const Access me{actor, now[actor], who};
    for (const Touch& t : touches) {
        if (t.hi <= t.lo) continue;
        split(t.lo);
        split(t.hi);
        for (auto it = g_segs.lower_bound(t.lo); it != g_segs.end() && it->first < t.hi; ++it) {
            const Seg& s = it->second;
            if (!ordered(s.write, actor, now)) return conflict(t, it->first, s.hi, *who, s.write, "wrote");
            if (t.write)
                for (const Access& r : s.reads)
                    if (!ordered(r, actor, now)) return conflict(t, it->first, s.hi, *who, r, "read");
        }
        uintptr_t cur = t.lo;
        auto it = g_segs.lower_bound(t.lo);
        while (cur < t.hi) {
            if (it == g_segs.end() || it->first > cur) {  // a gap: bytes nothing touched yet
                const uintptr_t end = it == g_segs.end() ? t.hi : std::min<uintptr_t>(it->first, t.hi);
                Seg s{end, {}, {}};
                record(s, me, t.write, now);
                g_segs.emplace(cur, std::move(s));
                cur = end;
            } else {
                record(it->second, me, t.write, now);
                cur = it->second.hi;
                ++it;
            }
        }
        merge(t.lo, t.hi);
    }
    return {};
}

void forget(uintptr_t lo, uintptr_t hi) {
    std::lock_guard<std::mutex> l(g_mu);
    split(lo);
    split(hi);
    g_segs.erase(g_segs.lower_bound(lo), g_segs.lower_bound(hi));
}

}  // namespace emu::order
