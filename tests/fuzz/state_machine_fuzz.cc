// libFuzzer target: the rendezvous state machine fed a stream of events decoded from the
// input (joins with odd fields and timeouts, reports, keep-alives, stream ends, ticks of a
// fake clock), over a handful of sessions and run ids. After every event the machine's own
// invariants and those visible in what it sends are checked; a violation aborts.
#include <fuzzer/FuzzedDataProvider.h>

#include <cstdint>
#include <cstdio>
#include <algorithm>
#include <cstdlib>
#include <limits>
#include <map>
#include <set>
#include <string>
#include <vector>

#include "muster/rendezvous/limits.h"
#include "muster/rendezvous/state_machine.h"

namespace {

namespace rdzv = muster::rendezvous;
namespace limits = muster::rendezvous::limits;
namespace v1 = muster::v1;
using std::chrono::milliseconds;

[[noreturn]] void violated(const std::string& what) {
  std::fprintf(stderr, "state_machine_fuzz: invariant violated: %s\n", what.c_str());
  std::abort();
}

void require(bool ok, const std::string& what) {
  if (!ok) violated(what);
}

constexpr int kSlots = 6;

std::int64_t odd_duration(FuzzedDataProvider& in) {
  switch (in.ConsumeIntegralInRange(0, 7)) {
    case 0: return 0;
    case 1: return -1;
    case 2: return std::numeric_limits<std::int64_t>::max();
    case 3: return std::numeric_limits<std::int64_t>::min();
    case 4: return 10000000000000;  // seen in the field: "fails at once"
    case 5: return in.ConsumeIntegral<std::int64_t>();
    default: return in.ConsumeIntegralInRange<std::int64_t>(1, 20000);
  }
}

std::string pick_text(FuzzedDataProvider& in, const char* stem) {
  switch (in.ConsumeIntegralInRange(0, 9)) {
    case 0: return "";
    case 1: return "\xff\xfe";
    case 2: return "\xc0\x80";
    case 3: return std::string(limits::kMaxIdBytes + in.ConsumeIntegralInRange(0, 2), 'x');
    case 4: return in.ConsumeRandomLengthString(16);
    default: return std::string(stem) + std::to_string(in.ConsumeIntegralInRange(0, 3));
  }
}

struct Fuzz {
  rdzv::StateMachine sm;
  rdzv::TimePoint now{};
  int gen[kSlots] = {};
  std::set<rdzv::SessionId> closed;       // sessions the machine closed (stream ended)
  std::map<rdzv::SessionId, int> lws;     // local_world_size of each session's last join
  std::map<rdzv::SessionId, std::string> host;
  std::map<rdzv::SessionId, int> round;   // of its last assignment
  std::map<rdzv::SessionId, std::string> prefix_run;  // run of its last assignment
  std::map<std::string, int> last_round;  // per run id, while the run is held

  explicit Fuzz(rdzv::RendezvousTimeouts t) : sm(t) { sm.enable_records(); }

  rdzv::SessionId session(int slot) const { return static_cast<rdzv::SessionId>(slot) * 1000000 + gen[slot] + 1; }

  // The stream of a session the machine closed ends: the server tells the machine, and a
  // new stream (a new id) takes the slot.
  void end_closed_streams(const std::vector<rdzv::Outgoing>& out) {
    for (const rdzv::Outgoing& o : out) {
      if (!o.close) continue;
      closed.insert(o.session);
    }
    for (int slot = 0; slot < kSlots; ++slot) {
      if (closed.count(session(slot))) {
        const rdzv::SessionId ended = session(slot);
        ++gen[slot];
        check(sm.on_stream_closed(ended, now), false);
      }
    }
  }

  // One decision, committed as the server does: the touched runs' records, then the
  // messages (the invariants hold that no record changed without its run touched).
  void check(const rdzv::Decision& d, bool tick) {
    const auto& out = d.messages;
    const rdzv::StateMachine::RecordChanges changes = sm.records(d.touched);
    for (const v1::RunRecord& r : changes.put) {
      require(d.touched.count(r.run_id()) == 1, "a record written for a run not touched");
      require(sm.has_run(r.run_id()), "a record written for a run not held");
    }
    for (const std::string& id : changes.erased) {
      require(!sm.has_run(id), "a record erased for a run still held");
    }
    std::set<rdzv::SessionId> closed_here;
    struct Seat {
      rdzv::SessionId session;
      v1::Assignment a;
    };
    std::map<std::string, std::vector<Seat>> rounds;  // store prefix -> assignments
    bool restarted = false, dropped_for_silence = false;
    for (const rdzv::Outgoing& o : out) {
      require(closed.count(o.session) == 0, "a message to a session already closed");
      require(closed_here.count(o.session) == 0, "a message after the close in one batch");
      if (o.close) {
        closed_here.insert(o.session);
        if (o.status.code() == absl::StatusCode::kUnavailable) dropped_for_silence = true;
        continue;
      }
      require(o.msg.has_value(), "an Outgoing with neither message nor close");
      std::string wire;
      require(o.msg->SerializeToString(&wire), "a ServerMsg that does not serialize");
      require(wire.size() <= limits::kMaxServerMessageBytes, "a ServerMsg over the bound");
      v1::ServerMsg back;
      require(back.ParseFromString(wire), "a ServerMsg an agent cannot parse (UTF-8?)");
      if (o.msg->has_restart()) restarted = true;
      if (o.msg->has_assignment()) {
        rounds[o.msg->assignment().store_prefix()].push_back({o.session, o.msg->assignment()});
      }
    }
    // Ticks alone restart nothing, except by dropping a silent member.
    if (tick) require(!restarted || dropped_for_silence, "a tick restarted a run");
    std::set<rdzv::SessionId> seated;
    for (auto& [prefix, seats] : rounds) {
      const int n = static_cast<int>(seats.size());
      std::vector<const Seat*> by_rank(n, nullptr);
      int world = 0;
      for (const Seat& s : seats) {
        require(seated.insert(s.session).second, "a session in two rounds at once");
        require(s.a.group_world_size() == n, "group_world_size is not the round's size");
        require(s.a.group_rank() >= 0 && s.a.group_rank() < n, "group rank out of range");
        require(by_rank[s.a.group_rank()] == nullptr, "two nodes with one group rank");
        by_rank[s.a.group_rank()] = &s;
        world += lws.at(s.session);
      }
      int offset = 0;
      for (const Seat* s : by_rank) {
        require(s->a.world_size() == world, "world_size is not the sum of local world sizes");
        require(s->a.rank_offset() == offset, "global ranks not contiguous by group rank");
        require(s->a.master_addr() == host.at(by_rank[0]->session), "master is not rank 0");
        require(s->a.round() == seats[0].a.round(), "one round, two numbers");
        offset += lws.at(s->session);
      }
      // The run id is the prefix's first component ("/run/round/").
      const std::string run = prefix.substr(1, prefix.find('/', 1) - 1);
      const int r = seats[0].a.round();
      auto last = last_round.find(run);
      require(last == last_round.end() || r > last->second, "round numbers went back");
      last_round[run] = r;
      for (const Seat& s : seats) {
        auto pr = prefix_run.find(s.session);
        require(pr == prefix_run.end() || pr->second == run, "a session served two runs");
        prefix_run[s.session] = run;
        round[s.session] = r;
      }
    }
    for (auto it = last_round.begin(); it != last_round.end();) {
      it = sm.has_run(it->first) ? std::next(it) : last_round.erase(it);
    }
    if (absl::Status st = sm.check_invariants(); !st.ok()) violated(std::string(st.message()));
    require(sm.num_runs() <= limits::kMaxRuns, "more runs than kMaxRuns");
    for (const v1::RunStatus& s : sm.status("")) {
      std::string wire;
      require(s.SerializeToString(&wire), "a RunStatus that does not serialize");
      v1::RunStatus back;
      require(back.ParseFromString(wire), "a RunStatus a client cannot parse");
      require(s.restart_count() <= s.max_restarts(), "restarts beyond the budget");
      require(s.phase() != "running" ||
                  (s.members_size() >= s.min_nodes() && s.members_size() <= s.max_nodes()),
              "a running round outside min..max");
    }
    end_closed_streams(d.messages);
  }
};

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  FuzzedDataProvider in(data, size);
  rdzv::RendezvousTimeouts t;
  t.join_timeout = milliseconds(in.ConsumeIntegralInRange(0, 20000));
  t.last_call_timeout = milliseconds(in.ConsumeIntegralInRange(0, 5000));
  t.keep_alive_interval = milliseconds(in.ConsumeIntegralInRange(0, 3000));
  t.keep_alive_max_attempt = in.ConsumeIntegralInRange(0, 5);
  t.finished_run_grace = milliseconds(in.ConsumeIntegralInRange(0, 10000));
  Fuzz f(t);
  const char* runs[] = {"a", "b", "c"};

  while (in.remaining_bytes() > 0) {
    const int slot = in.ConsumeIntegralInRange(0, kSlots - 1);
    const rdzv::SessionId s = f.session(slot);
    rdzv::Decision out;
    bool tick = false;
    switch (in.ConsumeIntegralInRange(0, 11)) {
      case 0:
      case 1:
      case 2: {
        v1::AgentMsg m;
        v1::Join* j = m.mutable_join();
        const bool odd = in.ConsumeIntegralInRange(0, 7) == 0;
        j->set_run_id(odd ? pick_text(in, "r") : runs[in.ConsumeIntegralInRange(0, 2)]);
        j->set_node_id(in.ConsumeIntegralInRange(0, 7) == 0 ? pick_text(in, "n")
                                                            : "n" + std::to_string(slot));
        j->set_host(in.ConsumeIntegralInRange(0, 7) == 0 ? pick_text(in, "h")
                                                         : "h" + std::to_string(slot));
        j->set_local_world_size(in.ConsumeIntegralInRange(0, 15) == 0
                                    ? in.ConsumeIntegral<int>()
                                    : in.ConsumeIntegralInRange(1, 4));
        const int min = in.ConsumeIntegralInRange(0, 15) == 0 ? in.ConsumeIntegral<int>()
                                                             : in.ConsumeIntegralInRange(1, 3);
        j->set_min_nodes(min);
        j->set_max_nodes(in.ConsumeIntegralInRange(0, 15) == 0
                             ? in.ConsumeIntegral<int>()
                             : static_cast<int>(std::min<std::int64_t>(
                                   std::int64_t{min} + in.ConsumeIntegralInRange(0, 2),
                                   std::numeric_limits<int>::max())));
        j->set_max_restarts(in.ConsumeIntegralInRange(-1, 3));
        j->set_master_port_candidate(in.ConsumeIntegralInRange(-1, 70000));
        j->set_requested_rank(in.ConsumeIntegralInRange(0, 3) == 0 ? in.ConsumeIntegralInRange(0, 4)
                                                                   : -1);
        if (in.ConsumeBool()) j->set_token(in.ConsumeRandomLengthString(32));
        if (in.ConsumeIntegralInRange(0, 3) == 0) {
          j->set_join_timeout_ms(odd_duration(in));
          j->set_last_call_timeout_ms(odd_duration(in));
          j->set_keep_alive_interval_ms(odd_duration(in));
          j->set_keep_alive_max_attempt(in.ConsumeIntegral<std::int32_t>());
        }
        if (in.ConsumeBool()) j->set_shutdown_timeout_ms(odd_duration(in));
        j->set_in_place(in.ConsumeIntegralInRange(0, 2) == 0);
        if (in.ConsumeIntegralInRange(0, 15) == 0) {
          const std::size_t n = in.ConsumeBool() ? limits::kMaxAgentMessageBytes
                                                 : in.ConsumeIntegralInRange<std::size_t>(0, 64);
          j->GetReflection()->MutableUnknownFields(j)->AddLengthDelimited(99, std::string(n, 'u'));
        }
        f.lws[s] = j->local_world_size();
        f.host[s] = j->host();
        out = f.sm.on_message(s, m, f.now);
        break;
      }
      case 3: {
        v1::AgentMsg m;
        v1::ReportFailure* r = m.mutable_failure();
        r->set_round(in.ConsumeBool() ? f.round[s] : in.ConsumeIntegralInRange(0, 5));
        v1::WorkerFailure* rc = r->mutable_root_cause();
        rc->set_rank(in.ConsumeIntegral<int>());
        rc->set_host(in.ConsumeBool() ? std::string("\xff\xfe host") : f.host[s]);
        rc->set_message(std::string(in.ConsumeIntegralInRange<std::size_t>(0, 20000), 'm') +
                        "\xe2\x82\xac");
        rc->set_traceback(std::string("\xe2\x82\xac") +
                          std::string(in.ConsumeIntegralInRange<std::size_t>(0, 30000), 't'));
        r->set_in_place_fallback(in.ConsumeIntegralInRange(0, 3) == 0);
        const int others = in.ConsumeIntegralInRange(0, 24);
        for (int i = 0; i < others; ++i) {
          r->add_others()->set_message(std::string(in.ConsumeIntegralInRange(0, 2000), 'o'));
        }
        out = f.sm.on_message(s, m, f.now);
        break;
      }
      case 4: {
        v1::AgentMsg m;
        m.mutable_success()->set_round(in.ConsumeBool() ? f.round[s]
                                                        : in.ConsumeIntegralInRange(0, 5));
        out = f.sm.on_message(s, m, f.now);
        break;
      }
      case 5: {
        v1::AgentMsg m;
        m.mutable_keep_alive();
        out = f.sm.on_message(s, m, f.now);
        break;
      }
      case 6:
        out = f.sm.on_stream_closed(s, f.now);
        f.closed.insert(s);  // the agent's stream ended: a new one takes the slot
        ++f.gen[slot];
        break;
      case 7:
        if (in.ConsumeBool()) {
          (void)f.sm.status(in.ConsumeBool() ? "" : runs[in.ConsumeIntegralInRange(0, 2)]);
        } else {
          // In-place recovery's report: this round or another, times fair or not.
          v1::AgentMsg m;
          v1::ReportResumed* r = m.mutable_resumed();
          r->set_round(in.ConsumeBool() ? f.round[s] : in.ConsumeIntegralInRange(0, 5));
          r->set_workers(in.ConsumeIntegralInRange(-1, 4));
          r->set_abort_ms(odd_duration(in));
          r->set_rendezvous_ms(odd_duration(in));
          r->set_reform_ms(odd_duration(in));
          out = f.sm.on_message(s, m, f.now);
        }
        break;
      default: {
        tick = true;
        milliseconds step;
        switch (in.ConsumeIntegralInRange(0, 5)) {
          case 0: step = milliseconds(0); break;
          case 1: step = milliseconds(1); break;
          case 2: step = std::chrono::hours(in.ConsumeIntegralInRange(1, 30)); break;
          case 3: {
            // Straight to the machine's next deadline, where off-by-one bugs live.
            auto next = f.sm.next_deadline();
            step = next && *next > f.now && *next - f.now < std::chrono::hours(24 * 365)
                       ? std::chrono::duration_cast<milliseconds>(*next - f.now) +
                             milliseconds(in.ConsumeIntegralInRange(0, 1))
                       : milliseconds(0);
            break;
          }
          default: step = milliseconds(in.ConsumeIntegralInRange(0, 10000));
        }
        if (f.now.time_since_epoch() < std::chrono::hours(24 * 365 * 10)) f.now += step;
        out = f.sm.on_tick(f.now);
        break;
      }
    }
    f.check(out, tick);
    if (tick) {
      auto next = f.sm.next_deadline();
      require(!next || *next > f.now, "a deadline at or before now after on_tick(now)");
    }
  }
  return 0;
}
